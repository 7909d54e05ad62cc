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

from distillery.common.errors import UserError
from distillery.lineage.contract import DIGEST_KEY
from distillery.lineage.dvc_outs import find_dvc_out
from distillery.lineage.hashing import hash_file, hash_tree, tree_digest
from distillery.lineage.manifest import MANIFEST_KEYS, Input, code_info, manifest_digest, read_lineage, write_lineage
from distillery.lineage.render import lineage_tree
from distillery.lineage.verify import verify_lineage

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
    from distillery.cli.main import build_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            build_parser().parse_args(["lineage", "x"])
    except SystemExit:
        return False
    return True


def _cli(*args: str) -> tuple[int, str, str]:
    """Run ``distillery lineage ARGS``: as a subprocess through distillery.cli.main when the lead has
    wired the command in, else in-process through add_command + the CLI's error guard."""
    if _lineage_wired():
        res = subprocess.run([sys.executable, "-m", "distillery.cli.main", "lineage", *args],
                             capture_output=True, text=True, timeout=120)
        return res.returncode, res.stdout, res.stderr
    from distillery.cli.guard import run_guarded
    from distillery.cli.lineage import add_command

    parser = argparse.ArgumentParser(prog="distillery")
    add_command(parser.add_subparsers(dest="command", required=True), "lineage", "help")
    ns = parser.parse_args(["lineage", *args])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = run_guarded(lambda: ns.func(ns))
    return rc, out.getvalue(), err.getvalue()


def test_hash_tree_files_and_exclusions(tmp_path: Path) -> None:
    _write(tmp_path / "lineage.json", "{}")  # top level: excluded
    _write(tmp_path / "sub/lineage.json", "{}")  # nested: a payload file like any other
    _write(tmp_path / "b.bin", b"xyz")
    _write(tmp_path / "sub/.x.bin.tmp-123", "partial")  # hidden temp file: counted like any other
    entries = hash_tree(tmp_path)
    assert [e["path"] for e in entries] == ["b.bin", "sub/.x.bin.tmp-123", "sub/lineage.json"]
    assert entries[0] == {"path": "b.bin", "sha256": hash_file(tmp_path / "b.bin"), "bytes": 3}
    assert tree_digest(entries) == tree_digest(list(reversed(entries)))
    with pytest.raises(UserError):
        hash_tree(tmp_path / "nope")
    (tmp_path / "sub" / "link.bin").symlink_to(tmp_path / "b.bin")
    with pytest.raises(UserError, match=r"holds sub/link.bin \(symlink -> "):
        hash_tree(tmp_path)
    assert [e["path"] for e in hash_tree(tmp_path, follow_symlinks=True)] == [
        "b.bin", "sub/.x.bin.tmp-123", "sub/lineage.json", "sub/link.bin"]


def test_export_embeds_the_whole_chain(chain: dict[str, Path]) -> None:
    m = read_lineage(chain["export"])
    assert tuple(m) == (*MANIFEST_KEYS, DIGEST_KEY)
    assert m[DIGEST_KEY] == manifest_digest(m)
    assert m["artifact"] == "artifacts/export" and m["kind"] == "export"
    datetime.strptime(m["created"], "%Y-%m-%dT%H:%M:%SZ")
    assert [o["path"] for o in m["outputs"]] == ["model/model_index.json", WEIGHTS]
    (student,) = m["inputs"]
    assert student["role"] == "student" and student["path"] == "artifacts/pretrain"
    assert student["sha256"] == tree_digest(hash_tree(chain["pretrain"]))
    pre = student["lineage"]
    assert pre == read_lineage(chain["pretrain"]) and pre[DIGEST_KEY] == manifest_digest(pre)
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


