"""Model families: which plugin package loads a folder's transformer.

A model family is one package of model plugins, ``distillery.models.<family>`` (``models/wan/``: Wan
2.1 and 2.2), for the diffusers transformer classes it declares. :data:`FAMILIES` is the one table of them:
a family's name, the ``_class_name`` values it loads, the folder layout it claims and its package. A
folder's family is read from the folder itself (:func:`transformer_class`): the ``_class_name`` of its
transformer's ``config.json`` (``<folder>/transformer/config.json``, or ``<folder>/config.json`` for a
transformer folder, e.g. an artifact's ``model/transformer``), else the ``transformer`` entry of its
``model_index.json`` (``["diffusers", "<class>"]``). Every Wan version's transformer is a
``WanTransformer3DModel``, so the class alone does not tell them apart: :func:`read_layout` reads the rest
(:class:`FolderLayout`: ``model_index.json``'s ``transformer_2`` and ``boundary_ratio`` — two experts,
Wan 2.2 A14B —, its ``expand_timesteps`` and the VAE's ``z_dim`` — Wan 2.2 TI2V-5B's 48-channel VAE
with per-token timesteps), and a row claims a class *and* a layout; a Wan 2.2 folder with one expert
missing, or a layout no row claims, is one line (:class:`UserError`). The variant within the family (bidirectional,
causal, PDD) is not the folder's: it is what the sampling contract asks
(``Sampler.model_options()``, from the artifact's ``sampling.json``), passed on to the family's
:func:`load_inference_model`.

Callers outside ``models/`` — the stages, validate, export, the exported ``pipeline.py`` — reach a
family only through this module (:func:`family_of`, :func:`locate_transformer`,
:func:`load_inference_model`, or :meth:`ModelFamily.loaders` for the rest of
:class:`FamilyLoaders`), so a new family is a package and a row here (CONTRIBUTING.md, "Adding a
model"). A folder of a class no family loads is one line (:class:`UserError`) naming the class and
the registered families. The table imports nothing: a family's package is imported when a folder of
it is loaded.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from distillery.common.errors import UserError

if TYPE_CHECKING:
    import torch

    from distillery.models.base import ModelBase


class FamilyLoaders(Protocol):
    """What a family's package exports (its ``__init__``), by these names (a test checks every family)."""

    HEAD_BANK_FILE: str  # the PDD head bank's file name beside a transformer's weights (export, load_inference_model)
    MODEL_CLASSES: dict[str, type]  # student kind (STUDENT_KINDS) -> the family's plugin class the recipes build; a kind
    # the family refuses (ModelFamily.refused_kinds) is absent

    def locate_transformer(self, folder: str | Path) -> tuple[Path, Path | None]:
        """``(transformer folder, scheduler folder or None)`` of a model or transformer folder (:class:`UserError`
        when it holds no transformer of the family)."""

    def load_inference_model(self, folder: str | Path, device: Any = "cpu", dtype: Any = None, shift: float | None = None,
                             role: str = "inference", transformer: Any = None, **options: Any) -> "ModelBase":
        """A frozen, eval plugin over ``folder``'s transformer on ``device`` in ``dtype``; ``options``:
        ``Sampler.model_options()`` (``chunk_size``: a causal model, ``pdd_steps``: a PDD student);
        ``transformer``: wrap this already loaded module of ``folder``; ``shift`` None: the scheduler's."""

    def build_transformer(self, config: dict[str, Any]) -> "torch.nn.Module":
        """The transformer of a ``config.json`` mapping, random weights (export loads a checkpoint into it)."""

    def input_widths(self, config: dict[str, Any]) -> tuple[int | None, int | None]:
        """``(latent channels, text embedding width)`` a transformer of ``config`` takes."""

    def image_conditioning(self, config: dict[str, Any]) -> Any:
        """How a transformer of ``config`` is conditioned on a first frame (image-to-video: the condition's channels,
        the image encoder's width), or None for text-to-video."""

    def empty_head_bank(self, transformer: "torch.nn.Module", num_heads: int) -> "torch.nn.Module":
        """A PDD head bank of ``num_heads`` heads shaped for ``transformer`` (a checkpoint's ``heads`` load into it)."""

    def save_head_bank(self, path: Path, bank: "torch.nn.Module") -> None:
        """Write ``bank`` to ``path`` (the ``HEAD_BANK_FILE`` that ``load_inference_model(pdd_steps=...)`` reads)."""

    def lay_out_given_model(self, folder: Path, model_dir: Path, copy: Any) -> None:
        """Lay ``folder``'s transformer out in ``model_dir`` as a trained artifact of the family holds it (every expert,
        the folder's layout recorded in the transformer): what a given-model stage publishes; ``copy(source, target)``
        copies one folder."""


