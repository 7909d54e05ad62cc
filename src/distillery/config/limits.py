"""Bounds on the YAML a user hands us, and the one way user values are echoed in error messages.

Run configs (``distillery train --config``), their dotted overrides and ``params.yaml`` are all read
through :func:`read_yaml_file` / :func:`parse_yaml_text`. Before PyYAML builds any object, the text
is checked against the bounds below by walking the parser's *event* stream (the parser is a state
machine, so a 10,000-deep nesting cannot blow the Python stack while it is checked); only text
within every bound is then loaded. Every violation is a one-line :class:`UserError` naming the file,
the dotted key and the line. The bounds:

- the file: at most :data:`MAX_FILE_BYTES`, checked on its size before it is read; strict UTF-8
  (the error names the byte offset of the first bad byte);
- nesting: at most :data:`MAX_DEPTH` levels of mappings/lists;
- size: at most :data:`MAX_NODES` values, an alias counting as the full size of what it names (so
  an alias bomb is refused); recursive aliases are refused;
- scalars: strings at most :data:`MAX_STRING_CHARS` characters, mapping keys at most
  :data:`MAX_KEY_CHARS`, integers at most :data:`MAX_INT_DIGITS` digits (Python itself refuses to
  read more than 4300);
- no duplicate keys in one mapping (YAML forbids them; PyYAML would silently keep the last): keys are
  compared as the values they load as (``1``, ``0x1`` and ``1.0`` are one key), a mapping has at most
  one merge key ``<<``, and no key is an alias (``*k : 5`` under ``&k steps: 120`` is ``steps`` twice;
  DVC refuses all of these, PyYAML would keep the last).

A caller may look at every scalar as it is checked (``on_scalar``): :mod:`distillery.pipeline.params.file`
uses it to refuse the scalars DVC's YAML 1.2 reads differently.

:func:`show` is the one helper every config and params error uses to echo a user value: a short
``repr`` on one line, cut to about :data:`ECHO_CHARS` characters with the full length stated.
"""

from __future__ import annotations

import difflib
import os
import re
import reprlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from distillery.common.errors import UserError
from distillery.common.fsutil import file_kind

MAX_FILE_BYTES = 1 << 20  # a run config or params.yaml (real ones are a few KB)
MAX_DEPTH = 32  # nested mappings/lists (real configs: 4)
MAX_NODES = 20_000  # values in one document, aliases expanded (real configs: ~100)
MAX_STRING_CHARS = 4096  # one string value (a path is at most 4095 bytes on Linux)
MAX_KEY_CHARS = 256  # one mapping key
MAX_INT_DIGITS = 64  # one integer (2**64 has 20 digits)
MAX_OVERRIDE_CHARS = 16_384  # the value text of one dotted command-line override
NAME_MAX_BYTES = 255  # one path component (Linux NAME_MAX)
PATH_MAX_BYTES = 4095  # a whole path (Linux PATH_MAX minus the NUL)
ECHO_CHARS = 60  # a user value echoed in an error is cut to about this many characters
MAX_MESSAGE_CHARS = 600  # no config error line is longer than this

_INT_TAG = "tag:yaml.org,2002:int"
_STR_TAG = "tag:yaml.org,2002:str"
_MERGE_TAG = "tag:yaml.org,2002:merge"


class SafeLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]  # libyaml when built in: 20x faster
    """PyYAML's safe loader (YAML 1.1), reading a float written with an exponent and no dot (``1e-4``,
    ``2e-06``) as the float YAML 1.2 — and DVC — read, not as text: DVC writes a small float back that
    way (``dvc exp run -S teacher.learning_rate=2.0e-6`` leaves ``2e-06`` in params.yaml)."""


SafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+$"), list("-+.0123456789"))
_LOADER: type = SafeLoader
_RESOLVER = yaml.resolver.Resolver()
_TOO_DEEP = f"nested deeper than {MAX_DEPTH} levels"


# -- echoing user values ----------------------------------------------------------------------
class _ShortRepr(reprlib.Repr):
    """``repr`` with bounded work: long containers, strings and numbers are elided."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxdict = self.maxlist = self.maxtuple = self.maxset = 6
        self.maxstring = ECHO_CHARS
        self.maxlong = 40
        self.maxother = ECHO_CHARS

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 200:  # repr of a huge int is slow, and refused past 4300 digits
            return f"<an integer of about {int(x.bit_length() * 0.30103) + 1} digits>"
        return super().repr_int(x, level)


_SHORT = _ShortRepr()


def one_line(text: str) -> str:
    """``text`` with every line break and control character written as an escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == " " else c.encode("unicode_escape").decode("ascii") for c in text)


