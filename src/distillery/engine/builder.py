"""Build a run's parts from a typed :class:`RunConfig`: role models, method, placement, optimizers, callbacks."""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from distillery.callbacks.base import Callback, CallbackList
from distillery.common.errors import UserError
from distillery.common.fsutil import file_kind
from distillery.common.log import get_logger
from distillery.common.ownpaths import refuse_link
from distillery.components.activation_checkpoint import checkpoint_blocks
from distillery.components.distributed import DistEnv, shard_transformer, uses_fsdp
from distillery.components.optim import role_optimizer_configs
from distillery.components.precision import ComputeCopy, cast_parameters_, compile_wanted
from distillery.config.schema import DistributedConfig, ModelRuntimeConfig, OptimizerConfig, RunConfig
from distillery.methods.base import TrainingMethod
from distillery.models.base import ModelBase
from distillery.models.lora import check_lora

log = get_logger("trainer")


@dataclass
class BuiltRun:
    """A run's parts, placed and ready to train: role → model, the method (its optimizers built)
    and the callbacks (in config order)."""

    models: dict[str, ModelBase]
    method: TrainingMethod
    callbacks: CallbackList


def build_models(config: RunConfig) -> dict[str, ModelBase]:
    """Instantiate each role's model (on CPU, fp32) from its component entry, with its LoRA adapter when it has one
    (``models.<role>.lora``: injected here, before the method and placement see the transformer)."""
    models = {}
    for role, comp in config.models.items():
        if not (isinstance(comp.cls, type) and issubclass(comp.cls, ModelBase)):
            raise UserError(f"config error: models.{role}._target_: {comp.target} is not a distillery model (ModelBase)")
        models[role] = comp.cls(comp.config, role=role)
        if comp.lora is not None:
            models[role].apply_lora(comp.lora)
    return models


def build_method(config: RunConfig, models: dict[str, ModelBase], rank: int, optimizers: dict[str, OptimizerConfig]) -> TrainingMethod:
    """The method over ``models`` with the per-role ``optimizers`` :func:`check_roles_early` resolved."""
    comp = config.method
    if not (isinstance(comp.cls, type) and issubclass(comp.cls, TrainingMethod)):
        raise UserError(f"config error: method._target_: {comp.target} is not a distillery method (TrainingMethod)")
    plugins = {"plugins": comp.plugins} if comp.plugins else {}  # a method naming plugins (rewards) takes them built
    return comp.cls(comp.config, models, config.training, rank=rank, optimizer_configs=optimizers, roles_checked=True,
                    **plugins)


def build_callbacks(config: RunConfig) -> CallbackList:
    out = CallbackList()
    for name, comp in config.callbacks.items():
        if not (isinstance(comp.cls, type) and issubclass(comp.cls, Callback)):
            raise UserError(f"config error: callbacks.{name}._target_: {comp.target} is not a distillery callback")
        plugins = {"plugins": comp.plugins} if comp.plugins else {}  # a callback naming plugins takes them resolved
        out.append(comp.cls(comp.config, name=name, **plugins))
    return out


def check_roles_early(config: RunConfig) -> dict[str, OptimizerConfig]:
    """Role/method fit — names, trainability, model kinds, per-role optimizers, the roles callbacks
    name — checked before any model is loaded (cheap, for --dry-run and stages), once per run; returns each trainable role's
    resolved optimizer config (:func:`~distillery.components.optim.role_optimizer_configs`)."""
    for role, model in config.models.items():
        if not (isinstance(model.cls, type) and issubclass(model.cls, ModelBase)):
            raise UserError(f"config error: models.{role}._target_: {model.target} is not a distillery model (ModelBase)")
    comp = config.method
    if not (isinstance(comp.cls, type) and issubclass(comp.cls, TrainingMethod)):
        raise UserError(f"config error: method._target_: {comp.target} is not a distillery method (TrainingMethod)")
    comp.cls.check_roles({role: c.config for role, c in config.models.items()})
    for role, model in config.models.items():
        comp.cls.check_role_kind(role, model.cls)
    for name, callback in config.callbacks.items():  # the roles a callback names, where the method's are checked
        if isinstance(callback.cls, type) and issubclass(callback.cls, Callback):
            callback.cls.check_roles(callback.config, config.models, f"callbacks.{name}")
    check_model_parallel_fit(config)
    for role, model in config.models.items():  # a LoRA on a frozen role, on no Linear layer, wider than one
        if model.lora is not None:
            trainable = bool(getattr(model.config, "trainable", False))
            check_lora(role, model.lora, trainable, model.cls.linear_layers(model.config) if trainable else None)
    return role_optimizer_configs(config)


