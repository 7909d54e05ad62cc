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


def pick(method: PDDMethod, *draws: list[float]) -> None:
    """Replace the method's global-batch uniforms (block starts, then heads) by ``draws``, in order."""
    queue = iter(draws)
    method.global_uniforms = lambda rows: next(queue)


def uniforms_for(starts: list[int], heads: list[int]) -> tuple[list[float], list[float]]:
    """The uniforms that draw these block starts (block_size_min 1) and heads on the P-interval grid."""
    return [(n + 0.5) / P for n in starts], [(k - n + 0.5) / (P - n) for n, k in zip(starts, heads)]


@pytest.mark.parametrize("integrator,guidance,head", [("euler", 1.0, 5), ("midpoint", 3.0, 6), ("euler", 2.0, 2)])
def test_one_step_supervises_each_rows_head_and_the_trunk_against_the_teacher(tiny_base, training, integrator, guidance, head):
    method = make(tiny_base, training, integrator=integrator, teacher_guidance_scale=guidance, block_size_max=P)
    starts, heads_k = [2, 4], [head, 7]  # each row its own block start and head
    pick(method, *uniforms_for(starts, heads_k))
    student: PDDWanModel = method.student
    calls = teacher_calls(method)
    raw = raw_batch()
    out = method.single_train_step(raw, step=1)
    method.backward(out)
    calls = list(calls)  # the step's teacher forwards (the checks below call the teacher again)
    n_calls = (1 if integrator == "euler" else 2) * (1 if guidance <= 1.0 else 2)
    assert len(calls) == n_calls
    sigmas = student.fine_sigmas()

    # gradients: the rows' heads and the trunk; no other head, not the frozen proj_out, never the teacher
    bank = student.head_bank
    assert [bank.weight[j].grad is not None for j in range(P)] == [j in heads_k for j in range(P)]
    assert [bank.bias[j].grad is not None for j in range(P)] == [j in heads_k for j in range(P)]
    assert all(float(bank.weight[j].grad.abs().max()) > 0 for j in heads_k)
    assert student.transformer.proj_out.weight.grad is None
    trunk = [p for n, p in student.transformer.named_parameters() if not n.startswith("proj_out")]
    assert all(p.grad is not None for p in trunk)
    assert all(p.grad is None for p in method.teacher.transformer.parameters())

    # the teacher's query: each row's x̄_k (detached) at its t_k
    x_k = calls[0][0]
    assert not x_k.requires_grad
    torch.testing.assert_close(calls[0][1], torch.tensor([float(sigmas[k] * 1000) for k in heads_k]))
    sigma_n = torch.tensor([float(sigmas[n]) for n in starts]).view(2, 1, 1, 1, 1)
    x_n = data_noised_to(method, raw, sigma_n)

    cond = Conditioning(raw["text_embeds"], raw["empty_text_embeds"].expand_as(raw["text_embeds"]))

    def teacher_v(x, sigma):
        t = (sigma.float() * 1000).expand(x.shape[0])
        c = method.teacher.predict_noise(x, t, cond, conditional=True).double()
        if guidance <= 1.0:
            return c
        u = method.teacher.predict_noise(x, t, cond, conditional=False).double()
        return u + guidance * (c - u)

    s_k = sigmas[torch.tensor(heads_k)]
    with torch.no_grad():
        v = teacher_v(x_k.float(), s_k)
        if integrator == "midpoint":
            mid = 0.5 * (s_k + sigmas[torch.tensor(heads_k) + 1])
            target = teacher_v((x_k.double() + (mid - s_k).double().view(2, 1, 1, 1, 1) * v).float(), mid)
        else:
            target = v
    assert torch.equal(calls[0][2], raw["text_embeds"])
    assert out.losses["pdd_loss"] > 0
    with torch.no_grad():  # x̄_k = x_n + Σ_{n ≤ j < k} Δ_j head_j(x_n) per row, and its head k, from one forward at x_n
        t_n = (sigmas[torch.tensor(starts)] * 1000).float()
        every = student.predict_pdd_heads(x_n, t_n, cond).double()  # [B, P, ...]
    for i, (n, k) in enumerate(zip(starts, heads_k)):
        x_bar = x_n[i].double() + sum((sigmas[j + 1] - sigmas[j]).double() * every[i, j] for j in range(n, k))
        torch.testing.assert_close(x_k[i].double(), x_bar, rtol=1e-5, atol=1e-5)
    pred_k = torch.stack([every[i, k] for i, k in enumerate(heads_k)])
    assert float(out.losses["pdd_loss"]) == pytest.approx(float(((pred_k - target) ** 2).mean()), rel=1e-4)
    assert out.metrics["pdd_block_start"] == sum(starts) / 2 and out.metrics["pdd_head"] == sum(heads_k) / 2


def data_noised_to(method: PDDMethod, raw: dict, sigma: torch.Tensor) -> torch.Tensor:
    """x_n of the step just run: the data latents noised to each row's σ_n with the batch noise, redrawn from a
    fresh stream of the run's seed (the draws of n and k were replaced, so the noise is the step's first draw)."""
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


def student_forwards(method: PDDMethod) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Record the student's forwards: (t, text) each."""
    calls = []

    def hook(module, args, kwargs, output):
        calls.append((kwargs["timestep"].detach().clone(), kwargs["encoder_hidden_states"].detach().clone()))

    method.student.transformer.register_forward_hook(hook, with_kwargs=True)
    return calls


