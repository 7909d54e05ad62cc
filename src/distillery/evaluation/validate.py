"""Validation: sample every candidate model on the same prompts and noise, and score the videos.

For each :class:`Candidate` (a teacher at several step counts counts as several candidates, see
:func:`~distillery.evaluation.candidates.teacher_candidates`), each prompt ``i`` and each seed index ``j < cfg.num_seeds``,
:func:`run_validation` samples one video with the sampler its sampling contract names (built from
:mod:`distillery.sampling`'s registry and run through a frozen model plugin that the folder's model
family loads, :func:`distillery.models.registry.load_inference_model`), starting from the same initial noise for every
candidate: a ``torch.Generator().manual_seed(cfg.seed + i + SEED_STRIDE·j)`` (``SEED_STRIDE`` = 1000;
see :func:`generator_seed`; seed index 0 is ``cfg.seed + i``, what a single-seed run draws). Text
embeddings come from the base's text encoder (empty prompt as the CFG negative), or are the ones it
made earlier for the latent set (:class:`PromptEmbeddings`), and every video is
decoded through the base's VAE (float32, or bfloat16 with ``vae_precision``). The candidates run in
``precision``; with ``compile`` (null: on for bf16 on CUDA) each transformer block is compiled (regional
compilation: one graph for all blocks, compiled during a candidate's warm-up). Given a :class:`~distillery.evaluation.sample_cache.SampleCache`, a
candidate whose weights, sampling contract and run settings did not change since it was last sampled
is not sampled again: its videos and per-video scores come from the cache, and everything measured
against the reference is computed again from them (bitwise what sampling it again here gives; the
log and report.json ``cache`` say which were reused). Per candidate it reports (``S`` = ``num_seeds``, ``P`` = prompts):

- ``colour``, ``shape``, ``direction``, ``all`` — prompt adherence read back from the decoded
  frames by :mod:`distillery.clips.analyzer` (thresholds from ``base_dir/analyzer.json`` when it
  exists), as fractions of the P·S videos — only where every prompt is a caption of the synthetic clips'
  grammar (:func:`distillery.clips.grammar.parse_caption`), the only captions the analyzer reads: on other
  prompts (one's own data) these metrics (and their ``_std``) are left out of ``metrics.json``, the plot
  and ``per_*`` tables, and ``summary.md`` marks them n/a (report.json ``adherence``), never a 0.00 that
  cannot apply;
- ``latency_s`` — the median wall seconds per video for sampling + VAE decode (batch 1 unless
  ``sample_batch`` says more: then a batch's wall time / its size; text encoding excluded) over the
  candidate's videos after its first :data:`~distillery.evaluation.video_scores.WARMUP_VIDEOS` (one untimed warm-up forward runs before them
  too; lazy initialisation, kernel selection and compilation make the first videos slower than the rest,
  so they are timed but left out; a candidate with no more videos than that keeps them all), and
  ``latency_s_iqr`` its spread: the interquartile range (75th − 25th percentile) of the same times;
  report.json ``latency`` has min, max, the warm-up times and ``sample_batch``, and ``timeline`` per sampled
  candidate where its wall time went: ``load_s`` (load + warm-up), ``sampling_unix`` (the window from the first video's
  start to the last one's decode, unix seconds: a profiler's GPU-busy samples can be cut to it),
  ``sampling_s``, ``finishing_previous_s`` (the part of that window spent between two of its batches finishing the
  candidate before it, whose line is logged as soon as its scoring is done: the log reads in order; no video's
  time includes it) and ``scoring_wait_s`` (the wait for the candidate's scoring threads; they run on while the
  next candidate loads and samples, so only the last candidate's wait is all idle device time);
- ``distance_to_teacher`` — mean over videos of the mean squared difference of the decoded frames
  (RGB in [0, 1]) from the reference candidate's video with the same prompt and noise (the
  reference is by default the first candidate: put the teacher first), so the reference scores 0;
- ``sharpness`` — mean over videos of :func:`distillery.evaluation.video_metrics.sharpness` (per frame the
  variance of the Laplacian of the luminance in [0, 1], averaged over frames; blurry few-step
  samples score lower);
- ``<metric>_std`` for each of the above but latency — the spread over noise: the sample standard deviation
  (ddof=1; 0 with one seed) across seed indices ``j`` of the per-seed means (each the mean over the
  P prompts of seed index ``j``). The headline ``<metric>`` is the mean over all P·S videos (= the
  mean of the per-seed means);
- ``frechet_distance`` — distribution-level distance to the reference: the Fréchet distance
  (squared, as FID) between Gaussian fits of the per-video feature vectors of
  :mod:`distillery.evaluation.video_metrics` (``FEATURE_NAMES``: analyzer shape/area/velocity readings and frame
  statistics) over the candidate's P·S videos and the reference's, all standardised by the
  reference's per-feature mean and standard deviation, covariances + ``COV_EPS``·I. The reference
  scores exactly 0;
- ``frechet_distance_std`` — bootstrap spread: the standard deviation (ddof=1) of the distance over
  ``cfg.bootstrap_resamples`` resamples (with replacement) of the candidate's videos against the
  fixed reference set, indices drawn by ``numpy.random.default_rng(cfg.seed)`` (the same draws for
  every candidate; 0 when ``bootstrap_resamples`` < 2);
- ``nfe`` — transformer forward evaluations per video, as the sampler counts them for the video's latent
  length (one-forward-per-step samplers: steps × (2 with CFG, else 1); causal streaming: branches ×
  (chunks × steps + chunks − 1 cache writes)) (no spread; report.json ``candidates[].forwards`` and
  ``summary.md`` split it per chunk: :func:`forwards`);
- and for the reference only, when ``num_seeds`` >= 2, ``frechet_floor`` — the Fréchet distance
  between the reference's own seed-0 and seed-1 videos (P each, same standardisation): the
  distance that sampling noise alone produces. It compares sets of P videos, not P·S, so it
  overstates the noise in ``frechet_distance`` somewhat; a candidate near it is indistinguishable.
- ``kid``, ``kid_lo``, ``kid_hi`` — the unbiased kernel inception distance (:mod:`distillery.evaluation.kid`:
  MMD² under the cubic polynomial kernel, ≈ 0 for two samples of one distribution at any size) between
  the same standardised features and the reference's, and its 95% bootstrap interval (both sets
  resampled, ``cfg.bootstrap_resamples`` times, ``default_rng(cfg.seed)``; left out for a candidate of one
  video: the unbiased estimate needs two a side); the reference scores 0 and,
  with ``num_seeds`` >= 2 and >= 2 prompts, adds ``kid_floor`` (its seed-0 vs seed-1 KID, as
  ``frechet_floor``);
- with the floors, for every other candidate ``kid_resolved`` / ``frechet_resolved`` — 1 when its
  difference from the reference is resolved at this size (``kid_lo`` > max(kid_floor, 0); Fréchet:
  ``frechet_distance − 1.96·frechet_distance_std`` > ``frechet_floor``), else 0 (within sampling noise);
- with ``cfg.clip_model`` (a CLIP folder in transformers' layout; None: none of these, nothing else
  changes), ``clip_text`` (CLIP text–video similarity), ``clip_consistency`` (CLIP frame-to-frame
  consistency) and ``motion`` (mean absolute frame difference, RGB in [0, 1]) — each the mean over the
  candidate's P·S videos with ``<score>_lo`` / ``<score>_hi``, its 95% bootstrap interval
  (``cfg.bootstrap_resamples`` resamples of the videos, ``default_rng(cfg.seed)``): contracts in
  :mod:`distillery.evaluation.clip_scores`. They are read from each video's frames every run, a reused
  candidate's from its cached frames (the sample cache keeps no CLIP score, so another ``clip_model``
  rescores every candidate without sampling any again); per video in ``per_video``, the grid's row
  labels add ``CLIP <clip_text>``, ``plots/adherence.csv`` and :func:`headline_metrics` add them;

Output folder (written to a temporary sibling, then renamed into place)::

    out_dir/samples/<candidate>/<key>.mp4 every video (H.264 lossless yuv444p); <key> = sample_key(i, j):
                                          "<i>" for seed index 0, "<i>_s<j>" for j >= 1
    out_dir/samples/<candidate>/latents.safetensors
                                          the sampler's normalised latents, key <key> → [C, T, H, W]
                                          (float32): what ``WanPipeline(output_type="latent")``
                                          returns for that prompt, generator seed and step count
    out_dir/grid.gif, out_dir/grid.mp4    rows = candidates, columns = prompts (seed index 0 only), labelled in the
                                          video: "<candidate> · <NFE> NFE" left of each row, "#<i>" above each
                                          column, "#<i>  <prompt>" lines below (tiles from report grid.origin_px),
                                          1-px separators; the GIF is a preview: a grid longer than
                                          ``GIF_MAX_PX`` on a side (real-shape tiles) is written every k-th
                                          pixel there, the mp4 at full size
    out_dir/metrics.json                  flat {"<candidate>/<metric>": number}, every metric above,
                                          candidates in input order (:func:`headline_metrics` picks the
                                          few a user compares, what the validate stage gives DVC)
    out_dir/plots/adherence.csv           one row per candidate: candidate, sampler, nfe, adherence,
                                          adherence_std, colour, shape, direction, latency_s,
                                          distance_to_teacher, sharpness, frechet_distance,
                                          frechet_distance_std (DVC plots: x = nfe, y = adherence)
    out_dir/plots/adherence_vs_nfe.png    the same as an image: adherence ± std against NFE per
                                          candidate family (:func:`distillery.evaluation.plots.write_adherence_plot`)
    out_dir/summary.md                    the table a user reads: per candidate NFE beside how a streaming
                                          sampler spends it (chunks × forwards per chunk + KV-cache writes) and
                                          its latency, every score ± spread, reused or sampled; which adherence
                                          readings discriminate (:mod:`distillery.evaluation.summary`)
    out_dir/report.json                   prompts and prompt_source (where they came from, also in summary.md and
                                          the log); adherence (applicable, how many prompts the analyzer reads);
                                          seeds (the seed-0 generator seed per prompt);
                                          num_seeds, seed_grid ([prompt][seed index] → generator
                                          seed) and sample_keys (same shape → <key>); candidates;
                                          per_video (every video: prompt and seed index, scores,
                                          latency, warmup, distance, sharpness, features); latency
                                          (per candidate: median, iqr, min, max, warm-up times); per_seed
                                          (per-seed means); per_prompt (per-prompt means over
                                          seeds: adherence as fractions); frechet (feature names,
                                          the reference's standardisation, bootstrap settings);
                                          candidates[].forwards (per_video, chunks, per_chunk, cache_writes);
                                          adherence_readings (per reading: min, max over candidates and
                                          whether it discriminates); cache (per candidate: its key, reused or
                                          why it was sampled; null without a cache); clip (the CLIP folder,
                                          its sizes and preprocessing, the interval's settings; null without)
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import save_file

from distillery.common.errors import UserError
from distillery.common.fsutil import replace_dir
from distillery.common.videogrid import VideoGrid
from distillery.config.validation import SEED_STRIDE
from distillery.evaluation.candidates import Candidate, forwards
from distillery.evaluation.clip_scores import CLIP_METRICS, CLIP_SCORES
from distillery.evaluation.kid import kid
from distillery.evaluation.kid import resolved as interval_resolved
from distillery.evaluation.sampling_context import PromptEmbeddings, SamplingContext, synchronize
from distillery.evaluation.validation_config import ValidationConfig, generator_seed
from distillery.evaluation.validation_files import CSV_COLUMNS, MP4_PRESET, scoring_workers, write_grid, write_tables
from distillery.evaluation.video_scores import (
    ADHERENCE_METRICS,
    METRIC_NAMES,
    SEEDED_METRICS,
    WARMUP_VIDEOS,
    ScoredVideo,
    adherence_applicability,
    distribution_scores,
    latency_summary,
    mean_table,
    sample_key,
    score_video,
    seeded_summary,
)

if TYPE_CHECKING:
    from distillery.evaluation.sample_cache import SampleCache

log = logging.getLogger("distillery")

# what DVC shows per headline candidate (headline_metrics), under these short names (a narrow `dvc metrics show`):
# adherence and the Fréchet distance to the teacher; the rest (KID — unbiased, so near 0 it can read below 0 —, the
# spreads, NFE, latency) is in report/metrics.json and summary.md
HEADLINE_METRICS = {"all": "all", "frechet_distance": "frechet"}
CLIP_HEADLINE = ("clip_text", "clip_text_lo", "clip_text_hi", "clip_consistency", "clip_consistency_lo",
                 "clip_consistency_hi", "motion", "motion_lo", "motion_hi")  # DVC's too, with validate.clip_model
REFERENCE_ZERO = ("frechet_distance", "kid", "distance_to_teacher")  # the reference's own: 0 by construction, never a headline


def _check_candidates(candidates: list[Candidate], reference: str | None) -> Candidate:
    if not candidates:
        raise UserError("validate: no candidates to sample")
    names = [c.name for c in candidates]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise UserError(f"validate: candidate names must be unique; repeated: {', '.join(dupes)}")
    if reference is None:
        return candidates[0]
    if reference not in names:
        raise UserError(f"validate: reference candidate {reference!r} is not one of {', '.join(names)}")
    return candidates[names.index(reference)]


def headline_metrics(metrics: dict[str, float], candidates: list[str] | None = None,
                     reference: str | None = None) -> dict[str, float]:
    """The few numbers a user compares between runs (what ``dvc metrics show`` and ``dvc exp show`` get)
    out of :func:`run_validation`'s flat metrics: :data:`HEADLINE_METRICS` (and, scored with
    ``clip_model``, :data:`CLIP_HEADLINE`: the CLIP scores and motion with their intervals) of each of
    ``candidates`` (None: every candidate), in the metrics' order, without the ``reference``'s own
    :data:`REFERENCE_ZERO` scores (0 by construction). Every metric stays in ``report/metrics.json``,
    the spreads, NFE and latency in ``report/summary.md`` beside them."""
    picked = None if candidates is None else set(candidates)
    out = {}
    for key, value in metrics.items():
        name, _, metric = key.rpartition("/")
        shown = metric in HEADLINE_METRICS or metric in CLIP_HEADLINE
        if shown and (picked is None or name in picked) and not (name == reference and metric in REFERENCE_ZERO):
            out[f"{name}/{HEADLINE_METRICS.get(metric, metric)}"] = value
    return out

def _validation_prompts(cfg: ValidationConfig, prompts: list[str]) -> list[str]:
    """The prompts a run samples (``cfg.prompts``, else ``prompts``): one line when there are none, or more than the
    seed grid can hold without repeating noise."""
    chosen = list(cfg.prompts if cfg.prompts is not None else prompts)
    if not chosen:
        raise UserError("validate: no prompts (the clip set has no validation captions and validate.prompts is unset)")
    if cfg.num_seeds > 1 and len(chosen) > SEED_STRIDE:
        raise UserError(f"validate: at most {SEED_STRIDE} prompts with num_seeds > 1 (the seed grid would repeat noise), "
                        f"got {len(chosen)}")
    return chosen


def _log_prompts(prompts: list[str], source: str, adherence: dict[str, Any]) -> None:
    """Which prompts a run samples and from where, and whether the analyzer's adherence applies to them."""
    log.info("validate: %d prompts from %s: %s", len(prompts), source,
             "; ".join(f"#{i} {p!r}" for i, p in enumerate(prompts[:4])) + (f"; … (+{len(prompts) - 4})" if len(prompts) > 4 else ""))
    if not adherence["applicable"]:
        log.info("validate: prompt adherence n/a: %d of %d prompts are captions of the synthetic clips' grammar, the "
                 "only captions its analyzer reads; the other scores (Fréchet, KID, paired distance, sharpness) apply",
                 adherence["prompts_in_grammar"], len(prompts))


