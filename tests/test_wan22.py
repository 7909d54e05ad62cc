"""Wan 2.2 as model families (issue 45, item 3): TI2V-5B's layout (per-token timesteps, the 48-channel VAE) and
A14B's two experts (``transformer`` for t >= boundary_ratio · 1000, ``transformer_2`` below), recognised from tiny
diffusers folders, refused in one line when an expert is missing, trained by SFT and DMD2, sampled and exported
with each timestep routed to its expert."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import run_config, train_in_process

from distillery.cli.guard import run_guarded
from distillery.common.errors import UserError
from distillery.models import registry
from distillery.models.base import Conditioning
from distillery.tinybase.wan22 import A14B_BOUNDARY_RATIO, TI2V_Z_DIM, make_tiny_wan22

BOUNDARY = A14B_BOUNDARY_RATIO * 1000


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wan22")
    return {layout: make_tiny_wan22(root / layout, layout) for layout in ("ti2v", "a14b")}


@pytest.fixture(scope="module")
def latents(tmp_path_factory) -> dict[str, Path]:
    from distillery.data.demo import make_demo_latents

    root = tmp_path_factory.mktemp("wan22-latents")
    return {"ti2v": make_demo_latents(root / "ti2v", channels=TI2V_Z_DIM), "a14b": make_demo_latents(root / "a14b")}


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


def _edit_index(folder: Path, **changes) -> None:
    index = json.loads((folder / "model_index.json").read_text())
    index.update(changes)
    (folder / "model_index.json").write_text(json.dumps(index))


def test_the_wan22_folders_are_recognised_from_the_folder(folders, tiny_base):
    assert registry.family_of(tiny_base).name == "wan2.1"
    assert registry.family_of(folders["ti2v"]).name == "wan2.2-ti2v-5b"
    assert registry.family_of(folders["a14b"]).name == "wan2.2-a14b"
    assert registry.family_of(folders["a14b"] / "transformer").name == "wan2.2-a14b"  # its model_index.json, one up
    layout = registry.read_layout(folders["a14b"])
    assert (layout.experts, layout.boundary_ratio, layout.expand_timesteps) == (2, A14B_BOUNDARY_RATIO, False)
    layout = registry.read_layout(folders["ti2v"])
    assert (layout.experts, layout.expand_timesteps, layout.vae_z_dim) == (1, True, TI2V_Z_DIM)
    # all share the diffusers class: the class alone is not the family
    assert {f.transformer_classes for f in registry.FAMILIES if f.package == "distillery.models.wan"} == {("WanTransformer3DModel",)}


@pytest.mark.parametrize("case,message", [
    ("no_second_folder", r"names a second expert \(transformer_2\) but .*transformer_2 holds no config\.json"),
    ("ratio_without_second", r"boundary_ratio 0\.875 but no second expert"),
    ("second_without_ratio", r"a second expert \(transformer_2\) but no boundary_ratio"),
    ("ratio_out_of_range", r"boundary_ratio 1\.5; expected a number in \(0, 1\)"),
    ("expand_with_a_wan21_vae", r"unknown layout \(1 expert\(s\), expand_timesteps true, VAE z_dim 8\)"),
    ("wan22_vae_without_expand", r"unknown layout \(1 expert\(s\), expand_timesteps false, VAE z_dim 48\)"),
])
def test_a_broken_or_unknown_wan22_folder_is_one_line_exit_2(folders, tiny_base, tmp_path, capsys, case, message):
    if case == "no_second_folder":
        folder = _copy(folders["a14b"], tmp_path)
        shutil.rmtree(folder / "transformer_2")
    elif case == "ratio_without_second":
        folder = _copy(folders["a14b"], tmp_path)
        shutil.rmtree(folder / "transformer_2")
        _edit_index(folder, transformer_2=[None, None])
    elif case == "second_without_ratio":
        folder = _copy(folders["a14b"], tmp_path)
        _edit_index(folder, boundary_ratio=None)
    elif case == "ratio_out_of_range":
        folder = _copy(folders["a14b"], tmp_path)
        _edit_index(folder, boundary_ratio=1.5)
    elif case == "expand_with_a_wan21_vae":
        folder = _copy(tiny_base, tmp_path)
        _edit_index(folder, expand_timesteps=True)
    else:
        folder = _copy(folders["ti2v"], tmp_path)
        _edit_index(folder, expand_timesteps=False)
    with pytest.raises(UserError, match=message):
        registry.family_of(folder)
    assert run_guarded(lambda: registry.load_inference_model(folder)) == 2  # before any weight is loaded
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")


def test_each_sample_goes_to_the_expert_of_its_timestep(folders):
    model = registry.load_inference_model(folders["a14b"])
    high, low = model.transformer.transformer, model.transformer.transformer_2
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(4, 8, 3, 8, 8, generator=g), torch.randn(4, 6, 32, generator=g)
    t = torch.tensor([999.0, BOUNDARY, BOUNDARY - 0.5, 10.0])  # the boundary itself is the high-noise expert's
    out = model.predict_noise(x, t, Conditioning(text_embeds=text))
    for rows, expert in ((slice(0, 2), high), (slice(2, 4), low)):  # each expert on its rows, as one batch
        alone = expert(hidden_states=x[rows], timestep=t[rows], encoder_hidden_states=text[rows], return_dict=False)[0]
        assert torch.equal(out[rows], alone.float()), rows
    other = low(hidden_states=x[:2], timestep=t[:2], encoder_hidden_states=text[:2], return_dict=False)[0]
    assert not torch.allclose(out[:2], other.float(), atol=1e-3)  # the experts differ: the routing is what is tested
    with pytest.raises(ValueError, match="straddle"):  # per-frame timesteps of one sample on both sides
        model.predict_noise(x[:1], torch.tensor([[900.0, 900.0, 100.0]]), Conditioning(text_embeds=text[:1]))


def test_ti2v_feeds_one_timestep_per_token_as_the_stock_pipeline_does(folders):
    model = registry.load_inference_model(folders["ti2v"])
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(2, TI2V_Z_DIM, 3, 8, 8, generator=g), torch.randn(2, 6, 32, generator=g)
    t = torch.tensor([700.0, 300.0])
    out = model.predict_noise(x, t, Conditioning(text_embeds=text))
    tokens = 3 * (8 // 2) * (8 // 2)  # WanPipeline(expand_timesteps=True): mask[0][0][:, ::2, ::2] * t, flattened
    stock = model.transformer(hidden_states=x, timestep=t[:, None].expand(-1, tokens), encoder_hidden_states=text,
                              return_dict=False)[0]
    assert torch.equal(out, stock.float())


def test_sampling_routes_each_step_to_its_expert(folders):
    from distillery.sampling import build_sampler

    model = registry.load_inference_model(folders["a14b"], shift=3.0)
    seen: list[tuple[int, float]] = []
    for index, expert in enumerate(model.transformer.experts):
        expert.register_forward_hook(lambda m, args, kwargs, out, index=index: seen.append((index, float(kwargs["timestep"][0]))),
                                     with_kwargs=True)
    sampler = build_sampler({"sampler": "euler", "shift": 3.0, "num_train_timesteps": 1000, "num_steps": 6,
                             "guidance_scale": 1.0})
    cond = Conditioning(text_embeds=torch.randn(1, 6, 32))
    sampler.sample(model, cond, (8, 3, 8, 8), torch.Generator().manual_seed(1))
    assert len(seen) == 6 and {index for index, _ in seen} == {0, 1}
    assert all((index == 0) == (t >= BOUNDARY) for index, t in seen), seen


def _expert_weights(module) -> list[dict[str, torch.Tensor]]:
    return [{k: v.detach().clone() for k, v in e.state_dict().items()} for e in module.experts]


@pytest.mark.parametrize("layout", ["ti2v", "a14b"])
@pytest.mark.parametrize("method", ["sft", "dmd2"])
def test_sft_and_dmd2_train_a_wan22_model_and_export_it(folders, latents, tmp_path, layout, method):
    from direct_weights_check import assert_direct_export_is_save_pretrained

    from distillery.export.code import check_own_pipeline_samples
    from distillery.export.weights import export_weights

    base = folders[layout]
    target = {"sft": "distillery.methods.sft.SFTMethod", "dmd2": "distillery.methods.dmd2.DMD2Method"}[method]
    knobs = {"generator_update_interval": 2, "real_score_guidance_scale": 2.0} if method == "dmd2" else {}
    cfg = run_config(base, latents[layout], tmp_path / "run", method=target, method_knobs=knobs, steps=4, batch_size=4,
                     save_every=4)
    if method == "dmd2":
        wan = "distillery.models.wan.WanModel"
        cfg["models"]["critic"] = {"_target_": wan, "init_from": str(base)}
        cfg["models"]["teacher"] = {"_target_": wan, "init_from": str(base), "trainable": False}
    result = train_in_process(cfg)
    assert result.final_step == 4 and result.checkpoint is not None
    assert all(torch.isfinite(torch.tensor(v)) for row in result.history for k, v in row.items() if "loss" in k)
    # TI2V: written without diffusers, save_pretrained's bytes; A14B (two experts): diffusers' path, kept
    assert_direct_export_is_save_pretrained(result.checkpoint, "student", tmp_path / "direct", direct=layout == "ti2v")
    out = export_weights(result.checkpoint, "student", tmp_path / "model")
    shutil.copytree(base / "scheduler", tmp_path / "model" / "scheduler")
    family = {"ti2v": "wan2.2-ti2v-5b", "a14b": "wan2.2-a14b"}[layout]
    assert registry.family_of(tmp_path / "model").name == family  # the artifact tells its layout alone
    # the export stage's check: a teacher-form (Euler) contract is stock WanPipeline's, which samples both layouts; every
    # other student's is the folder's own pipeline.py's, which runs both layouts too (a causal student of two experts:
    # a cache per expert; a PDD one: a head bank per expert)
    contract = {"sampler": "euler", "shift": 5.0, "num_train_timesteps": 1000}
    if method == "dmd2":
        contract = {"sampler": "few_step_x0", "shift": 5.0, "num_train_timesteps": 1000, "timesteps": [1000, 750, 500, 250]}
    (tmp_path / "model" / "sampling.json").write_text(json.dumps(contract))
    check_own_pipeline_samples("distill" if method == "dmd2" else "teacher", tmp_path / "model")
    if method == "dmd2":
        for other in ({"sampler": "causal_streaming", "chunk_size": 1}, {"sampler": "pdd_fused", "pdd_steps": 4},
                      {"sampler": "euler", "chunk_size": 1}):
            (tmp_path / "model" / "sampling.json").write_text(json.dumps(other))
            check_own_pipeline_samples("distill", tmp_path / "model")
    trained, before = registry.load_inference_model(tmp_path / "model"), registry.load_inference_model(base)
    assert trained.layout.expand_timesteps == (layout == "ti2v")
    if layout == "ti2v":
        assert not torch.equal(trained.transformer.proj_out.weight, before.transformer.proj_out.weight)
        return
    assert (out / "transformer_2" / "config.json").is_file() and trained.boundary_timestep == BOUNDARY
    # every sample's timestep picked its expert: with 16 samples on both sides of the boundary, both experts trained
    for after, start in zip(_expert_weights(trained.transformer), _expert_weights(before.transformer), strict=True):
        assert any(not torch.equal(after[k], start[k]) for k in start)


@pytest.mark.parametrize("layout", ["ti2v", "a14b"])
@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_our_euler_sampler_is_stock_wanpipeline_on_both_layouts(folders, layout, guidance):
    """Validate's sampler over the family's plugin gives what stock ``WanPipeline`` gives on the same folder: the
    A14B expert switch at ``t >= boundary_ratio · 1000`` (10 steps of shift 3 cross it) and TI2V's per-token
    timesteps, with and without CFG."""
    from diffusers import WanPipeline

    from distillery.data.encoders import BaseEncoders
    from distillery.sampling import GeneratorNoise, build_sampler

    folder = folders[layout]
    pipe = WanPipeline.from_pretrained(str(folder), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    channels = TI2V_Z_DIM if layout == "ti2v" else 8
    scale = pipe.vae_scale_factor_spatial
    shape = (channels, 5, 32 // scale, 32 // scale)  # 17 frames of 32 x 32
    prompts = ["a red circle moving left", "a blue square moving up"]
    noise = GeneratorNoise(torch.Generator().manual_seed(7)).randn((2, *shape), "cpu")
    expected = pipe(prompts, negative_prompt="", num_frames=17, height=32, width=32, num_inference_steps=10,
                    guidance_scale=guidance, max_sequence_length=32, latents=noise.clone(), output_type="latent").frames
    enc = BaseEncoders(folder)
    rows = enc.encode_prompts([*prompts, "", ""])
    padded = torch.stack([torch.cat([r, r.new_zeros(enc.max_sequence_length - r.shape[0], r.shape[1])]) for r in rows])
    model = registry.load_inference_model(folder)
    sampler = build_sampler({"sampler": "euler", "shift": 3.0, "num_train_timesteps": 1000})
    ours = sampler.sample(model, Conditioning(padded[:2], padded[2:]), shape, torch.Generator().manual_seed(7),
                          num_steps=10, guidance_scale=guidance, initial=noise)
    assert ours.shape == expected.shape
    assert (ours - expected).abs().max().item() <= 1e-5
    if layout == "a14b":  # the second expert took part: with its weights swapped for the first's, the result moves
        model.transformer.transformer_2.load_state_dict(model.transformer.transformer.state_dict())
        swapped = sampler.sample(model, Conditioning(padded[:2], padded[2:]), shape, torch.Generator().manual_seed(7),
                                 num_steps=10, guidance_scale=guidance, initial=noise)
        assert (swapped - expected).abs().max().item() > 1e-3


@pytest.mark.slow
def test_two_experts_on_two_ranks_train_as_on_one(folders, latents, tmp_path):
    """FSDP2 over 2 gloo ranks: a rank whose samples all fall to one expert still runs the other when the other rank
    needs it (its gathers are collectives; nothing hangs) and the run ends where one rank with the whole batch does."""
    from helpers import role_state
    from torchrun_each import torchrun_each

    def config(out: Path, batch: int) -> dict:
        return run_config(folders["a14b"], latents["a14b"], out, steps=4, batch_size=batch, save_every=4)

    one = train_in_process(config(tmp_path / "one", 4))
    torchrun_each([(config(tmp_path / "two", 2), tmp_path / "two.yaml")])
    a, b = role_state(one.checkpoint), role_state(tmp_path / "two" / "checkpoint-4")
    assert a.keys() == b.keys() and any(k.startswith("transformer_2.") for k in a)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5, msg=key)


# -- the export's own pipeline on Wan 2.2 (issue 45): per-token timesteps and two experts, as validate samples them --

WAN22_CONTRACTS = {  # (contract, call steps, call guidance): every kind of student trained on the layout
    "dmd2_few_step": ({"sampler": "few_step_x0", "shift": 3.0, "num_train_timesteps": 1000,
                       "timesteps": [1000.0, 900.0, 875.0, 500.0]}, None, None),  # crosses A14B's boundary, 875 itself high
    "teacher_euler_cfg": ({"sampler": "euler", "shift": 3.0, "num_train_timesteps": 1000}, 6, 4.0),
    "dfsft_block_causal_euler_cfg": ({"sampler": "euler", "shift": 3.0, "num_train_timesteps": 1000, "chunk_size": 2}, 2, 4.0),
    "self_forcing_streaming": ({"sampler": "causal_streaming", "shift": 3.0, "num_train_timesteps": 1000,
                                "timesteps": [1000.0, 800.0, 400.0], "chunk_size": 2, "context_noise": 50.0,
                                "renoise": "sde"}, None, None),
    "self_forcing_streaming_ode_cfg": ({"sampler": "causal_streaming", "shift": 3.0, "num_train_timesteps": 1000,
                                        "chunk_size": 1, "renoise": "ode"}, 2, 2.5),
    "pdd_fused": ({"sampler": "pdd_fused", "shift": 3.0, "num_train_timesteps": 1000, "pdd_steps": 4,
                   "block_size_max": 4, "num_steps": 2, "guidance_scale": 1.0}, None, None),
}


def _student(base: Path, out: Path, contract: dict) -> Path:
    """``out``: a trained student's ``model/`` as a training stage writes it — ``base``'s transformer(s) moved off the
    base (seeded noise), saved by the plugin (the layout in its config, the second expert in ``transformer/transformer_2``),
    the scheduler and ``contract`` as ``sampling.json``; a PDD contract's head bank of ``proj_out`` + noise per head."""
    from helpers import nudge_weights
    from safetensors.torch import save_file

    model = registry.load_inference_model(base)
    nudge_weights(model.transformer)
    model.transformer.save_pretrained(out / "transformer", safe_serialization=True)
    shutil.copytree(base / "scheduler", out / "scheduler")
    (out / "sampling.json").write_text(json.dumps(contract))
    if contract["sampler"] == "pdd_fused":  # two experts: the low-noise expert's heads too (weight_2, bias_2)
        gen, steps, tensors = torch.Generator().manual_seed(3), contract["pdd_steps"], {}
        experts = getattr(model.transformer, "experts", (model.transformer,))
        for suffix, expert in zip(("", "_2"), experts):
            w, b = expert.proj_out.weight.detach().float(), expert.proj_out.bias.detach().float()
            tensors[f"weight{suffix}"] = torch.stack([w + 0.05 * torch.randn(w.shape, generator=gen) for _ in range(steps)])
            tensors[f"bias{suffix}"] = torch.stack([b + 0.05 * torch.randn(b.shape, generator=gen) for _ in range(steps)])
        save_file(tensors, str(out / "transformer" / "pdd_heads.safetensors"))
    return out


