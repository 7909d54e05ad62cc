"""The base model's VAE and text encoder(s), used exactly as the base's diffusers pipeline uses them (WanPipeline's;
Cosmos Predict 2.5's pipeline has the same VAE; HunyuanVideo 1.5's its own; the text encoders are :class:`PromptEncoder`).

Contracts:
- videos: ``uint8 [B, T, H, W, 3]`` RGB frames ↔ latents ``float32 [B, C, T', H', W']`` with
  ``T' = (T − 1) / t + 1`` and ``H' = H / s``, ``W' = W / s`` (t, s = the VAE's temporal and spatial factors).
  Latents are the posterior **mean** (no sampling), **normalised** as the VAE's pipeline normalises them
  (:mod:`distillery.data.vae_codecs`: Wan's ``(z − latents_mean) / latents_std``, HunyuanVideo 1.5's
  ``z · scaling_factor``). This is where normalisation happens; the pipeline undoes it before decoding, so training
  on these latents matches sampling with the stock pipeline.
- prompts: ``prompt_clean`` → tokenizer (pad to ``max_sequence_length``, truncate, add ``</s>``) →
  encoder with the attention mask → each row trimmed to its real token count: ``[L_i, D]``
  unpadded. Training pads them back with zeros to the same ``max_sequence_length``. (A Cosmos base's rows are
  ``max_sequence_length`` long already: :class:`PromptEncoder`.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch

from distillery.common.errors import UserError
from distillery.common.log import quiet_library_progress
from distillery.data.vae_decode import auto_chunk_frames, decode_video, set_fused_decode


def read_max_sequence_length(base: Path, default: int = 512) -> int:
    """The prompt length the base model is meant to be used with.

    A distillery model card front matter (``max_sequence_length:``) wins; else the tokenizer's
    ``model_max_length`` when it is a sane number; else ``default`` (Wan 2.1 uses 512).
    """
    card = base / "README.md"
    if card.is_file():
        for line in card.read_text(encoding="utf-8").splitlines()[:40]:
            if line.strip().startswith("max_sequence_length:"):
                try:
                    return int(line.split(":", 1)[1].strip())
                except ValueError:
                    break
    cfg = base / "tokenizer" / "tokenizer_config.json"
    if cfg.is_file():
        value = json.loads(cfg.read_text()).get("model_max_length")
        if isinstance(value, int) and 0 < value <= 4096:
            return value
    return default


def _vae_kind(vae: Any) -> Any:
    from distillery.data.vae_codecs import KINDS

    kind = KINDS.get(type(vae).__name__)
    if kind is None:
        raise UserError(f"a {type(vae).__name__} VAE; distillery encodes videos with {', '.join(KINDS)}")
    return kind


def normalize_latents(vae: Any, z: torch.Tensor) -> torch.Tensor:
    """Training-space latents of raw latents ``z`` [B, C, ...], as the VAE's pipeline makes them
    (:mod:`distillery.data.vae_codecs`: Wan's ``(z − latents_mean) / latents_std``, HunyuanVideo 1.5's ``z · scaling_factor``)."""
    return _vae_kind(vae).normalize(vae, z)


def denormalize_latents(vae: Any, x: torch.Tensor) -> torch.Tensor:
    """Raw latents for ``vae.decode`` from training-space ``x`` [B, C, ...], as the VAE's pipeline undoes the normalisation."""
    return _vae_kind(vae).denormalize(vae, x)


