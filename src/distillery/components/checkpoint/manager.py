"""DCP checkpoints for crash resume: ``<output_dir>/checkpoint-<step>/``.

Layout of one checkpoint::

    checkpoint-<step>/
      dcp/                      # torch.distributed.checkpoint, tensors only (components.checkpoint.stateful):
                                #   roles.<role>.<module>  trainable modules (sharded, reshardable; a LoRA role: the adapter only)
                                #   optimizers.<role>      AdamW moments + step per parameter
                                #   schedulers.<role>      LR schedule position and rates
                                #   shadows.<name>         a method's shadow weights (its target networks)
                                #   method.*               the method's stream and own state
                                #   trainer                step, data position
                                #   callbacks.<name>       callback tensors (EMA shadow weights)
      roles/<role>/config.json  # each trainable role's transformer architecture (for export)
      rng/rank-<r>.json         # per-rank process RNGs: python, numpy, torch CPU/CUDA (+ the method's host state)
      rng/rank-<r>.safetensors  #   (its tensors; see distillery.components.checkpoint.host_state)
      checksums.json            # size + sha256 of every file above, and the digest of metadata.json's
                                # values (distillery.components.checkpoint.checksums)
      metadata.json             # step, world size, trainable roles, frozen roles' sources (path +
                                # sha256, not saved), LoRA roles' adapter spec + base ("lora", when any),
                                # method, MLflow run, time + digest of checksums.json

It is written into ``.tmp-checkpoint-<step>/`` and renamed when complete, so a crash mid-save
never leaves a checkpoint that looks complete; ``metadata.json`` is written last.

Trust (docs/reliability.md): nothing in a checkpoint is unpickled by us (DCP items are tensors; RNG state
is JSON + safetensors, :mod:`distillery.components.checkpoint.host_state`; DCP is read through
:mod:`distillery.components.checkpoint.dcp_io`, which refuses anything but DCP's own metadata classes).
Which checkpoint a run resumes — verified, falling back past damaged ones, granted when outside the
run's folder, never of the old pickled format — is decided by :mod:`distillery.components.checkpoint.trust`.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.stateful import Stateful

from distillery.common.diskerrors import DISK_ERRNOS, DiskProblem, disk_problem
from distillery.common.errors import UserError
from distillery.common.fsutil import human_bytes, read_json_file
from distillery.common.log import get_logger
from distillery.components.checkpoint import record as checkpoint_record
from distillery.components.checkpoint.checksums import Damage, FileDigest, hash_files, read_metadata, write_checksums
from distillery.components.checkpoint.dcp_io import load_dcp, read_dcp_metadata
from distillery.components.checkpoint.host_state import read_state, write_state
from distillery.components.checkpoint.stateful import ModuleState, OptimizerState
from distillery.components.checkpoint.trust import CHECKPOINT_RE, is_old_format, old_format_error, resolve_resume
from distillery.components.distributed import barrier, broadcast_object

log = get_logger("checkpoint")

FORMAT = 3  # metadata.json "format": 3 = all training state in DCP by the method's keys (2: role.<role> keys + state.json; 1: pickled state.pt; both refused)


METHOD_HOST_KEY = "method_host"  # the method's per-rank host state inside rng/rank-<r> (TrainingMethod.host_state)


def capture_rng() -> dict[str, Any]:
    """Every process-level RNG of this rank (the method's stream is in DCP: ``method.rng``)."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore the process RNGs :func:`capture_rng` captured."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def check_resume_lora(path: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """A :class:`UserError` unless the checkpoint ``path`` trained the same adapters (roles, spec) on the same bases
    (sha256) as this run: an adapter means nothing on another base."""
    if set(saved) != set(current):
        raise UserError(f"{path}: checkpoint trained LoRA adapters on roles {sorted(saved)}, this run on {sorted(current)}; "
                        "start from step 0 (resume: none) or set models.<role>.lora as it was")
    for role in sorted(saved):
        was, now = saved[role], current[role]
        for key in sorted(k for k in set(was) | set(now) if k != "base"):
            if was.get(key) != now.get(key):
                raise UserError(f"{path}: the {role}'s LoRA {key} was {was.get(key)!r}, this run's is {now.get(key)!r}; "
                                "start from step 0 (resume: none) or set it back")
        base_was, base_now = was.get("base") or {}, now.get("base") or {}
        if base_was.get("sha256") != base_now.get("sha256") or _second_changed(base_was, base_now):
            raise UserError(f"{path}: the {role}'s LoRA base changed since this checkpoint was saved ({base_was.get('path')} "
                            f"sha256 {str(base_was.get('sha256'))[:12]}…, now {base_now.get('path')} "
                            f"{str(base_now.get('sha256'))[:12]}…); an adapter fits only its base: start from step 0 "
                            "(resume: none) or restore it")


def _second_changed(was: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether a two-expert source's second expert (``second``: its folder and sha256, Wan 2.2 A14B's ``transformer_2``
    beside ``transformer``) differs; a source of one expert, or recorded before the key existed, has none to compare."""
    a, b = was.get("second"), now.get("second")
    return isinstance(a, dict) and isinstance(b, dict) and a.get("sha256") != b.get("sha256")


def check_frozen_roles(path: Path, saved: dict[str, Any], current: dict[str, dict[str, Any]]) -> None:
    """A UserError unless the frozen roles (teacher, ...) are the ones the checkpoint trained against."""
    for role in sorted(set(saved) | set(current)):
        was, now = saved.get(role), current.get(role)
        if was is None or now is None:
            raise UserError(f"{path}: checkpoint trained with frozen roles {sorted(saved)}, this run has {sorted(current)}; "
                            "start from step 0 (resume: none) or restore the roles")
        if was.get("sha256") != now.get("sha256") or _second_changed(was, now):
            raise UserError(f"{path}: the frozen {role} changed since this checkpoint was saved ({was.get('path')} "
                            f"sha256 {str(was.get('sha256'))[:12]}…, now {now.get('path')} {str(now.get('sha256'))[:12]}…); "
                            "not resuming against another model: start from step 0 (resume: none) or restore it")


def read_role_config(path: Path, role: str) -> dict[str, Any]:
    """``roles/<role>/config.json`` of the checkpoint ``path`` (bounded read); a one-line UserError
    when it is missing, not a regular file, too deep or not a JSON object."""
    where = path / "roles" / role / "config.json"
    try:
        config = read_json_file(where, 1 << 20)
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: roles/{role}/config.json is unreadable ({getattr(exc, 'strerror', None) or exc}); "
                        "not loaded") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}: roles/{role}/config.json is not a JSON object; not loaded")
    return config


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (those with ``metadata.json``) in ``output_dir`` that its record says a run
    of this folder wrote (:mod:`distillery.components.checkpoint.record`), oldest first; a complete one
    the record does not name is left out, said once in a warning line."""
    output_dir = Path(output_dir)
    found, foreign = [], []
    if output_dir.is_dir():
        ours = checkpoint_record.written(output_dir)
        for child in output_dir.iterdir():
            m = CHECKPOINT_RE.match(child.name)
            if m and not child.is_symlink() and (child / "metadata.json").is_file():
                (found if child.name in ours else foreign).append((int(m.group(1)), child))
    checkpoint_record.report_foreign(output_dir, [p.name for _, p in sorted(foreign)])
    return sorted(found)


SPLIT_BYTES = 1 << 30  # a rank's state above this is written (and hashed) as several files, one per thread
MAX_WRITER_THREADS = 8


def state_bytes(state: dict[str, Any]) -> int:
    """Bytes of this rank's module parameters and buffers in ``state`` (its :class:`ModuleState` items;
    a DTensor counts its local shard) — a lower bound of what it writes (optimizer moments come on top),
    taken without building any state dict."""
    total = 0
    for item in state.values():
        if isinstance(item, ModuleState):
            for t in [*item.module.parameters(), *item.module.buffers()]:
                local = getattr(t, "_local_tensor", t)
                total += local.numel() * local.element_size()
    return total


def writer_threads(state: Any) -> int:
    """DCP file-writer threads for this rank: 1 for a small state (one ``__<rank>_0.distcp``), else up to
    :data:`MAX_WRITER_THREADS`, the machine's cores shared among the node's ranks — each thread writes its
    own ``__<rank>_<i>.distcp`` and the checksums hash them in parallel (a 1.3B role's fp32 weights and
    AdamW moments are 17 GB: one file was written and hashed by one thread, 29–51 s on the H200 machine)."""
    if state_bytes(state) < SPLIT_BYTES:
        return 1
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(MAX_WRITER_THREADS, (os.cpu_count() or 1) // max(1, local_ranks)))


@dataclass
class CheckpointPayload:
    """Everything a checkpoint holds, as the trainer hands it over."""

    dcp_state: dict[str, Stateful]  # the method's (roles.*, optimizers.*, schedulers.*, method.*) + the
                                    # trainer's (trainer: step, data position) + callbacks.<name>
    rng_state: dict[str, Any]  # this rank's process RNGs (+ the method's host state under METHOD_HOST_KEY)
    role_configs: dict[str, dict[str, Any]]  # trainable role → transformer config.json content
    frozen_roles: dict[str, dict[str, Any]]  # frozen role → its source (path, sha256): not saved, checked on resume
    metadata: dict[str, Any]  # extra human-readable facts (method, MLflow run)


class CheckpointManager:
    def __init__(self, output_dir: str | Path, keep_last: int, rank: int, world_size: int) -> None:
        self.output_dir = Path(output_dir)
        self.keep_last = keep_last
        self.keep: set[int] = set()  # steps whose checkpoints keep_last never prunes (e.g. the one a run selects)
        self.rank = rank
        self.world_size = world_size
        self._verified: dict[Path, Damage | None] = {}  # rank 0: verification results of this process

    def save(self, step: int, payload: CheckpointPayload) -> Path:
        """Collective: every rank calls it. Returns the final checkpoint folder.

        Each rank writes its DCP shards and RNG files and hashes them; rank 0 writes the rest,
        hashes it, writes ``checksums.json`` then ``metadata.json`` and renames the folder.
        """
        try:
            return self._save(step, payload)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            last = list_checkpoints(self.output_dir)
            need = _tree_bytes(last[-1][1]) if last else state_bytes(payload.dcp_state) * self.world_size
            try:
                free = shutil.disk_usage(self.output_dir).free
            except OSError:
                free = -1
            problem = disk_problem(exc)
            if problem is None and 0 <= free < need:  # torch.save's zip writer hides ENOSPC ("unexpected pos 704 vs 598")
                problem = DiskProblem(DISK_ERRNOS[errno.ENOSPC], errno.ENOSPC, None)
            if problem is None:
                raise
            raise self._disk_full(step, problem, last, need, free) from None

    def _disk_full(self, step: int, problem: DiskProblem, last: list[tuple[int, Path]], need: int, free: int) -> UserError:
        """The one line for a checkpoint the disk could not hold (``need``: bytes of the last complete checkpoint
        or, without one, of this rank's weights × ranks; ``free``: bytes free when it failed); this save's partial
        folder is removed (rank 0) so the space it took is free again; the last complete checkpoint stays as it was."""
        if self.rank == 0:
            shutil.rmtree(self.output_dir / f".tmp-checkpoint-{step}", ignore_errors=True)
        kept = f"{last[-1][1].name} is intact and resumes" if last else "no earlier checkpoint: a rerun starts at step 0"
        return UserError(f"checkpoint-{step}: {problem.why}{problem.where()} ({self.output_dir}: a checkpoint needs about "
                         f"{human_bytes(need)}, {human_bytes(free) if free >= 0 else 'unknown'} free); {kept}: free space and rerun")

    def _save(self, step: int, payload: CheckpointPayload) -> Path:
        final = self.output_dir / f"checkpoint-{step}"
        tmp = self.output_dir / f".tmp-checkpoint-{step}"
        if self.rank == 0:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / "rng").mkdir(parents=True)
        barrier()
        started = time.perf_counter()
        dcp.save(payload.dcp_state, storage_writer=FileSystemWriter(str(tmp / "dcp"), thread_count=writer_threads(payload.dcp_state)))
        mine = [p.relative_to(tmp).as_posix() for p in write_state(tmp / "rng", f"rank-{self.rank}", payload.rng_state)]
        mine += [f"dcp/{p.name}" for p in (tmp / "dcp").glob(f"__{self.rank}_*.distcp")]
        digests = _gather_to_main({rel: (d.size, d.sha256) for rel, d in hash_files(tmp, mine).items()})
        if self.rank == 0:
            for role, cfg in payload.role_configs.items():
                role_dir = tmp / "roles" / role
                role_dir.mkdir(parents=True)
                (role_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
            known = {rel: FileDigest(size, sha) for part in digests for rel, (size, sha) in part.items()}
            meta = json.loads(json.dumps({  # the values as metadata.json will read back (their digest is in checksums.json)
                "step": step,
                "world_size": self.world_size,
                "roles": sorted(payload.role_configs),
                "frozen_roles": payload.frozen_roles,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                **payload.metadata,
                "format": FORMAT,
            }, default=str))
            meta["checksums"] = write_checksums(tmp, known, metadata=meta)
            (tmp / "metadata.json").write_text(json.dumps(meta, indent=2))
            ours = checkpoint_record.written(self.output_dir)
            if final.is_symlink() or (final.exists() and final.name not in ours):
                raise UserError(f"{final} exists and was not written by a run of this folder: not replaced; move it "
                                "away (or choose another training.checkpoint.output_dir) and rerun")
            checkpoint_record.add(self.output_dir, final.name)  # before the rename: a complete one is never unrecorded
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            self._verified.pop(final, None)
            self._prune()
        barrier()
        log.info("saved %s in %.1f s", final, time.perf_counter() - started)
        return final

    def _prune(self) -> None:
        """Delete killed saves' temp folders and, beyond ``keep_last``, this folder's oldest recorded
        checkpoints (those of :attr:`keep` aside) — never a folder the record does not name, never through a link."""
        for child in self.output_dir.glob(".tmp-checkpoint-*"):
            if CHECKPOINT_RE.match(child.name[len(".tmp-"):]) and child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
        if self.keep_last:
            old = [(step, path) for step, path in list_checkpoints(self.output_dir)[: -self.keep_last] if step not in self.keep]
            for _, path in old:
                shutil.rmtree(path, ignore_errors=True)
            checkpoint_record.forget(self.output_dir, {path.name for _, path in old if not path.exists()})

    def load(self, path: Path, payload: CheckpointPayload) -> dict[str, Any]:
        """Load into ``payload.dcp_state`` in place and restore this rank's process RNGs; return the
        checkpoint's ``metadata.json`` (plus ``saved_world_size``).

        Collective. ``path`` comes from :meth:`resume_path` (verified). A rank the checkpoint has no
        RNG file for (resumed on more ranks than saved) gets rank 0's. Raises a UserError when the
        checkpoint's format, trainable roles, architectures or frozen roles' sources differ from
        this run's, or its state does not load.
        """
        if is_old_format(path):
            raise old_format_error(path, self.output_dir)
        meta, damage = read_metadata(path)
        if damage is not None:  # verified by resume_path; changed since
            raise UserError(f"{path}: {damage}; not loaded")
        if meta.get("format", 0) < FORMAT:
            raise UserError(f"{path}: a checkpoint of an older distillery (format {meta.get('format')}, this one reads "
                            f"{FORMAT}); export it with that version, or start this run from step 0 (resume: none)")
        saved_roles = set(meta.get("roles", []))
        if saved_roles != set(payload.role_configs):
            raise UserError(
                f"{path}: checkpoint holds trainable roles {sorted(saved_roles)}, this run trains {sorted(payload.role_configs)}"
            )
        for role, cfg in payload.role_configs.items():
            saved = read_role_config(path, role)
            current = json.loads(json.dumps(cfg, sort_keys=True, default=str))
            diff = sorted(k for k in set(saved) | set(current) if not k.startswith("_") and saved.get(k) != current.get(k))
            if diff:
                k = diff[0]
                raise UserError(
                    f"{path}: checkpoint is from a different model for role {role}: {k}={saved.get(k)!r} there, {current.get(k)!r} here"
                )
        check_frozen_roles(path, meta.get("frozen_roles", {}), payload.frozen_roles)
        check_resume_lora(path, meta.get("lora") or {}, payload.metadata.get("lora") or {})
        keys = set(read_dcp_metadata(path / "dcp").state_dict_metadata)
        for key, state in payload.dcp_state.items():
            if isinstance(state, OptimizerState):
                state.expect(keys, key)
        load_dcp(payload.dcp_state, path / "dcp", "its weights, optimizer, schedule and callback states")
        stem = f"rank-{self.rank}"
        own = (path / "rng" / f"{stem}.json").is_file()
        state = read_state(path / "rng", stem if own else "rank-0")
        restore_rng(state)
        meta["saved_world_size"] = meta.get("world_size", self.world_size)
        meta["method_host_state"] = state.get(METHOD_HOST_KEY) if own else None  # another rank's is not this one's
        return meta

    def resume_path(self, resume: str) -> Path | None:
        """Rank 0 decides (and verifies) which checkpoint to resume from; every rank gets the same
        answer, or the same one-line UserError (no rank hangs)."""
        path, problem, failure = None, None, None
        if self.rank == 0:
            try:
                path = resolve_resume(resume, self.output_dir, self._verified)
            except UserError as exc:
                problem = str(exc)
            except Exception as exc:  # a bug or an OS failure: rank 0 raises it, the others must not wait
                failure = exc
        path, problem, failed = broadcast_object((path, problem, failure is not None))  # type: ignore[misc]
        if failure is not None:
            raise failure
        if failed:
            raise RuntimeError("rank 0 failed while choosing the checkpoint to resume from (see its error)")
        if problem:
            raise UserError(problem)
        return path


def _tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def _gather_to_main(obj: Any) -> list[Any]:
    """Every rank's ``obj`` on rank 0 (in rank order); ``[]`` on the other ranks."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out or []
    return [obj]
