"""Samplers shared by training rollouts, validation and exported pipelines (DESIGN.md §1 sampling/).

Latents are ``[B, C, T, H, W]`` in the VAE's normalised latent space; the transformer is a plain
``diffusers.WanTransformer3DModel`` predicting the flow velocity ``v = ε − x0``.
"""

from distillery.sampling.euler import (
    EulerSampler,
    cfg_enabled,
    few_step_timesteps,
    few_step_x0,
    guided_velocity,
    initial_noise,
    nfe_per_video,
)

__all__ = [
    "EulerSampler",
    "cfg_enabled",
    "few_step_timesteps",
    "few_step_x0",
    "guided_velocity",
    "initial_noise",
    "nfe_per_video",
]
