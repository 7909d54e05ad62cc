"""Lineage manifests over a chain of three small real artifact folders:
external base ─► latents ─► pretrain ─► export."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from distillery.errors import UserError
from distillery.lineage import (
    MANIFEST_KEYS,
    Input,
    code_info,
    hash_file,
    hash_tree,
    lineage_tree,
    read_lineage,
    tree_digest,
    verify_lineage,
    write_lineage,
)

WEIGHTS = "model/transformer/diffusion_pytorch_model.safetensors"


def _write(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())


@pytest.fixture()
def chain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Three artifacts under tmp_path/artifacts (written with relative paths, cwd = tmp_path)."""
    monkeypatch.chdir(tmp_path)
    base = Path("base/tiny-wan")  # external: no lineage.json
    _write(base / "model_index.json", '{"_class_name": "WanPipeline"}')
    _write(base / "transformer/config.json", '{"num_layers": 2}')
    _write(base / "transformer/diffusion_pytorch_model.safetensors", bytes(range(256)) * 8)

    latents = Path("artifacts/latents")
    _write(latents / "data/train/shard-00000.parquet", b"PAR1" + bytes(100) + b"PAR1")
    _write(latents / "data/validation/shard-00000.parquet", b"PAR1" + bytes(50) + b"PAR1")
    _write(latents / "metrics.json", '{"num_samples": 16}')
    write_lineage(latents, kind="data", stage="latents", method=None,
                  params={"preprocess": {"frames": 17, "height": 32, "width": 32}},
                  inputs=[Input("base", base)], metrics={"num_samples": 16, "bad_fraction": 0.0})

    pretrain = Path("artifacts/pretrain")
    _write(pretrain / WEIGHTS, bytes(range(200, 256)) * 64)
    _write(pretrain / "model/transformer/config.json", '{"num_layers": 2}')
    _write(pretrain / "model/sampling.json", '{"shift": 3.0}')
    _write(pretrain / "metrics.json", '{"loss": 0.25}')
    write_lineage(pretrain, kind="checkpoint", stage="pretrain", method="distillery.methods.dfsft.DFSFTMethod",
                  config={"training": {"loop": {"max_train_steps": 10}}},
                  params={"pretrain": {"steps": 10, "lr": 1e-4, "batch_size": 4}, "gpus": 0},
                  inputs=[Input("data", latents), Input("student_init", base)],
                  mlflow={"tracking_uri": "file:./mlruns", "experiment": "distillery", "run_id": "abc123run"},
                  metrics={"loss": 0.25, "grad_norm": 1.5})

    export = Path("artifacts/export")
    _write(export / "model/model_index.json", '{"_class_name": "WanPipeline"}')
    _write(export / WEIGHTS, bytes(range(200, 256)) * 64)
    write_lineage(export, kind="export", stage="export", params={"export": {"role": "student"}},
                  inputs=[Input("student", pretrain)])
    return {"base": base, "latents": latents, "pretrain": pretrain, "export": export}


def _lineage_wired() -> bool:
    from distillery.cli import build_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            build_parser().parse_args(["lineage", "x"])
    except SystemExit:
        return False
    return True


