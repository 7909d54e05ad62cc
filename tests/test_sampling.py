"""The sampler registry: every registered sampler builds from a contract and samples a tiny real Wan
through the model plugin; noise sources; the flow-matching helpers of models.schedule."""

from __future__ import annotations

import pytest
import torch

from distillery.common.errors import UserError
from distillery.components.rng import BatchRNG
from distillery.models.base import Conditioning
from distillery.models.schedule import FlowMatchSchedule, renoise, velocity_from_x0, x0_from_velocity
from distillery.models.wan import load_inference_model
from distillery.sampling import GeneratorNoise, RNGNoise, build_sampler, sampler_names
from distillery.tinybase.shipped import shipped_tiny_base

LATENT_SHAPE = (8, 2, 4, 4)  # tiny base: z_dim 8; patch (1, 2, 2)
# One contract per registered sampler: a sampler registered without a case here fails the registry test.
CONTRACTS = {
    "euler": {"sampler": "euler", "shift": 3.0, "num_train_timesteps": 1000, "num_steps": 3},
    "few_step_x0": {"sampler": "few_step_x0", "shift": 3.0, "num_train_timesteps": 1000, "timesteps": [1000.0, 600.0, 250.0]},
    "causal_streaming": {"sampler": "causal_streaming", "shift": 3.0, "num_train_timesteps": 1000,
                         "timesteps": [1000.0, 600.0, 250.0], "chunk_size": 1, "context_noise": 50.0},
    "pdd_fused": {"sampler": "pdd_fused", "shift": 3.0, "num_train_timesteps": 1000, "pdd_steps": 6, "block_size_max": 2,
                  "num_steps": 3},
}
# Forward calls per guidance branch for LATENT_SHAPE: 3 steps; causal_streaming: 2 one-frame chunks × 3 steps + 1 context write.
CALLS_PER_BRANCH = {"causal_streaming": 7}
NFE_ARGS = {"causal_streaming": {"num_frames": LATENT_SHAPE[1]}}


@pytest.fixture(scope="module")
def model():
    return load_inference_model(shipped_tiny_base(), "cpu")


@pytest.fixture(scope="module")
def special_models():
    """The samplers that need another model plugin: a causal Wan (causal_streaming), a PDD Wan (pdd_fused)."""
    from distillery.models.wan import CausalWanModel, CausalWanModelConfig, PDDWanModel, PDDWanModelConfig

    causal = CausalWanModel(CausalWanModelConfig(init_from=str(shipped_tiny_base()), trainable=False, chunk_size=1),
                            role="inference")
    causal.transformer.eval()
    pdd = PDDWanModel(PDDWanModelConfig(init_from=str(shipped_tiny_base()), trainable=False, pdd_steps=6), role="inference")
    pdd.transformer.eval()
    return {"causal_streaming": causal, "pdd_fused": pdd}


def _model_for(name, model, special_models):
    return special_models.get(name, model)


@pytest.fixture(scope="module")
def cond() -> Conditioning:
    g = torch.Generator().manual_seed(11)
    return Conditioning(torch.randn(2, 6, 32, generator=g), torch.randn(2, 6, 32, generator=g))


