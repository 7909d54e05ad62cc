"""The method conformance kit: every registered (stage, method) — a module ``stages/recipes/<stage>/<method>.py`` —
passes the same checks, with no test code of its own (a new method joins the kit by joining the registry):

1. **builds**: its recipe builds the run config the stage's own path builds (:func:`stages.training.stage_run_config`
   over the workspace's typed ``params.yaml``, its ``prepare`` first — ``ode_init``'s trajectories —), checked against
   its inputs as the stage checks it (:func:`~distillery.pipeline.launch.run_config.check_run_config`);
2. **steps**: on the tiny Wan (the session's ``prepared`` workspace: its base as every init, its latents), 1 rank,
   :data:`STEPS` steps, every logged loss finite;
3. **resumes bitwise**: stopped after step 1 and resumed, it ends where the uninterrupted run ends — every tensor of
   its last checkpoint (roles, optimizers, callbacks, shadow weights) and every logged loss equal (DiffusionNFT: stopped
   in the middle of a rollout group);
4. **1 rank ≡ 2 ranks**: on 2 gloo ranks (half the per-rank batch: the same global batch; every case in one torchrun
   launch) it logs the same values and ends with the same weights, within fp32 tolerance (AdamW's: an element whose
   gradient is ~0 moves by up to the learning rate either way);
5. **its sampling contract loads in validate and in the export**: the model the stage publishes
   (:func:`stages.training.publish_model`) samples by its ``sampling.json`` through the sampler registry over its
   family's loader (validate's) and through the export's shipped samplers over the shipped denoiser — the same latents,
   bit for bit.

Besides each registered method, :data:`VARIANTS` runs a method with knobs that add trained state of their own (the
discriminator head of ``distill.gan_weight``, the collapse watch's baseline and best) through the same checks.

A recipe whose base must have two experts (its module's ``EXPERTS = 2``: ``distill.method: phased_dmd``) runs on the tiny
Wan 2.2 A14B instead: a copy of the workspace whose stage artifacts hold its two experts and boundary (a given folder
laid out as the stages lay it out), the same latents.

Cost on 2 cores: the 1-rank runs in this process (3 per case), the 2-rank runs in one torchrun launch per workspace.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from helpers import dcp_tensors, read_log, shipped_denoiser, train_in_process
from torchrun_each import torchrun_each
from workspace import copy_workspace, set_params

from stages.recipes import registry

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]  # the first test builds every case (the module's kit)
STEPS = 2
VARIANTS = {  # (stage, method, variant) -> the params it sets beside <stage>.method: knobs that add trained state
    ("distill", "dmd2", "gan"): {"distill.gan_weight": 0.1},  # the discriminator head, trained in the critic's step
    ("distill", "self_forcing", "gan+collapse"): {"distill.gan_weight": 0.1, "distill.collapse_every": 1},  # + the watch's state
    ("distill", "phased_dmd", "collapse"): {"distill.collapse_every": 1, "distill.guidance_scale_2": 3.0},  # the watch over two experts, both teacher scales
}
CASES = [(stage, method, "") for stage, methods in registry().items() for method in methods] + list(VARIANTS)
INITS = ("teacher", "pretrain", "distill")  # every init a stage's artifact names: the tiny base's weights (or the A14B's)
KIT_PARAMS = {  # every training stage small; the ODE-init recipes' trajectories few; posttrain's rollouts short
    **{f"{stage}.{key}": value for stage in ("teacher", "pretrain", "distill", "pdd", "posttrain")
       for key, value in (("steps", STEPS), ("batch_size", 2), ("save_every", 1))},
    "pretrain.teacher_steps": 2, "pretrain.trajectory_rows_per_shard": 8, "pretrain.trajectory_batch_size": 4,
    "posttrain.samples_per_prompt": 2, "posttrain.rollout_steps": 2}


def _build(ws: Path, stage: str, method: str, variant: str = ""):
    """The run config ``stage``'s own path builds with ``<stage>.method: method`` (and the ``variant``'s params,
    :data:`VARIANTS`) in workspace ``ws`` (cwd); the workspace's params as they were afterwards."""
    from distillery.pipeline.dvcfile import stage_params
    from distillery.pipeline.launch.run_config import check_run_config
    from distillery.pipeline.params.reader import Params, StageParams
    from distillery.pipeline.params.recipes import prepared_data
    from stages.training import stage_run_config

    before = (ws / "params.yaml").read_text()
    set_params(ws, {f"{stage}.method": method, **VARIANTS.get((stage, method, variant), {})})
    view = StageParams(Params.load(ws / "params.yaml"), stage, stage_params(stage))
    prepared = prepared_data(view.recipe(), getattr(view.typed, stage), view)
    config, roles = stage_run_config(view, "", prepared)
    check_run_config(stage, config, roles)
    (ws / "params.yaml").write_text(before)
    return config