@pytest.mark.parametrize("layout,kind", [(layout, k) for layout in ("ti2v", "a14b") for k in WAN22_CONTRACTS])
def test_the_shipped_samplers_sample_a_wan22_student_as_the_package_does(folders, tmp_path, layout, kind):
    """The export's denoiser over a trained Wan 2.2 student (its layout read from the artifact, as the export's
    ``model_index.json`` gives it to the pipeline) and its samplers give the package's latents bit for bit: TI2V's
    per-token timesteps and A14B's two experts (each step by its timestep; a cache, a head bank per expert) for every
    kind of student."""
    from helpers import shipped_denoiser

    from distillery.export.standalone import distilled_samplers, distilled_wan
    from distillery.sampling import build_sampler

    contract, steps, guidance = WAN22_CONTRACTS[kind]
    model_dir = _student(folders[layout], tmp_path / "model", contract)
    gen = torch.Generator().manual_seed(11)
    text, negative = torch.randn(2, 6, 32, generator=gen), torch.randn(2, 6, 32, generator=gen)
    shape = (TI2V_Z_DIM if layout == "ti2v" else 8, 5, 4, 4)  # 5 latent frames: chunks of 2 are 2 + 2 + 1

    package = build_sampler(contract)
    plugin = registry.load_inference_model(model_dir, shift=package.shift, role="validate", **package.model_options())
    expected = package.sample(plugin, Conditioning(text, negative), shape, torch.Generator().manual_seed(5),
                              num_steps=steps, guidance_scale=guidance)
    shipped = distilled_samplers.build_sampler(contract)
    model = shipped_denoiser(model_dir, shipped.model_kind())
    assert model.layout.expand_timesteps == (layout == "ti2v") and (model.layout.second is not None) == (layout == "a14b")
    seen: list[tuple[int, tuple[int, ...]]] = []
    experts = [model.transformer] + ([model.layout.second] if model.layout.second is not None else [])
    for index, expert in enumerate(experts):
        expert.register_forward_hook(lambda m, args, kwargs, out, index=index: seen.append((index, tuple(kwargs["timestep"].shape))),
                                     with_kwargs=True)
    got = shipped.sample(model, distilled_wan.Conditioning(text, negative), shape, torch.Generator().manual_seed(5),
                         num_steps=steps, guidance_scale=guidance)
    assert got.shape == expected.shape == (2, *shape)
    assert torch.equal(got, expected), (got - expected).abs().max()
    if layout == "ti2v":  # one timestep per token: [B, tokens] (a streaming chunk's own tokens)
        assert seen and all(len(s) == 2 for _, s in seen), seen
    else:  # both experts ran, each on its own steps
        assert {index for index, _ in seen} == {0, 1} and all(s == (2,) for _, s in seen), seen


