"""Which checkpoint a run may load (docs/reliability.md).

- ``resume: latest``: the newest checkpoint of the run's own output folder whose checksums verify
  (:mod:`distillery.components.checkpoint.checksums`); each damaged newer one is skipped with one warning
  line naming it and its first bad file; none intact → step 0, said so.
- ``resume: <path>``: inside the run's output folder, or granted on the command line
  (``distillery train --allow-checkpoint PATH``, repeatable, or ``DISTILLERY_ALLOWED_CHECKPOINTS=a:b``),
  never by the config file; and it must verify. Otherwise a one-line UserError, no fallback.
- Checkpoints of the old pickled format (``state.pt``, ``rng/rank-*.pt``) are refused, unread.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from distillery.common.errors import UserError
from distillery.common.log import get_logger
from distillery.components.checkpoint import record as checkpoint_record
from distillery.components.checkpoint.checksums import Damage, verify_checkpoint

log = get_logger("checkpoint")

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
ENV_CHECKPOINTS = "DISTILLERY_ALLOWED_CHECKPOINTS"
_granted: tuple[Path, ...] = ()  # set by the command line (distillery.cli.train --allow-checkpoint)


def _cut(value: object, limit: int = 160) -> str:
    text = str(value)
    return text if len(text) <= limit else "…" + text[-(limit - 1):]


def grant_checkpoints(paths: Iterable[str | Path]) -> None:
    """Grant these checkpoint folders (or folders holding checkpoints) for this process; replaces
    earlier grants. Called by the command line only: a config file can never grant a checkpoint."""
    global _granted
    _granted = tuple(Path(p).expanduser() for p in paths if str(p).strip())


def allowed_checkpoints() -> tuple[Path, ...]:
    """Granted checkpoint paths: ``DISTILLERY_ALLOWED_CHECKPOINTS`` (``os.pathsep``-separated) and the command line."""
    env = [Path(p).expanduser() for p in os.environ.get(ENV_CHECKPOINTS, "").split(os.pathsep) if p.strip()]
    return tuple(dict.fromkeys(p.resolve() for p in (*env, *_granted)))


def _within(path: Path, root: Path) -> bool:
    path, root = path.resolve(), root.resolve()
    return path == root or root in path.parents


def is_old_format(path: Path) -> bool:
    """A checkpoint written before checksums existed: pickled ``state.pt`` / ``rng/rank-*.pt``."""
    return (path / "state.pt").exists() or any((path / "rng").glob("rank-*.pt"))


def old_format_error(path: Path, output_dir: Path | None = None) -> UserError:
    fix = f"delete {_cut(output_dir)} and retrain from step 0" if output_dir else "retrain it with this version of distillery"
    return UserError(f"{_cut(path)}: checkpoint in the old pickled format (state.pt), which is never loaded since "
                     f"unpickling it could run code; {fix}")


def resolve_resume(resume: str, output_dir: Path, verified: dict[Path, Damage | None] | None = None) -> Path | None:
    """The checkpoint to resume from for ``resume`` = "latest" | "none" | a path (rank 0 only).

    ``latest``: the newest intact checkpoint of ``output_dir`` among those its record says this folder's
    runs wrote (:mod:`distillery.components.checkpoint.record`; others are reported and left alone);
    each damaged newer one is reported
    in one warning line and skipped; ``None`` (step 0, said so) when none is intact.
    A path: inside ``output_dir``, or granted (:func:`allowed_checkpoints`); it must verify —
    otherwise a :class:`UserError` (no fallback). Old-format checkpoints raise a UserError.
    ``verified`` caches verification results by folder.
    """
    cache = verified if verified is not None else {}

    def check(path: Path) -> Damage | None:
        if path not in cache:
            cache[path] = verify_checkpoint(path)
        return cache[path]

    output_dir = Path(output_dir)
    if resume == "none":
        return None
    if resume == "latest":
        candidates, foreign = [], []
        if output_dir.is_dir():
            ours = checkpoint_record.written(output_dir)
            for child in output_dir.iterdir():
                if (m := CHECKPOINT_RE.match(child.name)) and child.is_dir() and not child.is_symlink():
                    (candidates if child.name in ours else foreign).append((int(m.group(1)), child))
            candidates.sort(reverse=True)
            checkpoint_record.report_foreign(output_dir, [p.name for _, p in sorted(foreign)])
        damaged: list[tuple[Path, Damage]] = []
        chosen = None
        for _, path in candidates:
            if is_old_format(path):
                raise old_format_error(path, output_dir)
            damage = check(path)
            if damage is None:
                chosen = path
                break
            damaged.append((path, damage))
        for path, damage in damaged:
            then = f"falling back to {chosen.name}" if chosen else f"no intact checkpoint left in {_cut(output_dir)}: starting from step 0"
            log.warning("checkpoint %s is damaged (%s); %s", _cut(path), damage, then)
        return chosen
    path = Path(resume).expanduser()
    where = "config error: training.checkpoint.resume"
    if not _within(path, output_dir) and not any(_within(path, granted) for granted in allowed_checkpoints()):
        raise UserError(f"{where}: {_cut(path)} is outside this run's output folder {_cut(output_dir)}; a checkpoint from "
                        f"elsewhere loads only when granted on the command line: --allow-checkpoint {_cut(path)} "
                        f"(or {ENV_CHECKPOINTS})")
    require_intact(path, where, "not loaded", check)
    return path


def require_intact(path: Path, where: str, outcome: str, check=verify_checkpoint) -> None:
    """Raise a one-line UserError unless ``path`` is a complete checkpoint of the current format
    whose files pass their checksums (``check`` returns None); ``where`` prefixes the message and
    ``outcome`` says what was not done ("not loaded", "not exported")."""
    if not (path / "metadata.json").is_file():
        raise UserError(f"{where}: {_cut(path)} is not a complete checkpoint (no metadata.json)")
    if is_old_format(path):
        raise old_format_error(path)
    damage = check(path)
    if damage is not None:
        raise UserError(f"{where}: {_cut(path)} fails verification ({damage}); {outcome}")
