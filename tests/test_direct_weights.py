"""The direct export path's guards (:mod:`distillery.export.direct_weights`): it vouches only for what it reproduces.

Its bytes against ``save_pretrained``'s are compared where roles are trained: test_training (Wan 2.1), test_pdd (head
bank, EMA), test_wan22 (TI2V; A14B keeps diffusers' path) — :mod:`direct_weights_check`."""

from __future__ import annotations

import inspect
import json

import pytest


def _config() -> dict:
    from distillery.export.direct_weights import WAN_INIT_KEYS

    config = {k: None for k in WAN_INIT_KEYS} | {"num_layers": 1, "patch_size": [1, 2, 2], "eps": 1e-6}
    return {**config, "_class_name": "WanTransformer3DModel", "_diffusers_version": "0.35.0", "_name_or_path": "x",
            "_pdd_steps": 4, "_use_default_values": []}


def test_the_pinned_diffusers_is_the_installed_one_and_its_wan_init_arguments_are_the_pinned_keys():
    import diffusers
    from diffusers import WanTransformer3DModel

    from distillery.export.direct_weights import DIFFUSERS_VERSION, WAN_INIT_KEYS

    assert diffusers.__version__ == DIFFUSERS_VERSION  # else the fast path is never taken: re-check it, then re-pin
    assert set(inspect.signature(WanTransformer3DModel.__init__).parameters) - {"self"} == WAN_INIT_KEYS
    assert not WanTransformer3DModel.ignore_for_config


def test_the_config_text_is_diffusers_own_for_the_rebuilt_module(tmp_path):
    from distillery.export.direct_weights import direct_config
    from distillery.models.wan.common import build_transformer

    for layout in ({}, {"expand_timesteps": True}):
        config = {**_config(), "num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 4, "out_channels": 4,
                  "text_dim": 8, "freq_dim": 8, "ffn_dim": 16, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
                  "rope_max_seq_len": 32, "_wan_layout": layout}
        module = build_transformer(config)
        module.save_config(tmp_path)
        assert direct_config(config) == (tmp_path / "config.json").read_text()


@pytest.mark.parametrize("change", ["class", "extra_key", "missing_key", "two_experts", "other_diffusers"])
def test_a_config_it_cannot_vouch_for_keeps_diffusers_path(monkeypatch, change):
    from distillery.export import direct_weights

    config = _config()
    assert direct_weights.direct_config(config) is not None
    if change == "class":
        config["_class_name"] = "CogVideoXTransformer3DModel"
    elif change == "extra_key":
        config["new_argument"] = 1
    elif change == "missing_key":
        del config["num_layers"]
    elif change == "two_experts":
        config["_wan_layout"] = {"boundary_ratio": 0.9, "transformer_2": {}}
    else:
        monkeypatch.setattr(direct_weights, "DIFFUSERS_VERSION", "0.0.1")
    assert direct_weights.direct_config(config) is None
    assert json.loads(json.dumps(config))  # untouched input