def test_the_shipped_denoiser_routes_each_sample_to_its_expert_as_the_plugin_does(folders, tmp_path):
    """A batch spanning the boundary: each row through the expert of its timestep (the boundary itself the high-noise
    expert's), the rows in order — the plugin's velocities, bit for bit, with and without the prompt."""
    from helpers import shipped_denoiser

    from distillery.export.standalone import distilled_wan

    model_dir = _student(folders["a14b"], tmp_path / "model", WAN22_CONTRACTS["dmd2_few_step"][0])
    plugin, shipped = registry.load_inference_model(model_dir, shift=3.0), shipped_denoiser(model_dir, {})
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(4, 8, 3, 8, 8, generator=g), torch.randn(4, 6, 32, generator=g)
    t = torch.tensor([10.0, BOUNDARY, 999.0, BOUNDARY - 0.5])
    for conditional in (True, False):
        expected = plugin.predict_noise(x, t, Conditioning(text_embeds=text), conditional=conditional)
        got = shipped.velocity(x, t, distilled_wan.Conditioning(text), conditional=conditional)
        assert torch.equal(got, expected)
    high = shipped.transformer(hidden_states=x[1:3], timestep=t[1:3], encoder_hidden_states=text[1:3], return_dict=False)[0]
    assert torch.equal(shipped.velocity(x, t, distilled_wan.Conditioning(text))[1:3], high.float())