LOADER_NAMES = ("HEAD_BANK_FILE", "MODEL_CLASSES", "locate_transformer", "load_inference_model", "build_transformer", "input_widths",
                "image_conditioning", "empty_head_bank", "save_head_bank", "lay_out_given_model")  # FamilyLoaders' members


#: The kinds of model plugin a recipe builds (a family's ``MODEL_CLASSES`` keys): full attention (a teacher, a critic,
#: an SFT'd or DMD2 student), block-causal over frame chunks with a KV cache (DFSFT, ODE init, Self-Forcing), a trunk
#: with a PDD head bank.
STUDENT_KINDS = ("bidirectional", "causal", "pdd")
#: Why no causal (block-causal, KV-cached) HunyuanVideo 1.5 student is built: its blocks are dual-stream — the prompt's
#: tokens attend to every video token and are modulated by the sample's one timestep — so a chunk's prompt states would
#: depend on later frames, and frames at other noise levels (a causal student's chunks) get one modulation.
HUNYUAN15_CAUSAL_REFUSAL = (
    "a causal HunyuanVideo 1.5 student is not built: its dual-stream blocks let the prompt's tokens attend to every "
    "video token (a chunk would depend on later frames) and modulate a sample with one timestep (a causal student's "
    "chunks sit at different noise levels); train a bidirectional student (DMD2, PDD)")


@dataclass(frozen=True)
class FolderLayout:
    """What tells model families of one transformer class apart, read from a folder (:func:`read_layout`).

    ``experts``: 2 when the folder's pipeline has a second transformer (``transformer_2``, the low-noise
    expert of Wan 2.2 A14B, for timesteps below ``boundary_ratio · 1000``), else 1; ``expand_timesteps``:
    the pipeline feeds the transformer one timestep per token (Wan 2.2 TI2V-5B); ``vae_z_dim``: the
    VAE's latent channels (None: no ``vae/config.json``, e.g. a trained artifact's ``model/``); ``pipeline_class``:
    ``model_index.json``'s ``_class_name`` (the class of a ``["module", "Class"]`` custom pipeline; None: no index)."""

    experts: int = 1
    boundary_ratio: float | None = None
    expand_timesteps: bool = False
    vae_z_dim: int | None = None
    pipeline_class: str | None = None


@dataclass(frozen=True)
class ModelFamily:
    """One model family: ``name`` (shown in errors and lineage), the diffusers transformer classes
    (``_class_name``) its plugins load, and ``package``: the dotted module exporting its
    :class:`FamilyLoaders`; ``experts``, ``expand_timesteps``, ``vae_z_dim`` (None: any), ``refused_vae_z_dims`` and
    ``pipeline_classes`` (the ``model_index.json`` pipelines it loads; empty: any): the :class:`FolderLayout` it claims
    (families sharing a class differ there); ``sparse_attention``: its plugins train and sample block-sparse
    self-attention (``models.<role>.attention: sparse``, ``<stage>.attention: sparse``); ``refused_kinds``: ``(kind, why)``
    of each :data:`STUDENT_KINDS` kind it builds no plugin of (read without importing the family: what a stage's preflight
    refuses a recipe with)."""

    name: str
    transformer_classes: tuple[str, ...]
    package: str
    experts: int = 1
    expand_timesteps: bool = False
    vae_z_dim: int | None = None
    refused_vae_z_dims: tuple[int, ...] = ()
    pipeline_classes: tuple[str, ...] = ()
    sparse_attention: bool = False
    refused_kinds: tuple[tuple[str, str], ...] = ()

    def loaders(self) -> FamilyLoaders:
        """The family's package (imported now), typed as its loaders."""
        return cast(FamilyLoaders, importlib.import_module(self.package))

    def refusal(self, kind: str) -> str | None:
        """Why the family builds no ``kind`` model (one line, for a :class:`UserError`), None when it builds one."""
        return dict(self.refused_kinds).get(kind)

    def model_class(self, kind: str) -> type:
        """The family's plugin class of ``kind`` (:data:`STUDENT_KINDS`: its package's ``MODEL_CLASSES``); a
        :class:`UserError` line for a kind it refuses (:meth:`refusal`)."""
        if kind not in STUDENT_KINDS:
            raise ValueError(f"model kind {kind!r}; expected one of {', '.join(STUDENT_KINDS)}")
        why = self.refusal(kind)
        if why is not None:
            raise UserError(f"a {self.name} model: {why}")
        return self.loaders().MODEL_CLASSES[kind]

    def claims(self, layout: FolderLayout) -> bool:
        """Whether a folder of this ``layout`` is this family's (a layout without a VAE: any ``vae_z_dim``)."""
        return (layout.experts == self.experts and layout.expand_timesteps == self.expand_timesteps
                and (self.vae_z_dim is None or layout.vae_z_dim is None or layout.vae_z_dim == self.vae_z_dim)
                and layout.vae_z_dim not in self.refused_vae_z_dims
                and (not self.pipeline_classes or layout.pipeline_class is None or layout.pipeline_class in self.pipeline_classes))


