"""Shared builders for tests: a fixed tiny latent set and run configs over the tiny Wan."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml

from distillery.data.demo import LATENT_SHAPE, TEXT_DIM  # noqa: F401


def run_config(
    base: Path,
    data: Path,
    output_dir: Path,
    method: str = "distillery.methods.sft.SFTMethod",
    method_knobs: dict[str, Any] | None = None,
    steps: int = 10,
    batch_size: int = 4,
    lr: float = 1e-3,
    save_every: int = 0,
    callbacks: dict[str, Any] | None = None,
    tracker: str = "none",
    tracking_uri: str | None = None,
) -> dict[str, Any]:
    cfg = {
        "models": {"student": {"_target_": "distillery.models.wan.WanModel", "init_from": str(base)}},
        "method": {"_target_": method, **(method_knobs or {})},
        "training": {
            "data": {"path": str(data), "batch_size": batch_size, "text_max_length": 8},
            "optimizer": {"learning_rate": lr, "weight_decay": 0.0},
            "loop": {"max_train_steps": steps, "seed": 0, "progress_bar": False},
            "checkpoint": {"output_dir": str(output_dir), "save_every": save_every, "keep_last": 0},
            "tracker": {"backend": tracker, **({"tracking_uri": tracking_uri} if tracking_uri else {})},
        },
        "callbacks": callbacks if callbacks is not None else {},
    }
    return cfg


def torchrun_command(nproc: int, folder: Path, *args: str) -> list[str]:
    """Plain ``torchrun --standalone`` on ``nproc`` local ranks running ``args`` (a script, or ``-m module``, and its
    arguments), its own log folder in the test's ``folder`` (torch's default leaves a ``torchelastic_*`` in /tmp)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "--log-dir", str(folder / "torch-logs"), *args]


PLUGINS = Path(__file__).resolve().parent / "plugins"


@contextlib.contextmanager
def plugins_allowed(prefixes: str) -> Iterator[None]:
    """The test plugins (tests/plugins/) importable, and ``prefixes`` (comma-separated module names) allowed as
    `_target_`s, in this process for the duration."""
    sys.path.insert(0, str(PLUGINS))
    previous = os.environ.get("DISTILLERY_ALLOWED_TARGET_PREFIXES")
    os.environ["DISTILLERY_ALLOWED_TARGET_PREFIXES"] = prefixes
    try:
        yield
    finally:
        sys.path.remove(str(PLUGINS))
        if previous is None:
            del os.environ["DISTILLERY_ALLOWED_TARGET_PREFIXES"]
        else:
            os.environ["DISTILLERY_ALLOWED_TARGET_PREFIXES"] = previous


