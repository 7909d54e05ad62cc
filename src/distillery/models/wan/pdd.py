"""PDD Wan: the Wan trunk with its output projection replicated once per fine-grid interval (a head bank).

Parallel decoding distillation (:mod:`distillery.methods.pdd`) trains a student that, from one
forward at a block start ``x_n``, predicts the velocity of every interval of a fine σ grid of
``pdd_steps`` intervals (the ``pdd_steps``-step Euler grid of the model's shifted schedule,
:meth:`~distillery.models.schedule.FlowMatchSchedule.inference_sigmas`): head ``k`` is interval
``[σ_k, σ_{k+1}]``'s. The trunk is diffusers' ``WanTransformer3DModel`` unchanged; only its last
projection (``proj_out``, ``Linear(inner_dim, out_channels · prod(patch_size))``) becomes
:class:`PDDHeadBank`, ``pdd_steps`` linear heads, each initialised from ``proj_out``.

How the heads see the trunk: a forward hook on ``transformer.proj_out`` (a module-level function,
so ``copy.deepcopy`` of the transformer — the bf16 compute copy — carries it) replaces the
projection's output, while :meth:`PDDWanModel.predict_head_groups` runs, by the head bank's
projections of its input (the normalised, time-modulated hidden states ``[B, S, inner_dim]``), laid
out per token as ``(p_t, p_h, p_w, M·C)``: the transformer's own unpatchify then returns
``[B, M·C, T, H, W]`` for M heads, and the transformer's output stays the one that carries the
gradient (FSDP2's backward hooks hang on it). Heads are requested in groups (:class:`HeadGroup`): a
group is plain heads or their fusion, with gradient or projected from the detached trunk states.
``proj_out`` itself is frozen (its own output is replaced: it trains nothing).

The bank is a trainable module of its own (``trainable_modules()['heads']``): its own FSDP2 unit,
checkpoint key ``roles.<role>.heads`` and per-head optimizer state (a head that was never
supervised has none). Because heads are linear, a block's heads fuse into one projection with
weights ``Σ_k w_k W_k`` (:func:`~distillery.models.schedule.block_weights`): sampling a block costs
one forward whatever its width (:meth:`PDDWanModel.predict_pdd_fused`).

On disk the bank is ``transformer/pdd_heads.safetensors`` beside the trunk's weights: ``weight``
``[pdd_steps, out, inner_dim]``, ``bias`` ``[pdd_steps, out]``, metadata ``pdd_steps`` (tensors
only; nothing is unpickled). A folder without it starts every head from ``proj_out``.

Two experts (Wan 2.2 A14B, :class:`~distillery.models.wan.experts.WanExperts`): each expert's trunk has its own bank
(:class:`ExpertHeadBanks`: the high-noise expert's heads as a one-expert bank's, ``second``: the low-noise one's), each
``proj_out`` hooked to its own; a forward at a block start ``t_n`` goes to the expert of ``t_n`` (each row to its own,
``WanModel``'s routing) and every head of that block is that expert's. The file holds both: ``weight``/``bias`` (the
high-noise expert's) and ``weight_2``/``bias_2`` (the low-noise one's), metadata ``experts`` 2.
"""

from __future__ import annotations

import contextvars
from abc import abstractmethod
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from distillery.common.errors import UserError
from distillery.config.typed import bounded, check_fields
from distillery.models.base import Conditioning, HeadGroup, PDDModelBase, TrainingBatch
from distillery.models.schedule import block_weights
from distillery.models.wan.bidirectional import WanModel
from distillery.models.wan.common import WanModelConfig

HEADS_FILE = "pdd_heads.safetensors"  # the head bank beside the trunk's weights (module doc)

__all__ = ["HEADS_FILE", "ExpertHeadBanks", "HeadBankModel", "HeadGroup", "PDDHeadBank", "PDDWanModel", "PDDWanModelConfig",
           "empty_head_bank", "read_head_bank", "save_head_bank", "write_head_bank"]

@dataclass
class _Request:
    bank: "PDDHeadBank"
    groups: list[HeadGroup]
    patch_volume: int  # p_t · p_h · p_w


# While PDDWanModel.predict_head_groups runs: what the proj_out hook projects instead.
_REQUEST: contextvars.ContextVar[_Request | None] = contextvars.ContextVar("distillery_pdd_request", default=None)


