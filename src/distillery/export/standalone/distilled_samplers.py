"""The samplers of an exported distilled Wan, built from its ``sampling.json`` (stdlib + torch only).

A sampling contract (``sampling.json``)::

    {"sampler": "euler" | "few_step_x0" | "causal_streaming" | "pdd_fused",
     "shift": 3.0, "num_train_timesteps": 1000,   # absent/null: the scheduler's shift, 1000
     "sigma_grid": "linspace",                     # the σ grid's form (distilled_schedule); absent: the denoiser's
     "num_steps": 4, "guidance_scale": 1.0,       # defaults of a call (guidance 1: no CFG)
     "guidance_scale_2": 3.0,                      # two experts only: the low-noise expert's scale (absent: guidance_scale)
     ...}                                          # the sampler's own keys (below)

Two experts (Wan 2.2 A14B): as diffusers' ``WanPipeline``, ``guidance_scale`` guides the steps at ``t >= boundary_ratio ·
num_train_timesteps`` (the high-noise ``transformer``) and ``guidance_scale_2`` the steps below (``transformer_2``); CFG
runs when ``guidance_scale > 1`` (:func:`step_scale`).

- ``euler`` (``chunk_size``): Euler on diffusers' σ grid with CFG ``u + w (c − u)`` when ``w > 1``;
  with ``chunk_size`` every frame is denoised in step under the block-causal mask. NFE/video: steps × branches.
  With ``given_first_frame`` (a causal image-to-video student): frame 0 is the given frame's clean latent, written
  once to a KV cache at t = 0 (+ branches forwards), frames 1 … T − 1 denoised in step against it.
- ``few_step_x0`` (``timesteps``, ``renoise``): at each ladder timestep predict ``x0 = x_t − σ v``, re-noise it to
  the next one with fresh noise (``sde``, default) or take the Euler step there (``ode``); returns the last x0.
  NFE/video: steps × branches.
- ``causal_streaming`` (``timesteps``, ``chunk_size``, ``context_noise``, ``renoise``): the ladder of
  ``few_step_x0`` chunk by chunk, each chunk attending to the earlier ones through the KV cache; a
  finished chunk is written to the cache by one more forward (at ``context_noise``, fresh noise when
  > 0), except the last. NFE/video: branches × (chunks × steps + chunks − 1); per chunk: steps (+1 write).
  With ``given_first_frame`` (a causal image-to-video student): frame 0 is the given frame's clean latent (the first
  frame condition's latent frame 0), written to the cache at t = 0 first (+ branches forwards) and returned as it is;
  the chunks start at frame 1 (the video: 1 + k · chunk_size latent frames).
- ``pdd_fused`` (``pdd_steps``, ``block_size_max``): N blocks of the ``pdd_steps``-interval fine grid,
  one fused-head forward each. NFE/video: N × branches.

Noise: one ``torch.Generator`` (or None: torch's global RNG) draws, in order, the initial latents
``[B, C, T, H, W]`` (as diffusers' ``randn_tensor`` draws them) and then every re-noise draw, on the
generator's device. Latents stay float32 between steps. Errors are ``ValueError`` naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from .distilled_schedule import (
    SIGMA_GRIDS,
    block_partition,
    chunk_bounds,
    euler_step,
    inference_sigmas,
    inference_timesteps,
    renoise,
    widest_block,
    x0_from_velocity,
)
from .distilled_wan import Conditioning

COMMON_KEYS = ("sampler", "shift", "num_train_timesteps", "sigma_grid", "num_steps", "guidance_scale", "guidance_scale_2")
CACHE_TAGS = ("cond", "uncond")  # the conditional / unconditional passes' KV caches


def cfg_enabled(guidance_scale: float) -> bool:
    """Whether classifier-free guidance runs (a second, unconditional forward): ``w > 1``, as WanPipeline."""
    return guidance_scale > 1.0


def guide(predict, guidance_scale: float, weight: float | None = None) -> torch.Tensor:
    """``u + w (c − u)`` of ``predict(conditional)``: the conditional call alone when ``guidance_scale ≤ 1``; ``w`` is
    ``weight`` (the step's expert's scale, :func:`step_scale`) or, None, ``guidance_scale``."""
    c = predict(True)
    if not cfg_enabled(guidance_scale):
        return c
    u = predict(False)
    return u + (guidance_scale if weight is None else weight) * (c - u)


def step_scale(model: Any, timestep: float, guidance_scale: float, guidance_scale_2: float | None) -> float:
    """The CFG scale of a step at ``timestep``: ``guidance_scale_2`` where ``model`` has two experts and the step is
    the low-noise one's (below its ``boundary_timestep``), else ``guidance_scale`` (module doc)."""
    boundary = getattr(model, "boundary_timestep", None)
    if guidance_scale_2 is not None and boundary is not None and float(timestep) < boundary:
        return float(guidance_scale_2)
    return float(guidance_scale)


