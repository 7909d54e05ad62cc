"""``distillery import-weights FILE --like MODEL --out DIR [--key NAME]``: a published Wan 2.1 checkpoint in the
original key layout (the Self-Forcing repository's ``ode_init.pt``, a ``torch.save`` of a state dict) as a
diffusers model folder that any ``init_from`` (and so a stage's init) takes.

``--like`` names the diffusers Wan folder whose transformer architecture the file must match (its
``transformer/config.json``; its ``scheduler/`` is copied beside the weights). The file is read with
``weights_only=True`` only and converted strictly (:mod:`distillery.models.wan.original_layout`); the folder
is written to a temporary sibling and renamed, never over an existing folder, with ``imported_from.json``
(the file, its sha256, the entry read, the tensor count).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path


def add_command(sub: argparse._SubParsersAction, name: str, help: str) -> None:  # noqa: A002
    """``import-weights`` on the top-level subparsers."""
    cmd = sub.add_parser(name, help=help)
    cmd.add_argument("file", help="the published checkpoint (.pt/.pth, original Wan key layout)")
    cmd.add_argument("--like", required=True, help="a diffusers Wan folder of the same architecture (its transformer "
                     "config is the target; its scheduler is copied)")
    cmd.add_argument("--out", required=True, help="the model folder to write (must not exist)")
    cmd.add_argument("--key", default=None, help="the file's entry holding the weights (default: the tensors at its "
                     "top level, else the first of generator_ema, generator, model, state_dict, module)")
    cmd.set_defaults(func=_import_weights)


def import_weights(file: str | Path, like: str | Path, out: str | Path, key: str | None = None) -> Path:
    """Convert ``file`` into the diffusers model folder ``out`` (module doc); returns ``out``."""
    import torch
    from safetensors.torch import save_file

    from distillery.common.errors import UserError
    from distillery.common.fsutil import follow_umask
    from distillery.models.wan.common import build_transformer, locate_transformer
    from distillery.models.wan.original_layout import read_published, to_diffusers

    file, out = Path(file), Path(out)
    if out.exists() or out.is_symlink():
        raise UserError(f"--out {out} exists: name a new folder (nothing is written over an existing one)")
    transformer_dir, scheduler_dir = locate_transformer(like)
    config = json.loads((transformer_dir / "config.json").read_text())
    with torch.device("meta"):
        expected = {k: v.shape for k, v in build_transformer(config).state_dict().items()}
    original, where = read_published(file, key)
    weights = {k: v.contiguous() for k, v in to_diffusers(original, expected, str(file)).items()}
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        (tmp / "transformer").mkdir(parents=True)
        save_file(weights, str(tmp / "transformer" / "diffusion_pytorch_model.safetensors"))
        shutil.copy2(transformer_dir / "config.json", tmp / "transformer" / "config.json")
        if scheduler_dir is not None:
            shutil.copytree(scheduler_dir, tmp / "scheduler")
        record = {"file": str(file.resolve()), "sha256": _sha256(file), "entry": where, "tensors": len(weights),
                  "like": str(Path(like).resolve())}
        (tmp / "imported_from.json").write_text(json.dumps(record, indent=2) + "\n")
        follow_umask(tmp)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _import_weights(args: argparse.Namespace) -> int:
    out = import_weights(args.file, args.like, args.out, args.key)
    sys.stdout.write(f"wrote {out} (from {args.file})\n")
    return 0