def first_frame_mask_channels(base: Path) -> int | None:
    """The first-frame mask's channels an image-to-video base's transformer takes — ``in_channels − 2 ·
    out_channels`` of ``transformer/config.json`` (Wan 2.1 I2V: 36 − 2 · 16 = 4) — or None for a text-to-video
    base (``in_channels == out_channels``, no transformer config to read, or a transformer not Wan's: HunyuanVideo 1.5's
    ``2 · out_channels + 1`` inputs carry a zero condition for text-to-video, its plugin's business). The model side's
    reading of the same config is ``distillery.models.wan.image_conditioning``."""
    path = Path(base) / "transformer" / "config.json"
    try:
        config = json.loads(path.read_text())
        if config.get("_class_name", "WanTransformer3DModel") != "WanTransformer3DModel":
            return None
        in_ch, out_ch = int(config["in_channels"]), int(config.get("out_channels") or config["in_channels"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return in_ch - 2 * out_ch if in_ch > 2 * out_ch else None


def first_frame_mask(num_frames: int, temporal_factor: int, latent_hw: tuple[int, int]) -> torch.Tensor:
    """The first-frame mask ``[temporal_factor, T', H', W']`` of ``WanImageToVideoPipeline``: per video frame 1 for the
    given first frame, 0 for the frames to generate; the first frame counted ``temporal_factor`` times so that each
    latent frame gets ``temporal_factor`` channels (``T' = (num_frames − 1) / temporal_factor + 1``)."""
    h, w = latent_hw
    mask = torch.zeros(num_frames + temporal_factor - 1, h, w)
    mask[:temporal_factor] = 1.0
    return mask.view(-1, temporal_factor, h, w).transpose(0, 1).contiguous()


# -- the prompt encoder, by the text encoder's class ---------------------------------------------------------
UMT5 = "UMT5EncoderModel"
QWEN25_VL = "Qwen2_5_VLForConditionalGeneration"
QWEN25_VL_TEXT = "Qwen2_5_VLTextModel"  # HunyuanVideo 1.5's first encoder (its second: text_encoder_2, ByT5's T5)


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: unreadable ({type(exc).__name__}); is the base a diffusers model folder?") from None


def text_encoder_class(base: Path) -> str:
    """The text encoder's class name of the diffusers folder ``base`` (module doc)."""
    index = base / "model_index.json"
    if index.is_file():
        entry = _read(index).get("text_encoder")
        if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str):
            return entry[1]
    archs = _read(base / "text_encoder" / "config.json").get("architectures") or []
    if archs:
        return str(archs[0])
    raise UserError(f"{base}: neither model_index.json nor text_encoder/config.json names the text encoder's class")


def _text_config(base: Path, part: str = "text_encoder") -> dict[str, Any]:
    config = _read(base / part / "config.json")
    return config.get("text_config") or config  # transformers 5 nests the language model's config


def _umt5_streams(base: Path) -> tuple[tuple[str, int, int | None], ...]:
    return ((UMT5, int(_read(base / "text_encoder" / "config.json")["d_model"]), None),)


def _qwen25_vl_streams(base: Path) -> tuple[tuple[str, int, int | None], ...]:
    text = _text_config(base)
    return ((QWEN25_VL, int(text["hidden_size"]) * int(text["num_hidden_layers"]), None),)


def _hunyuan15_streams(base: Path) -> tuple[tuple[str, int, int | None], ...]:
    from distillery.components.prompt_streams import hunyuan15_budgets

    qwen, byt5 = hunyuan15_budgets()
    return ((QWEN25_VL_TEXT, int(_text_config(base)["hidden_size"]), qwen),
            ("T5EncoderModel", int(_read(base / "text_encoder_2" / "config.json")["d_model"]), byt5))


@dataclass(frozen=True)
class TextEncoderKind:
    """One text-encoder class (``model_index.json``'s ``text_encoder``) and the prompt streams it makes, read from the
    base's configs: ``(encoder class, width, token budget or None)`` each, side by side in the stored prompt
    (:mod:`distillery.components.prompt_streams`; one stream: the width is the embedding's)."""

    class_name: str
    streams: Callable[[Path], tuple[tuple[str, int, int | None], ...]]

    def width(self, base: Path) -> int:
        return sum(width for _, width, _ in self.streams(base))


KINDS = {k.class_name: k for k in (TextEncoderKind(UMT5, _umt5_streams), TextEncoderKind(QWEN25_VL, _qwen25_vl_streams),
                                   TextEncoderKind(QWEN25_VL_TEXT, _hunyuan15_streams))}


def kind_of(base: Path) -> TextEncoderKind:
    """The :class:`TextEncoderKind` of ``base``'s text encoder (one line for a class no row knows)."""
    name = text_encoder_class(base)
    if name not in KINDS:
        raise UserError(f"{base}: a {name} text encoder; distillery encodes prompts with {', '.join(KINDS)}")
    return KINDS[name]


def text_streams(base: Path) -> tuple[tuple[str, int, int | None], ...]:
    """The prompt streams of ``base``'s text encoder(s) (:class:`TextEncoderKind`), read from their configs."""
    try:
        return kind_of(base).streams(base)
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{base}: a text encoder config with no readable width ({type(exc).__name__}: {exc})") from None


def text_width(base: Path) -> int:
    """The width ``D`` of the prompt embeddings ``base``'s text encoder(s) make, read from their configs (nothing
    loaded): the streams' widths added (:mod:`distillery.components.prompt_streams`)."""
    return sum(width for _, width, _ in text_streams(base))


class PromptEncoder:
    """A base folder's prompt encoder, by its text encoder's class: the prompt → embeddings step of each family's diffusers
    pipeline, run the way that pipeline runs it (so latents made here condition a transformer as the stock pipeline does).

    - ``UMT5EncoderModel`` (Wan 2.1 / 2.2): ``prompt_clean``, the tokenizer padded to ``max_sequence_length`` with its
      ``</s>``, the encoder under the attention mask, each row trimmed to its real tokens: ``[L_i, D]`` (``D = d_model``).
    - ``Qwen2_5_VLForConditionalGeneration`` (Cosmos Predict 2.5): the tokenizer's chat template (a system turn, the
      prompt as the user turn) padded to ``max_sequence_length``, the decoder without an attention mask, every hidden
      layer after the embeddings normalised over its width and concatenated — ``Cosmos2_5_PredictBasePipeline``'s own
      ``_get_prompt_embeds``, called as it is — untrimmed: ``[max_sequence_length, layers · hidden]`` (the pipeline
      passes the pad tokens' embeddings to the transformer too).
    - ``Qwen2_5_VLTextModel`` + ``text_encoder_2`` (HunyuanVideo 1.5): ``HunyuanVideo15Pipeline``'s own
      ``_get_mllm_prompt_embeds`` (its chat template, the third-from-last hidden layer, the template's 108 tokens
      cropped, a 1000-token budget, with its mask) and ``_get_byt5_prompt_embeds`` (the prompt's quoted text through
      ByT5, a 256-token budget with its mask; zeros and an empty mask when the prompt quotes nothing), called as they
      are, the two streams side by side with their real tokens only (:func:`~distillery.components.prompt_streams.pack_streams`):
      ``[max(L_qwen, L_byt5), hidden + d_model]``.

    Which one a folder has: ``model_index.json``'s ``text_encoder`` entry (``["transformers", "<class>"]``), else the
    ``architectures`` of ``text_encoder/config.json``. A class no row knows is one line (:class:`UserError`). It holds
    the tokenizer(s) and text encoder(s) of ``base``, frozen, float32, on ``device``."""

    def __init__(self, base: Path, device: torch.device, max_sequence_length: int) -> None:
        from transformers import AutoTokenizer

        self.kind = kind_of(base)
        self.device = device
        self.max_sequence_length = int(max_sequence_length)
        self.tokenizer = AutoTokenizer.from_pretrained(base / "tokenizer")
        self.second = None
        if self.kind.class_name == UMT5:
            from transformers import UMT5EncoderModel as model_class
        elif self.kind.class_name == QWEN25_VL:
            from transformers import Qwen2_5_VLForConditionalGeneration as model_class
        else:
            from transformers import ByT5Tokenizer, T5EncoderModel
            from transformers import Qwen2_5_VLTextModel as model_class

            self.second = (ByT5Tokenizer.from_pretrained(base / "tokenizer_2"),
                           T5EncoderModel.from_pretrained(base / "text_encoder_2", torch_dtype=torch.float32).to(device).eval())
        self.model = model_class.from_pretrained(base / "text_encoder", torch_dtype=torch.float32).to(device).eval()
        self.width = self.kind.width(base)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> list[torch.Tensor]:
        """Prompts → embeddings ``[L_i, D]`` (float32, CPU): trimmed to the real tokens (UMT5; HunyuanVideo 1.5's two
        streams side by side) or all ``max_sequence_length`` of them (Qwen2.5-VL), class doc."""
        if self.kind.class_name == UMT5:
            return self._encode_umt5(prompts)
        if self.second is not None:
            return self._encode_hunyuan15(prompts)
        from diffusers import Cosmos2_5_PredictBasePipeline

        # the pipeline's own encoding, on a stand-in holding only what that method reads
        parts = SimpleNamespace(tokenizer=self.tokenizer, text_encoder=self.model, _execution_device=self.device)
        hidden = Cosmos2_5_PredictBasePipeline._get_prompt_embeds(parts, prompt=list(prompts),
                                                                   max_sequence_length=self.max_sequence_length,
                                                                   device=self.device, dtype=torch.float32)
        return [h.float().cpu().clone() for h in hidden]

    def _encode_hunyuan15(self, prompts: list[str]) -> list[torch.Tensor]:
        from diffusers import HunyuanVideo15Pipeline

        from distillery.components.prompt_streams import pack_streams

        # the pipeline's own static encoders, with their default budgets (hunyuan15_budgets: its __init__'s too)
        qwen, qwen_mask = HunyuanVideo15Pipeline._get_mllm_prompt_embeds(
            text_encoder=self.model, tokenizer=self.tokenizer, prompt=list(prompts), device=self.device)
        byt5, byt5_mask = HunyuanVideo15Pipeline._get_byt5_prompt_embeds(
            tokenizer=self.second[0], text_encoder=self.second[1], prompt=list(prompts), device=self.device)
        return [pack_streams([(qwen[i], qwen_mask[i]), (byt5[i], byt5_mask[i])]) for i in range(len(prompts))]

    def _encode_umt5(self, prompts: list[str]) -> list[torch.Tensor]:
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        tokens = self.tokenizer(
            [prompt_clean(p) for p in prompts], padding="max_length", max_length=self.max_sequence_length,
            truncation=True, add_special_tokens=True, return_attention_mask=True, return_tensors="pt",
        )
        mask = tokens.attention_mask
        lengths = mask.gt(0).sum(dim=1)
        hidden = self.model(tokens.input_ids.to(self.device), mask.to(self.device)).last_hidden_state.float().cpu()
        return [h[: int(n)].clone() for h, n in zip(hidden, lengths)]


class BaseEncoders:
    """VAE + tokenizer(s) + text encoder(s) (:class:`PromptEncoder`) of a diffusers base folder (Wan, Cosmos Predict 2.5,
    HunyuanVideo 1.5), frozen, on ``device``; the VAE by its class (:mod:`distillery.data.vae_codecs`); for an
    image-to-video base (:func:`first_frame_mask_channels`) also its image encoder and processor (when the folder has them)."""

    def __init__(self, base: str | Path, device: str | torch.device = "cpu", max_sequence_length: int | None = None,
                 text_encoder: bool = True, vae_dtype: torch.dtype = torch.float32,
                 decode: tuple[int | None, bool] = (1, False)) -> None:
        """``text_encoder=False``: leave the tokenizer and text encoder unloaded (a caller that has the
        prompt embeddings already, e.g. from the latent set; :meth:`encode_prompts` then refuses);
        ``text_dim`` comes from ``text_encoder/config.json``. ``vae_dtype``: the VAE's weights and compute
        (float32, as the Wan model card runs it; bfloat16 decodes faster on a GPU); latents stay float32 either way.
        ``decode``: how :meth:`decode_latents` runs, ``(chunk_frames, fused)`` as :meth:`configure_decode` takes them
        (the default: diffusers' own frame-by-frame decode) — told once, by the caller that decides it."""
        from distillery.data.vae_codecs import vae_kind

        quiet_library_progress()
        self.base = Path(base)
        for part in ("vae", "text_encoder", "tokenizer"):
            if not (self.base / part).is_dir():
                raise UserError(f"{self.base}: no {part}/ folder; --base must be a diffusers model folder")
        self.device = torch.device(device)
        self.vae_kind = vae_kind(self.base)
        self.vae = self.vae_kind.load(self.base / "vae", vae_dtype, self.device)
        self.z_dim, self.temporal_factor, self.spatial_factor = self.vae_kind.geometry(dict(self.vae.config))
        self.configure_decode(*decode)
        self.max_sequence_length = max_sequence_length or read_max_sequence_length(self.base)
        self.prompt_encoder = PromptEncoder(self.base, self.device, self.max_sequence_length) if text_encoder else None
        self.text_dim = self.prompt_encoder.width if self.prompt_encoder is not None else text_width(self.base)
        self.text_streams = text_streams(self.base)
        self.mask_channels = first_frame_mask_channels(self.base)  # None: a text-to-video base
        self.image_encoder = self.image_processor = None
        if self.mask_channels is not None and (self.base / "image_encoder").is_dir():
            from transformers import CLIPImageProcessor, CLIPVisionModel

            self.image_processor = CLIPImageProcessor.from_pretrained(self.base / "image_processor")
            self.image_encoder = CLIPVisionModel.from_pretrained(self.base / "image_encoder", torch_dtype=torch.float32)
            self.image_encoder.to(self.device).eval()

    @torch.no_grad()
    def encode_videos(self, frames: np.ndarray | torch.Tensor) -> torch.Tensor:
        """``uint8 [B, T, H, W, 3]`` → normalised posterior-mean latents ``float32 [B, C, T', H', W']`` (CPU)."""
        x = torch.as_tensor(frames).to(self.device)  # uint8 over the bus, converted on the device
        x = x.permute(0, 4, 1, 2, 3).float().div(127.5).sub(1.0).to(self.vae.dtype)
        z = torch.cat([self.vae.encode(x[rows]).latent_dist.mode().float() for rows in self.vae_kind.calls(x.shape[0])])
        return self.vae_kind.normalize(self.vae, z).cpu()

    @property
    def image_to_video(self) -> bool:
        """Whether the base is an image-to-video model (its latents carry the first frame's condition)."""
        return self.mask_channels is not None

    @torch.no_grad()
    def encode_first_frames(self, frames: np.ndarray | torch.Tensor) -> torch.Tensor:
        """``uint8 [B, T, H, W, 3]`` → the first-frame condition ``float32 [B, M + C, T', H', W']`` (CPU) as
        ``WanImageToVideoPipeline.prepare_latents`` builds it: the mask (:func:`first_frame_mask`, ``M`` channels)
        then the normalised latent (the VAE's mode) of the video whose first frame is the clip's and the rest zeros."""
        if self.mask_channels is None:
            raise RuntimeError(f"{self.base} is not an image-to-video base")
        x = torch.as_tensor(frames).to(self.device)
        x = x[:, :1].permute(0, 4, 1, 2, 3).float().div(127.5).sub(1.0)  # [B, 3, 1, H, W] in [-1, 1]
        b, _, _, h, w = x.shape
        t = int(frames.shape[1])
        video = torch.cat([x, x.new_zeros(b, 3, t - 1, h, w)], dim=2).to(self.vae.dtype)
        z = normalize_latents(self.vae, self.vae.encode(video).latent_dist.mode().float()).cpu()
        mask = first_frame_mask(t, self.mask_channels, (z.shape[3], z.shape[4]))
        return torch.cat([mask.unsqueeze(0).expand(b, -1, -1, -1, -1), z], dim=1)

    @torch.no_grad()
    def encode_images(self, frames: np.ndarray | torch.Tensor) -> torch.Tensor | None:
        """``uint8 [B, T, H, W, 3]`` → the image encoder's embeddings of each first frame ``float32 [B, N, D]`` (CPU),
        as ``WanImageToVideoPipeline.encode_image``: the processor, then the encoder's penultimate hidden states.
        None when the base has no image encoder."""
        if self.image_encoder is None:
            return None
        first = [np.asarray(f[0]) for f in (frames.cpu().numpy() if isinstance(frames, torch.Tensor) else frames)]
        pixels = self.image_processor(images=first, return_tensors="pt").to(self.device)
        return self.image_encoder(**pixels, output_hidden_states=True).hidden_states[-2].float().cpu()

    def configure_decode(self, chunk_frames: int | None, fused: bool = False) -> None:
        """How :meth:`decode_latents` runs the VAE (:mod:`distillery.data.vae_decode`): ``chunk_frames`` latent
        frames per decoder call after the first (1: diffusers' frame-by-frame loop; more: the same function, other
        rounding; None: ``auto_chunk_frames``, sized to the GPU); ``fused``: the decoder's residual blocks in fewer
        passes (stays off for a VAE ``set_fused_decode`` does not know; ``fused_decode`` says which)."""
        if chunk_frames is not None and int(chunk_frames) < 1:
            raise ValueError(f"decode_chunk_frames must be >= 1 or None, got {chunk_frames}")
        self.decode_chunk_frames: int | None = None if chunk_frames is None else int(chunk_frames)
        self.fused_decode = set_fused_decode(self.vae, bool(fused))

    def chunk_frames_for(self, latent_shape: tuple[int, ...]) -> int:
        """The latent frames per decoder call :meth:`decode_latents` uses for latents of this shape."""
        if self.decode_chunk_frames is not None:
            return self.decode_chunk_frames
        return auto_chunk_frames(self.vae, tuple(latent_shape), self.device)

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor) -> np.ndarray:
        """Normalised latents ``[B, C, T', H', W']`` → ``uint8 [B, T, H, W, 3]`` frames."""
        z = self.vae_kind.denormalize(self.vae, latents.float().to(self.device)).to(self.vae.dtype)
        chunk = self.chunk_frames_for(tuple(z.shape))
        video = torch.cat([decode_video(self.vae, z[rows], chunk) for rows in self.vae_kind.calls(z.shape[0])])
        video = video.float().clamp(-1, 1)
        frames = ((video + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
        return frames.permute(0, 2, 3, 4, 1).cpu().numpy()

    def encode_prompts(self, prompts: list[str]) -> list[torch.Tensor]:
        """Captions → embeddings ``[L_i, D]`` (float32, CPU), as the base's pipeline computes them
        (:class:`PromptEncoder`: unpadded for Wan's UMT5 and HunyuanVideo 1.5's two streams, all ``max_sequence_length``
        rows for Cosmos)."""
        if self.prompt_encoder is None:
            raise RuntimeError("BaseEncoders was built with text_encoder=False: it cannot encode prompts")
        return self.prompt_encoder.encode(prompts)