def check_guidance_2(model: Any, guidance_scale: float, guidance_scale_2: float | None, name: str) -> None:
    """A ``guidance_scale_2`` needs two experts, and ``guidance_scale > 1`` when it is above 1 (diffusers runs CFG only
    then): ``ValueError`` otherwise."""
    if guidance_scale_2 is None:
        return
    if getattr(model, "boundary_timestep", None) is None:
        raise ValueError(f"sampler {name}: guidance_scale_2 is the low-noise expert's CFG scale; this model has one expert")
    if cfg_enabled(guidance_scale_2) and not cfg_enabled(guidance_scale):
        raise ValueError(f"sampler {name}: guidance_scale_2 {guidance_scale_2:g} with guidance_scale {guidance_scale:g}: "
                         "CFG runs only when guidance_scale > 1; set guidance_scale above 1 too")


def draw(generator: torch.Generator | None, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Standard normal float32 ``shape`` from ``generator`` (on its device), moved to ``device``."""
    where = generator.device if generator is not None else torch.device(device)
    return torch.randn(shape, generator=generator, device=where, dtype=torch.float32).to(device)


def _positive_int(value: Any, key: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"sampler {name}: {key} must be an integer >= 1, got {value!r}")
    return value


class Sampler:
    """A sampler configured by a contract; subclasses set ``name``, ``option_keys``, ``default_num_steps``."""

    name: ClassVar[str] = ""
    option_keys: ClassVar[tuple[str, ...]] = ()
    default_num_steps: ClassVar[int] = 4

    def __init__(self, contract: Mapping[str, Any]) -> None:
        unknown = sorted(set(contract) - set(COMMON_KEYS) - set(self.option_keys))
        if unknown:
            raise ValueError(f"sampling contract for {self.name!r}: unknown key {unknown[0]!r}; valid: "
                             f"{', '.join(COMMON_KEYS + self.option_keys)}")
        self.contract = dict(contract)
        shift, scale, steps = contract.get("shift"), contract.get("num_train_timesteps"), contract.get("num_steps")
        self.shift = None if shift is None else float(shift)
        self.num_train_timesteps = None if scale is None else int(scale)
        self.num_steps = None if steps is None else int(steps)
        self.sigma_grid = contract.get("sigma_grid")
        if self.sigma_grid is not None and self.sigma_grid not in SIGMA_GRIDS:
            raise ValueError(f"sampling contract for {self.name!r}: sigma_grid {self.sigma_grid!r}; expected one of "
                             f"{', '.join(SIGMA_GRIDS)}")
        guidance = contract.get("guidance_scale", 1.0)
        self.guidance_scale = float(guidance if guidance is not None else 1.0)
        second = contract.get("guidance_scale_2")
        self.guidance_scale_2 = None if second is None else float(second)
        for key, value in (("shift", self.shift), ("num_train_timesteps", self.num_train_timesteps),
                           ("num_steps", self.num_steps)):
            if value is not None and value <= 0:
                raise ValueError(f"sampling contract for {self.name!r}: {key} must be > 0, got {value}")
        self.configure({k: contract[k] for k in self.option_keys if k in contract})

    def configure(self, options: dict[str, Any]) -> None:
        del options

    def resolve_steps(self, num_steps: int | None) -> int:
        steps = num_steps if num_steps is not None else self.num_steps if self.num_steps is not None else self.default_num_steps
        if int(steps) < 1:
            raise ValueError(f"sampler {self.name}: num_steps must be >= 1, got {steps}")
        return int(steps)

    def resolve_guidance(self, guidance_scale: float | None) -> float:
        return float(guidance_scale) if guidance_scale is not None else self.guidance_scale

    def resolve_guidance_2(self, model: Any, guidance_scale: float, guidance_scale_2: float | None) -> float | None:
        """The low-noise expert's scale of a call (the call's, else the contract's; None: ``guidance_scale``'s),
        checked against ``model`` (:func:`check_guidance_2`)."""
        second = float(guidance_scale_2) if guidance_scale_2 is not None else self.guidance_scale_2
        check_guidance_2(model, guidance_scale, second, self.name)
        return second

    def schedule(self, own_shift: float) -> tuple[float, int]:
        """``(shift, num_train_timesteps)`` of a call: the contract's, else the model's shift and 1000."""
        return (self.shift if self.shift is not None else float(own_shift),
                self.num_train_timesteps if self.num_train_timesteps is not None else 1000)

    def grid(self, model: Any) -> str:
        """The σ grid's form of a call: the contract's, else the denoiser's (``table`` where it names none)."""
        return self.sigma_grid if self.sigma_grid is not None else str(getattr(model, "sigma_grid", "table"))

    def model_kind(self) -> dict[str, Any]:
        """What the denoiser must be: ``{"chunk_size": n}`` (causal), ``{"pdd_steps": p}`` (PDD) or ``{}``."""
        return {}

    def nfe(self, num_steps: int | None = None, guidance_scale: float | None = None, num_frames: int | None = None) -> int:
        """Transformer forwards per video (``num_frames``: latent frames, for streaming)."""
        del num_frames
        return self.resolve_steps(num_steps) * (2 if cfg_enabled(self.resolve_guidance(guidance_scale)) else 1)

    def sample(self, model: Any, cond: Conditioning, latent_shape: tuple[int, int, int, int],
               generator: torch.Generator | None, *, num_steps: int | None = None,
               guidance_scale: float | None = None, guidance_scale_2: float | None = None) -> torch.Tensor:
        """Normalised latents ``float32 [B, C, T, H, W]`` on the model's device."""
        raise NotImplementedError


