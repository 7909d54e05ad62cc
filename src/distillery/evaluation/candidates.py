"""The candidates a validation samples: :class:`Candidate` (one model × sampler setting, read from an artifact's
sampling contract, :data:`SAMPLING_FILE`), the teacher at its baseline step counts (:func:`teacher_candidates`) and
how a candidate spends its NFE (:func:`forwards`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distillery.common.errors import UserError

if TYPE_CHECKING:
    from distillery.sampling import Sampler


SAMPLING_FILE = "sampling.json"  # an artifact's sampling contract, beside its transformer/
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Candidate:
    """One model × sampler setting to validate."""

    name: str  # label in metric keys, sample folders and plots (letters, digits, '.', '_', '-')
    model_dir: Path  # diffusers Wan folder, or a folder with transformer/ (the base supplies VAE and text encoder)
    num_steps: int  # sampling steps (Euler steps, or few-step ladder length)
    guidance_scale: float  # CFG scale; CFG runs (2 forwards per step) when > 1
    sampler: str = "euler"  # a registered sampler (distillery.sampling.sampler_names()): euler, few_step_x0, ...
    timesteps: tuple[float, ...] | None = None  # few_step_x0 ladder in [0, 1000]; None: first num_steps of the Euler grid
    shift: float | None = None  # flow shift; None: model_dir's scheduler config, else the base's
    options: dict[str, Any] = field(default_factory=dict, compare=False)  # further sampling-contract keys for the sampler

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise UserError(f"candidate name {self.name!r} must be letters, digits, '.', '_' or '-' (it names files)")
        if self.num_steps < 1:
            raise UserError(f"candidate {self.name}: num_steps must be >= 1, got {self.num_steps}")
        if self.timesteps is not None and len(self.timesteps) != self.num_steps:
            raise UserError(f"candidate {self.name}: {len(self.timesteps)} timesteps given for num_steps={self.num_steps}")
        try:
            self.build_sampler(self.shift)  # unknown sampler names and bad contract keys fail here
        except UserError as exc:
            raise UserError(f"candidate {self.name}: {exc}") from None

    @classmethod
    def from_artifact(cls, name: str, model_dir: Path, num_steps: int | None = None,
                      guidance_scale: float | None = None) -> "Candidate":
        """A candidate sampled as ``model_dir/sampling.json`` says (its sampler, shift, ladder, options).

        ``num_steps`` / ``guidance_scale``: None → the contract's ``num_steps`` / ``guidance_scale``,
        else the length of its ``timesteps`` ladder / the sampler's defaults. :class:`UserError` when
        the contract is missing or invalid.
        """
        from distillery.sampling import build_sampler

        path = Path(model_dir) / SAMPLING_FILE
        try:
            contract = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"candidate {name}: {path} not found; point it at an artifact's model/ folder") from None
        except json.JSONDecodeError as exc:
            raise UserError(f"candidate {name}: {path}: not valid JSON ({exc.msg})") from None
        if not isinstance(contract, dict):
            raise UserError(f"candidate {name}: {path} must hold a JSON object (the sampling contract)")
        sampler = build_sampler(contract)
        ladder = contract.get("timesteps")
        steps = sampler.resolve_steps(num_steps)
        guidance = sampler.resolve_guidance(guidance_scale)
        known = ("sampler", "shift", "timesteps", "num_steps", "guidance_scale")
        return cls(name, Path(model_dir), steps, guidance, sampler=str(contract["sampler"]),
                   timesteps=tuple(float(t) for t in ladder) if ladder is not None else None,
                   shift=contract.get("shift"), options={k: v for k, v in contract.items() if k not in known})

    def sampling_contract(self, shift: float | None) -> dict[str, Any]:
        """The sampling contract this candidate samples with (``shift`` None: the model's own)."""
        contract: dict[str, Any] = {**self.options, "sampler": self.sampler, "shift": shift}
        if self.timesteps is not None:
            contract["timesteps"] = list(self.timesteps)
        return contract

    def build_sampler(self, shift: float | None) -> "Sampler":
        """The registered sampler for :meth:`sampling_contract`."""
        from distillery.sampling import build_sampler

        return build_sampler(self.sampling_contract(shift))

    def nfe(self, num_frames: int | None = None) -> int:
        """Transformer forward evaluations per video of ``num_frames`` latent frames (a streaming
        sampler's count grows with the length; None: the sampler's per-chunk count)."""
        return self.build_sampler(self.shift).nfe(self.num_steps, self.guidance_scale, num_frames=num_frames)


def teacher_candidates(teacher_dir: Path, steps: list[int], guidance_scale: float,
                       guidance_scale_2: float | None = None) -> list[Candidate]:
    """The teacher as one Euler candidate per entry of ``steps`` at CFG ``guidance_scale``, named ``teacher_<steps>``;
    ``guidance_scale_2``: a two-expert teacher's low-noise expert's scale (its contract's ``guidance_scale_2``, as
    diffusers' ``WanPipeline`` takes it; None: ``guidance_scale`` for both)."""
    options = {} if guidance_scale_2 is None else {"guidance_scale_2": float(guidance_scale_2)}
    return [Candidate(f"teacher_{int(n)}", Path(teacher_dir), int(n), float(guidance_scale), "euler", options=dict(options))
            for n in steps]


def forwards(cand: Candidate, latent_frames: int) -> dict[str, int]:
    """How a candidate spends its NFE on a video of ``latent_frames`` latent frames: ``per_video`` (its
    NFE), ``chunks`` (1 unless its sampler streams chunk by chunk), ``per_chunk`` (denoising forwards
    of one chunk: steps × CFG branches) and ``cache_writes`` (forwards that only write a finished
    chunk into the KV cache: per_video − chunks × per_chunk)."""
    from distillery.models.base import chunk_bounds

    per_video, per_chunk = cand.nfe(latent_frames), cand.nfe(None)
    sampler = cand.build_sampler(cand.shift)
    chunk = getattr(sampler, "chunk_size", None)
    if sampler.name != "causal_streaming" or not chunk:  # the whole video per forward (a causal mask alone does not stream)
        return {"per_video": per_video, "chunks": 1, "per_chunk": per_video, "cache_writes": 0}
    # a causal image-to-video student's given frame 0 is no chunk: its cache write counts among cache_writes
    chunks = len(chunk_bounds(int(latent_frames), int(chunk), bool(getattr(sampler, "given_first_frame", False))))
    return {"per_video": per_video, "chunks": chunks, "per_chunk": per_chunk, "cache_writes": per_video - chunks * per_chunk}