def check_model_parallel_fit(config: RunConfig) -> None:
    """``training.distributed.sp_size`` / ``tp_size`` > 1 against the method (a method may declare it cannot take them:
    ``TrainingMethod.sequence_parallel`` / ``tensor_parallel``) and every role's model (its plugin's
    ``sequence_parallel_problem`` / ``tensor_parallel_problem``: e.g. heads that do not split over the group; a LoRA
    role is not split by TP), from the config and the models' ``config.json`` — before any weights load."""
    dist_cfg = config.training.distributed
    sp_size, tp_size = dist_cfg.sp_size, dist_cfg.tp_size
    method = config.method.cls
    for key, size, what in (("sp_size", sp_size, "sequence"), ("tp_size", tp_size, "tensor")):
        problem = method.parallel_problem(config.method.config, what) if hasattr(method, "parallel_problem") else \
            None if getattr(method, f"{what}_parallel", False) else f"{method.__name__} does not take {what} parallelism"
        if size > 1 and problem:
            raise UserError(f"config error: training.distributed.{key}: {size}, but {problem}; use {key} 1")
    if sp_size == 1 and tp_size == 1:
        return
    key = "tp_size" if tp_size > 1 else "sp_size"
    where = f"config error: training.distributed.{key}: {tp_size if tp_size > 1 else sp_size}"
    for role, model in config.models.items():
        if tp_size > 1 and model.lora is not None:
            raise UserError(f"{where}: models.{role} trains a LoRA adapter, which tensor parallelism does not split; "
                            "use tp_size 1 (sp_size splits the sequence whatever trains)")
        problem = (model.cls.tensor_parallel_problem(model.config, tp_size, sp_size) if tp_size > 1
                   else model.cls.sequence_parallel_problem(model.config, sp_size))
        if problem:
            raise UserError(f"{where}: models.{role}: {problem}")


def build_run(config: RunConfig, env: DistEnv) -> BuiltRun:
    """Models → method → placement (FSDP2 sharding / compute copies; a role's shadow twins as the role) → optimizers
    → callbacks."""
    from distillery.engine.batches import check_data_kind

    check_data_kind(config)  # a method that reads video latents on a prompt-only set: one line before any model loads
    optimizers = check_roles_early(config)
    models = build_models(config)
    method = build_method(config, models, env.data_rank, optimizers)
    runtime = config.training.model
    if (env.sp is not None or env.tp_size > 1) and env.is_main:
        log.info("sequence parallel: %d ranks per sample (Ulysses), tensor parallel: %d, %d data ranks", env.sp_size,
                 env.tp_size, env.data_world)
    for role, model in models.items():  # in config order on every rank (a new mesh is a collective)
        if runtime.activation_checkpointing and runtime.activation_checkpointing_fraction >= 1.0 and hasattr(model, "enable_activation_checkpointing"):
            model.enable_activation_checkpointing()  # every block: diffusers' own (a share of them: place_model)
        own = config.models[role].distributed
        for placed in (model, *method.twins_of(role)):  # a method's frozen twins of the role: placed as the role is
            place_model(placed, env, config.training.distributed, runtime, own.replicate_size if own else None)
    method.build_optimizers()
    return BuiltRun(models=models, method=method, callbacks=build_callbacks(config))


def resolve_compile(runtime: ModelRuntimeConfig, env: DistEnv) -> bool:
    """``training.model.compile``; null: on for bf16 on CUDA (the fastest step, BENCHMARKS.md), off otherwise."""
    return compile_wanted(runtime.compile, env.device, env.compute_dtype)


