"""A manifest as a readable tree (:func:`lineage_tree`, what ``distillery lineage PATH`` prints) and its
artifacts each once (:func:`artifacts_once`, what a model card lists).

Stdlib only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from distillery.common.errors import UserError
from distillery.common.treeutil import flatten
from distillery.lineage.contract import DIGEST_KEY, cut
from distillery.lineage.hashing import tree_digest
from distillery.lineage.manifest import manifest_shape_problem


def _fmt_value(v: Any, limit: int = 32) -> str:
    if isinstance(v, float):
        s = f"{v:.4g}"
    elif isinstance(v, str):
        s = v
    else:
        s = json.dumps(v, default=str, ensure_ascii=False)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _fmt_pairs(d: Any, limit: int) -> str | None:
    pairs = list(flatten(d).items())
    if not pairs:
        return None
    shown = ", ".join(f"{k}={_fmt_value(v)}" for k, v in pairs[:limit])
    return shown + (f", … (+{len(pairs) - limit} more: --json shows all)" if len(pairs) > limit else "")


def _fmt_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def _fmt_files(entries: Sequence[Mapping[str, Any]]) -> str:
    total = sum(int(e.get("bytes") or 0) for e in entries)
    return f"{len(entries)} file(s), {_fmt_bytes(total)}, sha256 {tree_digest(entries)[:12]}"


def _node_lines(m: Mapping[str, Any]) -> list[str]:
    """Detail lines of one artifact node (the header is printed by the caller)."""
    lines = []
    method = m.get("method")
    lines.append(f"method: {str(method).rsplit('.', 1)[-1] if method else '-'}   created: {m.get('created') or '-'}")
    params = _fmt_pairs(m.get("params"), 8)
    if params:
        lines.append(f"params: {params}")
    lines.append(f"outputs: {_fmt_files(m.get('outputs') or [])}")
    code = m.get("code") or {}
    commit = code.get("git_commit")
    dirty = code.get("dirty")
    state = "" if dirty is None else (" (dirty)" if dirty else " (clean)")
    version = f"   distillery {code['package_version']}" if code.get("package_version") else ""
    exp = code.get("experiment") if isinstance(code.get("experiment"), Mapping) else {}
    baseline = f" from {str(exp['baseline'])[:10]}" if exp.get("baseline") else ""
    named = f"   dvc experiment {cut(exp['name'], limit=60)}{baseline}" if exp.get("name") else ""
    lines.append(f"code: {commit[:10] if commit else 'no git commit'}{state}{version}{named}")
    ml = m.get("mlflow") or {}
    if ml.get("run_id"):
        exp = f" (experiment {ml['experiment']})" if ml.get("experiment") else ""
        lines.append(f"mlflow: run {ml['run_id']}{exp}")
    metrics = _fmt_pairs(m.get("metrics"), 5)
    if metrics:
        lines.append(f"metrics: {metrics}")
    return lines


SHOWN_ABOVE = "(shown above)"  # a repeated input's one line in lineage_tree


def _render(m: Mapping[str, Any], head: str, first: str, rest: str, out: list[str], seen: set[tuple]) -> None:
    out.append(f"{first}{head}{m.get('stage')} [{m.get('kind')}]  {m.get('artifact')}")
    inputs = [i for i in (m.get("inputs") or []) if isinstance(i, Mapping)]
    bar = "│  " if inputs else "   "
    out.extend(f"{rest}{bar}{line}".rstrip() for line in _node_lines(m))
    for k, inp in enumerate(inputs):
        last = k == len(inputs) - 1
        child_first = rest + ("└─ " if last else "├─ ")
        child_rest = rest + ("   " if last else "│  ")
        role = f"{inp.get('role')}: "
        sub = inp.get("lineage")
        digest = str(inp.get("sha256") or "?")
        key = ("artifact", str(sub.get(DIGEST_KEY) or digest)) if isinstance(sub, Mapping) else ("external", digest)
        if key in seen:  # the same artifact (same sealed manifest, or the same external files) once more
            what = f"{sub.get('stage')} [{sub.get('kind')}]  {sub.get('artifact')}" if isinstance(sub, Mapping) \
                else f"{inp.get('path')}  (external)"
            out.append(f"{child_first}{role}{what}  {SHOWN_ABOVE}  sha256 {digest[:12]}")
            continue
        seen.add(key)
        if isinstance(sub, Mapping):
            _render(sub, role, child_first, child_rest, out, seen)
        else:
            files = inp.get("files") or []
            out.append(f"{child_first}{role}{inp.get('path')}  (external, no lineage)  "
                       f"{len(files)} file(s), {_fmt_bytes(sum(int(e.get('bytes') or 0) for e in files))}, "
                       f"sha256 {digest[:12]}")


def artifacts_once(manifest: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The artifact and every embedded input artifact, each once (by sealed manifest digest, as
    :func:`lineage_tree` counts them), depth first in input order."""
    seen: set[Any] = set()
    out: list[Mapping[str, Any]] = []

    def walk(m: Mapping[str, Any]) -> None:
        key = str(m.get(DIGEST_KEY) or id(m))
        if key in seen:
            return
        seen.add(key)
        out.append(m)
        for inp in m.get("inputs") or []:
            if isinstance(inp, Mapping) and isinstance(inp.get("lineage"), Mapping):
                walk(inp["lineage"])

    walk(manifest)
    return out


def lineage_tree(manifest: Mapping[str, Any]) -> str:
    """A readable tree of an artifact and, recursively, every embedded input: one node per
    artifact (stage, kind, path, method, created, up to 8 params, output digest, code commit,
    MLflow run, a few metrics); inputs without lineage are leaves with their digest. Each artifact
    is shown in full once, depth first; where the same one is an input again (the base under
    latents, teacher and export; the teacher as a distilled student's teacher and critic) it is one
    line ending in ``(shown above)`` with its digest. A manifest not shaped as a stage writes it
    (:func:`manifest_shape_problem`) is a one-line :class:`UserError` naming the malformed field."""
    problem = manifest_shape_problem(manifest)
    if problem:
        raise UserError(f"malformed lineage manifest: {problem} (`distillery lineage PATH --json` prints it as it is)")
    out: list[str] = []
    _render(manifest, "", "", "", out, set())
    return "\n".join(out)



# ---------------------------------------------------------------------------------------------
# verifying
