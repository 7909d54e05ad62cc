"""Validate's sample cache: a candidate's videos and their scores, kept by what determines them.

:func:`distillery.evaluation.validate.run_validation` given a :class:`SampleCache` reuses a candidate's
samples instead of sampling it again when an entry with the candidate's **key** is in the cache and
checks out. The key is the sha256 of the canonical JSON of its *material* (:func:`entry_key`):

- ``context`` (the same for every candidate of a run): prompts, the digest of the padded text
  embeddings the samplers see (whatever made them), the seed grid, latent shape, frames / size /
  fps, the digest of the base's VAE files and its analyzer thresholds (decode and adherence scores),
  the device (its name and compute capability on CUDA, the CPU thread count: CPU rounding depends on
  it), the candidates' precision, what resolves ``attention_backend: auto`` (the ``flash_attn``
  version), the torch / diffusers / numpy versions, the digest of the sources of the packages that
  sample and score (:data:`CODE_PACKAGES`) and :data:`CACHE_FORMAT`;
- ``candidate``: its sampling contract (sampler, steps, guidance, ladder, options, the resolved flow
  shift, the model options the sampler asks for) and the sha256 of **every byte** of every file of its
  transformer and scheduler folders and its ``sampling.json`` (read in full each run, never taken
  from the hash cache: a flipped weight byte with its mtime restored is still a new key; the digests
  are recorded in the workspace hash cache as they are read, so lineage does not read them again).

The candidate's name is not part of it: the same model and contract under another name is reused.
What is cached is what depends on the candidate alone — per video its latents, decoded frames
(uint8, exact), the MP4 the artifact ships, analyzer scores, sharpness, feature vector and the wall
time it took. Everything measured against the reference (paired distance, Fréchet distance and its
bootstrap, the noise floor) and every summary is computed again from those each run, so a reused
candidate's metrics are bitwise what sampling it again on the same machine gives, its latency the
one measured when it was sampled. The CLIP scores (``validate.clip_model``,
:mod:`distillery.evaluation.clip_scores`) are not cached and not part of a key: they are read from the
frames (cached or fresh) every run, so changing the CLIP folder rescores every candidate from its
cached frames — never a stale score, and no candidate sampled again for it (:data:`SCORE_KEYS` are the
analyzer's readings only).

Layout (``root``, the stage's ``runs/validate/cache/``: not a DVC out, so ``dvc repro`` never
deletes it; ``rm -rf`` it to sample everything again)::

    root/<key>/entry.json            {"format", "key", "candidate" (name when stored), "stored",
                                      "material", "videos" (per video, sampling order), "files"
                                      (name → sha256 of every other file of the entry), "seal"
                                      (sha256 of the canonical JSON of the other keys)}
    root/<key>/latents.safetensors   key <i>[_s<j>] → float32 [C, T, H, W]
    root/<key>/frames.safetensors    key <i>[_s<j>] → uint8 [T, H, W, 3]
    root/<key>/<i>[_s<j>].mp4        the video as the artifact ships it

Trust: an entry is used only when its folder is a real folder, ``entry.json`` parses within bounds,
its seal matches and it holds exactly the expected key and material, every file it lists is a regular file (no link)
whose bytes have the recorded sha256 and no other file is there, and every video record and tensor
has the expected keys, shapes, dtypes and types (:meth:`SampleCache.load`). Anything else — a
truncated file, a flipped byte, a swapped entry, a forged record of another shape — is one log line
naming the candidate and why, and the candidate is sampled again (its fresh entry replaces the bad
one). The entry holds no secret: like lineage's seal, a folder rewritten consistently (files and the
digests in ``entry.json``) is believed; whoever can write ``runs/`` can also rewrite the artifacts.

Entries are written to a temporary sibling and renamed; a write that fails is a warning (the run's
results are all there). :meth:`SampleCache.prune` keeps the entries of the current run and the most
recently used others within :data:`KEEP_BYTES`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import re
import shutil
import stat
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distillery.common.fsutil import read_json_file, replace_dir
from distillery.common.log import get_logger
from distillery.common.treeutil import flatten

log = get_logger("validate")

CACHE_FORMAT = 1  # bump when what an entry holds, or how a key is made, changes
CODE_PACKAGES = ("clips", "common", "components", "config", "data", "evaluation", "models", "sampling")
# the distillery packages whose code decides a sample or a score (their .py sources are hashed into every key)
ENTRY_FILE = "entry.json"
LATENTS_FILE = "latents.safetensors"
FRAMES_FILE = "frames.safetensors"
MAX_ENTRY_JSON_BYTES = 64 << 20
KEEP_BYTES = 32 << 30  # entries of other runs kept (most recently used first) up to this many bytes
SCORE_KEYS = ("colour", "shape", "direction", "all")
_KEY_RE = re.compile(r"^[0-9a-f]{64}$")


def canonical(data: Any) -> str:
    """The canonical JSON text of ``data`` (sorted keys, no spaces): what a key hashes."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)


