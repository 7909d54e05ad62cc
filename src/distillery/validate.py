"""Validation: sample every candidate model on the same prompts and noise, and score the videos.

For each :class:`Candidate` (a teacher at several step counts counts as several candidates, see
:func:`teacher_candidates`) and each prompt ``i``, :func:`run_validation` samples one video with
the sampler its sampling contract names (built from :mod:`distillery.sampling`'s registry and
run through a frozen model plugin, :func:`distillery.models.wan.load_inference_model`), starting from the same initial noise (a
generator seeded ``cfg.seed + i``) for every candidate, with text embeddings from the base's
text encoder (empty prompt as the CFG negative) and decoding through the base's VAE. It reports,
per candidate:

- ``colour``, ``shape``, ``direction``, ``all`` — prompt adherence read back from the decoded
  frames by :mod:`distillery.clips.analyzer` (thresholds from ``base_dir/analyzer.json`` when it
  exists), as fractions of the prompts;
- ``latency_s`` — mean wall seconds per video for sampling + VAE decode (batch 1, after one untimed
  warm-up forward; text encoding excluded);
- ``nfe`` — transformer forward evaluations per video: steps × (2 with CFG, else 1);
- ``distance_to_teacher`` — mean over prompts of the mean squared difference of the decoded
  frames (RGB in [0, 1]) from the reference candidate's (by default the first candidate: put the
  teacher first), so the reference itself scores exactly 0.

Output folder (written to a temporary sibling, then renamed into place)::

    out_dir/samples/<candidate>/<i>.mp4   every video (H.264 lossless yuv444p)
    out_dir/samples/<candidate>/latents.safetensors
                                          the sampler's normalised latents, key "<i>" → [C, T, H, W]
                                          (float32): what ``WanPipeline(output_type="latent")``
                                          returns for that prompt, seed and step count
    out_dir/grid.gif, out_dir/grid.mp4    rows = candidates, columns = prompts, 1-px separators
    out_dir/metrics.json                  flat {"<candidate>/<metric>": number} (DVC metrics)
    out_dir/plots/adherence.csv           one row per candidate: candidate, nfe, adherence, ...
                                          (DVC plots: x = nfe, y = adherence)
    out_dir/report.json                   prompts, candidates and per-prompt results
"""

from __future__ import annotations

import csv
import json
import logging
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import save_file

from distillery.clips.grid import VideoGrid, write_gif
from distillery.errors import UserError
from distillery.fsutil import replace_dir

if TYPE_CHECKING:
    from distillery.models.base import ModelBase
    from distillery.sampling import Sampler

log = logging.getLogger("distillery")

SAMPLING_FILE = "sampling.json"  # an artifact's sampling contract, beside its transformer/
GRID_FORMATS = ("gif", "mp4")
METRIC_NAMES = ("colour", "shape", "direction", "all", "latency_s", "nfe", "distance_to_teacher")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass
class ValidationConfig:
    """What to sample and how; one per validation run (``params.yaml: validate``)."""

    prompts: list[str] | None = None  # prompts to sample; None: the clip validation captions given to run_validation
    num_frames: int = 17  # frames per video (VAE temporal factor × k + 1)
    height: int = 32  # video height, pixels
    width: int = 32  # video width, pixels
    fps: float = 8.0  # frame rate of the written videos and grids
    teacher_steps: list[int] = field(default_factory=lambda: [40, 4])  # teacher baselines: many- and few-step Euler
    guidance_scale: float = 4.0  # CFG scale of the teacher baselines (empty-prompt negative)
    seed: int = 0  # prompt i starts from noise drawn by a generator seeded seed + i, for every candidate
    grid_formats: list[str] = field(default_factory=lambda: ["gif", "mp4"])  # grid files to write
    max_sequence_length: int | None = None  # prompt length; None: the base model's (model card / tokenizer)
    device: str = "cpu"  # where the models run ("cpu", "cuda", "cuda:1", ...)
    progress_bar: bool = True  # tqdm bar over the videos

    def __post_init__(self) -> None:
        if self.num_frames < 1 or self.height < 1 or self.width < 1:
            raise UserError(f"validate: num_frames, height and width must be >= 1, got {self.num_frames}, "
                            f"{self.height}, {self.width}")
        if self.fps <= 0:
            raise UserError(f"validate.fps must be > 0, got {self.fps}")
        if any(int(s) < 1 for s in self.teacher_steps):
            raise UserError(f"validate.teacher_steps must be positive step counts, got {self.teacher_steps}")
        if self.guidance_scale < 0:
            raise UserError(f"validate.guidance_scale must be >= 0, got {self.guidance_scale}")
        bad = [f for f in self.grid_formats if f not in GRID_FORMATS]
        if bad:
            raise UserError(f"validate.grid_formats: unknown format {bad[0]!r}; valid: {', '.join(GRID_FORMATS)}")
        if self.prompts is not None and not self.prompts:
            raise UserError("validate.prompts is empty; give at least one prompt or null for the validation captions")


