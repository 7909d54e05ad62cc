"""The ``prompts`` stage in the DAG (issue 42 item 2): a git + DVC workspace on the tiny CPU default whose distill
trains on prompts only (``distill.data: prompts``, ``prompts.path``) — DMD2 through `dvc repro` —, `dvc status` after one
changed prompt naming only the prompts stage, its rerun re-encoding one shard and rerunning only distill after it, a
PDD on prompts that asks for noised video latents refused by the params check, and hostile prompts files refused in
one line (exit 2) with the last good artifact kept. Self-Forcing and PDD from the prompts only run in
tests/test_given_teacher.py (the published recipe's whole DAG).

One workspace for the module: a copy of the session's ``trained`` one (conftest.py: clips, base, latents and teacher
there, none of which a param set here feeds), then `dvc repro distill` (prompts, pretrain, distill); the tests run in
file order and put back every param they change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from workspace import ROOT, copy_workspace, set_params, sh, stage

pytestmark = pytest.mark.slow

PROMPTS = (ROOT / "src" / "distillery" / "assets" / "prompts" / "tiny.txt").read_text().splitlines()[:12]


@pytest.fixture(scope="module")
def ws(trained: Path, tmp_path_factory) -> Path:
    repo = copy_workspace(trained, tmp_path_factory.mktemp("prompts") / "ws")
    set_params(repo, {"distill.data": "prompts", "distill.method": "dmd2", "prompts.path": "prompts.txt",
                      "prompts.rows_per_shard": 4})
    sh(["git", "commit", "-qam", "distill from prompts"], repo)
    (repo / "prompts.txt").write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    sh(["dvc", "repro", "distill"], repo)
    return repo


def _lineage(repo: Path, name: str) -> dict:
    return json.loads((repo / "artifacts" / name / "lineage.json").read_text())


def _inputs(repo: Path, name: str) -> dict[str, str]:
    return {i["role"]: i["path"] for i in _lineage(repo, name)["inputs"]}


def _status(repo: Path) -> set[str]:
    out = sh(["dvc", "status", "--json"], repo).stdout.strip()
    return set(json.loads(out or "{}"))


def test_dmd2_distills_from_the_prompts_only(ws):
    prompts = json.loads((ws / "artifacts" / "prompts" / "data" / "preprocess.json").read_text())
    assert prompts["kind"] == "prompts" and prompts["latent_shape"] == [8, 5, 8, 8]  # 17 frames of 32x32, the tiny VAE
    assert prompts["splits"]["train"]["rows"] == 12 and sorted(p.name for p in (ws / "artifacts" / "prompts" / "data" / "train")
                                                              .glob("*.parquet")) == [f"shard-0000{k}.parquet" for k in range(3)]
    assert _inputs(ws, "prompts") == {"base": "artifacts/base", "prompts": "prompts.txt"}
    distill = _lineage(ws, "distill")
    assert distill["method"] == "distillery.methods.dmd2.DMD2Method" and _inputs(ws, "distill")["data"] == "artifacts/prompts"
    data = distill["config"]["training"]["data"]
    assert data["path"] == "artifacts/prompts/data" and data["latent_shape"] == [8, 5, 8, 8]
    assert json.loads((ws / "metrics" / "distill.json").read_text())["steps"] == 4


def test_a_changed_prompt_reruns_only_what_reads_prompts(ws):
    before = _status(ws)  # the stages the repro did not reach (pdd, validate, export)
    assert before.isdisjoint({"clips", "base", "latents", "teacher", "pretrain", "prompts", "distill"})
    changed = PROMPTS[:5] + ["a magenta triangle moving down quickly on a white background"] + PROMPTS[6:]
    (ws / "prompts.txt").write_text("\n".join(changed) + "\n", encoding="utf-8")
    assert _status(ws) - before == {"prompts"}  # the one stage that reads the file; distill follows its artifact
    old_shards = {p.name: p.read_bytes() for p in (ws / "artifacts" / "prompts" / "data" / "train").glob("*.parquet")}
    done = sh(["dvc", "repro", "distill"], ws)
    log = done.stdout + done.stderr
    ran = [line.split("'")[1] for line in log.splitlines() if line.startswith("Running stage")]
    assert ran == ["prompts", "distill"]
    assert "encoded 4 of 12 prompts (1 shard re-encoded)" in log  # shard 1 (prompts 5-8) only
    new_shards = {p.name: p.read_bytes() for p in (ws / "artifacts" / "prompts" / "data" / "train").glob("*.parquet")}
    assert [n for n in sorted(new_shards) if new_shards[n] != old_shards[n]] == ["shard-00001.parquet"]
    assert _status(ws) == before


def test_a_pdd_that_noises_video_latents_of_a_prompt_only_set_is_refused_by_the_params_check(ws):
    set_params(ws, {"pdd.data": "prompts", "pdd.rollout": "data_latent"})  # noised video latents: none in a prompt-only set
    try:
        out = sh(["distillery", "params", "check"], ws, check=False)
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert [line for line in out.stderr.splitlines() if line.strip()] == [
            "error: params.yaml: pdd.data: prompts: pdd.rollout data_latent noises video latents, which a prompt-only set "
            "has none of; use pdd.rollout: simulate, or pdd.data: latents"]
        set_params(ws, {"pdd.rollout": "simulate"})
        assert sh(["distillery", "params", "check"], ws).returncode == 0
    finally:
        set_params(ws, {"pdd.data": "latents", "pdd.rollout": "simulate"})


@pytest.mark.parametrize("name,content,says", [
    ("binary.txt", b"a red circle\n\x00\x01\x02\xff", "line 2: a NUL byte: a binary file"),
    ("huge.txt", b"a red circle\n" * 4 + b"x" * 10_001 + b"\n", "line 5: 10001 characters, more than the limit of 10000"),
    ("empty.txt", b"", "lists no prompts"),
    ("latin1.txt", b"a red circle\n" * 4 + "a caf\xe9 moving left\n".encode("latin-1"), "line 5: not valid UTF-8"),
])
def test_a_hostile_prompts_file_is_one_line_exit_2_and_the_last_artifact_stays(ws, name, content, says):
    (ws / name).write_bytes(content)
    kept = (ws / "artifacts" / "prompts" / "lineage.json").read_bytes()
    set_params(ws, {"prompts.path": name})  # 4 prompts or more where the file counts (the first stage's batch check)
    try:
        out = stage(ws, "prompts")
    finally:
        set_params(ws, {"prompts.path": "prompts.txt"})
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1 and says in errors[0] and name in errors[0]
    assert "Traceback" not in out.stderr and (ws / "artifacts" / "prompts" / "lineage.json").read_bytes() == kept
    assert not (ws / "artifacts" / "prompts.tmp").exists()
