"""Scale-out on CPU ranks (gloo, real torchrun): HSDP meshes, resharded resume, a multi-node launch on one host.

- **HSDP 2×2**: 4 ranks as a ``(replicate 2, shard 2)`` mesh train the tiny Wan (SFT) to the losses of
  1 rank (1e-5); DMD2 the same, each role on the mesh its config gives it (the frozen teacher sharded
  over all 4 ranks, ``models.teacher.distributed.replicate_size: 1``; student and critic in HSDP).
- **Resharded resume**: a checkpoint saved by 1 rank resumes on 4 (HSDP), one saved by 4 resumes on
  2 and on 1, and the 2-rank continuation resumes on 1 (4 → 2 → 1): every loss is the uninterrupted
  1-rank run's.
- **PDD on a changed world size**: carried trajectories saved mid-way by 1 rank and resumed on 4, or
  saved by 4 and resumed on 1, restart from noise (rung 0, a warning line) — the same losses either way.
- **Two nodes on one host**: the 2-rank part runs as 2 torchrun agents (``--nnodes 2``, one process
  each) meeting at the c10d rendezvous the launching process serves (``distillery.pipeline.launch.launcher``,
  what a training stage runs for ``gpus.nnodes: 2``); a first launch is SIGKILLed (the stage's death)
  once both workers run, and no agent or worker survives it; the next launch removes the worker-error folders
  (torch's logs inside) the killed agents could not.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import read_log, run_config, train_in_process, write_config
from torchrun_each import torchrun_each
from workspace import kill_all_in, wait_no_processes

from distillery.cli.launch import error_folder_prefix
from distillery.config import allowed_prefixes, load_run_config

STEPS, DMD2_STEPS, PDD_STEPS, GLOBAL_BATCH = 6, 4, 3, 4
FROM_ONE, FROM_FOUR, FROM_TWO = 3, 3, 5  # the steps each resume starts from (1 → 4, 4 → 2 and 4 → 1, 2 → 1)
CALLBACKS = {"grad_clip": {"_target_": "distillery.callbacks.grad_clip.GradClipCallback", "max_grad_norm": 1.0},
             "ema": {"_target_": "distillery.callbacks.ema.EMACallback", "decay": 0.9}}


def _sft(base: Path, data: Path, out: Path, ranks: int, replicate: int = 1) -> dict:
    cfg = run_config(base, data, out, steps=STEPS, batch_size=GLOBAL_BATCH // ranks, save_every=3, callbacks=CALLBACKS)
    cfg["training"]["optimizer"].update(lr_scheduler="cosine", warmup_steps=2)
    cfg["method"]["caption_dropout"] = 0.25
    cfg["training"]["distributed"] = {"replicate_size": replicate}
    return cfg


def _dmd2(base: Path, data: Path, out: Path, ranks: int, replicate: int = 1) -> dict:
    cfg = run_config(base, data, out, method="distillery.methods.dmd2.DMD2Method", steps=DMD2_STEPS,
                     batch_size=GLOBAL_BATCH // ranks, method_knobs={"generator_update_interval": 2,
                                                                     "real_score_guidance_scale": 2.0},
                     callbacks={"grad_clip": CALLBACKS["grad_clip"]})
    wan = "distillery.models.wan.WanModel"
    cfg["models"]["critic"] = {"_target_": wan, "init_from": str(base), "optimizer": {"learning_rate": 2e-4}}
    cfg["models"]["teacher"] = {"_target_": wan, "init_from": str(base), "trainable": False,
                                "distributed": {"replicate_size": 1}}  # sharded over every rank: no copy per node
    cfg["training"]["distributed"] = {"replicate_size": replicate}
    return cfg


def _pdd(base: Path, data: Path, out: Path, ranks: int, stop: int | None = None) -> dict:
    cfg = run_config(base, data, out, method="distillery.methods.pdd.PDDMethod", steps=PDD_STEPS, batch_size=GLOBAL_BATCH // ranks,
                     method_knobs={"rollout": "simulate", "block_size_min": 2, "block_size_max": 4,
                                   "teacher_guidance_scale": 2.0, "sampling_steps": 2})
    cfg["models"]["student"] = {"_target_": "distillery.models.wan.PDDWanModel", "init_from": str(base), "pdd_steps": 4}
    cfg["models"]["teacher"] = {"_target_": "distillery.models.wan.WanModel", "init_from": str(base), "trainable": False}
    cfg["training"]["loop"]["stop_at_step"] = stop  # 1: mid-trajectory (rungs 0, 1 of blocks of 2 over 4 intervals)
    return cfg


def _resume_copy(src: Path, dst: Path, step: int) -> Path:
    """``dst``: ``src``'s run folder with its checkpoints after ``step`` removed (the run as it was at ``step``)."""
    shutil.copytree(src, dst)
    for ckpt in dst.glob("checkpoint-*"):
        if int(ckpt.name.split("-")[1]) > step:
            shutil.rmtree(ckpt)
    return dst


