"""flows/: the dvc.yaml DAG, the Prefect pipeline flow over real DVC repos, the nightly deployment.

Real git + DVC repos in temp dirs, stages that are python one-liners, and a real Prefect API
server started as users start it (``prefect server start`` in a subprocess, one per module; its
scheduler included) for flow runs, schedules, ``serve`` and workers; the test that ``serve``
starts its own server needs none. Fast tests need neither.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

PROJECT_ROOT = Path(__file__).resolve().parent.parent
if str(PROJECT_ROOT) not in sys.path:  # flows/ is a top-level package of the checkout
    sys.path.insert(0, str(PROJECT_ROOT))

for _k, _v in {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "DVC_NO_ANALYTICS": "1",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}.items():
    os.environ[_k] = _v
if "prefect" not in sys.modules:  # a temp PREFECT_HOME, before Prefect reads its settings; gone when the session ends
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="prefect-home-")
    atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], True)

from distillery.pipeline.dvcfile import StageSpec, load_dvc_stages, stage_order  # noqa: E402

PY = sys.executable


# --------------------------------------------------------------------------------------------
# repo builders


def _sh(args: list[str], cwd: Path) -> str:
    import subprocess

    r = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "DVC_NO_ANALYTICS": "1"})
    assert r.returncode == 0, f"{args}: {r.stdout}\n{r.stderr}"
    return r.stdout


def make_dvc_repo(root: Path, stages: dict, params: dict) -> Path:
    """git init + dvc init (analytics off, site cache inside root) + dvc.yaml + params.yaml."""
    root.mkdir(parents=True, exist_ok=True)
    _sh(["git", "init", "-q"], root)
    _sh(["git", "config", "user.email", "test@example.com"], root)
    _sh(["git", "config", "user.name", "test"], root)
    _sh([PY, "-m", "dvc", "init", "-q"], root)
    _sh([PY, "-m", "dvc", "config", "core.analytics", "false"], root)
    _sh([PY, "-m", "dvc", "config", "core.site_cache_dir", str(root / ".dvc-site-cache")], root)
    (root / ".gitignore").write_text(".dvc-site-cache/\n")
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    _sh(["git", "add", "-A"], root)
    _sh(["git", "commit", "-q", "-m", "init"], root)
    return root


def py(code: str) -> str:
    """A stage cmd: ``python -c "<code>"`` (code must not contain double quotes)."""
    assert '"' not in code
    return f'python -c "{code}"'


P = "import yaml,os,json;p=yaml.safe_load(open('params.yaml'));"

PIPELINE_STAGES = {
    # level 0
    "prep": {
        "cmd": py(P + "os.makedirs('data',exist_ok=True);"
                  "open('data/x.txt','w').write('x'*p['prep']['n'])"),
        "params": ["prep.n"],
        "outs": ["data"],
    },
    # level 1: train and report both need prep only, so they may run concurrently
    "train": {
        "cmd": py(P + "os.makedirs('model',exist_ok=True);"
                  "open('model/w.txt','w').write(open('data/x.txt').read()+str(p['train']['lr']));"
                  "json.dump({'loss':{'final':p['train']['lr']/2},'steps':3},open('metrics.json','w'))"),
        "deps": ["data/x.txt"],
        "params": ["train.lr"],
        "outs": ["model"],
        "metrics": [{"metrics.json": {"cache": False}}],
    },
    "report": {
        "cmd": py("import os;open('report.txt','w').write(str(len(os.listdir('data'))))"),
        "deps": ["data"],
        "outs": ["report.txt"],
    },
    # level 2
    "validate": {
        "cmd": py(P + "os.makedirs('val',exist_ok=True);"
                  "open('val/grid.gif','wb').write(b'GIF89a'+bytes(p['validate']['frames']));"
                  "json.dump({'adherence':0.75},open('val/metrics.json','w'))"),
        "deps": ["model/w.txt"],
        "params": ["validate.frames"],
        "outs": ["val/grid.gif"],
        "metrics": [{"val/metrics.json": {"cache": False}}],
    },
}
PIPELINE_PARAMS = {"prep": {"n": 3}, "train": {"lr": 0.1}, "validate": {"frames": 2}}


# --------------------------------------------------------------------------------------------
# fast: the DAG


def test_stage_order_levels_and_specs(tmp_path: Path) -> None:
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(PIPELINE_PARAMS))
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": PIPELINE_STAGES}))
    stages = load_dvc_stages(tmp_path)
    assert stage_order(stages) == [["prep"], ["report", "train"], ["validate"]]
    t = stages["train"]
    assert t.outs == ["model"] and t.metrics == ["metrics.json"] and t.params == ["train.lr"]
    assert t.deps == ["data/x.txt"] and t.upstream == ["prep"]  # dep inside an out
    assert stages["report"].upstream == ["prep"]  # dep equal to an out
    assert stages["validate"].upstream == ["train"]
    assert stages["prep"].upstream == [] and stages["prep"].cmd.startswith("python -c")


def test_stage_order_cycle_foreach_wdir_and_params_files(tmp_path: Path) -> None:
    cyc = {
        "a": StageSpec("a", "x", deps=["c.txt"], outs=["a.txt"]),
        "b": StageSpec("b", "x", deps=["a.txt"], outs=["b.txt"]),
        "c": StageSpec("c", "x", deps=["b.txt"], outs=["c.txt"]),
        "z": StageSpec("z", "x", outs=["z.txt"]),
    }
    with pytest.raises(ValueError, match=r"cycle: a -> c -> b -> a"):
        stage_order(cyc)

    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"size": 4}))
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({
        "vars": [{"root": "artifacts"}],
        "stages": {
            "make": {"foreach": ["cat", "dog"], "do": {
                "cmd": "echo ${item} ${size}", "outs": ["${root}/${item}"]}},
            "merge": {"cmd": ["echo a", "echo b"], "wdir": "sub",
                      "deps": ["../artifacts"], "params": [{"other.yaml": ["k"]}, "size"],
                      "outs": [{"../merged": {"persist": True}}],
                      "plots": [{"plot.csv": {"x": "step"}}]},
        },
    }))
    stages = load_dvc_stages(tmp_path)
    assert stages["make@cat"].outs == ["artifacts/cat"] and stages["make@dog"].cmd == "echo dog 4"
    m = stages["merge"]
    assert m.cmd == "echo a && echo b" and m.deps == ["artifacts"] and m.outs == ["merged"]
    assert m.params == ["other.yaml:k", "size"] and m.plots == ["sub/plot.csv"]
    assert m.upstream == ["make@cat", "make@dog"]  # a dep folder containing outs
    assert stage_order(stages) == [["make@cat", "make@dog"], ["merge"]]


def test_flatten_and_keys() -> None:
    from distillery.common.treeutil import flatten
    from flows.dag import artifact_key

    assert flatten({"a": {"b": 1, "c": [2, 3]}, "d": 4.5}, lists=True) == {
        "a.b": 1, "a.c.0": 2, "a.c.1": 3, "d": 4.5}
    assert flatten({"a": {"b": 1, "c": [2, 3], "e": {}}}) == {"a.b": 1, "a.c": [2, 3], "a.e": {}}  # lists whole, empty kept
    assert flatten({"a": {"b": 1}}, "run") == {"run.a.b": 1} and flatten(7) == {} and flatten(7, "x") == {"x": 7}
    assert artifact_key("distill_dmd2@x", "metrics") == "distill-dmd2-x-metrics"


# --------------------------------------------------------------------------------------------
# slow: real Prefect API + real DVC


@pytest.fixture(scope="module")
def prefect_api(prefect_server: str, tmp_path_factory: pytest.TempPathFactory):
    """This process's Prefect client on the module's real server (see ``prefect_server``)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    home = tmp_path_factory.mktemp("prefect-home")
    with temporary_settings(updates={PREFECT_HOME: str(home), PREFECT_API_URL: prefect_server}):
        yield
        APILogWorker.drain_all(timeout=30)  # send queued logs/events while the server is up
        EventsWorker.drain_all(timeout=30)


