"""PDD (src/distillery/methods/pdd.py, models/wan/pdd.py, sampling/pdd.py) on the tiny Wan.

- one step: only the supervised head and the shared trunk get gradients (the other heads, the frozen
  ``proj_out`` and the teacher none); the teacher is queried at the detached ``x̄_k`` the student's own
  heads reach, and the loss is the MSE to its (guided) Euler or midpoint velocity, recomputed here;
- the fused forward is the Δ-weighted sum of the heads; with every head equal to the base projection
  and one head per block, the fused sampler is the teacher's Euler sampler (bitwise);
- config checks at load time; the sampler refuses blocks wider than trained;
- through the trainer: a ``simulate`` run stopped mid-trajectory resumes its carried trajectories and
  its never-supervised heads (no optimizer state) to bitwise the uninterrupted run; the stage's
  export writes the head bank and sampling it gives the trainer's student back.
(2 ranks under FSDP2: tests/test_dmd2.py, in the distillation methods' shared torchrun launch.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import dcp_tensors, nudge_weights, read_log, run_config, train_in_process
from helpers import tiny_raw_batch as raw_batch

from distillery.common.errors import UserError
from distillery.config import allowed_prefixes, load_run_config
from distillery.methods.pdd import PDDConfig, PDDMethod
from distillery.models.base import Conditioning
from distillery.models.schedule import block_partition, block_weights
from distillery.models.wan import WanModel, WanModelConfig
from distillery.models.wan.pdd import HEADS_FILE, PDDWanModel, PDDWanModelConfig
from distillery.sampling import build_sampler

SHIFT = 3.0  # the tiny base's scheduler shift
P = 8  # fine-grid intervals in these tests


@pytest.fixture(scope="module")
def training(tiny_base: Path, latent_set: Path):
    return load_run_config(raw=run_config(tiny_base, latent_set, Path("unused")), prefixes=allowed_prefixes()).training


def make(tiny_base: Path, training, pdd_steps: int = P, **knobs) -> PDDMethod:
    student = PDDWanModel(PDDWanModelConfig(init_from=str(tiny_base), pdd_steps=pdd_steps), "student")
    teacher = WanModel(WanModelConfig(init_from=str(tiny_base), trainable=False), "teacher")
    for model in (student, teacher):
        model.bind_device(torch.device("cpu"))
    nudge_weights(teacher.transformer)  # a teacher that differs from the student's init, so the loss is not ~0
    method = PDDMethod(PDDConfig(**knobs), {"student": student, "teacher": teacher}, training)
    method.on_train_start(torch.device("cpu"))
    method.build_optimizers()
    return method


def teacher_calls(method: PDDMethod) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Record the teacher's forwards: (x, t, text, velocity) each."""
    calls = []

    def hook(module, args, kwargs, output):
        calls.append((kwargs["hidden_states"], kwargs["timestep"], kwargs["encoder_hidden_states"], output[0].detach()))

    method.teacher.transformer.register_forward_hook(hook, with_kwargs=True)
    return calls


