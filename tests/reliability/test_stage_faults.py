"""Faults around the pipeline stages (docs/reliability.md) on a real git + DVC workspace: a second
writer, a killed `dvc repro`, a failing stage, a diverging loss, a worker's user error, a full,
read-only or size-limited disk. Each test works on a copy (``ws``) of the session-scoped
``prepared`` workspace (clips → base → latents; conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from workspace import env, error_lines, kill_all_in, pause_training, read_log_steps, resume_training, set_params, sh, stage, tree_sha, wait_no_processes

pytestmark = pytest.mark.slow

@pytest.mark.reliability(case="8.6", title="one writer per stage",
                         injected="a second `distillery stage teacher` (and a direct `distillery train` on its run folder) "
                                  "while one is training",
                         expect="the second gets one line naming the holder and exits 2; the first finishes intact")
def test_second_writer_is_refused(ws, data_lost):
    steps = 6  # the first run is paused (SIGSTOP) while it holds its locks, so its length does not matter
    set_params(ws, {"teacher.steps": steps})
    first = subprocess.Popen(["distillery", "stage", "teacher"], cwd=ws, env=env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        paused = pause_training(ws, ws / "runs" / "teacher")  # the first run holds its locks while the others try
        # the second stage and the direct `distillery train`, at once (each is refused by a lock the paused first holds)
        second, direct = (subprocess.Popen(cmd, cwd=ws, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                          for cmd in (["distillery", "stage", "teacher"], ["distillery", "train", "--config", "runs/teacher/run.yaml"]))
        second_err, direct_err = (p.communicate(timeout=600)[1] for p in (second, direct))
        assert second.returncode == 2
        assert error_lines(second_err) == [line for line in second_err.splitlines() if line.strip()][-1:]
        assert re.match(r"error: stage teacher is in use by pid \d+", error_lines(second_err)[0])
        assert direct.returncode == 2 and "training output folder runs/teacher is in use by pid" in direct_err
        assert "Traceback" not in second_err + direct_err
        resume_training(paused)
        _, err = first.communicate(timeout=600)
        assert first.returncode == 0, err[-2000:]
    finally:
        if first.poll() is None:
            first.kill()
    logged = read_log_steps(ws / "runs" / "teacher")
    data_lost.record(steps - len(set(logged)), "logged steps missing")
    assert logged == list(range(1, steps + 1))


@pytest.mark.reliability(case="8.6", title="killing dvc kills the training, also under nohup",
                         injected="SIGKILL to a `nohup dvc repro teacher` process alone, mid-training (SIGHUP ignored "
                                  "in every process below it, as nohup leaves it)",
                         expect="no stage, launcher or worker process survives; a rerun resumes and logs each step once")
def test_killing_dvc_leaves_no_orphan(ws, data_lost):
    # Under nohup the stage once took "SIGHUP ignored" as "outlive everything" and kept training after dvc died; the
    # watch rule itself, with and without nohup, is tests/test_procutil.py's.
    set_params(ws, {"teacher.steps": 12})
    proc = subprocess.Popen(["dvc", "repro", "teacher"], cwd=ws, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        deadline = time.time() + 300
        while not (ws / "runs" / "teacher" / "checkpoint-2" / "metadata.json").is_file():
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.01)
        pause_training(ws)  # mid-run for sure, whatever the host's speed (a stopped worker still dies on SIGKILL)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        left = wait_no_processes(ws, timeout=30)
        assert left == [], f"orphans: {left}"
    finally:
        kill_all_in(ws)  # a failure here must not leave a stopped training behind for the rest of the suite
    out = sh(["dvc", "repro", "teacher"], ws)
    assert "resumed from runs/teacher/checkpoint-" in out.stderr
    steps = read_log_steps(ws / "runs" / "teacher")
    data_lost.record(12 - len(set(steps)), "logged steps missing")
    assert steps == list(range(1, 13))


@pytest.mark.reliability(case="8.8", title="a failed stage keeps the last good artifact",
                         injected="point latents.data at a folder whose videos are all corrupt, `dvc repro latents`",
                         expect="the stage fails with one line; artifacts/latents is byte-identical to before; no temp folders")
def test_failed_stage_keeps_previous_artifact(ws, data_lost):
    before = tree_sha(ws / "artifacts" / "latents")
    bad = ws / "bad-data"
    (bad / "videos").mkdir(parents=True)
    lines = []
    for i in range(4):
        (bad / "videos" / f"v{i}.mp4").write_bytes(b"\x00not a video" * 10)
        lines.append(json.dumps({"path": f"videos/v{i}.mp4", "caption": "a red circle moving left on a black background"}))
    (bad / "captions.jsonl").write_text("\n".join(lines) + "\n")
    set_params(ws, {"latents.data": str(bad)})
    out = sh(["dvc", "repro", "latents"], ws, check=False)
    assert out.returncode != 0
    assert len(error_lines(out.stderr)) == 1 and "unusable" in error_lines(out.stderr)[0]
    lost = 0 if (ws / "artifacts" / "latents").is_dir() and tree_sha(ws / "artifacts" / "latents") == before else 1
    data_lost.record(lost, "previous artifacts lost or changed")
    assert lost == 0
    assert not list((ws / "artifacts").glob("*.tmp")) and not list((ws / "artifacts").glob(".*.old-*"))


@pytest.mark.reliability(case="8.10", title="NaN loss stops with one line",
                         injected="teacher.learning_rate 1e12 (the loss diverges to NaN/Inf within a few steps)",
                         expect="exit 2, one line naming the step and the last good checkpoint; no checkpoint at or "
                                "after that step; every saved weight finite")
def test_diverging_loss_stops_cleanly(ws, data_lost):
    set_params(ws, {"teacher.learning_rate": 1.0e12, "teacher.steps": 20, "teacher.save_every": 1})
    out = stage(ws, "teacher")
    assert out.returncode == 2, out.stderr[-2000:]
    errors = error_lines(out.stderr)
    assert len(errors) == 1 and "Traceback" not in out.stderr
    m = re.match(r"error: training diverged at step (\d+): .*(nan|inf)", errors[0])
    assert m, errors
    bad_step = int(m.group(1))
    from distillery.components.checkpoint.manager import list_checkpoints

    saved = [s for s, _ in list_checkpoints(ws / "runs" / "teacher")]
    assert all(s < bad_step for s in saved)
    if saved:
        assert f"runs/teacher/checkpoint-{saved[-1]}" in errors[0]
        import torch
        from helpers import role_state

        assert all(torch.isfinite(t).all() for t in role_state(ws / "runs" / "teacher" / f"checkpoint-{saved[-1]}").values())
    data_lost.record(0 if (ws / "artifacts" / "latents").is_dir() else 1, "input artifacts lost")


@pytest.mark.reliability(case="8.13", title="worker error is one line, exit 2",
                         injected="truncate a latent shard, then `distillery stage teacher`",
                         expect="exit 2 and the worker's one line naming the shard; no torchrun traceback")
def test_worker_user_error_is_one_line(ws):
    shard = sorted((ws / "artifacts" / "latents" / "data" / "train").glob("*.parquet"))[0]
    shard.chmod(0o644)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    out = stage(ws, "teacher")
    assert out.returncode == 2
    errors = error_lines(out.stderr)
    assert len(errors) == 1 and shard.name in errors[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "ChildFailedError" not in out.stderr
    assert wait_no_processes(ws, timeout=30) == []


def _mount_tmpfs(where: Path, *options: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(where)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root/CAP_SYS_ADMIN): {done.stderr.strip()}")


@pytest.mark.reliability(case="8.9", title="disk full, found before the work",
                         injected="artifacts/ on a 1 MiB tmpfs, `distillery stage clips`",
                         expect="exit 2, one line with the bytes needed and free, before any work; nothing left behind")
def test_full_disk_is_found_up_front(ws):
    target = ws / "artifacts"
    import shutil

    shutil.rmtree(target)
    _mount_tmpfs(target, "size=1m")
    try:
        out = stage(ws, "clips")
        assert out.returncode == 2
        errors = error_lines(out.stderr)
        assert len(errors) == 1 and re.search(r"needs at least .* free in .*, only .* left", errors[0]), out.stderr[-2000:]
        assert "Traceback" not in out.stderr and list(target.iterdir()) == []
    finally:
        subprocess.run(["umount", str(target)], check=True)


@pytest.mark.reliability(case="8.9", title="read-only output",
                         injected="artifacts/ mounted read-only, `distillery stage clips`",
                         expect="exit 2, one line 'cannot write … read-only', before any work")
def test_read_only_output_is_found_up_front(ws):
    target = ws / "artifacts"
    import shutil

    shutil.rmtree(target)
    _mount_tmpfs(target, "size=4m", "ro")
    try:
        out = stage(ws, "clips")
        assert out.returncode == 2
        errors = error_lines(out.stderr)
        assert len(errors) == 1 and "cannot write to" in errors[0] and "read-only" in errors[0], out.stderr[-2000:]
        assert "Traceback" not in out.stderr
    finally:
        subprocess.run(["umount", str(target)], check=True)


@pytest.mark.reliability(case="8.9", title="a write that fails mid-artifact",
                         injected="`distillery stage base` under a 64 KiB file-size limit (RLIMIT_FSIZE: EFBIG mid-copy)",
                         expect="exit 2, one line; no artifacts/base.tmp or .base.old-* left; the previous artifacts/base "
                                "byte-identical")
def test_write_failure_mid_artifact_cleans_up(ws, data_lost):
    import resource

    before = tree_sha(ws / "artifacts" / "base")

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    out = subprocess.run(["distillery", "stage", "base"], cwd=ws, env=env(), capture_output=True, text=True,
                         preexec_fn=limit, timeout=600)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = error_lines(out.stderr)
    assert len(errors) == 1 and "size limit" in errors[0] and "Traceback" not in out.stderr
    assert not list((ws / "artifacts").glob("*.tmp")) and not list((ws / "artifacts").glob(".*.old-*"))
    lost = 0 if tree_sha(ws / "artifacts" / "base") == before else 1
    data_lost.record(lost, "previous artifacts lost or changed")
    assert lost == 0


@pytest.mark.reliability(case="10.1", title="the disk fills up during a training stage",
                         injected="runs/ on a 256 MiB tmpfs (the preflight passes); once checkpoint-2 of `distillery stage "
                                  "teacher` exists, another 'job' fills the file system to its last bytes; then the "
                                  "space is freed and the stage rerun",
                         expect="exit 2, one line naming the device problem and the path (no DCP or MLflow traceback); "
                                "checkpoint-2 intact, no partial checkpoint left; the rerun resumes from it and publishes")
def test_disk_full_mid_training_is_one_line_and_resumes(ws, data_lost):
    import os
    import threading
    import time

    from workspace import set_params

    from distillery.components.checkpoint.checksums import verify_checkpoint
    from distillery.components.checkpoint.manager import list_checkpoints

    set_params(ws, {"teacher.steps": 12, "teacher.save_every": 2})
    runs = ws / "runs"
    if runs.exists():
        import shutil

        shutil.rmtree(runs)
    _mount_tmpfs(runs, "size=256m")
    filler = runs / "another-job.bin"
    filled = threading.Event()

    def fill_when_saved() -> None:
        deadline = time.time() + 600
        while time.time() < deadline and not (runs / "teacher" / "checkpoint-2" / "metadata.json").is_file():
            time.sleep(0.01)
        free = os.statvfs(runs).f_bavail * os.statvfs(runs).f_frsize
        with open(filler, "wb") as fh:
            os.posix_fallocate(fh.fileno(), 0, max(free - 4096, 1))
        filled.set()

    try:
        watcher = threading.Thread(target=fill_when_saved, daemon=True)
        watcher.start()
        out = stage(ws, "teacher")
        watcher.join(5)
        assert filled.is_set(), f"the run ended before the disk was filled: {out.stderr[-3000:]}"
        errors = error_lines(out.stderr)
        assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-4000:]
        assert "no space left on the device" in errors[0], errors
        saved = list_checkpoints(runs / "teacher")
        intact = [path for _, path in saved if verify_checkpoint(path) is None]
        lost = data_lost.record(0 if saved and len(intact) == len(saved) else 1, "complete checkpoints damaged or lost")
        assert not list((runs / "teacher").glob(".tmp-checkpoint-*")), "a partial checkpoint was left on the full disk"
        assert not (ws / "artifacts" / "teacher").exists()
        filler.unlink()
        again = stage(ws, "teacher")
        assert again.returncode == 0, again.stderr[-4000:]
        assert "resum" in again.stderr.lower(), again.stderr[-3000:]
        lost += data_lost.record(0 if (ws / "artifacts" / "teacher" / "lineage.json").is_file() else 1, "artifact not published")
        assert lost == 0
    finally:
        subprocess.run(["umount", "-l", str(runs)], check=False)
