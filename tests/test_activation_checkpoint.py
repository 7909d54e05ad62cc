"""Selective activation checkpointing by block (distillery.components.activation_checkpoint)."""

from __future__ import annotations

import copy

import pytest
import torch

from distillery.components.activation_checkpoint import checkpoint_blocks, chosen_blocks


def test_chosen_blocks_are_spread_evenly():
    assert chosen_blocks(30, 0.2) == [0, 5, 10, 15, 20, 25]
    assert chosen_blocks(30, 1.0) == list(range(30))
    assert chosen_blocks(30, 0.0) == []
    assert chosen_blocks(4, 0.5) == [0, 2]
    with pytest.raises(ValueError):
        chosen_blocks(4, 1.5)


def _tiny_wan(layers: int = 4):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                 out_channels=4, text_dim=16, freq_dim=16, ffn_dim=16, num_layers=layers, rope_max_seq_len=32)


def _grads(model, inputs):
    out = model(*inputs, return_dict=False)[0]
    out.square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_checkpointed_blocks_give_the_same_output_and_gradients_and_keep_their_names():
    plain = _tiny_wan()
    partial = copy.deepcopy(plain)
    names = [n for n, _ in partial.named_parameters()]
    assert checkpoint_blocks(partial.blocks, 0.5) == [0, 2]
    assert [n for n, _ in partial.named_parameters()] == names  # checkpoints and exports keep their keys
    inputs = (torch.randn(1, 4, 3, 4, 4), torch.tensor([500.0]), torch.randn(1, 3, 16))
    out_plain, grads_plain = _grads(plain, inputs)
    out_partial, grads_partial = _grads(partial, inputs)
    assert torch.equal(out_plain, out_partial)
    for n, g in grads_plain.items():
        torch.testing.assert_close(grads_partial[n], g, rtol=0, atol=0)
    with torch.no_grad():  # sampling: no checkpoint, the same forward
        assert torch.equal(partial(*inputs, return_dict=False)[0], plain(*inputs, return_dict=False)[0])


def test_checkpointed_blocks_free_their_activations():
    """Saved tensors counted through autograd's hooks: the checkpointed blocks keep only their inputs."""
    counts = []
    for fraction in (0.0, 0.5, 1.0):
        model = _tiny_wan()
        checkpoint_blocks(model.blocks, fraction)
        saved = [0]

        def pack(t, saved=saved):
            saved[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randn(1, 4, 3, 4, 4), torch.tensor([500.0]), torch.randn(1, 3, 16), return_dict=False)[0].sum()
        counts.append(saved[0])
    assert counts[0] > counts[1] > counts[2]
