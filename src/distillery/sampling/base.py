"""What every sampler is: built from an artifact's sampling contract, run through the model plugin.

Conventions (docs/architecture.md §3): latents ``[B, C, T, H, W]`` in the VAE's *normalised* latent space;
the model plugin's ``predict_noise`` returns the flow velocity ``v = ε − x0`` (float32) for
timesteps in ``[0, num_train_timesteps]``; guidance is ``u + w (c − u)`` and runs (a second,
unconditional forward) when ``w > 1``, as in ``WanPipeline``. Samplers never touch a diffusers
module: only ``model.predict_noise`` / ``model.predict_x0``, ``model.device`` and ``model.schedule``.

A sampling contract is the content of an artifact's ``sampling.json``::

    {"sampler": "<registered name>",  # required
     "shift": 3.0,                    # flow shift; absent/null: the model's own schedule
     "num_train_timesteps": 1000,     # timestep scale; absent: the model's
     "sigma_grid": "linspace",        # the σ grid's form (models.schedule.SIGMA_GRIDS); absent: the model's
     "num_steps": 4,                  # default step count (the sampler's own default when absent)
     "guidance_scale": 1.0,           # default CFG scale (1: no CFG); of two experts, the high-noise one's
     "guidance_scale_2": 3.0,         # two experts only: the low-noise expert's CFG scale (absent: guidance_scale's)
     ...}                             # the sampler's own keys (``option_keys``), e.g. "timesteps"

Two experts (Wan 2.2 A14B: the model's ``boundary_timestep``) take two CFG scales as diffusers' ``WanPipeline`` does
(:class:`ExpertGuidance`): ``guidance_scale`` for the steps at ``t >= boundary`` (the high-noise expert, ``transformer``),
``guidance_scale_2`` for the steps below (the low-noise expert, ``transformer_2``); CFG runs at every step when
``guidance_scale > 1`` (the pipeline's ``do_classifier_free_guidance``), whatever ``guidance_scale_2`` is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from distillery.common.errors import UserError
from distillery.models.schedule import SIGMA_GRIDS, FlowMatchSchedule
from distillery.sampling.noise import NoiseLike

if TYPE_CHECKING:
    from distillery.models.base import Conditioning, ModelBase

LatentShape = tuple[int, int, int, int]  # (C, T, H, W) of one sample
COMMON_KEYS = ("sampler", "shift", "num_train_timesteps", "sigma_grid", "num_steps", "guidance_scale", "guidance_scale_2")


def cfg_enabled(guidance_scale: float) -> bool:
    """Whether classifier-free guidance runs (a second, unconditional forward): ``w > 1``, as WanPipeline."""
    return guidance_scale > 1.0


def nfe_per_video(num_steps: int, guidance_scale: float) -> int:
    """Transformer forward evaluations per video for a one-forward-per-step sampler: steps × (2 with CFG, else 1)."""
    return num_steps * (2 if cfg_enabled(guidance_scale) else 1)


def parse_chunk_size(value: Any, sampler: str) -> int | None:
    """A contract's ``chunk_size`` (the model attends block-causally over chunks of that many latent
    frames): an integer ≥ 1, or None when absent."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"sampler {sampler}: chunk_size must be an integer >= 1, got {value!r}")
    return value


