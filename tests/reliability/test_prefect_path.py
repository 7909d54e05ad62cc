"""Case 11.11: Prefect's printed next step works, and stopping ``serve`` stops a run cleanly (issue 58, item 11).

``python -m flows.deploy serve --repo .`` as README says (no ``PREFECT_API_URL``: it starts this workspace's server),
the line it prints to start a run pasted into another shell (a fresh environment: no ``PREFECT_API_URL``, another
``PREFECT_HOME``), then SIGTERM to ``serve`` while that run's stage works. The helpers are ``tests/test_flows.py``'s
(real git + DVC repos whose stages are python one-liners, a real Prefect server).
"""

from __future__ import annotations

import re
import signal
import sqlite3
import subprocess
from pathlib import Path

import pytest
from test_flows import PY, SERVER_START_S, _end, _env, _free_port, _pid_alive, _spawn, _wait_for, make_dvc_repo, py
from workspace import processes_in

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SLOW_STAGE = {"slow": {"cmd": py("import time;open('started','w').write('1');time.sleep(300);open('done','w')"),
                       "outs": ["done"]}}


def _flow_run_states(repo: Path) -> list[str]:
    """The state of every flow run the workspace server's database holds (read after it stopped)."""
    with sqlite3.connect(repo / ".prefect" / "prefect.db") as con:
        return [row[0] for row in con.execute("SELECT state_type FROM flow_run")]


@pytest.mark.slow
@pytest.mark.reliability(case="11.11", title="Prefect: the printed run command works; SIGTERM to serve cancels the run",
                         injected="`python -m flows.deploy serve --repo .` (no PREFECT_API_URL); the line it prints run "
                                  "as is in a fresh shell; SIGTERM to serve while that run's stage works",
                         expect="the pasted line creates a run the server gives serve; on SIGTERM the run ends "
                                "CANCELLED (not CRASHED), its stage process is gone, no traceback or 'Crash detected', "
                                "the server is stopped and its record kept")
def test_the_printed_prefect_line_works_and_sigterm_cancels_the_run(tmp_path, data_lost):
    repo = make_dvc_repo(tmp_path / "repo", SLOW_STAGE, {})
    log = tmp_path / "serve.log"
    env = _env(tmp_path / "user-prefect-home", None, PREFECT_SERVER_API_PORT=str(_free_port()))
    serve = _spawn([PY, "-m", "flows.deploy", "serve", "--repo", str(repo), "--retries", "0"], PROJECT_ROOT, env, log)
    server_pid = None
    try:
        line = _wait_for(lambda: re.search(r"to start a run from another shell: (.+)", log.read_text(errors="replace")),
                         SERVER_START_S, "the printed run command", serve, log).group(1)
        assert line.startswith("PREFECT_API_URL=http://127.0.0.1:") and line.endswith(
            "prefect deployment run 'distillery-pipeline/nightly'"), line
        _wait_for(lambda: "deployment run" in log.read_text(errors="replace").split(line, 1)[-1], 120,
                  "serve serving", serve, log)
        import json

        server_pid = json.loads((repo / ".prefect" / "server.json").read_text())["pid"]
        shell = _env(tmp_path / "another-shell-home", None)
        shell["PATH"] = f"{Path(PY).parent}:{shell['PATH']}"
        pasted = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=shell, capture_output=True, text=True, timeout=240)
        assert pasted.returncode == 0 and "Created flow run" in pasted.stdout, pasted.stdout + pasted.stderr
        _wait_for(lambda: (repo / "started").exists(), 240, "the run's stage started", serve, log)
        assert _end(serve, signal.SIGTERM, timeout=120) is not None, log.read_text()[-3000:]
        text = log.read_text(errors="replace")
        assert "Traceback" not in text and "Crash detected" not in text, text[-4000:]
        assert not processes_in(repo), "a stage process outlived serve"
        assert server_pid is not None and not _pid_alive(server_pid), "the server was left running"
        assert _flow_run_states(repo) == ["CANCELLED"], (_flow_run_states(repo), text[-3000:])
        assert not (repo / "done").exists()
    finally:
        _end(serve)
        if server_pid is not None and _pid_alive(server_pid):
            import os

            os.killpg(server_pid, signal.SIGKILL)
    data_lost.record(0, "runs left CRASHED")


TWO_STAGES = {"zeta": {"cmd": py("open('z.txt','w').write('z')"), "outs": ["z.txt"]},
              "alpha": {"cmd": py("open('a.txt','w').write('a')"), "outs": ["a.txt"]}}


@pytest.mark.slow
@pytest.mark.reliability(case="11.11", title="Prefect: `python -m flows.dag` keeps its record where one is kept",
                         injected="`python -m flows.dag --repo .` without a server; then with this workspace's "
                                  "server up (`python -m flows.deploy server`) and the stages forced to rerun",
                         expect="without: the summary in dvc.yaml's order and one line saying the record went with "
                                "Prefect's temporary server (and how to keep it); with: the run is in the workspace "
                                "server's database and no such line")
def test_flows_pipeline_runs_on_the_workspace_server_when_one_is_up(tmp_path, data_lost):
    import json
    import os

    repo = make_dvc_repo(tmp_path / "repo", TWO_STAGES, {})
    env = _env(tmp_path / "user-prefect-home", None, PREFECT_SERVER_API_PORT=str(_free_port()))
    alone = subprocess.run([PY, "-m", "flows.dag", "--repo", str(repo), "--retries", "0"], cwd=PROJECT_ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert alone.returncode == 0, alone.stdout + alone.stderr[-3000:]
    assert [line.split()[0] for line in alone.stdout.splitlines()] == ["zeta", "alpha"]  # dvc.yaml's order, not a-z
    assert "was on a temporary server, gone with it" in alone.stderr, alone.stderr[-2000:]
    log = tmp_path / "server.log"
    server = _spawn([PY, "-m", "flows.deploy", "server", "--repo", str(repo)], PROJECT_ROOT, env, log)
    server_pid = None
    try:
        record = repo / ".prefect" / "server.json"
        server_pid = _wait_for(lambda: record.exists() and json.loads(record.read_text()).get("pid"), SERVER_START_S,
                               "the workspace server", server, log)
        for out in ("z.txt", "a.txt"):
            (repo / out).unlink()
        kept = subprocess.run([PY, "-m", "flows.dag", "--repo", str(repo), "--retries", "0"], cwd=PROJECT_ROOT,
                              env=env, capture_output=True, text=True, timeout=600)
        assert kept.returncode == 0 and "temporary server" not in kept.stderr, kept.stdout + kept.stderr[-3000:]
        assert "this workspace's server, already running" in kept.stderr, kept.stderr[-2000:]
        assert _flow_run_states(repo) == ["COMPLETED"]
    finally:
        _end(server, signal.SIGINT)
        if server_pid and _pid_alive(server_pid):
            os.killpg(server_pid, signal.SIGKILL)
    data_lost.record(0, "runs whose record was lost without a word")