@dataclass(frozen=True)
class Candidate:
    """One model × sampler setting to validate."""

    name: str  # label in metric keys, sample folders and plots (letters, digits, '.', '_', '-')
    model_dir: Path  # diffusers Wan folder, or a folder with transformer/ (the base supplies VAE and text encoder)
    num_steps: int  # sampling steps (Euler steps, or few-step ladder length)
    guidance_scale: float  # CFG scale; CFG runs (2 forwards per step) when > 1
    sampler: str = "euler"  # a registered sampler (distillery.sampling.sampler_names()): euler, few_step_x0, ...
    timesteps: tuple[float, ...] | None = None  # few_step_x0 ladder in [0, 1000]; None: first num_steps of the Euler grid
    shift: float | None = None  # flow shift; None: model_dir's scheduler config, else the base's
    options: dict[str, Any] = field(default_factory=dict, compare=False)  # further sampling-contract keys for the sampler

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise UserError(f"candidate name {self.name!r} must be letters, digits, '.', '_' or '-' (it names files)")
        if self.num_steps < 1:
            raise UserError(f"candidate {self.name}: num_steps must be >= 1, got {self.num_steps}")
        if self.timesteps is not None and len(self.timesteps) != self.num_steps:
            raise UserError(f"candidate {self.name}: {len(self.timesteps)} timesteps given for num_steps={self.num_steps}")
        try:
            self.build_sampler(self.shift)  # unknown sampler names and bad contract keys fail here
        except UserError as exc:
            raise UserError(f"candidate {self.name}: {exc}") from None

    @classmethod
    def from_artifact(cls, name: str, model_dir: Path, num_steps: int | None = None,
                      guidance_scale: float | None = None) -> "Candidate":
        """A candidate sampled as ``model_dir/sampling.json`` says (its sampler, shift, ladder, options).

        ``num_steps`` / ``guidance_scale``: None → the contract's ``num_steps`` / ``guidance_scale``,
        else the length of its ``timesteps`` ladder / the sampler's defaults. :class:`UserError` when
        the contract is missing or invalid.
        """
        from distillery.sampling import build_sampler

        path = Path(model_dir) / SAMPLING_FILE
        try:
            contract = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"candidate {name}: {path} not found; point it at an artifact's model/ folder") from None
        except json.JSONDecodeError as exc:
            raise UserError(f"candidate {name}: {path}: not valid JSON ({exc.msg})") from None
        if not isinstance(contract, dict):
            raise UserError(f"candidate {name}: {path} must hold a JSON object (the sampling contract)")
        sampler = build_sampler(contract)
        ladder = contract.get("timesteps")
        steps = sampler.resolve_steps(num_steps)
        guidance = sampler.resolve_guidance(guidance_scale)
        known = ("sampler", "shift", "timesteps", "num_steps", "guidance_scale")
        return cls(name, Path(model_dir), steps, guidance, sampler=str(contract["sampler"]),
                   timesteps=tuple(float(t) for t in ladder) if ladder is not None else None,
                   shift=contract.get("shift"), options={k: v for k, v in contract.items() if k not in known})

    def sampling_contract(self, shift: float | None) -> dict[str, Any]:
        """The sampling contract this candidate samples with (``shift`` None: the model's own)."""
        contract: dict[str, Any] = {**self.options, "sampler": self.sampler, "shift": shift}
        if self.timesteps is not None:
            contract["timesteps"] = list(self.timesteps)
        return contract

    def build_sampler(self, shift: float | None) -> "Sampler":
        """The registered sampler for :meth:`sampling_contract`."""
        from distillery.sampling import build_sampler

        return build_sampler(self.sampling_contract(shift))

    @property
    def nfe(self) -> int:
        """Transformer forward evaluations per video."""
        return self.build_sampler(self.shift).nfe(self.num_steps, self.guidance_scale)


