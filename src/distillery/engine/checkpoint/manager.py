"""DCP checkpoints for crash resume: ``<output_dir>/checkpoint-<step>/``.

Layout of one checkpoint::

    checkpoint-<step>/
      dcp/                      # torch.distributed.checkpoint: trainable weights, optimizer states,
                                # callback tensors (EMA) — sharded, reshardable on load
      roles/<role>/config.json  # each trainable role's transformer architecture (for export)
      state.json                # rank-independent host state: step, LR schedulers, data position, MLflow run
      rng/rank-<r>.json         # per-rank RNG: python, numpy, torch CPU/CUDA, the method generator
      rng/rank-<r>.safetensors  #   (its tensors; see distillery.engine.checkpoint.host_state)
      checksums.json            # size + sha256 of every file above (distillery.engine.checkpoint.checksums)
      metadata.json             # summary (step, world size, roles, time, tracking run) + digest of checksums.json

It is written into ``.tmp-checkpoint-<step>/`` and renamed when complete, so a crash mid-save
never leaves a checkpoint that looks complete; ``metadata.json`` is written last.

Trust (DESIGN.md §2.2): nothing in a checkpoint is unpickled by us (host and RNG state are JSON +
safetensors, :mod:`distillery.engine.checkpoint.host_state`; DCP is read through :mod:`distillery.engine.checkpoint.dcp_io`).
Which checkpoint a run resumes — verified, falling back past damaged ones, granted when outside the
run's folder, never of the old pickled format — is decided by :mod:`distillery.engine.checkpoint.trust`.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from distillery.engine.checkpoint.checksums import Damage, FileDigest, hash_files, write_checksums
from distillery.engine.checkpoint.dcp_io import load_dcp
from distillery.engine.checkpoint.host_state import read_state, write_state
from distillery.engine.checkpoint.trust import CHECKPOINT_RE, is_old_format, old_format_error, resolve_resume
from distillery.engine.distributed import barrier, broadcast_object
from distillery.errors import UserError
from distillery.log import get_logger

log = get_logger("checkpoint")

FORMAT = 2  # metadata.json "format": 2 = JSON/safetensors state + checksums (1 = pickled state.pt, refused)


class RoleState(Stateful):
    """DCP view of one trainable role: its (sharded) transformer and optimizer."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.module = module
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        optimizers = [self.optimizer] if self.optimizer is not None else []
        model_sd, optim_sd = get_state_dict(self.module, optimizers)
        out = {"model": model_sd}
        if self.optimizer is not None:
            out["optim"] = optim_sd
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        optimizers = [self.optimizer] if self.optimizer is not None else []
        set_state_dict(
            self.module,
            optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state.get("optim", {}),
            options=StateDictOptions(strict=True),
        )


class CallbackState(Stateful):
    """DCP view of a callback's tensor state (e.g. EMA shadow weights)."""

    def __init__(self, callback: Any) -> None:
        self.callback = callback

    def state_dict(self) -> dict[str, Any]:
        return self.callback.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.callback.load_state_dict(state)