def cut(text: Any, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` (any value: its ``str``) on one line, at most about ``limit`` characters (the cut marked
    with …)."""
    text = one_line(str(text))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def show(value: Any) -> str:
    """A user value as echoed in an error: its ``repr`` on one line, cut to a readable length.

    A long string keeps its first characters and states its length (``'aaaa…' (300 characters)``);
    containers show their first few items (``[1, 2, 3, 4, 5, 6, ...]``).
    """
    if value is None or isinstance(value, bool):  # as YAML spells them
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, str) and len(value) > ECHO_CHARS:
        return f"{one_line(repr(value[: ECHO_CHARS - 15]))[: ECHO_CHARS]}… ({len(value)} characters)"
    try:
        text = _SHORT.repr(value)
    except Exception:  # a value whose repr fails must not turn a user error into a traceback
        text = f"<{type(value).__name__}>"
    return cut(text, ECHO_CHARS + 20)


def show_key(key: Any) -> str:
    """A mapping key as written in a dotted path: plain when it is a short printable string."""
    if isinstance(key, str) and key and len(key) <= ECHO_CHARS and key.isprintable() and key.strip() == key:
        return key
    return show(key)


def key_list(keys: Iterable[Any], limit: int = 24, max_chars: int = 100) -> str:
    """``a, b, c`` for valid-key lists in messages (at most ``limit`` names and about ``max_chars`` characters,
    so the one-line error stays one readable line as sections grow)."""
    names = [show_key(k) for k in keys]
    shown: list[str] = []
    for name in names[:limit]:
        if shown and sum(len(n) + 2 for n in shown) + len(name) > max_chars:
            break
        shown.append(name)
    more = f", … ({len(names)} in all)" if len(shown) < len(names) else ""
    return (", ".join(shown) or "(none)") + more


def did_you_mean(key: Any, valid: Iterable[str]) -> str:
    """``"; did you mean steps?"`` when ``key`` is close to one of ``valid``, else ``""``."""
    if not isinstance(key, str):
        return ""
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def unknown_key_message(key: Any, valid: Iterable[str]) -> str:
    """The text after the key in an unknown-key error: valid keys, then the nearest one."""
    valid = list(valid)
    return f"unknown key; valid keys: {key_list(valid)}{did_you_mean(key, valid)}"


def path_problem(value: str) -> str | None:
    """Why the string ``value`` can never be used as a file-system path, or None when it can.

    Checked on the text alone (nothing is touched on disk): a NUL character, text the file system
    encoding cannot hold, a component longer than 255 bytes or a path longer than 4095 bytes.
    """
    if "\x00" in value:
        return "contains a NUL character, which no path can hold"
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError:
        return "contains characters no file name can hold (unpaired surrogates)"
    if len(raw) > PATH_MAX_BYTES:
        return f"a path of {len(raw)} bytes; the file system allows at most {PATH_MAX_BYTES}"
    longest = max((len(part) for part in raw.split(b"/")), default=0)
    if longest > NAME_MAX_BYTES:
        return f"a path component of {longest} bytes; the file system allows at most {NAME_MAX_BYTES} per name"
    return None


def show_path(path: str | Path) -> str:
    """A file path as named in messages (cut when absurdly long)."""
    text = str(path)
    return text if len(text) <= 200 and text.isprintable() else show(text)


# -- reading ----------------------------------------------------------------------------------
def decode_utf8(data: bytes, source: str) -> str:
    """``data`` decoded as strict UTF-8; a bad byte is a UserError naming its offset and line."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise UserError(f"{source}: not UTF-8 text: invalid byte 0x{data[exc.start]:02x} at byte offset {exc.start} "
                        f"(line {line}); save the file as UTF-8") from None


OnScalar = Callable[[str, yaml.ScalarEvent, bool], None]
"""``on_scalar(path, event, is_key)``: called for every scalar of a checked document (``path`` is its
dotted path; for a key, the path of the value it names); it raises a UserError to refuse the file."""


def read_yaml_file(path: str | Path, source: str, missing: str, on_scalar: OnScalar | None = None) -> Any:
    """Read and parse the YAML file ``path`` within the bounds; messages start with ``source``.

    ``missing`` is the text after ``source`` when ``path`` is not a readable regular file. Returns
    the parsed document (None for an empty one).
    """
    return parse_yaml_text(read_text_file(path, source, missing), source, on_scalar=on_scalar)


def read_text_file(path: str | Path, source: str, missing: str) -> str:
    """The text of ``path``: a regular file of at most :data:`MAX_FILE_BYTES`, strict UTF-8 (as
    :func:`read_yaml_file` reads it, before parsing)."""
    p = Path(path)
    try:
        if not p.is_file():
            if os.path.lexists(p):  # there, but not a file: say what it is (a FIFO, a link to /dev/zero, a folder)
                what = file_kind(os.stat(p).st_mode) if os.path.exists(p) else "a dangling symbolic link"
                via = " through a symbolic link" if p.is_symlink() and os.path.exists(p) else ""
                raise UserError(f"{source}: is {what}{via}, not a regular file; a config file is a YAML file")
            raise UserError(f"{source}: {missing}")
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:
            raise UserError(f"{source}: {size} bytes; a config file is at most {MAX_FILE_BYTES} bytes (1 MiB)")
        with p.open("rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise UserError(f"{source}: cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:  # it grew after the size check
        raise UserError(f"{source}: more than {MAX_FILE_BYTES} bytes; a config file is at most 1 MiB")
    return decode_utf8(data, source)


def parse_yaml_text(text: str, source: str, *, syntax_error_as_text: bool = False, on_scalar: OnScalar | None = None) -> Any:
    """Parse YAML ``text`` within the bounds (see the module doc); errors start with ``source``.

    With ``syntax_error_as_text`` (command-line override values), text that is not valid YAML is
    returned as the plain string it is; a bound it breaks is still an error. ``on_scalar``: see
    :data:`OnScalar`.
    """
    try:
        check_yaml_events(text, source, on_scalar)
        return yaml.load(text, Loader=_LOADER)  # noqa: S506 - a safe loader (CSafeLoader or SafeLoader)
    except yaml.YAMLError as exc:
        problem = _yaml_error_text(exc, text)
        if syntax_error_as_text and not problem.endswith(_TOO_DEEP):
            if len(text) > MAX_STRING_CHARS:
                raise UserError(f"{source}: a value of {len(text)} characters; at most {MAX_STRING_CHARS}") from None
            return text
        raise UserError(f"{source}: invalid YAML{problem}") from None
    except (ValueError, TypeError, OverflowError, UnicodeError, RecursionError) as exc:  # e.g. a date 2024-13-45
        raise UserError(f"{source}: invalid value: {cut(str(exc), 200)}") from None


def _yaml_error_text(exc: yaml.YAMLError, text: str) -> str:
    if isinstance(exc, yaml.reader.ReaderError):
        line = text.count("\n", 0, exc.position) + 1 if isinstance(exc.position, int) else "?"
        return f" (line {line}): unacceptable character #x{exc.character:04x}: control characters are not allowed"
    mark = getattr(exc, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
    problem = getattr(exc, "problem", None) or (str(exc).splitlines() or ["?"])[0]
    if "maximum nesting depth" in problem:  # libyaml's own cap (1000) can fire before ours while it scans ahead
        problem = _TOO_DEEP
    return f"{where}: {cut(problem, 200)}"


@dataclass
class _Open:
    """A mapping or list whose end event has not come yet."""

    path: str  # its dotted path ("" for the document)
    is_map: bool
    anchor: str | None
    size: int = 1  # values inside it, aliases expanded
    index: int = 0  # list: the next item's index
    key: str | None = None  # mapping: the key whose value comes next (None: a key comes next)
    keys: dict[Any, int] = field(default_factory=dict)  # each key as it loads (see _key_identity) -> its line


def _join(path: str, part: str) -> str:
    return f"{path}.{part}" if path else part


def check_yaml_events(text: str, source: str, on_scalar: OnScalar | None = None) -> None:
    """Walk the parser's events of ``text`` and raise a UserError at the first bound it breaks.

    Syntax errors surface as :class:`yaml.YAMLError` (the caller words them).
    """
    stack: list[_Open] = []
    anchors: dict[str, int] = {}
    anchored_keys: dict[str, tuple[str, int]] = {}  # anchor of a scalar -> (its text, its line)
    total = 0

    one_liner = "\n" not in text.rstrip("\n")  # a command-line override value: no line numbers

    def fail(path: str, event: Any, problem: str) -> UserError:
        line = event.start_mark.line + 1 if getattr(event, "start_mark", None) is not None else "?"
        if one_liner:
            return UserError(f"{source}: {cut(path, 120) + ': ' if path else ''}{problem}")
        return UserError(f"{source}: {cut(path, 120) or 'the top level'} (line {line}): {problem}")

    def place(event: Any) -> str:
        """The dotted path of the node ``event`` starts, advancing its parent's state."""
        if not stack:
            return ""
        parent = stack[-1]
        if not parent.is_map:
            parent.index += 1
            return f"{parent.path}[{parent.index - 1}]"
        if parent.key is None:  # this node is a key
            if isinstance(event, yaml.AliasEvent):
                named = anchored_keys.get(event.anchor)
                what = f": {show_key(named[0])} of line {named[1]}" if named else ""
                raise fail(parent.path, event, f"a key may not be an alias (*{show_key(event.anchor)}{what}); "
                                               "write each key itself, once")
            if isinstance(event, yaml.ScalarEvent):
                text = event.value
                if len(text) > MAX_KEY_CHARS:
                    raise fail(parent.path, event, f"a key of {len(text)} characters; at most {MAX_KEY_CHARS}")
                name = show_key(text)
                identity = _key_identity(event)
                seen = parent.keys.get(identity)
                if seen is not None:
                    raise fail(_join(parent.path, name), event, f"duplicate key (first at line {seen}); "
                                                                "write each key once")
                parent.keys[identity] = event.start_mark.line + 1
                parent.key = name
            else:
                parent.key = "?"
            return _join(parent.path, parent.key)
        path = _join(parent.path, parent.key)
        parent.key = None
        return path

    def grow(n: int, path: str, event: Any) -> None:
        nonlocal total
        total += n
        if stack:
            stack[-1].size += n
        if total > MAX_NODES:
            raise fail(path, event, f"more than {MAX_NODES} values in one file (aliases count in full); "
                                    "this is not a config")

    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            path = place(event)
            if len(stack) >= MAX_DEPTH:
                raise fail(path, event, _TOO_DEEP)
            grow(1, path, event)
            stack.append(_Open(path, isinstance(event, yaml.MappingStartEvent), event.anchor))
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            done = stack.pop()
            if done.anchor is not None:
                anchors[done.anchor] = done.size
            if stack:
                stack[-1].size += done.size - 1  # its own 1 was counted when it opened
        elif isinstance(event, yaml.ScalarEvent):
            is_key = bool(stack) and stack[-1].is_map and stack[-1].key is None
            path = place(event)
            value = event.value
            if len(value) > MAX_INT_DIGITS and _scalar_tag(event) == _INT_TAG:
                digits = len(value.lstrip("+-").replace("_", ""))
                raise fail(path, event, f"an integer of {digits} digits; at most {MAX_INT_DIGITS}")
            if len(value) > MAX_STRING_CHARS:
                raise fail(path, event, f"a string of {len(value)} characters; at most {MAX_STRING_CHARS}")
            grow(1, path, event)
            if event.anchor is not None:
                anchors[event.anchor] = 1
                anchored_keys[event.anchor] = (value, event.start_mark.line + 1)
            if on_scalar is not None:
                on_scalar(path, event, is_key)
        elif isinstance(event, yaml.AliasEvent):
            path = place(event)
            if any(o.anchor == event.anchor for o in stack):
                raise fail(path, event, f"alias *{show_key(event.anchor)} refers to a value that contains it "
                                        "(recursive aliases are not allowed)")
            if event.anchor not in anchors:
                raise fail(path, event, f"alias *{show_key(event.anchor)} names no anchor defined before it")
            grow(anchors[event.anchor], path, event)


def _key_identity(event: yaml.ScalarEvent) -> Any:
    """A mapping key as the loaded mapping would hold it: two keys with one identity are one key.

    A string key is its text; any other key is the value it loads as (``1``, ``0x1``, ``1.0`` and
    ``true`` are all the key 1 of a Python dict); a key that cannot load stays its text (the load
    reports it). Every merge key ``<<`` is the same key.
    """
    tag = _scalar_tag(event)
    if tag in (_STR_TAG, _MERGE_TAG):
        return (tag, event.value)
    try:
        construct = yaml.constructor.SafeConstructor.yaml_constructors[tag]
        return ("value", construct(_CONSTRUCTOR, yaml.ScalarNode(tag, event.value)))
    except (KeyError, yaml.YAMLError, ValueError, TypeError, OverflowError):
        return (tag, event.value)


_CONSTRUCTOR = yaml.constructor.SafeConstructor()  # its scalar constructors keep no state


def _scalar_tag(event: yaml.ScalarEvent) -> str:
    """The tag the scalar will be loaded as (``tag:yaml.org,2002:int`` for ``42``, ``...:str`` for ``'42'``)."""
    if event.tag not in (None, "!"):
        return event.tag
    return _RESOLVER.resolve(yaml.ScalarNode, event.value, tuple(event.implicit))
