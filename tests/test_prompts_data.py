"""Prompt-only data (issue 42 item 2): a prompts file as the data of the distillation stages — text embeddings only,
no videos — with the latents' trust checks and incremental redo.

- the file's checks (binary, invalid UTF-8, a huge line, empty, too large, a FIFO, bad JSONL): one line each;
- the encoded set: the latent set's text columns, read by the one reader (``read_text_embeddings``) from either
  artifact; a changed prompt re-encodes its shard only; the latent shape derived from the frames, size and VAE;
- DMD2 and Self-Forcing (``simulate``) and PDD (``simulate``) train on a prompt-only set exactly as on a latent set
  with the same prompt embeddings (the same losses, bit for bit: ``simulate`` never read a latent); a method that
  reads video latents (``rollout: data_latent``) is one line before any model loads;
- through the DAG (slow): ``prompts → distill`` with DMD2 and Self-Forcing under torchrun, `dvc status` after a
  changed prompt names only what reads prompts, the rerun re-encodes one shard, and a hostile file is exit 2.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import prompt_twin, run_config, train_in_process

from distillery.common.errors import UserError
from distillery.data import LatentDataset, read_text_embeddings
from distillery.data.prompts import PromptsConfig, encode_prompts_file, read_prompts
from distillery.models.registry import latent_shape_for

CAPTIONS = ["a red circle moving left on a black background", "a blue square moving up on a white background",
            "a green triangle moving right on a gray background", "a yellow circle moving down slowly on a black background",
            "a cyan square moving left quickly on a white background"]


# -- the file's checks -------------------------------------------------------------------------------------
def _refused(path: Path, match: str, **limits) -> str:
    with pytest.raises(UserError, match=match) as info:
        read_prompts(path, **limits)
    line = str(info.value)
    assert "\n" not in line and str(path) in line
    return line


def test_a_plain_and_a_jsonl_prompts_file_read_in_order(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("  first prompt \n\n\r\nsecond prompt\r\n", encoding="utf-8")
    assert [(p.line, p.text, p.id) for p in read_prompts(text)] == [(1, "first prompt", "line-00000001"),
                                                                    (4, "second prompt", "line-00000004")]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "one"}\n\n{"caption": "two", "extra": 1}\n', encoding="utf-8")
    assert [(p.line, p.text) for p in read_prompts(jsonl)] == [(1, "one"), (3, "two")]


def test_hostile_prompts_files_are_one_line_each(tmp_path):
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"a prompt\n\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    _refused(binary, "line 4: a NUL byte: a binary file")  # the PNG signature holds two newlines
    latin = tmp_path / "latin.txt"
    latin.write_bytes("ok\nstill ok\ncaf\xe9 au lait\n".encode("latin-1"))
    _refused(latin, "line 3: not valid UTF-8")
    huge = tmp_path / "huge.txt"
    huge.write_text("short\n" + "x" * 20_001 + "\n", encoding="utf-8")
    _refused(huge, "line 2: 20001 characters, more than the limit of 20000", max_prompt_chars=20_000)
    big = tmp_path / "big.txt"
    big.write_text("p\n" * 600, encoding="utf-8")
    _refused(big, "1200 bytes, more than the limit of 1000", max_file_bytes=1000)
    for name, content in (("empty.txt", ""), ("blank.txt", "\n  \n\t\n")):
        (tmp_path / name).write_text(content, encoding="utf-8")
        _refused(tmp_path / name, "lists no prompts")
    fifo = tmp_path / "fifo.txt"
    os.mkfifo(fifo)
    _refused(fifo, "not a regular file")  # refused without blocking on a writer that never comes
    _refused(tmp_path / "absent.txt", "cannot be opened")
    for content, match in (('{"prompt": "ok"}\n[1, 2]\n', "line 2: a JSON list"), ('{"prompt": ""}\n', "line 1: no non-empty"),
                           ('{"text": "x"}\n', "line 1: no non-empty"), ("{not json\n", "line 1: not a JSON object")):
        (tmp_path / "bad.jsonl").write_text(content, encoding="utf-8")
        _refused(tmp_path / "bad.jsonl", match)


# -- encoding ----------------------------------------------------------------------------------------------
def test_the_latent_shape_is_the_vae_s_of_the_frames_and_size(tiny_base):
    assert latent_shape_for(tiny_base, 17, 32, 32, "prompts") == [8, 5, 8, 8]  # the tiny VAE: z_dim 8, ×4 in time and space
    assert latent_shape_for(tiny_base, 9, 32, 64, "prompts") == [8, 3, 8, 16]
    with pytest.raises(UserError, match="^prompts: 16 frames: .*4k\\+1 frames"):
        latent_shape_for(tiny_base, 16, 32, 32, "prompts")
    with pytest.raises(UserError, match="multiples of 4"):
        latent_shape_for(tiny_base, 17, 30, 32, "prompts")


SHAPE = [8, 5, 8, 8]  # the tiny VAE's latent of PromptsConfig()'s 17 frames of 32x32


def _shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "train").glob("shard-*.parquet"))}


def test_a_changed_prompt_re_encodes_its_shard_only(tiny_base, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(CAPTIONS) + "\n", encoding="utf-8")
    out = tmp_path / "set"
    cfg = PromptsConfig(rows_per_shard=2)
    first = encode_prompts_file(tiny_base, prompts, out, cfg, SHAPE)
    assert first["prompts_this_run"] == 5 and first["kind"] == "prompts" and first["latent_shape"] == [8, 5, 8, 8]
    data = read_text_embeddings(out)
    assert [data[i]["caption"] for i in range(len(data))] == CAPTIONS and "latents" not in data[0]
    assert data[0]["text_embedding"].shape[1] == first["text_dim"] == 32
    before = _shard_bytes(out)
    assert encode_prompts_file(tiny_base, prompts, out, cfg, SHAPE)["prompts_this_run"] == 0  # nothing changed: nothing encoded
    changed = CAPTIONS[:2] + ["a red square moving up quickly on a gray background"] + CAPTIONS[3:]
    prompts.write_text("\n".join(changed) + "\n", encoding="utf-8")
    again = encode_prompts_file(tiny_base, prompts, out, cfg, SHAPE)
    after = _shard_bytes(out)
    assert again["prompts_this_run"] == 2  # shard 1 (prompts 3 and 4) only
    assert after["shard-00000.parquet"] == before["shard-00000.parquet"]
    assert after["shard-00002.parquet"] == before["shard-00002.parquet"]
    assert after["shard-00001.parquet"] != before["shard-00001.parquet"]
    data = read_text_embeddings(out)
    assert data[2]["caption"] == changed[2] and data[3]["caption"] == changed[3]
    # a removed prompt drops the shard the plan no longer has
    prompts.write_text("\n".join(changed[:4]) + "\n", encoding="utf-8")
    assert encode_prompts_file(tiny_base, prompts, out, cfg, SHAPE)["prompts_this_run"] == 0
    assert sorted(_shard_bytes(out)) == ["shard-00000.parquet", "shard-00001.parquet"] and len(read_text_embeddings(out)) == 4


def test_a_prompt_set_is_refused_to_a_reader_of_latents(tiny_base, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(CAPTIONS[0] + "\n", encoding="utf-8")
    encode_prompts_file(tiny_base, prompts, tmp_path / "set", PromptsConfig(), SHAPE)
    with pytest.raises(UserError, match="holds prompt embeddings only \\(no video latents\\)"):
        LatentDataset(tmp_path / "set")


# -- training from prompts only --------------------------------------------------------------------------
def _distill(base: Path, data: Path, out: Path, method: str, **knobs) -> dict:
    targets = {"dmd2": "distillery.methods.dmd2.DMD2Method", "self_forcing": "distillery.methods.self_forcing.SelfForcingMethod",
               "pdd": "distillery.methods.pdd.PDDMethod"}
    wan = "distillery.models.wan.WanModel"
    if method == "pdd":
        cfg = run_config(base, data, out, method=targets[method], steps=3, batch_size=4,
                         method_knobs={"rollout": "simulate", "block_size_min": 2, "block_size_max": 4,
                                       "teacher_guidance_scale": 2.0, "sampling_steps": 2, **knobs})
        cfg["models"]["student"] = {"_target_": "distillery.models.wan.PDDWanModel", "init_from": str(base), "pdd_steps": 4}
    else:
        cfg = run_config(base, data, out, method=targets[method], steps=3, batch_size=4,
                         method_knobs={"generator_update_interval": 2, "real_score_guidance_scale": 2.0, **knobs})
        cfg["models"]["critic"] = {"_target_": wan, "init_from": str(base)}
    if method == "self_forcing":
        cfg["models"]["student"] = {"_target_": "distillery.models.wan.CausalWanModel", "init_from": str(base), "chunk_size": 2}
    cfg["models"]["teacher"] = {"_target_": wan, "init_from": str(base), "trainable": False}
    return cfg


@pytest.mark.parametrize("method", ["dmd2", "self_forcing", "pdd"])
def test_simulate_trains_on_prompts_only_as_on_the_latent_set(tiny_base, latent_set, tmp_path, method):
    """The same prompt embeddings with and without video latents: the same losses bit for bit (``simulate`` reads
    the batch's shape and prompts only), and the prompt-only run's batches never held a latent."""
    twin = prompt_twin(latent_set, tmp_path / "twin")
    timing = ("step_time_s", "samples_per_s")
    on_latents, on_prompts = ([{k: v for k, v in row.items() if k not in timing} for row in train_in_process(cfg).history]
                              for cfg in (_distill(tiny_base, latent_set, tmp_path / "a", method),
                                          _distill(tiny_base, twin, tmp_path / "b", method)))
    assert len(on_prompts) == 3 and on_prompts == on_latents
    assert all(torch.isfinite(torch.tensor(r["total_loss"])) for r in on_prompts)


def test_a_batch_of_prompts_draws_what_a_batch_of_latents_of_its_shape_draws(tiny_base):
    """``prepare_batch`` without latents: the same timesteps and noise as with latents of the batch's shape (so a
    ``simulate`` rollout is the same on either set), and no clean or noised latents."""
    from distillery.components.rng import BatchRNG
    from distillery.models.wan import WanModel, WanModelConfig

    model = WanModel(WanModelConfig(init_from=str(tiny_base)), "student")
    text = torch.randn(3, 8, 32)
    with_latents = model.prepare_batch({"latents": torch.randn(3, 8, 5, 8, 8), "text_embeds": text}, BatchRNG(7))
    prompts_only = model.prepare_batch({"latent_shape": (8, 5, 8, 8), "text_embeds": text}, BatchRNG(7))
    assert torch.equal(with_latents.noise, prompts_only.noise) and torch.equal(with_latents.timesteps, prompts_only.timesteps)
    assert prompts_only.latents is None and prompts_only.noisy_latents is None
    with pytest.raises(ValueError, match="needs latent_shape"):
        model.prepare_batch({"text_embeds": text}, BatchRNG(7))


def test_a_method_that_reads_video_latents_is_refused_a_prompt_set_before_any_model_loads(tiny_base, latent_set, tmp_path,
                                                                                         monkeypatch):
    from distillery.models.wan import WanModel

    twin = prompt_twin(latent_set, tmp_path / "twin")
    monkeypatch.setattr(WanModel, "__init__", lambda *a, **k: (_ for _ in ()).throw(AssertionError("a model was loaded")))
    for method, knobs in (("dmd2", {"rollout": "data_latent"}), ("pdd", {"rollout": "data_latent"})):
        with pytest.raises(UserError, match="holds prompt embeddings only .*rollout: data_latent trains on video latents") as info:
            train_in_process(_distill(tiny_base, twin, tmp_path / method, method, **knobs))
        assert "\n" not in str(info.value)
    sft = run_config(tiny_base, twin, tmp_path / "sft")  # SFT regresses onto video latents
    with pytest.raises(UserError, match="SFTMethod trains on video latents"):
        train_in_process(sft)


def test_a_latent_shape_that_is_not_the_set_s_is_one_line(tiny_base, latent_set, tmp_path):
    twin = prompt_twin(latent_set, tmp_path / "twin")
    cfg = _distill(tiny_base, twin, tmp_path / "run", "dmd2")
    cfg["training"]["data"]["latent_shape"] = [8, 5, 8, 8]
    with pytest.raises(UserError, match=r"training.data.latent_shape: \[8, 5, 8, 8\] differs from the \[8, 3, 8, 8\]"):
        train_in_process(cfg)


def test_the_first_stage_checks_a_prompt_trained_stage_s_batch_against_the_prompts(tmp_path):
    """The batch check before any work counts the prompts for a stage that trains on them (not the videos)."""
    import yaml

    from distillery.pipeline.launch.preflight import check_batch
    from distillery.pipeline.launch.runner import STAGES
    from distillery.pipeline.params.reader import Params

    (tmp_path / "prompts.txt").write_text("one\n\ntwo\nthree\n", encoding="utf-8")
    shipped = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    shipped["prompts"]["path"] = str(tmp_path / "prompts.txt")
    shipped["distill"].update(batch_size=4, data="latents")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(shipped))
    check_batch("clips", Params.load(tmp_path / "params.yaml"), tmp_path / "artifacts", stages=tuple(STAGES))  # 96 clips
    shipped["distill"]["data"] = "prompts"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(shipped))
    with pytest.raises(UserError, match=f"distill.batch_size 4 is more than the 3 training samples \\(the 3 prompts of "
                                        f"{tmp_path / 'prompts.txt'}\\)"):
        check_batch("clips", Params.load(tmp_path / "params.yaml"), tmp_path / "artifacts", stages=tuple(STAGES))
    for hostile in (b"", b"a\n\x00b\nc\nd\ne\n"):  # nothing to count, or a binary file: the prompts stage names it, not this check
        (tmp_path / "prompts.txt").write_bytes(hostile)
        check_batch("clips", Params.load(tmp_path / "params.yaml"), tmp_path / "artifacts", stages=tuple(STAGES))


def test_in_training_validation_reads_a_prompt_set_s_prompts_and_shape(latent_set, tmp_path):
    from distillery.callbacks.validation import ValidationPrompts

    twin = prompt_twin(latent_set, tmp_path / "twin")
    on_latents, on_prompts = (ValidationPrompts.read(root, None, 3, 8) for root in (latent_set, twin))
    assert on_prompts.latent_shape == on_latents.latent_shape == (8, 3, 8, 8)
    assert on_prompts.captions == on_latents.captions and torch.equal(on_prompts.text_embeds, on_latents.text_embeds)
