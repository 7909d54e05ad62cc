"""Process group, device mesh and FSDP2 wrapping.

The same code path runs single-process (a world of one, set up in-process) and under
``torchrun`` (RANK/WORLD_SIZE/MASTER_ADDR from the environment): gloo on CPU, nccl on GPU.
Every role's transformer is sharded with ``fully_shard`` per block and then at the root, on a
1-D mesh (FSDP) or a ``(replicate, shard)`` mesh (HSDP); on GPU, compute runs in bf16 with fp32
master weights and fp32 gradient reduction.

**Meshes.** ``training.distributed.replicate_size`` R is the run's mesh: R = 1, one ``shard`` dim over
all W ranks (FSDP: parameters, gradients and optimizer state split W ways); R > 1, ``(replicate,
shard)`` = ``(R, W/R)`` (HSDP: each group of W/R consecutive ranks — one node when W/R is the GPUs
per node — holds one full copy, split W/R ways; gradients are reduce-scattered inside the group and
all-reduced across the R groups). A role may pick its own R (``models.<role>.distributed``), e.g. a
frozen teacher sharded over every rank; :meth:`DistEnv.mesh_for` builds each R's mesh once (a
collective: every rank asks for the same meshes in the same order). Every rank is data-parallel in
both layouts: rank r trains slice r of the global batch, so the trajectory does not depend on R.

**Sequence parallelism.** ``training.distributed.sp_size`` S > 1 splits each sample's tokens over S consecutive
ranks (one node: :mod:`~distillery.components.sequence_parallel`). The run's device mesh is then ``(replicate, shard,
sp)`` = ``(R, W/(R·S), S)``; FSDP2 shards over the flattened ``(shard, sp)`` dims (``shard_sp``: the SP ranks hold
shards of the weights too, as torchtitan's context parallelism does) and the ``sp`` dim is the SP group. The data —
batches and :class:`~distillery.components.rng.BatchRNG` draws — is split over the W/S *data ranks* only
(:attr:`DistEnv.data_rank`, :attr:`DistEnv.data_world`): the ranks of a group train the same samples.

**Tensor parallelism.** ``training.distributed.tp_size`` T > 1 splits each block's attention heads and FFN width over
T consecutive ranks (innermost: ``(replicate, shard, [sp,] tp)``), as DTensors on the ``tp`` dim
(:mod:`distillery.models.wan.tensor_parallel`); FSDP2 shards over the data dims ``(replicate, shard_sp)`` only. The
ranks of a TP group, like those of an SP group, train the same samples: W/(S·T) data ranks.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from distillery.common.errors import UserError
from distillery.components.sequence_parallel import SequenceParallel
from distillery.config.schema import DistributedConfig, model_parallel_problem


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    mesh: DeviceMesh  # the run's mesh (training.distributed.replicate_size)
    compute_dtype: torch.dtype  # bf16 under mixed precision, else fp32
    meshes: dict[int, DeviceMesh] = field(default_factory=dict)  # replicate size → its mesh (mesh_for)
    sp: SequenceParallel | None = None  # this rank's sequence-parallel group (None: sp_size 1)
    tp_size: int = 1  # ranks a block's heads and FFN are split over (training.distributed.tp_size)
    tp_meshes: dict[int, DeviceMesh] = field(default_factory=dict)  # replicate size → the TP dim of its device mesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sp_size(self) -> int:
        return self.sp.size if self.sp is not None else 1

    @property
    def data_rank(self) -> int:
        """This rank's index among the data-parallel ranks (the ranks of an SP × TP group share one)."""
        return self.rank // (self.sp_size * self.tp_size)

    @property
    def data_world(self) -> int:
        """The number of data-parallel ranks: ranks that train different samples (world / (sp_size · tp_size))."""
        return self.world_size // (self.sp_size * self.tp_size)

    def mesh_for(self, replicate_size: int, key: str = "training.distributed.replicate_size") -> DeviceMesh:
        """The ``(replicate_size, world/replicate_size)`` HSDP mesh (1-D ``shard`` when 1; without the ``tp`` dim), built
        on first use.

        Collective on first use (it creates process groups). A size that does not divide the world
        is a one-line :class:`UserError` naming ``key``."""
        if replicate_size not in self.meshes:
            fsdp, _, tp = build_mesh(self.device.type, self.world_size, replicate_size, key, self.sp_size, self.tp_size)
            self.meshes[replicate_size] = fsdp
            if tp is not None:
                self.tp_meshes[replicate_size] = tp
        return self.meshes[replicate_size]

    def tp_mesh_for(self, replicate_size: int) -> DeviceMesh | None:
        """The ``tp`` dim of the device mesh whose data dims are :meth:`mesh_for` ``(replicate_size)`` (call that first);
        None without tensor parallelism."""
        return self.tp_meshes.get(replicate_size)


