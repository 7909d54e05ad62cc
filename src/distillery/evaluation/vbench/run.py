"""A VBench evaluation of one candidate's videos: :class:`VBenchConfig` (what the user sets), :func:`score_videos`
(the videos of a protocol, decoded as VBench reads files, scored and aggregated) and :func:`score_folder`, which
finds them in a folder by VBench's names (``<prompt>-<seed index>.mp4``) and writes ``vbench.json``, ``vbench.md``
and ``videos.jsonl`` (one line per video and dimension) into a new folder, atomically.

Everything that can be known before a model loads is checked first, each failure one line (exit 2 from the CLI): the
config, the protocol and its prompt file, every model folder, every video present and long enough (frame counts
read from the containers); then the models load, and the videos are decoded and scored one at a time.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from distillery.common.errors import UserError
from distillery.common.log import get_logger
from distillery.evaluation.vbench.score import COMPUTED

log = get_logger(__name__)


@dataclass
class VBenchConfig:
    """What a VBench evaluation computes and with which models (module doc; :mod:`.protocol`, :mod:`.models`)."""

    protocol: str = "vbench_standard"  # vbench_standard | vbench_extended | custom
    dimensions: list[str] = field(default_factory=lambda: list(COMPUTED))
    models: dict[str, str] = field(default_factory=dict)  # model key -> folder
    seeds_per_prompt: int = 5
    extended_prompts: str | None = None  # vbench_extended: the rewritten prompts, one per suite line
    prompts: list[str] | None = None  # custom: the prompts
    device: str = "cpu"

    def build_protocol(self):
        from distillery.evaluation.vbench.protocol import Protocol

        return Protocol(self.protocol, tuple(self.dimensions), self.seeds_per_prompt, self.extended_prompts, self.prompts)

    @classmethod
    def from_mapping(cls, data: object, where: str = "vbench") -> "VBenchConfig":
        """The config from a parsed YAML/JSON mapping; an unknown key or a wrong type is one line."""
        if not isinstance(data, dict):
            raise UserError(f"{where}: expected a mapping, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"{where}: unknown key {unknown[0]!r}; valid: {', '.join(sorted(known))}")
        if not isinstance(data.get("models", {}), dict):
            raise UserError(f"{where}.models: expected a mapping of model key to folder")
        if "dimensions" in data and not isinstance(data["dimensions"], list):
            raise UserError(f"{where}.dimensions: expected a list of dimension names")
        return cls(**data)


def video_shape(path: Path) -> tuple[int, int, int]:
    """(frames, height, width) of a video file: its stream's frame count, or the frames decoded when it has none."""
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise UserError(f"vbench: {path} has no video stream")
            stream = container.streams.video[0]
            count = stream.frames or sum(1 for _ in container.decode(stream))
            return count, stream.codec_context.height, stream.codec_context.width
    except av.FFmpegError as exc:
        raise UserError(f"vbench: cannot read {path}: {exc}") from None


def find_videos(protocol, folder: Path) -> list[tuple[object, Path]]:
    """(video spec, file) of every video the protocol needs, by VBench's names; a missing one is one line (VBench
    warns and scores fewer videos, which moves the number: refused here)."""
    found, missing = [], []
    for spec in protocol.videos():
        path = folder / f"{spec.name}.mp4"
        (found if path.is_file() else missing).append((spec, path))
    if missing:
        raise UserError(f"vbench: {len(missing)} of the {len(found) + len(missing)} videos protocol {protocol.name} needs "
                        f"are missing from {folder}, e.g. {missing[0][1].name!r}")
    return found


def check_videos(videos: list[tuple[object, Path]]) -> None:
    """Every video ((spec, mp4 path)) long and large enough for its dimensions, read from its container: one line
    for the first that is not (before any model loads)."""
    from distillery.evaluation.vbench.dimensions import check_video

    for spec, path in videos:
        check_video(*video_shape(path), spec.entry.dimensions, path.name)


def score_videos(scorer, protocol, videos: list[tuple[object, Path]], candidate: str) -> tuple[dict, list]:
    """Score ``videos`` ((spec, mp4 path)) of ``protocol`` with ``scorer`` (a
    :class:`~distillery.evaluation.vbench.dimensions.VBenchScorer`), each decoded from its file as
    ``distillery vbench score`` decodes it: (``candidate``'s report, the per-video rows)."""
    from distillery.clips.video_io import read_video

    rows = []
    for i, (spec, path) in enumerate(videos):
        frames, fps = read_video(path)
        rows += scorer.score(frames, fps, spec.entry.prompt, spec.entry.dimensions, spec.name)
        if (i + 1) % 50 == 0 or i + 1 == len(videos):
            log.info("vbench %s: %d/%d videos scored", candidate, i + 1, len(videos))
    return videos_report(scorer, protocol, rows, len(videos), candidate), rows


def videos_report(scorer, protocol, rows: list, videos: int, candidate: str) -> dict:
    """``candidate``'s report from its ``videos`` videos' scores ``rows`` (each dimension aggregated as VBench does)."""
    from distillery.evaluation.vbench.dimensions import aggregate
    from distillery.evaluation.vbench.report import build_report

    return build_report(candidate, protocol.describe(), scorer.describe(), scorer.published, aggregate(rows), videos)


def score_folder(cfg: VBenchConfig, videos_dir: str | Path, out_dir: str | Path, candidate: str = "candidate") -> dict:
    """Score the protocol's videos in ``videos_dir`` and write the results into ``out_dir`` (module doc)."""
    from distillery.common.fsutil import replace_dir
    from distillery.evaluation.vbench.models import check_folders

    protocol = cfg.build_protocol()
    check_folders(cfg.models, cfg.dimensions)
    folder = Path(videos_dir).expanduser()
    if not folder.is_dir():
        raise UserError(f"vbench: videos folder {folder} does not exist")
    videos = find_videos(protocol, folder)
    check_videos(videos)  # lengths and sizes first: a short or small video refused before any model loads
    from distillery.evaluation.vbench.dimensions import VBenchScorer

    report, rows = score_videos(VBenchScorer(cfg.models, tuple(cfg.dimensions), cfg.device), protocol, videos, candidate)
    out = Path(out_dir).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write_results(staging, [report], rows)
        replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return report


def write_results(folder: Path, reports: list[dict], rows: list) -> None:
    """``vbench.json`` (one candidate's report, or ``{"candidates": [...]}`` of several), ``vbench.md`` (the published
    rows and every candidate's) and ``videos.jsonl`` (one line per video and dimension) into ``folder``."""
    from distillery.evaluation.vbench.report import markdown

    folder.mkdir(parents=True, exist_ok=True)
    data = reports[0] if len(reports) == 1 else {"candidates": reports}
    (folder / "vbench.json").write_text(json.dumps(data, indent=2) + "\n")
    (folder / "vbench.md").write_text(markdown(reports))
    with open(folder / "videos.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({"video": r.name, "dimension": r.dimension, "value": r.value, "weight": r.weight}) + "\n")
