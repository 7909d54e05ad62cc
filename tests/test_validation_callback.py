"""The in-training validation callback, hooks called directly: a real tiny Wan role, a real MLflow run
on a temp store, a tiny latent set whose captions the analyzer understands."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distillery.callbacks.base import CallbackContext
from distillery.callbacks.validation import ValidationCallback, ValidationCallbackConfig, ValidationPrompts
from distillery.common.errors import UserError
from distillery.components.tracking import MLflowTracker, NullTracker
from distillery.config.schema import TrackerConfig
from distillery.models.wan import WanModel, WanModelConfig
from distillery.sampling import build_sampler
from distillery.tinybase.shipped import shipped_tiny_base

CAPTIONS = [
    "a red circle moving left slowly on a black background",
    "a blue square moving up quickly on a black background",
    "a yellow triangle moving right slowly on a black background",
]
LATENT_SHAPE = (8, 3, 8, 8)  # tiny base VAE: 9 frames × 32 × 32
CONTRACT = {"sampler": "few_step_x0", "shift": 3.0, "num_train_timesteps": 1000, "timesteps": [1000.0, 500.0]}


@pytest.fixture(scope="module")
def latent_set(tmp_path_factory) -> Path:
    """Captions with their real text embeddings (the base's encoder); the latents only give the shape."""
    from distillery.data import LatentRecord, write_empty_prompt_embedding, write_latent_shards
    from distillery.data.encoders import BaseEncoders

    root = tmp_path_factory.mktemp("latents") / "data"
    enc = BaseEncoders(shipped_tiny_base())
    embeds = enc.encode_prompts(CAPTIONS + [""])
    records = [LatentRecord(id=f"v{i}", caption=c, latent=torch.zeros(LATENT_SHAPE), text_embedding=e, num_frames=9,
                            height=32, width=32, fps=8.0, source="test") for i, (c, e) in enumerate(zip(CAPTIONS, embeds))]
    write_latent_shards(records[:1], root, rows_per_shard=4, split="train")
    write_latent_shards(records, root, rows_per_shard=4, split="validation")
    write_empty_prompt_embedding(root, embeds[-1])
    return root


@pytest.fixture(scope="module")
def student() -> WanModel:
    model = WanModel(WanModelConfig(init_from=str(shipped_tiny_base()), trainable=False), role="student")
    model.bind_device(torch.device("cpu"))
    return model


SCORER = "distillery.clips.analyzer.folder_scorer"  # the pipeline's analyzer, a plugin the run config names


def make_callback(latent_set: Path, **kw) -> ValidationCallback:
    kw = {"every_steps": 2, "num_prompts": 2, "text_max_length": 32, "vae_from": str(shipped_tiny_base()), "scorer": SCORER, **kw}
    cfg = ValidationCallbackConfig(data_path=str(latent_set), **kw)
    return ValidationCallback(cfg, "validation")


def test_metrics_and_grid_arrive_in_the_mlflow_run_on_validation_steps_only(latent_set, student, tmp_path):
    import imageio.v3 as iio

    tracker = MLflowTracker(TrackerConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="val-cb"))
    ctx = CallbackContext(roles={"student": student}, rank=0, world_size=1, max_train_steps=5, sampling=CONTRACT,
                          tracker=tracker)
    cb = make_callback(latent_set)
    student.transformer.train()  # the callback samples in eval mode and gives the module back as it was
    cb.on_loop_start(ctx, 0)
    for step in range(1, 6):
        assert cb.on_training_step_end(ctx, step) == {}
    assert student.transformer.training
    client, run = tracker.client, tracker.run_id
    metrics = client.get_run(run).data.metrics
    expected = {"val/latent_std", "val/latent_mean", "val/sample_s", "val/nfe", "val/decode_s",
                "val/colour", "val/shape", "val/direction", "val/adherence"}
    assert set(metrics) == expected
    for key in expected:
        assert [m.step for m in client.get_metric_history(run, key)] == [0, 2, 4], key  # nothing on steps 1, 3, 5
    history = client.get_metric_history(run, "val/latent_std")
    assert len({m.value for m in history}) == 1  # fixed prompts and seeds, frozen weights: the same samples
    assert metrics["val/nfe"] == 2.0 and all(0.0 <= metrics[f"val/{k}"] <= 1.0 for k in ("colour", "adherence"))
    # the latents are the registered sampler's for prompt i from a generator seeded seed + i
    prompts = ValidationPrompts.read(latent_set, None, 2, 32)
    assert prompts.captions == CAPTIONS[:2] and prompts.latent_shape == LATENT_SHAPE  # the validation split
    with torch.no_grad():
        latents = build_sampler(CONTRACT).sample(student, prompts.conditioning(), LATENT_SHAPE,
                                                 [torch.Generator().manual_seed(i) for i in range(2)])
    assert metrics["val/latent_std"] == pytest.approx(float(latents.std()), rel=1e-6)
    arts = sorted(a.path for a in client.list_artifacts(run, "validation"))
    assert arts == ["validation/step_000000.gif", "validation/step_000002.gif", "validation/step_000004.gif"]
    local = client.download_artifacts(run, "validation/step_000002.gif", str(tmp_path / "dl"))
    grid = iio.imread(local, index=None)
    assert grid.shape[:3] == (9, 32, 2 * 33 - 1)  # 9 frames, one row of two 32×32 tiles and a 1-px separator
    tracker.finish()