def _on(cond: Conditioning, device: torch.device) -> Conditioning:
    return cond.to(device)


def _chunk_size(value: Any, name: str) -> int | None:
    return None if value is None else _positive_int(value, "chunk_size", name)


def _given_first_frame(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"sampler {name}: given_first_frame must be true or false, got {value!r}")
    return value


def _causal_kind(chunk_size: int | None, given_first_frame: bool) -> dict[str, Any]:
    if chunk_size is None:
        return {}
    return {"chunk_size": chunk_size, **({"given_first_frame": True} if given_first_frame else {})}


def _check_causal(model: Any, chunk_size: int, given_first_frame: bool, name: str) -> None:
    if int(getattr(model, "chunk_size", -1)) != chunk_size or bool(getattr(model, "given_first_frame", False)) != given_first_frame:
        raise ValueError(f"sampler {name} needs a causal model with chunk_size {chunk_size}"
                         + (" whose frame 0 is the given frame" if given_first_frame else ""))


def first_latent(cond: Conditioning, latent_channels: int, batch: int) -> torch.Tensor:
    """The given frame's clean latent ``[B, C, 1, H, W]`` (float32): latent frame 0 of the first-frame condition's
    latent part (its last ``latent_channels`` channels, after the mask)."""
    first = cond.first_frame
    if first is None:
        raise ValueError("an image-to-video transformer samples from a first frame: pass image= (or first_frame=)")
    return first[:, first.shape[1] - latent_channels:, :1].float().expand(batch, -1, -1, -1, -1)


