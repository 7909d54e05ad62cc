"""Sequence parallelism (``training.distributed.sp_size``, Ulysses) and tensor parallelism (``tp_size``) on gloo CPU
ranks against one process.

- every method (SFT, DFSFT, KD, DMD2, Self-Forcing and its causal KV-cache rollout, PDD, DM-PDD; activation
  checkpointing on some; SFT and Self-Forcing with a block-sparse student) at world 2 = 1 data rank × sp 2: the losses
  and gradient norms of each step and the weights at the end are one process's, within fp32 tolerance; Wan 2.2's
  per-token timesteps (TI2V-5B) and two experts (A14B) too; SFT, DFSFT, DMD2, Self-Forcing and PDD at tp 2 likewise;
- world 4 = 2 data ranks × sp 2 (FSDP2, and HSDP: ``replicate × shard × sp``) is one process with the global batch;
  sp 2 × tp 2 is one process;
- a run stopped at sp 2 resumes at sp 2 bit for bit, at sp 1 (resharded) and the reverse, within tolerance; one
  stopped at tp 2 resumes at tp 1, and the reverse;
- refusals before any model loads: heads that do not split, a group larger than the node or not dividing the
  world, a method that cannot take SP, a LoRA under TP;
- the collectives alone: the Ulysses attention of a padded sequence is plain attention, its gradients too.

All world-2 runs are one torchrun launch (tests/torchrun_each.py), the world-4 ones another.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import dcp_tensors, read_log, role_state, run_config, torchrun_command, train_in_process, write_config
from torchrun_each import torchrun_each

from distillery.common.errors import UserError

STEPS = 3
STOP = 1
CLIP = {"grad_clip": {"_target_": "distillery.callbacks.grad_clip.GradClipCallback", "max_grad_norm": 1.0}}
WAN = "distillery.models.wan.WanModel"
CAUSAL = "distillery.models.wan.CausalWanModel"


def _method(name: str, base: Path, data: Path, trajectories: Path, out: Path, batch_size: int = 2) -> dict:
    """The run config of ``name`` over the tiny Wan (3 latent frames of 4 × 4 tokens: 48 tokens, 4 heads); ``<method>_sparse``:
    its student with block-sparse attention (frame tiles of 2 × 2 tokens, half of those it may attend kept)."""
    if name.endswith("_sparse"):
        cfg = _method(name[:-len("_sparse")], base, data, trajectories, out, batch_size)
        cfg["models"]["student"].update(attention="sparse", sparsity=0.5, sparse_tile=[1, 2, 2])
        return cfg
    if name == "kd":
        data = trajectories
    targets = {"sft": "distillery.methods.sft.SFTMethod", "sft_ac": "distillery.methods.sft.SFTMethod",
               "dfsft": "distillery.methods.dfsft.DFSFTMethod", "kd": "distillery.methods.kd.KDMethod",
               "dmd2": "distillery.methods.dmd2.DMD2Method", "self_forcing": "distillery.methods.self_forcing.SelfForcingMethod",
               "pdd": "distillery.methods.pdd.PDDMethod", "dm_pdd": "distillery.methods.dm_pdd.DMPDDMethod"}
    knobs = {"sft": {"caption_dropout": 0.25}, "sft_ac": {}, "dfsft": {"chunk_size": 2}, "kd": {"chunk_size": 2},
             "dmd2": {"generator_update_interval": 2, "real_score_guidance_scale": 2.0, "check_rank_agreement": True},
             "self_forcing": {"generator_update_interval": 2, "real_score_guidance_scale": 2.0, "context_noise": 50.0,
                              "check_rank_agreement": True},
             "pdd": {"rollout": "simulate", "block_size_min": 2, "block_size_max": 4, "teacher_guidance_scale": 2.0,
                     "sampling_steps": 2},
             "dm_pdd": {"rollout": "simulate", "block_size_min": 2, "block_size_max": 4, "teacher_guidance_scale": 2.0,
                        "sampling_steps": 2, "dm_weight": 0.5, "generator_update_interval": 2}}[name]
    cfg = run_config(base, data, out, method=targets[name], method_knobs=knobs, steps=STEPS, batch_size=batch_size,
                     callbacks=dict(CLIP))
    models = cfg["models"]
    if name in ("dfsft", "kd", "self_forcing"):  # the causal student: chunks of 2 latent frames (3 frames: 2 + 1)
        models["student"] = {"_target_": CAUSAL, "init_from": str(base), "chunk_size": 2}
    if name in ("pdd", "dm_pdd"):
        models["student"] = {"_target_": "distillery.models.wan.PDDWanModel", "init_from": str(base), "pdd_steps": 4}
    if name in ("dmd2", "self_forcing", "dm_pdd"):
        models["critic"] = {"_target_": WAN, "init_from": str(base), "optimizer": {"learning_rate": 2e-4, "betas": [0.0, 0.999]}}
    if name in ("dmd2", "self_forcing", "pdd", "dm_pdd"):
        models["teacher"] = {"_target_": WAN, "init_from": str(base), "trainable": False}
    if name in ("sft_ac", "self_forcing"):  # every block recomputed (diffusers'), half of them (ours)
        cfg["training"]["model"] = {"activation_checkpointing": True,
                                    "activation_checkpointing_fraction": 1.0 if name == "self_forcing" else 0.5}
    return cfg


METHODS = ("sft", "sft_ac", "dfsft", "kd", "dmd2", "self_forcing", "pdd", "dm_pdd", "sft_sparse", "self_forcing_sparse")
TP_METHODS = ("sft", "dfsft", "dmd2", "self_forcing", "pdd")
# world 4: (method, layout, training.distributed, the one-process run it equals)
FOUR = (("sft", "dp2-sp2", {"sp_size": 2}, "one-b4"), ("self_forcing", "hsdp-sp2", {"sp_size": 2, "replicate_size": 2}, "one-b4"),
        ("sft", "sp2-tp2", {"sp_size": 2, "tp_size": 2}, "one"), ("self_forcing", "sp2-tp2", {"sp_size": 2, "tp_size": 2}, "one"))


def _sp(cfg: dict, sp: int, **distributed) -> dict:
    cfg["training"]["distributed"] = {"sp_size": sp, **distributed}
    return cfg


def _stopped(cfg: dict) -> dict:
    cfg["training"]["loop"]["stop_at_step"] = STOP
    return cfg


def _resumed_from(cfg: dict, checkpoint: Path) -> dict:
    cfg["training"]["checkpoint"]["resume"] = str(checkpoint)
    return cfg


def _trajectories(base: Path, data: Path, out: Path) -> Path:
    from distillery.models.registry import load_inference_model
    from distillery.sampling.trajectories import TrajectorySettings, generate_trajectories

    teacher = load_inference_model(base, "cpu")
    settings = TrajectorySettings("digest", (999.0, 937.0, 833.0, 624.0, 0.0), 2, 4.0, 0, 1, 8, 4, teacher.schedule.shift,
                                  (8, 3, 8, 8), 8)
    generate_trajectories(teacher, data, out, settings)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_base, latent_set):
    """``<root>/<case>``: one process in this interpreter; every world-2 run in one launch, the world-4 ones in another."""
    from distillery.data.demo import make_demo_latents
    from distillery.tinybase.wan22 import TI2V_Z_DIM, make_tiny_wan22

    root = tmp_path_factory.mktemp("sp")
    traj = _trajectories(tiny_base, latent_set, root / "trajectories")
    wan22 = {layout: make_tiny_wan22(root / f"wan22-{layout}", layout) for layout in ("ti2v", "a14b")}
    wan22_data = {"ti2v": make_demo_latents(root / "ti2v-latents", channels=TI2V_Z_DIM), "a14b": latent_set}

    def method(name: str, out: str, batch_size: int = 2) -> dict:
        return _method(name, tiny_base, latent_set, traj, root / out, batch_size)

    def wan22_run(layout: str, out: str) -> dict:
        return run_config(wan22[layout], wan22_data[layout], root / out, steps=STEPS, batch_size=2, callbacks=dict(CLIP))

    two: list[tuple[dict, Path]] = []  # the sp-2 runs first, then the tp-2 ones (a launch's runs of one layout share meshes)
    for name in METHODS:  # one process, and 1 data rank × sp 2
        train_in_process(method(name, f"{name}/one"))
        two.append((_sp(method(name, f"{name}/sp2"), 2), root / f"{name}-sp2.yaml"))
    for layout in wan22:
        train_in_process(wan22_run(layout, f"wan22-{layout}/one"))
        two.append((_sp(wan22_run(layout, f"wan22-{layout}/sp2"), 2), root / f"wan22-{layout}-sp2.yaml"))
    for name in ("sft", "self_forcing"):  # stopped at sp 2 and resumed there, in the launch
        two += [(_stopped(_sp(method(name, f"{name}/resumed"), 2)), root / f"{name}-stopped.yaml"),
                (_sp(method(name, f"{name}/resumed"), 2), root / f"{name}-resumed.yaml")]
    train_in_process(_stopped(method("sft", "sft/one-stopped")))  # stopped at sp 1 (here), resumed at sp 2 (in the launch)
    two.append((_resumed_from(_sp(method("sft", "sft/up"), 2), root / "sft" / "one-stopped" / f"checkpoint-{STOP}"),
                root / "sft-up.yaml"))
    two += [(_sp(method(name, f"{name}/tp2"), 1, tp_size=2), root / f"{name}-tp2.yaml") for name in TP_METHODS]
    two.append((_stopped(_sp(method("sft", "sft/tp-stopped"), 1, tp_size=2)), root / "sft-tp-stopped.yaml"))
    two.append((_resumed_from(_sp(method("sft", "sft/tp-up"), 1, tp_size=2), root / "sft" / "one-stopped" / f"checkpoint-{STOP}"),
                root / "sft-tp-up.yaml"))  # stopped at tp 1 (here), resumed at tp 2
    granted = {**os.environ, "OMP_NUM_THREADS": "1", "DISTILLERY_ALLOWED_CHECKPOINTS": str(root)}
    proc = torchrun_each(two, nproc=2, env=granted)
    (root / "launch-2.log").write_text(proc.stderr)

    os.environ["DISTILLERY_ALLOWED_CHECKPOINTS"] = str(root)
    try:  # the sp-2 (tp-2) checkpoints of STOP resumed in one process (resharded)
        for name, stopped in (("sft", "resumed"), ("self_forcing", "resumed"), ("sft", "tp-stopped")):
            out = "down" if stopped == "resumed" else "tp-down"
            train_in_process(_resumed_from(method(name, f"{name}/{out}"), root / name / stopped / f"checkpoint-{STOP}"))
    finally:
        del os.environ["DISTILLERY_ALLOWED_CHECKPOINTS"]

    four: list[tuple[dict, Path]] = []
    for name, layout, distributed, reference in FOUR:  # 2 data ranks × sp 2 (FSDP2 over 4; HSDP 2 × 2); sp 2 × tp 2
        if reference == "one-b4" and not (root / name / "one-b4").exists():
            train_in_process(method(name, f"{name}/one-b4", batch_size=4))
        cfg = method(name, f"{name}/{layout}")
        cfg["training"]["distributed"] = dict(distributed)
        four.append((cfg, root / f"{name}-{layout}.yaml"))
    proc = torchrun_each(four, nproc=4)
    (root / "launch-4.log").write_text(proc.stderr)
    return root


def _close(a: float, b: float, rel: float = 2e-4, abs_: float = 1e-6) -> bool:
    return abs(a - b) <= abs_ + rel * abs(b)


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """The trained weights agree: on average to 1e-6, every element within 1e-4 — a tenth of the learning rate, the most
    an fp32 rounding difference moves one element: Adam's first steps (``m / (√v + ε)``, ≈ lr · sign(g)) turn the last
    bits of a near-zero gradient element into a visible part of a step (one element in thousands; plain data
    parallelism does the same)."""
    assert a.keys() == b.keys() and a
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    mean = sum((a[k] - b[k]).abs().sum().item() for k in a) / sum(v.numel() for v in a.values())
    assert worst <= 1e-4 and mean <= 1e-6, (worst, mean)


def _same_trajectory(got: Path, want: Path) -> None:
    """Every logged loss and gradient norm of ``got`` is ``want``'s (fp32 tolerance), and so are the trained weights."""
    a, b = read_log(got), read_log(want)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b):
        keys = sorted(k for k in y if k.endswith("loss") or k.startswith("grad_norm/"))
        assert keys and keys == sorted(k for k in x if k.endswith("loss") or k.startswith("grad_norm/")), x["step"]
        assert all(_close(x[k], y[k]) for k in keys), (x["step"], {k: (x[k], y[k]) for k in keys if not _close(x[k], y[k])})
    prefixes = ("roles.",)
    _same_weights(dcp_tensors(got / f"checkpoint-{STEPS}", prefixes), dcp_tensors(want / f"checkpoint-{STEPS}", prefixes))