def test_dvc_bookkeeping_does_not_make_the_tree_dirty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run writes dvc.lock (and .dvc/ state) itself: a clone that only ran the pipeline is clean; any
    other change, tracked or untracked, at the top or in a subfolder, is dirty."""
    if shutil.which("git") is None:
        pytest.skip("no git")
    import subprocess

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / "sub").mkdir()
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\n")
    git("init", "-q")
    git("-c", "user.email=a@b", "-c", "user.name=a", "add", "-A")
    git("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "c")
    monkeypatch.chdir(tmp_path / "sub")  # a stage may run below the repository root
    assert code_info()["dirty"] is False
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n")  # the run rewrote it
    (tmp_path / "sub" / "dvc.lock").write_text("x")  # a nested project's lock, untracked
    (tmp_path / ".dvc").mkdir()
    (tmp_path / ".dvc" / "config").write_text("[core]\n")
    for folder, name in (("metrics", "teacher.json"), ("plots", "teacher_loss.json")):  # the stages' copies for DVC
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_text("{}")
    assert code_info()["dirty"] is False
    (tmp_path / "sub" / "metrics").mkdir()  # only the top-level folders are bookkeeping
    (tmp_path / "sub" / "metrics" / "x.json").write_text("{}")
    assert code_info()["dirty"] is True
    shutil.rmtree(tmp_path / "sub" / "metrics")
    (tmp_path / "sub" / "new.py").write_text("y = 2\n")
    assert code_info()["dirty"] is True
    (tmp_path / "sub" / "new.py").unlink()
    (tmp_path / "code.py").write_text("x = 3\n")
    assert code_info()["dirty"] is True


def test_tree_shows_every_stage(chain: dict[str, Path]) -> None:
    text = lineage_tree(read_lineage(chain["export"]))
    lines = text.splitlines()
    assert lines[0].startswith("export [export]  artifacts/export")
    assert any(ln.startswith("└─ student: pretrain [checkpoint]  artifacts/pretrain") for ln in lines)
    assert any("├─ data: latents [data]  artifacts/latents" in ln for ln in lines)
    # the base is an input twice (the latents' base and the pretrain init): in full once, then one line back
    assert any("└─ base: base/tiny-wan  (external, no lineage)" in ln for ln in lines)
    assert any("└─ student_init: base/tiny-wan  (external)  (shown above)  sha256 " in ln for ln in lines)
    assert sum("base/tiny-wan" in ln for ln in lines) == 2 and text.count("(external, no lineage)") == 1
    assert "method: DFSFTMethod" in text and "pretrain.lr=0.0001" in text and "mlflow: run abc123run" in text
    assert "metrics: loss=0.25, grad_norm=1.5" in text and "code: " in text
    digest = tree_digest(read_lineage(chain["pretrain"])["outputs"])[:12]
    assert f"sha256 {digest}" in text


@pytest.mark.process
def test_cli_tree_and_json_round_trip(chain: dict[str, Path]) -> None:
    rc, out, _ = _cli(str(chain["export"]), "--json")
    assert rc == 0 and json.loads(out) == read_lineage(chain["export"])
    rc, out, _ = _cli(str(chain["export"] / "lineage.json"))
    assert rc == 0 and out.rstrip("\n") == lineage_tree(read_lineage(chain["export"]))


@pytest.mark.process
def test_verify_copy_then_tamper(chain: dict[str, Path], tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere" / "export"
    shutil.copytree(chain["export"], copy)
    shutil.rmtree(tmp_path / "artifacts")  # the originals are gone: verify must not need them
    shutil.rmtree(tmp_path / "base")
    res = verify_lineage(copy)
    assert res.ok and res.problems == [] and res.files == 2
    rc, out, _ = _cli(str(copy), "--verify")
    assert rc == 0 and out.splitlines() == [f"manifest digest: {res.manifest_digest}", "verified: 2 files"]
    assert res.sealed and res.manifest_digest == read_lineage(copy)[DIGEST_KEY]

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
    assert rc == 2 and lines[1:3] == res.problems and lines[-1] == "lineage check failed: 2 problem(s)"

    (copy / "model" / "model_index.json").unlink()
    assert "missing: model/model_index.json" in verify_lineage(copy).problems


def test_verify_checks_embedded_manifests(chain: dict[str, Path]) -> None:
    path = chain["export"] / "lineage.json"
    m = json.loads(path.read_text())
    m["inputs"][0]["lineage"]["inputs"][0]["lineage"]["outputs"][0]["sha256"] = "0" * 64
    path.write_text(json.dumps(m))
    res = verify_lineage(chain["export"])
    assert [p.split(": ", 1)[0] for p in res.problems] == [  # every seal up the chain, then the file list
        "manifest digest mismatch", "input student (artifacts/pretrain)", "input student/data (artifacts/latents)",
        "input student/data (artifacts/latents)"]
    assert all("embedded manifest digest mismatch" in p for p in res.problems[1:3])
    assert res.problems[3].startswith("input student/data (artifacts/latents): recorded sha256 ")


def test_write_refuses_an_input_changed_after_its_lineage(chain: dict[str, Path]) -> None:
    (chain["pretrain"] / WEIGHTS).write_bytes(b"retrained by hand")
    before = (chain["export"] / "lineage.json").read_bytes()
    with pytest.raises(UserError, match=f"input 'student'.*changed: {WEIGHTS}"):
        write_lineage(chain["export"], kind="export", stage="export", inputs=[Input("student", chain["pretrain"])])
    assert (chain["export"] / "lineage.json").read_bytes() == before
    with pytest.raises(UserError, match="input 'teacher' not found"):
        write_lineage(chain["export"], kind="export", stage="export", inputs=[Input("teacher", "artifacts/none")])


@pytest.mark.process
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


def _reference_dvc(repo: Path, *args: str) -> subprocess.CompletedProcess:
    dvc = Path(sys.executable).with_name("dvc")
    return subprocess.run([str(dvc), *args], cwd=repo, check=True, capture_output=True, text=True, timeout=120)


@pytest.mark.process
def test_dvc_lock_hash_is_what_dvc_add_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The DVC 3 directory hash that `--verify --dvc-lock` recomputes, checked against the installed DVC on a
    real `dvc add` (before and after a file changes): nested
    and hidden files, non-ASCII names, an empty folder, lineage.json, and names whose string order
    differs from their component order ("a-b/x" < "a/b/y")."""
    import yaml

    repo = tmp_path / "repo"
    art = repo / "art"
    _write(art / "a/b/y.txt", "x\r\ny\r\n")  # CRLF text: DVC 3 hashes raw bytes
    _write(art / "a-b/x", b"\x00\x01")
    _write(art / ".hidden.tmp-1", "partial")
    _write(art / "sub/é.bin", "é")
    (art / "empty").mkdir()
    monkeypatch.chdir(repo)
    write_lineage("art", kind="data", stage="art")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True, timeout=60)
    _reference_dvc(repo, "init", "-q")
    _reference_dvc(repo, "add", "-q", "art")
    (out,) = yaml.safe_load((repo / "art.dvc").read_text())["outs"]
    assert out["nfiles"] == 5
    found = find_dvc_out(repo / "art.dvc", art)
    assert (found.stage, found.path, found.md5, found.nfiles) == (None, "art", out["md5"], 5)
    res = verify_lineage("art", dvc_lock="art.dvc")
    assert res.ok and res.notes == [f"dvc: art matches {out['md5']} recorded for art in art.dvc"]
    (art / "a-b" / "x").write_bytes(b"\x00\x02")
    res = verify_lineage("art", dvc_lock="art.dvc")
    _reference_dvc(repo, "add", "-q", "art")  # what DVC records for the changed folder
    (changed,) = yaml.safe_load((repo / "art.dvc").read_text())["outs"]
    assert changed["md5"] != out["md5"]
    assert res.problems[-1] == (f"dvc: art hashes to {changed['md5']} but art.dvc records {out['md5']} "
                                f"for art (changed after DVC recorded it)")


