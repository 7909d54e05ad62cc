"""Where a pipeline stage that runs in its own process (latents, validate) puts its models."""

from __future__ import annotations

from distillery.common.errors import UserError


def stage_device(setting: str, nproc_per_node: int, key: str) -> str:
    """``params.yaml`` ``key`` (``auto``, ``cpu``, ``cuda`` or ``cuda:N``) → a torch device string.

    ``auto``: the first GPU when ``gpus.nproc_per_node`` ≥ 1 and CUDA is available, else the CPU.
    A CUDA device that is not there is a one-line :class:`UserError` naming ``key``."""
    import torch

    if setting == "auto":
        return "cuda" if nproc_per_node >= 1 and torch.cuda.is_available() else "cpu"
    if setting.startswith("cuda"):
        index = int(setting.partition(":")[2] or 0)
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise UserError(f"params.yaml: {key}: {setting}, but this machine has "
                            f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'} CUDA device(s); "
                            "use auto or cpu")
    return setting