def plugin_env(prefixes: str) -> dict[str, str]:
    """A worker's environment with the test plugins on its path and ``prefixes`` allowed (one OpenMP thread)."""
    return {**os.environ, "PYTHONPATH": f"{PLUGINS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "DISTILLERY_ALLOWED_TARGET_PREFIXES": prefixes, "OMP_NUM_THREADS": "1"}


def write_config(path: Path, cfg: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def fit_in_process(raw: dict[str, Any]):
    """Build and fit one process in this interpreter (a world of one); returns ``(TrainResult, the trainer)`` — its
    models stay in memory."""
    from distillery.components.distributed import init_distributed, shutdown
    from distillery.config import allowed_prefixes, load_run_config
    from distillery.engine.assemble import build_trainer

    config = load_run_config(raw=raw, prefixes=allowed_prefixes())
    env = init_distributed(config.training.distributed)
    try:
        trainer = build_trainer(config, env)
        return trainer.fit(), trainer
    finally:
        shutdown()


def train_in_process(raw: dict[str, Any]):
    """Train one process in this interpreter (a world of one); returns the TrainResult."""
    return fit_in_process(raw)[0]


def role_state(checkpoint: Path, role: str = "student", ema: str | None = None) -> dict[str, torch.Tensor]:
    """The role's transformer weights (or EMA shadow) stored in a checkpoint, as a plain state dict."""
    import json

    from distillery.export.weights import load_role_weights
    from distillery.models.registry import family_of_class

    config = json.loads((checkpoint / "roles" / role / "config.json").read_text())
    module = family_of_class(config.get("_class_name"), "test read").loaders().build_transformer(config)
    load_role_weights(checkpoint, role, module, ema)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def dcp_tensors(checkpoint: Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Every DCP tensor of ``checkpoint`` whose key starts with one of ``prefixes``, read through the safe reader."""
    from distillery.components.checkpoint.dcp_io import load_dcp, read_dcp_metadata

    meta = read_dcp_metadata(checkpoint / "dcp").state_dict_metadata
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items() if k.startswith(prefixes)}
    load_dcp(state, checkpoint / "dcp", "test read")
    return state


def nudge_weights(module: torch.nn.Module, scale: float = 0.02) -> None:
    """Add seeded noise (``scale`` · N(0, 1), seeded by each tensor's size) to every parameter, in
    place: e.g. a critic that differs from the teacher it was copied from, so ``f − r`` is not ~0."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))


def tiny_raw_batch(b: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """A collated batch for the tiny Wan (8 latent channels, 3×8×8 latents, 8×32 prompt embeddings) with a non-zero
    empty-prompt embedding, to tell the conditional and unconditional forwards apart."""
    g = torch.Generator().manual_seed(seed)
    return {"latents": torch.randn(b, 8, 3, 8, 8, generator=g), "text_embeds": torch.randn(b, 8, 32, generator=g),
            "empty_text_embeds": torch.randn(8, 32, generator=g)}


def read_log(output_dir: Path) -> list[dict[str, float]]:
    import json

    return [json.loads(line) for line in (output_dir / "train_log.jsonl").read_text().splitlines() if line.strip()]


def shipped_denoiser(folder: Path, model_kind: dict[str, Any], shift: float = 3.0) -> Any:
    """The exported package's denoiser over ``folder``'s transformer (eval, frozen) for a shipped sampler's
    ``model_kind()``: causal (``chunk_size``), PDD (``pdd_steps``: its ``pdd_heads.safetensors`` beside the weights) or
    plain — what ``DistilledWanPipeline`` builds, at flow ``shift``, in the folder's Wan 2.2 layout (per-token timesteps;
    the second expert in ``transformer_2/`` beside ``transformer/`` or inside it, an artifact's), with the sparse
    attention its ``config.json`` records."""
    from diffusers import WanTransformer3DModel

    from distillery.export.standalone import distilled_causal, distilled_sparse, distilled_wan
    from distillery.models.registry import read_layout

    def load(path: Path) -> Any:
        return WanTransformer3DModel.from_pretrained(path).eval().requires_grad_(False)

    found = read_layout(folder)
    second = None
    if found.experts == 2:
        second = load(next(p for p in (folder / "transformer_2", folder / "transformer" / "transformer_2") if p.is_dir()))
    layout = distilled_wan.WanLayout(found.expand_timesteps, second, found.boundary_ratio)
    transformer = load(folder / "transformer")
    if "chunk_size" in model_kind:
        denoiser = distilled_causal.CausalWanDenoiser(transformer, shift, model_kind["chunk_size"],
                                                      given_first_frame=bool(model_kind.get("given_first_frame", False)),
                                                      layout=layout)
    elif "pdd_steps" in model_kind:
        denoiser = distilled_wan.PDDWanDenoiser(transformer, shift, model_kind["pdd_steps"],
                                                folder / "transformer" / "pdd_heads.safetensors", layout=layout)
    else:
        denoiser = distilled_wan.WanDenoiser(transformer, shift, layout=layout)
    spec = distilled_sparse.folder_spec(folder / "transformer")  # trained sparse: sampled sparse, as the pipeline does
    if spec is not None:
        distilled_sparse.install_sparse(transformer, spec)
    return denoiser


def model_folders_of_the_tiny_base(root: Path, stages: tuple[str, ...] = ("base", "teacher", "pretrain", "distill", "pdd")) -> None:
    """``root/artifacts/<stage>/model/transformer/config.json`` for each of ``stages``: the shipped tiny Wan's, all a
    recipe reads of the folder a role starts from (its family: ``stages/recipes/parts.py``) when a test builds a run
    config without running the stages before it."""
    import shutil

    from distillery.tinybase.shipped import shipped_tiny_base

    for stage in stages:
        folder = root / "artifacts" / stage / "model" / "transformer"
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy2(shipped_tiny_base() / "transformer" / "config.json", folder / "config.json")


def prompt_twin(latent_set: Path, out: Path) -> Path:
    """A prompt-only set with the latent set's rows' ids, captions and text embeddings (and its empty prompt), its
    latent shape in the manifest: what the prompts stage writes, without encoding."""
    import json

    from distillery.data import LatentDataset, PromptRecord, read_text_embeddings, write_empty_prompt_embedding, write_prompt_shard
    from distillery.data.dataset import MANIFEST_FILE, read_empty_prompt_embedding
    from distillery.data.writer import shard_path

    rows = read_text_embeddings(latent_set)
    records = [PromptRecord(id=rows[i]["id"], caption=rows[i]["caption"], text_embedding=rows[i]["text_embedding"].clone(),
                            source="twin") for i in range(len(rows))]
    write_prompt_shard(records, shard_path(out, "train", 0))
    write_empty_prompt_embedding(out, read_empty_prompt_embedding(latent_set))
    shape = list(LatentDataset(latent_set)[0]["latents"].shape)
    (out / MANIFEST_FILE).write_text(json.dumps({"kind": "prompts", "latent_shape": shape, "text_dim": 32,
                                                 "splits": {"train": {"rows": len(records)}}}))
    return out
