"""Read the pipeline DAG from ``dvc.yaml`` — the one DAG (docs/architecture.md §1).

No Prefect and no DVC import here: this module parses ``dvc.yaml`` as YAML and links stages the
way DVC does, by matching each stage's deps against the other stages' outputs. Its readers:
the Prefect flow (:mod:`flows.dag`) builds its tasks from what it returns, so there is no
second DAG; the stages read their ``params:`` lists (:func:`stage_params`, what a stage may read
and records in its lineage) and their code deps (the resume key) from it, so there is no second
list of either.

Supported ``dvc.yaml`` subset:
- ``stages.<name>`` with ``cmd`` (string or list), ``wdir``, ``deps``, ``params``, ``outs``,
  ``metrics``, ``plots``; outputs may be plain paths or ``{path: {cache: ..., persist: ...}}``;
  params may be keys of ``params.yaml`` or ``{file: [keys]}`` mappings.
- the trivial forms of templating: ``vars`` given inline as mappings (or as files), ``${...}``
  lookups into them and into ``params.yaml``, and ``foreach`` over a literal list or mapping
  (stages named ``name@item`` / ``name@key`` / ``name@index`` as DVC names them).
  ``matrix`` and anything else DVC can express but this parser cannot is a ``ValueError``.

Paths in :class:`StageSpec` are repo-relative POSIX paths (``wdir`` applied, normalised).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["StageSpec", "load_dvc_stages", "stage_order", "link_stages", "stage_params", "stage_spec"]

_INTERP = re.compile(r"\$\{\s*([^}]+?)\s*\}")


@dataclass
class StageSpec:
    """One ``dvc.yaml`` stage, as the flow needs it."""

    name: str  # DVC stage name (``name@item`` for foreach-generated stages)
    cmd: str  # the command DVC runs (a list ``cmd`` joined with " && "); informational
    deps: list[str] = field(default_factory=list)  # dependency paths, repo-relative
    outs: list[str] = field(default_factory=list)  # ``outs`` paths, repo-relative
    params: list[str] = field(default_factory=list)  # "key" (params.yaml) or "file:key"
    metrics: list[str] = field(default_factory=list)  # ``metrics`` paths (also outputs)
    plots: list[str] = field(default_factory=list)  # ``plots`` paths (also outputs)
    upstream: list[str] = field(default_factory=list)  # stages this one depends on, sorted
    persisted: list[str] = field(default_factory=list)  # outs/metrics/plots marked ``persist: true`` (kept by DVC before a run)

    @property
    def all_outs(self) -> list[str]:
        """Every path DVC treats as this stage's output: outs, metrics and plots."""
        return [*self.outs, *self.metrics, *self.plots]


# --------------------------------------------------------------------------------------------
# parsing


def _norm(path: str, wdir: str) -> str:
    p = posixpath.normpath(posixpath.join(wdir, str(path).replace("\\", "/")))
    return "" if p == "." else p


def _out_paths(entries: Any, wdir: str, where: str) -> list[str]:
    """``outs``/``metrics``/``plots``/``deps`` entries → paths (mapping entries keep their key)."""
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise ValueError(f"dvc.yaml: {where} must be a list, got {type(entries).__name__}")
    paths = []
    for e in entries:
        if isinstance(e, str):
            paths.append(_norm(e, wdir))
        elif isinstance(e, Mapping) and len(e) == 1:
            paths.append(_norm(next(iter(e)), wdir))
        else:
            raise ValueError(f"dvc.yaml: cannot read entry {e!r} in {where}")
    return paths


def _persisted(entries: Any, wdir: str) -> list[str]:
    """Paths of the ``outs``/``metrics``/``plots`` entries marked ``persist: true`` (entries already
    checked by :func:`_out_paths`): DVC leaves those in place before it runs the stage, so a failed
    run does not delete the last good one."""
    paths = []
    for e in entries or []:
        if isinstance(e, Mapping) and len(e) == 1:
            path, flags = next(iter(e.items()))
            if isinstance(flags, Mapping) and flags.get("persist") is True:
                paths.append(_norm(path, wdir))
    return paths


def _params(entries: Any, where: str) -> list[str]:
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise ValueError(f"dvc.yaml: {where} must be a list")
    out: list[str] = []
    for e in entries:
        if isinstance(e, str):
            out.append(e)
        elif isinstance(e, Mapping):
            for file, keys in e.items():
                if not keys:  # `- other.yaml:` tracks the whole file
                    out.append(f"{file}:")
                else:
                    out.extend(f"{file}:{k}" for k in keys)
        else:
            raise ValueError(f"dvc.yaml: cannot read params entry {e!r} in {where}")
    return out


def _lookup(ctx: Mapping[str, Any], dotted: str) -> Any:
    cur: Any = ctx
    for part in dotted.split("."):
        if isinstance(cur, Mapping) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            raise KeyError(dotted)
    return cur


