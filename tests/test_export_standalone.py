"""The code an export ships (``src/distillery/export/standalone``, copied into every export folder) needs
nothing of distillery: its modules import only the standard library, torch (numpy, safetensors: its and
diffusers' own requirements), diffusers and transformers — and its samplers and attention reproduce the
package's, bit for bit on the CPU, for every kind of sampling contract an export carries (the teacher's
CFG Euler, a Diffusion-Forcing student's block-causal Euler, DMD2's few-step ladder, Self-Forcing's
chunk-by-chunk streaming through the KV cache, PDD's fused heads). Loading real exports where distillery
is not installed: tests/test_export_isolated.py."""

from __future__ import annotations

import ast
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers import shipped_denoiser

from distillery.export.code import SHIPPED_ELSEWHERE, SHIPPED_MODULES, shipped_sources
from distillery.lineage.artifact_code import EXPORT_OWN_CODE
from distillery.tinybase.shipped import shipped_tiny_base

STANDALONE = Path(__file__).resolve().parents[1] / "src" / "distillery" / "export" / "standalone"
ALLOWED = {"torch", "numpy", "safetensors", "diffusers", "transformers"}
OPTIONAL = {"flash_attn", "cutlass", "triton", "torchao"}  # the GPU path's, imported only inside functions, where installed


def _imports(path: Path, top_level_only: bool = False) -> tuple[set[str], set[str]]:
    """(top-level packages imported absolutely, modules imported relatively) by ``path``, lazy imports included
    unless ``top_level_only``; ``from . import x`` counts as the module ``x``."""
    absolute, relative = set(), set()
    tree = ast.parse(path.read_text(), str(path))
    for node in (tree.body if top_level_only else ast.walk(tree)):
        if isinstance(node, ast.Import):
            absolute |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                relative |= {node.module} if node.module else {a.name for a in node.names}
            else:
                absolute.add(node.module.split(".")[0])
    return absolute, relative


def test_the_shipped_modules_import_only_the_libraries_and_each_other():
    standalone = sorted(p.name for p in STANDALONE.glob("*.py") if p.name != "__init__.py")
    assert sorted(SHIPPED_MODULES) == sorted([*standalone, *SHIPPED_ELSEWHERE])
    assert tuple(EXPORT_OWN_CODE) == tuple(SHIPPED_MODULES)  # what lineage --verify lets an export carry
    stems = {name[:-3] for name in SHIPPED_MODULES}
    for name, path in shipped_sources().items():
        absolute, relative = _imports(path)
        foreign = absolute - ALLOWED - OPTIONAL - set(sys.stdlib_module_names)
        assert not foreign, (name, foreign)  # never distillery
        eager, _ = _imports(path, top_level_only=True)
        assert not eager & OPTIONAL, (name, eager & OPTIONAL)  # the folder loads where they are not installed
        assert relative <= stems, (name, relative)
    _, from_pipeline = _imports(STANDALONE / "pipeline.py")
    cosmos = {"pipeline_cosmos", "distilled_cosmos"}  # a Cosmos export's own pipeline and its denoiser
    hunyuan15 = {"pipeline_hunyuan15", "distilled_hunyuan15"}  # a HunyuanVideo 1.5 export's
    assert from_pipeline == stems - {"pipeline"} - cosmos - hunyuan15  # diffusers copies only the modules the pipeline imports relatively
    _, from_cosmos = _imports(STANDALONE / "pipeline_cosmos.py")
    assert from_cosmos == stems - {"pipeline_cosmos"} - hunyuan15  # a Cosmos export's: every module it runs, directly
    _, from_hunyuan15 = _imports(STANDALONE / "pipeline_hunyuan15.py")
    assert from_hunyuan15 == stems - {"pipeline_hunyuan15"} - cosmos  # a HunyuanVideo 1.5 export's, likewise


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The shipped tiny Wan's transformer + scheduler, with a PDD head bank of 4 heads (each ``proj_out``
    plus its own noise, so fusing them matters)."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("model")
    for part in ("transformer", "scheduler"):
        shutil.copytree(shipped_tiny_base() / part, root / part)
    weights = load_file(str(root / "transformer" / "diffusion_pytorch_model.safetensors"))
    w, b = weights["proj_out.weight"].float(), weights["proj_out.bias"].float()
    gen = torch.Generator().manual_seed(3)
    heads = {"weight": torch.stack([w + 0.05 * torch.randn(w.shape, generator=gen) for _ in range(4)]),
             "bias": torch.stack([b + 0.05 * torch.randn(b.shape, generator=gen) for _ in range(4)])}
    save_file(heads, str(root / "transformer" / "pdd_heads.safetensors"))
    return root


