"""The denoisers an exported distilled Wan samples through: thin wrappers over the pipeline's own
``WanTransformer3DModel`` (stdlib + torch + safetensors only; no weights are copied).

- :class:`WanDenoiser` — the velocity ``v = ε − x0`` (float32 ``[B, C, T, H, W]``) of the transformer
  at timesteps ``[B]`` in ``[0, num_train_timesteps]``, conditioned on text embeddings ``[B, L, D]``
  (the unconditional pass: the negative embeddings, zeros when None); an image-to-video transformer
  (``in_channels`` > ``out_channels``) also on the first frame, as ``WanImageToVideoPipeline`` feeds it: the
  condition ``[B, M + C, T, H, W]`` (mask, then the frame's latent) after the noisy latent on the channel axis,
  and, where the transformer has an ``image_dim``, the image encoder's embeddings ``[B, N, D']`` with the
  prompt zero-padded to :data:`I2V_TEXT_TOKENS` (diffusers' attention takes the text as the last 512 tokens).
  The unconditional pass keeps the frame (only the prompt is dropped, as the stock pipeline's CFG does);
  Wan 2.2's layouts (:class:`WanLayout`, from the folder's ``model_index.json``): TI2V-5B's ``expand_timesteps``
  feeds the transformer one timestep per token (``[B]`` → ``[B, T/pt · H/ph · W/pw]``, as ``WanPipeline`` does);
  A14B's two experts: each sample goes through ``transformer`` (high noise) when its timestep is
  ``>= boundary_ratio · num_train_timesteps``, else through ``transformer_2`` — distillery's ``WanModel`` routing;
- :class:`PDDWanDenoiser` — a PDD student: one velocity head per interval of a fine σ grid of
  ``pdd_steps`` intervals (``transformer/pdd_heads.safetensors``: ``weight [P, out, inner]``,
  ``bias [P, out]``); a block ``[a, b)`` of the grid is one forward through the heads fused into one
  projection (weights :func:`~distilled_schedule.block_weights`), put in place of ``proj_out``'s
  output for that forward only. Two experts: each has its own heads (the file's ``weight_2``/``bias_2`` are the
  low-noise expert's), and a block goes to the expert of its start, projected by that expert's heads.

The causal (block-causal, KV-cached) denoiser is :mod:`distilled_causal`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .distilled_schedule import block_weights, inference_sigmas

HEADS_FILE = "pdd_heads.safetensors"  # a PDD student's head bank, beside the transformer's weights
I2V_TEXT_TOKENS = 512  # the prompt length diffusers' Wan attention takes beside image embeddings


@dataclass
class Conditioning:
    """Text embeddings ``[B, L, D]`` (zero-padded to the prompt length) and the CFG negative (None: zeros); for an
    image-to-video transformer the first-frame condition ``first_frame [B or 1, M + C, T, H, W]`` and the image
    embeddings ``image_embeds [B or 1, N, D']`` (None for a text-to-video one)."""

    text_embeds: torch.Tensor
    negative_text_embeds: torch.Tensor | None = None
    first_frame: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None

    def to(self, device: torch.device) -> "Conditioning":
        """Every tensor on ``device``."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return Conditioning(self.text_embeds.to(device), move(self.negative_text_embeds), move(self.first_frame),
                            move(self.image_embeds))

    def frames(self, start: int, count: int) -> "Conditioning":
        """The conditioning of latent frames ``[start, start + count)`` (a streaming chunk: the first-frame condition
        is per latent frame, aligned with the latents); itself when it has none or holds just those frames."""
        first = self.first_frame
        if first is None or (start == 0 and first.shape[2] == count):
            return self
        return Conditioning(self.text_embeds, self.negative_text_embeds, first[:, :, start:start + count], self.image_embeds)


@dataclass(frozen=True)
class WanLayout:
    """How the transformer is fed (module doc): ``expand_timesteps`` (Wan 2.2 TI2V-5B: one timestep per token);
    ``second`` with ``boundary_ratio`` (Wan 2.2 A14B: the low-noise expert ``transformer_2`` and where it takes
    over). The default is Wan 2.1's: one transformer, one timestep per sample."""

    expand_timesteps: bool = False
    second: torch.nn.Module | None = None
    boundary_ratio: float | None = None

    def __post_init__(self) -> None:
        if (self.second is None) != (self.boundary_ratio is None):
            raise ValueError("two experts need both the second transformer and the boundary_ratio (model_index.json)")


class WanDenoiser:
    """Velocity of a (frozen) ``WanTransformer3DModel``; ``shift``: the flow shift of its schedule; ``layout``: Wan
    2.2's per-token timesteps or second expert (:class:`WanLayout`; None: Wan 2.1's)."""

    def __init__(self, transformer: torch.nn.Module, shift: float, num_train_timesteps: int = 1000, *,
                 layout: WanLayout | None = None) -> None:
        self.transformer = transformer
        self.shift = float(shift)
        self.num_train_timesteps = int(num_train_timesteps)
        self.layout = layout if layout is not None else WanLayout()
        # the high-noise expert's timesteps: t >= this (the plugin's boundary_ratio · its num_train_timesteps)
        ratio = self.layout.boundary_ratio
        self.boundary_timestep = None if ratio is None else float(ratio) * self.num_train_timesteps
        # inputs go in as the input layer's dtype (loaded in bf16, diffusers keeps some modules in fp32: the first
        # parameter is not the one to ask)
        param = getattr(getattr(transformer, "patch_embedding", None), "weight", None)
        param = param if param is not None else next(transformer.parameters())
        self.device, self.dtype = param.device, param.dtype
        cfg = transformer.config
        self.patch_size = tuple(cfg.patch_size)
        self.in_channels = int(cfg.in_channels)
        out = cfg.get("out_channels") if hasattr(cfg, "get") else getattr(cfg, "out_channels", None)
        self.condition_channels = self.in_channels - int(out if out is not None else self.in_channels)  # 0: text-to-video
        image_dim = cfg.get("image_dim") if hasattr(cfg, "get") else getattr(cfg, "image_dim", None)
        self.image_dim = None if image_dim is None else int(image_dim)

    def text_for(self, cond: Conditioning, conditional: bool) -> torch.Tensor:
        text = cond.text_embeds if conditional else cond.negative_text_embeds
        return torch.zeros_like(cond.text_embeds) if text is None else text

    def image_inputs(self, x: torch.Tensor, text: torch.Tensor, cond: Conditioning,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(hidden, text, image embeddings or None)`` the transformer takes for ``x`` (module doc): ``x`` and ``text``
        as they are for a text-to-video transformer. ``ValueError`` when an image-to-video one is given no frame."""
        if not self.condition_channels:
            return x, text, None
        first = cond.first_frame
        if first is None:
            raise ValueError("an image-to-video transformer samples from a first frame: pass image= (or first_frame= "
                             "and image_embeds=)")
        if first.shape[1] != self.condition_channels or first.shape[2:] != x.shape[2:] or first.shape[0] not in (1, x.shape[0]):
            raise ValueError(f"first_frame {tuple(first.shape)} does not fit latents {tuple(x.shape)} "
                             f"({self.condition_channels} condition channels)")
        hidden = torch.cat([x, first.to(x.dtype).expand(x.shape[0], -1, -1, -1, -1)], dim=1)
        if self.image_dim is None:
            return hidden, text, None
        if cond.image_embeds is None:
            raise ValueError(f"this image-to-video transformer takes image-encoder embeddings (image_dim {self.image_dim}): "
                             "pass image= with the folder's image encoder, or image_embeds=")
        if text.shape[1] > I2V_TEXT_TOKENS:
            raise ValueError(f"an image-to-video prompt of {text.shape[1]} tokens; diffusers' Wan takes {I2V_TEXT_TOKENS}")
        text = F.pad(text, (0, 0, 0, I2V_TEXT_TOKENS - text.shape[1]))
        return hidden, text, cond.image_embeds.expand(x.shape[0], -1, -1)

    def model_timesteps(self, timesteps: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """What the transformer takes for ``timesteps`` ``[B]`` at latents ``x``: ``[B]`` as they are, or — the layout
        expands timesteps (TI2V-5B) — the sample's timestep for each of its ``T/pt · H/ph · W/pw`` tokens."""
        if not self.layout.expand_timesteps:
            return timesteps
        p_t, p_h, p_w = self.patch_size
        _, _, t, h, w = x.shape
        return timesteps[:, None].expand(-1, (t // p_t) * (h // p_h) * (w // p_w))

    def run(self, module: torch.nn.Module, hidden: torch.Tensor, timesteps: torch.Tensor, text: torch.Tensor,
            image: torch.Tensor | None) -> torch.Tensor:
        """One transformer's output (its dtype) for ``hidden`` at ``timesteps`` ``[B]`` (expanded per the layout)."""
        return module(hidden_states=hidden, timestep=self.model_timesteps(timesteps, hidden).float(),
                      encoder_hidden_states=text.to(self.dtype),
                      encoder_hidden_states_image=None if image is None else image.to(self.dtype), return_dict=False)[0]

    routed_expert: int | None = None  # set: every sample goes to this expert (0 or 1; a causal student's cache write)

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning, conditional: bool) -> torch.Tensor:
        """The transformer's output for ``x`` at ``timesteps`` ``[B]`` (its dtype); of two experts, each sample's
        through the expert of its timestep (module doc; every sample through ``routed_expert`` when it is set), the
        rows put back in order (float32)."""
        hidden, text, image = self.image_inputs(x.to(self.dtype), self.text_for(cond, conditional), cond)
        if self.layout.second is None:
            return self.run(self.transformer, hidden, timesteps, text, image)
        if timesteps.ndim != 1:
            raise ValueError(f"two experts take one timestep per sample, got timesteps {tuple(timesteps.shape)}")
        low = timesteps < self.boundary_timestep  # the boundary itself is the high-noise expert's
        if self.routed_expert is not None:
            low = torch.full_like(low, bool(self.routed_expert))
        out: torch.Tensor | None = None
        for module, rows in ((self.transformer, (~low).nonzero().squeeze(1)), (self.layout.second, low.nonzero().squeeze(1))):
            if rows.numel() == 0:
                continue
            part = self.run(module, hidden[rows], timesteps[rows], text[rows],
                            None if image is None else image[rows]).float()
            if out is None:
                out = torch.zeros(hidden.shape[:1] + part.shape[1:], dtype=part.dtype, device=part.device)
            out = out.index_copy(0, rows, part)
        assert out is not None
        return out

    def velocity(self, x: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning, conditional: bool = True) -> torch.Tensor:
        """``v = ε − x0`` (float32, shape of ``x``)."""
        return self.forward(x, timesteps, cond, conditional).float()


def read_head_bank(path: Path, expert: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight [P, out, in], bias [P, out])`` of a head-bank file (tensors only, nothing unpickled); ``expert`` 1:
    the low-noise expert's (``weight_2``, ``bias_2``; ``ValueError`` when the file holds one expert's)."""
    from safetensors import safe_open

    names = ("weight", "bias") if not expert else ("weight_2", "bias_2")
    with safe_open(str(path), framework="pt") as f:
        if names[0] not in f.keys():
            raise ValueError(f"{path}: holds one expert's heads; this model has two experts")
        return f.get_tensor(names[0]), f.get_tensor(names[1])


class HeadBankDenoiser:
    """A PDD student's head bank over a family's denoiser (a mixin before it: ``class PDD<Family>Denoiser(HeadBankDenoiser,
    <Family>Denoiser)``), which gives ``transformer`` (its ``proj_out`` the projection the heads replace), ``device``,
    ``shift``, ``num_train_timesteps`` and ``forward(x, timesteps, cond, conditional)``, the transformer's output. A
    ``proj_out`` without a bias has heads without one (their stored ``bias`` is zeros)."""

    transformer: torch.nn.Module
    device: torch.device
    shift: float
    num_train_timesteps: int

    def head_transformers(self) -> list[torch.nn.Module]:
        """The transformers whose ``proj_out`` the heads replace: ``[transformer]``, and a second expert's
        (``layout.second`` of a family that has one: Wan 2.2 A14B)."""
        second = getattr(getattr(self, "layout", None), "second", None)
        return [self.transformer] + ([second] if second is not None else [])

    def load_head_bank(self, pdd_steps: int, heads_file: Path) -> None:
        """Read ``heads_file`` (``pdd_steps`` heads of ``proj_out``'s shape per expert); ``ValueError`` /
        ``FileNotFoundError``."""
        if not Path(heads_file).is_file():
            raise FileNotFoundError(f"{heads_file}: no PDD head bank beside the transformer weights; a pdd_fused "
                                    "sampling contract needs the PDD stage's heads")
        self.heads: list[tuple[torch.Tensor, torch.Tensor]] = []
        for expert, module in enumerate(self.head_transformers()):
            weight, bias = read_head_bank(Path(heads_file), expert)
            proj = module.proj_out
            if tuple(weight.shape) != (pdd_steps, *proj.weight.shape) or tuple(bias.shape) != (pdd_steps, proj.weight.shape[0]):
                raise ValueError(f"{heads_file}: holds {weight.shape[0]} heads of shape {tuple(weight.shape[1:])}; the "
                                 f"contract asks for pdd_steps={pdd_steps} heads of {tuple(proj.weight.shape)}")
            self.heads.append((weight.float().to(self.device), bias.float().to(self.device)))  # fp32 as trained
        self.pdd_steps = int(pdd_steps)
        self.head_weight, self.head_bias = self.heads[0]  # [P, out, in], [P, out]

    @property
    def fine_sigmas(self) -> torch.Tensor:
        """The fine grid ``[P + 1]`` (CPU) the heads are intervals of: the ``pdd_steps``-step grid of the shift, in the
        σ-grid form the sampler runs (``sigma_grid``: the contract's, set by the pipeline; the family's otherwise)."""
        return inference_sigmas(self.shift, self.pdd_steps, self.num_train_timesteps, getattr(self, "sigma_grid", "table"))

    def fused_head(self, start: int, end: int, expert: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weight [out, in], bias [out])`` of block ``[start, end)`` (``expert``'s heads): ``Σ_k w_k head_k`` summed
        in float64."""
        if not 0 <= start < end <= self.pdd_steps:
            raise ValueError(f"block [{start}, {end}) outside the {self.pdd_steps}-interval grid")
        w, b = self.heads[expert][0][start:end], self.heads[expert][1][start:end]
        c = block_weights(self.fine_sigmas, start, end).to(w.device, torch.float64)
        return (c[:, None, None] * w.double()).sum(0).float(), (c[:, None] * b.double()).sum(0).float()

    def velocity_fused(self, x: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning, start: int, end: int,
                       conditional: bool = True) -> torch.Tensor:
        """Block ``[start, end)``'s mean velocity (float32) from one forward: ``x_end = x_start + (σ_end − σ_start) ·`` this
        (each expert's ``proj_out`` replaced by its own fused heads: the forward runs the expert of ``timesteps``)."""
        handles = []
        for expert, module in enumerate(self.head_transformers()):
            weight, bias = self.fused_head(start, end, expert)

            def project(m: torch.nn.Module, args: tuple, output: torch.Tensor, weight=weight, bias=bias) -> torch.Tensor:
                hidden = args[0]
                return F.linear(hidden, weight.to(hidden.dtype), bias.to(hidden.dtype))

            handles.append(module.proj_out.register_forward_hook(project))
        try:
            return self.forward(x, timesteps, cond, conditional).float()  # type: ignore[attr-defined]  (the family's)
        finally:
            for handle in handles:
                handle.remove()


class PDDWanDenoiser(HeadBankDenoiser, WanDenoiser):
    """A PDD student: the trunk of :class:`WanDenoiser` with a bank of ``pdd_steps`` output heads
    read from ``heads_file`` (module doc)."""

    def __init__(self, transformer: torch.nn.Module, shift: float, pdd_steps: int, heads_file: Path,
                 num_train_timesteps: int = 1000, *, layout: WanLayout | None = None) -> None:
        WanDenoiser.__init__(self, transformer, shift, num_train_timesteps, layout=layout)
        self.load_head_bank(pdd_steps, heads_file)  # two experts: each its own heads (module doc)