@pytest.mark.parametrize("integrator,guidance,head", [("euler", 1.0, 5), ("midpoint", 3.0, 6), ("euler", 2.0, 2)])
def test_one_step_supervises_head_k_and_the_trunk_against_the_teacher(tiny_base, training, integrator, guidance, head):
    method = make(tiny_base, training, integrator=integrator, teacher_guidance_scale=guidance, block_size_max=P)
    start = 2
    draws = iter([start, head - start])  # the block start (a multiple of block_size_min = 1), then k − n
    method.rng.shared_randint = lambda high: next(draws)
    student: PDDWanModel = method.student
    calls = teacher_calls(method)
    raw = raw_batch()
    out = method.single_train_step(raw, step=1)
    method.backward(out)
    calls = list(calls)  # the step's teacher forwards (the checks below call the teacher again)
    n_calls = (1 if integrator == "euler" else 2) * (1 if guidance <= 1.0 else 2)
    assert len(calls) == n_calls
    sigmas = student.fine_sigmas()

    # gradients: head k and the trunk; no other head, not the frozen proj_out, never the teacher
    bank = student.head_bank
    assert [bank.weight[j].grad is not None for j in range(P)] == [j == head for j in range(P)]
    assert [bank.bias[j].grad is not None for j in range(P)] == [j == head for j in range(P)]
    assert float(bank.weight[head].grad.abs().max()) > 0
    assert student.transformer.proj_out.weight.grad is None
    trunk = [p for n, p in student.transformer.named_parameters() if not n.startswith("proj_out")]
    assert all(p.grad is not None for p in trunk)
    assert all(p.grad is None for p in method.teacher.transformer.parameters())

    # the teacher's query: x̄_k (detached) at t_k
    x_k = calls[0][0]
    assert not x_k.requires_grad
    assert torch.allclose(calls[0][1], torch.full_like(calls[0][1], float(sigmas[head] * 1000)))
    x_n = data_noised_to(method, raw, float(sigmas[start]))

    cond = Conditioning(raw["text_embeds"], raw["empty_text_embeds"].expand_as(raw["text_embeds"]))

    def teacher_v(x, sigma):
        t = torch.full((x.shape[0],), float(sigma) * 1000)
        c = method.teacher.predict_noise(x, t, cond, conditional=True).double()
        if guidance <= 1.0:
            return c
        u = method.teacher.predict_noise(x, t, cond, conditional=False).double()
        return u + guidance * (c - u)

    with torch.no_grad():
        v = teacher_v(x_k.float(), sigmas[head])
        if integrator == "midpoint":
            mid = 0.5 * (sigmas[head] + sigmas[head + 1])
            target = teacher_v((x_k.double() + (float(mid) - float(sigmas[head])) * v).float(), mid)
        else:
            target = v
    assert torch.equal(calls[0][2], raw["text_embeds"])
    assert out.losses["pdd_loss"] > 0
    with torch.no_grad():  # x̄_k = x_n + Σ_{j<k} Δ_j head_j(x_n), and head k's prediction, from one forward at x_n
        t_n = torch.full((2,), float(sigmas[start] * 1000))
        heads = student.predict_pdd_heads(x_n, t_n, cond, list(range(start, head + 1))).double()
        x_bar = x_n.double() + sum((sigmas[j + 1] - sigmas[j]).double() * heads[:, j - start] for j in range(start, head))
    torch.testing.assert_close(x_k.double(), x_bar, rtol=1e-5, atol=1e-5)
    pred_k = heads[:, head - start]
    assert float(out.losses["pdd_loss"]) == pytest.approx(float(((pred_k - target) ** 2).mean()), rel=1e-4)
    assert out.metrics["pdd_block_start"] == start and out.metrics["pdd_head"] == head


def data_noised_to(method: PDDMethod, raw: dict, sigma: float) -> torch.Tensor:
    """x_n of the step just run: the data latents noised to σ_n with the batch noise, redrawn from a fresh
    stream of the run's seed (the draws of n and k were replaced, so the noise is the step's first draw)."""
    from distillery.components.rng import BatchRNG

    noise = BatchRNG(method.training.loop.seed).randn(raw["latents"].shape)
    return (1 - sigma) * raw["latents"] + sigma * noise


