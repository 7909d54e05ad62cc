"""The teacher's ODE trajectories for knowledge distillation (ODE-init), as a resumable set of shards.

For each prompt of a text-embedding set (a latent set's, or a prompt-only set of the same shard format: read
by :func:`~distillery.data.dataset.read_text_embeddings`, the one reader of prompt embeddings) and each of
``seeds_per_prompt`` seeds, :func:`teacher_trajectory` integrates the teacher's flow ODE with CFG from pure
noise and keeps its states at ``t_list``. The result is a latent set (the parquet shard format of
:mod:`distillery.data.latent_format`) whose rows hold those points stacked along the channel axis, point-
major — ``[(K + 1)·C, T, H, W]`` = ``x_{t_0}, …, x_{t_{K−1}}, x_0`` — beside the prompt's embedding, so the
trainer reads it as any latent set (:class:`distillery.methods.kd.KDMethod` splits the points).

**The ODE.** The teacher's Euler grid of ``teacher_steps`` steps on its own flow shift (exactly
:meth:`~distillery.models.schedule.FlowMatchSchedule.inference_sigmas`, the grid of the ``euler``
sampler and of ``WanPipeline``), with every point of ``t_list`` (σ = t / n) added as a grid point, so
each recorded state is a state of the integration, not an interpolation; it starts at σ = 1 from the
noise ``ε`` (float32, drawn on the CPU from a generator seeded by :func:`row_seed`: the run's seed, the
prompt's id and the seed index — a row's noise depends on nothing else) and ends at σ = 0, the clean
end point. Each step's velocity is CFG in the standard form ``u + w (c − u)`` (``w = guidance_scale``; the
unconditional prompt: the set's negative prompt's embedding — its empty prompt's where it has none; one
conditional forward when w = 1). Latents stay float32 between steps.

**Image-to-video.** From an image-to-video latent set (rows with ``first_frame`` — the first frame's mask and
VAE latent — and ``image_embedding``), the teacher integrates each row conditioned on its prompt's first frame and
image embeddings (both CFG branches keep the frame, as the pipeline's), and every trajectory row carries those two
columns as they are in the source (the i2v shard schema): a KD student trains on them with the frame of the
trajectory. The manifest keeps the source's ``image_conditioning``, so the training stage's check reads a trajectory
set without frames as latents without first frames (one line for an image-to-video student). A source with first
frames for some rows only is refused in one line.

**Shards and resume.** Row ``r`` of the set is prompt ``r // seeds_per_prompt``, seed
``r % seeds_per_prompt``; shard ``k`` holds rows ``[k·R, (k+1)·R)`` (``R = rows_per_shard``), computed in
batches of ``batch_size`` rows counted from the shard's start. A shard is written to a temp file and
renamed (:func:`~distillery.data.writer.write_shard`), then its record ``shard-<k>.json`` (also atomic):
the settings (:class:`TrajectorySettings`: teacher digest, t_list, guidance, steps, seed, ...), the digest of
its rows' inputs (ids and prompt embeddings), its row count and the parquet's sha256. A shard whose record
is missing, or says other settings, other inputs or another file, is made again from scratch; one that
matches is kept. So a killed generation resumes at the first unfinished shard and the finished set is
bitwise the set an uninterrupted run writes (same batches, same noise, same file bytes). Records hold no
time; the manifest (``preprocess.json``) and ``trajectories.json`` are rewritten at the end from the
settings and counts alone.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from distillery.common.errors import UserError
from distillery.common.fsutil import write_text_atomic
from distillery.data.dataset import (
    EMPTY_PROMPT_FILE,
    MANIFEST_FILE,
    NEGATIVE_PROMPT_FILE,
    pad_prompt_embedding,
    read_empty_prompt_embedding,
    read_text_embeddings,
    shard_record_path,
)
from distillery.data.writer import LatentRecord, shard_path, write_shard

FORMAT = "distillery.trajectories/v1"
SETTINGS_FILE = "trajectories.json"  # beside the manifest: the set's settings and per-shard digests
SPLIT = "train"
SOURCE = "teacher ODE trajectory"

TEMP_FILE = re.compile(r"^\..+\.tmp(-\d+)?$")  # the temp files this module's writers leave when killed


@dataclass(frozen=True)
class TrajectorySettings:
    """What a trajectory set is made with (recorded in every shard's record; a change remakes the shard)."""

    teacher_sha256: str  # the teacher model folder's content digest
    t_list: tuple[float, ...]  # the recorded points, descending, ending at 0
    teacher_steps: int  # the teacher's Euler steps (before the t_list points are added to its grid)
    guidance_scale: float  # CFG w in u + w (c − u)
    seed: int  # the run's seed (row_seed)
    seeds_per_prompt: int
    rows_per_shard: int
    batch_size: int  # rows per teacher batch, counted from each shard's start
    teacher_shift: float  # the teacher's flow shift (its grid)
    latent_shape: tuple[int, ...]  # [C, T, H, W] of one point
    text_max_length: int  # prompt embeddings padded/truncated to this for the teacher
    guidance_scale_2: float | None = None  # a two-expert teacher's low-noise expert's w (guidance_scale_2); None: the same

    def __post_init__(self) -> None:
        ts = [float(t) for t in self.t_list]
        if len(ts) < 2 or any(b >= a for a, b in zip(ts, ts[1:])) or ts[-1] != 0 or ts[0] > 1000:
            raise ValueError(f"t_list {ts}: must descend strictly within [0, 1000] and end at 0")
        for name in ("teacher_steps", "seeds_per_prompt", "rows_per_shard", "batch_size", "text_max_length"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1")

    def record(self) -> dict[str, Any]:
        out = asdict(self)
        out["t_list"], out["latent_shape"] = list(self.t_list), list(self.latent_shape)
        if self.guidance_scale_2 is None:  # the record of a set made before the key existed, unchanged
            del out["guidance_scale_2"]
        return out


def row_seed(seed: int, prompt_id: str, seed_index: int) -> int:
    """The noise seed of one row: 63 bits of sha256 over the run's seed, the prompt's id and the seed index."""
    digest = hashlib.sha256(f"{int(seed)}\0{prompt_id}\0{int(seed_index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def row_noise(seed: int, prompt_id: str, seed_index: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The row's initial noise ``ε`` (float32, CPU) of ``shape``."""
    g = torch.Generator(device="cpu").manual_seed(row_seed(seed, prompt_id, seed_index))
    return torch.randn(shape, generator=g, dtype=torch.float32)


def ode_grid(inference_sigmas: torch.Tensor, t_list: tuple[float, ...], num_train_timesteps: int) -> tuple[list[float], list[int]]:
    """The integration grid (σ values, descending from 1 to 0, float32 values) — the teacher's grid with the
    ``t_list`` points added — and the grid index of each ``t_list`` point."""
    points = torch.tensor([float(t) for t in t_list], dtype=torch.float64) / num_train_timesteps
    points32 = points.to(torch.float32).tolist()
    grid = sorted(set(inference_sigmas.to(torch.float32).tolist()) | set(points32) | {1.0, 0.0}, reverse=True)
    return grid, [grid.index(p) for p in points32]


@torch.no_grad()
def teacher_trajectory(teacher: Any, text: torch.Tensor, negative: torch.Tensor | None, noise: torch.Tensor,
                       grid: list[float], record: list[int], guidance_scale: float,
                       first_frame: torch.Tensor | None = None, image_embeds: torch.Tensor | None = None,
                       guidance_scale_2: float | None = None) -> torch.Tensor:
    """The ODE states ``[B, K + 1, C, T, H, W]`` (float32) at the grid indices ``record`` (module doc).

    ``teacher``: a :class:`~distillery.models.base.ModelBase`; ``text`` / ``negative`` ``[B, L, D]`` on its
    device; ``noise [B, C, T, H, W]`` the state at σ = ``grid[0]`` = 1; an image-to-video teacher's
    ``first_frame [B, M + C, T, H, W]`` and ``image_embeds [B, N, D_img]`` (None for text-to-video);
    ``guidance_scale_2``: a two-expert teacher's low-noise expert's scale (diffusers' ``WanPipeline`` rule,
    :class:`~distillery.sampling.base.ExpertGuidance`)."""
    from distillery.models.base import Conditioning
    from distillery.sampling.base import expert_guidance, guided_velocity

    guidance = expert_guidance(teacher, guidance_scale, guidance_scale_2, "trajectories")

    n = teacher.schedule.num_train_timesteps
    cond = Conditioning(text, negative, first_frame, image_embeds)
    x = noise.to(teacher.device, torch.float32)
    keep: dict[int, torch.Tensor] = {}
    b = x.shape[0]
    for i in range(len(grid)):
        if i in record:
            keep[i] = x.clone()
        if i == len(grid) - 1:
            break
        t = torch.full((b,), grid[i] * n, dtype=torch.float32, device=x.device)
        v = guided_velocity(teacher, x, t, cond, guidance)
        x = x + (grid[i + 1] - grid[i]) * v  # the Euler step (models.schedule.euler_step)
    return torch.stack([keep[i] for i in record], dim=1)


def rows_digest(rows: list[tuple[str, int]], texts: list[torch.Tensor],
                extras: list[list[torch.Tensor]] | None = None) -> str:
    """sha256 over a shard's inputs: each row's prompt id, seed index and prompt embedding (shape, dtype, bytes), and,
    an image-to-video set, each row's ``extras`` (its first-frame condition and image embeddings, the same way)."""
    h = hashlib.sha256()
    for i, ((pid, s), emb) in enumerate(zip(rows, texts)):
        for k, tensor in enumerate([emb, *(extras[i] if extras is not None else [])]):
            if k == 0:
                h.update(f"{pid}\0{s}\0{list(tensor.shape)}\0{tensor.dtype}\0".encode())
            else:
                h.update(f"extra{k}\0{list(tensor.shape)}\0{tensor.dtype}\0".encode())
            h.update(tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return h.hexdigest()


I2V_COLUMNS = ("first_frame", "image_embedding")  # the image-to-video columns a trajectory row carries from its source


def _row_extras(item: dict[str, Any]) -> list[torch.Tensor]:
    """A source row's image-to-video tensors, in :data:`I2V_COLUMNS` order (those it has)."""
    return [item[name] for name in I2V_COLUMNS if item.get(name) is not None]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def shard_is_done(path: Path, settings: dict[str, Any], inputs: str, rows: int) -> bool:
    """Whether shard ``path`` and its record are this run's: same settings, inputs and row count, and the
    parquet the record's digest names."""
    record_file = shard_record_path(path)
    try:
        record = json.loads(record_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict) or record.get("format") != FORMAT or record.get("settings") != settings:
        return False
    if record.get("inputs_sha256") != inputs or record.get("rows") != rows or not path.is_file():
        return False
    return record.get("sha256") == file_sha256(path)


@dataclass
class GenerationReport:
    rows: int
    shards: int
    shards_made: int  # this run
    rows_made: int  # this run
    seconds: float  # this run's generation time


def generate_trajectories(teacher: Any, source: Path, out: Path, settings: TrajectorySettings,
                          on_batch: Callable[[int, int], None] | None = None) -> GenerationReport:
    """Write the trajectory set of the prompts in ``source`` (split ``train``) to ``out`` (module doc),
    resuming what an earlier run with the same settings finished. ``on_batch(shard, rows_done_in_shard)``
    is called after each teacher batch (progress; a test kills the process there). Unconditional
    embedding: the negative prompt's (the empty prompt's where none); a CFG scale ≠ 1 without either is a
    :class:`UserError`."""
    import time

    started = time.perf_counter()
    dataset = read_text_embeddings(source, SPLIT)
    uncond = read_empty_prompt_embedding(source, "negative")
    if uncond is None and (settings.guidance_scale != 1.0 or settings.guidance_scale_2 not in (None, 1.0)):
        raise UserError(f"{source}: no {EMPTY_PROMPT_FILE} (nor {NEGATIVE_PROMPT_FILE}): the unconditional prompt of the "
                        f"teacher's CFG ({settings.guidance_scale}); rerun the stage that made {source}")
    n = teacher.schedule.num_train_timesteps
    grid, record = ode_grid(teacher.schedule.inference_sigmas(settings.teacher_steps), settings.t_list, n)
    per = settings.seeds_per_prompt
    total = len(dataset) * per
    recorded = settings.record()
    out.mkdir(parents=True, exist_ok=True)
    for leftover in [*out.iterdir(), *((out / SPLIT).iterdir() if (out / SPLIT).is_dir() else ())]:
        # a killed run's half-written file: a shard's ``.<name>.tmp``, a record's ``.<name>.tmp-<pid>`` (write_text_atomic)
        if TEMP_FILE.match(leftover.name) and leftover.is_file() and not leftover.is_symlink():
            leftover.unlink()
    meta = _source_manifest(source).get("settings") or {}
    shards = (total + settings.rows_per_shard - 1) // settings.rows_per_shard
    made = rows_made = 0
    digests = []
    for k in range(shards):
        lo, hi = k * settings.rows_per_shard, min(total, (k + 1) * settings.rows_per_shard)
        rows = [(r // per, r % per) for r in range(lo, hi)]
        items = {i: dataset[i] for i in sorted({i for i, _ in rows})}
        keys = [(items[i]["id"], s) for i, s in rows]
        extras = [_row_extras(items[i]) for i, _ in rows]
        if len({len(e) for e in extras}) > 1 or len({len(_row_extras(item)) for item in items.values()}) > 1:
            raise UserError(f"{source}: some rows have a first frame (image-to-video) and some not; rerun the stage "
                            f"that made {source}")
        inputs = rows_digest(keys, [items[i]["text_embedding"] for i, _ in rows], extras if extras and extras[0] else None)
        path = shard_path(out, SPLIT, k)
        if not shard_is_done(path, recorded, inputs, len(rows)):
            records = []
            for start in range(0, len(rows), settings.batch_size):
                part = rows[start:start + settings.batch_size]
                records += _batch_records(teacher, items, part, uncond, grid, record, settings, meta)
                if on_batch is not None:
                    on_batch(k, start + len(part))
            write_shard(records, path)
            record_json = {"format": FORMAT, "settings": recorded, "inputs_sha256": inputs, "rows": len(rows),
                           "sha256": file_sha256(path)}
            write_text_atomic(shard_record_path(path), json.dumps(record_json, indent=2, sort_keys=True))
            made, rows_made = made + 1, rows_made + len(rows)
        digests.append(file_sha256(path))
    for stale in sorted((out / SPLIT).glob("shard-*.parquet")):  # shards of a larger earlier set
        if int(stale.stem.split("-")[1]) >= shards:
            stale.unlink()
            shard_record_path(stale).unlink(missing_ok=True)
    _write_manifest(source, out, settings, total, shards, digests, int(dataset[0]["text_embedding"].shape[1]))
    return GenerationReport(total, shards, made, rows_made, round(time.perf_counter() - started, 3))


def _batch_records(teacher: Any, items: dict[int, dict[str, Any]], part: list[tuple[int, int]], uncond: torch.Tensor | None,
                   grid: list[float], record: list[int], settings: TrajectorySettings,
                   meta: dict[str, Any]) -> list[LatentRecord]:
    """One teacher batch: the trajectories of the rows ``part`` ((prompt index, seed index) pairs) as records
    (``meta``: the source set's settings, whose frames, size and fps the rows name)."""
    device = teacher.device
    length = settings.text_max_length
    text = torch.stack([pad_prompt_embedding(items[i]["text_embedding"], length, torch.float32) for i, _ in part]).to(device)
    negative = None
    if uncond is not None:
        negative = pad_prompt_embedding(uncond, length, torch.float32).to(device).unsqueeze(0).expand_as(text)
    shape = tuple(settings.latent_shape)
    noise = torch.stack([row_noise(settings.seed, items[i]["id"], s, shape) for i, s in part])
    first = images = None
    if items[part[0][0]].get("first_frame") is not None:  # image-to-video: each row's frame and image embeddings
        first = torch.stack([items[i]["first_frame"].float() for i, _ in part]).to(device)
        if items[part[0][0]].get("image_embedding") is not None:
            images = torch.stack([items[i]["image_embedding"].float() for i, _ in part]).to(device)
    points = teacher_trajectory(teacher, text, negative, noise, grid, record, settings.guidance_scale,
                                first_frame=first, image_embeds=images, guidance_scale_2=settings.guidance_scale_2).cpu()
    c, t, h, w = shape
    out = []
    for row, (i, s) in enumerate(part):
        item = items[i]
        out.append(LatentRecord(id=f"{item['id']}#seed{s}", caption=str(item["caption"]),
                                latent=points[row].reshape(len(record) * c, t, h, w).contiguous(),
                                text_embedding=item["text_embedding"].clone(),
                                num_frames=int(meta.get("num_frames") or 0), height=int(meta.get("height") or 0),
                                width=int(meta.get("width") or 0), fps=float(meta.get("fps") or 0.0), source=SOURCE,
                                first_frame=None if item.get("first_frame") is None else item["first_frame"].clone(),
                                image_embedding=None if item.get("image_embedding") is None else item["image_embedding"].clone()))
    return out


def _source_manifest(source: Path) -> dict[str, Any]:
    """The source set's manifest (``{}`` for a set written without one, e.g. the demo latents)."""
    try:
        manifest = json.loads((source / MANIFEST_FILE).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        raise UserError(f"{source / MANIFEST_FILE}: unreadable; rerun the stage that made {source}") from None
    return manifest if isinstance(manifest, dict) else {}


def _write_manifest(source: Path, out: Path, settings: TrajectorySettings, rows: int, shards: int, digests: list[str],
                    text_dim: int) -> None:
    """``preprocess.json`` (the latent-set manifest the trainer and the stages read: the source's settings,
    one point's channels, the stacked row shape, the row count) and ``trajectories.json`` (the settings and
    every shard's sha256); the source's empty/negative prompt embeddings copied beside them."""
    src = _source_manifest(source)
    c, t, h, w = settings.latent_shape
    points = len(settings.t_list)
    manifest = {"settings": src.get("settings") or {"max_sequence_length": settings.text_max_length},
                "base": src.get("base"), "data": str(source),
                "splits": {SPLIT: {"rows": rows, "skipped": 0, "entries": rows}},
                "latent_channels": c, "latent_shape": [points * c, t, h, w], "text_dim": text_dim,
                "normalisation": src.get("normalisation"), "trajectory_points": points}
    if src.get("image_conditioning") is not None:  # the rows carry the source's first frames and image embeddings
        manifest["image_conditioning"] = src["image_conditioning"]
    write_text_atomic(out / MANIFEST_FILE, json.dumps(manifest, indent=2))
    write_text_atomic(out / SETTINGS_FILE, json.dumps({"format": FORMAT, "settings": settings.record(), "rows": rows,
                                                        "shards": shards, "shard_sha256": digests}, indent=2))
    for name in (EMPTY_PROMPT_FILE, NEGATIVE_PROMPT_FILE):
        if (source / name).is_file():
            tmp = out / f".{name}.tmp"
            shutil.copyfile(source / name, tmp)
            tmp.replace(out / name)
        else:
            (out / name).unlink(missing_ok=True)


def source_layout(source: Path) -> tuple[list[int], int]:
    """``(latent_shape [C, T, H, W], max_sequence_length)`` the trajectories of ``source`` take, from its
    manifest; one line when it says neither."""
    try:
        manifest = json.loads((source / MANIFEST_FILE).read_text())
        shape = [int(v) for v in manifest["latent_shape"]]
        length = int(manifest["settings"]["max_sequence_length"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{source / MANIFEST_FILE}: no latent_shape and max_sequence_length; rerun the stage that made "
                        f"{source}") from None
    if len(shape) != 4:
        raise UserError(f"{source / MANIFEST_FILE}: latent_shape {shape} is not [C, T, H, W]")
    return shape, length