def test_carried_rows_walk_staggered_rungs_and_restart_with_the_batchs_prompt(tiny_base, training):
    """Issue 46: every row started together, so a step trained one rung ([0, 0], [1, 1], … per step). Now row g
    starts at rung g mod R and is at (g + c) mod R at its slot's call c: one step trains R rungs."""
    method = make(tiny_base, training, rollout="simulate", block_size_min=2, block_size_max=4)
    rungs, nodes = 4, [0, 2, 4, 6]
    sigmas = method.student.fine_sigmas()
    forwards = student_forwards(method)
    prompts = {}  # row → the prompt its trajectory set out with
    for call in range(6):
        raw = raw_batch(4, seed=call)
        method.single_train_step(raw, step=call + 1)
        if call == 0:  # a fresh slot walks its rows to their offsets first: 3 forwards at rungs 0, 1, 2
            walk, forwards[:] = forwards[:3], forwards[3:]
            for r, (t, _) in enumerate(walk):
                torch.testing.assert_close(t, torch.full((4,), float(sigmas[nodes[r]] * 1000)))
        (t, text), = forwards
        forwards.clear()
        expected = [(g + call) % rungs for g in range(4)]
        torch.testing.assert_close(t, torch.tensor([float(sigmas[nodes[r]] * 1000) for r in expected]))
        for g, r in enumerate(expected):
            if call == 0 or r == 0:  # a fresh trajectory: this call's prompt for the row
                prompts[g] = raw["text_embeds"][g]
            assert torch.equal(text[g], prompts[g]), (call, g)
    assert method.host_state()["slots"][0]["uses"] == 6


def test_two_ranks_plan_and_train_what_one_rank_does(tiny_base, training):
    """FSDP2 needs every rank to project the same heads (with and without a gradient); the per-row starts and
    heads are drawn for the global batch, so each rank knows them all: the two ranks' plans are the one rank's,
    and their rows' losses average to its loss."""
    from distillery.models.wan import WanModel as Teacher

    def build(rank: int, world: int) -> PDDMethod:
        student = PDDWanModel(PDDWanModelConfig(init_from=str(tiny_base), pdd_steps=P), "student")
        teacher = Teacher(WanModelConfig(init_from=str(tiny_base), trainable=False), "teacher")
        for model in (student, teacher):
            model.bind_device(torch.device("cpu"))
        nudge_weights(teacher.transformer)
        method = PDDMethod(PDDConfig(rollout="simulate", block_size_min=1, block_size_max=4), {"student": student, "teacher": teacher},
                           training, rank=rank)
        method.on_train_start(torch.device("cpu"), world_size=world)
        return method

    one, ranks = build(0, 1), [build(r, 2) for r in range(2)]
    for call in range(3):
        raw = raw_batch(4, seed=call)
        plans: dict[int, list] = {0: [], 1: [], -1: []}
        full = one.pdd_step(raw, lambda plan: plans[-1].append(plan) or [])
        halves = [m.pdd_step({k: (v[2 * r:2 * r + 2] if k != "empty_text_embeds" else v) for k, v in raw.items()},
                             lambda plan, r=r: plans[r].append(plan) or []) for r, m in enumerate(ranks)]
        (p1,), (p2,), (ref,) = plans[0], plans[1], plans[-1]
        for p in (p1, p2):
            assert (p.nodes, p.heads, p.ends, p.rungs) == (ref.nodes, ref.heads, ref.ends, ref.rungs)
            assert p.supervised == ref.supervised and p.window == ref.window
        assert len(set(ref.nodes)) > 1  # the rows are on different rungs
        assert (p1.first, p2.first, p1.rows) == (0, 2, 2)
        mean = 0.5 * (float(halves[0].loss.detach()) + float(halves[1].loss.detach()))
        assert mean == pytest.approx(float(full.loss.detach()), rel=1e-5)


def test_guidance_below_one_and_a_missing_empty_prompt_are_refused(tiny_base, training, latent_set, tmp_path):
    """Issue 46: w in (0, 1) was silently the conditional teacher in the targets (and CFG in DM-PDD's real score);
    a latent set without the empty prompt's embedding made the unconditional forward on zeros."""
    with pytest.raises(ValueError, match="teacher_guidance_scale must be >= 1"):
        PDDConfig(teacher_guidance_scale=0.5)
    raw = run_config(tiny_base, latent_set, tmp_path, method="distillery.methods.pdd.PDDMethod",
                     method_knobs={"teacher_guidance_scale": 0.5})
    with pytest.raises(UserError, match=r"method.*teacher_guidance_scale must be >= 1") as err:
        load_run_config(raw=raw, prefixes=allowed_prefixes())
    assert "\n" not in str(err.value)
    method = make(tiny_base, training, teacher_guidance_scale=2.0)
    batch = {k: v for k, v in raw_batch().items() if k != "empty_text_embeds"}
    with pytest.raises(UserError, match=r"has no empty_prompt\.safetensors.*teacher_guidance_scale 2\.0.*zeros are not it"):
        method.single_train_step(batch, step=1)
    make(tiny_base, training, teacher_guidance_scale=1.0).single_train_step(batch, step=1)  # the conditional teacher alone


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
    # rungs 0, 2 of the 4-interval grid (blocks of 2): the two rows of each slot stagger, one on each rung every call
    assert [r["rollout_rung"] for r in log] == [0.5] * STEPS
    slots = host_state(full / f"checkpoint-{STOP}")["slots"]
    assert len(slots) == 2 and all(s is not None and s["uses"] == STOP for s in slots)  # mid-trajectory at the stop
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
    from direct_weights_check import assert_direct_export_is_save_pretrained

    from distillery.export.weights import export_weights
    from distillery.models.wan import load_inference_model

    ckpt = simulate_runs / "full" / f"checkpoint-{STEPS}"
    for ema in (None, "ema"):  # the head bank beside a trunk written without diffusers: save_pretrained's bytes
        assert_direct_export_is_save_pretrained(ckpt, "student", tmp_path / f"direct-{ema}", ema)
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

    from distillery.pipeline.params.loading import validate_params

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
