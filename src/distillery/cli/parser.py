"""The CLI's argument parser: every option's help shows its default (tests/test_cli_help.py walks them all).

Its own module so that every command (``distillery train`` included) builds its parser without
importing the others (no ``main`` <-> ``train`` circle)."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that ends each option with ``(default: X)``; not for required options, flags (``store_true``:
    off unless given), a default of None or an empty list (repeatable, none given): there the help text
    says what leaving the option out does."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.required or action.default in (None, []) or isinstance(action, argparse._StoreTrueAction):
            return action.help or ""
        return super()._get_help_string(action) or ""


class Parser(argparse.ArgumentParser):
    """The CLI's parser: :class:`HelpFormatter` by default, for its subcommands too (``add_subparsers``
    makes them of this class)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 (argparse's own signature)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