def _dvc_lock_stages(repo: Path) -> set[str]:
    return set(yaml.safe_load((repo / "dvc.lock").read_text())["stages"])


def _flow_artifacts(flow_run_id) -> dict[str, object]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as c:
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return {a.key: a for a in arts}


def _task_runs(flow_run_id) -> dict[str, object]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as c:
        runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.name: r for r in runs}


@pytest.mark.slow
def test_pipeline_runs_skips_and_reruns_downstream(prefect_api, tmp_path: Path) -> None:
    from flows.dag import build_pipeline_flow

    repo = make_dvc_repo(tmp_path / "repo", PIPELINE_STAGES, PIPELINE_PARAMS)
    pipeline = build_pipeline_flow(repo, retries=1, retry_delay_seconds=0, timeout_seconds=300)
    assert pipeline.name == "distillery-pipeline"

    # run 1: every stage runs, in dependency order, through DVC
    state = pipeline(return_state=True)
    assert state.is_completed(), state.message
    res = state.result()
    assert {k: v["status"] for k, v in res.items()} == dict.fromkeys(PIPELINE_STAGES, "ran")
    assert _dvc_lock_stages(repo) == set(PIPELINE_STAGES)  # dvc.lock is the truth
    assert res["train"]["metrics"] == {"loss.final": 0.05, "steps": 3}
    assert res["validate"]["metrics"] == {"adherence": 0.75}
    assert (repo / "val/grid.gif").read_bytes().startswith(b"GIF89a")

    runs = _task_runs(state.state_details.flow_run_id)
    assert set(runs) == set(PIPELINE_STAGES)  # one task per stage, named after it
    start = {n: r.start_time for n, r in runs.items()}
    end = {n: r.end_time for n, r in runs.items()}
    assert end["prep"] <= start["train"] and end["prep"] <= start["report"]
    assert end["train"] <= start["validate"]

    arts = _flow_artifacts(state.state_details.flow_run_id)
    assert {"train-metrics", "validate-metrics", "validate-validation-grid"} <= set(arts)
    rows = json.loads(arts["train-metrics"].data)
    assert {r["metric"]: r["value"] for r in rows} == {"loss.final": 0.05, "steps": 3}
    assert arts["train-metrics"].type == "table"
    assert "val/grid.gif" in arts["validate-validation-grid"].data
    assert not any(k.startswith(("prep-", "report-")) for k in arts)  # no metrics, no videos

    # run 2: nothing changed, DVC skips every stage ("Stage ... didn't change, skipping")
    lock_before = (repo / "dvc.lock").read_text()
    res2 = pipeline()
    assert {k: v["status"] for k, v in res2.items()} == dict.fromkeys(PIPELINE_STAGES, "skipped")
    assert (repo / "dvc.lock").read_text() == lock_before
    assert res2["train"]["metrics"] == res["train"]["metrics"]

    # run 3: a changed param reruns that stage and what depends on it, only
    params = {**PIPELINE_PARAMS, "train": {"lr": 0.2}}
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    res3 = pipeline()
    assert {k: v["status"] for k, v in res3.items()} == {
        "prep": "skipped", "report": "skipped", "train": "ran", "validate": "ran"}
    assert res3["train"]["metrics"]["loss.final"] == 0.1
    assert yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["train"]["params"][
        "params.yaml"]["train.lr"] == 0.2