def test_find_dvc_out_errors(tmp_path: Path) -> None:
    art = tmp_path / "artifacts" / "export"
    art.mkdir(parents=True)
    lock = tmp_path / "dvc.lock"
    with pytest.raises(UserError, match="dvc lock file not found"):
        find_dvc_out(lock, art)
    lock.write_text("stages: [unclosed\n")
    with pytest.raises(UserError, match="is not a readable YAML file"):
        find_dvc_out(lock, art)
    lock.write_text("schema: '2.0'\n")
    with pytest.raises(UserError, match="neither a dvc.lock"):
        find_dvc_out(lock, art)
    stage = "stages:\n  export:\n    cmd: x\n    outs:\n    - path: {path}\n      md5: {md5}\n{extra}"
    lock.write_text(stage.format(path="artifacts/other", md5="0" * 32 + ".dir", extra="      hash: md5\n"))
    with pytest.raises(UserError, match=r"records no out for .*export \(outs: artifacts/other\)"):
        find_dvc_out(lock, art)
    lock.write_text(stage.format(path="artifacts/export", md5="0" * 32, extra="      hash: md5\n"))
    with pytest.raises(UserError, match="is not a folder out"):
        find_dvc_out(lock, art)
    lock.write_text(stage.format(path="artifacts/export", md5="0" * 32 + ".dir", extra=""))
    with pytest.raises(UserError, match="DVC 2 hashes"):
        find_dvc_out(lock, art)
    lock.write_text(stage.format(path="artifacts/export", md5="0" * 32 + ".dir", extra="      hash: md5\n"))
    assert find_dvc_out(lock, art).stage == "export"
    copy = tmp_path / "elsewhere" / "export"
    copy.mkdir(parents=True)  # a copy is found by the manifest's recorded artifact path
    assert find_dvc_out(lock, copy, "artifacts/export").path == "artifacts/export"


