"""Knowledge distillation (ODE-init, issue 42 item 3): the KD loss and the teacher's trajectories, by hand.

- the loss: ``½ · mean (x̂0 − x_0)²`` on a two-number case written out; a real step of the causal student
  (per-chunk trajectory points, per-frame timesteps) and of a bidirectional one (one point per sample)
  recomputed from what the transformer saw and returned;
- the settings: a ``t_list`` not descending, not ending at 0 or past 1000 is refused by the method's config
  and by ``distillery params check`` (one line, exit 2), by the same rule;
- the trajectories: the integration grid is the teacher's Euler grid with the t_list points added, and the
  recorded states are a hand-written Euler loop with CFG ``u + w (c − u)``; a generation SIGKILLed in the
  middle of a shard and run again leaves the set byte for byte as an uninterrupted run does.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from workspace import copy_stages, shipped_params_text

from distillery.common.errors import UserError
from distillery.components.rng import BatchRNG
from distillery.methods.kd import KDConfig, KDMethod, kd_loss, t_list_problem
from distillery.models.base import Conditioning
from distillery.models.wan import CausalWanModel, CausalWanModelConfig, WanModel, WanModelConfig
from distillery.pipeline.params.schema import trajectory_points

ROOT = Path(__file__).resolve().parents[1]
T_LIST = [999.0, 937.0, 833.0, 624.0, 0.0]
C, T, H, W = 8, 3, 8, 8  # the tiny base's latent of 9×32×32 clips


@pytest.fixture(scope="module")
def training(tiny_base: Path, latent_set: Path):
    from helpers import run_config

    from distillery.config import allowed_prefixes, load_run_config

    return load_run_config(raw=run_config(tiny_base, latent_set, Path("unused")), prefixes=allowed_prefixes()).training


def test_kd_loss_is_half_the_mean_square_on_a_written_out_case():
    pred, target = torch.tensor([[1.0, 3.0]]), torch.tensor([[0.0, 1.0]])
    assert kd_loss(pred, target).item() == 0.5 * (1.0 + 4.0) / 2  # ½ · mean(1², 2²) = 1.25


def _trajectory_batch(b: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"latents": torch.randn(b, len(T_LIST) * C, T, H, W, generator=g), "text_embeds": torch.randn(b, 8, 32, generator=g)}


def _step(method: KDMethod, batch: dict[str, torch.Tensor]):
    calls = []

    def hook(_module, _args, kwargs, output):
        calls.append({"x": kwargs["hidden_states"].detach().clone(), "t": kwargs["timestep"].detach().clone(),
                      "text": kwargs["encoder_hidden_states"].detach().clone(), "v": output[0].detach().clone()})

    handle = method.student.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        out = method.single_train_step(batch, step=1)
    finally:
        handle.remove()
    assert len(calls) == 1
    return out, calls[0]


@pytest.mark.parametrize("chunk_size", [1, 2])
def test_a_causal_kd_step_regresses_each_chunks_trajectory_point_onto_the_end_point(tiny_base, training, chunk_size):
    student = CausalWanModel(CausalWanModelConfig(init_from=str(tiny_base), chunk_size=chunk_size), "student")
    method = KDMethod(KDConfig(t_list=T_LIST, chunk_size=chunk_size), {"student": student}, training)
    batch = _trajectory_batch(3)
    out, call = _step(method, batch)
    # by hand: the draws (one per sample and chunk, from the run's seed), the input each frame gets, its timestep
    chunks = -(-T // chunk_size)
    draws = BatchRNG(training.loop.seed).randint(0, len(T_LIST) - 1, (3, chunks))
    points = batch["latents"].reshape(3, len(T_LIST), C, T, H, W)
    x_t = torch.empty(3, C, T, H, W)
    t = torch.empty(3, T)
    for b in range(3):
        for f in range(T):
            k = int(draws[b, f // chunk_size])
            x_t[b, :, f] = points[b, k, :, f]
            t[b, f] = T_LIST[k]
    assert torch.equal(call["x"].float(), x_t)
    per_token = call["t"].reshape(3, T, -1)  # the Wan forward takes one timestep per token: each frame's repeated
    assert torch.equal(per_token, t[:, :, None].expand_as(per_token))
    assert torch.equal(call["text"].float(), batch["text_embeds"])  # the conditional prompt, no CFG
    x0 = x_t - (t / 1000.0)[:, None, :, None, None] * call["v"].float()
    target = points[:, -1]
    reference = 0.5 * ((x0.double() - target.double()) ** 2).mean()
    torch.testing.assert_close(out.losses["total_loss"].double(), reference, rtol=1e-5, atol=0)
    assert out.losses["total_loss"].requires_grad


def test_a_bidirectional_kd_step_takes_one_point_per_sample(tiny_base, training):
    student = WanModel(WanModelConfig(init_from=str(tiny_base)), "student")
    method = KDMethod(KDConfig(t_list=T_LIST), {"student": student}, training)
    batch = _trajectory_batch(4, seed=1)
    out, call = _step(method, batch)
    draws = BatchRNG(training.loop.seed).randint(0, len(T_LIST) - 1, (4, 1))[:, 0]
    points = batch["latents"].reshape(4, len(T_LIST), C, T, H, W)
    x_t = torch.stack([points[b, int(draws[b])] for b in range(4)])
    t = torch.tensor([T_LIST[int(k)] for k in draws])
    assert torch.equal(call["x"].float(), x_t)
    assert torch.equal(call["t"].float(), t)
    x0 = x_t - (t / 1000.0)[:, None, None, None, None] * call["v"].float()
    reference = 0.5 * ((x0.double() - points[:, -1].double()) ** 2).mean()
    torch.testing.assert_close(out.losses["total_loss"].double(), reference, rtol=1e-5, atol=0)


@pytest.mark.parametrize("t_list, why", [([999, 624, 833, 0], "descending"), ([999, 937, 833, 624], "end at 0"),
                                         ([1001, 500, 0], "[0, 1000]"), ([0], "at least 2"), ([500, 500, 0], "descending")])
def test_a_bad_t_list_is_refused_by_the_config_and_by_params_the_same_way(t_list, why):
    with pytest.raises(ValueError, match=why.replace("[", r"\[").replace("]", r"\]")):
        KDConfig(t_list=t_list)
    assert why in trajectory_points([float(v) for v in t_list]) and t_list_problem([float(v) for v in t_list]) == \
        trajectory_points([float(v) for v in t_list])


def test_the_student_s_chunks_and_the_method_s_must_agree(tiny_base, training):
    causal = CausalWanModel(CausalWanModelConfig(init_from=str(tiny_base), chunk_size=2), "student")
    with pytest.raises(UserError, match="differs from models.student.chunk_size"):
        KDMethod(KDConfig(t_list=T_LIST, chunk_size=1), {"student": causal}, training)
    with pytest.raises(UserError, match="the student is causal"):
        KDMethod(KDConfig(t_list=T_LIST), {"student": causal}, training)
    with pytest.raises(UserError, match="bidirectional"):
        KDMethod(KDConfig(t_list=T_LIST, chunk_size=1), {"student": WanModel(WanModelConfig(init_from=str(tiny_base)), "student")},
                 training)


@pytest.mark.process
@pytest.mark.parametrize("t_list, why", [("[999, 624, 833, 0]", "strictly descending"), ("[999, 937, 833, 624]", "must end at 0"),
                                         ("[1500, 937, 0]", "in [0, 1000]")])
def test_params_check_refuses_a_bad_t_list_in_one_line(tmp_path, t_list, why):
    copy_stages(tmp_path)  # the stage layer: params check reads the recipes' registry beside params.yaml
    params = yaml.safe_load(shipped_params_text())
    params["pretrain"]["t_list"] = yaml.safe_load(t_list)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    proc = subprocess.run([sys.executable, "-m", "distillery.cli.main", "params", "check"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "pretrain.t_list" in lines[0] and why in lines[0], lines[0]


# -- the teacher's trajectories ------------------------------------------------------------------
def test_the_grid_is_the_teacher_s_euler_grid_with_the_t_list_points_added(tiny_base):
    from distillery.models.schedule import FlowMatchSchedule
    from distillery.sampling.trajectories import ode_grid

    sigmas = FlowMatchSchedule(shift=3.0).inference_sigmas(4)
    grid, record = ode_grid(sigmas, tuple(T_LIST), 1000)
    expected = sorted(set(sigmas.tolist()) | {torch.tensor(t / 1000, dtype=torch.float32).item() for t in T_LIST}, reverse=True)
    assert grid == expected and grid[0] == 1.0 and grid[-1] == 0.0
    assert [grid[i] for i in record] == [torch.tensor(t / 1000, dtype=torch.float32).item() for t in T_LIST]
    assert len(grid) == 4 + 1 + 4  # 4 steps' 5 nodes, the 4 points other than 0 added (none was a node)


def test_the_recorded_states_are_a_hand_written_euler_loop_with_cfg(tiny_base):
    from distillery.models.registry import load_inference_model
    from distillery.sampling.trajectories import ode_grid, teacher_trajectory

    teacher = load_inference_model(tiny_base, "cpu")
    grid, record = ode_grid(teacher.schedule.inference_sigmas(3), tuple(T_LIST), 1000)
    g = torch.Generator().manual_seed(3)
    text, negative, noise = torch.randn(2, 8, 32, generator=g), torch.randn(2, 8, 32, generator=g), torch.randn(2, C, T, H, W, generator=g)
    got = teacher_trajectory(teacher, text, negative, noise, grid, record, guidance_scale=4.0)
    x, states = noise.clone(), []
    for i, sigma in enumerate(grid):
        if i in record:
            states.append(x.clone())
        if i == len(grid) - 1:
            break
        t = torch.full((2,), sigma * 1000)
        c = teacher.predict_noise(x, t, Conditioning(text), conditional=True)
        u = teacher.predict_noise(x, t, Conditioning(text, negative), conditional=False)
        x = x + (grid[i + 1] - sigma) * (u + 4.0 * (c - u))
    assert got.shape == (2, len(T_LIST), C, T, H, W)
    torch.testing.assert_close(got, torch.stack(states, dim=1), rtol=0, atol=0)
    assert not torch.equal(got[:, 0], noise)  # 999 is one small step from the noise at 1000, not the noise


GENERATE = '''
import os, signal, sys
from pathlib import Path
from distillery.sampling.trajectories import TrajectorySettings, generate_trajectories
from distillery.models.registry import load_inference_model

base, source, out, kill_at = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
teacher = load_inference_model(base, "cpu")
settings = TrajectorySettings("digest", (999.0, 937.0, 833.0, 624.0, 0.0), 2, 4.0, 0, 2, 4, 2, teacher.schedule.shift,
                              (8, 3, 8, 8), 8)

def on_batch(shard, rows):
    if kill_at != "none" and (shard, rows) == tuple(map(int, kill_at.split(","))):
        os.kill(os.getpid(), signal.SIGKILL)  # mid-shard: its first batch done, nothing of it written

report = generate_trajectories(teacher, source, out, settings, on_batch)
print(report.shards_made, report.rows_made, report.seconds)
'''


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.process
def test_a_generation_killed_mid_shard_resumes_to_the_same_bytes(tmp_path, tiny_base):
    from distillery.data.demo import make_demo_latents

    source = make_demo_latents(tmp_path / "prompts", num_samples=4, rows_per_shard=4)
    script = tmp_path / "generate.py"
    script.write_text(GENERATE)

    def run(out: Path, kill_at: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script), str(tiny_base), str(source), str(out), kill_at],
                              capture_output=True, text=True, timeout=300)

    whole = run(tmp_path / "whole", "none")
    assert whole.returncode == 0, whole.stderr
    assert whole.stdout.split()[:2] == ["2", "8"]  # 4 prompts × 2 seeds in shards of 4
    killed = run(tmp_path / "resumed", "1,2")  # shard 1, after its first batch of 2
    assert killed.returncode == -9
    assert sorted(p.name for p in (tmp_path / "resumed" / "train").glob("*.parquet")) == ["shard-00000.parquet"]
    resumed = run(tmp_path / "resumed", "none")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.split()[:2] == ["1", "4"]  # shard 0 kept, shard 1 made again from its start
    assert _files(tmp_path / "resumed") == _files(tmp_path / "whole")


def test_dfsft_on_a_prompt_only_set_is_refused_at_the_params_check():
    from distillery.pipeline.params.loading import validate_params

    params = yaml.safe_load(shipped_params_text())
    params["pretrain"]["data"] = "prompts"
    with pytest.raises(UserError, match="pretrain.data: prompts: pretrain.method dfsft trains on video latents"):
        validate_params(params)
    params["pretrain"]["method"] = "ode_init"
    assert validate_params(params).pretrain.data == "prompts"