WAN22_VAE_Z_DIM = 48  # Wan 2.2's VAE (TI2V-5B's): 48 latent channels, 16x spatial (a patchify 2 in it)

FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("wan2.1", ("WanTransformer3DModel",), "distillery.models.wan", refused_vae_z_dims=(WAN22_VAE_Z_DIM,),
                sparse_attention=True),
    ModelFamily("wan2.2-ti2v-5b", ("WanTransformer3DModel",), "distillery.models.wan", expand_timesteps=True,
                vae_z_dim=WAN22_VAE_Z_DIM, sparse_attention=True),
    ModelFamily("wan2.2-a14b", ("WanTransformer3DModel",), "distillery.models.wan", experts=2,
                refused_vae_z_dims=(WAN22_VAE_Z_DIM,)),  # A14B's VAE is Wan 2.1's; no sparse attention on two experts
    # Cosmos Predict 2.5 (text-to-world); Cosmos 1.0 and Predict 2 share the transformer class, not the pipeline
    ModelFamily("cosmos-predict2.5", ("CosmosTransformer3DModel",), "distillery.models.cosmos",
                pipeline_classes=("Cosmos2_5_PredictBasePipeline",)),
    # HunyuanVideo 1.5 (text-to-video); its image-to-video pipeline shares the transformer class
    ModelFamily("hunyuanvideo1.5", ("HunyuanVideo15Transformer3DModel",), "distillery.models.hunyuan15",
                pipeline_classes=("HunyuanVideo15Pipeline",), refused_kinds=(("causal", HUNYUAN15_CAUSAL_REFUSAL),)),
)


def registered() -> str:
    """The registered families as one phrase: ``wan2.1 (WanTransformer3DModel), ...``."""
    return ", ".join(f"{f.name} ({', '.join(f.transformer_classes)})" for f in FAMILIES)


def _describe(layout: FolderLayout, pipeline: bool = False) -> str:
    """The layout in words; ``pipeline``: with its pipeline class (where a family of the class claims by it)."""
    return (f"{layout.experts} expert(s), expand_timesteps {str(layout.expand_timesteps).lower()}, "
            f"VAE z_dim {layout.vae_z_dim if layout.vae_z_dim is not None else 'unknown'}"
            + (f", pipeline {layout.pipeline_class}" if pipeline and layout.pipeline_class is not None else ""))


def family_of_class(class_name: Any, where: str, layout: FolderLayout | None = None) -> ModelFamily:
    """The family that loads transformer class ``class_name`` in ``layout`` (None: a lone transformer's,
    one expert, no per-token timesteps); ``where`` names what declared it (a file) in the one-line
    :class:`UserError` when no family does."""
    layout = layout if layout is not None else FolderLayout()
    known = [family for family in FAMILIES if class_name in family.transformer_classes]
    for family in known:
        if family.claims(layout):
            return family
    if known:
        by_pipeline = any(f.pipeline_classes for f in known)
        raise UserError(f"{where}: a {class_name} model of an unknown layout ({_describe(layout, by_pipeline)}); the registered "
                        f"families of that class: {', '.join(f.name for f in known)}")
    raise UserError(f"{where}: a {class_name!r} transformer; no registered model family loads it "
                    f"(registered: {registered()}; CONTRIBUTING.md, \"Adding a model\")")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc.msg})") from None
    except OSError as exc:
        raise UserError(f"{path}: unreadable ({exc.strerror or type(exc).__name__})") from None


