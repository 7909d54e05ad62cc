"""Case 8.5: ``distillery lineage --verify`` protects the manifest, not only the files.

A small hand-made chain under a temp folder (cwd = that folder, paths recorded relative):
external base ─► artifacts/latents ─► artifacts/pretrain ─► artifacts/export, written with
``write_lineage``; each test tampers with it the way an attacker or a careless hand would and runs
the real CLI (``distillery.cli.main``) on it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from distillery.cli.guard import run_guarded
from distillery.cli.main import build_parser
from distillery.common.errors import UserError
from distillery.lineage.contract import DIGEST_KEY
from distillery.lineage.hashing import hash_tree
from distillery.lineage.manifest import Input, manifest_digest, write_lineage

WEIGHTS = "model/transformer/diffusion_pytorch_model.safetensors"
FAILED = "lineage check failed"


def _write(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())


def _make_chain(root: Path) -> dict[str, Path]:
    """external base -> latents -> pretrain -> export under ``root`` (the current directory)."""
    base = Path("base/tiny-wan")
    _write(root / base / "model_index.json", '{"_class_name": "WanPipeline"}')
    _write(root / base / "transformer/diffusion_pytorch_model.safetensors", bytes(range(256)) * 4)
    latents = Path("artifacts/latents")
    _write(root / latents / "data/train/shard-00000.parquet", b"PAR1" + bytes(64) + b"PAR1")
    write_lineage(latents, kind="data", stage="latents", params={"latents": {"rows_per_shard": 8}},
                  inputs=[Input("base", base)])
    pretrain = Path("artifacts/pretrain")
    _write(root / pretrain / WEIGHTS, bytes(range(200, 256)) * 32)
    _write(root / pretrain / "model/sampling.json", '{"shift": 3.0}')
    _write(root / pretrain / "metrics.json", '{"loss": 0.25}')
    write_lineage(pretrain, kind="checkpoint", stage="pretrain", method="distillery.methods.dfsft.DFSFTMethod",
                  params={"pretrain": {"steps": 10, "lr": 1e-4}},
                  inputs=[Input("data", latents), Input("student_init", base)])
    export = Path("artifacts/export")
    _write(root / export / "model_index.json", '{"_class_name": "WanPipeline"}')
    _write(root / export / "transformer/diffusion_pytorch_model.safetensors", bytes(range(200, 256)) * 32)
    write_lineage(export, kind="export", stage="export", params={"export": {"role": "student"}},
                  inputs=[Input("student", pretrain)])
    return {"base": base, "latents": latents, "pretrain": pretrain, "export": export}


@pytest.fixture()
def chain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    monkeypatch.chdir(tmp_path)
    return _make_chain(tmp_path)


def _run_cli(*args: str) -> int:
    """``distillery lineage ARGS`` in-process through the real CLI parser and its error guard
    (``distillery.cli.main`` minus its logging setup, which would outlive the test)."""
    ns = build_parser().parse_args(["lineage", *map(str, args)])
    return run_guarded(lambda: ns.func(ns))


def lineage(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str], str]:
    """``distillery lineage ARGS``: (exit code, stdout lines, stderr)."""
    capsys.readouterr()
    rc = _run_cli(*args)
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err


def _manifest(artifact: Path) -> dict:
    return json.loads((artifact / "lineage.json").read_text())


def _save(artifact: Path, manifest: dict, *, reseal: bool = False) -> None:
    if reseal:  # what an attacker who knows the format does: the seal holds no secret
        manifest[DIGEST_KEY] = manifest_digest(manifest)
    (artifact / "lineage.json").write_text(json.dumps(manifest, indent=2))


def _flip_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _record_undetected(data_lost, rc: int, lines: list[str]) -> None:
    undetected = 0 if (rc == 2 and lines and lines[-1].startswith(FAILED)) else 1
    data_lost.record(undetected, "tampered artifacts reported as verified")
    assert data_lost.total == 0, lines


@pytest.mark.reliability(case="8.5", title="genuine artifact verifies",
                         injected="none: a hand-made latents -> pretrain -> export chain, verified with "
                                  "--recursive and --expect its recorded digest",
                         expect="exit 0, 'manifest digest: <hex>' equal to the recorded seal, every present input "
                                "verified, no file touched")
def test_genuine_artifact_verifies(chain, capsys, data_lost):
    export = chain["export"]
    before = _snapshot(Path("artifacts"))
    sealed = _manifest(export)[DIGEST_KEY]
    rc, lines, err = lineage(capsys, export, "--verify", "--recursive", "--expect", sealed)
    assert rc == 0 and err == "", lines
    assert lines[0] == f"manifest digest: {sealed}" and lines[-1] == "verified: 2 files"
    assert "manifest digest matches the expected one" in lines
    assert "input student (artifacts/pretrain): verified: 3 files, manifest matches the embedded one" in lines
    assert "input student/data (artifacts/latents): verified: 1 files, manifest matches the embedded one" in lines
    assert "input student/data/base (base/tiny-wan): verified: 2 files (external, no lineage)" in lines
    assert not any("warning" in ln for ln in lines)
    changed = sum(before[k] != v for k, v in _snapshot(Path("artifacts")).items()) + len(
        set(before) ^ set(_snapshot(Path("artifacts"))))
    data_lost.record(changed, "files of the artifacts changed by verifying")
    assert data_lost.total == 0


@pytest.mark.reliability(case="8.5", title="file and its hash edited together",
                         injected="flip a byte of the export's weights and write the new sha256 into its "
                                  "outputs entry in lineage.json",
                         expect="--verify exits 2: manifest digest mismatch")
def test_file_and_its_recorded_hash_edited(chain, capsys, data_lost):
    export = chain["export"]
    weights = export / "transformer/diffusion_pytorch_model.safetensors"
    _flip_byte(weights)
    m = _manifest(export)
    entry = next(o for o in m["outputs"] if o["path"] == "transformer/diffusion_pytorch_model.safetensors")
    entry["sha256"] = hash_tree(export)[1]["sha256"]
    _save(export, m)
    rc, lines, _ = lineage(capsys, export, "--verify")
    _record_undetected(data_lost, rc, lines)
    assert lines[1].startswith("manifest digest mismatch: its content hashes to ") and len(lines) == 3


@pytest.mark.reliability(case="8.5", title="recorded params changed",
                         injected="edit params.pretrain.lr in pretrain's lineage.json (files untouched)",
                         expect="--verify exits 2: manifest digest mismatch")
def test_recorded_params_changed(chain, capsys, data_lost):
    pretrain = chain["pretrain"]
    m = _manifest(pretrain)
    m["params"]["pretrain"]["lr"] = 1e-3
    _save(pretrain, m)
    rc, lines, _ = lineage(capsys, pretrain, "--verify")
    _record_undetected(data_lost, rc, lines)
    assert lines[1].startswith("manifest digest mismatch") and len(lines) == 3


@pytest.mark.reliability(case="8.5", title="file deleted with its entry",
                         injected="delete pretrain's model/sampling.json and its outputs entry in lineage.json",
                         expect="--verify exits 2: manifest digest mismatch")
def test_file_deleted_with_its_entry(chain, capsys, data_lost):
    pretrain = chain["pretrain"]
    (pretrain / "model/sampling.json").unlink()
    m = _manifest(pretrain)
    m["outputs"] = [o for o in m["outputs"] if o["path"] != "model/sampling.json"]
    _save(pretrain, m)
    rc, lines, _ = lineage(capsys, pretrain, "--verify")
    _record_undetected(data_lost, rc, lines)
    assert lines[1].startswith("manifest digest mismatch") and len(lines) == 3


@pytest.mark.reliability(case="8.5", title="hidden temp file added",
                         injected="add transformer/.diffusion_pytorch_model.safetensors.tmp-1 (a hidden *.tmp "
                                  "name, once skipped by hashing) to the export",
                         expect="--verify exits 2: 'unexpected: <that file>'")
def test_hidden_temp_file_counts(chain, capsys, data_lost):
    export = chain["export"]
    hidden = "transformer/.diffusion_pytorch_model.safetensors.tmp-1"
    _write(export / hidden, b"swap me in later")
    rc, lines, _ = lineage(capsys, export, "--verify")
    _record_undetected(data_lost, rc, lines)
    assert lines[1] == f"unexpected: {hidden} (new file, not in the recorded outputs)" and len(lines) == 3


@pytest.mark.reliability(case="8.5", title="symlink pointing outside the folder",
                         injected="replace the export's model_index.json by a symlink to a file outside, and add a "
                                  "folder symlink to a folder outside; then write a manifest over such a folder",
                         expect="--verify exits 2 naming both as refused (never followed); writing is a one-line "
                                "user error")
def test_symlinks_are_refused(chain, capsys, data_lost, tmp_path):
    export = chain["export"]
    outside = tmp_path / "outside"
    _write(outside / "model_index.json", '{"_class_name": "WanPipeline"}')  # same bytes as the original
    (export / "model_index.json").unlink()
    (export / "model_index.json").symlink_to(outside / "model_index.json")
    (export / "extra").symlink_to(outside, target_is_directory=True)
    rc, lines, _ = lineage(capsys, export, "--verify")
    _record_undetected(data_lost, rc, lines)
    assert lines[1].startswith("refused: extra (symlink -> ") and lines[1].endswith(
        "; an artifact holds regular files only, never followed)")
    assert lines[2].startswith("refused: model_index.json (symlink -> ") and len(lines) == 4
    with pytest.raises(UserError, match=r"holds extra \(symlink -> "):
        write_lineage(export, kind="export", stage="export")
    rc = _run_cli(export, "--json")  # the manifest was not rewritten
    assert rc == 0 and json.loads(capsys.readouterr().out)[DIGEST_KEY] == _manifest(export)[DIGEST_KEY]


def _consistent_rewrite(artifact: Path) -> None:
    """Edit a payload file, then rewrite every outputs entry and the seal to match."""
    _flip_byte(artifact / "transformer/diffusion_pytorch_model.safetensors")
    m = _manifest(artifact)
    m["outputs"] = hash_tree(artifact)
    _save(artifact, m, reseal=True)


@pytest.mark.reliability(case="8.5", title="files and manifest rewritten consistently: --expect",
                         injected="edit the export's weights, rewrite its outputs and recompute manifest_sha256",
                         expect="plain --verify passes (nothing in the folder can tell); --verify --expect <digest "
                                "recorded before> exits 2")
def test_consistent_rewrite_caught_by_expect(chain, capsys, data_lost):
    export = chain["export"]
    recorded = _manifest(export)[DIGEST_KEY]
    _consistent_rewrite(export)
    rc, lines, _ = lineage(capsys, export, "--verify")
    assert rc == 0, lines  # the documented limit of a self-check
    rc, lines, _ = lineage(capsys, export, "--verify", "--expect", recorded)
    _record_undetected(data_lost, rc, lines)
    assert lines[1].startswith("manifest digest ") and f"!= expected {recorded[:12]}…" in lines[1]


def _dvc(repo: Path, *args: str) -> None:
    dvc = Path(sys.executable).with_name("dvc")
    subprocess.run([str(dvc), *args], cwd=repo, check=True, capture_output=True, text=True, timeout=120)


@pytest.mark.process
@pytest.mark.reliability(case="8.5", title="files and manifest rewritten consistently: --dvc-lock",
                         injected="`dvc repro` a stage that writes a sealed artifact; then edit its weights, rewrite "
                                  "its outputs and recompute manifest_sha256",
                         expect="--verify --dvc-lock dvc.lock exits 0 before the edit and 2 after it (folder hash != "
                                "the .dir md5 in dvc.lock)")
def test_consistent_rewrite_caught_by_dvc_lock(tmp_path, monkeypatch, capsys, data_lost):
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True, timeout=60)
    _dvc(repo, "init", "-q")
    (repo / "make_export.py").write_text(
        "from pathlib import Path\n"
        "from distillery.lineage.manifest import write_lineage\n"
        "out = Path('artifacts/export')\n"
        "(out / 'transformer').mkdir(parents=True)\n"
        "(out / 'model_index.json').write_text('{}')\n"
        "(out / 'transformer/diffusion_pytorch_model.safetensors').write_bytes(bytes(range(256)) * 16)\n"
        "write_lineage(out, kind='export', stage='export', params={'export': {'role': 'student'}})\n")
    (repo / "dvc.yaml").write_text(
        f"stages:\n  export:\n    cmd: {sys.executable} make_export.py\n    outs: [artifacts/export]\n")
    _dvc(repo, "repro", "-q")
    monkeypatch.chdir(repo)
    export = Path("artifacts/export")
    rc, lines, _ = lineage(capsys, export, "--verify", "--dvc-lock", "dvc.lock")
    assert rc == 0 and any(ln.startswith("dvc: artifacts/export matches ") for ln in lines), lines
    _consistent_rewrite(export)
    assert lineage(capsys, export, "--verify")[0] == 0  # the self-check alone cannot tell
    rc, lines, _ = lineage(capsys, export, "--verify", "--dvc-lock", "dvc.lock")
    _record_undetected(data_lost, rc, lines)
    assert lines[1].startswith("dvc: artifacts/export hashes to ") and "(stage export)" in lines[1]


@pytest.mark.reliability(case="8.5", title="--recursive catches a tampered upstream",
                         injected="flip a byte of artifacts/pretrain's weights; then also rewrite pretrain's "
                                  "outputs and reseal its manifest; verify artifacts/export",
                         expect="plain --verify of the export passes, --verify --recursive exits 2 naming "
                                "artifacts/pretrain both times (changed file; then digest != the embedded one)")
def test_recursive_catches_tampered_upstream(chain, capsys, data_lost):
    export, pretrain = chain["export"], chain["pretrain"]
    _flip_byte(pretrain / WEIGHTS)
    assert lineage(capsys, export, "--verify")[0] == 0  # the export's own folder is intact
    rc, lines, _ = lineage(capsys, export, "--verify", "--recursive")
    _record_undetected(data_lost, rc, lines)
    assert f"input student (artifacts/pretrain): changed: {WEIGHTS} (sha256 " in "\n".join(lines)

    m = _manifest(pretrain)
    m["outputs"] = hash_tree(pretrain)
    _save(pretrain, m, reseal=True)
    assert lineage(capsys, pretrain, "--verify")[0] == 0  # pretrain alone is self-consistent now
    rc, lines, _ = lineage(capsys, export, "--verify", "--recursive")
    _record_undetected(data_lost, rc, lines)
    assert any(ln.startswith("input student (artifacts/pretrain): its manifest digest ") and "embedded here" in ln
               for ln in lines), lines
    assert "input student/data (artifacts/latents): verified: 1 files, manifest matches the embedded one" in lines


def _craft_inputs(export: Path, paths: list[str]) -> None:
    """Add external inputs naming ``paths`` to the export's lineage and reseal it (the format holds no secret)."""
    m = _manifest(export)
    for i, path in enumerate(paths):
        m["inputs"].append({"role": f"crafted{i}", "path": path, "kind": "external",
                            "files": [{"path": "x", "sha256": "0" * 64, "bytes": 1}]})
    _save(export, m, reseal=True)