@pytest.mark.process
def test_unsealed_manifest_verifies_with_a_warning(chain: dict[str, Path]) -> None:
    """Manifests written before seals (no manifest_sha256, at any level) still verify, with a
    warning; they never satisfy --expect."""
    for name in ("latents", "pretrain", "export"):
        path = chain[name] / "lineage.json"
        m = json.loads(path.read_text())

        def strip(node: dict) -> None:
            node.pop(DIGEST_KEY, None)
            for inp in node.get("inputs") or []:
                if isinstance(inp.get("lineage"), dict):
                    strip(inp["lineage"])

        strip(m)
        path.write_text(json.dumps(m, indent=2))
    res = verify_lineage(chain["export"], recursive=True)
    assert res.ok and not res.sealed and res.notes[0].startswith("warning: manifest is unsealed")
    assert "input student (artifacts/pretrain): verified: 4 files, manifest matches the embedded one" in res.notes
    rc, out, _ = _cli(str(chain["export"]), "--verify")
    lines = out.splitlines()
    assert rc == 0 and lines[0] == f"manifest digest: {res.manifest_digest}" and lines[1].startswith("warning: ")
    rc, out, _ = _cli(str(chain["export"]), "--verify", "--expect", res.manifest_digest)
    assert rc == 2 and "manifest is unsealed (no manifest_sha256), so it cannot match the expected digest" in out
    # a new artifact may still take an unsealed input: its files are checked, the input is embedded as it is
    m = write_lineage(chain["export"], kind="export", stage="export", inputs=[Input("student", chain["pretrain"])])
    assert DIGEST_KEY not in m["inputs"][0]["lineage"] and verify_lineage(chain["export"]).ok


@pytest.mark.process
def test_verify_flag_errors_are_one_line(chain: dict[str, Path]) -> None:
    for args, msg in (((str(chain["export"]), "--verify", "--expect", "abc"), "is not a sha256 hex digest"),
                      ((str(chain["export"]), "--recursive"), "--recursive only applies with --verify"),
                      ((str(chain["export"]), "--verify", "--dvc-lock", "nope.lock"), "dvc lock file not found")):
        rc, out, err = _cli(*args)
        assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and msg in err, (args, err)
    digest = read_lineage(chain["export"])[DIGEST_KEY]
    assert verify_lineage(chain["export"], expect=f"  SHA256:{digest.upper()} ").ok