def _project_with_head_bank(module: torch.nn.Module, args: tuple, output: torch.Tensor,
                            expert: int | None = None) -> torch.Tensor | None:
    """Forward hook of ``proj_out``: the requested head groups' projections of its input, laid out
    per token as ``(p_t, p_h, p_w, M·C)`` (module doc); outside a request, the output unchanged. ``expert``: the
    hook of that expert's ``proj_out`` (two experts, :class:`ExpertHeadBanks`), projecting by its own heads."""
    del module, output
    req = _REQUEST.get()
    if req is None:
        return None
    hidden = args[0]
    which = {} if expert is None else {"expert": expert}
    parts = []
    for group in req.groups:
        if group.detached:
            with torch.no_grad():
                parts.append(req.bank(hidden.detach(), group.heads, group.coeffs, **which))
        else:
            parts.append(req.bank(hidden, group.heads, group.coeffs, **which))
    y = torch.cat(parts, dim=2)  # [B, S, M, p·C]
    b, s, m, out = y.shape
    return y.reshape(b, s, m, req.patch_volume, out // req.patch_volume).transpose(2, 3).reshape(b, s, -1)


@dataclass
class PDDWanModelConfig(WanModelConfig):
    pdd_steps: int = bounded(8, 1, 1000)  # fine-grid intervals = heads of the bank

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(self, "model")  # pdd_steps' declared range, for a config built in Python


class PDDHeadBank(torch.nn.Module):
    """``num_heads`` output projections ``W_k [out, in]``, ``b_k [out]`` (fp32 masters), one parameter
    pair per head (``weight.<k>``, ``bias.<k>``) so a head that receives no gradient has no optimizer state. Of a
    projection without a bias (``base.bias`` None), heads without one: ``b_k`` is 0 and never trains."""

    def __init__(self, base: torch.nn.Linear, num_heads: int) -> None:
        super().__init__()
        w = base.weight.detach().float()
        self.weight = torch.nn.ParameterList([torch.nn.Parameter(w.clone()) for _ in range(num_heads)])
        self.has_bias = base.bias is not None  # a projection without one (Cosmos' proj_out): heads without one, bias 0
        b = base.bias.detach().float() if base.bias is not None else None
        self.bias = torch.nn.ParameterList([torch.nn.Parameter(b.clone()) for _ in range(num_heads)] if b is not None else [])

    def weights(self, heads: list[int], coeffs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weight [m, out, in], bias [m, out])`` of the heads ``heads``; with ``coeffs`` (``[len(heads)]``)
        their fusion ``Σ_j coeffs_j head_j`` (summed in float64) as m = 1. Keeps the graph to the heads."""
        w = torch.stack([self.weight[k] for k in heads])
        b = torch.stack([self.bias[k] for k in heads]) if self.has_bias else w.new_zeros(w.shape[:2])
        if coeffs is None:
            return w, b
        c = coeffs.to(w.device, torch.float64)
        return ((c[:, None, None] * w.double()).sum(0, keepdim=True).float(),
                (c[:, None] * b.double()).sum(0, keepdim=True).float())

    def forward(self, hidden: torch.Tensor, heads: list[int], coeffs: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden [B, S, in]`` → ``[B, S, m, out]``: the heads (or their fusion) of :meth:`weights`,
        cast to ``hidden``'s dtype (the bf16 compute of a mixed-precision run)."""
        w, b = self.weights(heads, coeffs)
        m, out, _ = w.shape
        y = F.linear(hidden, w.reshape(m * out, -1).to(hidden.dtype), b.reshape(m * out).to(hidden.dtype))
        return y.unflatten(-1, (m, out))


class ExpertHeadBanks(PDDHeadBank):
    """The head banks of two experts (module doc): itself the high-noise expert's (``weight.<k>``, ``bias.<k>``: a
    one-expert bank's keys), ``second`` the low-noise one's. ``forward`` / ``weights`` take the ``expert`` (0, 1) whose
    heads project — through this module's own ``forward``, so FSDP2 gathers both banks as one unit."""

    def __init__(self, high: torch.nn.Linear, low: torch.nn.Linear, num_heads: int) -> None:
        super().__init__(high, num_heads)
        self.second = PDDHeadBank(low, num_heads)

    def weights(self, heads: list[int], coeffs: torch.Tensor | None = None, expert: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if expert:
            return self.second.weights(heads, coeffs)
        return PDDHeadBank.weights(self, heads, coeffs)

    def forward(self, hidden: torch.Tensor, heads: list[int], coeffs: torch.Tensor | None = None,
                expert: int = 0) -> torch.Tensor:
        if expert:
            return self.second.forward(hidden, heads, coeffs)
        return PDDHeadBank.forward(self, hidden, heads, coeffs)


def read_head_bank(path: Path, expert: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight [H, out, in], bias [H, out])`` from a heads file — of ``expert`` 1, the low-noise expert's
    (``weight_2``/``bias_2``) — (:class:`UserError` when unreadable, or without that expert's heads)."""
    from safetensors import safe_open

    names = ("weight", "bias") if not expert else ("weight_2", "bias_2")
    try:
        with safe_open(str(path), framework="pt") as f:
            if names[0] not in f.keys():
                raise UserError(f"{path}: holds the heads of one expert; a model of two experts needs both "
                                "(weight_2, bias_2: the low-noise expert's)")
            return f.get_tensor(names[0]), f.get_tensor(names[1])
    except UserError:
        raise
    except Exception as exc:  # a corrupt or foreign file: one line, no traceback
        raise UserError(f"{path}: not a PDD head bank ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None


def write_head_bank(path: Path, weight: torch.Tensor, bias: torch.Tensor,
                    second: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Write a heads file (``weight [H, out, in]``, ``bias [H, out]``, float32; ``second``: a low-noise expert's
    ``(weight, bias)`` too, as ``weight_2``/``bias_2``)."""
    from safetensors.torch import save_file

    def plain(t: torch.Tensor) -> torch.Tensor:
        return t.detach().float().contiguous().cpu()

    tensors = {"weight": plain(weight), "bias": plain(bias)}
    meta = {"pdd_steps": str(int(weight.shape[0]))}
    if second is not None:
        tensors.update(weight_2=plain(second[0]), bias_2=plain(second[1]))
        meta["experts"] = "2"
    save_file(tensors, str(path), metadata=meta)


def empty_head_bank(transformer: torch.nn.Module, num_heads: int) -> PDDHeadBank:
    """A bank of ``num_heads`` heads shaped for ``transformer`` (a ``WanTransformer3DModel``; of two experts,
    :class:`ExpertHeadBanks`), each initialised from its ``proj_out``: what a checkpoint's ``heads`` are loaded into
    (export)."""
    from distillery.models.wan.experts import WanExperts

    if isinstance(transformer, WanExperts):
        return ExpertHeadBanks(transformer.transformer.proj_out, transformer.transformer_2.proj_out, num_heads)
    return PDDHeadBank(transformer.proj_out, num_heads)


def save_head_bank(path: Path, bank: PDDHeadBank) -> None:
    """Write ``bank`` as a heads file (:func:`write_head_bank`; a bias-less bank's ``bias`` is zeros; both experts'
    heads of an :class:`ExpertHeadBanks`)."""
    heads = list(range(len(bank.weight)))
    weight, bias = PDDHeadBank.weights(bank, heads)
    second = bank.second.weights(heads) if isinstance(bank, ExpertHeadBanks) else None
    write_head_bank(path, weight, bias, second)


class HeadBankModel(PDDModelBase):
    """The head-bank half of a PDD student of any family (module doc): the family's plugin
    (``class PDD<Family>Model(HeadBankModel, <Family>Model)``) calls :meth:`attach_head_bank` after building its
    transformer and gives :meth:`trunk_output`, one transformer call's raw output; everything else — what trains, the
    heads' forwards, the fused projection — is here. ``self.transformer.proj_out`` is the projection the bank
    replaces (``Linear(inner, out · prod(patch))``, its output channel-last per token, as Wan's and Cosmos' are)."""

    def head_projections(self) -> list[torch.nn.Linear]:
        """The projections the bank replaces: ``[self.transformer.proj_out]``; a family's model of two experts gives
        each expert's (the high-noise one's first)."""
        return [self.transformer.proj_out]

    def attach_head_bank(self, config: Any, role: str) -> None:
        """Freeze ``proj_out``, build the bank from it (``config.pdd_steps`` heads), load the folder's stored bank
        (``HEADS_FILE`` beside the weights) when there is one, hook ``proj_out`` — of two experts (two
        :meth:`head_projections`), an :class:`ExpertHeadBanks`, each expert's ``proj_out`` hooked to its own heads."""
        self.pdd_steps = int(config.pdd_steps)
        self._fine_sigmas = self.schedule.inference_sigmas(self.pdd_steps)  # derived once: [pdd_steps + 1], CPU
        projs = self.head_projections()
        for proj in projs:
            proj.requires_grad_(False)
        self.head_bank = (PDDHeadBank(projs[0], self.pdd_steps) if len(projs) == 1
                          else ExpertHeadBanks(projs[0], projs[1], self.pdd_steps))
        banks = [self.head_bank] + ([self.head_bank.second] if isinstance(self.head_bank, ExpertHeadBanks) else [])
        stored = Path(self.transformer_dir) / HEADS_FILE
        if stored.is_file():
            for expert, (bank, proj) in enumerate(zip(banks, projs)):
                weight, bias = read_head_bank(stored, expert)
                out = proj.weight.shape[0]
                if tuple(weight.shape) != (self.pdd_steps, *proj.weight.shape) or tuple(bias.shape) != (self.pdd_steps, out):
                    raise UserError(f"{stored}: holds {weight.shape[0]} heads of shape {tuple(weight.shape[1:])}; models.{role} "
                                    f"asks for pdd_steps={self.pdd_steps} heads of {tuple(proj.weight.shape)}")
                if not bank.has_bias and bool(bias.ne(0).any()):
                    raise UserError(f"{stored}: its heads have a bias; the transformer's proj_out has none")
                with torch.no_grad():
                    for k in range(self.pdd_steps):
                        bank.weight[k].copy_(weight[k])
                        if bank.has_bias:
                            bank.bias[k].copy_(bias[k])
        self.head_bank.requires_grad_(config.trainable)
        if len(projs) == 1:
            projs[0].register_forward_hook(_project_with_head_bank)
        else:
            for expert, proj in enumerate(projs):
                proj.register_forward_hook(partial(_project_with_head_bank, expert=expert))

    @abstractmethod
    def trunk_output(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, batch: Conditioning | TrainingBatch,
                     conditional: bool) -> torch.Tensor:
        """One call of ``self.forward_module`` on the family's inputs for ``noisy_latents`` ``[B, C, T, H, W]``: its
        raw output ``[B, M · C, T, H, W]`` (M heads: the bank's projections replace ``proj_out``'s, module doc)."""

    # -- what trains, what is saved ------------------------------------------------------------
    def trainable_modules(self) -> dict[str, torch.nn.Module]:
        return {"transformer": self.transformer, "heads": self.head_bank, **self.attached}

    def transformer_config(self) -> dict[str, Any]:
        return {**super().transformer_config(), "_pdd_steps": self.pdd_steps}

    def fine_sigmas(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The fine σ grid ``float32 [pdd_steps + 1]``, 1 → 0 (the ``pdd_steps``-step Euler grid)."""
        return self._fine_sigmas.to(device)

    def bind_device(self, device: torch.device, compute_dtype: torch.dtype = torch.float32, compute_copy: Any = None) -> None:
        super().bind_device(device, compute_dtype, compute_copy)
        if next(self.head_bank.parameters()).device != torch.device(device):  # FSDP2 placed it already
            self.head_bank.to(device)

    # -- forwards -----------------------------------------------------------------------------
    def predict_head_groups(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                            batch: Conditioning | TrainingBatch, groups: list[HeadGroup],
                            conditional: bool = True) -> list[torch.Tensor]:
        """One trunk forward at ``noisy_latents`` (``[B, C, T, H, W]``), projected by each group →
        per group float32 ``[B, m, C, T, H, W]`` (m = its heads, or 1 fused)."""
        for group in groups:
            if not group.heads or min(group.heads) < 0 or max(group.heads) >= self.pdd_steps:
                raise ValueError(f"heads {group.heads} outside the bank's 0 … {self.pdd_steps - 1}")
        pt, ph, pw = self.patch_size
        token = _REQUEST.set(_Request(self.head_bank, groups, pt * ph * pw))
        try:
            out = self.trunk_output(noisy_latents, timesteps, batch, conditional)
        finally:
            _REQUEST.reset(token)
        b, _, t, h, w = out.shape
        heads = out.float().reshape(b, -1, self.in_channels, t, h, w)
        return list(heads.split([g.size for g in groups], dim=1))

    def predict_pdd_heads(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                          batch: Conditioning | TrainingBatch, heads: list[int] | None = None,
                          conditional: bool = True) -> torch.Tensor:
        """Velocities of heads ``heads`` (default: all; e.g. ``list(range(a, b))`` for a head window)
        from one trunk forward at ``noisy_latents`` → float32 ``[B, m, C, T, H, W]``."""
        heads = list(range(self.pdd_steps)) if heads is None else list(heads)
        return self.predict_head_groups(noisy_latents, timesteps, batch, [HeadGroup(heads)], conditional)[0]

    def predict_pdd_fused(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, batch: Conditioning | TrainingBatch,
                          start: int, end: int, conditional: bool = True) -> torch.Tensor:
        """The block ``[start, end)``'s mean velocity ``Σ_k w_k head_k`` (float32 ``[B, C, T, H, W]``)
        from one forward through one fused projection; ``x_end = x_start + (σ_end − σ_start) ·`` this."""
        if not 0 <= start < end <= self.pdd_steps:
            raise ValueError(f"block [{start}, {end}) outside the {self.pdd_steps}-interval grid")
        group = HeadGroup(list(range(start, end)), block_weights(self.fine_sigmas(), start, end))
        return self.predict_head_groups(noisy_latents, timesteps, batch, [group], conditional)[0][:, 0]

    def head_for_timestep(self, timesteps: torch.Tensor) -> int:
        """The interval whose start node is nearest the (first) timestep: the head a plain
        ``predict_noise`` call uses."""
        t = float(timesteps.reshape(-1)[0])
        nodes = self.fine_sigmas()[:-1] * self.schedule.num_train_timesteps
        return int((nodes - t).abs().argmin())

    def predict_noise(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, batch: Conditioning | TrainingBatch,
                      conditional: bool = True) -> torch.Tensor:
        """The velocity of the head of the fine interval starting nearest ``timesteps`` (one Euler
        step on the fine grid; what a ``pdd_steps``-NFE sampler uses there)."""
        head = self.head_for_timestep(timesteps)
        return self.predict_pdd_heads(noisy_latents, timesteps, batch, [head], conditional)[:, 0]

    # -- fused export ---------------------------------------------------------------------------
    def fuse_into_projection(self, module: torch.nn.Module, start: int, end: int) -> None:
        """Write block ``[start, end)``'s fused projection into ``module.proj_out`` (a plain
        transformer of this trunk): that transformer's velocity is the block's mean
        velocity, so stock Euler with the block as one step reproduces the fused sampler (a bias-less projection's
        heads have none to write). Of two experts (``module`` their :class:`WanExperts`): into the ``proj_out`` of the
        expert of the block's start, whose heads those are."""
        expert = 0
        if isinstance(self.head_bank, ExpertHeadBanks):
            boundary = float(self.boundary_timestep) if self.boundary_timestep is not None else 0.0
            expert = int(float(self.fine_sigmas()[start]) * self.schedule.num_train_timesteps < boundary)
            module = module.experts[expert]
        coeffs = block_weights(self.fine_sigmas(), start, end)
        with torch.no_grad():
            heads = list(range(start, end))
            weight, bias = (self.head_bank.weights(heads, coeffs, expert=expert)
                            if isinstance(self.head_bank, ExpertHeadBanks) else self.head_bank.weights(heads, coeffs))
            module.proj_out.weight.copy_(weight[0].to(module.proj_out.weight.dtype))
            if module.proj_out.bias is not None:
                module.proj_out.bias.copy_(bias[0].to(module.proj_out.bias.dtype))


class PDDWanModel(HeadBankModel, WanModel):
    """A :class:`WanModel` whose output projection is a :class:`PDDHeadBank` (module doc); the Wan
    family's :class:`~distillery.models.base.PDDModelBase`."""

    config_class = PDDWanModelConfig
    two_experts = True  # a Wan 2.2 A14B folder: a head bank per expert (module doc)

    def __init__(self, config: PDDWanModelConfig, role: str, transformer: torch.nn.Module | None = None) -> None:
        WanModel.__init__(self, config, role, transformer)
        self.attach_head_bank(config, role)

    def head_projections(self) -> list[torch.nn.Linear]:
        from distillery.models.wan.experts import WanExperts

        if isinstance(self.transformer, WanExperts):
            return [expert.proj_out for expert in self.transformer.experts]
        return [self.transformer.proj_out]

    def trunk_output(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, batch: Conditioning | TrainingBatch,
                     conditional: bool) -> torch.Tensor:
        """The Wan transformer's output at ``noisy_latents`` (image-to-video: with the first frame's condition; two
        experts: each row through the expert of its timestep)."""
        return self.transformer_output(noisy_latents, timesteps, batch, conditional)