def capture_rng(method_state: dict[str, Any]) -> dict[str, Any]:
    """Every RNG this process uses, plus the method's generator state."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "method": method_state,
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> dict[str, Any]:
    """Restore the process RNGs; return the method's saved state for the method to load."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    return state["method"]


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (those with ``metadata.json``) in ``output_dir``, oldest first."""
    found = []
    if output_dir.is_dir():
        for child in output_dir.iterdir():
            m = CHECKPOINT_RE.match(child.name)
            if m and (child / "metadata.json").is_file():
                found.append((int(m.group(1)), child))
    return sorted(found)


@dataclass
class CheckpointPayload:
    """Everything a checkpoint holds, as the trainer hands it over."""

    dcp_state: dict[str, Stateful]  # "role.<role>" → RoleState, "callback.<name>" → CallbackState
    host_state: dict[str, Any]  # step, schedulers, data position (same on every rank)
    rng_state: dict[str, Any]  # this rank's RNGs
    role_configs: dict[str, dict[str, Any]]  # trainable role → transformer config.json content
    metadata: dict[str, Any]  # extra human-readable facts


class CheckpointManager:
    def __init__(self, output_dir: str | Path, keep_last: int, rank: int, world_size: int) -> None:
        self.output_dir = Path(output_dir)
        self.keep_last = keep_last
        self.rank = rank
        self.world_size = world_size
        self._verified: dict[Path, Damage | None] = {}  # rank 0: verification results of this process

    def save(self, step: int, payload: CheckpointPayload) -> Path:
        """Collective: every rank calls it. Returns the final checkpoint folder.

        Each rank writes its DCP shards and RNG files and hashes them; rank 0 writes the rest,
        hashes it, writes ``checksums.json`` then ``metadata.json`` and renames the folder.
        """
        final = self.output_dir / f"checkpoint-{step}"
        tmp = self.output_dir / f".tmp-checkpoint-{step}"
        if self.rank == 0:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / "rng").mkdir(parents=True)
        barrier()
        started = time.perf_counter()
        dcp.save(payload.dcp_state, checkpoint_id=str(tmp / "dcp"))
        mine = [p.relative_to(tmp).as_posix() for p in write_state(tmp / "rng", f"rank-{self.rank}", payload.rng_state)]
        mine += [f"dcp/{p.name}" for p in (tmp / "dcp").glob(f"__{self.rank}_*.distcp")]
        digests = _gather_to_main({rel: (d.size, d.sha256) for rel, d in hash_files(tmp, mine).items()})
        if self.rank == 0:
            for role, cfg in payload.role_configs.items():
                role_dir = tmp / "roles" / role
                role_dir.mkdir(parents=True)
                (role_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
            write_state(tmp, "state", payload.host_state)
            known = {rel: FileDigest(size, sha) for part in digests for rel, (size, sha) in part.items()}
            meta = {
                "step": step,
                "world_size": self.world_size,
                "roles": sorted(payload.role_configs),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                **payload.metadata,
                "format": FORMAT,
                "checksums": write_checksums(tmp, known),
            }
            (tmp / "metadata.json").write_text(json.dumps(meta, indent=2, default=str))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            self._verified.pop(final, None)
            self._prune()
        barrier()
        log.info("saved %s in %.1f s", final, time.perf_counter() - started)
        return final

    def _prune(self) -> None:
        for child in self.output_dir.glob(".tmp-checkpoint-*"):
            shutil.rmtree(child, ignore_errors=True)
        if self.keep_last:
            for _, path in list_checkpoints(self.output_dir)[: -self.keep_last]:
                shutil.rmtree(path, ignore_errors=True)

    def load(self, path: Path, payload: CheckpointPayload) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load into ``payload.dcp_state`` in place; return (host state, this rank's RNG state).

        Collective. ``path`` comes from :meth:`resume_path` (verified). A rank the checkpoint has no
        RNG file for (resumed on more ranks than saved) gets rank 0's. Raises a UserError when the
        checkpoint's roles or architectures differ from this run's, or its state does not load.
        """
        if is_old_format(path):
            raise old_format_error(path, self.output_dir)
        meta = json.loads((path / "metadata.json").read_text())
        saved_roles = set(meta.get("roles", []))
        if saved_roles != set(payload.role_configs):
            raise UserError(
                f"{path}: checkpoint holds trainable roles {sorted(saved_roles)}, this run trains {sorted(payload.role_configs)}"
            )
        for role, cfg in payload.role_configs.items():
            saved = json.loads((path / "roles" / role / "config.json").read_text())
            current = json.loads(json.dumps(cfg, sort_keys=True, default=str))
            diff = sorted(k for k in set(saved) | set(current) if not k.startswith("_") and saved.get(k) != current.get(k))
            if diff:
                k = diff[0]
                raise UserError(
                    f"{path}: checkpoint is from a different model for role {role}: {k}={saved.get(k)!r} there, {current.get(k)!r} here"
                )
        load_dcp(payload.dcp_state, path / "dcp", "its weights, optimizer and callback states")
        host = read_state(path, "state")
        stem = f"rank-{self.rank}"
        rng = read_state(path / "rng", stem if (path / "rng" / f"{stem}.json").is_file() else "rank-0")
        host["saved_world_size"] = int(meta.get("world_size", self.world_size))
        return host, rng

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


def _gather_to_main(obj: Any) -> list[Any]:
    """Every rank's ``obj`` on rank 0 (in rank order); ``[]`` on the other ranks."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out or []
    return [obj]