class ForwardCounter:
    """Counts the transformer's forward calls (a real forward hook, no fakes)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls = 0
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, *args) -> None:
        self.calls += 1

    def __enter__(self) -> "ForwardCounter":
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def test_every_registered_sampler_has_a_case():
    assert set(sampler_names()) == set(CONTRACTS), "add a contract for each new sampler to CONTRACTS"


@pytest.mark.parametrize("name", sorted(CONTRACTS))
@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_registered_sampler_shapes_nfe_and_determinism(model, special_models, cond, name, guidance):
    model = _model_for(name, model, special_models)
    sampler = build_sampler(CONTRACTS[name])
    assert sampler.name == name
    with torch.no_grad(), ForwardCounter(model.transformer) as counter:
        out = sampler.sample(model, cond, LATENT_SHAPE, torch.Generator().manual_seed(0), guidance_scale=guidance)
    assert out.shape == (2, *LATENT_SHAPE) and out.dtype == torch.float32 and torch.isfinite(out).all()
    calls = CALLS_PER_BRANCH.get(name, 3)
    assert counter.calls == sampler.nfe(guidance_scale=guidance, **NFE_ARGS.get(name, {})) == calls * (2 if guidance > 1 else 1)
    with torch.no_grad():
        again = sampler.sample(model, cond, LATENT_SHAPE, torch.Generator().manual_seed(0), guidance_scale=guidance)
        other = sampler.sample(model, cond, LATENT_SHAPE, torch.Generator().manual_seed(1), guidance_scale=guidance)
        rng_a = sampler.sample(model, cond, LATENT_SHAPE, BatchRNG(5), guidance_scale=guidance)
        rng_b = sampler.sample(model, cond, LATENT_SHAPE, RNGNoise(BatchRNG(5)), guidance_scale=guidance)
    assert torch.equal(out, again) and not torch.equal(out, other)
    assert torch.equal(rng_a, rng_b)  # a BatchRNG noise source reruns the same with the same seed


@pytest.mark.parametrize("name", sorted(CONTRACTS))
def test_per_sample_generators_equal_sampling_each_prompt_alone(model, special_models, cond, name):
    """A list of generators (one per sample) draws per sample: a batched run equals per-prompt runs."""
    model = _model_for(name, model, special_models)
    sampler = build_sampler(CONTRACTS[name])
    with torch.no_grad():
        batched = sampler.sample(model, cond, LATENT_SHAPE, [torch.Generator().manual_seed(10 + i) for i in range(2)])
        for i in range(2):
            one = Conditioning(cond.text_embeds[i:i + 1], cond.negative_text_embeds[i:i + 1])
            alone = sampler.sample(model, one, LATENT_SHAPE, torch.Generator().manual_seed(10 + i))
            torch.testing.assert_close(batched[i:i + 1], alone, rtol=0, atol=1e-5)


def test_a_batch_rng_draws_its_ranks_slice(model, cond):
    """Two ranks of a BatchRNG each draw their slice of one global batch: rank r's samples are the
    global batch's rows r·B … (r+1)·B − 1."""
    sampler = build_sampler(CONTRACTS["few_step_x0"])
    text = torch.cat([cond.text_embeds, cond.text_embeds])
    with torch.no_grad():
        whole = sampler.sample(model, Conditioning(text), LATENT_SHAPE, BatchRNG(3))
        rank1 = sampler.sample(model, Conditioning(cond.text_embeds), LATENT_SHAPE, BatchRNG(3, rank=1, world_size=2))
    torch.testing.assert_close(whole[2:], rank1, rtol=0, atol=1e-5)