def place_model(model: ModelBase, env: DistEnv, dist_cfg: DistributedConfig, runtime: ModelRuntimeConfig,
                replicate_size: int | None = None) -> None:
    """Put one role on the device in the form it trains in.

    - FSDP2 (several ranks, or ``shard_single_rank: true``): sharded fp32 masters, bf16 gathers, on
      the role's mesh: ``replicate_size`` (``models.<role>.distributed``) or the run's
      (``training.distributed.replicate_size``), :meth:`~distillery.components.distributed.DistEnv.mesh_for`.
    - One rank without FSDP, bf16 compute: a trainable role gets a bf16 compute copy beside its
      fp32 master (:class:`~distillery.components.precision.ComputeCopy`); a frozen role is cast to bf16 in
      place (no master is needed). Buffers (RoPE tables) stay fp32.
    - fp32 compute (CPU by default): the transformer itself, as loaded.

    ``runtime.compile`` compiles the module that runs forward (:func:`resolve_compile`): each of its blocks
    (``compile_mode: blocks``, regional compilation) or the whole of it (``model``);
    ``runtime.attention_backend`` picks the attention kernel (``auto``: FA4 where it runs, else SDPA). Under
    sequence parallelism (``env.sp``) the role's forwards split their tokens over the SP group (every role: the
    frozen ones' activations are as large).
    """
    if runtime.attention_backend not in ("native", "auto") and env.device.type != "cuda":
        raise UserError(
            f"config error: training.model.attention_backend: {runtime.attention_backend} needs a CUDA device; use native"
        )
    model.set_attention_backend(runtime.attention_backend, env.device, env.compute_dtype)
    if env.sp is not None:  # every role's forwards split their tokens over the SP group (after the backend's processors)
        model.enable_sequence_parallel(env.sp)
    compiled = resolve_compile(runtime, env)
    compile_blocks = compiled and runtime.compile_mode == "blocks"
    if compiled:  # every Wan block: both torch bugs below, bidirectional ones included
        avoid_mix_order_reduction()
    extra = {name: m for name, m in model.trainable_modules().items() if m is not model.transformer}
    partial_ac = runtime.activation_checkpointing and runtime.activation_checkpointing_fraction < 1.0 and model.trainable
    if uses_fsdp(env, dist_cfg):
        mesh = (env.mesh_for(dist_cfg.replicate_size) if replicate_size is None
                else env.mesh_for(replicate_size, f"models.{model.role}.distributed.replicate_size"))
        if env.is_main:
            dims = " x ".join(f"{name} {mesh.size(i)}" for i, name in enumerate(mesh.mesh_dim_names or ()))
            log.info("role %s: %s on mesh (%s)%s", model.role, "HSDP" if mesh.ndim > 1 else "FSDP2", dims,
                     f", blocks split over tp {env.tp_size}" if env.tp_size > 1 else "")
        if partial_ac:  # before the blocks are compiled and wrapped
            _checkpoint_some_blocks(model, model.shardable_blocks(), runtime.activation_checkpointing_fraction)
        tp_mesh = env.tp_mesh_for(dist_cfg.replicate_size if replicate_size is None else replicate_size)
        if tp_mesh is not None:  # the blocks split over the TP dim before FSDP2 shards them over the data dims
            model.enable_tensor_parallel(tp_mesh)
        shard_transformer(model.transformer, model.shardable_blocks(), env, dist_cfg, compile_blocks, mesh)
        for module in extra.values():  # e.g. a PDD head bank: one FSDP unit of its own
            shard_transformer(module, [], env, dist_cfg, False, mesh)
        model.bind_device(env.device, env.compute_dtype)
        if compiled and not compile_blocks:
            model.transformer.compile()
        return
    compute_copy = None
    if env.compute_dtype != torch.float32:
        if model.trainable:
            compute_copy = ComputeCopy(model.transformer, env.compute_dtype, env.device)
        else:
            cast_parameters_(model.transformer, env.compute_dtype)
    model.transformer.to(env.device)
    for module in extra.values():  # fp32 on the device (the model casts what it computes with)
        module.to(env.device)
    model.bind_device(env.device, env.compute_dtype, compute_copy)
    if partial_ac:  # on the blocks that run forward (the compute copy's), before they are compiled
        _checkpoint_some_blocks(model, model.shardable_blocks(model.forward_module), runtime.activation_checkpointing_fraction)
    if compile_blocks:
        for block in model.shardable_blocks(model.forward_module):
            block.compile()
    elif compiled:
        model.forward_module.compile()