class EulerSampler(Sampler):
    name = "euler"
    option_keys = ("chunk_size", "given_first_frame")
    default_num_steps = 40

    def configure(self, options: dict[str, Any]) -> None:
        self.chunk_size = _chunk_size(options.get("chunk_size"), self.name)
        self.given_first_frame = _given_first_frame(options.get("given_first_frame"), self.name)
        if self.given_first_frame and self.chunk_size is None:
            raise ValueError("sampler euler: given_first_frame is a causal student's layout; the contract names no chunk_size")

    def model_kind(self) -> dict[str, Any]:
        return _causal_kind(self.chunk_size, self.given_first_frame)

    def nfe(self, num_steps=None, guidance_scale=None, num_frames=None) -> int:
        """steps × branches, + branches for a given first frame's cache write."""
        branches = 2 if cfg_enabled(self.resolve_guidance(guidance_scale)) else 1
        return branches * (self.resolve_steps(num_steps) + int(self.given_first_frame))

    def _ladder(self, model, num_steps, guidance_scale):
        """``(steps, guidance, sigmas [steps + 1] on the model's device, timesteps [steps])`` of one call."""
        steps, guidance = self.resolve_steps(num_steps), self.resolve_guidance(guidance_scale)
        shift, scale = self.schedule(model.shift)
        sigmas = inference_sigmas(shift, steps, scale, self.grid(model)).to(model.device)
        return steps, guidance, sigmas, sigmas[:-1] * scale

    @torch.no_grad()
    def sample(self, model, cond, latent_shape, generator, *, num_steps=None, guidance_scale=None, guidance_scale_2=None):
        if self.given_first_frame:
            return self._sample_given_first_frame(model, cond, latent_shape, generator, num_steps, guidance_scale,
                                                  guidance_scale_2)
        batch = cond.text_embeds.shape[0]
        steps, guidance, sigmas, timesteps = self._ladder(model, num_steps, guidance_scale)
        second = self.resolve_guidance_2(model, guidance, guidance_scale_2)
        device = model.device
        x = draw(generator, (batch, *latent_shape), device)
        cond = _on(cond, device)
        for i in range(steps):
            t = timesteps[i].expand(batch)
            v = guide(lambda conditional: model.velocity(x, t, cond, conditional), guidance,
                      step_scale(model, float(timesteps[i]), guidance, second))
            x = euler_step(x, v, sigmas[i], sigmas[i + 1])
        return x

    def _sample_given_first_frame(self, model, cond, latent_shape, generator, num_steps, guidance_scale, guidance_scale_2):
        """Frame 0 cached clean at t = 0 once, frames 1 … T − 1 denoised in step against it (module doc)."""
        _check_causal(model, self.chunk_size, True, self.name)
        batch = cond.text_embeds.shape[0]
        c, frames = int(latent_shape[0]), int(latent_shape[1])
        chunk_bounds(frames, self.chunk_size, True)  # a length that does not fit: before any forward
        steps, guidance, sigmas, timesteps = self._ladder(model, num_steps, guidance_scale)
        second = self.resolve_guidance_2(model, guidance, guidance_scale_2)
        device = model.device
        whole = draw(generator, (batch, *latent_shape), device)
        cond = _on(cond, device)
        first = first_latent(cond, c, batch)

        def streamed(x: torch.Tensor, t: torch.Tensor, start: int, store: bool) -> torch.Tensor:
            return guide(lambda conditional: model.velocity_streaming(
                x, t, cond, tag=CACHE_TAGS[0 if conditional else 1], store_kv=store, start_frame=start,
                conditional=conditional), guidance, step_scale(model, float(t[0]), guidance, second))

        model.clear_caches()
        try:
            streamed(first, torch.zeros(batch, dtype=torch.float32, device=device), 0, True)
            x = whole[:, :, 1:]
            for i in range(steps):
                v = streamed(x, timesteps[i].expand(batch), 1, False)
                x = euler_step(x, v, sigmas[i], sigmas[i + 1])
        finally:
            model.clear_caches()
        return torch.cat([first, x], dim=2)