@pytest.mark.slow
@pytest.mark.parametrize("name", METHODS)
def test_each_method_at_sp_2_is_one_process(runs, name):
    _same_trajectory(runs / name / "sp2", runs / name / "one")


@pytest.mark.slow
def test_the_launch_split_the_sequence(runs):
    log = (runs / "launch-2.log").read_text()
    assert "FSDP2 on mesh (shard_sp 2)" in log and "sequence parallel: 2 ranks per sample" in log
    four = (runs / "launch-4.log").read_text()
    assert "HSDP on mesh (replicate 2 x shard_sp 2)" in four
    assert "FSDP2 on mesh (shard_sp 2), blocks split over tp 2" in four  # sp 2 × tp 2: the data dims are the SP ranks
    assert "FSDP2 on mesh (shard 1), blocks split over tp 2" in log


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ti2v", "a14b"])
def test_wan22_layouts_at_sp_2_are_one_process(runs, layout):
    """TI2V-5B's per-token timesteps are split with the tokens; A14B's two experts each split their sequence."""
    _same_trajectory(runs / f"wan22-{layout}" / "sp2", runs / f"wan22-{layout}" / "one")


@pytest.mark.slow
@pytest.mark.parametrize("name", TP_METHODS)
def test_each_method_at_tp_2_is_one_process(runs, name):
    _same_trajectory(runs / name / "tp2", runs / name / "one")