@pytest.mark.parametrize("layout,kind", [("ti2v", "dmd2_few_step"), ("ti2v", "self_forcing_streaming"),
                                         ("ti2v", "pdd_fused"), ("a14b", "dmd2_few_step"),
                                         ("a14b", "self_forcing_streaming"), ("a14b", "pdd_fused")])
def test_an_exported_wan22_student_samples_validates_latents_through_diffusers(folders, tmp_path, layout, kind):
    """The export stage's check and assembly of a Wan 2.2 student (the base's ``model_index.json``: TI2V's
    ``expand_timesteps``, A14B's ``transformer_2`` and ``boundary_ratio``) give a folder that names its own pipeline and
    passes ``lineage --verify``; ``DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)`` loads it (both
    experts) and samples bit for bit the latents validate sampled for that student."""
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    from distillery.data.encoders import read_max_sequence_length
    from distillery.evaluation.candidates import Candidate
    from distillery.evaluation.sampling_context import PromptEmbeddings
    from distillery.evaluation.validate import run_validation
    from distillery.evaluation.validation_config import ValidationConfig
    from distillery.export.code import CODE_RECORD_KEY, OWN_PIPELINE, check_own_pipeline_samples
    from distillery.export.model_card import export_model_card
    from distillery.lineage.manifest import write_lineage
    from distillery.lineage.verify import verify_lineage
    from stages.export import assemble_export

    base = folders[layout]
    student = tmp_path / "artifacts" / "distill"
    _student(base, student / "model", WAN22_CONTRACTS[kind][0])
    write_lineage(student, kind="model", stage="distill", config={}, method="dmd2")
    gen = torch.Generator().manual_seed(2)
    stored = PromptEmbeddings(texts=[torch.randn(5, 32, generator=gen)], negative=torch.randn(3, 32, generator=gen))
    cfg = ValidationConfig(num_frames=9, num_seeds=1, progress_bar=False, grid_formats=[], bootstrap_resamples=0)
    report_dir = tmp_path / "artifacts" / "validate" / "report"
    run_validation(base, [Candidate.from_artifact("distill_s", student / "model")], ["a red circle moving left"],
                   report_dir, cfg, prompt_embeddings=stored)
    saved = load_file(str(report_dir / "samples" / "distill_s" / "latents.safetensors"))["0"]
    seed = json.loads((report_dir / "report.json").read_text())["seeds"][0]

    check_own_pipeline_samples("distill", student / "model")  # accepted now: before any work, as the stage runs it
    folder = tmp_path / "export"
    folder.mkdir()
    code, stock_nfe = assemble_export(base, student / "model", folder)
    card = export_model_card("distill", student, tmp_path / "artifacts" / "validate", read_max_sequence_length(base),
                             stock_nfe, folder=str(folder))
    assert {"ti2v": "A Wan 2.2 TI2V-5B (one timestep per token", "a14b": "A Wan 2.2 A14B (two experts"}[layout] in card
    (folder / "README.md").write_text(card)
    write_lineage(folder, kind="export", stage="export", config={CODE_RECORD_KEY: code})
    assert verify_lineage(folder).ok, verify_lineage(folder).problems
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == list(OWN_PIPELINE)

    pipe = DiffusionPipeline.from_pretrained(str(folder), trust_remote_code=True)
    assert type(pipe).__name__ == "DistilledWanPipeline"
    if layout == "a14b":
        assert pipe.config.boundary_ratio == A14B_BOUNDARY_RATIO and pipe.transformer_2 is not None
    else:
        assert pipe.config.expand_timesteps and pipe.transformer_2 is None
    calls: list[int] = []
    for index_, expert in enumerate([pipe.transformer, pipe.transformer_2]):
        if expert is not None:
            expert.register_forward_hook(lambda *a, index_=index_: calls.append(index_))
    text = torch.zeros(1, read_max_sequence_length(base), 32)
    text[0, :5] = stored.texts[0]
    got = pipe(prompt_embeds=text, generator=torch.Generator().manual_seed(seed), output_type="latent", num_frames=9,
               height=32, width=32).frames
    assert got.shape == (1, *saved.shape) and torch.equal(got[0], saved), (got[0] - saved).abs().max()
    assert set(calls) == ({0, 1} if layout == "a14b" else {0}), calls
