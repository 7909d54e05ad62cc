"""Model families: which plugin package loads a folder's transformer.

A model family is one package of model plugins, ``distillery.models.<family>`` (``models/wan/``: Wan
2.1), for the diffusers transformer classes it declares. :data:`FAMILIES` is the one table of them:
a family's name, the ``_class_name`` values it loads and its package. A folder's family is read from
the folder itself (:func:`transformer_class`): the ``_class_name`` of its transformer's
``config.json`` (``<folder>/transformer/config.json``, or ``<folder>/config.json`` for a transformer
folder, e.g. an artifact's ``model/transformer``), else the ``transformer`` entry of its
``model_index.json`` (``["diffusers", "<class>"]``). The variant within the family (bidirectional,
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


LOADER_NAMES = ("HEAD_BANK_FILE", "locate_transformer", "load_inference_model", "build_transformer", "input_widths",
                "image_conditioning", "empty_head_bank", "save_head_bank")  # FamilyLoaders' members


@dataclass(frozen=True)
class ModelFamily:
    """One model family: ``name`` (shown in errors and lineage), the diffusers transformer classes
    (``_class_name``) its plugins load, and ``package``: the dotted module exporting its
    :class:`FamilyLoaders`."""

    name: str
    transformer_classes: tuple[str, ...]
    package: str

    def loaders(self) -> FamilyLoaders:
        """The family's package (imported now), typed as its loaders."""
        return cast(FamilyLoaders, importlib.import_module(self.package))


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("wan2.1", ("WanTransformer3DModel",), "distillery.models.wan"),
)


def registered() -> str:
    """The registered families as one phrase: ``wan2.1 (WanTransformer3DModel)``."""
    return ", ".join(f"{f.name} ({', '.join(f.transformer_classes)})" for f in FAMILIES)


def family_of_class(class_name: Any, where: str) -> ModelFamily:
    """The family that loads transformer class ``class_name``; ``where`` names what declared it (a
    file) in the one-line :class:`UserError` when no family does."""
    for family in FAMILIES:
        if class_name in family.transformer_classes:
            return family
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


def family_of(folder: str | Path) -> ModelFamily:
    """The registered family of ``folder``'s transformer (:class:`UserError`, one line, when none)."""
    class_name, where = transformer_class(folder)
    return family_of_class(class_name, str(where))


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