def test_fused_block_is_the_weighted_sum_and_one_head_per_block_is_euler(tiny_base):
    student = PDDWanModel(PDDWanModelConfig(init_from=str(tiny_base), trainable=False, pdd_steps=P), "student")
    teacher = WanModel(WanModelConfig(init_from=str(tiny_base), trainable=False), "teacher")
    cond = Conditioning(torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1)), None)
    shape = (8, 3, 8, 8)
    # every head the base projection, one head per block: the teacher's Euler sampler at P steps, bitwise
    euler = build_sampler({"sampler": "euler", "shift": SHIFT}).sample(teacher, cond, shape, torch.Generator().manual_seed(0),
                                                                       num_steps=P, guidance_scale=1.0)
    pdd = build_sampler({"sampler": "pdd_fused", "shift": SHIFT, "pdd_steps": P})
    fused = pdd.sample(student, cond, shape, torch.Generator().manual_seed(0), num_steps=P)
    assert torch.equal(euler, fused)
    # heads that differ: a block's fused forward is Σ_k w_k head_k with w_k = Δ_k / ΣΔ, and the sampler advances by it
    with torch.no_grad():  # each head its own change
        for j, w in enumerate(student.head_bank.weight):
            w.add_(0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(j)))
    x = torch.randn(2, *shape, generator=torch.Generator().manual_seed(2))
    t = torch.full((2,), 1000.0)
    with torch.no_grad():
        heads = student.predict_pdd_heads(x, t, cond, list(range(0, 4))).double()
        one = student.predict_pdd_fused(x, t, cond, 0, 4).double()
    w = block_weights(student.fine_sigmas(), 0, 4)
    expected = sum(w[j] * heads[:, j] for j in range(4))
    assert float((heads[:, 0] - heads[:, 3]).abs().max()) > 1e-3  # the heads differ
    torch.testing.assert_close(one, expected, rtol=1e-5, atol=1e-5)
    nodes = block_partition(P, 2)
    assert nodes == [0, 4, 8]
    two = pdd.sample(student, cond, shape, torch.Generator().manual_seed(0), num_steps=2)
    s = student.fine_sigmas()
    x0 = torch.randn((2, *shape), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        x4 = x0 + (s[4] - s[0]) * student.predict_pdd_fused(x0, torch.full((2,), 1000.0), cond, 0, 4)
        x8 = x4 + (s[8] - s[4]) * student.predict_pdd_fused(x4, (s[4] * 1000).expand(2), cond, 4, 8)
    torch.testing.assert_close(two, x8, rtol=0, atol=0)
    assert pdd.nfe(2) == 2 and pdd.nfe(4, guidance_scale=3.0) == 8


def test_load_time_checks(tiny_base, training):
    with pytest.raises(UserError, match="block_size_max: 9 exceeds the student's pdd_steps=8"):
        make(tiny_base, training, block_size_max=9)
    with pytest.raises(UserError, match=r"method\.validation_steps: 1: .*need a 8-interval block of the 8-interval grid;"
                                        r" .*at most 4"):
        make(tiny_base, training, block_size_max=4, validation_steps=[2, 1])
    with pytest.raises(UserError, match="method.sampling_steps: 9: .*9 steps cannot split the 8-interval grid"):
        make(tiny_base, training, sampling_steps=9)
    with pytest.raises(ValueError, match="block_size_min <= block_size_max"):
        PDDConfig(block_size_min=4, block_size_max=2)
    sampler = build_sampler({"sampler": "pdd_fused", "shift": SHIFT, "pdd_steps": 8, "block_size_max": 4})
    assert sampler.partition(2) == [0, 4, 8] and sampler.partition(3) == [0, 2, 5, 8]
    with pytest.raises(UserError, match="need a 8-interval block .* at most 4"):
        sampler.partition(1)
    with pytest.raises(UserError, match="must name pdd_steps"):
        build_sampler({"sampler": "pdd_fused"})
    with pytest.raises(UserError, match="needs a PDD model"):
        teacher = WanModel(WanModelConfig(init_from=str(tiny_base), trainable=False), "teacher")
        sampler.sample(teacher, Conditioning(torch.zeros(1, 8, 32)), (8, 3, 8, 8), torch.Generator(), num_steps=2)


STEPS, STOP = 6, 3


def _config(base: Path, data: Path, out: Path, steps: int = STEPS) -> dict:
    cfg = run_config(base, data, out, method="distillery.methods.pdd.PDDMethod", steps=steps, batch_size=2, lr=1e-3,
                     save_every=1, method_knobs={"rollout": "simulate", "block_size_min": 2, "block_size_max": 4,
                                                 "integrator": "midpoint", "teacher_guidance_scale": 2.0,
                                                 "sampling_steps": 2},
                     callbacks={"ema": {"_target_": "distillery.callbacks.ema.EMACallback", "decay": 0.5}})
    cfg["models"]["student"] = {"_target_": "distillery.models.wan.PDDWanModel", "init_from": str(base), "pdd_steps": 4}
    cfg["models"]["teacher"] = {"_target_": "distillery.models.wan.WanModel", "init_from": str(base), "trainable": False}
    cfg["training"]["loop"]["grad_accum_steps"] = 2  # two carried trajectories, one per accumulation slot
    return cfg


@pytest.fixture(scope="module")
def simulate_runs(tmp_path_factory, tiny_base, latent_set):
    root = tmp_path_factory.mktemp("pdd")
    train_in_process(_config(tiny_base, latent_set, root / "full"))
    stopped = _config(tiny_base, latent_set, root / "resumed")
    stopped["training"]["loop"]["stop_at_step"] = STOP
    train_in_process(stopped)
    train_in_process(_config(tiny_base, latent_set, root / "resumed"))
    return root


@pytest.mark.slow
def test_carried_trajectories_and_untrained_heads_resume_exactly(simulate_runs):
    full, resumed = simulate_runs / "full", simulate_runs / "resumed"
    log = read_log(full)
    # rungs 0, 2 of the 4-interval grid (blocks of 2), one rung per call, two slots: 0 0 | 1 1 | 0 0 per step pair
    assert [r["rollout_rung"] for r in log] == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    slots = host_state(full / f"checkpoint-{STOP}")["slots"]
    assert len(slots) == 2 and all(s is not None and s["rung"] == 1 for s in slots)  # mid-trajectory at the stop
    opt = dcp_tensors(full / "checkpoint-1", ("optimizers.student.state.heads.",))
    trained = {k.split(".")[-2] for k in opt}
    assert trained and trained != {str(j) for j in range(4)}  # some heads had not been supervised: no optimizer state
    got, ref = read_log(resumed), log
    assert [r["total_loss"] for r in got] == [r["total_loss"] for r in ref]
    prefixes = ("roles.", "optimizers.", "schedulers.", "method.")
    a = dcp_tensors(full / f"checkpoint-{STEPS}", prefixes)
    b = dcp_tensors(resumed / f"checkpoint-{STEPS}", prefixes)
    assert a.keys() == b.keys() and any(k.startswith("roles.student.heads.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
    ra, rb = host_state(full / f"checkpoint-{STEPS}"), host_state(resumed / f"checkpoint-{STEPS}")
    assert ra["calls"] == rb["calls"] == 2 * STEPS
    for sa, sb in zip(ra["slots"], rb["slots"]):  # the carried states at the end, bitwise
        assert (sa is None) == (sb is None) and (sa is None or torch.equal(sa["state"], sb["state"]))


def host_state(checkpoint: Path) -> dict:
    """The method's per-rank host state of rank 0 in a checkpoint."""
    from distillery.components.checkpoint.host_state import read_state

    return read_state(checkpoint / "rng", "rank-0")["method_host"]


@pytest.mark.slow
def test_export_writes_the_head_bank_and_samples_the_trained_student(simulate_runs, tiny_base, tmp_path):
    from distillery.export.weights import export_weights
    from distillery.models.wan import load_inference_model

    ckpt = simulate_runs / "full" / f"checkpoint-{STEPS}"
    out = export_weights(ckpt, "student", tmp_path / "model")
    assert (out / HEADS_FILE).is_file()
    heads = dcp_tensors(ckpt, ("roles.student.heads.",))
    plugin = load_inference_model(tmp_path / "model", pdd_steps=4, shift=SHIFT)
    for j in range(4):
        assert torch.equal(plugin.head_bank.weight[j], heads[f"roles.student.heads.weight.{j}"])
    ema_heads = dcp_tensors(ckpt, ("callbacks.ema.student.heads.",))
    assert len(ema_heads) == 8  # the EMA shadow covers the head bank (a trainable module of the role)
    export_weights(ckpt, "student", tmp_path / "ema", ema="ema")
    shadow = load_inference_model(tmp_path / "ema", pdd_steps=4, shift=SHIFT)
    moved = 0
    for j in range(4):
        w = ema_heads[f"callbacks.ema.student.heads.weight.{j}"]
        assert torch.equal(shadow.head_bank.weight[j], w)
        moved += not torch.equal(w, heads[f"roles.student.heads.weight.{j}"])
    assert moved  # the supervised heads' shadows lag their weights (decay 0.5)
    with pytest.raises(UserError, match="asks for pdd_steps=8"):
        load_inference_model(tmp_path / "model", pdd_steps=8, shift=SHIFT)
    (out / HEADS_FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="not a PDD head bank"):
        load_inference_model(tmp_path / "model", pdd_steps=4, shift=SHIFT)


def test_params_yaml_refuses_pdd_blocks_its_sampling_would_need_wider():
    """Before any stage runs: the grid, the trained block sizes, the contract's NFE and validate's NFE curve agree."""
    import yaml

    from distillery.stages.params_schema import validate_params

    params = yaml.safe_load((Path(__file__).resolve().parent.parent / "params.yaml").read_text())
    validate_params(params)  # the shipped defaults fit
    cases = [({"block_size_max": 9}, "params.yaml: pdd.block_size_max: 9: need pdd.block_size_min (1) ≤ block_size_max ≤ "
                                     "pdd.pdd_steps (8)"),
             ({"block_size_max": 4}, "params.yaml: validate.pdd_nfe: 1: 1 NFE samples 8-interval blocks of the 8-interval "
                                     "grid, wider than pdd.block_size_max (4)"),
             ({"sampling_steps": 12}, "params.yaml: pdd.sampling_steps: 12: more NFE than the 8 intervals of pdd.pdd_steps")]
    for change, message in cases:
        bad = {**params, "pdd": {**params["pdd"], **change}}
        with pytest.raises(UserError) as err:
            validate_params(bad)
        assert str(err.value).startswith(message), str(err.value)