def _cli(*args: str) -> tuple[int, str, str]:
    """Run ``distillery lineage ARGS``: as a subprocess through distillery.cli when the lead has
    wired the command in, else in-process through add_lineage_command + the CLI's error guard."""
    if _lineage_wired():
        res = subprocess.run([sys.executable, "-m", "distillery.cli", "lineage", *args],
                             capture_output=True, text=True, timeout=120)
        return res.returncode, res.stdout, res.stderr
    from distillery.cli import run_guarded
    from distillery.lineage_cli import add_lineage_command

    parser = argparse.ArgumentParser(prog="distillery")
    add_lineage_command(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(["lineage", *args])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = run_guarded(lambda: ns.func(ns))
    return rc, out.getvalue(), err.getvalue()


def test_hash_tree_files_and_exclusions(tmp_path: Path) -> None:
    _write(tmp_path / "lineage.json", "{}")  # top level: excluded
    _write(tmp_path / "sub/lineage.json", "{}")  # nested: a payload file like any other
    _write(tmp_path / "b.bin", b"xyz")
    _write(tmp_path / ".lineage.json.tmp-123", "partial")  # hidden temp file: skipped
    entries = hash_tree(tmp_path)
    assert [e["path"] for e in entries] == ["b.bin", "sub/lineage.json"]
    assert entries[0] == {"path": "b.bin", "sha256": hash_file(tmp_path / "b.bin"), "bytes": 3}
    assert tree_digest(entries) == tree_digest(list(reversed(entries)))
    with pytest.raises(UserError):
        hash_tree(tmp_path / "nope")


def test_export_embeds_the_whole_chain(chain: dict[str, Path]) -> None:
    m = read_lineage(chain["export"])
    assert tuple(m) == MANIFEST_KEYS
    assert m["artifact"] == "artifacts/export" and m["kind"] == "export"
    datetime.strptime(m["created"], "%Y-%m-%dT%H:%M:%SZ")
    assert [o["path"] for o in m["outputs"]] == ["model/model_index.json", WEIGHTS]
    (student,) = m["inputs"]
    assert student["role"] == "student" and student["path"] == "artifacts/pretrain"
    assert student["sha256"] == tree_digest(hash_tree(chain["pretrain"]))
    pre = student["lineage"]
    assert pre == read_lineage(chain["pretrain"])
    assert pre["stage"] == "pretrain" and pre["mlflow"]["run_id"] == "abc123run"
    data, init = pre["inputs"]
    assert data["lineage"]["stage"] == "latents"
    assert init["lineage"] is None and {f["path"] for f in init["files"]} == {
        "model_index.json", "transformer/config.json", "transformer/diffusion_pytorch_model.safetensors"}
    base = data["lineage"]["inputs"][0]
    assert base["role"] == "base" and base["lineage"] is None and base["sha256"] == init["sha256"]
    assert set(code_info()) == {"git_commit", "dirty", "package_version"}


def test_code_info_in_a_git_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    repo = Path(__file__).resolve().parents[1]
    if not (repo / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    monkeypatch.chdir(repo)
    info = code_info()
    assert len(info["git_commit"]) == 40 and isinstance(info["dirty"], bool)


def test_tree_shows_every_stage(chain: dict[str, Path]) -> None:
    text = lineage_tree(read_lineage(chain["export"]))
    lines = text.splitlines()
    assert lines[0].startswith("export [export]  artifacts/export")
    assert any(ln.startswith("└─ student: pretrain [checkpoint]  artifacts/pretrain") for ln in lines)
    assert any("├─ data: latents [data]  artifacts/latents" in ln for ln in lines)
    assert any("└─ student_init: base/tiny-wan  (external, no lineage)" in ln for ln in lines)
    assert any("└─ base: base/tiny-wan  (external, no lineage)" in ln for ln in lines)
    assert "method: DFSFTMethod" in text and "pretrain.lr=0.0001" in text and "mlflow: run abc123run" in text
    assert "metrics: loss=0.25, grad_norm=1.5" in text and "code: " in text
    digest = tree_digest(read_lineage(chain["pretrain"])["outputs"])[:12]
    assert f"sha256 {digest}" in text


def test_cli_tree_and_json_round_trip(chain: dict[str, Path]) -> None:
    rc, out, _ = _cli(str(chain["export"]), "--json")
    assert rc == 0 and json.loads(out) == read_lineage(chain["export"])
    rc, out, _ = _cli(str(chain["export"] / "lineage.json"))
    assert rc == 0 and out.rstrip("\n") == lineage_tree(read_lineage(chain["export"]))


def test_verify_copy_then_tamper(chain: dict[str, Path], tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere" / "export"
    shutil.copytree(chain["export"], copy)
    shutil.rmtree(tmp_path / "artifacts")  # the originals are gone: verify must not need them
    shutil.rmtree(tmp_path / "base")
    res = verify_lineage(copy)
    assert res.ok and res.problems == [] and res.files == 2
    rc, out, _ = _cli(str(copy), "--verify")
    assert rc == 0 and out.strip() == "verified: 2 files"

    weights = copy / WEIGHTS
    raw = bytearray(weights.read_bytes())
    raw[100] ^= 0xFF
    weights.write_bytes(bytes(raw))
    (copy / "model" / "notes.txt").write_text("new")
    res = verify_lineage(copy)
    assert not res.ok and len(res.problems) == 2
    assert res.problems[0].startswith(f"changed: {WEIGHTS} (sha256 ")
    assert res.problems[1].startswith("unexpected: model/notes.txt")
    rc, out, _ = _cli(str(copy), "--verify")
    lines = out.strip().splitlines()
    assert rc == 2 and lines[:2] == res.problems and lines[-1] == "lineage check failed: 2 problem(s)"

    (copy / "model" / "model_index.json").unlink()
    assert "missing: model/model_index.json" in verify_lineage(copy).problems


def test_verify_checks_embedded_manifests(chain: dict[str, Path]) -> None:
    path = chain["export"] / "lineage.json"
    m = json.loads(path.read_text())
    m["inputs"][0]["lineage"]["inputs"][0]["lineage"]["outputs"][0]["sha256"] = "0" * 64
    path.write_text(json.dumps(m))
    res = verify_lineage(chain["export"])
    assert res.problems == [res.problems[0]] and res.problems[0].startswith(
        "input student/data (artifacts/latents): recorded sha256 ")


def test_write_refuses_an_input_changed_after_its_lineage(chain: dict[str, Path]) -> None:
    (chain["pretrain"] / WEIGHTS).write_bytes(b"retrained by hand")
    before = (chain["export"] / "lineage.json").read_bytes()
    with pytest.raises(UserError, match=f"input 'student'.*changed: {WEIGHTS}"):
        write_lineage(chain["export"], kind="export", stage="export", inputs=[Input("student", chain["pretrain"])])
    assert (chain["export"] / "lineage.json").read_bytes() == before
    with pytest.raises(UserError, match="input 'teacher' not found"):
        write_lineage(chain["export"], kind="export", stage="export", inputs=[Input("teacher", "artifacts/none")])


def test_read_errors_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no lineage.json"):
        read_lineage(tmp_path)
    (tmp_path / "lineage.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        read_lineage(tmp_path)
    (tmp_path / "lineage.json").write_text('{"kind": "data"}')
    with pytest.raises(UserError, match="missing key"):
        verify_lineage(tmp_path)
    rc, out, err = _cli(str(tmp_path / "missing"))
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and "no lineage.json" in err
