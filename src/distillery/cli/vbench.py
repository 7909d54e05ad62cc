"""``distillery vbench ...``: VBench's quality dimensions and quality score, computed as VBench 0.1.5 computes them.

    distillery vbench prompts --config FILE [--out FILE]
    distillery vbench score --config FILE --videos DIR --out DIR [--candidate NAME]

FILE is YAML (:class:`~distillery.evaluation.vbench.run.VBenchConfig`): ``protocol`` (``vbench_standard``,
``vbench_extended`` with ``extended_prompts``, or ``custom`` with ``prompts``), ``dimensions``, ``models`` (one folder
per model key: ``distillery.evaluation.vbench.models``), ``seeds_per_prompt``, ``device``. ``prompts`` writes the videos
to sample as tab-separated lines ``<file stem>\\t<seed index>\\t<prompt to sample>`` (stdout without ``--out``);
``score`` reads ``<file stem>.mp4`` for each of them from ``--videos`` and writes ``vbench.json``, ``vbench.md`` and
``videos.jsonl`` into ``--out``. Bad input is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from distillery.common.errors import UserError


def add_command(subparsers: argparse._SubParsersAction, name: str, help: str) -> None:  # noqa: A002
    """Add the ``vbench`` command group (``prompts``, ``score``)."""
    vb = subparsers.add_parser(name, help=help)
    sub = vb.add_subparsers(dest="vbench_command", required=True, metavar="COMMAND")
    prompts = sub.add_parser("prompts", help="list the videos a protocol needs (file stem, seed index, prompt to sample)")
    prompts.add_argument("--config", required=True, help="the VBench config (YAML)")
    prompts.add_argument("--out", default=None, help="file to write (default: stdout)")
    prompts.set_defaults(func=_prompts)
    score = sub.add_parser("score", help="score a folder of videos on VBench's dimensions and quality score")
    score.add_argument("--config", required=True, help="the VBench config (YAML)")
    score.add_argument("--videos", required=True, help="folder of <prompt>-<seed index>.mp4 videos")
    score.add_argument("--out", required=True, help="folder to write vbench.json, vbench.md, videos.jsonl into (replaced)")
    score.add_argument("--candidate", default="candidate", help="the name of the scored model in the report")
    score.set_defaults(func=_score)


def read_config(path: str):
    """The :class:`~distillery.evaluation.vbench.run.VBenchConfig` of a YAML file, or one line."""
    import yaml

    from distillery.evaluation.vbench.run import VBenchConfig

    file = Path(path).expanduser()
    try:
        data = yaml.safe_load(file.read_text())
    except OSError as exc:
        raise UserError(f"vbench --config: cannot read {file} ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise UserError(f"vbench --config: {file} is not YAML ({str(exc).splitlines()[0]})") from None
    try:
        return VBenchConfig.from_mapping(data)
    except TypeError as exc:
        raise UserError(f"vbench --config: {exc}") from None


def _prompts(args: argparse.Namespace) -> int:
    protocol = read_config(args.config).build_protocol()
    lines = [f"{v.name}\t{v.seed_index}\t{v.entry.sampled}" for v in protocol.videos()]
    text = "\n".join(lines) + "\n"
    if args.out:
        from distillery.common.fsutil import write_text_atomic

        write_text_atomic(Path(args.out), text)
    else:
        sys.stdout.write(text)
    return 0


def _score(args: argparse.Namespace) -> int:
    from distillery.evaluation.vbench.run import score_folder

    report = score_folder(read_config(args.config), args.videos, args.out, args.candidate)
    quality = report["quality_score"]
    print(f"vbench {args.candidate}: quality score {'—' if quality is None else f'{quality:.2f}'} "
          f"({report['protocol']['name']}, {report['videos']} videos{'' if report['comparable'] else ', not comparable'})")
    return 0