def _clip_scorer(cfg: ValidationConfig, device: torch.device) -> Any:
    """The CLIP scorer of ``cfg.clip_model`` on ``device``; None without one."""
    if cfg.clip_model is None:
        return None
    from distillery.evaluation.clip_scores import ClipScorer

    clip = ClipScorer(cfg.clip_model, device)  # scores from the frames each run (cached or sampled): never stale (module doc)
    log.info("validate: CLIP text similarity, frame consistency and motion scored with %s", cfg.clip_model)
    return clip


class _Run:
    """One :func:`run_validation`: its plan (the candidates in sampling order, the seed grid, what the sample cache
    holds) and, as each candidate finishes, what was measured of it. Its steps, in order: :meth:`plan_cache`,
    :meth:`begin`, then per candidate :meth:`start` (reuse from the cache, or sample) and :meth:`finish` (score and
    measure against the reference), then :meth:`report`."""

    def __init__(self, ctx: SamplingContext, cfg: ValidationConfig, candidates: list[Candidate], ref: Candidate,
                 prompts: list[str], adherence: dict[str, Any], cache: "SampleCache | None", clip: Any) -> None:
        self.ctx, self.cfg, self.candidates, self.ref, self.prompts = ctx, cfg, candidates, ref, prompts
        self.adherence, self.cache, self.clip = adherence, cache, clip
        self.order = [ref] + [c for c in candidates if c is not ref]  # the reference first: others compare against it
        self.row_of = {c.name: i for i, c in enumerate(candidates)}
        self.seed_grid = [[generator_seed(cfg, i, j) for j in range(cfg.num_seeds)] for i in range(len(prompts))]
        self.video_order = [(i, j) for j in range(cfg.num_seeds) for i in range(len(prompts))]  # sampling order: seed-major
        self.resolved = {c.name: ctx.resolve(c) for c in self.order}
        self.hits: dict[str, Any] = {}
        self.cache_log: dict[str, dict[str, Any]] = {}
        # what finish() measures, per candidate
        self.metrics: dict[str, dict[str, float]] = {}
        self.rows: list[dict[str, Any]] = []
        self.per_video: dict[str, list[dict[str, Any]]] = {}
        self.per_seed: dict[str, list[dict[str, Any]]] = {}
        self.per_prompt: dict[str, list[dict[str, Any]]] = {}
        self.reference_frames: dict[tuple[int, int], np.ndarray] = {}  # (prompt, seed index) → the reference's uint8 RGB frames
        self.scaler: Any = None  # video_metrics.Standardiser fitted to the reference's features
        self.reference_z = np.empty(0)  # the reference's standardised features [P·S, D]
        self.latency: dict[str, dict[str, Any]] = {}
        self.timeline: dict[str, dict[str, Any]] = {}  # per sampled candidate: where its wall time went (module doc)

    def plan_cache(self) -> None:
        """Which candidates the sample cache holds unchanged (``hits``) and, for each, its key and why it is reused
        or sampled (``cache_log``); logged."""
        from distillery.evaluation.sample_cache import Expected, entry_key
        from distillery.evaluation.video_metrics import FEATURE_NAMES

        cache, ctx, cfg, order = self.cache, self.ctx, self.cfg, self.order
        assert cache is not None
        context = ctx.context_material(self.prompts, self.seed_grid)
        expected = Expected(tuple((i, j, self.seed_grid[i][j], sample_key(i, j)) for i, j in self.video_order),
                            ctx.latent_shape, (cfg.num_frames, cfg.height, cfg.width, 3), len(FEATURE_NAMES))
        for c in order:
            material = {"context": context, "candidate": ctx.candidate_material(c, self.resolved[c.name])}
            key = entry_key(material)
            hit, why = cache.load(key, material, expected)
            if hit is None and why == "no entry":
                changed = cache.what_changed(c.name, material)
                why = f"changed: {changed}" if changed else "not sampled before"
            elif hit is None:
                log.warning("validate: %s's cached samples in %s are not used (%s): sampling it again", c.name,
                            cache.root / key, why.removeprefix("unusable entry: "))
            self.cache_log[c.name] = {"key": key, "material": material, "reused": hit is not None, "why": why,
                                      **({"sampled": hit.stored} if hit is not None else {})}
            if hit is not None:
                self.hits[c.name] = hit
        why_sampled = "; ".join(f"{c.name} ({self.cache_log[c.name]['why']})" for c in order if c.name not in self.hits)
        log.info("validate: reusing %d of %d candidates' samples from %s%s; sampling %d%s", len(self.hits), len(order),
                 cache.root, f" ({', '.join(self.hits)})" if self.hits else "", len(order) - len(self.hits),
                 f": {why_sampled}" if why_sampled else "")

    def begin(self, stage: Path, scoring: ThreadPoolExecutor, grid: VideoGrid) -> None:
        """Where the videos go (``stage``, the run's temporary folder; ``grid``), the scoring threads, and the
        progress over the videos to sample."""
        from distillery.common.progress import Progress

        self.stage, self.scoring, self.grid = stage, scoring, grid
        self.to_sample = [c for c in self.order if c.name not in self.hits]
        self.bar = Progress(len(self.to_sample) * len(self.video_order), "validate", "video",
                            enabled=self.cfg.progress_bar and bool(self.to_sample))
        self.bar_lock = threading.Lock()
        self.held: list[str] = []  # videos scored before the candidate before theirs said its line (_score_and_write)

    def start(self, cand: Candidate, previous: dict[str, Any] | None = None) -> dict[str, Any]:
        """The candidate's videos: from the cache, or sampled on the device with their CPU half (scoring, mp4)
        submitted to the scoring threads. Returns what :meth:`finish` needs; ``pending`` futures when sampled.
        ``previous`` (the candidate started before, not finished yet) is finished before this one loads and between
        its batches as soon as its scoring threads are done (:meth:`finish_if_scored`), so its line comes before
        this candidate's progress lines; the caller finishes it after, if it was not."""
        folder = self.stage / "samples" / cand.name
        folder.mkdir(parents=True)
        self.finish_if_scored(previous)
        hit = self.hits.get(cand.name)
        if hit is not None:
            return self._reuse(cand, hit, folder)
        return self._sample(cand, folder, previous)

    def finish_if_scored(self, item: dict[str, Any] | None) -> float:
        """Finish ``item`` (:meth:`finish`) if it is not finished and none of its videos is still being scored,
        without waiting; returns the seconds it took (0 when it did not run)."""
        if item is None or item["finished"] or not all(f.done() for f in item.get("pending", ())):
            return 0.0
        started = time.time()
        self.finish(item)
        return time.time() - started

    def _reuse(self, cand: Candidate, hit: Any, folder: Path) -> dict[str, Any]:
        """A reused candidate: the cache entry's files as they were written, its records as they were measured."""
        shutil.copyfile(hit.folder / "latents.safetensors", folder / "latents.safetensors")
        for i, j in self.video_order:
            shutil.copyfile(hit.folder / f"{sample_key(i, j)}.mp4", folder / f"{sample_key(i, j)}.mp4")
        return {"cand": cand, "hit": hit, "records": hit.videos, "frames": hit.frames, "finished": False, "said": False,
                "measured": {"reused": True, "at": hit.stored, **(hit.load or {"load_1min": None, "cpus": None})}}

    def _sample(self, cand: Candidate, folder: Path, previous: dict[str, Any] | None) -> dict[str, Any]:
        """Load, warm up and sample the candidate batch by batch, timing each batch; each video's CPU half goes to
        the scoring threads (:meth:`_score_and_write`) while the device samples the next; ``previous`` is finished
        between two batches once its scoring is done (timeline ``finishing_previous_s``; no batch's time holds it)."""
        from distillery.evaluation.sample_cache import machine_load

        ctx, cfg = self.ctx, self.cfg
        number = self.to_sample.index(cand) + 1
        label = f"{cand.name} ({number}/{len(self.to_sample)})"  # a progress line names the candidate it counted
        load_started = time.time()
        measured = {"reused": False, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **machine_load()}
        loaded = ctx.load(cand, self.resolved[cand.name])
        ctx.warm_up(loaded)
        sampling_started = time.time()
        frames: dict[str, np.ndarray] = {}
        sampled: dict[str, torch.Tensor] = {}
        pending = []
        finishing_s = 0.0  # finishing the previous candidate, between two batches
        for first in range(0, len(self.video_order), cfg.sample_batch):
            batch = self.video_order[first:first + cfg.sample_batch]
            t0 = time.perf_counter()
            latents = ctx.sample(cand, loaded, [i for i, _ in batch], [self.seed_grid[i][j] for i, j in batch])
            batch_videos = ctx.encoders.decode_latents(latents)  # uint8 [B, T, H, W, 3]
            synchronize(ctx.device)
            seconds = (time.perf_counter() - t0) / len(batch)  # per video (the batch's share)
            for b, (i, j) in enumerate(batch):
                key = sample_key(i, j)
                sampled[key] = latents[b].detach().to("cpu", torch.float32).contiguous()
                frames[key] = batch_videos[b]
                pending.append(self.scoring.submit(self._score_and_write, folder, i, j, batch_videos[b], seconds, key,
                                                   label, previous))
            finishing_s += self.finish_if_scored(previous)
        del loaded  # the next candidate loads into the device memory this one held
        sampling_ended = time.time()
        self.timeline[cand.name] = {"load_s": round(sampling_started - load_started, 3),
                                    "sampling_unix": [round(sampling_started, 3), round(sampling_ended, 3)],
                                    "sampling_s": round(sampling_ended - sampling_started, 3),
                                    "finishing_previous_s": round(finishing_s, 3)}
        return {"cand": cand, "hit": None, "pending": pending, "frames": frames, "sampled": sampled, "folder": folder,
                "measured": measured, "finished": False, "said": False}

    def _score_and_write(self, folder: Path, i: int, j: int, video: np.ndarray, seconds: float, key: str,
                         label: str, previous: dict[str, Any] | None) -> Any:
        """The CPU half of one video — adherence, sharpness, features, its mp4 — on a scoring thread
        while the device samples the next video (numpy and the encoder release the GIL); counted in the progress
        under ``label``, its own candidate's — held back while ``previous`` (the candidate before it) has not said its
        line, so that no progress line of a candidate comes before the line of the one before it."""
        from distillery.clips.video_io import write_video
        from distillery.evaluation.sample_cache import CachedVideo

        scores, sharp, features = score_video(video, self.ctx.analyzer, self.prompts[i])
        record = CachedVideo(i, j, self.seed_grid[i][j], scores, seconds, sharp, features)
        write_video(folder / f"{key}.mp4", video, self.cfg.fps, preset=MP4_PRESET)
        with self.bar_lock:
            if previous is not None and not previous["said"]:
                self.held.append(label)  # counted when previous says its line (finish)
            else:
                self.bar.update(candidate=label)
        return record

    def finish(self, item: dict[str, Any]) -> None:
        """Wait for the candidate's scoring threads (they ran while the next candidate loaded and sampled),
        keep its samples in the cache, and measure it against the reference; its line is logged."""
        item["finished"] = True
        cand, frames = item["cand"], item["frames"]
        records = self._collect(item) if item["hit"] is None else item["records"]
        videos = self._videos(cand, records, frames)
        values, seed_means = self._values(cand, videos, item["measured"])
        clip_rows = None
        if self.clip is not None:  # the CLIP scores of every video, from its frames; means + bootstrap intervals
            from distillery.evaluation.clip_scores import summarise

            clip_rows = [self.clip.score(frames[sample_key(v.prompt, v.seed_index)], self.prompts[v.prompt]) for v in videos]
            values.update(summarise(clip_rows, self.cfg.bootstrap_resamples, self.cfg.seed))
        self._keep_metrics(cand, values)
        self._keep_tables(cand, values, videos, seed_means, clip_rows)
        self._log_candidate(cand, values, item["hit"], clip_rows is not None)
        with self.bar_lock:  # the next candidate's videos scored meanwhile are counted now, after this line
            item["said"] = True
            if self.held:
                self.bar.update(len(self.held), candidate=self.held[-1])
                self.held.clear()

    def _collect(self, item: dict[str, Any]) -> list[Any]:
        """A sampled candidate's records, in sampling order (whatever order the threads finished in), its latents
        written beside its videos and the whole kept in the sample cache."""
        cand = item["cand"]
        waited = time.time()
        records = [f.result() for f in item["pending"]]
        self.timeline[cand.name]["scoring_wait_s"] = round(time.time() - waited, 3)
        save_file(item["sampled"], str(item["folder"] / "latents.safetensors"))
        if self.cache is not None:
            entry = self.cache_log[cand.name]
            self.cache.store(entry["key"], entry["material"], cand.name, records, item["sampled"], item["frames"],
                             item["folder"], {k: item["measured"][k] for k in ("load_1min", "cpus")})
        return records

    def _videos(self, cand: Candidate, records: list[Any], frames: dict[str, np.ndarray]) -> list[ScoredVideo]:
        """Each video's scores with its paired distance to the reference's same video (the reference's frames are
        kept for the others); its seed-0 videos put in the grid."""
        from distillery.evaluation.video_metrics import paired_mse

        ref, reference_frames = self.ref, self.reference_frames
        videos: list[ScoredVideo] = []
        for rec in records:
            pixels = frames[sample_key(rec.prompt, rec.seed_index)]
            if cand is ref:  # kept as uint8 (97 MB a real-shape video; its float64 copy is 776 MB)
                reference_frames[(rec.prompt, rec.seed_index)] = pixels
            paired = 0.0 if cand is ref else paired_mse(pixels, reference_frames[(rec.prompt, rec.seed_index)])
            videos.append(ScoredVideo(rec.prompt, rec.seed_index, rec.seed, rec.scores, rec.latency_s,
                                      len(videos) < WARMUP_VIDEOS, paired,
                                      rec.sharpness, np.asarray(rec.features, dtype=np.float64)))
            if rec.seed_index == 0:
                self.grid.put(self.row_of[cand.name], rec.prompt, frames[sample_key(rec.prompt, 0)])
        return videos

    def _values(self, cand: Candidate, videos: list[ScoredVideo], measured: dict[str, Any]) -> tuple[dict[str, float], np.ndarray]:
        """The candidate's seeded means and spreads, distribution scores against the reference (whose features fit
        the standardisation: it finishes first), NFE and latency; and its per-seed means ``[S, M]``."""
        from distillery.evaluation.video_metrics import Standardiser

        cfg = self.cfg
        features = np.stack([v.features for v in videos])  # [P·S, D], seed-major
        if self.scaler is None:  # cand is ref
            self.scaler = Standardiser.fit(features)
            self.reference_z = self.scaler(features)
        seed_means = mean_table(videos, "seed_index", cfg.num_seeds)  # [S, M]
        values = seeded_summary(seed_means)
        values.update(distribution_scores(self.scaler(features), self.reference_z, cfg.bootstrap_resamples, cfg.seed))
        values["nfe"] = cand.nfe(self.ctx.latent_shape[1])
        latency = self.latency[cand.name] = latency_summary([v.latency_s for v in videos])  # in sampling order
        latency["measured"] = measured  # when, and beside what load (reused: when it was sampled)
        values["latency_s"], values["latency_s_iqr"] = latency["median_s"], latency["iqr_s"]
        return values, seed_means

    def _keep_metrics(self, cand: Candidate, values: dict[str, float]) -> None:
        """The candidate's metrics.json entries (rounded, :data:`METRIC_NAMES` first; adherence left out where it
        does not apply), the reference's noise floors, and whether the candidate is resolved from the reference."""
        from distillery.evaluation.video_metrics import frechet_distance

        ref, reference_z = self.ref, self.reference_z
        if not self.adherence["applicable"]:  # readings of captions the analyzer cannot read: not scores (module doc)
            values = {k: v for k, v in values.items() if k.removesuffix("_std") not in ADHERENCE_METRICS}
        names = [*(k for k in METRIC_NAMES if k in values), *(k for k in values if k not in METRIC_NAMES)]  # an added score comes last
        self.metrics[cand.name] = {k: values[k] if k == "nfe" else round(float(values[k]), 6) for k in names}
        if cand is ref and self.cfg.num_seeds >= 2:
            n = len(self.prompts)  # seed-major: rows [0, n) are seed index 0, [n, 2n) seed index 1
            self.metrics[cand.name]["frechet_floor"] = round(frechet_distance(reference_z[:n], reference_z[n: 2 * n]), 6)
            if n >= 2:
                self.metrics[cand.name]["kid_floor"] = round(kid(reference_z[:n], reference_z[n: 2 * n]), 6)
        m, floors = self.metrics[cand.name], self.metrics[ref.name]
        if cand is not ref and "kid_floor" in floors:  # the interval's lower end above the reference's own seed-to-seed floor
            m["kid_resolved"] = float(interval_resolved(m["kid_lo"], floors["kid_floor"]))
            m["frechet_resolved"] = float(interval_resolved(m["frechet_distance"] - 1.96 * m["frechet_distance_std"], floors["frechet_floor"]))

    def _keep_tables(self, cand: Candidate, values: dict[str, float], videos: list[ScoredVideo], seed_means: np.ndarray,
                     clip_rows: list[dict[str, Any]] | None) -> None:
        """The candidate's row of plots/adherence.csv and its per_video, per_seed and per_prompt tables."""
        m = self.metrics[cand.name]
        self.rows.append({"candidate": cand.name, "sampler": cand.sampler, "nfe": values["nfe"], "adherence": m.get("all"),
                          "adherence_std": m.get("all_std"), **{k: m.get(k) for k in CSV_COLUMNS[5:]},  # n/a: empty cells
                          **{k: m[k] for k in CLIP_METRICS if k in m}})
        kept = [k for k in SEEDED_METRICS if self.adherence["applicable"] or k not in ADHERENCE_METRICS]
        self.per_video[cand.name] = [{**{k: x for k, x in video.row().items() if k in kept or k not in ADHERENCE_METRICS},
                                      **(clip_rows[n] if clip_rows is not None else {})} for n, video in enumerate(videos)]
        self.per_seed[cand.name] = [{"seed_index": j, **{k: x for k, x in zip(SEEDED_METRICS, map(float, row)) if k in kept}}
                                    for j, row in enumerate(seed_means)]
        self.per_prompt[cand.name] = [{"prompt": prompt, **{k: x for k, x in zip(SEEDED_METRICS, map(float, row)) if k in kept}}
                                      for prompt, row in zip(self.prompts, mean_table(videos, "prompt", len(self.prompts)))]

    def _log_candidate(self, cand: Candidate, values: dict[str, float], hit: Any, clip_scored: bool) -> None:
        """One line of the candidate's scores (+ one of its CLIP scores)."""
        m = self.metrics[cand.name]
        said = (f"adherence all {m['all']:.2f}±{m['all_std']:.2f} (colour {m['colour']:.2f} shape {m['shape']:.2f} "
                f"direction {m['direction']:.2f})" if self.adherence["applicable"] else "adherence n/a")
        log.info("validate %s: %s NFE, %s, "
                 "%.3f s/video (median%s), distance to %s %.5f±%.5f, sharpness %.5f±%.5f, Fréchet distance %.3f±%.3f%s",
                 cand.name, values["nfe"], said,
                 m["latency_s"], f", reused: sampled {hit.stored}" if hit is not None else "", self.ref.name,
                 m["distance_to_teacher"], m["distance_to_teacher_std"], m["sharpness"],
                 m["sharpness_std"], m["frechet_distance"], m["frechet_distance_std"],
                 f" (noise floor {m['frechet_floor']:.3f})" if "frechet_floor" in m else "")
        if clip_scored:
            log.info("validate %s: CLIP text %.4f [%.4f, %.4f], CLIP consistency %.4f [%.4f, %.4f], "
                     "motion %.5f [%.5f, %.5f] (95%% bootstrap intervals)", cand.name,
                     *(m[f"{k}{e}"] for k in CLIP_SCORES for e in ("", "_lo", "_hi")))

    def write_grid(self) -> tuple[int, int]:
        """The labelled grid (rows: candidates, in input order) as ``cfg.grid_formats`` asks; returns its tiles' origin."""
        metrics, prompts = self.metrics, self.prompts
        labelled, origin = self.grid.labelled([f"{c.name} · {int(metrics[c.name]['nfe'])} NFE"
                                               + (f" · CLIP {metrics[c.name]['clip_text']:.3f}" if self.clip is not None else "")
                                               for c in self.candidates],
                                              [f"#{i}" for i in range(len(prompts))],
                                              [f"#{i}  {p}" for i, p in enumerate(prompts)])
        write_grid(labelled, self.stage, self.cfg.grid_formats, self.cfg.fps)
        return origin

    def report(self, base_dir: Path, source: str, flat: dict[str, float], origin: Any, started: float) -> dict[str, Any]:
        """report.json (layout in the module doc)."""
        from distillery.evaluation.summary import adherence_readings
        from distillery.evaluation.video_metrics import COV_EPS, FEATURE_NAMES

        cfg, ctx, candidates, cache, clip, scaler = self.cfg, self.ctx, self.candidates, self.cache, self.clip, self.scaler
        assert scaler is not None
        return {
            "base_dir": str(base_dir), "reference": self.ref.name, "prompts": self.prompts, "prompt_source": source,
            "adherence": self.adherence, "config": asdict(cfg),
            "seeds": [row[0] for row in self.seed_grid],  # seed index 0: torch.Generator().manual_seed(seed) per prompt
            "num_seeds": cfg.num_seeds,
            "seed_grid": self.seed_grid,  # [prompt i][seed index j] → generator seed (cfg.seed + i + SEED_STRIDE·j)
            "sample_keys": [[sample_key(i, j) for j in range(cfg.num_seeds)] for i in range(len(self.prompts))],
            "max_sequence_length": ctx.encoders.max_sequence_length,  # prompt embeddings padded to this
            "candidates": [{**asdict(c), "model_dir": str(c.model_dir), "nfe": self.metrics[c.name]["nfe"],
                            "forwards": forwards(c, ctx.latent_shape[1]), "shift": self.resolved[c.name].shift}
                           for c in candidates],
            "grid": {"rows": [c.name for c in candidates], "tile_hw": [cfg.height, cfg.width], "separator_px": 1,
                     "seed_index": 0, "origin_px": list(origin)},  # tile (r, c) at origin + (r·(H+1), c·(W+1))
            "frechet": {"feature_names": list(FEATURE_NAMES), "reference_mean": scaler.mean.tolist(),
                        "reference_scale": scaler.scale.tolist(), "cov_eps": COV_EPS,
                        "bootstrap_resamples": cfg.bootstrap_resamples, "bootstrap_seed": cfg.seed},
            "latency": {"warmup_videos": WARMUP_VIDEOS, "sample_batch": cfg.sample_batch, "dtype": str(ctx.dtype),
                        "vae_dtype": str(ctx.vae_dtype), "compiled": ctx.compile,
                        "vae_decode": dict(zip(("chunk_frames", "fused"), ctx.vae_decode)),
                        "statistic": "median, iqr = p75 - p25, of the videos after the warm-up",
                        **{c.name: self.latency[c.name] for c in candidates}},
            "per_video": {c.name: self.per_video[c.name] for c in candidates},
            "per_seed": {c.name: self.per_seed[c.name] for c in candidates},
            "per_prompt": {c.name: self.per_prompt[c.name] for c in candidates},
            "cache": None if cache is None else {
                "folder": str(cache.root),
                **{c.name: {k: v for k, v in self.cache_log[c.name].items() if k != "material"} for c in candidates}},
            "adherence_readings": adherence_readings(flat, [c.name for c in candidates])  # which readings separate them
            if self.adherence["applicable"] else None,
            "seconds": round(time.perf_counter() - started, 2),
            "timeline": self.timeline,
            "clip": None if clip is None else {**clip.describe(), "scores": list(CLIP_SCORES),
                                               "interval": "95% bootstrap of the mean over the candidate's videos",
                                               "bootstrap_resamples": cfg.bootstrap_resamples, "bootstrap_seed": cfg.seed},
        }