FAIL_STAGES = {
    "ok": {"cmd": py("open('ok.txt','w').write('1')"), "outs": ["ok.txt"]},
    "boom": {
        "cmd": py("import sys;open('attempts.log','a').write('x\\n');"
                  "print('boom is about to fail');sys.exit(3)"),
        "outs": ["boom.txt"],
    },
    "after": {"cmd": py("open('after.txt','w').write('1')"), "deps": ["boom.txt"],
              "outs": ["after.txt"]},
}


@pytest.mark.slow
def test_failing_stage_is_retried_then_fails_the_flow(prefect_api, tmp_path: Path) -> None:
    from flows.dag import PipelineFailedError, build_pipeline_flow

    repo = make_dvc_repo(tmp_path / "repo", FAIL_STAGES, {})
    pipeline = build_pipeline_flow(repo, retries=1, retry_delay_seconds=0, timeout_seconds=300)
    state = pipeline(return_state=True)
    assert state.is_failed()
    with pytest.raises(PipelineFailedError) as err:
        state.result()
    msg = str(err.value)
    assert "stage(s) boom failed" in msg and "not run (upstream failed): after" in msg
    assert "exited with 3" in msg and "boom is about to fail" in msg  # the dvc output tail
    assert (repo / "attempts.log").read_text().count("x") == 2  # 1 try + 1 retry
    runs = _task_runs(state.state_details.flow_run_id)
    assert runs["boom"].run_count == 2 and runs["boom"].state.is_failed()
    assert runs["ok"].state.is_completed()
    assert "after" not in runs or not runs["after"].state.is_completed()
    assert not (repo / "after.txt").exists()

    # retries are for training stages only: boom is not one here, so it runs once
    pipeline = build_pipeline_flow(repo, retries=1, retry_delay_seconds=0,
                                   training_stages={"ok"})
    with pytest.raises(PipelineFailedError):
        pipeline()
    assert (repo / "attempts.log").read_text().count("x") == 3


