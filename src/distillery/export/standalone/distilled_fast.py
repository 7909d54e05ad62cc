"""How an exported distilled Wan samples fast on a GPU, and stays stock where it must (stdlib + torch + diffusers;
FlashAttention-4, Triton and torchao only where installed).

A :class:`SpeedSettings` (every switch ``auto`` by default) becomes, for the device the pipeline samples on, a
:class:`SpeedPlan`: what will actually run, with the reason for each part that stays stock.
:func:`apply_speed_plan` then changes the pipeline's modules in place, once, before its first video:

- **attention** ``fa4``: every self-attention (``attn1``) runs FlashAttention-4's forward (``flash_attn.cute``)
  through the torch custom op ``distilled_wan::fa4_forward`` (opaque to ``torch.compile``); a block-causal
  student's chunks each attend their key prefix in one FA4 call. Needs a CUDA device of compute capability 9.0+
  (Hopper, Blackwell), bf16/fp16 weights and ``flash_attn.cute`` importable (``pip install flash-attn-4``, or
  distillery's ``[gpu]`` extra). Else ``sdpa``: diffusers' processors as loaded (the stock path). Cross-attention
  (text keys) is always diffusers'.
- **compile** ``blocks``: each transformer block compiled (regional: diffusers' ``compile_repeated_blocks``, one
  graph for all blocks) in ``compile_mode`` (``default``, or ``max-autotune-no-cudagraphs``). Needs CUDA. The first
  video after load pays the compile. ``reduce-overhead`` (CUDA graphs) is refused: over regionally compiled Wan
  blocks (diffusers 0.42) a block reads an output that a later graph replay overwrote (seen on an H200), and at the
  export's shapes a forward keeps the GPU busy throughout (distillery's BENCHMARKS.md).
- **decode** ``fused``: the VAE decodes ``chunk_frames`` latent frames per decoder call (sized to the GPU's
  memory) through the leaner residual blocks of :mod:`vae_decode` (Triton kernels from :mod:`vae_kernels` where
  Triton runs), in the VAE's own dtype: the same function as diffusers' frame-by-frame decode, other rounding.
  Needs CUDA and a Wan 2.1 or Wan 2.2 VAE (TI2V-5B's: residual up blocks, 2×2-patchified output) that does not
  tile. Else ``stock``: ``vae.decode``.
- **fp8** (off unless asked): the blocks' linear layers as float8 e4m3 GEMMs with row-wise scales (dynamic
  activations) through torchao's ``Float8DynamicActivationFloat8WeightConfig``. Needs torchao and compute
  capability 8.9+. Off by default: BENCHMARKS.md says how far it moves the samples.

On the CPU every part is stock, so the pipeline computes exactly what it computed before this module existed
(validate's samples, bit for bit, where validate ran the same kernels). :meth:`SpeedPlan.describe` is the one line
the pipeline prints on its first video.
"""
# No ``from __future__ import annotations``: torch.library.custom_op reads the op's annotations.

import importlib
import importlib.util
from dataclasses import dataclass, field

import torch

from .vae_decode import auto_chunk_frames, fused_decode_applies, set_fused_decode

CHOICES = {"attention": ("auto", "fa4", "sdpa"), "compile": ("auto", "blocks", "off"),
           "decode": ("auto", "fused", "stock"), "fp8": ("off", "on")}
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
REFUSED_COMPILE_MODES = {  # mode -> why (module doc)
    "reduce-overhead": "CUDA graphs over regionally compiled Wan blocks read block outputs a later graph replay "
                       "overwrote (diffusers 0.42, seen on an H200); use 'default'",
}
FA4_DTYPES = (torch.bfloat16, torch.float16)
FA4_OP = "distilled_wan::fa4_forward"


@dataclass(frozen=True)
class SpeedSettings:
    """What the user asks for (``auto``: the fast part where it can run, else stock; an explicit fast part that
    cannot run is a ``ValueError`` naming why)."""

    attention: str = "auto"
    compile: str = "auto"
    decode: str = "auto"
    fp8: str = "off"
    compile_mode: str = "default"
    decode_chunk_frames: int | None = None  # None: sized to the GPU (vae_decode.auto_chunk_frames)

    def __post_init__(self) -> None:
        for key, allowed in CHOICES.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key}={getattr(self, key)!r}: one of {', '.join(allowed)}")
        if self.compile_mode in REFUSED_COMPILE_MODES:
            raise ValueError(f"compile_mode={self.compile_mode!r}: {REFUSED_COMPILE_MODES[self.compile_mode]}")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode={self.compile_mode!r}: one of {', '.join(COMPILE_MODES)}")
        if self.decode_chunk_frames is not None and not 1 <= int(self.decode_chunk_frames) <= 1024:
            raise ValueError(f"decode_chunk_frames={self.decode_chunk_frames!r}: an integer in [1, 1024] or None")


