"""Before a stage works: can it write its outputs, and is there room for them?

:func:`check_writable` probes each output folder with a real file (root ignores permission bits,
so only a write shows a read-only mount); :func:`check_free_space` compares the free bytes of the
file system with a lower-bound estimate of what the stage writes (:func:`estimate_bytes`), so a
full disk is found before the work, not after it. Both raise a one-line :class:`UserError`.
:func:`disk_error` turns the OSError of a write that failed anyway (ENOSPC, EROFS, ...) into one.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from pathlib import Path

from distillery.errors import UserError
from distillery.pipeline.params import Params
from distillery.pipeline.training_table import TRAINING_STAGES

DISK_ERRNOS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EFBIG: "a file grew past the file system's (or the process's) size limit",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}
MIN_FREE = 16 << 20  # bytes every stage needs at least (logs, manifests, MLflow rows)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def check_writable(folders: list[Path], stage: str) -> None:
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=folder)
            try:
                os.write(fd, b"x")
            finally:
                os.close(fd)
                os.unlink(probe)
        except OSError as exc:
            why = DISK_ERRNOS.get(exc.errno or 0, exc.strerror or type(exc).__name__)
            raise UserError(f"stage {stage}: cannot write to {folder.resolve()}: {why}; nothing was changed") from None


def _tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def _transformer_bytes(model: Path) -> int:
    folder = model / "transformer" if (model / "transformer").is_dir() else model
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def estimate_bytes(stage: str, params: Params, artifacts: Path) -> int:
    """A lower bound of the bytes ``stage`` writes (its artifact, and checkpoints for training)."""
    if stage == "clips":
        c = params.get("clips")
        frames = (c["num_train"] + c["num_validation"]) * c["num_frames"] * c["size"] ** 2 * 3
        return frames // 100  # encoded video of synthetic shapes compresses by far more than 100x
    if stage == "base":
        from distillery.pipeline.data_stages import resolve_base

        return _tree_bytes(resolve_base(params.get("base.path")))
    if stage == "latents":
        c = params.get("clips")
        data = params.get("latents.data")
        count = c["num_train"] + c["num_validation"] if not data else sum(1 for _ in Path(data).rglob("*") if _.is_file()) // 2
        latent = 16 * ((c["num_frames"] - 1) // 4 + 1) * (c["size"] // 8) ** 2 * 4
        return count * latent
    if stage in TRAINING_STAGES:
        spec = TRAINING_STAGES[stage]
        weights = _transformer_bytes(artifacts / spec.inputs[spec.export_role] / "model")
        fp32 = weights * 2 if weights else 0  # lower bound: the init may be bf16; the master weights are fp32
        checkpoint = 3 * fp32  # weights + AdamW's two moments
        return 2 * checkpoint + fp32  # a new checkpoint beside the previous one, and the exported model
    if stage == "export":
        student = params.get("export.student")
        return _tree_bytes(artifacts / "base" / "model") + _transformer_bytes(artifacts / str(student) / "model")
    return 0


def check_free_space(stage: str, params: Params, artifacts: Path) -> None:
    need = estimate_bytes(stage, params, artifacts) + MIN_FREE
    free = shutil.disk_usage(artifacts).free
    if free < need:
        raise UserError(f"stage {stage}: needs at least {human(need)} free in {artifacts.resolve()}, only {human(free)} "
                        f"left; free some space (or move the workspace) and rerun; nothing was changed")


def disk_error(stage: str, exc: OSError) -> UserError | None:
    """A one-line UserError for a write that failed on the disk's account, else None."""
    code, filename = exc.errno, exc.filename
    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list) and exc.args[0]:
        _, dst, message = exc.args[0][0]  # copytree gathers (src, dst, str(error)) triples
        found = re.search(r"\[Errno (\d+)\]", str(message))
        code, filename = (int(found.group(1)) if found else None), dst
    why = DISK_ERRNOS.get(code or 0)
    if why is None:
        return None
    where = f" writing {filename}" if filename else ""
    return UserError(f"stage {stage}: {why}{where}; its partial output was removed and the previous artifacts/{stage} "
                     f"is unchanged; fix the disk and rerun")