class LadderSampler(Sampler):
    """Over a descending timestep ladder: the contract's ``timesteps``, else the K-step Euler grid's K timesteps."""

    def configure_ladder(self, options: dict[str, Any]) -> None:
        ts = options.get("timesteps")
        self.timesteps: list[float] | None = None
        if ts is None:
            return
        ts = [float(t) for t in ts]
        scale = self.num_train_timesteps or 1000
        if not ts or any(not 0.0 <= t <= scale for t in ts) or any(a <= b for a, b in zip(ts, ts[1:])):
            raise ValueError(f"sampler {self.name}: timesteps must be non-empty and strictly descending in [0, {scale}], got {ts}")
        self.timesteps = ts

    def resolve_steps(self, num_steps: int | None) -> int:
        if self.timesteps is None:
            return super().resolve_steps(num_steps)
        if num_steps is not None and int(num_steps) != len(self.timesteps):
            raise ValueError(f"sampler {self.name}: {num_steps} steps asked of a {len(self.timesteps)}-timestep ladder")
        return len(self.timesteps)

    def ladder(self, shift: float, scale: int, num_steps: int | None, grid: str = "table") -> list[float]:
        steps = self.resolve_steps(num_steps)
        if self.timesteps is not None:
            return list(self.timesteps)
        return [float(t) for t in inference_timesteps(shift, steps, scale, grid)]


class FewStepX0Sampler(LadderSampler):
    name = "few_step_x0"
    option_keys = ("timesteps", "renoise")

    def configure(self, options: dict[str, Any]) -> None:
        self.configure_ladder(options)
        self.renoise_mode = options.get("renoise", "sde")
        if self.renoise_mode not in ("sde", "ode"):
            raise ValueError(f"sampler few_step_x0: renoise must be 'sde' or 'ode', got {self.renoise_mode!r}")

    @torch.no_grad()
    def sample(self, model, cond, latent_shape, generator, *, num_steps=None, guidance_scale=None, guidance_scale_2=None):
        batch = cond.text_embeds.shape[0]
        guidance = self.resolve_guidance(guidance_scale)
        second = self.resolve_guidance_2(model, guidance, guidance_scale_2)
        shift, scale = self.schedule(model.shift)
        ts = self.ladder(shift, scale, num_steps, self.grid(model))
        device = model.device
        shape = (batch, *latent_shape)
        x = draw(generator, shape, device)
        cond = _on(cond, device)
        x0 = x
        for k, t in enumerate(ts):
            step = torch.full((batch,), t, dtype=torch.float32, device=device)
            v = guide(lambda conditional: model.velocity(x, step, cond, conditional), guidance,
                      step_scale(model, t, guidance, second))
            x0 = x0_from_velocity(x, v, t / scale)
            if k + 1 < len(ts):
                if self.renoise_mode == "ode":
                    x = euler_step(x, v, t / scale, ts[k + 1] / scale)
                else:
                    x = renoise(x0, draw(generator, shape, device), ts[k + 1] / scale)
        return x0