# --------------------------------------------------------------------------------------------
# slow: real Prefect servers started as users start them, real runners and workers
#
# A flow run has three creators: `run_deployment` (manual), the server's scheduler
# (auto_scheduled, created_by type SCHEDULE) and automations. These tests wait for runs the
# SCHEDULER made. Soonest: an interval schedule of 60 s anchored a few seconds ahead (the
# scheduler's recent-deployments loop, every 5 s, creates the anchor's run at once, and the runner
# prefetches runs due within 10 s); a cron can only fire at the next minute boundary.

HELLO_STAGES = {"hello": {"cmd": py("open('hello.txt','w').write('hi')"), "outs": ["hello.txt"]}}
DEPLOYMENT = "distillery-pipeline/nightly"
SERVER_START_S = 240.0  # a first `prefect server start` migrates its database (~25 s idle)
RUN_WAIT_S = 180.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(tmp: Path, api_url: str | None, **extra: str) -> dict[str, str]:
    """Environment of a user's shell at the checkout: no PYTHONPATH tricks, fresh PREFECT_HOME,
    PREFECT_API_URL only when given; runners/workers poll every 2 s (default 10 s)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
    env.pop("PYTHONPATH", None)
    env.update({"PREFECT_HOME": str(tmp), "PREFECT_RUNNER_POLL_FREQUENCY": "2",
                "PREFECT_WORKER_QUERY_SECONDS": "2", **extra})
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def _spawn(args: list[str], cwd: Path, env: dict[str, str], log: Path):
    """Start ``args`` in its own session as a user's terminal would: SIGINT (Ctrl-C) at its default
    disposition, even when this suite runs as a background job of a non-interactive shell (which
    starts its children with SIGINT ignored, so a Ctrl-C test would wait for nothing)."""
    import signal
    import subprocess

    with open(log, "wb") as f:
        return subprocess.Popen(args, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _end(proc, sig: int | None = None, timeout: float = 60.0) -> int | None:
    """Stop a process we spawned (``sig`` first, then SIGKILL of its group); its exit code."""
    import signal
    import subprocess

    if proc.poll() is None and sig is not None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    rc = proc.poll()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # it and anything it left in its session
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    return rc


def _pid_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _wait_for(check, timeout: float, what: str, proc=None, log: Path | None = None):
    """Poll ``check()`` until truthy; fail naming ``what`` (and the log) on timeout or when
    ``proc`` exits first."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (found := check()):
            return found
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(1.0)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    state = "" if proc is None else f" (process exit code {proc.poll()})"
    pytest.fail(f"no {what} within {timeout:.0f} s{state}\n{tail}")