CONTRACTS = {  # (contract, call steps, call guidance)
    "teacher_euler_cfg": ({"sampler": "euler", "shift": 3.0, "num_train_timesteps": 1000}, 3, 4.0),
    "dfsft_block_causal_euler": ({"sampler": "euler", "shift": 3.0, "num_train_timesteps": 1000, "chunk_size": 2}, 2, 4.0),
    "dmd2_few_step": ({"sampler": "few_step_x0", "shift": 3.0, "num_train_timesteps": 1000,
                       "timesteps": [1000.0, 750.0, 500.0]}, None, None),
    "self_forcing_streaming": ({"sampler": "causal_streaming", "shift": 3.0, "num_train_timesteps": 1000,
                                "timesteps": [1000.0, 800.0, 400.0], "chunk_size": 2, "context_noise": 50.0,
                                "renoise": "sde"}, None, None),
    "self_forcing_streaming_ode_cfg": ({"sampler": "causal_streaming", "shift": 3.0, "num_train_timesteps": 1000,
                                        "chunk_size": 1, "renoise": "ode"}, 2, 2.5),
    "pdd_fused": ({"sampler": "pdd_fused", "shift": 3.0, "num_train_timesteps": 1000, "pdd_steps": 4,
                   "block_size_max": 4, "num_steps": 2, "guidance_scale": 1.0}, None, None),
}


@pytest.mark.parametrize("kind", list(CONTRACTS))
def test_the_shipped_samplers_reproduce_the_package_s_latents(folder, kind):

    from distillery.export.standalone import distilled_samplers, distilled_wan
    from distillery.models.base import Conditioning
    from distillery.models.registry import load_inference_model
    from distillery.sampling import build_sampler

    contract, steps, guidance = CONTRACTS[kind]
    gen = torch.Generator().manual_seed(11)
    text, negative = torch.randn(1, 16, 32, generator=gen), torch.randn(1, 16, 32, generator=gen)
    shape = (8, 5, 4, 4)  # 5 latent frames: chunks of 2 are 2 + 2 + 1

    package = build_sampler(contract)
    plugin = load_inference_model(folder, shift=package.shift, role="validate", **package.model_options())
    expected = package.sample(plugin, Conditioning(text, negative), shape, torch.Generator().manual_seed(5),
                              num_steps=steps, guidance_scale=guidance)

    shipped = distilled_samplers.build_sampler(contract)
    model = shipped_denoiser(folder, shipped.model_kind())
    got = shipped.sample(model, distilled_wan.Conditioning(text, negative), shape, torch.Generator().manual_seed(5),
                         num_steps=steps, guidance_scale=guidance)
    assert got.dtype == torch.float32 and got.shape == expected.shape == (1, *shape)
    assert torch.equal(got, expected), (got - expected).abs().max()
    frames = shape[1]
    assert shipped.nfe(steps, guidance, num_frames=frames) == package.nfe(steps, guidance, num_frames=frames)


SPARSE_KINDS = ("dfsft_block_causal_euler", "dmd2_few_step", "self_forcing_streaming", "pdd_fused")


@pytest.mark.parametrize("kind", SPARSE_KINDS)
def test_a_student_trained_sparse_samples_as_the_package_samples_it(folder, tmp_path, kind):
    """A transformer whose config.json records block-sparse attention (frame tiles of 2 × 2 tokens: 5 tiles, a query
    tile keeps half of those it may attend): the shipped samplers, through the shipped sparse attention, reproduce the
    package's latents bit for bit, and those differ from the dense student's."""
    import json

    from distillery.export.standalone import distilled_samplers, distilled_wan
    from distillery.models.base import Conditioning
    from distillery.models.registry import load_inference_model
    from distillery.sampling import build_sampler

    sparse = tmp_path / "sparse"
    shutil.copytree(folder, sparse)
    config = json.loads((sparse / "transformer" / "config.json").read_text())
    config["_sparse_attention"] = {"sparsity": 0.5, "tile": [1, 2, 2]}
    (sparse / "transformer" / "config.json").write_text(json.dumps(config))
    contract, steps, guidance = CONTRACTS[kind]
    gen = torch.Generator().manual_seed(11)
    text, negative = torch.randn(1, 16, 32, generator=gen), torch.randn(1, 16, 32, generator=gen)
    shape = (8, 5, 4, 4)
    package = build_sampler(contract)
    latents = {}
    for name, where in (("sparse", sparse), ("dense", folder)):
        plugin = load_inference_model(where, shift=package.shift, role="validate", **package.model_options())
        assert (plugin.sparse is not None) == (name == "sparse")
        latents[name] = package.sample(plugin, Conditioning(text, negative), shape, torch.Generator().manual_seed(5),
                                       num_steps=steps, guidance_scale=guidance)
    shipped = distilled_samplers.build_sampler(contract)
    got = shipped.sample(shipped_denoiser(sparse, shipped.model_kind()), distilled_wan.Conditioning(text, negative), shape,
                         torch.Generator().manual_seed(5), num_steps=steps, guidance_scale=guidance)
    assert torch.equal(got, latents["sparse"]), (got - latents["sparse"]).abs().max()
    assert (latents["sparse"] - latents["dense"]).abs().max() > 1e-3