def test_write_lineage_refuses_symlinks_and_drops_its_stale_temp(chain: dict[str, Path], tmp_path: Path) -> None:
    export = chain["export"]
    stale = export / ".lineage.json.tmp-killed"
    stale.write_text("half a manifest from a killed write")
    other = export / "model" / ".notes.tmp"
    other.write_text("someone else's hidden file")
    m = write_lineage(export, kind="export", stage="export", inputs=[Input("student", chain["pretrain"])])
    assert not stale.exists() and "model/.notes.tmp" in [o["path"] for o in m["outputs"]]
    assert verify_lineage(export).ok
    (export / "model" / "link").symlink_to(tmp_path / "base", target_is_directory=True)
    before = (export / "lineage.json").read_bytes()
    with pytest.raises(UserError, match=r"holds model/link \(symlink -> .*\): refused, an artifact holds regular"):
        write_lineage(export, kind="export", stage="export")
    assert (export / "lineage.json").read_bytes() == before
    # an input artifact holding a symlink is refused too
    (chain["pretrain"] / "extra.bin").symlink_to(tmp_path / "base" / "model_index.json")
    with pytest.raises(UserError, match=r"holds extra.bin \(symlink"):
        write_lineage(chain["latents"], kind="data", stage="latents", inputs=[Input("x", chain["pretrain"])])


def test_external_input_symlinks_are_followed_and_pinned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hugging Face cache snapshot links its files to blobs: an external input is hashed
    through them, and --recursive rechecks it by content."""
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "blobs/aaa", '{"_class_name": "WanPipeline"}')
    _write(tmp_path / "vae-real/config.json", '{"z_dim": 4}')
    snap = Path("snapshot")
    snap.mkdir()
    (snap / "model_index.json").symlink_to(tmp_path / "blobs/aaa")
    (snap / "vae").symlink_to(tmp_path / "vae-real", target_is_directory=True)
    art = Path("artifacts/base")
    _write(art / "model/model_index.json", '{"_class_name": "WanPipeline"}')
    m = write_lineage(art, kind="model", stage="base", inputs=[Input("source", snap)])
    assert [f["path"] for f in m["inputs"][0]["files"]] == ["model_index.json", "vae/config.json"]
    notes = verify_lineage(art, recursive=True).notes
    assert "input source (snapshot): verified: 2 files (external, no lineage)" in notes
    (tmp_path / "vae-real" / "up").symlink_to(tmp_path / "vae-real", target_is_directory=True)  # a loop
    with pytest.raises(UserError, match=r"holds vae/up \(symlink -> .*; a loop\)"):
        write_lineage(art, kind="model", stage="base", inputs=[Input("source", snap)])
    (tmp_path / "vae-real" / "up").unlink()
    (tmp_path / "blobs/aaa").write_text("{}")
    res = verify_lineage(art, recursive=True)
    assert not res.ok and res.problems[0].startswith("input source (snapshot): changed: model_index.json")


def test_staged_write_records_the_final_artifact_path(chain: dict[str, Path]) -> None:
    """A stage writes into artifacts/<name>.tmp and renames it: ``artifact_name`` records the final
    place, and the sealed manifest verifies after the rename (a dvc.lock finds it by that path)."""
    staging = Path("artifacts/export.tmp")
    shutil.copytree(chain["export"], staging)
    m = write_lineage(staging, kind="export", stage="export", inputs=[Input("student", chain["pretrain"])],
                      artifact_name="artifacts/export")
    shutil.rmtree(chain["export"])
    staging.rename(chain["export"])
    assert m["artifact"] == "artifacts/export" and m == read_lineage(chain["export"])
    assert verify_lineage(chain["export"], expect=m[DIGEST_KEY], recursive=True).ok


@pytest.mark.process
def test_hash_once_reuses_digests_and_still_catches_tampering(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the stage runner's hash cache active, a downstream stage takes the producer's digests
    for unchanged files instead of reading them again (staging renamed into place included); an
    input changed afterwards is read again and refused by the next stage; content changed with its
    mtime put back is caught by ``--verify``, which never uses the cache."""
    import dataclasses
    import os

    from distillery.common import hashcache

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(hashcache.ENV_VAR, str(tmp_path / "runs" / ".hash_cache.json"))
    staging = Path("artifacts/teacher.tmp")
    _write(staging / WEIGHTS, bytes(range(256)) * 4096)  # 1 MiB
    _write(staging / "model/transformer/config.json", '{"num_layers": 2}')
    write_lineage(staging, kind="checkpoint", stage="teacher", artifact_name="artifacts/teacher")
    staging.rename("artifacts/teacher")  # what artifacts.publish does
    teacher = Path("artifacts/teacher")
    assert (tmp_path / "runs" / ".hash_cache.json").is_file()  # written to disk for the next process

    hashcache._ACTIVE = None  # a new stage process: the cache is read back from the file
    before = dataclasses.replace(hashcache.STATS)
    consumer = Path("artifacts/pretrain")
    _write(consumer / "metrics.json", "{}")
    manifest = write_lineage(consumer, kind="checkpoint", stage="pretrain", inputs=[Input("student_init", teacher)])
    assert hashcache.STATS.files_cached - before.files_cached == 2  # both teacher files from the cache
    assert hashcache.STATS.read_bytes - before.read_bytes == (consumer / "metrics.json").stat().st_size  # only its own output
    assert manifest["inputs"][0]["sha256"] == tree_digest(hash_tree(teacher))
    monkeypatch.delenv(hashcache.ENV_VAR)
    assert manifest["inputs"][0]["sha256"] == tree_digest(hash_tree(teacher))  # the same digest read from the bytes
    monkeypatch.setenv(hashcache.ENV_VAR, str(tmp_path / "runs" / ".hash_cache.json"))

    weights = teacher / WEIGHTS
    stat = weights.stat()
    data = bytearray(weights.read_bytes())
    data[0] ^= 0xFF
    weights.write_bytes(bytes(data))  # tampered: new mtime → a miss → read again → refused
    with pytest.raises(UserError, match=f"input 'student_init'.*changed: {WEIGHTS}"):
        write_lineage(consumer, kind="checkpoint", stage="pretrain", inputs=[Input("student_init", teacher)])
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # tampered with the mtime put back
    report = verify_lineage(teacher)
    assert not report.ok and any(WEIGHTS in p for p in report.problems)
    rc, out, err = _cli(str(teacher), "--verify")
    assert rc != 0 and WEIGHTS in out + err


