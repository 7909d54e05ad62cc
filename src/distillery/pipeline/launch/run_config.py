"""A training stage's run config: its template in ``stages/`` filled in by its table row.

:func:`fill_run_config` reads the template and sets dotted keys to the typed params' Python values
through the config loader (:func:`distillery.config.loader.set_override`: every key must exist in the
schema; the values are checked when the config is built), in this order:

1. inputs: ``models.<role>.init_from = artifacts/<stage>/model`` per row ``inputs``;
2. the data: ``training.data.path = artifacts/<data>/data`` (the latents stage's set, or — ``distill.data:
   prompts`` — the prompts stage's) and ``training.data.text_max_length`` from its ``preprocess.json`` (the text
   encoder's sequence length); a prompt-only set also gives ``training.data.latent_shape`` (the ``[C, T, H, W]`` its
   stage derived from the frames, size and the base's VAE: what the rollouts generate);
3. the knobs: ``<config key> = params.yaml[<knob>]`` for each knob the recipe takes, the config key the knob's
   own declaration names (:meth:`TrainingStageSpec.config_overrides`); ``models.<role>.lora`` with
   ``<stage>.lora_rank`` above 0 (:meth:`TrainingStageSpec.lora_overrides`); and
   ``training.distributed.replicate_size = gpus.replicate_size`` when > 1 (HSDP; every role's mesh);
4. the EMA: with ``<stage>.ema_decay`` set, a ``callbacks.ema`` entry (:meth:`TrainingStageSpec.ema_callback`:
   decay, start step, the exported role) beside the template's callbacks; with it null, none;
5. the run: ``training.checkpoint.output_dir = runs/<stage>`` and MLflow
   ``training.tracker.{parent_run_id, run_name, tags}`` (``training.loop.progress_bar`` keeps its default,
   on: under DVC or Prefect, stderr is not a terminal and progress is a log line per 10 % or minute,
   :mod:`distillery.common.progress`).

The result is the raw mapping written to ``runs/<stage>/run.yaml`` (and hashed into the resume key).
:func:`check_chain` then builds it, once — the typed :class:`~distillery.config.RunConfig` the stage reads from
then on — and checks it against its inputs before any training.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distillery.common.errors import UserError
from distillery.common.fsutil import read_json_file
from distillery.pipeline.launch.training_table import DATA_ARTIFACT, EMA_CALLBACK, TrainingStageSpec
from distillery.pipeline.params.reader import StageParams
from distillery.pipeline.publish.artifacts import ARTIFACTS, RUNS

if TYPE_CHECKING:
    from distillery.config import RunConfig


def data_dir(artifact: str = DATA_ARTIFACT) -> Path:
    return ARTIFACTS / artifact / "data"


def latent_manifest(folder: Path | None = None) -> dict[str, Any]:
    """The latents stage's ``preprocess.json`` in ``folder`` (default: the pipeline's latent set):
    its settings (frames, size, fps, sequence length, ...), shapes and counts."""
    path = (folder if folder is not None else data_dir()) / "preprocess.json"
    try:
        manifest = read_json_file(path, 64 << 20)  # a FIFO or a device there never blocks the stage
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: unreadable ({getattr(exc, 'strerror', None) or exc}); rerun the latents stage") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("settings"), dict):
        raise UserError(f"{path}: no preprocessing settings; rerun the latents stage")
    return manifest


def stage_overrides(spec: TrainingStageSpec, params: StageParams, parent_run_id: str,
                    data: Path | None = None) -> list[tuple[str, Any]]:
    """The ``(dotted key, value)`` pairs that turn the template into the stage's run config (module doc);
    ``data``: the set the stage trains on when it is not the latent set (its trajectories)."""
    latents = latent_manifest(data if data is not None else data_dir(spec.data))
    pairs: list[tuple[str, Any]] = [(f"models.{role}.init_from", str(ARTIFACTS / stage / "model"))
                                    for role, stage in spec.inputs.items()]
    pairs += [("training.data.path", str(data if data is not None else data_dir(spec.data))),
              ("training.data.text_max_length", latents["settings"]["max_sequence_length"])]
    if latents.get("kind") == "prompts":  # no latents to read the shape from: the one the prompts stage derived
        pairs += [("training.data.latent_shape", [int(v) for v in latents["latent_shape"]])]
    pairs += spec.config_overrides(params)
    pairs += spec.lora_overrides(params)  # <stage>.lora_rank > 0: the exported role trains a LoRA adapter
    if params.get("gpus.replicate_size") > 1:  # HSDP over the launch's ranks (1, the default: the template's FSDP)
        pairs += [("training.distributed.replicate_size", params.get("gpus.replicate_size"))]
    pairs += [("training.checkpoint.output_dir", str(RUNS / spec.name)),
              ("training.tracker.parent_run_id", parent_run_id),
              ("training.tracker.run_name", spec.name),
              ("training.tracker.tags", {"distillery.stage": spec.name})]
    return pairs


def fill_run_config(spec: TrainingStageSpec, params: StageParams, parent_run_id: str,
                    data: Path | None = None) -> dict[str, Any]:
    """The stage's run config as a raw mapping: template + :func:`stage_overrides`, each value set as
    the Python value it is (an override naming a key the schema lacks is a UserError); ``data``: the set it
    trains on when not the latent set."""
    from distillery.config import allowed_prefixes
    from distillery.config.loader import read_yaml, set_override

    if spec.variant_key is not None:
        raise ValueError(f"stage {spec.name}: fill the resolved spec (TrainingStageSpec.resolve)")
    raw = read_yaml(spec.template)
    prefixes = allowed_prefixes()
    ema = spec.ema_callback(params)
    if ema is not None:
        callbacks = raw.setdefault("callbacks", {}) or {}
        if EMA_CALLBACK in callbacks:  # a template's own EMA would be silently replaced
            raise ValueError(f"{spec.template}: callbacks.{EMA_CALLBACK} is the stage's (params.yaml {spec.name}.ema_decay)")
        raw["callbacks"] = {**callbacks, EMA_CALLBACK: ema}
    for key, value in stage_overrides(spec, params, parent_run_id, data):
        set_override(raw, key, value, prefixes)
    return raw


def check_image_conditioning(stage: str, tdir: Path, spec: Any, latents: dict[str, Any], data: Path) -> None:
    """An image-to-video model (``spec``: its family's ``image_conditioning``, None for text-to-video) trains only on
    latents that carry its first frames — the condition's channels and, when it takes them, the image embeddings' width
    (the manifest's ``image_conditioning``); one :class:`UserError` line otherwise, before anything is launched."""
    if spec is None:
        return
    recorded = latents.get("image_conditioning")
    if not isinstance(recorded, dict):
        raise UserError(f"stage {stage}: the model in {tdir} is image-to-video, but the latents in {data} have no first "
                        "frames; make them with the latents stage from an image-to-video base (base.path)")
    shape, embedding = recorded.get("first_frame_shape") or [None], recorded.get("image_embedding_shape")
    if shape[0] != spec.condition_channels:
        raise UserError(f"stage {stage}: the model in {tdir} takes a first-frame condition of {spec.condition_channels} "
                        f"channels, the latents in {data} have {shape[0]}; preprocess with this model's base")
    if spec.image_dim is not None and (not embedding or embedding[-1] != spec.image_dim):
        raise UserError(f"stage {stage}: the model in {tdir} takes image embeddings of width {spec.image_dim}, the latents "
                        f"in {data} have {'none' if not embedding else embedding[-1]}; preprocess with this model's base")


def check_chain(spec: TrainingStageSpec, raw: dict[str, Any]) -> "RunConfig":
    """Before any training: the config builds, the roles fit the method, and each role's init model fits the data.
    Returns the built config (the stage's one build of it: what it reads of its run config from then on)."""
    from distillery.config import allowed_prefixes, load_run_config
    from distillery.engine.batches import check_data_kind
    from distillery.engine.builder import check_roles_early
    from distillery.models.registry import family_of

    config = load_run_config(raw=raw, prefixes=allowed_prefixes())
    check_data_kind(config)  # a method that reads video latents on a prompt-only set: one line, nothing launched
    check_roles_early(config)
    latents = latent_manifest(Path(config.training.data.path))
    for role in spec.inputs:
        init_from = config.models[role].config.init_from
        loaders = family_of(init_from).loaders()  # a folder of no registered family: one line
        tdir, _ = loaders.locate_transformer(init_from)
        channels, text_dim = loaders.input_widths(json.loads((tdir / "config.json").read_text()))
        if channels != latents["latent_channels"]:
            raise UserError(f"stage {spec.name}: the model in {tdir} takes {channels} latent channels, "
                            f"the latents have {latents['latent_channels']}; preprocess with this model's VAE")
        if text_dim != latents["text_dim"]:
            raise UserError(f"stage {spec.name}: the model in {tdir} takes text_dim {text_dim}, the latents' "
                            f"prompt embeddings have {latents['text_dim']}; preprocess with this model's text encoder")
        image = loaders.image_conditioning(json.loads((tdir / "config.json").read_text()))
        check_image_conditioning(spec.name, tdir, image, latents, Path(config.training.data.path))
        check_given_frame_layout(spec.name, image, getattr(config.models[role].config, "chunk_size", None), latents)
    return config


def check_given_frame_layout(stage: str, image: Any, chunk_size: int | None, latents: dict[str, Any]) -> None:
    """A causal image-to-video model (``image`` set, ``chunk_size`` not None: its latent frame 0 is the given frame,
    then chunks of ``chunk_size``) trains only on clips of ``1 + k · chunk_size`` latent frames (the manifest's
    ``latent_shape``); one :class:`UserError` line otherwise, before anything is launched."""
    from distillery.models.base import given_frame_layout_problem

    shape = latents.get("latent_shape")
    if image is None or chunk_size is None or not isinstance(shape, list) or len(shape) != 4:
        return
    problem = given_frame_layout_problem(int(shape[1]), int(chunk_size))
    if problem:
        raise UserError(f"stage {stage}: {problem}; change clips.num_frames (latents.num_frames) or the chunk_size")
