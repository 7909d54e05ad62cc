"""Wan text-to-video plugin over ``diffusers.WanTransformer3DModel``: full (bidirectional)
attention over the whole video. Where the weights and the flow shift come from: :mod:`.common`.

The folder's layout (:mod:`.experts`) is Wan 2.1's (one transformer, one timestep per sample), Wan 2.2
TI2V-5B's (one timestep per token, as ``WanPipeline(expand_timesteps=True)`` feeds it) or Wan 2.2 A14B's (two
experts, :class:`~distillery.models.wan.experts.WanExperts`: each sample goes to the expert of its timestep,
in training and in sampling alike).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from distillery.common.errors import UserError
from distillery.common.log import get_logger
from distillery.components.rng import BatchRNG
from distillery.models.base import CausalModelBase, Conditioning, ModelBase, TrainingBatch, load_transformer
from distillery.models.wan.attention import install_attention_backend, resolve_attention_backend
from distillery.models.wan.common import TRANSFORMER_CLASS, WanModelConfig, image_conditioning, locate_transformer
from distillery.models.wan.experts import LAYOUT_KEY, WanExperts, expert_index, read_wan_layout
from distillery.models.wan.sparse import install_sparse_attention, record, spec_of

#: Diffusers' Wan attention splits an image-to-video context as ``[image tokens, the last 512 text tokens]``.
I2V_TEXT_TOKENS = 512

log = get_logger("models.wan")

# The transformer's output is a reshaped view; we never modify it in place, so FSDP2's warning
# about in-place ops on returned views does not apply.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

class WanModel(ModelBase):
    """One role backed by a diffusers ``WanTransformer3DModel`` (fp32 master weights on CPU at build)."""

    config_class = WanModelConfig
    two_experts: bool = True  # whether this plugin runs a two-expert (Wan 2.2 A14B) folder
    _routed_expert: int | None = None  # set: every sample of the next forward goes to this expert (a causal cache write)

    def __init__(self, config: WanModelConfig, role: str, transformer: torch.nn.Module | None = None) -> None:
        """``transformer``: an already loaded ``WanTransformer3DModel`` of ``config.init_from`` to wrap
        instead of loading it again (a diffusers pipeline's own component)."""
        super().__init__(config, role)
        from diffusers import WanTransformer3DModel

        transformer_dir, scheduler_dir = locate_transformer(config.init_from)
        self.transformer_dir = transformer_dir
        self.layout = read_wan_layout(transformer_dir)
        if self.layout.second_dir is not None and not self.two_experts:
            raise UserError(f"models.{role}: {config.init_from} is a two-expert Wan 2.2 A14B model; "
                            f"{type(self).__name__} runs one transformer (only the bidirectional WanModel takes two experts)")

        def load(folder: Any) -> torch.nn.Module:
            return load_transformer(WanTransformer3DModel, folder, config.random_init)

        if transformer is not None:
            self.transformer = transformer
        elif self.layout.second_dir is not None:
            self.transformer = WanExperts(load(transformer_dir), load(self.layout.second_dir), self.layout.boundary_ratio)
        else:
            self.transformer = load(transformer_dir)
        self.experts = isinstance(self.transformer, WanExperts)
        if self.experts != (self.layout.second_dir is not None):
            raise UserError(f"models.{role}: {transformer_dir}: the given transformer does not match the folder's experts")
        if self.layout.record():  # every transformer this plugin trains remembers its layout (module doc of .experts)
            high = self.transformer.transformer if isinstance(self.transformer, WanExperts) else self.transformer
            high.register_to_config(**{LAYOUT_KEY: self.layout.record()})
        self.settle_transformer(scheduler_dir)
        shift = self.schedule.shift
        self.boundary_timestep = (self.layout.boundary_ratio * self.schedule.num_train_timesteps
                                  if self.layout.boundary_ratio is not None else None)
        cfg = self.transformer.config
        self.patch_size = tuple(cfg.patch_size)
        self.image_conditioning = image_conditioning(dict(cfg))  # None: text-to-video
        self.in_channels = int(cfg.in_channels) if self.image_conditioning is None else self.image_conditioning.latent_channels
        self.text_dim = int(cfg.text_dim)
        self.attention_backend = "native"  # set_attention_backend resolves and installs another
        self.sparse = spec_of(config, role, transformer_dir)  # block-sparse self-attention (models/wan/sparse.py); None: dense
        if self.sparse is not None and self.experts:
            raise UserError(f"config error: models.{role}: sparse attention on a two-expert Wan 2.2 A14B model is not "
                            "supported; use attention: dense")
        if not self.experts:
            record(self.transformer, self.sparse)  # the config says how this transformer attends (None: dense)
        if self.sparse is not None and not isinstance(self, CausalModelBase):  # the causal plugin installs its own
            install_sparse_attention(self.transformer, self.sparse)
        log.info("role %s: %s%s from %s (%.1f M params, shift %.2f)", role, TRANSFORMER_CLASS,
                 f" x2 (experts at t >= {self.boundary_timestep:g} / below)" if self.experts else "", transformer_dir,
                 sum(p.numel() for p in self.transformer.parameters()) / 1e6, shift)

    @classmethod
    def linear_layers(cls, config: WanModelConfig) -> dict[str, tuple[int, int]]:
        """The Linear layers of ``config.init_from``'s transformer, built on the meta device from its ``config.json``; of
        two experts, both experts' (``transformer.<path>``, ``transformer_2.<path>``: a LoRA's targets adapt both)."""
        from diffusers import WanTransformer3DModel

        from distillery.models.lora import linear_layers

        transformer_dir, _ = locate_transformer(config.init_from)
        layout = read_wan_layout(transformer_dir)
        with torch.device("meta"):
            modules = [WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(folder))
                       for folder in (transformer_dir, layout.second_dir) if folder is not None]
        if len(modules) == 1:
            return linear_layers(modules[0])
        return {f"{name}.{path}": shape for name, module in zip(("transformer", "transformer_2"), modules)
                for path, shape in linear_layers(module).items()}

    def source(self) -> dict[str, Any]:
        """:meth:`ModelBase.source`; of two experts, with the second expert's folder and sha256 under ``second`` (a
        diffusers folder keeps it beside ``transformer/``, outside the first's digest)."""
        out = super().source()
        if self.layout.second_dir is not None:
            from distillery.common.hashcache import folder_sha256

            out["second"] = {"path": str(self.layout.second_dir), "sha256": folder_sha256(self.layout.second_dir)}
        return out

    def set_attention_backend(self, backend: str, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        """Route the transformer's attention to ``backend`` (:mod:`.attention`: ``auto`` resolves for ``device`` and
        ``dtype``, default the bound ones): SDPA through diffusers' dispatcher (native | cudnn | flash | efficient)
        or FlashAttention-4 (fa4 | fa4_sparse). The resolved name is kept in ``self.attention_backend``."""
        resolved = resolve_attention_backend(backend, self.device if device is None else device,
                                             self.compute_dtype if dtype is None else dtype)
        for module in {id(m): m for m in (self.transformer, self.forward_module)}.values():  # a compute copy made already too
            install_attention_backend(module, resolved)
        self.attention_backend = resolved
        if resolved != "native":
            log.info("role %s: attention backend %s%s", self.role, resolved, f" (from {backend})" if backend != resolved else "")

    @classmethod
    def sequence_parallel_problem(cls, config: WanModelConfig, sp_size: int) -> str | None:
        """Ulysses splits the attention heads over the SP group: ``sp_size`` must divide the folder's
        ``num_attention_heads`` (read from its ``config.json``). Any sequence length is split (padded: :mod:`.sequence_parallel`)."""
        from diffusers import WanTransformer3DModel

        from distillery.components.sequence_parallel import heads_problem

        if sp_size == 1:
            return None
        transformer_dir, _ = locate_transformer(config.init_from)
        heads = int(WanTransformer3DModel.load_config(transformer_dir)["num_attention_heads"])
        problem = heads_problem(heads, sp_size)
        return f"{transformer_dir}: {problem}" if problem else None

    def enable_sequence_parallel(self, sp: Any) -> None:
        """Split every forward's tokens over ``sp`` (:func:`~distillery.models.wan.sequence_parallel.install_sequence_parallel`
        on the transformer, each of two experts)."""
        from distillery.models.wan.sequence_parallel import install_sequence_parallel

        for module in {id(m): m for m in (self.transformer, self.forward_module)}.values():
            for transformer in (module.experts if isinstance(module, WanExperts) else (module,)):
                install_sequence_parallel(transformer, sp)

    @classmethod
    def tensor_parallel_problem(cls, config: WanModelConfig, tp_size: int, sp_size: int = 1) -> str | None:
        """The folder's heads must split over ``tp_size × sp_size``, its FFN width over ``tp_size``
        (:func:`~distillery.models.wan.tensor_parallel.tensor_parallel_problem`, from its ``config.json``)."""
        from diffusers import WanTransformer3DModel

        from distillery.models.wan.tensor_parallel import tensor_parallel_problem

        if tp_size == 1:
            return cls.sequence_parallel_problem(config, sp_size)
        transformer_dir, _ = locate_transformer(config.init_from)
        problem = tensor_parallel_problem(dict(WanTransformer3DModel.load_config(transformer_dir)), tp_size, sp_size)
        return f"{transformer_dir}: {problem}" if problem else None

    def enable_tensor_parallel(self, mesh: Any) -> None:
        """Split each block's attention and FFN over the TP ``mesh``
        (:func:`~distillery.models.wan.tensor_parallel.install_tensor_parallel`; each of two experts)."""
        from distillery.models.wan.tensor_parallel import install_tensor_parallel

        for transformer in (self.transformer.experts if isinstance(self.transformer, WanExperts) else (self.transformer,)):
            install_tensor_parallel(transformer, mesh)

    def hidden_width(self) -> int:
        """``num_attention_heads · attention_head_dim``: the width of the hidden states every block returns."""
        config = self.transformer_config()
        return int(config["num_attention_heads"]) * int(config["attention_head_dim"])

    def shardable_blocks(self, module: torch.nn.Module | None = None) -> list[torch.nn.Module]:
        return list((module if module is not None else self.transformer).blocks)

    def transformer_config(self) -> dict[str, Any]:
        """The transformer's config; of two experts, the high-noise one's with the second's config under
        ``_wan_layout.transformer_2`` (what :func:`~distillery.models.wan.common.build_transformer` rebuilds both from)."""
        config = dict(self.transformer.config)
        if isinstance(self.transformer, WanExperts):
            config[LAYOUT_KEY] = {**self.layout.record(), "transformer_2": dict(self.transformer.transformer_2.config)}
        return config

    def enable_activation_checkpointing(self) -> None:
        """Recompute each block's activations in backward (diffusers' gradient checkpointing)."""
        self.transformer.enable_gradient_checkpointing()

    def sample_timesteps(self, batch_size: int, rng: BatchRNG) -> torch.Tensor:
        sigmas = self.schedule.sample_sigmas(
            batch_size, rng, self.config.timestep_sampling, self.config.logit_mean, self.config.logit_std
        )
        return sigmas * self.schedule.num_train_timesteps

    def _model_timesteps(self, timesteps: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """Per-sample ``[B]`` stays — unless the layout expands timesteps (TI2V-5B): then, as ``WanPipeline`` does,
        one per token —; per-frame ``[B, T]`` becomes per-token ``[B, T/pt · H/ph · W/pw]``."""
        p_t, p_h, p_w = self.patch_size
        _, _, t, h, w = latents.shape
        if timesteps.ndim == 1:
            if not self.layout.expand_timesteps:
                return timesteps
            return timesteps[:, None].expand(-1, (t // p_t) * (h // p_h) * (w // p_w))
        if timesteps.shape[1] != t:
            raise ValueError(f"per-frame timesteps {tuple(timesteps.shape)} do not match {t} latent frames")
        per_patch_frame = timesteps[:, ::p_t]
        return per_patch_frame.repeat_interleave((h // p_h) * (w // p_w), dim=1)

    def predict_noise(
        self,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        batch: Conditioning | TrainingBatch,
        conditional: bool = True,
    ) -> torch.Tensor:
        return self.transformer_output(noisy_latents, timesteps, batch, conditional).float()

    def transformer_output(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, batch: Conditioning | TrainingBatch,
                           conditional: bool = True) -> torch.Tensor:
        """The transformer's raw output at ``noisy_latents`` (its compute dtype; float32 of two experts, each row through
        the expert of its timestep): the text of the branch, an image-to-video model's first-frame condition, the
        layout's timesteps."""
        text = batch.text_embeds if conditional else batch.negative_text_embeds
        if text is None:
            text = torch.zeros_like(batch.text_embeds)
        dtype = self.input_dtype()
        hidden, image = noisy_latents.to(dtype), None
        if self.image_conditioning is not None:
            hidden, text, image = self._image_inputs(hidden, text, batch)
        if self.experts:  # Wan 2.2 A14B: its I2V form conditions by the latent channels only (no image encoder)
            return self._predict_by_expert(hidden, timesteps, text.to(dtype))
        return self.forward_module(
            hidden_states=hidden,
            timestep=self._model_timesteps(timesteps, noisy_latents).float(),
            encoder_hidden_states=text.to(dtype),
            encoder_hidden_states_image=None if image is None else image.to(dtype),
            return_dict=False,
        )[0]

    def _image_inputs(self, hidden: torch.Tensor, text: torch.Tensor, batch: Conditioning | TrainingBatch,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """An image-to-video transformer's inputs, as ``WanImageToVideoPipeline`` builds them: the noisy latent then
        the first-frame condition (mask, latent) on the channel axis; the image embeddings when the model takes them,
        with the prompt zero-padded to the 512 tokens diffusers' attention takes as the text (the unconditional
        forward keeps the frame: only the prompt is dropped, as the pipeline's CFG does)."""
        spec = self.image_conditioning
        first = getattr(batch, "first_frame", None)
        if first is None:
            raise UserError(f"models.{self.role}: {self.transformer_dir} is an image-to-video model; its batches need "
                            "the first frame's condition (latents made from this base by the latents stage)")
        if first.shape[1] != spec.condition_channels or first.shape[2:] != hidden.shape[2:] or first.shape[0] not in (1, hidden.shape[0]):
            raise ValueError(f"first_frame {tuple(first.shape)} does not fit latents {tuple(hidden.shape)} "
                             f"({spec.mask_channels} mask + {spec.latent_channels} latent channels)")
        first = first.to(hidden.dtype).expand(hidden.shape[0], -1, -1, -1, -1)
        hidden = torch.cat([hidden, first], dim=1)
        image = None
        if spec.image_dim is not None:
            image = getattr(batch, "image_embeds", None)
            if image is None:
                raise UserError(f"models.{self.role}: {self.transformer_dir} takes image-encoder embeddings "
                                f"(image_dim {spec.image_dim}); its batches have none (rerun the latents stage on this base)")
            image = image.expand(hidden.shape[0], -1, -1)
            if text.shape[1] > I2V_TEXT_TOKENS:
                raise ValueError(f"an image-to-video prompt of {text.shape[1]} tokens; diffusers' Wan takes {I2V_TEXT_TOKENS}")
            text = torch.nn.functional.pad(text, (0, 0, 0, I2V_TEXT_TOKENS - text.shape[1]))
        return hidden, text, image

    def _predict_by_expert(self, latents: torch.Tensor, timesteps: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """Each sample through the expert of its timestep (:func:`~distillery.models.wan.experts.expert_index`),
        the rows put back in order. Sharded over several ranks, every rank runs each expert some rank needs (an
        expert's FSDP2 gathers are collectives): a rank with no sample for it runs its first sample and adds the
        result times zero (so a backward reaches the expert's blocks on every rank too)."""
        assert self.boundary_timestep is not None
        if self._routed_expert is not None:  # one expert for every sample (a causal model's write into its own cache)
            which = torch.full((latents.shape[0],), int(self._routed_expert), dtype=torch.long, device=latents.device)
        else:
            which = expert_index(timesteps, self.boundary_timestep)
        needed = torch.stack([(which == e).any() for e in (0, 1)]).to(torch.int32)
        if _sharded_over_ranks(self.forward_module):
            import torch.distributed as dist

            dist.all_reduce(needed, op=dist.ReduceOp.MAX)
        needed_list = needed.tolist()  # one host sync: which rows go where is data-dependent
        out: torch.Tensor | None = None
        spare = None
        for expert in (0, 1):
            if not needed_list[expert]:
                continue
            rows = (which == expert).nonzero().squeeze(1)
            idle = rows.numel() == 0
            if idle:
                rows = rows.new_zeros(1)
            part = self.forward_module(
                expert,
                hidden_states=latents[rows],
                timestep=self._model_timesteps(timesteps[rows], latents[rows]).float(),
                encoder_hidden_states=text[rows],
                return_dict=False,
            )[0].float()
            if idle:
                spare = part.sum() * 0.0
                continue
            if out is None:
                out = torch.zeros(latents.shape[:1] + part.shape[1:], dtype=part.dtype, device=part.device)
            out = out.index_copy(0, rows, part)
        assert out is not None
        return out + spare if spare is not None else out


def _sharded_over_ranks(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 module of a process group of more than one rank."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule) and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