def _interpolate(value: Any, ctx: Mapping[str, Any], where: str) -> Any:
    """Resolve ``${a.b}`` in strings (recursively in lists/mappings) from ``ctx``."""
    if isinstance(value, str):
        whole = _INTERP.fullmatch(value)
        try:
            if whole:  # a lone ${x} keeps the looked-up value's type
                return _lookup(ctx, whole.group(1))
            return _INTERP.sub(lambda m: str(_lookup(ctx, m.group(1))), value)
        except KeyError as e:
            raise ValueError(
                f"dvc.yaml: cannot resolve ${{{e.args[0]}}} in {where} (only inline/file `vars`, "
                "params.yaml keys and foreach item/key are supported)"
            ) from None
    if isinstance(value, list):
        return [_interpolate(v, ctx, where) for v in value]
    if isinstance(value, Mapping):
        return {
            _interpolate(k, ctx, where): _interpolate(v, ctx, where) for k, v in value.items()
        }
    return value


def _load_yaml(path: Path) -> Any:
    """A YAML file read within the project's input bounds (size, depth, UTF-8): one-line errors."""
    from distillery.config.limits import read_yaml_file

    return read_yaml_file(path, str(path), "not found")


def _vars_context(repo: Path, doc: Mapping[str, Any]) -> dict[str, Any]:
    ctx: dict[str, Any] = {}
    default_params = repo / "params.yaml"
    if default_params.exists():  # DVC makes params.yaml available for interpolation
        ctx.update(_load_yaml(default_params) or {})
    for entry in doc.get("vars") or []:
        if isinstance(entry, Mapping):
            ctx.update(entry)
        elif isinstance(entry, str):
            file, _, keys = entry.partition(":")
            data = _load_yaml(repo / file) or {}
            if keys:
                data = {k: data[k] for k in keys.split(",")}
            ctx.update(data)
        else:
            raise ValueError(f"dvc.yaml: cannot read vars entry {entry!r}")
    return ctx


def _expand(name: str, body: Mapping[str, Any], ctx: Mapping[str, Any]) -> list[tuple[str, dict]]:
    """Expand one ``stages`` entry into ``(name, body)`` pairs (``foreach`` → several)."""
    if "matrix" in body:
        raise ValueError(f"dvc.yaml: stage {name!r} uses `matrix`, which distillery.pipeline.dvcfile does not read")
    if "foreach" not in body:
        return [(name, _interpolate(dict(body), ctx, f"stage {name!r}"))]
    items = _interpolate(body["foreach"], ctx, f"stage {name!r} foreach")
    do = body.get("do")
    if not isinstance(do, Mapping):
        raise ValueError(f"dvc.yaml: foreach stage {name!r} needs a `do` mapping")
    if isinstance(items, Mapping):
        pairs = [(str(k), {**ctx, "item": v, "key": k}) for k, v in items.items()]
    elif isinstance(items, list):
        pairs = [
            (str(v) if isinstance(v, (str, int, float)) else str(i), {**ctx, "item": v, "key": i})
            for i, v in enumerate(items)
        ]
    else:
        raise ValueError(f"dvc.yaml: foreach of stage {name!r} must be a list or mapping")
    return [(f"{name}@{suffix}", _interpolate(dict(do), c, f"stage {name}@{suffix}"))
            for suffix, c in pairs]


def load_dvc_stages(repo: Path) -> dict[str, StageSpec]:
    """Parse ``<repo>/dvc.yaml`` into ``{stage name: StageSpec}`` with ``upstream`` filled in.

    Raises FileNotFoundError when there is no dvc.yaml and ValueError for content it cannot read
    (naming the stage and entry) or for two stages declaring the same output.
    """
    repo = Path(repo)
    path = repo / "dvc.yaml"
    if not path.exists():
        raise FileNotFoundError(f"no dvc.yaml in {repo}: run `dvc stage add` or write one")
    doc = _load_yaml(path) or {}
    if not isinstance(doc, Mapping):
        raise ValueError(f"{path}: top level must be a mapping")
    raw_stages = doc.get("stages") or {}
    if not isinstance(raw_stages, Mapping):
        raise ValueError(f"{path}: `stages` must be a mapping")
    ctx = _vars_context(repo, doc) if ("vars" in doc or "${" in path.read_text()) else {}

    stages: dict[str, StageSpec] = {}
    for raw_name, raw_body in raw_stages.items():
        if not isinstance(raw_body, Mapping):
            raise ValueError(f"{path}: stage {raw_name!r} must be a mapping")
        for name, body in _expand(str(raw_name), raw_body, ctx):
            if "cmd" not in body:
                raise ValueError(f"{path}: stage {name!r} has no `cmd`")
            cmd = body["cmd"]
            cmd = " && ".join(map(str, cmd)) if isinstance(cmd, list) else str(cmd)
            wdir = str(body.get("wdir", "."))
            where = f"{path}: stage {name!r}"
            stages[name] = StageSpec(
                name=name,
                cmd=cmd,
                deps=_out_paths(body.get("deps"), wdir, f"{where} deps"),
                outs=_out_paths(body.get("outs"), wdir, f"{where} outs"),
                params=_params(body.get("params"), f"{where} params"),
                metrics=_out_paths(body.get("metrics"), wdir, f"{where} metrics"),
                plots=_out_paths(body.get("plots"), wdir, f"{where} plots"),
                persisted=[p for key in ("outs", "metrics", "plots") for p in _persisted(body.get(key), wdir)],
            )
    link_stages(stages)
    return stages