def _variant(config, output_dir: Path, *, stop_at: int | None = None, ranks: int = 1):
    """``config`` writing into ``output_dir``, untracked, no progress line; stopped at ``stop_at``; its per-rank batch
    for ``ranks`` ranks (the same global batch)."""
    from distillery.config.schema import TrackerConfig

    t = config.training
    training = dataclasses.replace(
        t, tracker=TrackerConfig(backend="none"),
        checkpoint=dataclasses.replace(t.checkpoint, output_dir=str(output_dir), keep_last=0),
        loop=dataclasses.replace(t.loop, progress_bar=False, stop_at_step=stop_at),
        data=dataclasses.replace(t.data, batch_size=t.data.batch_size // ranks))
    return dataclasses.replace(config, training=training)


def _experts(stage: str, method: str) -> int:
    """The experts the recipe's base must have (its ``EXPERTS``; 1 unless it says)."""
    return getattr(registry()[stage][method], "EXPERTS", 1)


def _workspace(prepared: Path, ws: Path, experts: int, root: Path) -> Path:
    """A copy of ``prepared`` whose stage artifacts (:data:`INITS`) hold the tiny base's transformer and scheduler — or,
    for ``experts`` 2, the tiny Wan 2.2 A14B's two experts and boundary, laid out as a given folder is
    (:func:`~distillery.models.wan.experts.lay_out_given_model`) —, with the kit's params."""
    from distillery.models.schedule import read_scheduler_shift
    from distillery.models.wan import lay_out_given_model
    from distillery.tinybase.wan22 import make_tiny_wan22

    copy_workspace(prepared, ws)
    source = ws / "artifacts" / "base" / "model" if experts == 1 else make_tiny_wan22(root / "a14b", "a14b")
    for stage in INITS:
        model = ws / "artifacts" / stage / "model"
        if experts == 1:
            shutil.copytree(source / "transformer", model / "transformer")
        else:
            lay_out_given_model(source, model, shutil.copytree)
        shutil.copytree(source / "scheduler", model / "scheduler")
    student = ws / "artifacts" / "distill" / "model"  # posttrain's student samples as a given model: Euler, own schedule
    (student / "sampling.json").write_text(json.dumps(
        {"sampler": "euler", "shift": read_scheduler_shift(student / "scheduler"), "num_train_timesteps": 1000}))
    set_params(ws, KIT_PARAMS)
    return ws


@pytest.fixture(scope="module")
def kit(prepared, tmp_path_factory, monkeypatch_module):
    """Every case built and run: ``{case: (config, folder, workspace)}`` — ``folder/full`` uninterrupted,
    ``folder/resumed`` stopped after step 1 and resumed, ``folder/two`` on 2 ranks."""
    root = tmp_path_factory.mktemp("conformance")
    spaces = {n: _workspace(prepared, root / ("ws" if n == 1 else f"ws-{n}-experts"), n, root)
              for n in sorted({_experts(stage, method) for stage, method, _ in CASES})}
    built, launches = {}, {n: [] for n in spaces}
    for stage, method, variant in CASES:
        n = _experts(stage, method)
        ws = spaces[n]
        monkeypatch_module.chdir(ws)
        config = _build(ws, stage, method, variant)
        folder = root / f"{stage}-{method}{'-' + variant if variant else ''}"
        train_in_process(_variant(config, folder / "full").to_plain())
        train_in_process(_variant(config, folder / "resumed", stop_at=1).to_plain())
        train_in_process(_variant(config, folder / "resumed").to_plain())
        launches[n].append((_variant(config, folder / "two", ranks=2).to_plain(), ws / f"kit-{folder.name}.yaml"))
        built[(stage, method, variant)] = (config, folder, ws)
    for launch in launches.values():  # each in its workspace (its config's paths are the workspace's)
        torchrun_each(launch)
    return built


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _logged(folder: Path) -> list[dict[str, float]]:
    """The run's logged rows without their wall-clock figures (``step_time_s``, ``samples_per_s``)."""
    return [{k: v for k, v in row.items() if not k.endswith("_s")} for row in read_log(folder)]


def _last(folder: Path) -> Path:
    return folder / f"checkpoint-{STEPS}"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, a NaN equal to a NaN in its place (a callback's "none yet" holds NaNs)."""
    return torch.equal(a, b) or (a.is_floating_point() and a.shape == b.shape and a.dtype == b.dtype
                                 and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


def _saved(checkpoint: Path) -> dict[str, torch.Tensor]:
    return dcp_tensors(checkpoint, ("roles.", "optimizers.", "schedulers.", "callbacks.", "shadows.", "method."))


def _samples(model: Path, latent_shape: list[int], text_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The latents ``model``'s ``sampling.json`` gives through validate's sampler (the registry, the family's loader)
    and through the export's shipped sampler and denoiser, from the same noise."""
    from distillery.evaluation.candidates import Candidate
    from distillery.export.standalone import distilled_samplers, distilled_wan
    from distillery.models.base import Conditioning
    from distillery.models.registry import load_inference_model

    contract = json.loads((model / "sampling.json").read_text())
    candidate = Candidate.from_artifact("kit", model)  # validate's reading of the contract
    package = candidate.build_sampler(candidate.shift)
    steps = 2 if "timesteps" not in contract and "num_steps" not in contract else None  # a many-step contract: 2 of them
    gen = torch.Generator().manual_seed(11)
    text, negative = torch.randn(1, text_length, 32, generator=gen), torch.randn(1, text_length, 32, generator=gen)
    plugin = load_inference_model(model, shift=package.shift, role="validate", **package.model_options())
    expected = package.sample(plugin, Conditioning(text, negative), tuple(latent_shape), torch.Generator().manual_seed(5),
                              num_steps=steps, guidance_scale=None)
    shipped = distilled_samplers.build_sampler(contract)
    got = shipped.sample(shipped_denoiser(model, shipped.model_kind()), distilled_wan.Conditioning(text, negative),
                         tuple(latent_shape), torch.Generator().manual_seed(5), num_steps=steps, guidance_scale=None)
    return expected, got


@pytest.mark.parametrize("stage,method,variant", CASES)
def test_method_conforms(kit, stage, method, variant, monkeypatch):
    from distillery.pipeline.publish.run_summary import read_run_summary
    from stages.training import publish_model

    config, folder, ws = kit[(stage, method, variant)]
    monkeypatch.chdir(ws)  # its workspace: the artifacts its config names
    full = read_log(folder / "full")  # 2. it steps: finite losses on every step
    assert [r["step"] for r in full] == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for r in full for k, v in r.items() if k.endswith("_loss")), full
    # 3. stopped and resumed: bitwise the uninterrupted run
    reference, resumed = _saved(_last(folder / "full")), _saved(_last(folder / "resumed"))
    assert reference.keys() == resumed.keys() and any(k.startswith("roles.student.") for k in reference)
    unequal = [k for k in reference if not _same_bits(reference[k], resumed[k])]
    assert not unequal, f"{stage}/{method}: resumed differs in {unequal[:5]}"
    assert _logged(folder / "resumed") == _logged(folder / "full")
    # 4. 1 rank ≡ 2 ranks (the same global batch), within fp32 tolerance: every logged value (losses, gradient norms,
    # draws) to 1e-4; every trained weight to 1e-4 relative or the run's peak learning rate absolute — AdamW moves an
    # element by about the learning rate a step whatever its gradient, so one whose gradient is ~0 moves by ±lr as the
    # reduction order rounds it
    for one, other in zip(_logged(folder / "full"), _logged(folder / "two"), strict=True):
        assert other.keys() == one.keys()
        assert all(other[k] == pytest.approx(one[k], rel=1e-4, abs=1e-6) for k in one), (stage, method, one, other)
    two = _saved(_last(folder / "two"))
    roles = [k for k in reference if k.startswith("roles.")]
    assert roles and set(roles) <= two.keys()
    lr = max([config.training.optimizer.learning_rate] + [m.optimizer.learning_rate for m in config.models.values()
                                                          if m.optimizer is not None and m.optimizer.learning_rate])
    far = [k for k in roles if not torch.allclose(reference[k], two[k], rtol=1e-4, atol=lr)]
    assert not far, f"{stage}/{method}: 2 ranks differ from 1 in {far[:5]}"
    # 5. the published model's sampling contract: validate's sampler and the export's give the same latents
    model = folder / "model"
    run = _variant(config, folder / "full")
    publish_model(read_run_summary(folder / "full"), run, model)
    manifest = json.loads(Path("artifacts/latents/data/preprocess.json").read_text())  # what the models generate
    expected, got = _samples(model, manifest["latent_shape"], int(manifest["settings"]["max_sequence_length"]))
    assert got.shape == expected.shape and torch.isfinite(got).all()
    assert torch.equal(got, expected), (stage, method, (got - expected).abs().max())