def test_euler_through_the_plugin_equals_the_direct_computation(model, cond):
    """What sampling/euler.py computed before it went through the plugin: diffusers' σ grid, the raw
    transformer called with diffusers keyword arguments, CFG u + w (c − u), x ← x + (σ_next − σ) v."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    steps, w = 4, 4.0
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(steps)
    x = torch.randn((2, *LATENT_SHAPE), generator=torch.Generator().manual_seed(2))
    noise = x.clone()
    transformer = model.transformer
    with torch.no_grad():
        for i in range(steps):
            t = sched.timesteps[i].float().expand(2)
            c = transformer(hidden_states=x, timestep=t, encoder_hidden_states=cond.text_embeds, return_dict=False)[0]
            u = transformer(hidden_states=x, timestep=t, encoder_hidden_states=cond.negative_text_embeds, return_dict=False)[0]
            x = x + (sched.sigmas[i + 1] - sched.sigmas[i]) * (u + w * (c - u))
        ours = build_sampler(CONTRACTS["euler"]).sample(model, cond, LATENT_SHAPE, None, num_steps=steps,
                                                         guidance_scale=w, initial=noise)
        drawn = build_sampler(CONTRACTS["euler"]).sample(model, cond, LATENT_SHAPE, torch.Generator().manual_seed(2),
                                                          num_steps=steps, guidance_scale=w)
    assert torch.equal(ours, x)
    assert torch.equal(drawn, x)  # the generator draws the same initial noise


def test_contract_defaults_and_the_models_shift(model):
    euler = build_sampler({"sampler": "euler"})
    assert euler.resolve_steps(None) == 40 and euler.resolve_guidance(None) == 1.0
    assert euler.schedule_for(model).shift == model.schedule.shift  # no shift in the contract: the model's
    few = build_sampler({"sampler": "few_step_x0", "shift": 3.0, "num_steps": 2})
    assert few.ladder(few.schedule_for(model)) == [float(t) for t in FlowMatchSchedule(3.0).inference_timesteps(2)]
    assert few.nfe(guidance_scale=4.0) == 4


def test_contract_errors():
    with pytest.raises(UserError) as info:
        build_sampler({"sampler": "heun", "shift": 3.0})
    message = str(info.value)
    assert "\n" not in message and "'heun'" in message and "euler" in message and "few_step_x0" in message
    with pytest.raises(UserError, match="no 'sampler' key"):
        build_sampler({"shift": 3.0})
    with pytest.raises(UserError, match="unknown key 'chunk'"):
        build_sampler({"sampler": "euler", "chunk": 3})
    with pytest.raises(UserError, match="descending"):
        build_sampler({"sampler": "few_step_x0", "timesteps": [250, 600]})
    with pytest.raises(UserError, match="shift must be > 0"):
        build_sampler({"sampler": "euler", "shift": 0})
    with pytest.raises(UserError, match="ladder"):
        build_sampler(CONTRACTS["few_step_x0"]).resolve_steps(2)


def test_flow_helpers_round_trip():
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(2, 3, 4, 2, 2, generator=g), torch.randn(2, 3, 4, 2, 2, generator=g)
    for sigma in (0.3, torch.tensor([0.2, 0.9]), torch.rand(2, 4, generator=g) * 0.9 + 0.05):
        x_t = renoise(x0, eps, sigma)
        v = velocity_from_x0(x_t, x0, sigma)
        torch.testing.assert_close(v, eps - x0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x0_from_velocity(x_t, v, sigma), x0, rtol=1e-5, atol=1e-5)
    # a per-frame σ [B, T] applies frame by frame
    sigma = torch.tensor([[0.1, 0.5, 0.7, 0.9], [0.2, 0.2, 0.2, 0.2]])
    x_t = renoise(x0, eps, sigma)
    torch.testing.assert_close(x_t[0, :, 2], 0.3 * x0[0, :, 2] + 0.7 * eps[0, :, 2])


def test_generator_noise_is_what_diffusers_draws():
    from diffusers.utils.torch_utils import randn_tensor

    shape = (2, *LATENT_SHAPE)
    ours = GeneratorNoise(torch.Generator().manual_seed(4)).randn(shape, "cpu")
    assert torch.equal(ours, randn_tensor(shape, generator=torch.Generator().manual_seed(4), dtype=torch.float32))


def test_samplers_never_touch_a_diffusers_module():
    """sampling/ calls the model plugin only: no diffusers import, no diffusers keyword arguments."""
    from pathlib import Path

    import distillery.sampling as pkg

    for path in Path(pkg.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert "from diffusers" not in text and "import diffusers" not in text, path.name
        assert "encoder_hidden_states" not in text and "hidden_states=" not in text, path.name


def test_inference_model_is_frozen_and_bf16_keeps_diffusers_fp32_modules():
    from diffusers import WanTransformer3DModel

    base = shipped_tiny_base()
    model = load_inference_model(base, "cpu", torch.bfloat16)
    assert not model.transformer.training and not any(p.requires_grad for p in model.transformer.parameters())
    assert model.input_dtype() == torch.bfloat16 and model.schedule.shift == 3.0
    stock = WanTransformer3DModel.from_pretrained(base / "transformer", torch_dtype=torch.bfloat16)
    assert {n: p.dtype for n, p in model.transformer.named_parameters()} == {n: p.dtype for n, p in stock.named_parameters()}
    with torch.no_grad():
        out = build_sampler({"sampler": "euler", "num_steps": 2}).sample(
            model, Conditioning(torch.randn(1, 6, 32)), LATENT_SHAPE, torch.Generator().manual_seed(0))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
