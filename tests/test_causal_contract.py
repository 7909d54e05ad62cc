"""The causal contract: methods declare role kinds, a wrong kind is refused from the config before
any weights load, and the contract's cache bookkeeping (tests/plugins/causal_double.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from distillery.common.errors import UserError
from distillery.models.base import CausalModelBase, Conditioning

PLUGINS = Path(__file__).resolve().parent / "plugins"


@pytest.fixture
def plugins():
    sys.path.insert(0, str(PLUGINS))
    yield
    sys.path.remove(str(PLUGINS))


def _config(student_target: str, init_from: str) -> dict:
    return {"models": {"student": {"_target_": student_target, "init_from": init_from}},
            "method": {"_target_": "causal_double.CausalSFTMethod"},
            "training": {"data": {"path": "/nowhere"}}}


def test_a_bidirectional_student_is_refused_before_any_weights_load(plugins, tmp_path):
    from distillery.config import allowed_prefixes, load_run_config
    from distillery.engine.builder import check_roles_early

    config = load_run_config(raw=_config("distillery.models.wan.WanModel", str(tmp_path / "no-such-model")),
                             prefixes=allowed_prefixes(["causal_double"]))
    with pytest.raises(UserError, match="CausalSFTMethod needs a CausalModelBase as its student; "
                                        "distillery.models.wan.bidirectional.WanModel is not one"):
        check_roles_early(config)  # the folder does not exist: nothing was loaded to find this out
    causal = load_run_config(raw=_config("causal_double.CausalWanDouble", str(tmp_path / "no-such-model")),
                             prefixes=allowed_prefixes(["causal_double"]))
    check_roles_early(causal)


def test_streaming_bookkeeping_of_the_double(plugins, tiny_base):
    from causal_double import CausalDoubleConfig, CausalWanDouble

    model = CausalWanDouble(CausalDoubleConfig(init_from=str(tiny_base), trainable=False), role="student")
    model.bind_device(torch.device("cpu"))
    assert isinstance(model, CausalModelBase)
    gen = torch.Generator().manual_seed(0)
    c = model.in_channels
    video = torch.randn(1, c, 2, 4, 4, generator=gen)
    cond = Conditioning(text_embeds=torch.randn(1, 8, model.text_dim, generator=gen))
    t = torch.tensor([700.0])
    with torch.no_grad():
        model.predict_noise_streaming(video[:, :, :1], torch.zeros(1), cond, cache_tag="pos", store_kv=True, cur_start_frame=0)
        assert model.cached_frames("pos") == 1 and model.cached_frames("neg") == 0
        with pytest.raises(ValueError, match="holds 1 frames"):
            model.predict_noise_streaming(video[:, :, 1:], t, cond, cache_tag="pos", store_kv=False, cur_start_frame=0)
        v = model.predict_noise_streaming(video[:, :, 1:], t, cond, cache_tag="pos", store_kv=False, cur_start_frame=1)
        assert model.cached_frames("pos") == 1  # store_kv=False leaves the cache
        full = model.predict_noise(video, torch.tensor([[0.0, 700.0]]), cond)[:, :, 1:]
        torch.testing.assert_close(v, full)
        x0 = model.predict_x0_streaming(video[:, :, 1:], t, cond, cache_tag="pos", store_kv=False, cur_start_frame=1)
        torch.testing.assert_close(x0, video[:, :, 1:] - 0.7 * v)
        model.clear_caches("pos")
        assert model.cached_frames("pos") == 0