@dataclass
class SpeedPlan:
    """What runs: ``attention`` ``fa4``|``sdpa``, ``compiled`` (blocks), ``decode`` ``fused``|``stock``, ``fp8``;
    ``reasons``: why each part that stays stock does."""

    attention: str = "sdpa"
    compiled: bool = False
    compile_mode: str = "default"
    decode: str = "stock"
    decode_chunk_frames: int | None = None
    fp8: bool = False
    reasons: dict[str, str] = field(default_factory=dict)

    @property
    def stock(self) -> bool:
        """Whether nothing of the fast path runs (the pipeline as it samples on a CPU)."""
        return self.attention == "sdpa" and not self.compiled and self.decode == "stock" and not self.fp8

    def describe(self, pipeline: str = "distilled Wan pipeline") -> str:
        """One line: the path taken and why each stock part is stock (``pipeline`` names what took it)."""
        parts = [f"attention {'FlashAttention-4' if self.attention == 'fa4' else 'SDPA (diffusers)'}",
                 f"blocks {'compiled (' + self.compile_mode + ')' if self.compiled else 'eager'}",
                 "VAE decode " + ("fused, " + (f"{self.decode_chunk_frames} latent frames a call"
                                              if self.decode_chunk_frames else "chunks sized to the GPU")
                                  if self.decode == "fused" else "stock (frame by frame)"),
                 f"fp8 GEMMs {'on' if self.fp8 else 'off'}"]
        why = "; ".join(f"{key}: {reason}" for key, reason in self.reasons.items())
        return (f"{pipeline}: " + ("stock path" if self.stock else "fast path") + " — " + ", ".join(parts)
                + (f" ({why})" if why else ""))


def fa4_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why FlashAttention-4 cannot run here (None when it can); the package is checked before the GPU."""
    if device.type != "cuda":
        return f"needs CUDA, sampling on {device.type}"
    if dtype not in FA4_DTYPES:
        return f"needs bf16/fp16 weights, the transformer is {str(dtype).removeprefix('torch.')}"
    try:
        importlib.import_module("flash_attn.cute")
    except Exception as exc:  # ImportError, or a CUDA library that fails to load
        return f"flash_attn.cute does not import ({type(exc).__name__}); pip install flash-attn-4"
    major, minor = torch.cuda.get_device_capability(device)
    return None if major >= 9 else f"needs compute capability 9.0+, this GPU is {major}.{minor}"


def fp8_problem(device: torch.device) -> str | None:
    """Why torchao's float8 GEMMs cannot run here (None when they can)."""
    if device.type != "cuda":
        return f"needs CUDA, sampling on {device.type}"
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install torchao)"
    major, minor = torch.cuda.get_device_capability(device)
    return None if (major, minor) >= (8, 9) else f"needs compute capability 8.9+, this GPU is {major}.{minor}"


def plan_speed(settings: SpeedSettings, device: torch.device, dtype: torch.dtype, vae: torch.nn.Module) -> SpeedPlan:
    """The plan for a transformer of ``dtype`` sampling on ``device`` with ``vae`` (module doc)."""
    plan = SpeedPlan(compile_mode=settings.compile_mode)
    if settings.attention != "sdpa":
        problem = fa4_problem(device, dtype)
        if problem is None:
            plan.attention = "fa4"
        elif settings.attention == "fa4":
            raise ValueError(f"attention='fa4': FlashAttention-4 {problem}")
        else:
            plan.reasons["attention"] = problem
    if settings.compile != "off":
        if device.type == "cuda":
            plan.compiled = True
        elif settings.compile == "blocks":
            raise ValueError(f"compile='blocks' needs CUDA, sampling on {device.type}")
        else:
            plan.reasons["compile"] = f"needs CUDA, sampling on {device.type}"
    if settings.decode != "stock":
        problem = (None if vae.device.type == "cuda" else f"needs the VAE on CUDA, it is on {vae.device.type}")
        if problem is None and not fused_decode_applies(vae):
            problem = "this VAE's decoder is not Wan 2.1's or Wan 2.2's (or it tiles)"
        if problem is None:
            plan.decode, plan.decode_chunk_frames = "fused", settings.decode_chunk_frames
        elif settings.decode == "fused":
            raise ValueError(f"decode='fused' {problem}")
        else:
            plan.reasons["decode"] = problem
    if settings.fp8 == "on":
        problem = fp8_problem(device)
        if problem is not None:
            raise ValueError(f"fp8='on' {problem}")
        plan.fp8 = True
    return plan


def apply_speed_plan(plan: SpeedPlan, transformer: torch.nn.Module, vae: torch.nn.Module | None) -> None:
    """Change ``transformer`` and ``vae`` (None: leave it) in place as ``plan`` says (once; nothing for a stock plan).
    The attention goes first (its processors are what the compiled blocks trace), fp8 before compile."""
    if plan.attention == "fa4":
        install_fa4(transformer)
    if plan.fp8:
        quantize_fp8(transformer)
    if plan.compiled:
        options = {} if plan.compile_mode == "default" else {"mode": plan.compile_mode}
        if getattr(transformer, "_repeated_blocks", None):
            transformer.compile_repeated_blocks(**options)
        else:  # a class diffusers names no repeated blocks for (Cosmos): each of its blocks, as validate compiles them
            for block in transformer.transformer_blocks:
                block.compile(**options)
    if plan.decode == "fused" and vae is not None:
        set_fused_decode(vae, True)