@pytest.mark.slow
@pytest.mark.parametrize(("name", "layout", "distributed", "reference"), FOUR, ids=[f"{n}-{lay}" for n, lay, _, _ in FOUR])
def test_world_4_layouts_are_one_process(runs, name, layout, distributed, reference):
    """2 data ranks × sp 2 against one process with the global batch, sp 2 × tp 2 against one process."""
    _same_trajectory(runs / name / layout, runs / name / reference)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sft", "self_forcing"])
def test_a_run_stopped_at_sp_2_resumes_there_bit_for_bit(runs, name):
    full, resumed = runs / name / "sp2", runs / name / "resumed"
    assert [r["total_loss"] for r in read_log(resumed)] == [r["total_loss"] for r in read_log(full)]
    prefixes = ("roles.", "optimizers.", "schedulers.", "method.")
    a, b = dcp_tensors(full / f"checkpoint-{STEPS}", prefixes), dcp_tensors(resumed / f"checkpoint-{STEPS}", prefixes)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sft", "self_forcing"])
def test_an_sp_2_checkpoint_resumes_at_sp_1(runs, name):
    saved = json.loads((runs / name / "resumed" / f"checkpoint-{STOP}" / "metadata.json").read_text())
    assert saved["world_size"] == 2
    down = read_log(runs / name / "down")
    assert down[0]["step"] == STOP + 1
    _same_trajectory_tail(runs / name / "down", runs / name / "one")


