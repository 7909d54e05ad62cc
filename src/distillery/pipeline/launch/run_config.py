"""A training stage's run config: the facts a recipe builds it from, and the checks of the built config
against them.

A recipe (``stages/recipes/<stage>/<method>.py``,
:class:`distillery.pipeline.params.recipes.Recipe`) builds the typed
:class:`~distillery.config.RunConfig` from its stage's typed ``params.yaml`` section and the
:class:`RunInputs` the stage gives it (:func:`run_inputs`): each role's init folder
(``artifacts/<stage>/model``), the data it trains on (``artifacts/<data>/data``, or the set the
recipe made first: :class:`PreparedData`) with what that set's ``preprocess.json`` says of it (the
text encoder's sequence length; for a prompt-only set the ``[C, T, H, W]`` the rollouts generate),
the seed, ``runs/<stage>`` and the MLflow parent run, the layout (HSDP's replicate size, the SP and TP
groups), and a typed view of the other ``params.yaml`` keys the stage's ``dvc.yaml`` entry lists (a
knob of another stage it borrows). The stage builds it once; :func:`check_run_config` then checks it against its inputs
before anything launches, and the stage writes it as ``runs/<stage>/run.yaml``
(:mod:`distillery.pipeline.launch.run_folder`), which the trainer loads once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distillery.common.errors import UserError
from distillery.common.fsutil import read_json_file
from distillery.pipeline.params.reader import ParamsView, StageParams
from distillery.pipeline.params.schema import DATA_ARTIFACT
from distillery.pipeline.publish.artifacts import ARTIFACTS, RUNS

if TYPE_CHECKING:
    from distillery.config import RunConfig

EXPORT_ROLE = "student"  # the role whose trained weights a training stage's artifact ships (model/transformer)
EMA_CALLBACK = "ema"  # the run config's callbacks.<name> of the stage's EMA (params.yaml <stage>.ema_decay set)


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


@dataclass(frozen=True)
class PreparedData:
    """A data set a recipe makes before training (``pretrain.method: ode_init``: the teacher's ODE
    trajectories): the ``folder`` the run trains on, the ``name`` it goes by (its resume-key input,
    its folder in the artifact) and the artifacts it was ``made_from`` (lineage and resume-key
    inputs)."""

    folder: Path
    name: str
    made_from: dict[str, Path] = field(default_factory=dict)


@dataclass(frozen=True)
class RunInputs:
    """What a training stage hands its recipe beside its typed section (module doc)."""

    stage: str
    init: dict[str, str]  # role -> the model folder it starts from (artifacts/<stage>/model)
    data: str  # the folder of latent (or prompt) shards the run trains on
    text_max_length: int  # the data's prompt-embedding length (its preprocess.json)
    latent_shape: list[int] | None  # [C, T, H, W] the rollouts generate on a prompt-only set (None: the latents')
    seed: int
    output_dir: str  # runs/<stage>: its checkpoints, log and summary
    parent_run_id: str  # the pipeline's MLflow run
    replicate_size: int  # HSDP: copies of each trained model (gpus.replicate_size)
    sp_size: int  # ranks a sample's tokens split over (<stage>.sp_size, else gpus.sp_size)
    tp_size: int  # ranks each block splits over (<stage>.tp_size, else gpus.tp_size)
    params: ParamsView  # the other params.yaml keys the stage's dvc.yaml entry lists, typed


def run_inputs(stage: str, inputs: dict[str, str], data: Path, params: StageParams, parent_run_id: str) -> RunInputs:
    """The :class:`RunInputs` of training stage ``stage``: ``inputs`` (role → the stage it starts from,
    the recipe's), the set it trains on in ``data``."""
    manifest = latent_manifest(data)
    typed = params.typed
    shape = manifest.get("latent_shape") if manifest.get("kind") == "prompts" else None  # the prompts stage derived it
    return RunInputs(stage=stage, init={role: str(ARTIFACTS / source / "model") for role, source in inputs.items()},
                     data=str(data), text_max_length=manifest["settings"]["max_sequence_length"],
                     latent_shape=None if shape is None else [int(v) for v in shape], seed=typed.seed,
                     output_dir=str(RUNS / stage), parent_run_id=parent_run_id, replicate_size=typed.gpus.replicate_size,
                     **getattr(typed, stage).layout(typed.gpus), params=typed)


def check_image_conditioning(stage: str, tdir: Path, spec: Any, latents: dict[str, Any], data: Path) -> None:
    """An image-to-video model (``spec``: its family's ``image_conditioning``, None for text-to-video)
    trains only on latents that carry its first frames — the condition's channels and, when it takes
    them, the image embeddings' width (the manifest's ``image_conditioning``); one
    :class:`UserError` line otherwise, before anything is launched."""
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


def check_run_config(stage: str, config: "RunConfig", inputs: dict[str, str]) -> None:
    """Before any training: the roles fit the method, the method fits the data, and each role's init
    model (``inputs``: role → the stage it starts from) fits the data — one :class:`UserError` line
    otherwise, nothing launched."""
    from distillery.engine.batches import check_data_kind
    from distillery.engine.builder import check_roles_early
    from distillery.models.registry import family_of

    check_data_kind(config)  # a method that reads video latents on a prompt-only set: one line, nothing launched
    check_roles_early(config)
    latents = latent_manifest(Path(config.training.data.path))
    for role in inputs:
        init_from = config.models[role].config.init_from
        loaders = family_of(init_from).loaders()  # a folder of no registered family: one line
        tdir, _ = loaders.locate_transformer(init_from)
        channels, text_dim = loaders.input_widths(json.loads((tdir / "config.json").read_text()))
        if channels != latents["latent_channels"]:
            raise UserError(f"stage {stage}: the model in {tdir} takes {channels} latent channels, "
                            f"the latents have {latents['latent_channels']}; preprocess with this model's VAE")
        if text_dim != latents["text_dim"]:
            raise UserError(f"stage {stage}: the model in {tdir} takes text_dim {text_dim}, the latents' "
                            f"prompt embeddings have {latents['text_dim']}; preprocess with this model's text encoder")
        image = loaders.image_conditioning(json.loads((tdir / "config.json").read_text()))
        check_image_conditioning(stage, tdir, image, latents, Path(config.training.data.path))
        check_given_frame_layout(stage, image, getattr(config.models[role].config, "chunk_size", None), latents)


def check_given_frame_layout(stage: str, image: Any, chunk_size: int | None, latents: dict[str, Any]) -> None:
    """A causal image-to-video model (``image`` set, ``chunk_size`` not None: its latent frame 0 is the
    given frame, then chunks of ``chunk_size``) trains only on clips of ``1 + k · chunk_size``
    latent frames (the manifest's ``latent_shape``); one :class:`UserError` line otherwise, before
    anything is launched."""
    from distillery.models.base import given_frame_layout_problem

    shape = latents.get("latent_shape")
    if image is None or chunk_size is None or not isinstance(shape, list) or len(shape) != 4:
        return
    problem = given_frame_layout_problem(int(shape[1]), int(chunk_size))
    if problem:
        raise UserError(f"stage {stage}: {problem}; change clips.num_frames (latents.num_frames) or the chunk_size")