def _scheduled_completed_runs(api_url: str, **where) -> list:
    """Completed runs of the nightly deployment that the server's scheduler created (and whose
    attributes match ``where``); a failed or crashed one fails the test."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        with get_client(sync_client=True) as c:
            try:
                dep = c.read_deployment_by_name(DEPLOYMENT)
            except Exception:  # noqa: BLE001 — not registered yet
                return []
            runs = c.read_flow_runs()
    runs = [r for r in runs if r.deployment_id == dep.id and r.auto_scheduled
            and r.created_by is not None and r.created_by.type == "SCHEDULE" and r.state is not None
            and all(getattr(r, k) == v for k, v in where.items())]
    for r in runs:  # fail at once, not at the timeout
        if r.state.is_final() and not r.state.is_completed():
            pytest.fail(f"scheduled run {r.name} ended {r.state.name}: {r.state.message}")
    return [r for r in runs if r.state.is_completed()]


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory: pytest.TempPathFactory):
    """`prefect server start` as a user runs it: a subprocess on a free loopback port with its
    own PREFECT_HOME (so its database) in a temp dir; yields its API URL."""
    import signal

    from flows.server import server_answers

    home = tmp_path_factory.mktemp("prefect-server")
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    log = home / "server.log"
    proc = _spawn([str(Path(PY).parent / "prefect"), "server", "start", "--host", "127.0.0.1",
                   "--port", str(port)], home, _env(home, None), log)
    try:
        _wait_for(lambda: server_answers(url), SERVER_START_S, "answer from `prefect server start`",
                  proc, log)
        yield url
    finally:
        _end(proc, signal.SIGTERM)


def test_stage_exit_code_from_dvc_output() -> None:
    from flows.dag import stage_exit_code

    tail = ["Running stage 'train':", "> distillery stage teacher", "error: bad key",
            "ERROR: failed to reproduce 'train': failed to run: distillery stage teacher, exited with 2"]
    assert stage_exit_code(tail) == 2
    assert stage_exit_code(["ERROR: failed to reproduce 'a': failed to run: python -c x, exited with -9"]) == -9
    multi = ["ERROR: failed to reproduce 'a': failed to run: echo 'exited with 2'", "false, exited with 1"]
    assert stage_exit_code(multi) == 1  # a command spanning lines; only the last code counts
    assert stage_exit_code(["ERROR: failed to reproduce 'a': missing dependency x"]) is None
    assert stage_exit_code(["a line that says exited with 2"]) is None


def test_nightly_deployment_defaults(tmp_path: Path) -> None:
    from flows.deploy import nightly_deployment

    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": HELLO_STAGES}))
    dep = nightly_deployment(tmp_path, retries=0)
    assert dep.name == "nightly" and dep.entrypoint == "flows/dag.py:distillery_pipeline"
    assert dep.parameters["repo"] == str(tmp_path.resolve()) and dep.parameters["retries"] == 0
    (sched,) = dep.schedules
    assert sched.schedule.cron == "0 2 * * *" and sched.schedule.timezone in (None, "UTC")


@pytest.mark.slow
def test_serve_without_api_url_starts_workspace_server_and_runs_cron(tmp_path: Path) -> None:
    """README's `python -m flows.deploy serve --repo .` on a fresh machine (no PREFECT_API_URL):
    it starts a persistent server in <repo>/.prefect, a per-minute cron run made by that server's
    scheduler completes, and Ctrl-C stops the server again."""
    import json
    import signal

    from flows.server import server_answers

    repo = make_dvc_repo(tmp_path / "repo", HELLO_STAGES, {})
    log = tmp_path / "serve.log"
    env = _env(tmp_path / "user-prefect-home", None, PREFECT_SERVER_API_PORT=str(_free_port()))
    serve = _spawn([PY, "-m", "flows.deploy", "serve", "--repo", str(repo), "--cron", "* * * * *",
                    "--retries", "0"], PROJECT_ROOT, env, log)
    record = repo / ".prefect" / "server.json"
    server_pid = None
    try:
        def server_recorded():
            if "ephemeral server" in log.read_text(errors="replace"):
                pytest.fail("serve fell back to Prefect's ephemeral server:\n" + log.read_text())
            return record.exists() and json.loads(record.read_text())

        rec = _wait_for(server_recorded, SERVER_START_S, "workspace server record", serve, log)
        url, server_pid = rec["api_url"], rec["pid"]
        assert server_answers(url) and (repo / ".prefect" / "prefect.db").exists()
        runs = _wait_for(lambda: _scheduled_completed_runs(url), RUN_WAIT_S + 60,
                         "completed run made by the scheduler", serve, log)
        assert runs[0].expected_start_time.second == 0  # a cron minute, not a manual run
        assert _dvc_lock_stages(repo) == {"hello"} and (repo / "hello.txt").read_text() == "hi"

        assert _end(serve, signal.SIGINT) == 0, log.read_text()
        assert not server_answers(url) and not _pid_alive(server_pid), "server left running"
        assert not record.exists() and (repo / ".prefect" / "prefect.db").exists()  # history kept
        assert "stopped this workspace's Prefect server" in log.read_text()
    finally:
        _end(serve)
        if server_pid is not None and _pid_alive(server_pid):
            os.killpg(server_pid, signal.SIGKILL)  # the server serve started, in its own session


@pytest.mark.slow
def test_serve_says_in_one_line_when_the_server_cannot_start(tmp_path: Path) -> None:
    """A workspace server that fails to start (here: its database path cannot be created) ends
    `serve` with one `error:` line naming the server log, exit code 2, and no process left."""
    import subprocess

    repo = make_dvc_repo(tmp_path / "repo", HELLO_STAGES, {})
    env = _env(tmp_path / "home", None, PREFECT_SERVER_API_PORT=str(_free_port()),
               PREFECT_SERVER_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{tmp_path}/no/such/dir/x.db")
    r = subprocess.run([PY, "-m", "flows.deploy", "serve", "--repo", str(repo)], cwd=PROJECT_ROOT,
                       env=env, capture_output=True, text=True, timeout=240)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stdout + r.stderr
    assert lines[-1].startswith("error: the Prefect server for ") and "server.log" in lines[-1]
    assert "Traceback" not in r.stderr and not (repo / ".prefect" / "server.json").exists()


@pytest.mark.slow
def test_served_deployment_run_made_by_scheduler_completes(prefect_server: str,
                                                           tmp_path: Path) -> None:
    """`serve` against a server the user started (PREFECT_API_URL set): a run the scheduler
    creates from a per-minute schedule executes in the serving process and completes."""
    import datetime
    import signal

    repo = make_dvc_repo(tmp_path / "repo", HELLO_STAGES, {})
    anchor = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=20)
    code = ("import datetime,sys;from prefect.schedules import Interval;"
            "from flows.deploy import serve_nightly;"
            "a=datetime.datetime.fromisoformat(sys.argv[2]);"
            "serve_nightly(sys.argv[1],schedule=Interval(60,anchor_date=a),retries=0)")
    log = tmp_path / "serve.log"
    serve = _spawn([PY, "-c", code, str(repo), anchor.isoformat()], PROJECT_ROOT,
                   _env(tmp_path / "home", prefect_server), log)
    try:
        runs = _wait_for(lambda: _scheduled_completed_runs(prefect_server), RUN_WAIT_S,
                         "completed run made by the scheduler", serve, log)
        late = (runs[0].expected_start_time - anchor).total_seconds()
        assert late >= 0 and late % 60 == pytest.approx(0, abs=1e-3)  # on the schedule's grid
        assert _dvc_lock_stages(repo) == {"hello"}
        assert not (repo / ".prefect").exists()  # PREFECT_API_URL set: no server of our own
        assert _end(serve, signal.SIGINT) == 0, log.read_text()
    finally:
        _end(serve)


@pytest.mark.slow
def test_worker_runs_work_pool_deployment(prefect_server: str, tmp_path: Path) -> None:
    """`deploy --work-pool` + `prefect worker start --pool` (a real process worker in a
    subprocess): the worker picks up the run the scheduler made and completes it."""
    import datetime
    import signal

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.schedules import Interval
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.workers.process import ProcessWorker

    from flows.deploy import deploy_nightly

    repo = make_dvc_repo(tmp_path / "repo", HELLO_STAGES, {})
    anchor = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=15)
    with temporary_settings(updates={PREFECT_API_URL: prefect_server}):
        with get_client(sync_client=True) as c:
            c.create_work_pool(WorkPoolCreate(
                name="test-pool", type="process",
                base_job_template=ProcessWorker.get_default_base_job_template()))
        dep_id = deploy_nightly(repo, "test-pool", schedule=Interval(60, anchor_date=anchor),
                                retries=0)
        with get_client(sync_client=True) as c:
            dep = c.read_deployment(dep_id)
    assert dep.work_pool_name == "test-pool" and dep.entrypoint == "flows/dag.py:distillery_pipeline"

    log = tmp_path / "worker.log"
    worker = _spawn([str(Path(PY).parent / "prefect"), "worker", "start", "--pool", "test-pool"],
                    tmp_path, _env(tmp_path / "home", prefect_server), log)
    try:
        runs = _wait_for(lambda: _scheduled_completed_runs(prefect_server, work_pool_name="test-pool"),
                         RUN_WAIT_S, "completed run picked up by the worker", worker, log)
        assert runs[0].deployment_id == dep_id
        assert _dvc_lock_stages(repo) == {"hello"} and (repo / "hello.txt").read_text() == "hi"
        assert "test-pool" in log.read_text()
    finally:
        _end(worker, signal.SIGINT)


USER_ERROR = "error: training.loop.max_train_steps: expected an int, got 'ten'"
STAGE_SCRIPT = f"""import sys, yaml
open('attempts.log', 'a').write('x\\n')
code = yaml.safe_load(open('params.yaml'))['exit_code']
print('training starts')
if code == 2:
    sys.stderr.write({USER_ERROR!r} + '\\n')  # what distillery's run_guarded prints