def teacher_candidates(teacher_dir: Path, cfg: ValidationConfig) -> list[Candidate]:
    """The teacher as one Euler candidate per ``cfg.teacher_steps`` entry, named ``teacher_<steps>``."""
    return [Candidate(f"teacher_{int(n)}", Path(teacher_dir), int(n), cfg.guidance_scale, "euler")
            for n in cfg.teacher_steps]


@dataclass
class _Loaded:
    """A candidate's model plugin and flow shift, ready to sample."""

    model: "ModelBase"  # frozen WanModel (eval, fp32) bound to the run device
    shift: float  # flow shift of its schedule


class _Context:
    """Base-model parts shared by every candidate: encoders, prompt embeddings, latent shape, analyzer."""

    def __init__(self, base_dir: Path, prompts: list[str], cfg: ValidationConfig) -> None:
        from distillery.clips.analyzer import AnalyzerConfig
        from distillery.data.encoders import BaseEncoders

        self.base_dir = base_dir
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.encoders = BaseEncoders(base_dir, self.device, cfg.max_sequence_length)
        length = self.encoders.max_sequence_length
        embeds = self.encoders.encode_prompts(list(prompts) + [""])
        self.text = [self._pad(e, length).to(self.device) for e in embeds[:-1]]  # each [1, L, D], on the device
        self.negative = self._pad(embeds[-1], length).to(self.device)  # [1, L, D]
        vae_cfg = self.encoders.vae.config
        tf, sf = int(vae_cfg.scale_factor_temporal), int(vae_cfg.scale_factor_spatial)
        if (cfg.num_frames - 1) % tf or cfg.height % sf or cfg.width % sf:
            raise UserError(f"validate: num_frames − 1 must be a multiple of {tf} and height/width of {sf} for the VAE of "
                            f"{base_dir}, got {cfg.num_frames}×{cfg.height}×{cfg.width}")
        self.latent_shape = (self.encoders.z_dim, (cfg.num_frames - 1) // tf + 1, cfg.height // sf, cfg.width // sf)
        analyzer_json = base_dir / "analyzer.json"
        self.analyzer = AnalyzerConfig(**json.loads(analyzer_json.read_text())) if analyzer_json.is_file() else None
        self.base_shift = self._scheduler_shift(base_dir / "scheduler")
        self._last: tuple[Path, float, "ModelBase"] | None = None  # last model loaded (teacher step counts share it)

    @staticmethod
    def _pad(embed: torch.Tensor, length: int) -> torch.Tensor:
        """Unpadded ``[L_i, D]`` → zero-padded ``[1, length, D]`` (as WanPipeline pads)."""
        out = embed.new_zeros(length, embed.shape[1])
        out[: embed.shape[0]] = embed[:length]
        return out[None]

    @staticmethod
    def _scheduler_shift(folder: Path | None) -> float | None:
        from distillery.models.schedule import read_scheduler_shift

        if folder is None or not (folder / "scheduler_config.json").is_file():
            return None
        return read_scheduler_shift(folder)

    def load(self, cand: Candidate) -> _Loaded:
        """Load a candidate's model plugin and check it fits the base's latents and text embeddings."""
        from distillery.models.wan import load_inference_model, locate_transformer

        transformer_dir, scheduler_dir = locate_transformer(cand.model_dir)
        shift = cand.shift if cand.shift is not None else self._scheduler_shift(scheduler_dir)
        shift = shift if shift is not None else self.base_shift
        if shift is None:
            raise UserError(f"candidate {cand.name}: no scheduler config beside {transformer_dir} or in {self.base_dir}; "
                            "set the candidate's shift")
        key = transformer_dir.resolve()
        if self._last is not None and self._last[:2] == (key, float(shift)):
            model = self._last[2]
        else:
            self._last = None
            model = load_inference_model(transformer_dir, self.device, torch.float32, shift=float(shift), role=cand.name)
        conf = model.transformer_config()
        if int(conf["in_channels"]) != self.latent_shape[0] or int(conf["text_dim"]) != self.encoders.text_dim:
            raise UserError(f"candidate {cand.name}: {transformer_dir} takes {conf['in_channels']} latent channels and "
                            f"text_dim {conf['text_dim']}, but the base {self.base_dir} gives {self.latent_shape[0]} and "
                            f"{self.encoders.text_dim}; validate it against the base it was trained from")
        self._last = (key, float(shift), model)
        return _Loaded(model, float(shift))

    def sample(self, cand: Candidate, loaded: _Loaded, index: int) -> torch.Tensor:
        """Normalised latents ``[1, C, T, H, W]`` for prompt ``index`` (noise seeded ``cfg.seed + index``),
        from the registered sampler the candidate's sampling contract names."""
        from distillery.models.base import Conditioning

        sampler = cand.build_sampler(loaded.shift)
        generator = torch.Generator().manual_seed(self.cfg.seed + index)
        cond = Conditioning(self.text[index], self.negative)
        with torch.no_grad():
            return sampler.sample(loaded.model, cond, self.latent_shape, generator, num_steps=cand.num_steps,
                                  guidance_scale=cand.guidance_scale)

    def warm_up(self, loaded: _Loaded) -> None:
        """One untimed forward (and decode) so lazy initialisation does not count as latency."""
        from distillery.models.base import Conditioning

        with torch.no_grad():
            x = torch.zeros(1, *self.latent_shape, device=self.device)
            loaded.model.predict_noise(x, torch.zeros(1, device=self.device), Conditioning(self.negative))
            self.encoders.decode_latents(x)
        _synchronize(self.device)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def _write_grid(grid: np.ndarray, stage: Path, cfg: ValidationConfig) -> None:
    from distillery.clips.video_io import write_video

    if "gif" in cfg.grid_formats:
        write_gif(stage / "grid.gif", grid, cfg.fps)
    if "mp4" in cfg.grid_formats:
        write_video(stage / "grid.mp4", grid, cfg.fps)


def _write_tables(stage: Path, metrics: dict[str, float], rows: list[dict[str, Any]], report: dict[str, Any]) -> None:
    (stage / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (stage / "plots").mkdir()
    columns = ["candidate", "sampler", "nfe", "adherence", "colour", "shape", "direction", "latency_s", "distance_to_teacher"]
    with (stage / "plots" / "adherence.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    (stage / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")


def run_validation(
    base_dir: Path,
    candidates: list[Candidate],
    prompts: list[str],
    out_dir: Path,
    cfg: ValidationConfig | None = None,
    reference: str | None = None,
) -> dict[str, float]:
    """Sample, score and compare every candidate on every prompt; write ``out_dir`` (layout above).

    ``base_dir``: diffusers Wan folder whose text encoder, tokenizer, VAE (and ``analyzer.json``)
    are used for every candidate. ``prompts``: used when ``cfg.prompts`` is None. ``reference``:
    name of the candidate that ``distance_to_teacher`` is measured against (default: the first).
    Returns the flat metrics dict written to ``metrics.json``.
    """
    from tqdm import tqdm

    from distillery.clips.analyzer import SCORE_KEYS, score
    from distillery.clips.video_io import write_video

    cfg = cfg or ValidationConfig()
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    prompts = list(cfg.prompts if cfg.prompts is not None else prompts)
    if not prompts:
        raise UserError("validate: no prompts (the clip set has no validation captions and validate.prompts is unset)")
    ref = _check_candidates(candidates, reference)
    started = time.perf_counter()
    ctx = _Context(base_dir, prompts, cfg)
    order = [ref] + [c for c in candidates if c is not ref]  # the reference first: others compare against it
    row_of = {c.name: i for i, c in enumerate(candidates)}
    grid = VideoGrid(len(candidates), len(prompts), cfg.num_frames, cfg.height, cfg.width)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    stage.chmod(0o755)
    try:
        metrics: dict[str, float] = {}
        rows: list[dict[str, Any]] = []
        per_prompt: dict[str, list[dict[str, Any]]] = {}
        reference_frames: list[np.ndarray] = []  # the reference's videos as float64 RGB in [0, 1]
        shifts: dict[str, float] = {}
        bar = tqdm(total=len(order) * len(prompts), desc="validate", unit="video", disable=not cfg.progress_bar,
                   mininterval=1.0)
        for cand in order:
            loaded = ctx.load(cand)
            shifts[cand.name] = loaded.shift
            ctx.warm_up(loaded)
            hits = dict.fromkeys(SCORE_KEYS, 0)
            seconds, distances, results, sampled = [], [], [], {}
            for i, prompt in enumerate(prompts):
                t0 = time.perf_counter()
                latents = ctx.sample(cand, loaded, i)
                sampled[str(i)] = latents[0].detach().to("cpu", torch.float32).contiguous()
                video = ctx.encoders.decode_latents(latents)[0]  # uint8 [T, H, W, 3]
                _synchronize(ctx.device)
                seconds.append(time.perf_counter() - t0)
                if cand is ref:
                    reference_frames.append(video.astype(np.float64) / 255.0)
                diff = video.astype(np.float64) / 255.0 - reference_frames[i]
                distances.append(float(np.mean(diff**2)))
                scores = score(video, prompt, ctx.analyzer)
                for key in SCORE_KEYS:
                    hits[key] += int(bool(scores[key]))
                write_video(stage / "samples" / cand.name / f"{i}.mp4", video, cfg.fps)
                grid.put(row_of[cand.name], i, video)
                results.append({"prompt": prompt, **{k: bool(v) for k, v in scores.items()},
                                "latency_s": round(seconds[-1], 6), "distance_to_teacher": distances[-1]})
                bar.update()
            save_file(sampled, str(stage / "samples" / cand.name / "latents.safetensors"))
            values = {key: hits[key] / len(prompts) for key in SCORE_KEYS}
            values.update(latency_s=float(np.mean(seconds)), nfe=cand.nfe, distance_to_teacher=float(np.mean(distances)))
            for key in METRIC_NAMES:
                metrics[f"{cand.name}/{key}"] = values[key] if key == "nfe" else round(float(values[key]), 6)
            rows.append({"candidate": cand.name, "sampler": cand.sampler, "nfe": cand.nfe, "adherence": metrics[f"{cand.name}/all"],
                         **{k: metrics[f"{cand.name}/{k}"] for k in ("colour", "shape", "direction", "latency_s",
                                                                    "distance_to_teacher")}})
            per_prompt[cand.name] = results
            log.info("validate %s: %s NFE, adherence colour %.2f shape %.2f direction %.2f all %.2f, %.3f s/video, "
                     "distance to %s %.5f", cand.name, cand.nfe, values["colour"], values["shape"], values["direction"],
                     values["all"], values["latency_s"], ref.name, values["distance_to_teacher"])
        bar.close()
        metrics = {f"{c.name}/{k}": metrics[f"{c.name}/{k}"] for c in candidates for k in METRIC_NAMES}  # input order
        rows.sort(key=lambda r: row_of[r["candidate"]])
        _write_grid(grid.pixels, stage, cfg)
        report = {
            "base_dir": str(base_dir), "reference": ref.name, "prompts": prompts, "config": asdict(cfg),
            "seeds": [cfg.seed + i for i in range(len(prompts))],  # torch.Generator().manual_seed(seed) per prompt
            "max_sequence_length": ctx.encoders.max_sequence_length,  # prompt embeddings padded to this
            "candidates": [{**asdict(c), "model_dir": str(c.model_dir), "nfe": c.nfe, "shift": shifts[c.name]}
                           for c in candidates],
            "grid": {"rows": [c.name for c in candidates], "tile_hw": [cfg.height, cfg.width], "separator_px": 1},
            "per_prompt": {c.name: per_prompt[c.name] for c in candidates},
            "seconds": round(time.perf_counter() - started, 2),
        }
        _write_tables(stage, metrics, rows, report)
        replace_dir(stage, out_dir)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    log.info("validation of %d candidates on %d prompts written to %s", len(candidates), len(prompts), out_dir)
    return metrics