@pytest.mark.slow
def test_an_sp_1_checkpoint_resumes_at_sp_2(runs):
    _same_trajectory_tail(runs / "sft" / "up", runs / "sft" / "one")


@pytest.mark.slow
def test_a_tp_2_checkpoint_resumes_at_tp_1(runs):
    """The split weights are saved whole (DCP): the norms' scales and the column/row shards put back together."""
    saved = dcp_tensors(runs / "sft" / "tp-stopped" / f"checkpoint-{STOP}", ("roles.student.transformer.blocks.0.attn1.",))
    assert saved["roles.student.transformer.blocks.0.attn1.norm_q.weight"].shape == (128,)  # 4 heads × 32, whole
    assert saved["roles.student.transformer.blocks.0.attn1.to_q.weight"].shape == (128, 128)
    _same_trajectory_tail(runs / "sft" / "tp-down", runs / "sft" / "one")


@pytest.mark.slow
def test_a_tp_1_checkpoint_resumes_at_tp_2(runs):
    """Whole tensors saved by one process are split column/row-wise over the TP group on load."""
    _same_trajectory_tail(runs / "sft" / "tp-up", runs / "sft" / "one")


def _same_trajectory_tail(got: Path, want: Path) -> None:
    a, b = read_log(got), read_log(want)[STOP:]
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert _close(x["total_loss"], y["total_loss"]), (x, y)
    _same_weights(role_state(got / f"checkpoint-{STEPS}"), role_state(want / f"checkpoint-{STEPS}"))