def test_a_copied_model_folder_is_read_once_for_both_manifests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The base stage copies the user's model folder: with the hash cache active the copy reads each
    source byte once, and the source's input manifest and the copy's output manifest take that digest
    (a 14 GB Wan2.1 folder was hashed twice, 28 GB, on the GPU machine); a source changed afterwards
    is read again."""
    import dataclasses
    import hashlib

    from distillery.common import hashcache
    from distillery.pipeline.publish.base_folder import copy_model_folder

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(hashcache.ENV_VAR, str(tmp_path / "runs" / ".hash_cache.json"))
    hashcache._ACTIVE = None
    source = tmp_path / "user-model"
    payload = bytes(range(256)) * 8192  # 2 MiB
    _write(source / "transformer" / "diffusion_pytorch_model.safetensors", payload)
    _write(source / "model_index.json", "{}")
    before = dataclasses.replace(hashcache.STATS)
    copy_model_folder(source, tmp_path / "artifacts" / "base.tmp" / "model")
    assert hashcache.STATS.read_bytes - before.read_bytes == len(payload) + 2
    copied = tmp_path / "artifacts" / "base.tmp" / "model" / "transformer" / "diffusion_pytorch_model.safetensors"
    mid = dataclasses.replace(hashcache.STATS)
    for f in (copied, source / "transformer" / "diffusion_pytorch_model.safetensors"):
        assert hashcache.file_sha256(f) == hashlib.sha256(payload).hexdigest()
    assert hashcache.STATS.read_bytes == mid.read_bytes and hashcache.STATS.files_cached - mid.files_cached == 2
    (source / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(payload[::-1])
    assert hashcache.file_sha256(source / "transformer" / "diffusion_pytorch_model.safetensors") == hashlib.sha256(payload[::-1]).hexdigest()
    assert hashcache.STATS.read_bytes - mid.read_bytes == len(payload)
    hashcache._ACTIVE = None