def _export_folder(root: Path, contract: dict, *, kind: str = "export", record_pipeline: bool = True) -> Path:
    """``root/export``: the shipped tiny Wan's index, ``contract`` as ``sampling.json``, the shipped code written as the
    export stage writes it (:func:`~distillery.export.code.write_export_code`), and a sealed lineage.json of ``kind``
    recording that code (all of it, or all but ``pipeline.py``)."""
    import json

    from distillery.export.code import CODE_RECORD_KEY, write_export_code
    from distillery.lineage.manifest import write_lineage

    folder = root / "export"
    folder.mkdir()
    shutil.copyfile(shipped_tiny_base() / "model_index.json", folder / "model_index.json")
    (folder / "sampling.json").write_text(json.dumps(contract))
    code = write_export_code(folder)
    if not record_pipeline:
        code.pop("pipeline.py")
    write_lineage(folder, kind=kind, stage="export", config={CODE_RECORD_KEY: code})
    return folder


@pytest.mark.parametrize("kind", list(CONTRACTS))
def test_a_folder_that_needs_its_own_sampler_names_its_own_pipeline_and_lineage_accepts_exactly_that(tmp_path, kind):
    """Stock ``WanPipeline`` samples only the teacher's plain Euler; every other contract's export names
    ``["pipeline", "DistilledWanPipeline"]`` in ``model_index.json`` (so diffusers loads the folder's pipeline or
    refuses, tests/test_export_isolated.py) — the one ``[module, class]`` ``lineage --verify`` accepts, and only in an
    export that recorded its ``pipeline.py``. The rest of the index is the base's, unchanged."""
    import json

    from distillery.export.code import OWN_PIPELINE, OWN_PIPELINES
    from distillery.lineage.artifact_code import EXPORT_PIPELINE_CLASS, EXPORT_PIPELINE_CLASSES
    from distillery.lineage.verify import verify_lineage

    assert tuple(OWN_PIPELINE) == tuple(EXPORT_PIPELINE_CLASS)
    assert sorted(set(OWN_PIPELINES.values())) == sorted(EXPORT_PIPELINE_CLASSES)  # every family's own pipeline
    contract = CONTRACTS[kind][0]
    folder = _export_folder(tmp_path, contract)
    index = json.loads((folder / "model_index.json").read_text())
    base = json.loads((shipped_tiny_base() / "model_index.json").read_text())
    assert index["_class_name"] == ("WanPipeline" if kind == "teacher_euler_cfg" else list(OWN_PIPELINE))
    assert {k: v for k, v in index.items() if k != "_class_name"} == {k: v for k, v in base.items() if k != "_class_name"}
    assert verify_lineage(folder).ok, verify_lineage(folder).problems
    if kind == "teacher_euler_cfg":
        return
    other = tmp_path / "other"
    other.mkdir()
    for wrong, problem in ((dict(record_pipeline=False), "refused: pipeline.py (code the export's lineage.json does not record"),
                           (dict(kind="model"), "refused: pipeline.py (a code file")):
        shutil.rmtree(other)
        other.mkdir()
        res = verify_lineage(_export_folder(other, contract, **wrong))
        assert any(p.startswith(problem) for p in res.problems), res.problems
        assert any(p.startswith("refused: model_index.json: _class_name") for p in res.problems), res.problems
    index["_class_name"] = ["pipeline", "WanPipeline"]  # another pair, even one naming its own pipeline.py
    (folder / "model_index.json").write_text(json.dumps(index))
    from distillery.lineage.manifest import write_lineage

    manifest = json.loads((folder / "lineage.json").read_text())
    write_lineage(folder, kind="export", stage="export", config=manifest["config"])
    assert [p for p in verify_lineage(folder).problems if "_class_name" in p] == [
        'refused: model_index.json: _class_name: ["pipeline", "WanPipeline"]: a [module, class] pair, which diffusers '
        'would import from the folder'], verify_lineage(folder).problems