@pytest.mark.slow
def test_the_export_of_an_sp_2_run_is_the_export_of_its_sp_1_twin(runs, tmp_path):
    """The checkpoint holds whole tensors whatever the layout: the same keys, shapes and config as one process's."""
    sp2, one = runs / "pdd" / "sp2" / f"checkpoint-{STEPS}", runs / "pdd" / "one" / f"checkpoint-{STEPS}"
    assert (sp2 / "roles" / "student" / "config.json").read_text() == (one / "roles" / "student" / "config.json").read_text()
    a, b = role_state(sp2), role_state(one)
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    heads_a = dcp_tensors(sp2, ("roles.student.heads.",))
    heads_b = dcp_tensors(one, ("roles.student.heads.",))
    assert heads_a.keys() == heads_b.keys() and heads_a


# -- refusals, before any model loads ------------------------------------------------------------------------------
def test_heads_that_do_not_split_over_the_group_are_refused_from_the_config(tiny_base, latent_set, tmp_path):
    from distillery.config import allowed_prefixes, load_run_config
    from distillery.engine.builder import check_roles_early

    raw = _sp(run_config(tiny_base, latent_set, tmp_path / "run"), 3)
    with pytest.raises(UserError, match=r"sp_size: 3: models.student: .*4 attention heads do not split over 3"):
        check_roles_early(load_run_config(raw=raw, prefixes=allowed_prefixes()))


def test_a_method_that_cannot_take_sp_is_refused(tiny_base, latent_set, tmp_path, monkeypatch):
    from distillery.config import allowed_prefixes, load_run_config
    from distillery.engine.builder import check_roles_early
    from distillery.methods.sft import SFTMethod

    raw = _sp(run_config(tiny_base, latent_set, tmp_path / "run"), 2)
    monkeypatch.setattr(SFTMethod, "sequence_parallel", False)
    with pytest.raises(UserError, match="SFTMethod does not take sequence parallelism"):
        check_roles_early(load_run_config(raw=raw, prefixes=allowed_prefixes()))


def test_a_model_plugin_offers_no_sp_or_tp_unless_it_says_so():
    from distillery.models.base import ModelBase

    assert ModelBase.sequence_parallel_problem(None, 1) is None and ModelBase.tensor_parallel_problem(None, 1) is None
    assert ModelBase.sequence_parallel_problem(None, 2) == "ModelBase does not offer sequence parallelism"
    assert ModelBase.tensor_parallel_problem(None, 2) == "ModelBase does not offer tensor parallelism"


@pytest.mark.parametrize(("sp", "tp", "world", "local", "why"), [
    (2, 1, 1, 1, "sp_size: 2 does not divide the world size 1"),
    (4, 1, 4, 2, "sp_size: a group of 4 ranks is larger than a node's 2 processes"),
    (2, 1, 3, 3, "sp_size: 2 does not divide the world size 3"),
    (4, 1, 12, 6, "sp_size: 4 does not divide the 6 processes per node"),
    (1, 2, 3, 3, "tp_size: 2 does not divide the world size 3"),
    (2, 2, 8, 2, "sp_size × tp_size: a group of 4 ranks is larger than a node's 2 processes")])
def test_sp_and_tp_groups_must_fit_in_a_node(monkeypatch, sp, tp, world, local, why):
    from distillery.components.distributed import check_model_parallel

    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    with pytest.raises(UserError, match=why):
        check_model_parallel(sp, tp, world)
    check_model_parallel(1, 1, world)


