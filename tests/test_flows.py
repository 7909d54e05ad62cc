"""flows/: the dvc.yaml DAG, the Prefect pipeline flow over real DVC repos, the nightly deployment.

Real git + DVC repos in temp dirs, stages that are python one-liners, and a real Prefect API
server (``prefect_test_harness``, one per module). Fast tests need neither.
"""

from __future__ import annotations

import asyncio
import json
import os
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
if "prefect" not in sys.modules:  # a temp PREFECT_HOME, before Prefect reads its settings
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="prefect-home-")

from flows.dag import StageSpec, load_dvc_stages, stage_order  # noqa: E402

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
    from flows.pipeline import artifact_key, flatten_metrics

    assert flatten_metrics({"a": {"b": 1, "c": [2, 3]}, "d": 4.5}) == {
        "a.b": 1, "a.c.0": 2, "a.c.1": 3, "d": 4.5}
    assert artifact_key("distill_dmd2@x", "metrics") == "distill-dmd2-x-metrics"


# --------------------------------------------------------------------------------------------
# slow: real Prefect API + real DVC


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory: pytest.TempPathFactory):
    from prefect.settings import PREFECT_HOME, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    home = tmp_path_factory.mktemp("prefect-home")
    with temporary_settings(updates={PREFECT_HOME: str(home)}):
        with prefect_test_harness(server_startup_timeout=120):
            yield


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
    from flows.pipeline import build_pipeline_flow

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
    from flows.pipeline import PipelineFailedError, build_pipeline_flow

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


@pytest.mark.slow
def test_nightly_deployment_is_scheduled_and_runs(prefect_api, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.deployments import run_deployment
    from prefect.runner import Runner
    from prefect.server.services.scheduler import schedule_deployments
    from prefect.workers.process import ProcessWorker

    from flows.deploy import deploy_nightly, nightly_deployment

    monkeypatch.chdir(PROJECT_ROOT)  # deployments record entrypoints relative to the cwd
    stages = {k: PIPELINE_STAGES[k] for k in ("prep", "report")}
    repo = make_dvc_repo(tmp_path / "repo", stages, PIPELINE_PARAMS)

    # 1. the nightly deployment, registered with the API, schedule "0 2 * * *"
    deployment = nightly_deployment(repo, retries=0)
    assert deployment.entrypoint == "flows/pipeline.py:distillery_pipeline"
    dep_id = deployment.apply()
    dep_filter = DeploymentFilter(id=DeploymentFilterId(any_=[dep_id]))
    with get_client(sync_client=True) as c:
        assert c.read_flow_runs(deployment_filter=dep_filter) == []  # nothing scheduled yet

    # 2. the server's scheduler service (not started by the ephemeral test server) makes runs:
    #    we run one pass of the real service function against the harness database
    asyncio.run(schedule_deployments())
    with get_client(sync_client=True) as c:
        dep = c.read_deployment(dep_id)
        assert dep.name == "nightly" and dep.parameters["repo"] == str(repo.resolve())
        assert [s.schedule.cron for s in dep.schedules] == ["0 2 * * *"]
        scheduled = c.read_flow_runs(deployment_filter=dep_filter)
    assert len(scheduled) >= 3
    for fr in scheduled:
        assert fr.state.is_scheduled() and fr.auto_scheduled
        t = fr.expected_start_time
        assert (t.hour, t.minute, t.second) == (2, 0, 0) and t.utcoffset().total_seconds() == 0
    assert len({fr.expected_start_time.date() for fr in scheduled}) == len(scheduled)

    # 3. a run of the deployment, executed by a runner (what flow.serve starts) in a subprocess
    fr = run_deployment(dep_id, timeout=0)

    async def serve_once() -> None:
        runner = Runner(name="nightly-test", query_seconds=1)
        await runner.aadd_deployment(deployment)
        await runner.start(run_once=True)

    asyncio.run(serve_once())
    with get_client(sync_client=True) as c:
        done = c.read_flow_run(fr.id)
    assert done.state.is_completed(), done.state.message
    assert _dvc_lock_stages(repo) == {"prep", "report"}

    # 4. the work-pool form: deployment on a process pool, code from this checkout
    with get_client(sync_client=True) as c:
        c.create_work_pool(WorkPoolCreate(
            name="test-pool", type="process",
            base_job_template=ProcessWorker.get_default_base_job_template()))
    pool_dep_id = deploy_nightly(repo, "test-pool", cron="30 3 * * 1-5", timezone="Europe/Paris")
    with get_client(sync_client=True) as c:
        pd = c.read_deployment(pool_dep_id)
        assert pd.work_pool_name == "test-pool" and pd.entrypoint == "flows/pipeline.py:distillery_pipeline"
        assert [(s.schedule.cron, s.schedule.timezone) for s in pd.schedules] == [
            ("30 3 * * 1-5", "Europe/Paris")]


@pytest.mark.slow
def test_stage_timeout_stops_the_stage(prefect_api, tmp_path: Path) -> None:
    import time

    from flows.pipeline import PipelineFailedError, build_pipeline_flow

    stages = {"hang": {
        "cmd": py("import os,time;open('pid.txt','w').write(str(os.getpid()));time.sleep(120)"),
        "outs": ["never.txt"]}}
    repo = make_dvc_repo(tmp_path / "repo", stages, {})
    pipeline = build_pipeline_flow(repo, retries=0, timeout_seconds=4)
    t0 = time.monotonic()
    with pytest.raises(PipelineFailedError, match="(?i)timeout|timed out"):
        pipeline()
    assert time.monotonic() - t0 < 60
    pid = int((repo / "pid.txt").read_text())
    for _ in range(50):  # the stage's process group was terminated
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"stage process {pid} still alive after the timeout")