def decode_chunk_frames(plan: SpeedPlan, vae: torch.nn.Module, latent_shape: tuple[int, ...]) -> int:
    """Latent frames per decoder call for latents ``[B, C, T', H', W']`` under ``plan`` (1: diffusers' loop)."""
    if plan.decode != "fused":
        return 1
    if plan.decode_chunk_frames is not None:
        return int(plan.decode_chunk_frames)
    return auto_chunk_frames(vae, tuple(latent_shape), vae.device)


# -- FlashAttention-4 -------------------------------------------------------------------------------------------
def _op_exists() -> bool:
    try:
        torch.ops.distilled_wan.fa4_forward  # noqa: B018  (raises when the op is not defined in this process)
    except (AttributeError, RuntimeError):
        return False
    return True


def _define_fa4_op() -> None:
    """Define the custom op ``distilled_wan::fa4_forward(q, k, v) -> out`` (``[B, L, heads, head_dim]``,
    contiguous) once per process (diffusers may import this module under more than one name)."""
    if _op_exists():
        return

    @torch.library.custom_op(FA4_OP, mutates_args=())
    def fa4_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from flash_attn.cute.interface import _flash_attn_fwd

        return _flash_attn_fwd(q, k, v)[0].contiguous()

    @fa4_forward.register_fake
    def _(q, k, v):
        return q.new_empty((*q.shape[:-1], v.shape[-1]))


def fa4_can_run(x: torch.Tensor) -> bool:
    """Whether the FA4 kernel takes activations ``x``: CUDA, bf16/fp16 (a processor falls back to diffusers' else)."""
    return x.is_cuda and x.dtype in FA4_DTYPES


def fa4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of ``q`` ``[B, Lq, heads, d]`` over ``k``/``v`` ``[B, Lk, heads, d]`` (no mask, scale
    ``1/√d``) through FlashAttention-4 (:func:`install_fa4` defines the op); returns ``[B, Lq, heads, d]`` in
    ``q``'s dtype."""
    return torch.ops.distilled_wan.fa4_forward(q.contiguous(), k.contiguous(), v.contiguous())


def self_attention_qkv(attn, hidden_states: torch.Tensor, rotary_emb) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``attn``'s queries, keys and values ``[B, L, heads, head_dim]`` after ``norm_q``/``norm_k`` and Wan's
    rotary embedding (``rotary_emb``: ``(freqs_cos, freqs_sin)``, or None), as diffusers' ``WanAttnProcessor``."""
    from diffusers.models.transformers.transformer_wan import _get_qkv_projections

    query, key, value = _get_qkv_projections(attn, hidden_states, None)
    query, key = attn.norm_q(query), attn.norm_k(key)
    query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
    if rotary_emb is not None:
        query = apply_rotary(query, rotary_emb[0], rotary_emb[1])
        key = apply_rotary(key, rotary_emb[0], rotary_emb[1])
    return query, key, value


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding of ``x`` ``[B, L, heads, head_dim]`` (interleaved pairs), as diffusers applies it."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def attention_output(attn, hidden: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """``[B, L, heads, head_dim]`` attention → the layer's output (``to_out``), as diffusers finishes it."""
    hidden = hidden.flatten(2, 3).type_as(query)
    return attn.to_out[1](attn.to_out[0](hidden))


class FA4SelfAttnProcessor:
    """``attn1`` of a bidirectional block: self-attention through :func:`fa4_attention` for CUDA bf16/fp16
    activations; anything else (a mask, another dtype or device, an image-conditioned layer) is diffusers'."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if (encoder_hidden_states is not None or attention_mask is not None or attn.add_k_proj is not None
                or not fa4_can_run(hidden_states)):
            from diffusers.models.transformers.transformer_wan import WanAttnProcessor

            stock = WanAttnProcessor()
            stock._attention_backend, stock._parallel_config = self._attention_backend, self._parallel_config
            return stock(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        query, key, value = self_attention_qkv(attn, hidden_states, rotary_emb)
        return attention_output(attn, fa4_attention(query, key, value), query)


def install_fa4(transformer: torch.nn.Module) -> None:
    """Every block's self-attention through FA4: a block-causal processor (it has ``fa4``) is switched over, any
    other ``attn1`` gets a :class:`FA4SelfAttnProcessor`."""
    _define_fa4_op()
    for block in transformer.blocks:
        processor = block.attn1.processor
        if hasattr(processor, "fa4"):
            processor.fa4 = True
        elif not isinstance(processor, FA4SelfAttnProcessor):
            block.attn1.set_processor(FA4SelfAttnProcessor())


# -- float8 GEMMs --------------------------------------------------------------------------------------------------
def quantize_fp8(transformer: torch.nn.Module) -> None:
    """The blocks' ``nn.Linear`` layers (attention projections and feed-forward; not the embedders or the head)
    as float8 e4m3 GEMMs with row-wise scales through torchao (weights quantized once, activations per call)."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    for block in transformer.blocks:
        quantize_(block, config, filter_fn=lambda module, _name: isinstance(module, torch.nn.Linear)
                  and module.in_features % 16 == 0 and module.out_features % 16 == 0)
