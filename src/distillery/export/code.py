"""The code an export folder ships: the modules of :mod:`distillery.export.standalone` and the fused chunked VAE
decode of :mod:`distillery.data` (``vae_decode.py``, ``vae_kernels.py``: the same code validate decodes with), copied
to the folder's top level, and the record of them its lineage keeps.

The export's only code is these files (``lineage --verify`` refuses any other code file, and these
unless their digests are the ones recorded, :func:`distillery.lineage.verify.verify_lineage`):
:data:`SHIPPED_MODULES` is their names, and the same names are
:data:`distillery.lineage.artifact_code.EXPORT_OWN_CODE` (a test keeps the two equal). They import only the
standard library, torch, numpy, safetensors, diffusers and transformers (FlashAttention-4, Triton and torchao only
where installed, for the GPU path of :mod:`distilled_fast`), so the folder samples where
distillery is not installed — with :data:`REQUIREMENTS` installed (diffusers loads Wan's transformer only
where accelerate is: ``low_cpu_mem_usage`` cannot be off for its fp32-kept modules), the packages the
model card names and ``tests/test_export_isolated.py`` installs, alone, to load every kind of export.

A folder whose sampling contract stock ``WanPipeline`` does not sample (:func:`stock_samples`: a few-step
ladder, a streaming or block-causal student, PDD heads) names its own pipeline in ``model_index.json``:
``"_class_name": ["pipeline", "DistilledWanPipeline"]`` (:data:`OWN_PIPELINE`), diffusers' form for a
folder's own pipeline class. Then ``DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)``
(and ``WanPipeline.from_pretrained``, which resolves the class the same way) loads
:class:`DistilledWanPipeline`, and without ``trust_remote_code`` diffusers refuses, naming
``pipeline.py`` — never a plain ``WanPipeline`` that would sample the student with the teacher's loop.
``lineage --verify`` accepts that one entry in an export whose ``pipeline.py`` it recorded
(:data:`distillery.lineage.artifact_code.EXPORT_PIPELINE_CLASS`, kept equal to :data:`OWN_PIPELINE` by a test).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

STANDALONE_PACKAGE = "distillery.export.standalone"
# the module files copied into every export (pipeline.py imports the others relatively: diffusers copies them with it)
SHIPPED_MODULES = ("pipeline.py", "distilled_schedule.py", "distilled_samplers.py", "distilled_wan.py", "distilled_causal.py",
                   "distilled_fast.py", "distilled_sparse.py", "distilled_decode.py", "sparse_attention.py", "vae_decode.py",
                   "vae_kernels.py", "pipeline_cosmos.py", "distilled_cosmos.py", "pipeline_hunyuan15.py",
                   "distilled_hunyuan15.py")
# the shipped modules that live outside STANDALONE_PACKAGE: the fused chunked VAE decode validate uses too, and the
# block-sparse video attention a sparse student trained with
SHIPPED_ELSEWHERE = {"vae_decode.py": "distillery.data", "vae_kernels.py": "distillery.data",
                     "sparse_attention.py": "distillery.models.wan"}
CODE_RECORD_KEY = "shipped_code"  # in the export's lineage config: {file name: sha256}
# what the folder's snippets need installed (the model card names them; the isolated test installs exactly these)
REQUIREMENTS = ("torch", "diffusers", "transformers", "accelerate")
OWN_PIPELINE = ("pipeline", "DistilledWanPipeline")  # model_index.json's _class_name where stock WanPipeline is wrong
#: A base pipeline class → the export's own pipeline in its place (a Cosmos Predict 2.5 export: pipeline_cosmos.py; a
#: HunyuanVideo 1.5 export: pipeline_hunyuan15.py)
OWN_PIPELINES = {"WanPipeline": OWN_PIPELINE, "WanImageToVideoPipeline": OWN_PIPELINE,
                 "Cosmos2_5_PredictBasePipeline": ("pipeline_cosmos", "DistilledCosmosPipeline"),
                 "HunyuanVideo15Pipeline": ("pipeline_hunyuan15", "DistilledHunyuanVideo15Pipeline")}
INDEX_FILE = "model_index.json"
SPARSE_RECORD_KEY = "_sparse_attention"  # distillery.models.wan.sparse_attention.RECORD_KEY (that module imports torch)


def shipped_sources() -> dict[str, Path]:
    """``{file name: source file in the package}`` of every module an export ships."""
    sources = {}
    for name in SHIPPED_MODULES:
        spec = importlib.util.find_spec(f"{SHIPPED_ELSEWHERE.get(name, STANDALONE_PACKAGE)}.{name[:-3]}")  # located (a dvc.yaml dep), never run
        assert spec is not None and spec.origin, name
        sources[name] = Path(spec.origin)
    return sources


def stock_samples(contract: Mapping[str, Any], sparse: bool = False) -> bool:
    """Whether stock ``WanPipeline`` samples a model of this sampling contract as the contract says: plain
    (bidirectional) Euler with CFG — the teacher's — and dense attention (``sparse``: the transformer trained with
    block-sparse attention, :func:`records_sparse`, which stock diffusers would run dense). Every other model needs
    the folder's own pipeline."""
    return contract.get("sampler") == "euler" and contract.get("chunk_size") is None and not sparse