def test_tp_refuses_heads_that_do_not_split_and_a_lora(tiny_base, latent_set, tmp_path):
    from distillery.config import allowed_prefixes, load_run_config
    from distillery.engine.builder import check_roles_early

    raw = _sp(run_config(tiny_base, latent_set, tmp_path / "run"), 2, tp_size=4)
    with pytest.raises(UserError, match=r"tp_size: 4: models.student: .*4 attention heads do not split over tp_size 4 × sp_size 2"):
        check_roles_early(load_run_config(raw=raw, prefixes=allowed_prefixes()))
    raw = _sp(run_config(tiny_base, latent_set, tmp_path / "run"), 1, tp_size=2)
    raw["models"]["student"]["lora"] = {"rank": 4, "target_modules": ["to_q", "to_v"]}
    with pytest.raises(UserError, match="models.student trains a LoRA adapter, which tensor parallelism does not split"):
        check_roles_early(load_run_config(raw=raw, prefixes=allowed_prefixes()))


@pytest.mark.process
def test_the_cli_refuses_an_sp_group_larger_than_the_world_in_one_line(tiny_base, latent_set, tmp_path):
    path = write_config(tmp_path / "run.yaml", _sp(run_config(tiny_base, latent_set, tmp_path / "run"), 2))
    proc = subprocess.run([sys.executable, "-m", "distillery.cli.train", "--config", str(path)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].endswith("sp_size: 2 does not divide the world size 1 (nodes x processes per node)")


# -- the collectives alone -----------------------------------------------------------------------------------------
ULYSSES = '''
import sys, torch, torch.distributed as dist
from distillery.components.sequence_parallel import SequenceParallel

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
sp = SequenceParallel(dist.new_group(list(range(world))), world, rank)
torch.manual_seed(0)
b, tokens, heads, dim = 2, int(sys.argv[1]), 4, 8
q, k, v = (torch.randn(b, tokens, heads, dim, requires_grad=True) for _ in range(3))
proj = torch.randn(heads * dim, 5, requires_grad=True)

def attend(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)

def loss(sharded):
    if not sharded:
        return (attend(q, k, v).flatten(2) @ proj).square().mean()
    out = sp.attention(attend, *(sp.shard(t) for t in (q, k, v)), tokens)
    return sp.gather(out.flatten(2) @ proj, tokens).square().mean()

want = loss(False)
want_grads = torch.autograd.grad(want, (q, proj))
got = loss(True)
grads = [g.clone() for g in torch.autograd.grad(got, (q, proj))]
for g in grads:  # what FSDP2 does with a parameter's gradient over the group: the mean
    dist.all_reduce(g)
    g /= world
assert torch.equal(got, want), (got, want)
for g, w in zip(grads, want_grads):
    torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
open(f"ok-{tokens}-{rank}", "w").close()
'''


@pytest.mark.slow
def test_ulysses_attention_of_a_padded_sequence_is_plain_attention_gradients_too(tmp_path):
    script = tmp_path / "ulysses.py"
    script.write_text(ULYSSES)
    for tokens in ("7", "8"):  # 7 over 2 ranks: one pad
        proc = subprocess.run(torchrun_command(2, tmp_path, str(script), tokens), capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (tmp_path / f"ok-{tokens}-0").is_file() and (tmp_path / f"ok-{tokens}-1").is_file()


def test_shard_pads_the_last_rank_and_gather_drops_the_pads():
    """The slices on one rank of a group (no collective): a group of 2 over 5 tokens gives [0, 1, 2] and [3, 4, pad]."""
    from distillery.components.sequence_parallel import SequenceParallel

    x = torch.arange(10.0).reshape(1, 5, 2)
    first, last = SequenceParallel(None, 2, 0), SequenceParallel(None, 2, 1)  # type: ignore[arg-type]
    assert first.padded(5) == 6 and torch.equal(first.shard(x), x[:, :3])
    assert torch.equal(last.shard(x), torch.cat([x[:, 3:], torch.zeros(1, 1, 2)], dim=1))
    assert torch.equal(last.shard(x.transpose(1, 2), dim=2), last.shard(x).transpose(1, 2))

