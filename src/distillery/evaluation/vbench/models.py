"""The models VBench's dimensions run, each loaded from a folder the user names (``models.<key>``), never
downloaded: its class checked, its files' sha256 recorded, and whether it has the published architecture.

=============  =========================================  ==================================================================
key            dimension(s)                               what the folder holds (where the user gets it)
=============  =========================================  ==================================================================
``dino``       subject consistency                        DINO ViT-B/16: a transformers ViT folder (``facebook/dino-vitb16``)
                                                          or ``dino_vitbase16_pretrain.pth`` (the DINO release)
``clip_b32``   background consistency                     CLIP ViT-B/32 in transformers' layout (``openai/clip-vit-base-patch32``)
``clip_l14``   aesthetic quality                          CLIP ViT-L/14 in transformers' layout (``openai/clip-vit-large-patch14``)
``aesthetic``  aesthetic quality                          ``sa_0_4_vit_l_14_linear.pth`` (LAION-AI/aesthetic-predictor)
``amt``        motion smoothness                          ``amt-s.pth`` (the AMT release, Hugging Face ``lalala125/AMT``)
``raft``       dynamic degree                             ``raft-things.pth`` (the RAFT release, princeton-vl/RAFT ``models.zip``)
``musiq``      imaging quality                            ``musiq_spaq_ckpt-358bb6af.pth`` (IQA-PyTorch's ``v0.1-weights`` release)
``viclip``     overall consistency                        ``ViClip-InternVid-10M-FLT.pth`` (Hugging Face ``OpenGVLab/VBench_Used_Models``)
                                                          and ``bpe_simple_vocab_16e6.txt.gz`` (openai/CLIP)
=============  =========================================  ==================================================================

The ``.pth`` files are read with ``torch.load(weights_only=True)`` (tensors and plain containers only: a pickle
that would run code is refused) and loaded strictly into our modules (:mod:`raft`, :mod:`amt`, :mod:`musiq`,
:mod:`viclip`, the aesthetic head a :class:`torch.nn.Linear`), the transformers folders with their own classes
(safetensors only). A missing key, folder or file, an unreadable file, a model of another class (missing or
unexpected tensors) is one line naming the key and where the model comes from. ``published`` says whether the
loaded model has the published architecture's sizes (a smaller model of the same class — the tests' — computes
the same formulas, but its numbers are not VBench's); the MUSIQ file name carries the first 8 hex digits of its
sha256 (IQA-PyTorch's convention), checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from distillery.common.errors import UserError
from distillery.common.log import get_logger

log = get_logger(__name__)

WHERE = {
    "dino": "DINO ViT-B/16: a transformers ViT folder (facebook/dino-vitb16) or a folder with dino_vitbase16_pretrain.pth "
            "from the DINO release",
    "clip_b32": "CLIP ViT-B/32 in transformers' layout (openai/clip-vit-base-patch32)",
    "clip_l14": "CLIP ViT-L/14 in transformers' layout (openai/clip-vit-large-patch14)",
    "aesthetic": "a folder with sa_0_4_vit_l_14_linear.pth from LAION-AI/aesthetic-predictor",
    "amt": "a folder with amt-s.pth from the AMT release (Hugging Face lalala125/AMT)",
    "raft": "a folder with raft-things.pth from the RAFT release (princeton-vl/RAFT, models.zip)",
    "musiq": "a folder with musiq_spaq_ckpt-358bb6af.pth from IQA-PyTorch's v0.1-weights release",
    "viclip": "a folder with ViClip-InternVid-10M-FLT.pth (Hugging Face OpenGVLab/VBench_Used_Models) and "
              "bpe_simple_vocab_16e6.txt.gz (openai/CLIP)",
}
FILES = {"aesthetic": "sa_0_4_vit_l_14_linear.pth", "amt": "amt-s.pth", "raft": "raft-things.pth",
         "musiq": "musiq_spaq_ckpt-358bb6af.pth", "viclip": "ViClip-InternVid-10M-FLT.pth"}
VICLIP_BPE = "bpe_simple_vocab_16e6.txt.gz"
DIMENSION_MODELS = {
    "subject_consistency": ("dino",), "background_consistency": ("clip_b32",), "temporal_flickering": (),
    "motion_smoothness": ("amt",), "dynamic_degree": ("raft",), "aesthetic_quality": ("clip_l14", "aesthetic"),
    "imaging_quality": ("musiq",), "overall_consistency": ("viclip",),
}
MUSIQ_SHA256_PREFIX = "358bb6af"  # IQA-PyTorch names its files by the first 8 hex digits of their sha256
# (vision hidden size, layers, patch) of the published CLIP towers
CLIP_PUBLISHED = {"clip_b32": (768, 12, 32), "clip_l14": (1024, 24, 14)}


@dataclass
class LoadedModel:
    """A model of one key, on its device, with what lineage records of it."""

    key: str
    module: Any
    folder: Path
    files: dict[str, str] = field(default_factory=dict)  # file name -> sha256
    published: bool = True
    extra: Any = None  # the ViCLIP tokenizer

    def describe(self) -> dict[str, Any]:
        return {"folder": str(self.folder), "class": type(self.module).__name__, "files": dict(self.files),
                "published_architecture": self.published}


def needed_keys(dimensions: tuple[str, ...] | list[str]) -> list[str]:
    """The model keys ``dimensions`` need, in table order."""
    wanted = {k for d in dimensions for k in DIMENSION_MODELS[d]}
    return [k for k in WHERE if k in wanted]


def check_folders(models: dict[str, str], dimensions, where: str = "vbench.models") -> dict[str, Path]:
    """The folder of every model ``dimensions`` need, checked to exist and hold the files its kind needs; a missing
    one is one line naming the key and where the user gets it (module doc). Reads no weights."""
    unknown = sorted(set(models) - set(WHERE))
    if unknown:
        raise UserError(f"{where}: unknown model key {unknown[0]!r}; valid: {', '.join(WHERE)}")
    out = {}
    for key in needed_keys(dimensions):
        path = models.get(key)
        if not path:
            raise UserError(f"{where}.{key} is not set: the {key} model is needed; get {WHERE[key]}")
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise UserError(f"{where}.{key}: {folder} does not exist or is not a folder; it should be {WHERE[key]}")
        for name in _required_files(key, folder):
            if not (folder / name).is_file():
                raise UserError(f"{where}.{key}: {folder} has no {name}; it should be {WHERE[key]}")
        out[key] = folder
    return out


def _required_files(key: str, folder: Path) -> list[str]:
    if key == "dino":
        return [] if (folder / "config.json").is_file() else ["dino_vitbase16_pretrain.pth"]
    if key in ("clip_b32", "clip_l14"):
        return ["config.json"]
    return [FILES[key]] + ([VICLIP_BPE] if key == "viclip" else [])


def read_state(path: Path, key: str, where: str) -> dict[str, torch.Tensor]:
    """A ``.pth`` file's tensors (``weights_only``), unwrapped from ``state_dict``/``params``/``model`` and ``module.``."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a corrupt file or a refused pickle: one line either way
        raise UserError(f"{where}.{key}: cannot read {path} as tensors ({type(exc).__name__}: {str(exc).splitlines()[0][:100]}); "
                        f"it should be {WHERE[key]}") from None
    for wrapper in ("state_dict", "params", "model"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{where}.{key}: {path} holds no state dict of tensors; it should be {WHERE[key]}")
    return {k.removeprefix("module."): v for k, v in state.items()}


def load_strict(module: torch.nn.Module, state: dict[str, torch.Tensor], key: str, path: Path, where: str) -> None:
    """``module.load_state_dict(state, strict=True)``, a mismatch one line naming the class expected."""
    expected = module.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    wrong = [k for k in expected if k in state and tuple(state[k].shape) != tuple(expected[k].shape)]
    if missing or unexpected or wrong:
        what = (f"{len(missing)} tensors missing (e.g. {missing[0]})" if missing else
                f"{len(unexpected)} unexpected tensors (e.g. {unexpected[0]})" if unexpected else
                f"{wrong[0]} of shape {tuple(state[wrong[0]].shape)}, expected {tuple(expected[wrong[0]].shape)}")
        raise UserError(f"{where}.{key}: {path} is not a {type(module).__name__} checkpoint: {what}; it should be {WHERE[key]}")
    module.load_state_dict(state, strict=True)


def _sha256(path: Path) -> str:
    from distillery.common.hashcache import file_sha256

    return file_sha256(path)


def load_model(key: str, folder: Path, device: torch.device, where: str = "vbench.models") -> LoadedModel:
    """The model of ``key`` from its checked folder (:func:`check_folders`), float32, eval mode, on ``device``."""
    loaded = _LOADERS[key](key, folder, where)
    loaded.module = loaded.module.float().eval().to(device)
    for p in loaded.module.parameters():
        p.requires_grad_(False)
    return loaded


def _load_dino(key: str, folder: Path, where: str) -> LoadedModel:
    from distillery.evaluation.vbench.dino import DINO_FILE, use_dino_position_interpolation, vit_from_dino_state

    if (folder / "config.json").is_file():
        from transformers import ViTModel

        kind = _model_type(folder, key, where)
        if kind != "vit":
            raise UserError(f"{where}.{key}: {folder} is a {kind!r} model, not a ViT; it should be {WHERE[key]}")
        if not any(folder.glob("*.safetensors")):
            raise UserError(f"{where}.{key}: {folder} has no .safetensors weights (pickled weights are not loaded)")
        model = ViTModel.from_pretrained(folder, add_pooling_layer=False, dtype=torch.float32, use_safetensors=True)
        files = {p.name: _sha256(p) for p in sorted(folder.glob("*.safetensors"))}
    else:
        path = folder / DINO_FILE
        try:
            model = vit_from_dino_state(read_state(path, key, where))
        except (KeyError, ValueError, RuntimeError) as exc:
            raise UserError(f"{where}.{key}: {path} is not a DINO ViT checkpoint ({str(exc)[:80]}); it should be {WHERE[key]}") from None
        files = {DINO_FILE: _sha256(path)}
    cfg = model.config
    published = (cfg.hidden_size, cfg.num_hidden_layers, cfg.patch_size) == (768, 12, 16)
    return LoadedModel(key, use_dino_position_interpolation(model), folder, files, published)


def _model_type(folder: Path, key: str, where: str) -> str | None:
    from distillery.common.fsutil import read_json_file

    try:
        config = read_json_file(folder / "config.json", 1 << 20)
    except (OSError, ValueError) as exc:
        raise UserError(f"{where}.{key}: {folder}/config.json is not readable JSON ({str(exc)[:80]})") from None
    return config.get("model_type") if isinstance(config, dict) else None


def _load_clip(key: str, folder: Path, where: str) -> LoadedModel:
    from transformers import CLIPModel

    from distillery.evaluation.clip_scores import check_clip_folder

    check_clip_folder(folder, where=f"{where}.{key}")
    model = CLIPModel.from_pretrained(folder, dtype=torch.float32, use_safetensors=True)
    vision = model.config.vision_config
    published = (vision.hidden_size, vision.num_hidden_layers, vision.patch_size) == CLIP_PUBLISHED[key]
    published = published and vision.image_size == 224
    files = {p.name: _sha256(p) for p in sorted(folder.glob("*.safetensors"))}
    return LoadedModel(key, model, folder, files, published)


def _load_pth(key: str, folder: Path, where: str) -> LoadedModel:
    path = folder / FILES[key]
    state = read_state(path, key, where)
    extra = None
    if key == "aesthetic":
        weight = state.get("weight")
        if weight is None or weight.ndim != 2 or weight.shape[0] != 1:
            raise UserError(f"{where}.{key}: {path} is not a Linear(D, 1) head; it should be {WHERE[key]}")
        module = torch.nn.Linear(weight.shape[1], 1)
        published = weight.shape[1] == 768
    elif key == "amt":
        from distillery.evaluation.vbench.amt import AMTS

        module, published = AMTS(), True
    elif key == "raft":
        from distillery.evaluation.vbench.raft import RAFT

        module, published = RAFT(), True
    elif key == "musiq":
        from distillery.evaluation.vbench.musiq import MUSIQ

        module, published = MUSIQ(), True
    else:
        from distillery.evaluation.vbench.bpe import ClipBPE
        from distillery.evaluation.vbench.viclip import SIZES, ViCLIP

        width = state.get("vision_encoder.class_embedding")
        size = next((s for s, (v, _) in SIZES.items() if width is not None and width.shape[0] == v["width"]), "l14")
        module, published = ViCLIP(size), size == "l14"
        try:
            extra = ClipBPE(folder / VICLIP_BPE)
        except (OSError, EOFError, UnicodeDecodeError) as exc:
            raise UserError(f"{where}.{key}: {folder / VICLIP_BPE} is not CLIP's BPE vocabulary ({exc})") from None
    load_strict(module, state, key, path, where)
    files = {path.name: _sha256(path)}
    if key == "musiq" and not files[path.name].startswith(MUSIQ_SHA256_PREFIX):
        log.warning("%s.%s: %s's sha256 does not begin with %s as its name says: not IQA-PyTorch's weights, so the "
                    "imaging quality is not VBench's", where, key, path, MUSIQ_SHA256_PREFIX)
        published = False
    if key == "viclip":
        files[VICLIP_BPE] = _sha256(folder / VICLIP_BPE)
    return LoadedModel(key, module, folder, files, published, extra)


_LOADERS = {"dino": _load_dino, "clip_b32": _load_clip, "clip_l14": _load_clip, "aesthetic": _load_pth, "amt": _load_pth,
            "raft": _load_pth, "musiq": _load_pth, "viclip": _load_pth}
