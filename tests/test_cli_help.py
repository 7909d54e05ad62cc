"""Every option of every `distillery` subcommand has help text, and its help shows the default."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from distillery.cli.main import build_parser
from distillery.cli.train import build_parser as build_train_parser


def _parsers(parser: argparse.ArgumentParser, name: str = "distillery") -> list[tuple[str, argparse.ArgumentParser]]:
    """``parser`` and every subcommand parser below it, with their command lines."""
    found = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                found += _parsers(sub, f"{name} {sub_name}")
    return found


def _all_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(n, p) for n, p in _parsers(build_parser()) if n != "distillery train"]  # a stub: train parses its own
    return found + [("distillery train", build_train_parser())]


def test_every_option_of_every_subcommand_has_help_and_shows_its_default():
    parsers = _all_parsers()
    names = {n for n, _ in parsers}
    assert {"distillery base make-tiny", "distillery preprocess", "distillery clips make", "distillery clips analyze",
            "distillery lineage", "distillery stage", "distillery latents demo", "distillery export-weights",
            "distillery train"} <= names
    missing, no_default = [], []
    for name, parser in parsers:
        text = parser.format_help()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            flag = "/".join(action.option_strings) or action.dest
            if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
                missing.append(f"{name} {flag}")
            shown = action.default not in (None, [], False) and not action.required
            if shown and f"(default: {action.default})" not in " ".join(text.split()):
                no_default.append(f"{name} {flag}")
    assert not missing, f"options without help: {missing}"
    assert not no_default, f"options whose help does not show the default: {no_default}"


@pytest.mark.process
def test_train_help_explains_the_dotted_overrides():
    out = subprocess.run([sys.executable, "-m", "distillery.cli.main", "train", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--training.loop.max_train_steps 10" in out.stdout and "must exist in the config" in out.stdout
    assert "--config" in out.stdout and "--dry-run" in out.stdout
