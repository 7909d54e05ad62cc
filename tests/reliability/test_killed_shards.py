"""Case 11.6: work a kill would throw away is kept (issue 58, item 6).

- A ``prompts`` (or ``latents``) stage SIGKILLed mid-encode keeps the shards it finished in its staging folder
  (``artifacts/<stage>.tmp/data``: each shard written by rename, its record last): the rerun encodes only the rest, and
  its artifact is byte for byte an uninterrupted run's.
- The teacher's ODE trajectories (``pretrain.method: ode_init``): the temp files a SIGTERM leaves (a record's
  ``.shard-00001.json.tmp-<pid>``, a shard's ``.shard-00001.parquet.tmp``) are removed by the next run, which finishes
  the set bitwise as an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from workspace import copy_workspace, env, set_params, stage

ROOT = Path(__file__).resolve().parents[2]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


CASES = {  # stage -> (params, the log words of the shards a rerun found done)
    "prompts": ({"prompts.path": "prompts.txt", "prompts.rows_per_shard": 2}, "already encoded"),
    "latents": ({"latents.rows_per_shard": 2}, "already done"),
}


@pytest.mark.slow
@pytest.mark.reliability(case="11.6", title="a killed encoding stage keeps its finished shards",
                         injected="SIGKILL to `distillery stage prompts` (then `latents`) once it has finished a few "
                                  "shards (2 rows a shard), then the stage run again",
                         expect="the rerun says how many shards were already encoded (at least those finished before the "
                                "kill) and encodes only the rest; the artifact equals an uninterrupted run's, byte for byte")
@pytest.mark.parametrize("name", list(CASES))
def test_a_killed_encoding_stage_keeps_its_finished_shards(prepared, tmp_path, data_lost, name):
    params, words = CASES[name]
    prompts = (ROOT / "src" / "distillery" / "assets" / "prompts" / "tiny.txt").read_text().splitlines()
    repos = []
    for which in ("killed", "whole"):
        repo = copy_workspace(prepared, tmp_path / which)
        set_params(repo, params)
        (repo / "prompts.txt").write_text("\n".join(f"{p}, take {i}" for i in range(3) for p in prompts) + "\n")
        repos.append(repo)
    killed, whole = repos
    records = killed / "artifacts" / f"{name}.tmp" / "data" / "train"
    proc = subprocess.Popen(["distillery", "stage", name], cwd=killed, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None and len(list(records.glob("shard-*.json"))) < 3:
        time.sleep(0.02)
    assert proc.poll() is None, f"the stage ended before it could be killed: {proc.stderr.read()[-2000:]}"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    finished = {p.name for p in records.glob("shard-*.json")}
    kept = {p.name: p.read_bytes() for p in records.glob("shard-*.parquet") if p.with_suffix(".json").name in finished}
    assert len(finished) >= 3
    rerun = stage(killed, name, check=True)
    done = [line for line in rerun.stderr.splitlines() if words in line]
    assert done, rerun.stderr[-3000:]
    count = int(done[0].split("(")[-1].split()[0])
    assert count >= len(finished), done
    stage(whole, name, check=True)
    published = _files(killed / "artifacts" / name / "data")
    assert published == _files(whole / "artifacts" / name / "data")
    assert all(published[f"train/{n}"] == b for n, b in kept.items())
    assert not (killed / "artifacts" / f"{name}.tmp").exists()
    data_lost.record(len(finished) - min(count, len(finished)), "finished shards encoded again after the kill")
    assert data_lost.total == 0


@pytest.mark.reliability(case="11.6", title="a stopped trajectory generation leaves no temp file behind",
                         injected="the temp files a SIGTERM mid-write leaves (a record's .shard-00001.json.tmp-<pid>, "
                                  "a shard's .shard-00001.parquet.tmp, the summary's .trajectories.json.tmp-<pid>) beside "
                                  "a set whose shard 1 was not finished; the generation run again",
                         expect="no temp file left; the set equals an uninterrupted run's, byte for byte")
def test_a_stopped_trajectory_generation_leaves_no_temp_file(tmp_path, tiny_base, data_lost):
    from distillery.data.demo import make_demo_latents
    from distillery.models.registry import load_inference_model
    from distillery.sampling.trajectories import TrajectorySettings, generate_trajectories

    source = make_demo_latents(tmp_path / "prompts", num_samples=4, rows_per_shard=4)
    teacher = load_inference_model(tiny_base, "cpu")
    settings = TrajectorySettings("digest", (999.0, 937.0, 833.0, 624.0, 0.0), 2, 4.0, 0, 2, 4, 2, teacher.schedule.shift,
                                  (8, 3, 8, 8), 8)
    generate_trajectories(teacher, source, tmp_path / "whole", settings)
    stopped = tmp_path / "stopped"
    generate_trajectories(teacher, source, stopped, settings)
    for unfinished in ("shard-00001.json", "shard-00001.parquet"):
        (stopped / "train" / unfinished).unlink()
    leftovers = [stopped / "train" / f".shard-00001.json.tmp-{os.getpid()}", stopped / "train" / ".shard-00001.parquet.tmp",
                 stopped / f".trajectories.json.tmp-{os.getpid() + 1}"]
    for leftover in leftovers:
        leftover.write_bytes(b"half")
    report = generate_trajectories(teacher, source, stopped, settings)
    assert report.shards_made == 1
    left = [p.name for p in stopped.rglob(".*tmp*")]
    assert not left, left
    assert _files(stopped) == _files(tmp_path / "whole")
    data_lost.record(len(left), "temp files left behind")
    assert json.loads((stopped / "trajectories.json").read_text())["rows"] == 8
    assert data_lost.total == 0