class CausalStreamingSampler(LadderSampler):
    name = "causal_streaming"
    option_keys = ("timesteps", "chunk_size", "context_noise", "renoise", "given_first_frame")

    def configure(self, options: dict[str, Any]) -> None:
        self.given_first_frame = _given_first_frame(options.get("given_first_frame"), self.name)
        scale = self.num_train_timesteps or 1000
        self.configure_ladder(options)
        self.chunk_size = _chunk_size(options.get("chunk_size"), self.name)
        if self.chunk_size is None:
            raise ValueError("sampler causal_streaming: the sampling contract names no chunk_size")
        context = options.get("context_noise", 0.0)
        self.context_noise = float(context if context is not None else 0.0)
        if not 0.0 <= self.context_noise < scale:
            raise ValueError(f"sampler causal_streaming: context_noise must be in [0, {scale}), got {self.context_noise}")
        self.renoise_mode = options.get("renoise", "sde")
        if self.renoise_mode not in ("sde", "ode"):
            raise ValueError(f"sampler causal_streaming: renoise must be 'sde' or 'ode', got {self.renoise_mode!r}")

    def model_kind(self) -> dict[str, Any]:
        return _causal_kind(self.chunk_size, self.given_first_frame)

    def nfe(self, num_steps=None, guidance_scale=None, num_frames=None) -> int:
        """branches × (chunks × steps + chunks − 1 cache writes), + branches for a given first frame's write; without
        ``num_frames``: one chunk's, branches × steps."""
        steps = self.resolve_steps(num_steps)
        branches = 2 if cfg_enabled(self.resolve_guidance(guidance_scale)) else 1
        if num_frames is None:
            return branches * steps
        chunks = len(chunk_bounds(int(num_frames), self.chunk_size, self.given_first_frame))
        return branches * (chunks * steps + chunks - 1 + int(self.given_first_frame))

    @torch.no_grad()
    def sample(self, model, cond, latent_shape, generator, *, num_steps=None, guidance_scale=None, guidance_scale_2=None):
        return torch.cat([x0 for _, x0 in self.stream(model, cond, latent_shape, generator, num_steps=num_steps,
                                                       guidance_scale=guidance_scale, guidance_scale_2=guidance_scale_2)],
                         dim=2)

    @torch.no_grad()
    def stream(self, model, cond, latent_shape, generator, *, num_steps=None, guidance_scale=None, guidance_scale_2=None):
        """:meth:`sample` chunk by chunk: yields ``(start frame, latents float32 [B, C, f, H, W])`` as each chunk is
        finished (a given first frame first), before its keys and values are written to the cache for the next; the
        chunks, concatenated in time, are :meth:`sample`'s latents (the same draws in the same order)."""
        _check_causal(model, self.chunk_size, self.given_first_frame, self.name)
        batch = cond.text_embeds.shape[0]
        w = self.resolve_guidance(guidance_scale)
        second = self.resolve_guidance_2(model, w, guidance_scale_2)
        guided = cfg_enabled(w)
        shift, scale = self.schedule(model.shift)
        ts = self.ladder(shift, scale, num_steps, self.grid(model))
        device = model.device
        c, frames, h, wd = latent_shape
        whole = draw(generator, (batch, *latent_shape), device)
        cond = _on(cond, device)
        tags = CACHE_TAGS if guided else CACHE_TAGS[:1]
        model.clear_caches()

        def velocity(x: torch.Tensor, t: float, start: int, store: bool) -> torch.Tensor:
            step = torch.full((batch,), t, dtype=torch.float32, device=device)
            v = model.velocity_streaming(x, step, cond, tag=tags[0], store_kv=store, start_frame=start, conditional=True)
            if not guided:
                return v
            u = model.velocity_streaming(x, step, cond, tag=tags[1], store_kv=store, start_frame=start, conditional=False)
            return u + step_scale(model, t, w, second) * (v - u)

        bounds = chunk_bounds(frames, self.chunk_size, self.given_first_frame)  # a length that does not fit: ValueError
        try:
            if self.given_first_frame:  # frame 0: the given frame's clean latent, cached at t = 0, never denoised
                first = first_latent(cond, c, batch)
                yield 0, first
                velocity(first, 0.0, 0, store=True)
            for start, f in bounds:
                shape = (batch, c, f, h, wd)
                x = whole[:, :, start:start + f]
                x0 = x
                for k, t in enumerate(ts):
                    v = velocity(x, t, start, store=False)
                    x0 = x0_from_velocity(x, v, t / scale)
                    if k + 1 < len(ts):
                        eps = draw(generator, shape, device) if self.renoise_mode == "sde" else x0 + v
                        x = renoise(x0, eps, ts[k + 1] / scale)
                yield start, x0
                if start + f < frames:  # the finished chunk becomes context for the next ones
                    context = x0
                    if self.context_noise > 0:
                        context = renoise(x0, draw(generator, shape, device), self.context_noise / scale)
                    velocity(context, self.context_noise, start, store=True)
        finally:
            model.clear_caches()