def transformer_class(folder: str | Path) -> tuple[Any, Path]:
    """``(class name, the file that names it)`` of ``folder``'s transformer (module doc: its
    ``config.json``'s ``_class_name``, else ``model_index.json``'s ``transformer`` entry).
    :class:`UserError` when the folder is missing or names no transformer."""
    root = Path(folder).expanduser()
    if not root.exists():
        raise UserError(f"model folder {root} does not exist")
    for cfg in (root / "transformer" / "config.json", root / "config.json"):
        if cfg.is_file():
            data = _read_json(cfg)
            if isinstance(data, dict) and "_class_name" in data:
                return data["_class_name"], cfg
    index = root / "model_index.json"
    if index.is_file():
        data = _read_json(index)
        entry = data.get("transformer") if isinstance(data, dict) else None
        if isinstance(entry, list) and len(entry) == 2:
            return entry[1], index
    raise UserError(f"{root}: no transformer/config.json or config.json with a _class_name found; expected a diffusers "
                    "model folder or a transformer folder")


def _pipeline_root(folder: Path) -> Path | None:
    """The model folder whose ``model_index.json`` describes ``folder``: itself, or — ``folder`` a transformer
    folder — its parent (None: neither has one)."""
    for root in (folder, folder.parent):
        if (root / "model_index.json").is_file():
            return root
    return None


def read_layout(folder: str | Path) -> FolderLayout:
    """The :class:`FolderLayout` of a model folder (or of the model folder a transformer folder sits in).

    A one-line :class:`UserError` for a folder whose experts do not add up: ``model_index.json`` names a
    ``transformer_2`` and there is no ``transformer_2/config.json``, a ``boundary_ratio`` without a second
    expert (or a second expert without one), a ``boundary_ratio`` outside (0, 1)."""
    path = Path(folder).expanduser()
    root = _pipeline_root(path)
    if root is None:
        return _trained_layout(path)
    index_file = root / "model_index.json"
    index = _read_json(index_file)
    if not isinstance(index, dict):
        raise UserError(f"{index_file}: not a JSON object")
    second = index.get("transformer_2")
    names_second = isinstance(second, list) and len(second) == 2 and second[1] is not None
    ratio = index.get("boundary_ratio")
    has_second = (root / "transformer_2" / "config.json").is_file()
    if names_second and not has_second:
        raise UserError(f"{index_file}: names a second expert (transformer_2) but {root / 'transformer_2'} holds no "
                        "config.json; a Wan 2.2 A14B folder needs both experts (transformer/ and transformer_2/)")
    if ratio is not None and not names_second:
        raise UserError(f"{index_file}: boundary_ratio {ratio} but no second expert (transformer_2 is null); a Wan 2.2 "
                        "A14B folder needs both experts, a one-transformer folder no boundary_ratio")
    if names_second and ratio is None:
        raise UserError(f"{index_file}: a second expert (transformer_2) but no boundary_ratio: which timesteps each "
                        "expert denoises is unknown")
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio < 1):
        raise UserError(f"{index_file}: boundary_ratio {ratio!r}; expected a number in (0, 1)")
    expand = index.get("expand_timesteps", False)
    if not isinstance(expand, bool):
        raise UserError(f"{index_file}: expand_timesteps {expand!r}; expected true or false")
    z_dim = None
    vae_config = root / "vae" / "config.json"
    if vae_config.is_file():
        vae = _read_json(vae_config)
        z_dim = vae.get("z_dim") if isinstance(vae, dict) else None
        z_dim = int(z_dim) if isinstance(z_dim, int) and not isinstance(z_dim, bool) else None
    pipeline = index.get("_class_name")
    if isinstance(pipeline, list) and len(pipeline) == 2:  # a custom pipeline: ["module", "Class"]
        pipeline = pipeline[1]
    return FolderLayout(experts=2 if names_second else 1, boundary_ratio=float(ratio) if ratio is not None else None,
                        expand_timesteps=expand, vae_z_dim=z_dim, pipeline_class=pipeline if isinstance(pipeline, str) else None)


