"""Synthetic captioned clips (moving coloured shapes) and the prompt-adherence analyzer.

- :mod:`~distillery.clips.grammar`: the caption grammar (``a red circle moving left on a black background``).
- :mod:`~distillery.clips.synthetic`: :func:`make_clip_set` writes a deterministic clip set in the
  layout of a user's own data (``<split>/videos/*.mp4`` + ``<split>/captions.jsonl``).
- :mod:`~distillery.clips.analyzer`: reads colour, shape and direction back from frames and scores captions.
- :mod:`~distillery.clips.video_io`: MP4 read/write.
"""

from distillery.clips.analyzer import (
    AnalyzedClip,
    AnalyzerConfig,
    analyze,
    calibrate,
    evaluate,
    score,
    score_analysis,
)
from distillery.clips.grammar import ClipAttributes, format_caption, parse_caption
from distillery.clips.synthetic import ClipSetConfig, ClipSpec, make_clip_set, plan_clips, render_clip
from distillery.clips.video_io import iter_captioned_videos, read_video, write_video

__all__ = [
    "AnalyzedClip",
    "AnalyzerConfig",
    "ClipAttributes",
    "ClipSetConfig",
    "ClipSpec",
    "analyze",
    "calibrate",
    "evaluate",
    "format_caption",
    "iter_captioned_videos",
    "make_clip_set",
    "parse_caption",
    "plan_clips",
    "read_video",
    "render_clip",
    "score",
    "score_analysis",
    "write_video",
]