else:
    print('Traceback (most recent call last): a crash')
sys.exit(code)
"""


@pytest.mark.slow
def test_user_error_stage_is_not_retried_but_a_crash_is(prefect_server: str,
                                                        tmp_path: Path) -> None:
    """DESIGN §2.2: a stage exiting 2 runs once and its `error:` line shows once (the CLI ends
    with one `error:` line, exit 2); a stage exiting 1 is retried `--retries` times."""
    import subprocess

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "stage.py").write_text(STAGE_SCRIPT)
    stages = {"train": {"cmd": "python stage.py", "deps": ["stage.py"], "params": ["exit_code"],
                        "outs": ["model.txt"]}}
    make_dvc_repo(repo, stages, {"exit_code": 2})

    def run_cli() -> tuple[int, str, str, int]:
        (repo / "attempts.log").unlink(missing_ok=True)
        r = subprocess.run([PY, "-m", "flows.dag", "--repo", str(repo), "--retries", "2",
                            "--retry-delay", "0"], cwd=PROJECT_ROOT, capture_output=True,
                           text=True, timeout=300, env=_env(tmp_path / "home", prefect_server))
        return r.returncode, r.stdout + r.stderr, r.stderr, (repo / "attempts.log").read_text().count("x")

    rc, out, err, attempts = run_cli()
    assert (rc, attempts) == (2, 1), out
    assert out.count(USER_ERROR.removeprefix("error: ")) == 1, out  # not per attempt, not per wrapper
    assert "Retry" not in out
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "train" in last and "user error" in last

    (repo / "params.yaml").write_text(yaml.safe_dump({"exit_code": 1}))
    rc, out, _, attempts = run_cli()
    assert (rc, attempts) == (1, 3), out  # 1 try + 2 retries
    assert "Retry 2/2" in out and "exited with 1" in out


@pytest.mark.slow
def test_stage_timeout_stops_the_stage(prefect_api, tmp_path: Path) -> None:
    import time

    from flows.dag import PipelineFailedError, build_pipeline_flow

    stages = {"hang": {
        "cmd": py("import os,time;open('pid.txt','w').write(str(os.getpid()));time.sleep(120)"),
        "outs": ["never.txt"]}}
    repo = make_dvc_repo(tmp_path / "repo", stages, {})
    pipeline = build_pipeline_flow(repo, retries=0, timeout_seconds=4)
    with pytest.raises(PipelineFailedError, match="(?i)timeout|timed out"):
        pipeline()
    pid = int((repo / "pid.txt").read_text())
    for _ in range(50):  # the stage's process group was terminated
        if not _pid_alive(pid):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"stage process {pid} still alive after the timeout")


@pytest.mark.slow
def test_a_workspace_held_by_another_dvc_run_is_one_line_not_a_retried_crash(prefect_server: str,
                                                                              tmp_path: Path) -> None:
    """Issue 46 item 7: `dvc repro` in a shell and the flow started at once in one workspace. DVC refuses the
    second with "'<out>' is busy, it is being blocked by: (PID n): dvc repro" (its rwlock, which
    --wait-for-lock does not queue on): the flow says in one line which run holds what, and does not
    retry it as a crash. The holder is a real live process named in DVC's own rwlock file."""
    import subprocess

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "stage.py").write_text(STAGE_SCRIPT)
    stages = {"train": {"cmd": "python stage.py", "deps": ["stage.py"], "params": ["exit_code"],
                        "outs": ["model.txt"]}}
    make_dvc_repo(repo, stages, {"exit_code": 0})
    holder = subprocess.Popen(["sleep", "300"])
    try:
        (repo / ".dvc" / "tmp").mkdir(parents=True, exist_ok=True)
        rwlock = {"write": {str(repo / "model.txt"): {"pid": holder.pid, "cmd": "dvc repro"}}, "read": {}}
        (repo / ".dvc" / "tmp" / "rwlock").write_text(json.dumps(rwlock))
        r = subprocess.run([PY, "-m", "flows.dag", "--repo", str(repo), "--retries", "2", "--retry-delay", "0"],
                           cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300,
                           env=_env(tmp_path / "home", prefect_server))
    finally:
        holder.kill()
        holder.wait()
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert f"another DVC run in this workspace holds {repo / 'model.txt'} ((PID {holder.pid}): dvc repro)" in out, out
    assert "Retry" not in out and not (repo / "attempts.log").exists()
    assert r.stderr.strip().splitlines()[-1].startswith("error: ")