def test_other_ranks_sample_but_do_not_log_and_a_resume_does_not_revalidate(latent_set, student):
    cb = make_callback(latent_set, vae_from=None)
    ctx = CallbackContext(roles={"student": student}, rank=1, world_size=2, max_train_steps=4, sampling=CONTRACT,
                          tracker=NullTracker())
    metrics = cb.validate(ctx, 2)
    assert set(metrics) == {"val/latent_std", "val/latent_mean", "val/sample_s", "val/nfe"}
    cb._prompts = None
    cb.on_loop_start(ctx, 3)  # resumed at step 3: no validation (prompts never read)
    assert cb._prompts is None


def test_config_and_role_errors(latent_set, student):
    with pytest.raises(ValueError, match="data_path"):
        ValidationCallbackConfig()
    with pytest.raises(ValueError, match="every_steps"):
        ValidationCallbackConfig(data_path=str(latent_set), every_steps=0)
    cb = make_callback(latent_set, role="critic")
    ctx = CallbackContext(roles={"student": student}, rank=0, world_size=1, max_train_steps=4, sampling=CONTRACT)
    with pytest.raises(UserError, match="'critic' is not a role"):
        cb.on_loop_start(ctx, 0)


def _run_config(latent_set: Path, scorer) -> dict:
    return {"models": {"student": {"_target_": "distillery.models.wan.WanModel", "init_from": str(shipped_tiny_base())}},
            "method": {"_target_": "distillery.methods.sft.SFTMethod"},
            "callbacks": {"validation": {"_target_": "distillery.callbacks.validation.ValidationCallback",
                                         "data_path": str(latent_set), "num_prompts": 2, "text_max_length": 32,
                                         "vae_from": str(shipped_tiny_base()), "scorer": scorer}}}


def test_the_scorer_is_a_plugin_the_run_config_names_resolved_under_the_allowed_prefixes(latent_set, student):
    """The run config names the scorer; the config loader resolves it (the builder hands it over), so the
    library's callback never imports the pipeline's analyzer; with no scorer the videos are logged unscored."""
    from distillery.clips.analyzer import folder_scorer
    from distillery.config import allowed_prefixes, load_run_config
    from distillery.engine.builder import build_callbacks

    config = load_run_config(raw=_run_config(latent_set, SCORER), prefixes=allowed_prefixes())
    assert config.callbacks["validation"].plugins == {"scorer": folder_scorer}
    assert config.callbacks["validation"].to_plain()["scorer"] == SCORER  # the dumped config keeps the path
    [cb] = list(build_callbacks(config))
    ctx = CallbackContext(roles={"student": student}, rank=0, world_size=1, max_train_steps=4, sampling=CONTRACT)
    scored = cb.validate(ctx, 0)
    assert {"val/colour", "val/shape", "val/direction", "val/adherence"} <= set(scored)
    unscored = make_callback(latent_set, scorer=None).validate(ctx, 0)
    assert not {"val/colour", "val/adherence"} & set(unscored) and "val/decode_s" in unscored
    assert unscored["val/latent_std"] == scored["val/latent_std"]


@pytest.mark.parametrize("scorer, message", [
    ("os.system", "outside the allowed prefixes"),
    ("distillery.clips.analyzer.no_such_scorer", "does not exist"),
    ("not a path", "expected a dotted path"),
])
def test_a_bad_scorer_is_one_line_when_the_config_is_built(latent_set, scorer, message):
    from distillery.config import allowed_prefixes, load_run_config

    with pytest.raises(UserError, match=message) as err:
        load_run_config(raw=_run_config(latent_set, scorer), prefixes=allowed_prefixes())
    assert "callbacks.validation.scorer" in str(err.value) and "\n" not in str(err.value)
