"""Samplers shared by training rollouts, validation and exported pipelines (docs/architecture.md §1).

Latents are ``[B, C, T, H, W]`` in the VAE's normalised latent space. Samplers call the model
plugin (``predict_noise`` → flow velocity ``v = ε − x0``), never a raw diffusers module, and draw
from a noise source (:mod:`.noise`). They are registered by name (:mod:`.registry`) and built from
an artifact's ``sampling.json`` with :func:`build_sampler`:

- ``euler`` (:mod:`.euler`) — many-step Euler ODE with CFG on diffusers' σ grid;
- ``few_step_x0`` (:mod:`.few_step`) — DMD-style x0 prediction + re-noise over a timestep ladder;
- ``causal_streaming`` (:mod:`.causal`) — chunk-by-chunk x0/re-noise through a causal model's KV cache;
- ``pdd_fused`` (:mod:`.pdd`) — parallel decoding: one fused-head forward per block of a PDD student's fine grid.

The flow-matching maths (shift, σ grid, x0 ↔ v, re-noise) lives in :mod:`distillery.models.schedule`.
"""

from distillery.sampling.base import LatentShape, Sampler, cfg_enabled, guided_velocity, nfe_per_video
from distillery.sampling.causal import CausalStreamingSampler  # noqa: E402  (registers "causal_streaming")
from distillery.sampling.euler import EulerSampler  # noqa: E402  (registers "euler")
from distillery.sampling.few_step import FewStepX0Sampler, default_ladder  # noqa: E402  (registers "few_step_x0")
from distillery.sampling.noise import GeneratorNoise, NoiseSource, RNGNoise, as_noise_source
from distillery.sampling.pdd import PDDFusedSampler  # noqa: E402  (registers "pdd_fused")
from distillery.sampling.registry import build_sampler, register_sampler, sampler_class, sampler_names

__all__ = [
    "CausalStreamingSampler",
    "EulerSampler",
    "PDDFusedSampler",
    "FewStepX0Sampler",
    "GeneratorNoise",
    "LatentShape",
    "NoiseSource",
    "RNGNoise",
    "Sampler",
    "as_noise_source",
    "build_sampler",
    "cfg_enabled",
    "default_ladder",
    "guided_velocity",
    "nfe_per_video",
    "register_sampler",
    "sampler_class",
    "sampler_names",
]