def stage_spec(stage: str, repo: Path = Path(".")) -> StageSpec:
    """The ``dvc.yaml`` entry of one stage; a missing or unreadable file or stage is a one-line UserError."""
    from distillery.common.errors import UserError

    try:
        stages = load_dvc_stages(repo)
    except FileNotFoundError:
        raise UserError(f"{Path(repo) / 'dvc.yaml'}: not found; run stages from the pipeline folder "
                        "(where params.yaml and dvc.yaml are)") from None
    except ValueError as exc:
        raise UserError(" ".join(str(exc).split())) from None
    if stage not in stages:
        raise UserError(f"{Path(repo) / 'dvc.yaml'}: no stage {stage!r} (stages: {', '.join(stages)})")
    return stages[stage]


def stage_params(stage: str, repo: Path = Path(".")) -> list[str]:
    """The ``params.yaml`` keys ``stage`` lists under ``params:`` in ``dvc.yaml``, in file order.

    This is the one list of what a stage reads: DVC reruns the stage when one of them changes, the
    stage may read only these (:class:`distillery.pipeline.params.reader.StageParams`) and records them
    in its lineage. ``params.yaml:key`` entries count as ``key``; keys of other files are refused.
    """
    from distillery.common.errors import UserError

    keys: list[str] = []
    for entry in stage_spec(stage, repo).params:
        file, sep, key = entry.rpartition(":")
        if sep and file != "params.yaml":
            raise UserError(f"dvc.yaml: stage {stage}: params entry {entry!r}: stages read params.yaml only")
        keys.append(key if sep else entry)
    return keys


# --------------------------------------------------------------------------------------------
# linking and ordering


def _overlaps(dep: str, out: str) -> bool:
    """A dep depends on an out when it is the out, lies inside it, or contains it (as DVC)."""
    if dep == out or dep == "" or out == "":
        return True
    return dep.startswith(out + "/") or out.startswith(dep + "/")


def link_stages(stages: Mapping[str, StageSpec]) -> None:
    """Fill each stage's ``upstream`` from deps ↔ outs (in place); duplicate outs are an error."""
    owner: dict[str, str] = {}
    for s in stages.values():
        for out in s.all_outs:
            if out in owner and owner[out] != s.name:
                raise ValueError(
                    f"dvc.yaml: output {out!r} is declared by both {owner[out]!r} and {s.name!r}"
                )
            owner[out] = s.name
    for s in stages.values():
        ups = set(s.upstream) & set(stages)
        for dep in s.deps:
            for out, producer in owner.items():
                if producer != s.name and _overlaps(dep, out):
                    ups.add(producer)
        s.upstream = sorted(ups)


def _find_cycle(nodes: Iterable[str], edges: Mapping[str, list[str]]) -> list[str]:
    """A cycle among ``nodes`` (edges: node → its upstream), as [a, b, ..., a]."""
    nodes = sorted(nodes)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, [])):
            if m not in nodes:
                continue
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in nodes:
        if n not in state and (found := visit(n)):
            return found
    return nodes  # unreachable when nodes really hold a cycle


def stage_order(stages: Mapping[str, StageSpec]) -> list[list[str]]:
    """Dependency levels: level 0 has no upstream, level k depends only on levels < k.

    Each stage sits at its longest-path depth; names are alphabetical within a level, so the
    order is deterministic. Upstream comes from ``StageSpec.upstream`` plus deps ↔ outs matching
    (so hand-built specs work too). A cycle raises ValueError naming it (``a -> b -> a``).
    """
    edges: dict[str, set[str]] = {n: set(s.upstream) & set(stages) for n, s in stages.items()}
    owner = {out: s.name for s in stages.values() for out in s.all_outs}
    for s in stages.values():
        for dep in s.deps:
            for out, producer in owner.items():
                if producer != s.name and _overlaps(dep, out):
                    edges[s.name].add(producer)

    levels: list[list[str]] = []
    placed: set[str] = set()
    remaining = set(stages)
    while remaining:
        ready = sorted(n for n in remaining if edges[n] <= placed)
        if not ready:
            cycle = _find_cycle(remaining, {n: sorted(e) for n, e in edges.items()})
            raise ValueError("dvc.yaml: stage dependency cycle: " + " -> ".join(cycle))
        levels.append(ready)
        placed.update(ready)
        remaining.difference_update(ready)
    return levels