@pytest.mark.reliability(case="10.F", title="a crafted lineage naming paths outside the tree",
                         injected="the export's lineage.json given inputs /proc/kmsg, / and /etc (resealed); "
                                  "`distillery lineage --verify --recursive`",
                         expect="no hang, no walk: each input noted 'outside the tree being verified: not opened'; "
                                "the genuine inputs still verified")
def test_recursive_verify_never_opens_paths_outside_the_tree(chain, capsys, data_lost, monkeypatch):
    import os as _os

    export = chain["export"]
    _craft_inputs(export, ["/proc/kmsg", "/", "/etc"])
    opened: list[str] = []
    real_scandir, real_open = _os.scandir, open

    def scandir(path="."):
        opened.append(str(path))
        return real_scandir(path)

    monkeypatch.setattr("os.scandir", scandir)
    rc, lines, err = lineage(capsys, export, "--verify", "--recursive")
    outside = [ln for ln in lines if "outside the tree being verified" in ln]
    assert len(outside) == 3, lines
    walked = [p for p in opened if p in ("/", "/etc") or p.startswith(("/etc/", "/proc"))]
    data_lost.record(len(walked), "folders outside the tree walked")
    assert walked == [] and real_open is open
    assert "input student (artifacts/pretrain): verified: 3 files, manifest matches the embedded one" in lines


