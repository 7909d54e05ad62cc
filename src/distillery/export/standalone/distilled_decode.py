"""From an exported student's latents to the frames a user gets, whole or chunk by chunk (stdlib + torch + diffusers).

- :func:`frames_out` — decoded video ``[B, 3, F, H, W]`` in ``[-1, 1]`` → diffusers' ``output_type``, as
  ``VideoProcessor.postprocess_video`` gives it (the same operations in the same dtype: ``np`` float32
  ``[B, F, H, W, 3]``, ``pt`` ``[B, F, 3, H, W]``, ``pil`` lists of images); for ``np`` on a GPU the rescale, layout
  and float32 cast run there and one copy brings the frames to page-locked host memory (diffusers casts on the host).
- :func:`decode_frames` — the whole video (``__call__``): on the fused GPU path the latents go through the decoder in
  the pieces its chunked decode makes anyway (:class:`vae_decode.StreamingDecoder`), each piece's frames copied to the
  host on a copy stream while the next piece decodes; elsewhere diffusers' decode and postprocess as they are.
- :class:`ChunkDecoder` — a causal student's chunks (``stream()``): each finished chunk decoded through the VAE's
  causal cache on a CUDA stream of higher priority than the sampling's, so its frames are ready while the next
  chunk denoises; on the CPU in line. The chunks' frames, concatenated, are :func:`decode_frames`' of the whole video
  (the same decoder calls on the CPU: diffusers' one latent frame at a time).
"""

from __future__ import annotations

from typing import Any

import torch

from .vae_decode import StreamingDecoder, chunk_spans, decode_video


def raw_latents(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """Normalised latents ``[B, C, T', H', W']`` → the VAE's raw latents in its dtype and on its device."""
    z_dim = int(vae.config.z_dim)
    z = latents.to(vae.device, vae.dtype)
    mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(z.device, z.dtype)
    std = torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(z.device, z.dtype)
    return z * std + mean


def _np_on_device(decoded: torch.Tensor) -> torch.Tensor:
    """diffusers' ``np`` postprocess of ``[B, 3, F, H, W]`` without the host: ``(x · 0.5 + 0.5)`` clamped to ``[0, 1]``
    in the decoded dtype, then ``[B, F, H, W, 3]`` float32 (the cast is exact: the same values as on the host)."""
    return (decoded * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).float()


def frames_out(decoded: torch.Tensor, output_type: str, video_processor: Any) -> Any:
    """A decoded video ``[B, 3, F, H, W]`` as diffusers' ``postprocess_video(decoded, output_type)`` returns it (module
    doc); ``np`` of a CUDA tensor is rescaled and cast on the GPU, then copied once."""
    if output_type == "np" and decoded.is_cuda:
        return _np_on_device(decoded).cpu().numpy()
    return video_processor.postprocess_video(decoded, output_type=output_type)


def decode_pieces(latent_frames: int, chunk_frames: int, temporal_factor: int) -> list[tuple[int, int, int]]:
    """``(start, end, first video frame)`` of the pushes :func:`decode_frames` decodes a video's latent frames in: the
    decoder calls of its chunked decode (:func:`vae_decode.chunk_spans`), frame 0 pushed with the first call's frames."""
    spans = chunk_spans(latent_frames, chunk_frames)
    pieces = [(0, spans[1][1] if len(spans) > 1 else 1)] + spans[2:]
    return [(a, b, 0 if a == 0 else 1 + temporal_factor * (a - 1)) for a, b in pieces]


def decode_frames(vae: Any, latents: torch.Tensor, chunk_frames: int, output_type: str, video_processor: Any) -> Any:
    """Normalised latents → the videos in ``output_type`` (:func:`frames_out`); ``chunk_frames`` latent frames per
    decoder call after the first (1: diffusers' loop). On a GPU with a chunked decode and ``np`` output, each call's
    frames go to page-locked host memory on a copy stream while the next call decodes."""
    z = raw_latents(vae, latents)
    with torch.no_grad():
        if output_type != "np" or not z.is_cuda or chunk_frames == 1 or int(z.shape[2]) <= 1:
            return frames_out(decode_video(vae, z, chunk_frames), output_type, video_processor)
        decoder = StreamingDecoder(vae, chunk_frames)
        tf, main, copier = int(vae.config.scale_factor_temporal), torch.cuda.current_stream(z.device), torch.cuda.Stream(z.device)
        frames = 1 + tf * (int(z.shape[2]) - 1)
        host: torch.Tensor | None = None
        for start, end, first in decode_pieces(int(z.shape[2]), chunk_frames, tf):
            out = _np_on_device(decoder.push(z[:, :, start:end]))  # [B, f, H, W, 3] float32 on the GPU
            if host is None:
                host = torch.empty((out.shape[0], frames, *out.shape[2:]), dtype=torch.float32, pin_memory=True)
            copier.wait_stream(main)
            with torch.cuda.stream(copier):
                host[:, first:first + out.shape[1]].copy_(out, non_blocking=True)
            out.record_stream(copier)  # the allocator keeps it until the copy is done
        copier.synchronize()
        return host.numpy()


class _Piece:
    """A chunk's frames being decoded (module doc): :meth:`result` waits for them and returns them in ``output_type``
    — ``np`` already on the host (copied on the decode's stream), else rescaled from the decoded video then."""

    def __init__(self, output_type: str, video_processor: Any, decoded: torch.Tensor | None = None,
                 host: torch.Tensor | None = None, done: torch.cuda.Event | None = None) -> None:
        self.output_type, self.video_processor = output_type, video_processor
        self.decoded, self.host, self.done = decoded, host, done

    def result(self) -> Any:
        if self.done is not None:
            self.done.synchronize()
        if self.host is not None:
            return self.host.numpy()
        if self.decoded.is_cuda:  # made on the decode's stream, read on the caller's
            self.decoded.record_stream(torch.cuda.current_stream(self.decoded.device))
        return frames_out(self.decoded, self.output_type, self.video_processor)


class ChunkDecoder:
    """Decode a causal student's chunks as they finish (module doc): :meth:`launch` a chunk's normalised latents
    ``[B, C, f, H', W']``, later ``.result()`` its frames in ``output_type``; the pieces, concatenated in time, are the
    whole video's frames."""

    def __init__(self, vae: Any, chunk_frames: int, output_type: str, video_processor: Any) -> None:
        self.vae, self.output_type, self.video_processor = vae, output_type, video_processor
        self.decoder = StreamingDecoder(vae, chunk_frames)
        self.side = torch.cuda.Stream(vae.device, priority=-1) if vae.device.type == "cuda" else None

    def launch(self, latents: torch.Tensor) -> _Piece:
        with torch.no_grad():
            z = raw_latents(self.vae, latents)
            if self.side is None:
                return _Piece(self.output_type, self.video_processor, decoded=self.decoder.push(z))
            self.side.wait_stream(torch.cuda.current_stream(z.device))
            with torch.cuda.stream(self.side):
                z.record_stream(self.side)  # made on the sampling's stream, read on this one
                decoded, host = self.decoder.push(z), None
                if self.output_type == "np":
                    out = _np_on_device(decoded)
                    host = torch.empty(out.shape, dtype=torch.float32, pin_memory=True)
                    host.copy_(out, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.side)
        return _Piece(self.output_type, self.video_processor, decoded=None if host is not None else decoded, host=host,
                      done=done)