def build_mesh(device_type: str, world: int, replicate_size: int, key: str, sp_size: int = 1,
               tp_size: int = 1) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh | None]:
    """``(FSDP2 mesh, device mesh, TP mesh)``. Without SP and TP: a 1-D ``("shard",)`` mesh over ``world`` ranks, or the
    ``("replicate", "shard")`` HSDP mesh — the device mesh itself —, and no TP mesh. With ``sp_size`` S > 1 the data
    dim is ``shard_sp`` and the device mesh has it unflattened into ``(shard, sp)``, whose ``sp`` dim is the SP group;
    with ``tp_size`` T > 1 a ``tp`` dim of T consecutive ranks comes last, FSDP2's mesh is the data dims
    ``(replicate, shard[_sp])`` of the same mesh and the TP mesh its ``tp`` dim (module doc)."""
    if replicate_size < 1 or world % replicate_size:
        raise UserError(f"config error: {key}: {replicate_size} does not divide the world size {world} "
                        f"(nodes x processes per node); use a divisor of {world}")
    if (world // replicate_size) % (sp_size * tp_size):
        raise UserError(f"config error: training.distributed: sp_size {sp_size} × tp_size {tp_size} does not divide the "
                        f"{world // replicate_size} ranks of a shard group ({key} {replicate_size} of a world of {world})")
    shard = "shard_sp" if sp_size > 1 else "shard"
    sizes, names = [world // (replicate_size * tp_size)], [shard]
    if replicate_size > 1:
        sizes, names = [replicate_size, *sizes], ["replicate", *names]
    if tp_size > 1:
        sizes, names = [*sizes, tp_size], [*names, "tp"]
    mesh = init_device_mesh(device_type, tuple(sizes), mesh_dim_names=tuple(names))
    fsdp = mesh[tuple(n for n in names if n != "tp")] if tp_size > 1 else mesh
    device = mesh
    if sp_size > 1:
        device = mesh._unflatten(shard, (world // (replicate_size * sp_size * tp_size), sp_size), ("shard", "sp"))
    return fsdp, device, (mesh["tp"] if tp_size > 1 else None)


def check_model_parallel(sp_size: int, tp_size: int, world: int) -> None:
    """``training.distributed.sp_size`` and ``tp_size`` against the launch, before any process group exists
    (:func:`~distillery.config.schema.model_parallel_problem`, with the processes per node torchrun sets in
    ``LOCAL_WORLD_SIZE``)."""
    problem = model_parallel_problem(sp_size, tp_size, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if problem:
        key, why = problem
        raise UserError(f"config error: training.distributed.{key}: {why}")


def _resolve_device(cfg: DistributedConfig) -> str:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError("config error: training.distributed.device: cuda requested but no CUDA device is available")
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def init_distributed(cfg: DistributedConfig) -> DistEnv:
    """Start (or join) the process group and build the device mesh."""
    device_type = _resolve_device(cfg)
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device_type == "cuda" else "gloo")
    if backend == "nccl" and device_type != "cuda":
        raise UserError("config error: training.distributed.backend: nccl needs CUDA; use gloo on CPU")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        # Expandable segments keep the caching allocator from fragmenting near the memory limit
        # (BENCHMARKS.md); a user's own PYTORCH_CUDA_ALLOC_CONF (even empty) wins. Read at the
        # allocator's first use, so this must precede any CUDA allocation.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=30)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend=backend, timeout=timeout, device_id=device if device_type == "cuda" else None)
        else:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    check_model_parallel(cfg.sp_size, cfg.tp_size, world)
    mesh, device_mesh, tp = build_mesh(device_type, world, cfg.replicate_size, "training.distributed.replicate_size",
                                       cfg.sp_size, cfg.tp_size)
    sp = None
    if cfg.sp_size > 1:
        sp = SequenceParallel(device_mesh["sp"].get_group(), cfg.sp_size, device_mesh["sp"].get_local_rank())
    mp = cfg.mixed_precision
    bf16 = mp == "bf16" or (mp == "auto" and device_type == "cuda")
    return DistEnv(rank, world, local_rank, device, backend, mesh, torch.bfloat16 if bf16 else torch.float32,
                   meshes={cfg.replicate_size: mesh}, sp=sp, tp_size=cfg.tp_size,
                   tp_meshes={cfg.replicate_size: tp} if tp is not None else {})


def uses_fsdp(env: DistEnv, cfg: DistributedConfig) -> bool:
    """FSDP2 wraps the transformers on more than one rank (or when asked to on one).

    On one rank without FSDP, bf16 training runs a bf16 compute copy of each trainable
    transformer beside its fp32 master (:mod:`distillery.components.precision`).
    """
    return env.world_size > 1 or cfg.shard_single_rank


def shard_transformer(
    transformer: torch.nn.Module,
    blocks: list[torch.nn.Module],
    env: DistEnv,
    cfg: DistributedConfig,
    compile_blocks: bool = False,
    mesh: DeviceMesh | None = None,
) -> torch.nn.Module:
    """Move ``transformer`` to the device and apply FSDP2 per block, then at the root (in place).

    ``mesh``: the role's mesh (:meth:`DistEnv.mesh_for`; default the run's, ``env.mesh``).

    Parameters are gathered in the compute dtype (bf16 under mixed precision) and gradients are
    reduced in fp32 into fp32 master weights. Forward inputs are *not* cast by FSDP: the model
    casts latents and text to the compute dtype itself and keeps timesteps and rotary tables in
    fp32, as diffusers' inference pipelines do. With a shard group of one rank, resharding after
    forward is skipped by default (it would only re-gather the same weights in backward).
    ``compile_blocks`` compiles each block (regional compilation) before it is wrapped.
    """
    transformer.to(env.device)
    if compile_blocks:
        for block in blocks:
            block.compile()
    mp = MixedPrecisionPolicy(param_dtype=env.compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    mesh = env.mesh if mesh is None else mesh
    reshard = cfg.reshard_after_forward
    if reshard is None:
        reshard = mesh.size(mesh.ndim - 1) > 1
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(transformer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    return transformer


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself, no DTensor dispatch), or ``t`` unchanged."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def all_reduce_mean(values: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over ranks (gloo has no AVG: SUM then divide)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        values /= dist.get_world_size()
    return values


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def broadcast_object(obj: object) -> object:
    """Rank 0's ``obj`` on every rank."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