def _log_closing(candidates: list[Candidate], flat: dict[str, float], report: dict[str, Any]) -> None:
    """How each streaming candidate spends its NFE, and which adherence readings do not tell the candidates apart."""
    for c, f in ((c, entry["forwards"]) for c, entry in zip(candidates, report["candidates"])):
        if f["chunks"] > 1:
            log.info("validate %s: %d NFE per video = %d chunks × %d forwards + %d KV-cache writes (streamed); "
                     "%.3f s/video", c.name, f["per_video"], f["chunks"], f["per_chunk"], f["cache_writes"],
                     flat[f"{c.name}/latency_s"])
    flat_readings = [k for k, r in (report["adherence_readings"] or {}).items() if not r["discriminates"]]
    if flat_readings:
        log.info("validate: %s the same for every candidate (%s): not discriminating on these prompts",
                 ", ".join(flat_readings), ", ".join(f"{report['adherence_readings'][k]['min']:.2f}" for k in flat_readings))


def run_validation(
    base_dir: Path,
    candidates: list[Candidate],
    prompts: list[str],
    out_dir: Path,
    cfg: ValidationConfig | None = None,
    reference: str | None = None,
    prompt_embeddings: PromptEmbeddings | None = None,
    cache: "SampleCache | None" = None,
    prompt_source: str | None = None,
) -> dict[str, float]:
    """Sample, score and compare every candidate on every prompt × seed; write ``out_dir`` (layout above).

    ``base_dir``: diffusers Wan folder whose text encoder, tokenizer, VAE (and ``analyzer.json``)
    are used for every candidate. ``prompts``: used when ``cfg.prompts`` is None. ``reference``:
    name of the candidate that ``distance_to_teacher`` and ``frechet_distance`` are measured against
    (default: the first). ``prompt_embeddings``: the prompts' embeddings made earlier by this base's
    text encoder (the latent set's); then the text encoder is not loaded (used only with ``prompts``,
    not with ``cfg.prompts``). ``cache``: reuse each candidate's videos and scores from it when
    nothing they depend on changed, and keep the ones sampled
    (:mod:`distillery.evaluation.sample_cache`; the log and report.json ``cache`` say which were
    reused and why the others were sampled); None: sample every candidate. ``prompt_source``: where
    ``prompts`` came from, in words (the log, summary.md and report.json say it; ``cfg.prompts`` names
    itself). Returns the flat metrics dict written to ``metrics.json``.
    """
    from distillery.evaluation.plots import write_adherence_plot
    from distillery.evaluation.summary import summary_markdown

    cfg = cfg or ValidationConfig()
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    prompts = _validation_prompts(cfg, prompts)
    ref = _check_candidates(candidates, reference)
    source = "validate.prompts" if cfg.prompts is not None else (prompt_source or "the prompts given to run_validation")
    adherence = adherence_applicability(prompts)
    _log_prompts(prompts, source, adherence)
    started = time.perf_counter()
    ctx = SamplingContext(base_dir, prompts, cfg, prompt_embeddings if cfg.prompts is None else None)
    for cand in candidates:  # a causal I2V student whose layout the frames do not fit: one line before any sampling
        cand.nfe(ctx.latent_shape[1])
    run = _Run(ctx, cfg, candidates, ref, prompts, adherence, cache, _clip_scorer(cfg, ctx.device))
    if cache is not None:
        run.plan_cache()
    grid = VideoGrid(len(candidates), len(prompts), cfg.num_frames, cfg.height, cfg.width)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    stage.chmod(0o755)
    # scoring and encoding (CPU) of the videos overlap the sampling of the next ones (GPU): at 81×480×832 the CPU
    # half of one video (analyzer, sharpness, features, mp4) is ~20-40 core-seconds against a few GPU seconds of
    # sampling, so it runs on several threads (numpy and the encoder release the GIL); the records stay in order
    scoring = ThreadPoolExecutor(max_workers=scoring_workers(cfg.num_frames * cfg.height * cfg.width * 3),
                                 thread_name_prefix="validate-score")
    try:
        run.begin(stage, scoring, grid)
        # one candidate of overlap: candidate k's CPU half finishes on the scoring threads while candidate k + 1
        # loads and samples on the device (two candidates' frames in memory at most, besides the reference's)
        # candidate k's line is said once its scoring is done, between k + 1's batches: the log reads in order
        previous = None
        for cand in run.order:
            current = run.start(cand, previous)
            if previous is not None and not previous["finished"]:
                run.finish(previous)
            previous = current
        if previous is not None:
            run.finish(previous)
        run.bar.close()
        if cache is not None:
            cache.prune({entry["key"] for entry in run.cache_log.values()})
        flat = {f"{c.name}/{k}": v for c in candidates for k, v in run.metrics[c.name].items()}  # input order
        run.rows.sort(key=lambda r: run.row_of[r["candidate"]])
        origin = run.write_grid()
        report = run.report(base_dir, source, flat, origin, started)
        write_tables(stage, flat, run.rows, report)
        (stage / "summary.md").write_text(summary_markdown(flat, report))
        if adherence["applicable"]:  # else there is no adherence to plot (module doc)
            write_adherence_plot(run.rows, stage / "plots" / "adherence_vs_nfe.png")
        replace_dir(stage, out_dir)
    except BaseException:
        scoring.shutdown(wait=True, cancel_futures=True)  # nothing writes into the stage folder once it is removed
        shutil.rmtree(stage, ignore_errors=True)
        raise
    scoring.shutdown(wait=True)
    _log_closing(candidates, flat, report)
    log.info("validation of %d candidates on %d prompts × %d seeds written to %s (summary.md)%s", len(candidates),
             len(prompts), cfg.num_seeds, out_dir, f"; {len(run.hits)} reused from the sample cache" if cache is not None else "")
    return flat