def _checkpoint_some_blocks(model: ModelBase, blocks: list[torch.nn.Module], fraction: float) -> None:
    chosen = checkpoint_blocks(blocks, fraction)
    log.info("role %s: activation checkpointing on %d of %d blocks (%s)", model.role, len(chosen), len(blocks),
             ", ".join(map(str, chosen)) or "none")


def avoid_mix_order_reduction() -> None:
    """Turn off Inductor's "mix-order reduction" (Triton, i.e. CUDA; on by default since torch 2.10) for this process.

    Two torch bugs in it hit the Wan blocks we compile:

    - pytorch/pytorch#193061 (fix PR #193103; still unfixed in torch 2.13): a Wan block's ``scale_shift_table`` is
      ``chunk``-ed into the modulation vectors of chained modulated norms; the fused reduction that computes their
      gradients never writes its result into the table's gradient buffer, so the compiled backward returns
      uninitialised or stale memory as that gradient. The likely cause of ``grad_norm/critic=inf,
      grad_norm/student=inf`` at step 1 of DMD2 on 2 GPUs under FSDP2 (issue 29; Self-Forcing, whose causal student
      already turned this off, was finite); confirmed on an H200 (BENCHMARKS.md, 2026-12-01; the retired probe:
      ``git show b3d4e5b:bench/dmd2_two_gpu_probe.py``).
    - pytorch/pytorch#178080 (fix PR #178098): a fused row + column reduction returns a broadcast input's gradient as
      ``[C]`` instead of ``[1, 1, C]`` and backward fails with "CompiledFunctionBackward returned an invalid gradient"
      (Self-Forcing's causal blocks with activation checkpointing at 21×60×104, BENCHMARKS.md, 2026-11-30).

    Process-wide: Inductor reads it when it compiles, so calling this before the first compiled forward is enough.
    """
    from torch._inductor import config as inductor_config

    if getattr(inductor_config.triton, "mix_order_reduction", False):
        inductor_config.triton.mix_order_reduction = False


def check_data_path(path: str) -> Path:
    if not path:
        raise UserError("config error: training.data.path: required (a folder of latent parquet shards)")
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"config error: training.data.path: {p} is not a folder")
    return p


def check_output_dir(path: str | Path) -> Path:
    """``training.checkpoint.output_dir``, created when absent, and probed with a real file (root
    ignores permission bits): a one-line UserError when it is, or lies under, something that is not
    a folder (a file, ``/dev/null``), is a symbolic link, or no file can be created in it (``/proc``, a
    read-only mount).
    Called before any model is loaded."""
    where = "config error: training.checkpoint.output_dir"
    p = Path(path)
    if not str(path):
        raise UserError(f"{where}: required (the folder the run's checkpoints are written to)")
    refuse_link(p, f"{where}:")  # never written or pruned through a link (docs/reliability.md)
    for existing in (p, *p.parents):  # the nearest part of the path that exists must be a folder
        try:
            mode = os.stat(existing).st_mode
        except OSError:  # absent, or under a file (ENOTDIR: the file is found further up)
            continue
        if not stat.S_ISDIR(mode):
            what = p if existing == p else f"{p}: {existing}"
            raise UserError(f"{where}: {what} is {file_kind(mode)}, not a folder; name a folder for the run's checkpoints")
        break
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=p)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UserError(f"{where}: cannot create files in {p} ({exc.strerror or exc}); name a folder the run "
                        "can write to") from None
    return p


def seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
