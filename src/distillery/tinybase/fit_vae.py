"""Fit the tiny ``AutoencoderKLWan`` to short clips on a CPU, and record its latent statistics.

The recipe (measured in TOOLCHAIN.md, "A tiny Wan that learns on 2 CPU cores"):

1. ``init_as_framewise_autoencoder(vae)``: xavier-initialised convs whose past-frame taps are
   zero, and temporal resamplers that copy the current frame, so the VAE starts as a
   per-frame 2D autoencoder and only has to learn time on top of it.
2. ``fit_vae(vae, train, val, cfg)``: Adam on MSE of the *unclamped* decode (``decode``
   clamps to [-1, 1], which gives zero gradient wherever a black background is
   over-shot) plus ``kl_weight`` · KL. Phase 1 trains on single frames (T=1) for the
   warm-up budget; phase 2 on random ``clip_frames``-frame windows (≥ 9, so the chunked,
   cached causal path that longer clips use is exercised). Training runs through the
   same chunked path as ``vae.encode`` / ``vae.decode`` (the temporal resamplers only act
   there); an optional linear lr cooldown ends the budget. Validation uses the real,
   clamped ``encode(...).latent_dist.mode()`` → ``decode`` path the pipeline uses.
3. ``latent_stats`` / ``set_latent_stats``: measure the per-channel mean and std of the
   posterior means and write them into the VAE config as ``latents_mean``/``latents_std``.

Latent normalisation contract (what ``WanPipeline`` assumes): the pipeline decodes a
generated latent ``x`` as ``z = x / (1 / latents_std) + latents_mean`` (per channel), so the
diffusion model must be trained on normalised latents ``x = (z - latents_mean) / latents_std``
where ``z = vae.encode(clip).latent_dist.mode()``. ``normalize_latents`` /
``denormalize_latents`` (in :mod:`distillery.data.encoders`) implement exactly that pair, reading the stats from the VAE config.

Clips everywhere are float tensors ``[N, 3, T, H, W]`` in [-1, 1] with ``T = 4k + 1`` and H, W
multiples of the VAE's spatial factor. PSNR is in dB over the signals mapped to [0, 1]
(peak 1), computed from the mean squared error over the whole clip set.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from distillery.common.errors import UserError

if TYPE_CHECKING:  # diffusers costs seconds to import; functions import it lazily
    from diffusers import AutoencoderKLWan

logger = logging.getLogger("distillery")


@dataclass(frozen=True)
class VAEFitConfig:
    """Budget and optimisation settings for ``fit_vae`` (defaults: the CPU recipe)."""

    seconds: float | None = 240.0  # training wall-clock budget, both phases (s); None = no limit
    max_steps: int | None = None  # optimizer steps, both phases; None = no limit (first limit ends)
    warmup_seconds: float | None = 40.0  # phase 1 (single frames) wall-clock budget (s); None = no limit
    warmup_steps: int | None = None  # phase 1 step cap; None = no cap (first limit ends the phase)
    batch_size: int = 8  # clips (phase 2) or frames (phase 1) per step
    clip_frames: int = 9  # frames per phase-2 training window; 4k+1 and >= 9
    lr: float = 2e-3  # Adam learning rate
    lr_cooldown: float = 0.0  # final fraction of the budget over which lr decays linearly to 0; 0 = constant lr
    kl_weight: float = 1e-4  # weight of the per-element mean KL against the per-pixel MSE
    sample_posterior: bool = True  # train on z ~ q(z|x) (else on its mean); eval always uses the mean
    seed: int = 0  # seeds batch/window choice and posterior noise
    log_every: int = 25  # steps between training log lines / history entries
    eval_every_seconds: float | None = 30.0  # training seconds between val PSNR checks; None = end only
    eval_batch_size: int = 8  # clips per validation forward pass

    def __post_init__(self) -> None:
        if self.seconds is None and self.max_steps is None:
            raise UserError("vae fit needs a budget: set seconds or max_steps")
        if self.clip_frames < 9 or (self.clip_frames - 1) % 4:
            raise UserError(f"clip_frames must be 4k+1 and at least 9, got {self.clip_frames}")
        if self.warmup_seconds is None and self.warmup_steps is None:
            raise UserError("vae fit warm-up needs a limit: set warmup_seconds or warmup_steps (0 skips it)")
        if self.batch_size < 1 or self.log_every < 1 or self.eval_batch_size < 1:
            raise UserError("batch_size, log_every and eval_batch_size must be positive")
        if self.lr <= 0 or self.kl_weight < 0:
            raise UserError("lr must be positive and kl_weight non-negative")
        if not 0.0 <= self.lr_cooldown <= 1.0:
            raise UserError(f"lr_cooldown must be in [0, 1], got {self.lr_cooldown}")


@dataclass
class VAEFitLogEntry:
    """One point of the training history (training time excludes validation time)."""

    step: int  # optimizer steps done so far
    seconds: float  # training wall-clock seconds so far
    phase: str  # "frames" (phase 1) or "clips" (phase 2)
    loss: float  # mean total loss over the steps since the previous entry
    mse: float  # mean unclamped reconstruction MSE (over [-1, 1] signals) over the same steps
    kl: float  # mean per-element KL over the same steps
    val_psnr_db: float | None = None  # validation PSNR at this point, if measured here


@dataclass
class VAEFitReport:
    """What ``fit_vae`` did and how well the result reconstructs the validation clips."""

    steps: int  # optimizer steps taken
    seconds: float  # training wall-clock seconds (validation excluded)
    val_psnr_db: float  # final validation PSNR through encode→mode→decode (clamped), dB
    val_psnr_black_db: float  # PSNR of an all-black (-1) output on the same clips: the trivial baseline
    history: list[VAEFitLogEntry] = field(default_factory=list)  # log/eval points in order


# --------------------------------------------------------------------------------------------- init


def init_as_framewise_autoencoder(vae: AutoencoderKLWan, seed: int = 0) -> AutoencoderKLWan:
    """Re-initialise ``vae`` in place so it starts as a per-frame 2D autoencoder; return it.

    * Every Conv2d / Conv3d (incl. ``WanCausalConv3d``): xavier-uniform weights on the
      current-frame slice (fans of the 2D kernel), zero bias.
    * ``WanCausalConv3d`` with a temporal kernel > 1: all past-frame taps (``weight[:, :, :-1]``)
      zero, so the conv sees only the current frame.
    * Temporal resamplers (``WanResample.time_conv`` of ``downsample3d`` / ``upsample3d``):
      identity on the current frame (the down conv keeps the newest frame of each pair;
      the up conv emits two copies of the current frame), zero bias.

    Norm gains are left at diffusers' defaults. Deterministic given ``seed``.
    """
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanResample

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in vae.modules():
            if isinstance(module, nn.Conv3d):
                module.weight.zero_()
                current = module.weight[:, :, -1]  # [out, in, kh, kw] view of the newest-frame tap
                current.copy_(_xavier(current.shape, g))
            elif isinstance(module, nn.Conv2d):
                module.weight.copy_(_xavier(module.weight.shape, g))
            else:
                continue
            if module.bias is not None:
                module.bias.zero_()
        for module in vae.modules():
            if isinstance(module, WanResample) and hasattr(module, "time_conv"):
                _copy_current_frame(module.time_conv)
    return vae


def _xavier(shape: torch.Size, g: torch.Generator) -> torch.Tensor:
    """Xavier-uniform values for a conv weight ``[out, in, *kernel]``."""
    receptive = math.prod(shape[2:])
    fan_in, fan_out = shape[1] * receptive, shape[0] * receptive
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    return (torch.rand(shape, generator=g) * 2 - 1) * bound


def _copy_current_frame(conv: nn.Conv3d) -> None:
    """Make a ``(k, 1, 1)`` temporal conv with out = m·in channels output m copies of the newest frame."""
    out_ch, in_ch = conv.weight.shape[:2]
    if out_ch % in_ch or conv.weight.shape[3:] != (1, 1):
        raise ValueError(f"unexpected temporal resampler weight {tuple(conv.weight.shape)}")
    conv.weight.zero_()
    eye = torch.eye(in_ch, dtype=conv.weight.dtype)
    for copy in range(out_ch // in_ch):
        conv.weight[copy * in_ch : (copy + 1) * in_ch, :, -1, 0, 0] = eye
    if conv.bias is not None:
        conv.bias.zero_()


# ------------------------------------------------------------------------------ forward helpers


def encode_moments(vae: AutoencoderKLWan, x: torch.Tensor) -> torch.Tensor:
    """Posterior moments ``[B, 2·z_dim, 1 + (T-1)/4, H/s, W/s]`` (mean, logvar) of clips ``x`` [B, 3, T, H, W].

    The same chunked, cached path ``vae.encode`` takes (no slicing or tiling), with gradients.
    """
    return vae._encode(x)


def decode_unclamped(vae: AutoencoderKLWan, z: torch.Tensor) -> torch.Tensor:
    """Decode latents ``z`` [B, z_dim, t, h, w] to ``[B, 3, 1 + 4(t-1), h·s, w·s]`` *without* clamping.

    Replicates ``AutoencoderKLWan._decode`` (per-latent-frame chunks through the cached
    causal decoder) minus its final ``clamp(-1, 1)``, so the loss keeps gradients where the
    output over-shoots the [-1, 1] range. ``decode_unclamped(vae, z).clamp(-1, 1)`` equals
    ``vae.decode(z).sample`` (tests check this against the installed diffusers).
    """
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    outs = []
    for i in range(x.shape[2]):
        vae._conv_idx = [0]
        outs.append(
            vae.decoder(x[:, :, i : i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=i == 0)
        )
    out = torch.cat(outs, dim=2)
    if vae.config.patch_size is not None:
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        out = unpatchify(out, patch_size=vae.config.patch_size)
    vae.clear_cache()
    return out


def _loss(
    vae: AutoencoderKLWan, x: torch.Tensor, cfg: VAEFitConfig, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(total, mse, kl) for a batch of clips ``x`` [B, 3, T, H, W]."""
    moments = encode_moments(vae, x)
    mean, logvar = moments.chunk(2, dim=1)
    logvar = logvar.clamp(-30.0, 20.0)  # as DiagonalGaussianDistribution
    if cfg.sample_posterior:
        z = mean + torch.exp(0.5 * logvar) * torch.randn(mean.shape, generator=g, dtype=mean.dtype)
    else:
        z = mean
    recon = decode_unclamped(vae, z)
    mse = F.mse_loss(recon, x)
    kl = 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).mean()
    return mse + cfg.kl_weight * kl, mse, kl