@pytest.mark.reliability(case="10.F", title="a recorded input inside the tree that is a FIFO or a device",
                         injected="artifacts/pretrain replaced by a FIFO, then by a character device (/dev/zero's numbers, "
                                  "made with mknod inside the tree); `--verify --recursive` of the export",
                         expect="exit 2, 'is a named pipe / character device, not an artifact: not read'; no hang")
@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_recursive_verify_never_reads_a_special_file(chain, capsys, data_lost, tmp_path, kind):
    import os as _os
    import shutil as _shutil

    export, pretrain = chain["export"], chain["pretrain"]
    _shutil.rmtree(pretrain)
    if kind == "fifo":
        _os.mkfifo(pretrain)
        words = "is a named pipe, not an artifact: not read"
    else:
        _os.mknod(pretrain, 0o600 | __import__("stat").S_IFCHR, _os.makedev(1, 5))
        words = "is a character device, not an artifact: not read"
    rc, lines, _ = lineage(capsys, export, "--verify", "--recursive")
    _record_undetected(data_lost, rc, lines)
    assert any(words in ln for ln in lines), lines


@pytest.mark.reliability(case="10.3", title="a symbolic link loop in a verified tree",
                         injected="base/tiny-wan/loop -> . and base/tiny-wan/self -> self (the external input, followed); "
                                  "`--verify --recursive` of the export",
                         expect="no 'Symlink loop' traceback: each loop refused by name, exit 2 (the input's tree changed)")
def test_recursive_verify_over_a_link_loop(chain, capsys, data_lost):
    base = chain["base"]
    (base / "loop").symlink_to(".", target_is_directory=True)
    (base / "self").symlink_to("self")
    rc, lines, err = lineage(capsys, chain["export"], "--verify", "--recursive")
    assert "Traceback" not in err
    _record_undetected(data_lost, rc, lines)
    text = "\n".join(lines)
    assert "refused: loop (symlink -> .; a loop)" in text and "refused: self (symlink -> self)" in text, text