def sparse_record(transformer_dir: Path) -> dict[str, Any] | None:
    """The block-sparse attention the transformer in ``transformer_dir`` trained with, as its ``config.json`` records
    it (:data:`distillery.models.wan.sparse_attention.RECORD_KEY`: ``{"sparsity", "tile"}``), None: dense."""
    config = Path(transformer_dir) / "config.json"
    return json.loads(config.read_text()).get(SPARSE_RECORD_KEY) if config.is_file() else None


def records_sparse(transformer_dir: Path) -> bool:
    """Whether the transformer in ``transformer_dir`` trained with block-sparse attention (:func:`sparse_record`)."""
    return sparse_record(transformer_dir) is not None


def check_own_pipeline_samples(student: str, model: Path) -> None:
    """Refuse, in one line (:class:`UserError`) before any work, the export of a student in ``model`` (an artifact's
    ``model/``) that only the folder's own pipeline would sample (:func:`stock_samples` false) when its transformer is
    of a layout that pipeline does not run as distillery sampled it. It runs Wan 2.1's one transformer, Wan 2.2
    TI2V-5B's one timestep per token and A14B's two experts routed by timestep — every contract: few-step, a causal
    student's streaming (a KV cache per expert) and block-causal Euler, PDD's fused heads (a head bank per expert) —
    but not an image-to-video student of two experts (Wan 2.2 I2V-A14B: no test shows it sampled as validate samples
    it) (the layout a trained transformer records, :func:`distillery.models.registry.family_of`). Sampled by it, such
    a student's videos would be silently wrong. A causal image-to-video student whose contract lacks
    ``given_first_frame`` (trained when it generated its latent frame 0) is refused too: retrain it."""
    from distillery.common.errors import UserError
    from distillery.models.registry import family_of, image_conditioning

    if not (model / "sampling.json").is_file():
        return  # no contract: the export's own checks name what is missing
    contract = json.loads((model / "sampling.json").read_text())
    if (contract.get("chunk_size") is not None and not contract.get("given_first_frame")
            and image_conditioning(model) is not None):
        raise UserError(f"stage export: the {student} student is a causal image-to-video model whose sampling.json "
                        "lacks given_first_frame: true (trained before its latent frame 0 was the given frame, it "
                        "generates frame 0); retrain it")
    if stock_samples(contract, records_sparse(model / "transformer")):
        return
    family = family_of(model)
    if family.experts == 1 or image_conditioning(model) is None:
        return
    raise UserError(f"stage export: the {student} student is a {family.name} model (two experts) with the "
                    f"{contract.get('sampler')!r} sampling contract; the exported pipeline.py does not sample an "
                    "image-to-video student of two experts (not supported yet): export a stage whose contract stock "
                    "WanPipeline samples (export.student: teacher)")


def name_own_pipeline(folder: Path) -> bool:
    """Where ``folder/sampling.json`` is a contract stock ``WanPipeline`` does not sample (:func:`stock_samples`),
    set ``folder/model_index.json``'s ``_class_name`` to the family's own pipeline (:data:`OWN_PIPELINES`: Wan's
    :data:`OWN_PIPELINE`, module doc; Cosmos Predict 2.5's ``pipeline_cosmos.py``); returns whether it did.
    The rest of the index is kept as it is, key order included."""
    contract = json.loads((folder / "sampling.json").read_text())
    if stock_samples(contract, records_sparse(folder / "transformer")):
        return False
    index = json.loads((folder / INDEX_FILE).read_text())
    index["_class_name"] = list(OWN_PIPELINES.get(index.get("_class_name"), OWN_PIPELINE))
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return True


def write_export_code(folder: Path) -> dict[str, str]:
    """Copy every shipped module into ``folder`` (top level) and, where its ``sampling.json`` needs them, name
    its own pipeline in its ``model_index.json`` (:func:`name_own_pipeline`); returns ``{file name: sha256}``
    of the modules written."""
    record = {}
    for name, source in shipped_sources().items():
        shutil.copyfile(source, folder / name)
        record[name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    if (folder / "sampling.json").is_file() and (folder / INDEX_FILE).is_file():
        name_own_pipeline(folder)
    return record
