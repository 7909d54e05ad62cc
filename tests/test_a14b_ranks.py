"""The new two-expert paths (Wan 2.2 A14B, issue 63 item 2) through the real trainer on 2 gloo ranks under FSDP2:
Self-Forcing (a causal student of two experts, a cache per expert), PDD (a head bank per expert), LoRA on a role of two
experts (SFT) and Phased DMD. Each: 2 ranks × 2 samples end where 1 rank × 4 does (draws, losses, weights), and a
2-rank run stopped mid-way resumes to the uninterrupted run's checkpoint bit for bit. One torchrun launch runs every
2-rank run (a launch and its imports cost more than the tiny runs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import dcp_tensors, read_log, run_config, train_in_process
from torchrun_each import torchrun_each

from distillery.tinybase.wan22 import make_tiny_wan22

pytestmark = pytest.mark.slow

STEPS = 4
STOP = 3
WAN = "distillery.models.wan.WanModel"
CLIP = {"grad_clip": {"_target_": "distillery.callbacks.grad_clip.GradClipCallback", "max_grad_norm": 1.0}}
LADDER = [1000.0, 900.0, 500.0]  # both experts' steps (boundary 875)


def _config(method: str, base: Path, data: Path, out: Path, batch_size: int) -> dict:
    if method == "self_forcing":
        cfg = run_config(base, data, out, method="distillery.methods.self_forcing.SelfForcingMethod", steps=STEPS,
                         batch_size=batch_size, callbacks=CLIP,
                         method_knobs={"generator_update_interval": 2, "real_score_guidance_scale": 3.0,
                                       "real_score_guidance_scale_2": 2.0, "student_timesteps": LADDER,
                                       "context_noise": 50.0, "check_rank_agreement": True})
        cfg["models"]["student"] = {"_target_": "distillery.models.wan.CausalWanModel", "init_from": str(base), "chunk_size": 1}
    elif method == "phased_dmd":
        cfg = run_config(base, data, out, method="distillery.methods.phased_dmd.PhasedDMDMethod", steps=STEPS,
                         batch_size=batch_size, callbacks=CLIP,
                         method_knobs={"generator_update_interval": 1, "real_score_guidance_scale": 3.0,
                                       "student_timesteps": [1000.0, 900.0, 500.0, 250.0], "check_rank_agreement": True})
    elif method == "pdd":
        cfg = run_config(base, data, out, method="distillery.methods.pdd.PDDMethod", steps=STEPS, batch_size=batch_size,
                         callbacks=CLIP, method_knobs={"rollout": "simulate", "block_size_max": 2, "sampling_steps": 2,
                                                       "teacher_guidance_scale": 2.0, "teacher_guidance_scale_2": 1.5})
        cfg["models"]["student"] = {"_target_": "distillery.models.wan.PDDWanModel", "init_from": str(base), "pdd_steps": 4}
    else:  # lora: SFT of both experts' adapters
        cfg = run_config(base, data, out, steps=STEPS, batch_size=batch_size, lr=1e-2, callbacks=CLIP)
        cfg["models"]["student"]["lora"] = {"rank": 4, "alpha": 8, "target_modules": ["to_q", "to_v", "ffn.net.0.proj"]}
    if method in ("self_forcing", "phased_dmd"):
        cfg["models"]["critic"] = {"_target_": WAN, "init_from": str(base), "optimizer": {"learning_rate": 2e-4, "betas": [0.0, 0.999]}}
    if method != "lora":
        cfg["models"]["teacher"] = {"_target_": WAN, "init_from": str(base), "trainable": False}
    return cfg


METHODS = ("self_forcing", "pdd", "lora", "phased_dmd")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    from distillery.data.demo import make_demo_latents

    root = tmp_path_factory.mktemp("a14b-ranks")
    base = make_tiny_wan22(root / "a14b", "a14b")
    data = make_demo_latents(root / "latents")
    launches = []
    for method in METHODS:
        out = root / method
        out.mkdir()
        train_in_process(_config(method, base, data, out / "one", 4))
        stopped = _config(method, base, data, out / "resumed", 2)
        stopped["training"]["loop"]["stop_at_step"] = STOP
        stopped["training"]["checkpoint"]["save_every"] = 1
        launches += [(_config(method, base, data, out / "two", 2), out / "two.yaml"), (stopped, out / "stopped.yaml"),
                     (_config(method, base, data, out / "resumed", 2), out / "resumed.yaml")]
    torchrun_each(launches)
    return root


def _logged(folder: Path) -> list[dict[str, float]]:
    """The run's logged rows without their wall-clock figures (``step_time_s``, ``samples_per_s``)."""
    return [{k: v for k, v in row.items() if not k.endswith("_s")} for row in read_log(folder)]


def _peak_lr(method: str) -> float:
    cfg = _config(method, Path("base"), Path("data"), Path("out"), 2)
    return max([cfg["training"]["optimizer"]["learning_rate"]]
               + [m.get("optimizer", {}).get("learning_rate", 0.0) for m in cfg["models"].values()])


@pytest.mark.parametrize("method", METHODS)
def test_two_ranks_train_what_one_rank_trains(runs, method):
    """The conformance kit's rule (tests/test_method_conformance.py): every logged value (losses, gradient norms, draws,
    phases, heads) to 1e-4; every trained weight of every role to 1e-4 relative or the peak learning rate absolute
    (AdamW moves an element whose gradient is ~0 by about the learning rate, either way as the reduction rounds it) —
    and both experts of the student among them."""
    one, two = _logged(runs / method / "one"), _logged(runs / method / "two")
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(1, STEPS + 1))
    for a, b in zip(two, one, strict=True):
        assert a.keys() == b.keys()
        assert all(a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6) for k in b), (method, b, a)
    a = dcp_tensors(runs / method / "one" / f"checkpoint-{STEPS}", ("roles.",))
    b = dcp_tensors(runs / method / "two" / f"checkpoint-{STEPS}", ("roles.",))
    assert a.keys() == b.keys()
    assert any(k.startswith("roles.student.") and ".transformer_2." in k for k in a)
    assert any(k.startswith("roles.student.transformer.transformer.blocks") for k in a)
    lr = _peak_lr(method)
    far = [k for k in a if not torch.allclose(b[k], a[k], rtol=1e-4, atol=lr)]
    assert not far, f"{method}: 2 ranks differ from 1 in {far[:5]}"


@pytest.mark.parametrize("method", METHODS)
def test_a_stopped_two_rank_run_resumes_bit_for_bit(runs, method):
    assert [r["step"] for r in read_log(runs / method / "resumed")] == list(range(1, STEPS + 1))
    assert _logged(runs / method / "resumed") == _logged(runs / method / "two")
    prefixes = ("roles.", "optimizers.", "schedulers.", "callbacks.", "method.")
    a = dcp_tensors(runs / method / "two" / f"checkpoint-{STEPS}", prefixes)
    b = dcp_tensors(runs / method / "resumed" / f"checkpoint-{STEPS}", prefixes)
    assert a.keys() == b.keys() and any(k.startswith("roles.student.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