class PDDFusedSampler(Sampler):
    name = "pdd_fused"
    option_keys = ("pdd_steps", "block_size_max")

    def configure(self, options: dict[str, Any]) -> None:
        if options.get("pdd_steps") is None:
            raise ValueError("sampler pdd_fused: the contract must name pdd_steps")
        self.pdd_steps = _positive_int(options["pdd_steps"], "pdd_steps", self.name)
        self.block_size_max = _positive_int(options.get("block_size_max", self.pdd_steps), "block_size_max", self.name)

    def model_kind(self) -> dict[str, Any]:
        return {"pdd_steps": self.pdd_steps}

    def partition(self, num_steps: int) -> list[int]:
        """Fine-grid node indices ``[num_steps + 1]`` of the blocks (each at most ``block_size_max`` wide)."""
        if not 1 <= num_steps <= self.pdd_steps:
            raise ValueError(f"sampler pdd_fused: {num_steps} steps cannot split the {self.pdd_steps}-interval grid")
        nodes = block_partition(self.pdd_steps, num_steps)
        if widest_block(nodes) > self.block_size_max:
            raise ValueError(f"sampler pdd_fused: {num_steps} steps need a {widest_block(nodes)}-interval block; the "
                             f"student was trained on blocks of at most {self.block_size_max}")
        return nodes

    def resolve_steps(self, num_steps: int | None) -> int:
        steps = super().resolve_steps(num_steps)
        self.partition(steps)
        return steps

    @torch.no_grad()
    def sample(self, model, cond, latent_shape, generator, *, num_steps=None, guidance_scale=None, guidance_scale_2=None):
        if int(getattr(model, "pdd_steps", -1)) != self.pdd_steps:
            raise ValueError(f"sampler pdd_fused needs a PDD model of {self.pdd_steps} heads")
        batch = cond.text_embeds.shape[0]
        steps, guidance = self.resolve_steps(num_steps), self.resolve_guidance(guidance_scale)
        second = self.resolve_guidance_2(model, guidance, guidance_scale_2)
        nodes = self.partition(steps)
        device = model.device
        shift, scale = self.schedule(model.shift)
        sigmas = inference_sigmas(shift, self.pdd_steps, scale, self.grid(model)).to(device)
        x = draw(generator, (batch, *latent_shape), device)
        cond = _on(cond, device)
        for a, b in zip(nodes, nodes[1:]):
            t = (sigmas[a] * scale).expand(batch)
            v = guide(lambda conditional: model.velocity_fused(x, t, cond, a, b, conditional), guidance,
                      step_scale(model, float(t[0]), guidance, second))
            x = x + (sigmas[b] - sigmas[a]) * v
        return x


SAMPLERS: dict[str, type[Sampler]] = {cls.name: cls for cls in (EulerSampler, FewStepX0Sampler, CausalStreamingSampler,
                                                               PDDFusedSampler)}


def build_sampler(contract: Mapping[str, Any]) -> Sampler:
    """The sampler ``contract["sampler"]`` names, configured by the contract."""
    name = contract.get("sampler") if isinstance(contract, Mapping) else None
    if name not in SAMPLERS:
        raise ValueError(f"sampling contract names sampler {name!r}; this export knows {', '.join(SAMPLERS)}")
    return SAMPLERS[name](contract)