def parse_given_first_frame(value: Any, sampler: str) -> bool:
    """A contract's ``given_first_frame`` (a causal image-to-video student: latent frame 0 is the given frame's clean
    latent, written to the cache at t = 0 and never denoised; generation starts at frame 1): a bool, False when absent."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise UserError(f"sampler {sampler}: given_first_frame must be true or false, got {value!r}")
    return value


def require_causal(model: "ModelBase", chunk_size: int | None, sampler: str, given_first_frame: bool = False) -> int:
    """The chunk size a causal ``model`` attends over; a :class:`UserError` when it is not a
    :class:`~distillery.models.base.CausalModelBase`, differs from the contract's ``chunk_size``, or its
    ``given_first_frame`` (an image-to-video student's layout) is not the contract's."""
    from distillery.models.base import CausalModelBase

    if not isinstance(model, CausalModelBase):
        raise UserError(f"sampler {sampler} with a chunk_size needs a causal model (a CausalModelBase); "
                        f"{type(model).__name__} is not one")
    own = int(model.chunk_size)
    if chunk_size is not None and chunk_size != own:
        raise UserError(f"sampler {sampler}: the contract's chunk_size {chunk_size} differs from the model's {own}; "
                        f"the model attends block-causally over chunks of {own} frames")
    if bool(model.given_first_frame) != given_first_frame:
        if model.given_first_frame:
            raise UserError(f"sampler {sampler}: the model is a causal image-to-video student (latent frame 0 is the given "
                            "frame, never denoised) but its sampling contract lacks given_first_frame: true — a student "
                            "trained before that layout generated frame 0; retrain it")
        raise UserError(f"sampler {sampler}: the sampling contract says given_first_frame but the model takes no first "
                        "frame (not an image-to-video model)")
    return own


def causal_model_options(chunk_size: int | None, sampler: str) -> dict[str, Any]:
    """``model_options`` of a sampler whose contract names the causal chunk size."""
    if chunk_size is None:
        raise UserError(f"sampler {sampler}: the sampling contract names no chunk_size, so a plain model folder "
                        "cannot be loaded as the causal model it is; add chunk_size to sampling.json")
    return {"chunk_size": chunk_size}


@dataclass(frozen=True)
class ExpertGuidance:
    """The CFG scales of a call, as diffusers' ``WanPipeline`` applies them (module doc): ``scale`` at every step of a
    one-expert model and at the high-noise expert's steps (``t >= boundary``) of two; ``scale_2`` at the low-noise
    expert's (``t < boundary``; None: ``scale``). ``boundary``: the model's ``boundary_timestep`` (None: one expert).
    CFG runs when ``scale > 1``."""

    scale: float
    scale_2: float | None = None
    boundary: float | None = None

    @property
    def enabled(self) -> bool:
        """Whether the unconditional forward runs (at every step): ``scale > 1``."""
        return cfg_enabled(self.scale)

    def scale_at(self, timestep: float) -> float:
        """The scale of a step at ``timestep`` (every sample of a sampler's step shares it)."""
        if self.scale_2 is not None and self.boundary is not None and float(timestep) < self.boundary:
            return float(self.scale_2)
        return float(self.scale)


def expert_guidance(model: "ModelBase", guidance_scale: float, guidance_scale_2: float | None, sampler: str) -> ExpertGuidance:
    """The :class:`ExpertGuidance` of a call on ``model``; a one-line :class:`UserError` for a ``guidance_scale_2`` on a
    model of one expert (diffusers' ``WanPipeline`` refuses it there too), or above 1 while ``guidance_scale`` is not
    (the pipeline would run no CFG at all: that call is refused rather than sampled unguided)."""
    boundary = getattr(model, "boundary_timestep", None)
    if guidance_scale_2 is not None:
        if boundary is None:
            raise UserError(f"sampler {sampler}: guidance_scale_2 is the low-noise expert's CFG scale; "
                            f"{type(model).__name__} is a model of one expert (only guidance_scale applies)")
        if cfg_enabled(guidance_scale_2) and not cfg_enabled(guidance_scale):
            raise UserError(f"sampler {sampler}: guidance_scale_2 {guidance_scale_2:g} with guidance_scale "
                            f"{guidance_scale:g}: CFG runs only when guidance_scale > 1 (diffusers' WanPipeline), so the "
                            "low-noise expert would be unguided; set guidance_scale above 1 too")
    return ExpertGuidance(float(guidance_scale), None if guidance_scale_2 is None else float(guidance_scale_2), boundary)


def guide(predict: Callable[[bool], torch.Tensor], guidance_scale: float, weight: float | None = None) -> torch.Tensor:
    """Classifier-free guidance ``u + w (c − u)`` of ``predict(conditional)``: the conditional call
    alone when ``guidance_scale ≤ 1``, else the conditional then the unconditional call (as WanPipeline), combined with
    ``w`` = ``weight`` (the step's expert's scale, :class:`ExpertGuidance`) or, None, ``guidance_scale``."""
    c = predict(True)
    if not cfg_enabled(guidance_scale):
        return c
    u = predict(False)
    return u + (guidance_scale if weight is None else weight) * (c - u)


def guided_velocity(model: "ModelBase", latents: torch.Tensor, timesteps: torch.Tensor, cond: "Conditioning",
                    guidance_scale: "float | ExpertGuidance") -> torch.Tensor:
    """CFG velocity ``u + w (c − u)`` (float32 ``[B, C, T, H, W]``) from the model plugin.

    ``timesteps``: ``[B]`` (or per-frame ``[B, T]``) in ``[0, 1000]``, one value for the batch when ``guidance_scale``
    is an :class:`ExpertGuidance` (its scale is the step's expert's). One forward without CFG; with it, the
    conditional then the unconditional forward (negative embeds, zeros when None), separately as WanPipeline does.
    Runs under the caller's grad mode.
    """
    def predict(conditional: bool) -> torch.Tensor:
        return model.predict_noise(latents, timesteps, cond, conditional=conditional)

    if isinstance(guidance_scale, ExpertGuidance):
        return guide(predict, guidance_scale.scale, guidance_scale.scale_at(float(timesteps.reshape(-1)[0])))
    return guide(predict, guidance_scale)


def conditioning_on(cond: "Conditioning", device: torch.device) -> "Conditioning":
    """``cond`` with its tensors on ``device`` (dtype unchanged: the model casts to its input dtype)."""
    from distillery.models.base import Conditioning

    def moved(t: torch.Tensor | None) -> torch.Tensor | None:
        return t.to(device) if t is not None else None

    return Conditioning(cond.text_embeds.to(device), moved(cond.negative_text_embeds), moved(cond.first_frame),
                        moved(cond.image_embeds))


def check_inputs(cond: "Conditioning", latent_shape: Sequence[int], initial: torch.Tensor | None) -> int:
    """Validate the shapes a sampler is given; returns the batch size B."""
    text = cond.text_embeds
    if text.ndim != 3:
        raise ValueError(f"text_embeds must be [B, L, D], got {tuple(text.shape)}")
    negative = cond.negative_text_embeds
    if negative is not None and negative.shape != text.shape:
        raise ValueError(f"negative_text_embeds {tuple(negative.shape)} must match text_embeds {tuple(text.shape)}")
    if len(latent_shape) != 4:
        raise ValueError(f"latent_shape must be (C, T, H, W), got {tuple(latent_shape)}")
    if initial is not None and tuple(initial.shape) != (text.shape[0], *latent_shape):
        raise ValueError(f"initial noise {tuple(initial.shape)} must be [B, C, T, H, W] = {(text.shape[0], *latent_shape)}")
    return int(text.shape[0])


class Sampler(ABC):
    """A registered sampler, configured by a sampling contract (see the module docstring).

    Subclasses set ``name`` (through :func:`~distillery.sampling.registry.register_sampler`),
    ``option_keys`` (their own contract keys), ``default_num_steps``, and implement :meth:`sample`
    (and :meth:`nfe` when a step is not one forward per guidance branch).
    """

    name: ClassVar[str] = ""
    option_keys: ClassVar[tuple[str, ...]] = ()  # contract keys beyond COMMON_KEYS
    default_num_steps: ClassVar[int] = 4  # steps when neither the call nor the contract says

    def __init__(self, contract: Mapping[str, Any]) -> None:
        unknown = sorted(set(contract) - set(COMMON_KEYS) - set(self.option_keys))
        if unknown:
            valid = ", ".join(COMMON_KEYS + self.option_keys)
            raise UserError(f"sampling contract for {self.name!r}: unknown key {unknown[0]!r}; valid keys: {valid}")
        self.contract = dict(contract)
        shift = contract.get("shift")
        self.shift = None if shift is None else _positive(float(shift), "shift", self.name)
        scale = contract.get("num_train_timesteps")
        self.num_train_timesteps = None if scale is None else int(_positive(int(scale), "num_train_timesteps", self.name))
        grid = contract.get("sigma_grid")
        if grid is not None and grid not in SIGMA_GRIDS:
            raise UserError(f"sampling contract for {self.name!r}: sigma_grid {grid!r}; expected one of {', '.join(SIGMA_GRIDS)}")
        self.sigma_grid: str | None = grid
        steps = contract.get("num_steps")
        self.num_steps = None if steps is None else int(_positive(int(steps), "num_steps", self.name))
        guidance = contract.get("guidance_scale", 1.0)
        self.guidance_scale = float(guidance if guidance is not None else 1.0)
        if self.guidance_scale < 0:
            raise UserError(f"sampling contract for {self.name!r}: guidance_scale must be >= 0, got {self.guidance_scale}")
        second = contract.get("guidance_scale_2")
        self.guidance_scale_2 = None if second is None else float(second)
        if self.guidance_scale_2 is not None and not self.guidance_scale_2 >= 0:
            raise UserError(f"sampling contract for {self.name!r}: guidance_scale_2 must be >= 0, got {self.guidance_scale_2}")
        self.configure({k: contract[k] for k in self.option_keys if k in contract})

    def configure(self, options: dict[str, Any]) -> None:
        """Read the sampler's own contract keys (raise :class:`UserError` on bad values)."""
        del options

    def resolve_steps(self, num_steps: int | None) -> int:
        """The step count for a call: the call's, else the contract's, else ``default_num_steps``."""
        steps = num_steps if num_steps is not None else self.num_steps if self.num_steps is not None else self.default_num_steps
        if int(steps) < 1:
            raise UserError(f"sampler {self.name}: num_steps must be >= 1, got {steps}")
        return int(steps)

    def resolve_guidance(self, guidance_scale: float | None) -> float:
        """The CFG scale for a call: the call's, else the contract's (default 1: no CFG)."""
        return float(guidance_scale) if guidance_scale is not None else self.guidance_scale

    def resolve_guidance_2(self, guidance_scale_2: float | None) -> float | None:
        """The low-noise expert's CFG scale for a call: the call's, else the contract's (None: ``guidance_scale``'s)."""
        return float(guidance_scale_2) if guidance_scale_2 is not None else self.guidance_scale_2

    def expert_guidance(self, model: "ModelBase", guidance_scale: float | None,
                        guidance_scale_2: float | None) -> ExpertGuidance:
        """The call's :class:`ExpertGuidance` on ``model`` (:func:`expert_guidance`: refusals in one line)."""
        return expert_guidance(model, self.resolve_guidance(guidance_scale), self.resolve_guidance_2(guidance_scale_2),
                               self.name)

    def schedule_for(self, model: "ModelBase") -> FlowMatchSchedule:
        """The contract's shift, timestep scale and σ-grid form, each falling back to the model's own schedule."""
        own = model.schedule
        return FlowMatchSchedule(
            shift=self.shift if self.shift is not None else own.shift,
            num_train_timesteps=self.num_train_timesteps if self.num_train_timesteps is not None else own.num_train_timesteps,
            sigma_grid=self.sigma_grid if self.sigma_grid is not None else own.sigma_grid,
        )

    def model_options(self) -> dict[str, Any]:
        """What the model plugin must be to run this sampler, as keyword arguments of
        :func:`distillery.models.registry.load_inference_model` (the folder's model family's loader:
        validate and export load plain folders with them). Default: none (a bidirectional model)."""
        return {}

    def nfe(self, num_steps: int | None = None, guidance_scale: float | None = None, num_frames: int | None = None) -> int:
        """Transformer forward evaluations per video for a call with these arguments (``num_frames``:
        the video's latent frames, for samplers whose work depends on the length)."""
        del num_frames
        return nfe_per_video(self.resolve_steps(num_steps), self.resolve_guidance(guidance_scale))

    @abstractmethod
    def sample(
        self,
        model: "ModelBase",
        cond: "Conditioning",
        latent_shape: LatentShape,
        noise: NoiseLike,
        *,
        num_steps: int | None = None,
        guidance_scale: float | None = None,
        initial: torch.Tensor | None = None,
        guidance_scale_2: float | None = None,
    ) -> torch.Tensor:
        """Sample ``B`` videos; returns normalised latents ``float32 [B, C, T, H, W]`` on ``model.device``.

        ``cond``: text embeddings ``[B, L, D]`` (and the CFG negative, zeros when None), zero-padded
        to the length the model was trained with. ``latent_shape``: ``(C, T, H, W)`` of one sample.
        ``noise``: a :mod:`~distillery.sampling.noise` source (``torch.Generator``, one generator per
        sample, or a ``BatchRNG``) for the initial noise and any later draws. ``initial``: optional
        initial noise ``[B, C, T, H, W]`` (then nothing is drawn for it). ``num_steps`` /
        ``guidance_scale`` / ``guidance_scale_2`` (two experts: the low-noise expert's, module doc): None → the
        contract's defaults. NFE per video: :meth:`nfe`.
        """


def _positive(value: float, key: str, name: str) -> float:
    if value <= 0:
        raise UserError(f"sampling contract for {name!r}: {key} must be > 0, got {value}")
    return value