def _trained_layout(folder: Path) -> FolderLayout:
    """The layout a trained Wan transformer keeps in its ``config.json`` (``_wan_layout``:
    :mod:`distillery.models.wan.experts`; an artifact's ``model/`` has no ``model_index.json``); Wan 2.1's without."""
    for cfg in (folder / "transformer" / "config.json", folder / "config.json"):
        if cfg.is_file():
            data = _read_json(cfg)
            own = data.get("_wan_layout") if isinstance(data, dict) else None
            if isinstance(own, dict):
                ratio = own.get("boundary_ratio")
                return FolderLayout(experts=2 if ratio is not None else 1, boundary_ratio=ratio,
                                    expand_timesteps=bool(own.get("expand_timesteps", False)))
            break
    return FolderLayout()


def family_of(folder: str | Path) -> ModelFamily:
    """The registered family of ``folder``'s transformer and layout (:class:`UserError`, one line, when none)."""
    class_name, where = transformer_class(folder)
    return family_of_class(class_name, str(where), read_layout(folder))


def locate_transformer(folder: str | Path) -> tuple[Path, Path | None]:
    """``(transformer folder, scheduler folder or None)`` of ``folder``, by its family's locator."""
    return family_of(folder).loaders().locate_transformer(folder)


def image_conditioning(folder: str | Path) -> Any:
    """The first-frame conditioning of ``folder``'s transformer by its family (:meth:`FamilyLoaders.image_conditioning`:
    None for a text-to-video model): what tells an image-to-video base (Wan 2.1 I2V: ``in_channels`` 36 =
    latent 16 + mask 4 + first-frame latent 16, ``image_dim`` set) from a text-to-video one."""
    loaders = family_of(folder).loaders()
    transformer_dir, _ = loaders.locate_transformer(folder)
    return loaders.image_conditioning(_read_json(transformer_dir / "config.json"))


def load_inference_model(folder: str | Path, device: Any = "cpu", dtype: Any = None, shift: float | None = None,
                         role: str = "inference", transformer: Any = None, **options: Any) -> "ModelBase":
    """A frozen plugin over ``folder``'s transformer by its family's loader (:meth:`FamilyLoaders.load_inference_model`;
    ``dtype`` None: float32; ``options``: the sampler's ``model_options()``)."""
    import torch

    loaders = family_of(folder).loaders()
    return loaders.load_inference_model(folder, device, torch.float32 if dtype is None else dtype, shift=shift, role=role,
                                        transformer=transformer, **options)


def vae_geometry(folder: str | Path) -> tuple[int, int, int]:
    """``(latent channels, frames per latent after the first, pixels per latent side)`` of the VAE of model folder
    ``folder``, read from its ``vae/config.json`` by the VAE's class as its pipeline reads it
    (:mod:`distillery.components.vae_geometry`: Wan's ``z_dim`` and scale factors, HunyuanVideo 1.5's ``latent_channels``
    and compression ratios); one :class:`UserError` line when the folder has no readable VAE config."""
    from distillery.components.vae_geometry import vae_geometry as read

    return read(folder)


def latent_shape_for(folder: str | Path, num_frames: int, height: int, width: int, what: str) -> list[int]:
    """``[C, T', H', W']`` of the latent the VAE of model folder ``folder`` makes of ``num_frames`` frames of
    ``height × width`` pixels (what the ``latents`` stage stores): ``T' = (num_frames − 1) / t + 1``, ``H' = height / s``,
    ``W' = width / s`` (:func:`vae_geometry`). Frames or sizes the VAE does not divide are one :class:`UserError` line,
    starting with ``what`` (who asks: ``prompts``, ``validate``)."""
    z_dim, t, s = vae_geometry(folder)
    if num_frames < 1 or (num_frames - 1) % t:
        raise UserError(f"{what}: {num_frames} frames: the base's VAE needs {t}k+1 frames")
    if height < s or width < s or height % s or width % s:
        raise UserError(f"{what}: {height}x{width} pixels: the base's VAE needs multiples of {s}")
    return [z_dim, (num_frames - 1) // t + 1, height // s, width // s]