# ------------------------------------------------------------------------------------ metrics


def psnr_db(mse_pm1: float) -> float:
    """PSNR in dB of a mean squared error measured on [-1, 1] signals, with the signals mapped to [0, 1]."""
    mse01 = mse_pm1 / 4.0
    return float("inf") if mse01 <= 0 else 10.0 * math.log10(1.0 / mse01)


@torch.no_grad()
def reconstruct(vae: AutoencoderKLWan, clips: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """The pipeline's reconstruction of ``clips`` [N, 3, T, H, W]: ``decode(encode(x).latent_dist.mode())``, clamped."""
    outs = []
    for batch in clips.split(batch_size):
        z = vae.encode(batch).latent_dist.mode()
        outs.append(vae.decode(z).sample)
    return torch.cat(outs)


@torch.no_grad()
def val_psnr(vae: AutoencoderKLWan, clips: torch.Tensor, batch_size: int = 8) -> float:
    """PSNR (dB) of ``reconstruct(vae, clips)`` against ``clips``, over the whole set."""
    sq_err, count = 0.0, 0
    for batch in clips.split(batch_size):
        recon = reconstruct(vae, batch, len(batch))
        sq_err += float((recon.double() - batch.double()).pow(2).sum())
        count += batch.numel()
    return psnr_db(sq_err / count)


def black_psnr(clips: torch.Tensor) -> float:
    """PSNR (dB) of an all-black output (every value -1) against ``clips``: the trivial baseline."""
    return psnr_db(float((clips.double() + 1.0).pow(2).mean()))


# ----------------------------------------------------------------------------------------- fit


def fit_vae(
    vae: AutoencoderKLWan, train_clips: torch.Tensor, val_clips: torch.Tensor, cfg: VAEFitConfig = VAEFitConfig()
) -> VAEFitReport:
    """Train ``vae`` in place on ``train_clips``; measure it on ``val_clips``; return the report.

    Clips: float ``[N, 3, T, H, W]`` in [-1, 1]; train T >= ``cfg.clip_frames``; val T any 4k+1.
    Phase 1 ("frames") draws ``batch_size`` random single frames per step until
    ``warmup_seconds`` / ``warmup_steps`` run out; phase 2 ("clips") draws ``batch_size``
    random clips, each cut to a random ``clip_frames`` window, until ``seconds`` /
    ``max_steps`` run out (both count phase 1 too). With ``lr_cooldown`` > 0 the learning
    rate falls linearly to 0 over that final fraction of the budget. Batches, windows and
    posterior noise come from a ``torch.Generator`` seeded with ``cfg.seed`` (CPU kernels may
    still vary in the last bits between runs). Validation time is not counted in the budget. The model is
    left in eval mode, weights fp32 as given. The VAE should be initialised first (see
    ``init_as_framewise_autoencoder``); ``fit_vae`` does not re-initialise it.
    """
    _check_clips("train_clips", train_clips, min_frames=cfg.clip_frames)
    _check_clips("val_clips", val_clips, min_frames=1)
    g = torch.Generator().manual_seed(cfg.seed)
    optimizer = torch.optim.Adam(vae.parameters(), lr=cfg.lr)
    n, _, t_total = train_clips.shape[:3]
    history: list[VAEFitLogEntry] = []
    baseline = black_psnr(val_clips)
    logger.info(
        "fitting VAE on %d clips (%d frames), val %d clips; black baseline %.2f dB; budget %s s / %s steps",
        n, t_total, val_clips.shape[0], baseline, cfg.seconds, cfg.max_steps,
    )

    step, trained = 0, 0.0  # optimizer steps; training seconds (validation excluded)
    next_eval = cfg.eval_every_seconds
    sums = [0.0, 0.0, 0.0]
    since_log = 0
    phase = "frames"
    vae.train()
    while not _over(cfg.seconds, cfg.max_steps, trained, step):
        if phase == "frames" and _over(cfg.warmup_seconds, cfg.warmup_steps, trained, step):
            phase = "clips"
        start = time.perf_counter()
        if phase == "frames":
            idx = torch.randint(0, n, (cfg.batch_size,), generator=g)
            frame = torch.randint(0, t_total, (cfg.batch_size,), generator=g)
            x = train_clips[idx, :, frame].unsqueeze(2)  # [B, 3, 1, H, W]
        else:
            idx = torch.randint(0, n, (cfg.batch_size,), generator=g)
            t0 = torch.randint(0, t_total - cfg.clip_frames + 1, (cfg.batch_size,), generator=g)
            x = torch.stack([train_clips[i, :, s : s + cfg.clip_frames] for i, s in zip(idx.tolist(), t0.tolist())])
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * _lr_factor(cfg, trained, step)
        loss, mse, kl = _loss(vae, x, cfg, g)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        trained += time.perf_counter() - start
        step += 1
        for k, v in enumerate((loss, mse, kl)):
            sums[k] += float(v.detach())
        since_log += 1

        due_eval = next_eval is not None and trained >= next_eval
        if step % cfg.log_every == 0 or due_eval:
            entry = VAEFitLogEntry(step, trained, phase, *(s / since_log for s in sums))
            sums, since_log = [0.0, 0.0, 0.0], 0
            if due_eval:
                entry.val_psnr_db = _evaluate(vae, val_clips, cfg)
                while next_eval is not None and next_eval <= trained:
                    next_eval += cfg.eval_every_seconds
            history.append(entry)
            logger.info(
                "vae step %d (%s) %.0fs: loss %.5f mse %.5f kl %.3f%s",
                step, phase, trained, entry.loss, entry.mse, entry.kl,
                "" if entry.val_psnr_db is None else f" | val {entry.val_psnr_db:.2f} dB",
            )

    final = _evaluate(vae, val_clips, cfg)
    if since_log:
        history.append(VAEFitLogEntry(step, trained, phase, *(s / since_log for s in sums), val_psnr_db=final))
    elif history:
        history[-1].val_psnr_db = final
    vae.eval()
    logger.info("VAE fit done: %d steps, %.0f s, val %.2f dB (black %.2f dB)", step, trained, final, baseline)
    return VAEFitReport(steps=step, seconds=trained, val_psnr_db=final, val_psnr_black_db=baseline, history=history)


def _evaluate(vae: AutoencoderKLWan, val_clips: torch.Tensor, cfg: VAEFitConfig) -> float:
    was_training = vae.training
    vae.eval()
    try:
        return val_psnr(vae, val_clips, cfg.eval_batch_size)
    finally:
        vae.train(was_training)


def _lr_factor(cfg: VAEFitConfig, trained: float, step: int) -> float:
    """Learning-rate multiplier: 1, then linear to 0 over the last ``lr_cooldown`` of the budget.

    Progress is the larger of the time and step fractions spent (limits that are None are ignored).
    """
    if cfg.lr_cooldown <= 0:
        return 1.0
    progress = max(
        trained / cfg.seconds if cfg.seconds else 0.0,
        step / cfg.max_steps if cfg.max_steps else 0.0,
    )
    return min(1.0, max(0.0, (1.0 - progress) / cfg.lr_cooldown))


def _over(seconds: float | None, steps: int | None, trained: float, step: int) -> bool:
    """Whether a (seconds, steps) budget is spent; a None limit never ends it."""
    return (seconds is not None and trained >= seconds) or (steps is not None and step >= steps)


def _check_clips(name: str, clips: torch.Tensor, min_frames: int) -> None:
    if clips.ndim != 5 or clips.shape[1] != 3 or not clips.is_floating_point():
        raise UserError(f"{name} must be a float tensor [N, 3, T, H, W], got {clips.dtype} {tuple(clips.shape)}")
    t = clips.shape[2]
    if clips.shape[0] == 0 or t < min_frames or (t - 1) % 4:
        raise UserError(f"{name} needs at least one clip of 4k+1 >= {min_frames} frames, got {tuple(clips.shape)}")


# ------------------------------------------------------------------------------ latent stats


@torch.no_grad()
def latent_stats(vae: AutoencoderKLWan, clips: torch.Tensor, batch_size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (mean, std), each float32 ``[z_dim]``, of the posterior means of ``clips``.

    Statistics pool over clips, latent frames and positions of ``encode(x).latent_dist.mode()``;
    std is the population std. Clips: ``[N, 3, T, H, W]`` in [-1, 1].
    """
    was_training = vae.training
    vae.eval()
    total = sq = None
    count = 0
    try:
        for batch in clips.split(batch_size):
            z = vae.encode(batch).latent_dist.mode().double()
            flat = z.transpose(0, 1).reshape(z.shape[1], -1)
            total = flat.sum(1) if total is None else total + flat.sum(1)
            sq = flat.pow(2).sum(1) if sq is None else sq + flat.pow(2).sum(1)
            count += flat.shape[1]
    finally:
        vae.train(was_training)
    mean = total / count
    std = (sq / count - mean.pow(2)).clamp_min(0).sqrt()
    return mean.float(), std.float()


def set_latent_stats(
    vae: AutoencoderKLWan, mean: Sequence[float] | torch.Tensor, std: Sequence[float] | torch.Tensor
) -> None:
    """Write ``latents_mean`` / ``latents_std`` (``[z_dim]`` each, std > 0) into ``vae.config``.

    ``save_pretrained`` then stores them in ``config.json``, where ``WanPipeline`` reads them.
    """
    mean_l = [float(v) for v in (mean.tolist() if isinstance(mean, torch.Tensor) else mean)]
    std_l = [float(v) for v in (std.tolist() if isinstance(std, torch.Tensor) else std)]
    z_dim = vae.config.z_dim
    if len(mean_l) != z_dim or len(std_l) != z_dim:
        raise UserError(f"latent stats need {z_dim} values each, got {len(mean_l)} and {len(std_l)}")
    if not all(math.isfinite(v) for v in mean_l) or not all(math.isfinite(v) and v > 0 for v in std_l):
        raise UserError("latents_mean must be finite and latents_std finite and positive")
    vae.register_to_config(latents_mean=mean_l, latents_std=std_l)
