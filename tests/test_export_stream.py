"""The exported causal student's video chunk by chunk (``DistilledWanPipeline.stream``, ``distilled_decode.py``, the
Wan VAE's decode piece by piece: ``vae_decode.StreamingDecoder``; issue 64).

- the decoder carried from piece to piece through its causal cache decodes what the whole decode decodes — bit for
  bit where the decoder calls agree (diffusers' one latent frame a call; the chunked decode's own calls), within fp32
  rounding where they do not; the pieces ``__call__``'s decode pushes on a GPU are its chunked decode's calls;
- ``stream()`` of a Self-Forcing export yields, chunk by chunk, exactly the frames (and latents) the usual call
  returns — chunks of 1 and 2 latent frames, ``np`` and ``pt`` frames; another sampler's folder is refused.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan

from distillery.data.vae_decode import StreamingDecoder, decode_video
from distillery.export.standalone.distilled_decode import decode_pieces
from distillery.tinybase.shipped import shipped_tiny_base


@pytest.fixture(scope="module")
def vae() -> AutoencoderKLWan:
    return AutoencoderKLWan.from_pretrained(shipped_tiny_base() / "vae").eval()


def _z(vae, frames=5, seed=0):
    return torch.randn(1, vae.config.z_dim, frames, 4, 4, generator=torch.Generator().manual_seed(seed))


def _pushed(vae, z, sizes, chunk_frames=1):
    decoder, start, parts = StreamingDecoder(vae, chunk_frames), 0, []
    for f in sizes:
        parts.append(decoder.push(z[:, :, start:start + f]))
        start += f
    return torch.cat(parts, dim=2)


@pytest.mark.parametrize("sizes", [[5], [1, 2, 2], [3, 2], [1, 1, 1, 1, 1]])
def test_pieces_through_the_carried_cache_decode_what_diffusers_decodes(vae, sizes):
    z = _z(vae)
    want = vae.decode(z, return_dict=False)[0]
    got = _pushed(vae, z, sizes)
    assert got.shape == want.shape == (1, 3, 17, 16, 16)  # the tiny VAE: 4× in time and in space
    assert torch.equal(got, want), (got - want).abs().max()  # the same decoder calls, one latent frame each
    chunked = _pushed(vae, z, sizes, chunk_frames=2)  # other decoder calls: the same function, other sums
    torch.testing.assert_close(chunked, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("frames,chunk", [(5, 2), (21, 10), (21, 5), (2, 3), (1, 4)])
def test_the_pieces_of_the_gpu_decode_are_the_chunked_decode_s_calls(vae, frames, chunk):
    pieces = decode_pieces(frames, chunk, 4)
    assert pieces[0][0] == 0 and pieces[-1][1] == frames and all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    assert [p[2] for p in pieces] == [0] + [1 + 4 * (a - 1) for a, _, _ in pieces[1:]]
    if frames <= 5:
        z = _z(vae, frames)
        decoder = StreamingDecoder(vae, chunk)
        got = torch.cat([decoder.push(z[:, :, a:b]) for a, b, _ in pieces], dim=2)
        assert torch.equal(got, decode_video(vae, z, chunk))


def _pipeline(root, contract):
    from diffusers import DiffusionPipeline

    from distillery.export.code import write_export_code

    folder = root / "export"
    shutil.copytree(shipped_tiny_base(), folder)
    (folder / "sampling.json").write_text(json.dumps(contract))
    write_export_code(folder)
    return DiffusionPipeline.from_pretrained(folder, custom_pipeline=str(folder), trust_remote_code=True)


SF = {"sampler": "causal_streaming", "shift": 3.0, "num_train_timesteps": 1000, "timesteps": [1000.0, 750.0, 500.0],
      "context_noise": 50.0, "renoise": "sde"}
CALL = {"prompt": "a red ball moves left", "num_frames": 17, "height": 32, "width": 32, "max_sequence_length": 16}


@pytest.mark.parametrize("chunk_size", [1, 2])
def test_the_streamed_frames_are_the_usual_call_s(tmp_path, chunk_size):
    pipe = _pipeline(tmp_path, {**SF, "chunk_size": chunk_size})
    whole = pipe(**CALL, generator=torch.Generator().manual_seed(7)).frames
    pieces = list(pipe.stream(**CALL, generator=torch.Generator().manual_seed(7)))
    latent_frames = (17 - 1) // 4 + 1
    assert len(pieces) == -(-latent_frames // chunk_size)
    assert [p.shape[1] for p in pieces] == [1 + 4 * (chunk_size - 1)] + [4 * min(chunk_size, latent_frames - s)
                                                                        for s in range(chunk_size, latent_frames, chunk_size)]
    assert isinstance(whole, np.ndarray) and np.array_equal(np.concatenate(pieces, axis=1), whole)
    if chunk_size == 2:  # the latents chunk by chunk, and frames as tensors
        latents = pipe(**CALL, output_type="latent", generator=torch.Generator().manual_seed(7)).frames
        streamed = list(pipe.stream(**CALL, output_type="latent", generator=torch.Generator().manual_seed(7)))
        assert torch.equal(torch.cat(streamed, dim=2), latents)
        frames = torch.cat(list(pipe.stream(**CALL, output_type="pt", generator=torch.Generator().manual_seed(7))), dim=1)
        assert torch.equal(frames, torch.from_numpy(whole).permute(0, 1, 4, 2, 3))


def test_stream_refuses_a_student_that_does_not_stream(tmp_path):
    pipe = _pipeline(tmp_path, {"sampler": "few_step_x0", "shift": 3.0, "timesteps": [1000.0, 500.0]})
    with pytest.raises(ValueError, match="stream\\(\\) yields a causal student's chunks; this folder's sampler is 'few_step_x0'"):
        next(pipe.stream(**CALL))


def test_a_consumer_that_stops_early_leaves_the_pipeline_as_it_was(tmp_path):
    """Reading only the first chunk and closing the generator: those frames are the video's first frames, and the
    pipeline samples the same video again afterwards (no state — the KV cache, the decoder's cache — left behind)."""
    pipe = _pipeline(tmp_path, {**SF, "chunk_size": 2})
    whole = pipe(**CALL, generator=torch.Generator().manual_seed(3)).frames
    stream = pipe.stream(**CALL, generator=torch.Generator().manual_seed(3))
    first = next(stream)
    stream.close()  # the consumer is done: GeneratorExit inside the sampling
    with pytest.raises(StopIteration):
        next(stream)
    assert np.array_equal(first, whole[:, :first.shape[1]]) and first.shape[1] == 5  # 1 + 4 (2 − 1) frames
    again = pipe(**CALL, generator=torch.Generator().manual_seed(3)).frames
    assert np.array_equal(again, whole)
    streamed = np.concatenate(list(pipe.stream(**CALL, generator=torch.Generator().manual_seed(3))), axis=1)
    assert np.array_equal(streamed, whole)


def test_each_decoder_carries_its_own_cache(vae):
    """Two videos decoded piece by piece, their pushes interleaved: each decoder's cache is its own (not the VAE's),
    so each video is its whole decode; the VAE's own decode afterwards is untouched by them. The cache is what
    carries: the same frames pushed into a fresh decoder come out otherwise."""
    a, b = _z(vae, seed=1), _z(vae, seed=2)
    da, db = StreamingDecoder(vae, 1), StreamingDecoder(vae, 1)
    assert da.cache is not db.cache and len(da.cache) == vae._cached_conv_counts["decoder"]
    parts = {"a": [], "b": []}
    for start, end in ((0, 1), (1, 3), (3, 5)):
        parts["a"].append(da.push(a[:, :, start:end]))
        parts["b"].append(db.push(b[:, :, start:end]))
    assert da.frames == db.frames == 5 and any(c is not None for c in da.cache)
    for name, z in (("a", a), ("b", b)):
        assert torch.equal(torch.cat(parts[name], dim=2), vae.decode(z, return_dict=False)[0])
    fresh = StreamingDecoder(vae, 1)  # a new decoder starts from frame 0 again: a new video, not the last one's tail
    assert torch.equal(fresh.push(a), vae.decode(a, return_dict=False)[0])
    other = StreamingDecoder(vae, 1)  # a's frames 1-2 behind b's frame 0: what the cache carried differs
    other.push(b[:, :, :1])
    behind_b = other.push(a[:, :, 1:3])
    assert behind_b.shape == parts["a"][1].shape and (behind_b - parts["a"][1]).abs().max() > 1e-4
