"""Our VBench dimensions equal vbench 0.1.5's own code on the same frames and the same weights.

``tests/vbench_faithfulness/reference.json`` was recorded by ``make_reference.py`` in a venv of vbench's pins (vbench
0.1.5, transformers 4.33.2, numpy < 2, torch 2.14.1 + torchvision 0.29.1, pyiqa 0.1.13; the module doc there says how
to rebuild it): vbench's functions and model classes on two synthetic clips and a decoded sample of the tiny student,
with weights that ``common.fill`` makes from the recorded key → shape lists. Here the same weights go into our models
(DINO's and OpenAI's CLIP layouts mapped onto transformers' classes) and every per-video score and every dimension's
aggregate must agree within 1e-4 (dynamic degree: the same decision and each frame pair's flow score within 1e-4
relative).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent / "vbench_faithfulness"
sys.path.insert(0, str(HERE))
import common  # noqa: E402

pytestmark = pytest.mark.slow  # published-size RAFT, AMT-S and MUSIQ on the CPU: about a minute and a half
REFERENCE = json.loads((HERE / "reference.json").read_text())
TOL = 1e-4
DEVICE = torch.device("cpu")


def filled(key: str, seed: int, half: bool = False) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in common.fill(REFERENCE["shapes"][key], seed, half).items()}


def hf_clip_from_openai(state: dict[str, torch.Tensor]):
    """transformers' CLIPModel holding an OpenAI-layout CLIP state dict (sizes read from it; 64-wide heads)."""
    from transformers import CLIPConfig, CLIPModel

    def layers(prefix: str) -> int:
        return 1 + max(int(k[len(prefix):].split(".")[0]) for k in state if k.startswith(prefix))

    vw, tw = state["visual.conv1.weight"].shape[0], state["ln_final.weight"].shape[0]
    patch = state["visual.conv1.weight"].shape[-1]
    grid = round((state["visual.positional_embedding"].shape[0] - 1) ** 0.5)
    config = CLIPConfig(
        vision_config=dict(hidden_size=vw, num_hidden_layers=layers("visual.transformer.resblocks."), num_attention_heads=vw // 64,
                           intermediate_size=4 * vw, patch_size=patch, image_size=patch * grid, hidden_act="quick_gelu"),
        text_config=dict(hidden_size=tw, num_hidden_layers=layers("transformer.resblocks."), num_attention_heads=tw // 64,
                         intermediate_size=4 * tw, max_position_embeddings=state["positional_embedding"].shape[0],
                         vocab_size=state["token_embedding.weight"].shape[0], hidden_act="quick_gelu"),
        projection_dim=state["text_projection"].shape[1])
    out = {"logit_scale": state["logit_scale"], "visual_projection.weight": state["visual.proj"].T,
           "text_projection.weight": state["text_projection"].T,
           "vision_model.embeddings.class_embedding": state["visual.class_embedding"],
           "vision_model.embeddings.patch_embedding.weight": state["visual.conv1.weight"],
           "vision_model.embeddings.position_embedding.weight": state["visual.positional_embedding"],
           "text_model.embeddings.token_embedding.weight": state["token_embedding.weight"],
           "text_model.embeddings.position_embedding.weight": state["positional_embedding"]}
    for src, dst in (("visual.ln_pre", "vision_model.pre_layrnorm"), ("visual.ln_post", "vision_model.post_layernorm"),
                     ("ln_final", "text_model.final_layer_norm")):
        out[f"{dst}.weight"], out[f"{dst}.bias"] = state[f"{src}.weight"], state[f"{src}.bias"]
    for src_root, dst_root in (("visual.transformer.resblocks.", "vision_model.encoder.layers."),
                               ("transformer.resblocks.", "text_model.encoder.layers.")):
        for i in range(layers(src_root)):
            s, d = f"{src_root}{i}.", f"{dst_root}{i}."
            for part, src_key in (("weight", "in_proj_weight"), ("bias", "in_proj_bias")):
                q, k, v = state[s + f"attn.{src_key}"].chunk(3)
                out[d + f"self_attn.q_proj.{part}"], out[d + f"self_attn.k_proj.{part}"], out[d + f"self_attn.v_proj.{part}"] = q, k, v
            for a, b in (("attn.out_proj", "self_attn.out_proj"), ("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"),
                         ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
                out[d + f"{b}.weight"], out[d + f"{b}.bias"] = state[s + f"{a}.weight"], state[s + f"{a}.bias"]
    model = CLIPModel(config)
    model.load_state_dict(out, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def videos() -> dict[str, np.ndarray]:
    got = common.clips()
    assert set(got) == set(REFERENCE["videos"]), "the reference was recorded on other videos"
    return got


def close(ours: float, theirs: float, what: str) -> None:
    assert abs(ours - theirs) <= TOL, f"{what}: ours {ours!r} vs vbench {theirs!r}"


def check(dimension: str, ours: dict[str, float]) -> None:
    for name, value in ours.items():
        close(value, REFERENCE["videos"][name][dimension], f"{dimension} of {name}")


def test_subject_consistency(videos):
    from distillery.evaluation.vbench.consistency import subject_consistency
    from distillery.evaluation.vbench.dimensions import VideoScore, aggregate
    from distillery.evaluation.vbench.dino import use_dino_position_interpolation, vit_from_dino_state

    dino = use_dino_position_interpolation(vit_from_dino_state(filled("dino", common.SEED + 1))).eval()
    ours = {n: subject_consistency(dino, v, DEVICE) for n, v in videos.items()}
    check("subject_consistency", ours)
    rows = [VideoScore(n, "subject_consistency", s, v.shape[0] - 1) for (n, s), v in zip(ours.items(), videos.values())]
    close(aggregate(rows)["subject_consistency"], REFERENCE["aggregate"]["subject_consistency"], "its aggregate")


def test_background_consistency_and_aesthetic_quality(videos):
    from distillery.evaluation.vbench.appearance import aesthetic_quality
    from distillery.evaluation.vbench.consistency import background_consistency

    clip_b = hf_clip_from_openai(filled("clip_b32", common.SEED + 2, half=True))
    check("background_consistency", {n: background_consistency(clip_b, v, DEVICE) for n, v in videos.items()})
    clip_l = hf_clip_from_openai(filled("clip_l14", common.SEED + 3, half=True))
    head = torch.nn.Linear(32, 1)
    head.load_state_dict(filled("aesthetic", common.SEED + 4))
    check("aesthetic_quality", {n: aesthetic_quality(clip_l, head, v, DEVICE) for n, v in videos.items()})


def test_temporal_flickering(videos):
    from distillery.evaluation.vbench.consistency import temporal_flickering

    check("temporal_flickering", {n: temporal_flickering(v) for n, v in videos.items()})


def test_motion_smoothness(videos):
    from distillery.evaluation.vbench.amt import AMTS
    from distillery.evaluation.vbench.motion import motion_smoothness

    amt = AMTS()
    amt.load_state_dict(filled("amt", common.SEED + 5))
    check("motion_smoothness", {n: motion_smoothness(amt.eval(), v, DEVICE) for n, v in videos.items()})


def test_dynamic_degree(videos):
    from distillery.evaluation.vbench.motion import RAFT_ITERS, dynamic_degree, flow_score
    from distillery.evaluation.vbench.raft import RAFT, Padder

    raft = RAFT()
    raft.load_state_dict(filled("raft", common.SEED + 6))
    raft.eval()
    for name, frames in videos.items():
        assert dynamic_degree(raft, frames, common.FPS, DEVICE) == REFERENCE["videos"][name]["dynamic_degree"], name
        taken = frames[::2]
        padder = Padder(*taken.shape[1:3], divisor=8)
        for i, theirs in enumerate(REFERENCE["videos"][name]["dynamic_degree_pair_scores"]):
            pair = padder.pad(torch.from_numpy(taken[i:i + 2]).permute(0, 3, 1, 2).float())
            with torch.no_grad():
                ours = flow_score(raft(pair[:1], pair[1:], iters=RAFT_ITERS)[0])
            assert abs(ours - theirs) <= TOL * max(1.0, abs(theirs)), f"{name} pair {i}: ours {ours} vs vbench {theirs}"


def test_imaging_quality(videos):
    from distillery.evaluation.vbench.appearance import imaging_quality
    from distillery.evaluation.vbench.musiq import MUSIQ

    musiq = MUSIQ()
    musiq.load_state_dict(filled("musiq", common.SEED + 7))
    ours = {n: imaging_quality(musiq.eval(), v, DEVICE) for n, v in videos.items()}
    check("imaging_quality", ours)
    close(float(np.mean(list(ours.values()))) / 100, REFERENCE["aggregate"]["imaging_quality"], "the imaging quality aggregate")


def test_overall_consistency(videos, tmp_path):
    from distillery.evaluation.vbench.bpe import ClipBPE
    from distillery.evaluation.vbench.overall import TextEmbeddings, overall_consistency
    from distillery.evaluation.vbench.viclip import CONTEXT, ViCLIP

    tokenizer = ClipBPE(common.write_bpe(tmp_path / "bpe_simple_vocab_16e6.txt.gz"))
    for prompt, ids in REFERENCE["viclip_token_ids"].items():
        assert tokenizer.tokenize(prompt, CONTEXT) == ids, prompt
    viclip = ViCLIP("tiny")
    viclip.load_state_dict(filled("viclip", common.SEED + 8))
    text = TextEmbeddings(viclip.eval(), tokenizer)
    ours = {n: overall_consistency(viclip, text, v, common.PROMPTS[i % len(common.PROMPTS)], DEVICE)
            for i, (n, v) in enumerate(videos.items())}
    check("overall_consistency", ours)


def test_tokenizer_on_clips_real_vocabulary_was_identical():
    """Recorded in the reference venv (CLIP's vocabulary ships in openai-clip, not here): every suite prompt."""
    got = REFERENCE["tokenizer_real_vocab"]
    assert got["prompts"] == 946 and got["identical"] == 946


def test_preprocessing_at_real_shapes_was_identical():
    """Recorded in the reference venv: vbench's torchvision transforms and ours on random frames of real sizes (480×832,
    832×480, 224×224, 720×1280: resizes, crops and MUSIQ's downscale the small clips above never reach) — equal."""
    assert REFERENCE["pixels"] and all(v == 0.0 for shape in REFERENCE["pixels"].values() for v in shape.values())
    from distillery.evaluation.vbench.frames import middle_indices

    for n, theirs in REFERENCE["middle_indices"].items():
        assert middle_indices(8, int(n)) == theirs, n