def _two_agents(config: Path, cwd: Path) -> subprocess.Popen:
    """This file as a training stage would launch ``gpus: {nnodes: 2, nproc_per_node: 1}`` (:func:`_agents`)."""
    return subprocess.Popen([sys.executable, __file__, "agents", str(config)], cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _running(config: Path) -> list[tuple[int, list[bytes]]]:
    """(pid, argv) of every process whose command line names ``config``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(config).encode() in argv:
            found.append((int(entry.name), argv))
    return found


def _workers(config: Path) -> list[int]:
    """Pids of the training workers (not agents) running ``config``."""
    return [pid for pid, argv in _running(config) if b"distillery.cli.train" in argv and b"distillery.cli.launch" not in argv
            and b"agents" not in argv]


def _error_folders_of_agents(config: Path) -> list[Path]:
    """The worker-error folders (:mod:`distillery.cli.launch`) of the torchrun agents running ``config``."""
    agents = [pid for pid, argv in _running(config) if b"distillery.cli.launch" in argv]
    return sorted(f for pid in agents for f in Path(tempfile.gettempdir()).glob(f"{error_folder_prefix(pid)}*"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_base, latent_set):
    root = tmp_path_factory.mktemp("scale")
    sft, dmd2, pdd = root / "sft", root / "dmd2", root / "pdd"
    for folder in (sft, dmd2, pdd):
        folder.mkdir()
    train_in_process(_sft(tiny_base, latent_set, sft / "one", 1))  # the uninterrupted 1-rank references
    train_in_process(_dmd2(tiny_base, latent_set, dmd2 / "one", 1))
    train_in_process(_pdd(tiny_base, latent_set, pdd / "one_to_four", 1, stop=1))
    _resume_copy(sft / "one", sft / "one_to_four", FROM_ONE)
    four = torchrun_each([(_sft(tiny_base, latent_set, sft / "hsdp", 4, replicate=2), sft / "hsdp.yaml"),
                        (_sft(tiny_base, latent_set, sft / "one_to_four", 4, replicate=2), sft / "one_to_four.yaml"),
                        (_dmd2(tiny_base, latent_set, dmd2 / "hsdp", 4, replicate=2), dmd2 / "hsdp.yaml"),
                        (_pdd(tiny_base, latent_set, pdd / "four_to_one", 4, stop=1), pdd / "four.yaml"),
                        (_pdd(tiny_base, latent_set, pdd / "one_to_four", 4), pdd / "one_to_four.yaml")], nproc=4).stderr
    _resume_copy(sft / "hsdp", sft / "four_to_one", FROM_FOUR)
    train_in_process(_sft(tiny_base, latent_set, sft / "four_to_one", 1))
    train_in_process(_pdd(tiny_base, latent_set, pdd / "four_to_one", 1))

    # 4 → 2 on two agents (--nnodes 2): a first launch killed once its workers run, then the real one
    _resume_copy(sft / "hsdp", sft / "four_to_two", FROM_FOUR)
    two = _sft(tiny_base, latent_set, sft / "four_to_two", 2)
    two["training"]["loop"]["stop_at_step"] = FROM_TWO
    config = write_config(sft / "four_to_two.yaml", two)
    cwd = root / "agents"
    cwd.mkdir()
    killed = _two_agents(config, cwd)
    try:
        deadline = time.time() + 120
        while len(_workers(config)) < 2:
            assert killed.poll() is None and time.time() < deadline, killed.communicate()[1][-3000:]
            time.sleep(0.05)
        orphaned = _error_folders_of_agents(config)  # the kill skips the agents' own removal of these
        torch_logs_inside = all((f / "torch-logs").is_dir() for f in orphaned)  # torch's log folder, not a torchelastic_*
        killed.send_signal(signal.SIGKILL)  # the stage dies: nothing may outlive it
        killed.wait()
        left = wait_no_processes(cwd, timeout=30)
    finally:
        kill_all_in(cwd)
    done = _two_agents(config, cwd)
    _, err = done.communicate(timeout=600)
    assert done.returncode == 0, err[-4000:]
    _resume_copy(sft / "four_to_two", sft / "two_to_one", FROM_TWO)
    train_in_process(_sft(tiny_base, latent_set, sft / "two_to_one", 1))
    return {"root": root, "left_after_kill": left, "agents_log": err, "four_ranks_log": four, "orphaned_folders": orphaned,
            "torch_logs_inside": torch_logs_inside}


def _same_losses(got: list[dict], ref: list[dict], keys: tuple[str, ...], first: int = 1) -> None:
    ref_by_step = {r["step"]: r for r in ref}
    assert [r["step"] for r in got] == list(range(1, len(ref) + 1)) and len(got) >= first
    for r in got:
        for key in keys:
            if key in ref_by_step[r["step"]]:
                assert r[key] == pytest.approx(ref_by_step[r["step"]][key], rel=1e-5, abs=1e-6), (r["step"], key)


@pytest.mark.slow
def test_hsdp_two_by_two_trains_to_the_one_rank_losses(runs):
    sft, dmd2 = runs["root"] / "sft", runs["root"] / "dmd2"
    one = read_log(sft / "one")
    assert one[-1]["total_loss"] < one[0]["total_loss"]
    _same_losses(read_log(sft / "hsdp"), one, ("total_loss", "grad_norm/student", "lr/student"))
    ref = read_log(dmd2 / "one")
    assert any("generator_loss" in r for r in ref) and all("critic_loss" in r for r in ref)
    _same_losses(read_log(dmd2 / "hsdp"), ref, ("total_loss", "critic_loss", "generator_loss", "grad_norm/critic",
                                                "grad_norm/student"))
    log = runs["four_ranks_log"]  # rank 0's placement of each role, from its config
    for role in ("student", "critic"):
        assert f"role {role}: HSDP on mesh (replicate 2 x shard 2)" in log
    assert "role teacher: FSDP2 on mesh (shard 4)" in log


def test_hsdp_meshes_come_from_the_config(tiny_base, latent_set, tmp_path):
    """The run's mesh and a role's own (``models.<role>.distributed``) are what the config says; a size
    that does not divide the world is one line naming the key (a world of one: only 1 divides it)."""
    import torch.distributed as dist

    from distillery.common.errors import UserError
    from distillery.components.distributed import init_distributed, shutdown
    from distillery.engine.builder import place_model

    cfg = _dmd2(tiny_base, latent_set, tmp_path / "x", 1)
    cfg["training"]["distributed"]["shard_single_rank"] = True
    config = load_run_config(raw=cfg, prefixes=allowed_prefixes())
    assert config.models["teacher"].distributed.replicate_size == 1 and config.models["student"].distributed is None
    assert config.models["teacher"].to_plain()["distributed"] == {"replicate_size": 1}
    env = init_distributed(config.training.distributed)
    try:
        assert env.mesh_for(1) is env.mesh and env.mesh.mesh_dim_names == ("shard",)
        with pytest.raises(UserError, match=r"models\.critic\.distributed\.replicate_size: 2 does not divide the world size 1"):
            from distillery.models.wan import WanModel, WanModelConfig

            critic = WanModel(WanModelConfig(init_from=str(tiny_base)), "critic")
            place_model(critic, env, config.training.distributed, config.training.model, replicate_size=2)
        assert dist.get_world_size() == 1
    finally:
        shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("name, start", [("one_to_four", FROM_ONE), ("four_to_one", FROM_FOUR),
                                         ("four_to_two", FROM_FOUR), ("two_to_one", FROM_TWO)])
def test_resharded_resume_has_the_uninterrupted_losses(runs, name, start):
    import json

    sft = runs["root"] / "sft"
    got = read_log(sft / name)
    _same_losses(got, read_log(sft / "one")[: len(got)], ("total_loss", "grad_norm/student", "lr/student"))
    saved_by = {"one_to_four": 1, "four_to_one": 4, "four_to_two": 4, "two_to_one": 2}[name]
    assert json.loads((sft / name / f"checkpoint-{start}" / "metadata.json").read_text())["world_size"] == saved_by
    last = max(int(p.name.split("-")[1]) for p in (sft / name).glob("checkpoint-*"))
    resumed_by = {"one_to_four": 4, "four_to_one": 1, "four_to_two": 2, "two_to_one": 1}[name]
    assert json.loads((sft / name / f"checkpoint-{last}" / "metadata.json").read_text())["world_size"] == resumed_by


@pytest.mark.slow
def test_pdd_trajectories_restart_from_noise_the_same_on_any_world_size(runs):
    pdd = runs["root"] / "pdd"
    up, down = read_log(pdd / "one_to_four"), read_log(pdd / "four_to_one")  # saved by 1 resumed on 4, and the reverse
    assert [r["step"] for r in up] == [r["step"] for r in down] == list(range(1, PDD_STEPS + 1))
    # the 4 rows stagger over the 2 rungs (mean 0.5 every step), also after step 2's restart (the warning below)
    assert [r["rollout_rung"] for r in up] == [r["rollout_rung"] for r in down] == [0.5, 0.5, 0.5]
    assert up[0]["total_loss"] == pytest.approx(down[0]["total_loss"], rel=1e-5)  # before the stop: one trajectory
    for a, b in zip(up[1:], down[1:]):
        assert a["total_loss"] == pytest.approx(b["total_loss"], rel=1e-5, abs=1e-7), a["step"]
    assert "pdd: the checkpoint's carried trajectories were made by 1 rank(s) with 1 slot(s), this run has 4 rank(s)" \
        in runs["four_ranks_log"]


@pytest.mark.slow
def test_two_agents_meet_and_a_killed_launch_leaves_no_process(runs):
    assert runs["left_after_kill"] == []
    assert len(runs["orphaned_folders"]) == 2 and runs["torch_logs_inside"]  # one per killed agent, torch's logs in it
    assert not any(f.exists() for f in runs["orphaned_folders"]), runs["orphaned_folders"]
    assert "launch: local, 2 node(s) x 1 process(es), rendezvous 127.0.0.1:" in runs["agents_log"]
    assert [r["step"] for r in read_log(runs["root"] / "sft" / "four_to_two")] == list(range(1, FROM_TWO + 1))


def test_launch_plans(monkeypatch):
    """What a stage starts for ``gpus``: one local process is the worker itself (no agent); one standalone agent;
    N local agents at one c10d rendezvous the stage serves; one ``srun`` over the Slurm allocation (refused in one
    line outside one, or on another node count)."""
    import sys

    from distillery.common.errors import UserError
    from distillery.pipeline.launch.launcher import plan_launch
    from distillery.pipeline.params.schema import GpusParams

    alone = plan_launch(GpusParams(), ["--config", "runs/teacher/run.yaml"])
    assert alone.commands == [[sys.executable, "-m", "distillery.cli.train", "--config", "runs/teacher/run.yaml"]]
    assert alone.record == {"launcher": "local", "nnodes": 1, "nproc_per_node": 1, "world_size": 1}
    assert not alone.serve_rendezvous
    one = plan_launch(GpusParams(nproc_per_node=2), ["--config", "runs/teacher/run.yaml"])
    assert len(one.commands) == 1 and "--standalone" in one.commands[0] and not one.serve_rendezvous
    assert one.record == {"launcher": "local", "nnodes": 1, "nproc_per_node": 2, "world_size": 2}
    local = plan_launch(GpusParams(nnodes=3), ["--config", "runs/teacher/run.yaml"])
    assert len(local.commands) == 3 and local.serve_rendezvous and local.endpoint.startswith("127.0.0.1:")
    for cmd in local.commands:
        at = cmd.index("--rdzv_endpoint")
        assert cmd[at + 1] == local.endpoint and cmd[cmd.index("--nnodes") + 1] == "3" and "is_host=false" in cmd
        assert cmd[-4:] == ["-m", "distillery.cli.train", "--config", "runs/teacher/run.yaml"]
    assert len({cmd[cmd.index("--rdzv_id") + 1] for cmd in local.commands}) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # agent i on its own GPUs
    gpus = plan_launch(GpusParams(nnodes=2, nproc_per_node=2), ["--config", "x.yaml"])
    assert gpus.envs == [{"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    given = plan_launch(GpusParams(nnodes=2, rdzv_endpoint="10.0.0.1:29400"), ["--config", "x.yaml"])
    assert not given.serve_rendezvous and [("is_host=true" in c) for c in given.commands] == [True, False]
    for var in ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(UserError, match=r"gpus.launcher: slurm, but this stage is not inside a Slurm allocation"):
        plan_launch(GpusParams(nnodes=2, launcher="slurm"), ["--config", "x.yaml"])
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "3")
    with pytest.raises(UserError, match=r"gpus.nnodes: 2, but Slurm job 77 has 3 node\(s\)"):
        plan_launch(GpusParams(nnodes=2, launcher="slurm"), ["--config", "x.yaml"])
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    slurm = plan_launch(GpusParams(nnodes=2, nproc_per_node=4, launcher="slurm"), ["--config", "runs/distill/run.yaml"])
    (cmd,) = slurm.commands
    assert cmd[:6] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--export=ALL"]
    assert "--job-name=distillery-distill" in cmd and slurm.record["slurm_job_id"] == "77" and slurm.serve_rendezvous


def test_resume_key_holds_the_global_batch_not_the_layout():
    from distillery.pipeline.launch.resume_key import config_digest

    def raw(batch: int, replicate: int = 1, teacher_mesh: int | None = None, sp: int = 1, tp: int = 1) -> dict:
        cfg = {"models": {"student": {"_target_": "x"}, "teacher": {"_target_": "x"}}, "method": {"_target_": "m"},
               "training": {"data": {"batch_size": batch},
                            "distributed": {"replicate_size": replicate, "sp_size": sp, "tp_size": tp}}}
        if teacher_mesh:
            cfg["models"]["teacher"]["distributed"] = {"replicate_size": teacher_mesh}
        return cfg

    assert config_digest(raw(16), 1) == config_digest(raw(8), 2) == config_digest(raw(4, 2, 1), 4)
    assert config_digest(raw(16), 2) != config_digest(raw(16), 1)
    # an SP (TP) group trains one sample on several ranks: the global batch counts data ranks only, and a run moved to
    # another group resumes (its checkpoint is resharded: tests/test_model_parallel.py)
    assert config_digest(raw(16), 1) == config_digest(raw(16, sp=2), 2) == config_digest(raw(8, sp=2, tp=2), 8)
    assert config_digest(raw(16, sp=2), 2) != config_digest(raw(16), 2)


def _agents(config: str) -> int:
    """What a training stage runs for ``gpus: {nnodes: 2, nproc_per_node: 1, launcher: local}``."""
    from distillery.common.log import setup_logging
    from distillery.pipeline.launch.launcher import plan_launch, run_launch
    from distillery.pipeline.params.schema import GpusParams

    setup_logging()
    launch = plan_launch(GpusParams(nproc_per_node=1, nnodes=2, launcher="local"), ["--config", config])
    return run_launch(launch, dict(os.environ))


if __name__ == "__main__":
    sys.exit(_agents(sys.argv[2]))