def entry_key(material: Mapping[str, Any]) -> str:
    """sha256 hex of :func:`canonical` ``material``."""
    return hashlib.sha256(canonical(material).encode()).hexdigest()


def file_digests(paths: Iterable[Path], root: Path) -> dict[str, str]:
    """``{path relative to root: sha256}`` of every regular file under each of ``paths`` (a file or a
    folder, recursively; links are not followed), read from the bytes. The digests are recorded in
    the workspace hash cache when one is active (:func:`distillery.common.hashcache.from_bytes`)."""
    from distillery.common.hashcache import file_sha256, from_bytes

    out: dict[str, str] = {}
    with from_bytes():
        for path in paths:
            path = Path(path)
            files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink())
            for f in files:
                out[os.path.relpath(f, root)] = file_sha256(f)
    return dict(sorted(out.items()))


def tensor_digest(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 over each tensor's dtype, shape and bytes (CPU, contiguous), in order."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}{list(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 over the sources (relative path + bytes) of :data:`CODE_PACKAGES` of this distillery."""
    import distillery

    top = Path(distillery.__file__).resolve().parent
    h = hashlib.sha256()
    for package in CODE_PACKAGES:
        for path in sorted((top / package).rglob("*.py")):
            h.update(path.relative_to(top).as_posix().encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_facts(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """What of the machine and the libraries a sample's bits depend on (part of the context material)."""
    import diffusers

    facts: dict[str, Any] = {"device": str(device), "dtype": str(dtype), "torch": torch.__version__,
                             "diffusers": diffusers.__version__, "numpy": np.__version__,
                             "flash_attn": _version("flash-attn") or _version("flash_attn"),
                             "threads": torch.get_num_threads(), "machine": platform.machine()}
    if device.type == "cuda":  # GPU-only code paths: FlashAttention-4 (attention_backend auto) and the decode's Triton kernels
        facts.update(gpu=torch.cuda.get_device_name(device), capability=list(torch.cuda.get_device_capability(device)),
                     cuda=torch.version.cuda, flash_attn_4=_version("flash-attn-4"), triton=_version("triton"))
    return facts


@dataclass
class CachedVideo:
    """What one video of a candidate scored, whatever the reference (an entry's ``videos`` row)."""

    prompt: int  # prompt index i
    seed_index: int  # seed index j
    seed: int  # generator seed of its noise
    scores: dict[str, bool]  # analyzer adherence: colour, shape, direction, all
    latency_s: float  # wall seconds for sampling + decode, measured when it was sampled
    sharpness: float  # video_metrics.sharpness
    features: list[float]  # video_metrics.video_features

    def record(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "seed_index": self.seed_index, "seed": self.seed, "scores": dict(self.scores),
                "latency_s": self.latency_s, "sharpness": self.sharpness, "features": list(self.features)}


@dataclass
class CachedCandidate:
    """A usable entry: per video (in sampling order) its record, latents, frames and MP4 file."""

    key: str
    videos: list[CachedVideo]
    latents: dict[str, torch.Tensor]  # sample key → float32 [C, T, H, W]
    frames: dict[str, np.ndarray]  # sample key → uint8 [T, H, W, 3]
    folder: Path  # holds <sample key>.mp4
    stored: str  # when it was sampled (UTC, ISO 8601)
    load: dict[str, Any] | None = None  # the machine's load when it was sampled (machine_load; None: an older entry)


def machine_load() -> dict[str, Any]:
    """The machine's 1-minute load average and CPU count, now: what a latency measured now ran beside
    (a reused candidate's latency is compared with fresh ones only together with it)."""
    try:
        load = round(os.getloadavg()[0], 2)
    except OSError:
        load = None
    return {"load_1min": load, "cpus": os.cpu_count()}


@dataclass(frozen=True)
class Expected:
    """What a run needs an entry to hold: videos ``(prompt, seed index, seed, sample key)`` in sampling
    order, latents ``[C, T, H, W]``, frames ``[T, H, W, 3]``, features of ``num_features``."""

    videos: tuple[tuple[int, int, int, str], ...]
    latent_shape: tuple[int, ...]
    frame_shape: tuple[int, ...]
    num_features: int


class Unusable(Exception):
    """Why an entry cannot be used (one short phrase)."""


def _seal(entry: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of an entry's every key but ``seal`` (catches an edit that does not
    also recompute it)."""
    try:
        return entry_key({k: v for k, v in entry.items() if k != "seal"})
    except ValueError:  # a NaN or infinity: not an entry this module wrote
        return ""


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _record(row: Any, want: tuple[int, int, int, str], num_features: int) -> CachedVideo:
    prompt, seed_index, seed, key = want
    if not isinstance(row, dict) or set(row) != {"prompt", "seed_index", "seed", "scores", "latency_s", "sharpness", "features"}:
        raise Unusable(f"video {key}: not a video record")
    if (row["prompt"], row["seed_index"], row["seed"]) != (prompt, seed_index, seed) or \
            not all(isinstance(row[k], int) and not isinstance(row[k], bool) for k in ("prompt", "seed_index", "seed")):
        raise Unusable(f"video {key}: recorded for another prompt or seed")
    scores = row["scores"]
    if not isinstance(scores, dict) or set(scores) != set(SCORE_KEYS) or not all(isinstance(v, bool) for v in scores.values()):
        raise Unusable(f"video {key}: scores are not {', '.join(SCORE_KEYS)} booleans")
    features = row["features"]
    if not (isinstance(features, list) and len(features) == num_features and all(map(_is_number, features))):
        raise Unusable(f"video {key}: features are not {num_features} numbers")
    if not (_is_number(row["latency_s"]) and math.isfinite(row["latency_s"]) and row["latency_s"] >= 0
            and _is_number(row["sharpness"])):
        raise Unusable(f"video {key}: latency or sharpness is not a number")
    return CachedVideo(prompt, seed_index, seed, {k: scores[k] for k in SCORE_KEYS}, float(row["latency_s"]),
                       float(row["sharpness"]), [float(f) for f in features])


def _tensors(path: Path, keys: Sequence[str], shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise Unusable(f"{path.name}: not readable ({str(exc)[:80]})") from None
    if sorted(tensors) != sorted(keys):
        raise Unusable(f"{path.name}: holds other videos than the run's")
    for k, t in tensors.items():
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise Unusable(f"{path.name}: {k} is {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)}")
    return tensors


class SampleCache:
    """The cache folder ``root`` (module doc). :meth:`load` an entry or say why not; :meth:`store` one."""

    def __init__(self, root: Path, keep_bytes: int = KEEP_BYTES) -> None:
        self.root = Path(root)
        self.keep_bytes = keep_bytes

    def _folder(self, key: str) -> Path:
        if not _KEY_RE.match(key):
            raise ValueError(f"not a cache key: {key!r}")
        return self.root / key

    def load(self, key: str, material: Mapping[str, Any], expected: Expected) -> tuple[CachedCandidate | None, str]:
        """The entry ``key`` when it checks out (module doc), else ``(None, why)``: ``"no entry"`` when
        there is none, else why it is unusable."""
        folder = self._folder(key)
        try:
            st = os.lstat(folder)
        except FileNotFoundError:
            return None, "no entry"
        except OSError as exc:
            return None, f"unusable entry: {exc.strerror or exc}"
        try:
            if not stat.S_ISDIR(st.st_mode):
                raise Unusable("not a folder")
            return self._check(folder, key, material, expected), ""
        except Unusable as exc:
            return None, f"unusable entry: {exc}"
        except OSError as exc:  # unreadable files or folders
            return None, f"unusable entry: {exc.strerror or exc}"

    def _check(self, folder: Path, key: str, material: Mapping[str, Any], expected: Expected) -> CachedCandidate:
        from distillery.common.hashcache import read_sha256

        try:
            entry = read_json_file(folder / ENTRY_FILE, MAX_ENTRY_JSON_BYTES)
        except FileNotFoundError:
            raise Unusable(f"no {ENTRY_FILE}") from None
        except (OSError, ValueError) as exc:
            raise Unusable(f"{ENTRY_FILE}: {exc}") from None
        if not isinstance(entry, dict) or entry.get("format") != CACHE_FORMAT or entry.get("key") != key:
            raise Unusable(f"{ENTRY_FILE} is not an entry of this format for this key")
        if entry.get("seal") != _seal(entry):
            raise Unusable(f"{ENTRY_FILE} was edited after it was stored (its seal does not match)")
        if entry.get("material") != json.loads(canonical(material)):
            raise Unusable(f"{ENTRY_FILE} records another candidate or run (its material differs from the key's)")
        names = [k for *_, k in expected.videos]
        want_files = {LATENTS_FILE, FRAMES_FILE, *(f"{k}.mp4" for k in names)}
        files = entry.get("files")
        if not isinstance(files, dict) or set(files) != want_files or not all(isinstance(v, str) for v in files.values()):
            raise Unusable(f"{ENTRY_FILE} lists other files than a run's videos")
        present = {p.name for p in folder.iterdir()} - {ENTRY_FILE}
        if present != want_files:
            raise Unusable(f"holds other files than it lists ({', '.join(sorted(present ^ want_files)[:3])})")
        for name, digest in sorted(files.items()):
            path = folder / name
            if not stat.S_ISREG(os.lstat(path).st_mode):
                raise Unusable(f"{name} is not a regular file")
            if read_sha256(path) != digest:
                raise Unusable(f"{name} does not have the bytes it was stored with")
        rows = entry.get("videos")
        if not isinstance(rows, list) or len(rows) != len(expected.videos):
            raise Unusable(f"{ENTRY_FILE} has {len(rows) if isinstance(rows, list) else 'no'} video records, "
                           f"expected {len(expected.videos)}")
        videos = [_record(row, want, expected.num_features) for row, want in zip(rows, expected.videos)]
        latents = _tensors(folder / LATENTS_FILE, names, expected.latent_shape, torch.float32)
        frames = _tensors(folder / FRAMES_FILE, names, expected.frame_shape, torch.uint8)
        with contextlib.suppress(OSError):  # a read-only cache is still used
            os.utime(folder / ENTRY_FILE)  # most recently used (prune)
        load = entry.get("load") if isinstance(entry.get("load"), dict) else None
        return CachedCandidate(key, videos, latents, {k: t.numpy() for k, t in frames.items()}, folder,
                               str(entry.get("stored", "")), load)

    def store(self, key: str, material: Mapping[str, Any], name: str, videos: Sequence[CachedVideo],
              latents: Mapping[str, torch.Tensor], frames: Mapping[str, np.ndarray], mp4_dir: Path,
              load: Mapping[str, Any] | None = None) -> bool:
        """Write the entry ``key`` (through a temporary sibling, renamed): the videos' records, latents,
        frames and the MP4 files ``mp4_dir/<sample key>.mp4``. A failure is a warning; returns whether
        the entry was written."""
        from safetensors.torch import save_file

        from distillery.common.hashcache import read_sha256

        folder = self._folder(key)
        tmp = self.root / f".tmp-{key[:16]}-{os.getpid()}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            save_file({k: t.contiguous() for k, t in latents.items()}, str(tmp / LATENTS_FILE))
            save_file({k: torch.from_numpy(np.ascontiguousarray(f)) for k, f in frames.items()}, str(tmp / FRAMES_FILE))
            for k in latents:
                shutil.copyfile(mp4_dir / f"{k}.mp4", tmp / f"{k}.mp4")
            entry = {"format": CACHE_FORMAT, "key": key, "candidate": name,
                     "stored": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load": dict(load or machine_load()),
                     "material": json.loads(canonical(material)), "videos": [v.record() for v in videos],
                     "files": {p.name: read_sha256(p) for p in sorted(tmp.iterdir())}}
            entry["seal"] = _seal(entry)
            (tmp / ENTRY_FILE).write_text(json.dumps(entry, indent=1) + "\n")
            if os.path.lexists(folder) and not stat.S_ISDIR(os.lstat(folder).st_mode):
                os.unlink(folder)  # a file or a link where the entry goes
            replace_dir(tmp, folder)
            return True
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            log.warning("validate: could not keep %s's samples in %s (%s); the next run samples it again", name,
                        self.root, exc.strerror or exc)
            return False

    def _entries(self) -> list[tuple[Path, os.stat_result]]:
        """Every entry folder (name a key, a real folder) with the stat of its entry.json (absent: the folder's)."""
        out = []
        try:
            children = list(self.root.iterdir())
        except OSError:
            return []
        for p in children:
            if not _KEY_RE.match(p.name) or not stat.S_ISDIR(os.lstat(p).st_mode):
                continue
            try:
                out.append((p, os.stat(p / ENTRY_FILE)))
            except OSError:
                out.append((p, os.lstat(p)))
        return out

    def what_changed(self, name: str, material: Mapping[str, Any], limit: int = 3) -> str:
        """Against the most recent entry stored for a candidate named ``name``: which material keys differ
        (dotted, at most ``limit``), or ``""`` when there is none to compare with."""
        latest: tuple[float, dict] | None = None
        for folder, st in self._entries():
            try:
                entry = read_json_file(folder / ENTRY_FILE, MAX_ENTRY_JSON_BYTES)
            except (OSError, ValueError):
                continue
            if isinstance(entry, dict) and entry.get("candidate") == name and isinstance(entry.get("material"), dict):
                if latest is None or st.st_mtime > latest[0]:
                    latest = (st.st_mtime, entry["material"])
        if latest is None:
            return ""
        old, new = flatten(latest[1]), flatten(json.loads(canonical(material)))
        changed = [k for k in sorted(set(old) | set(new)) if old.get(k, object()) != new.get(k, object())]
        if not changed:
            return ""
        more = f" (+{len(changed) - limit} more)" if len(changed) > limit else ""
        return ", ".join(changed[:limit]) + more

    def prune(self, keep: set[str]) -> None:
        """Delete the entries not in ``keep`` beyond :attr:`keep_bytes`, least recently used first, and
        temporary folders of processes that are gone."""
        for p in self.root.glob(".tmp-*-*"):
            pid = p.name.rsplit("-", 1)[-1]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                shutil.rmtree(p, ignore_errors=True)
        others = sorted(((st.st_mtime, p) for p, st in self._entries() if p.name not in keep), reverse=True)
        total = 0
        for _, folder in others:
            total += sum(f.stat().st_size for f in folder.iterdir() if f.is_file() and not f.is_symlink())
            if total > self.keep_bytes:
                shutil.rmtree(folder, ignore_errors=True)
