"""The latent data layer: parquet latent shards (docs/architecture.md §2), datasets, batching and sampling.

- :mod:`.latent_format` — the shard schema and tensor <-> bytes codecs.
- :mod:`.writer` — :class:`LatentRecord` and atomic zstd shard writing.
- :mod:`.dataset` — :class:`LatentDataset`, :func:`collate_latents`, the empty-prompt embedding.
- :mod:`.sampler` — :class:`ShardedBatchSampler` (rank-sharded, resumable) and :class:`LatentBatchLoader`.
"""

from distillery.data.dataset import (
    LatentDataset,
    collate_latents,
    pad_prompt_embedding,
    read_empty_prompt_embedding,
    write_empty_prompt_embedding,
)
from distillery.data.latent_format import SCHEMA, tensor_from_bytes, tensor_to_record_fields
from distillery.data.sampler import LatentBatchLoader, ShardedBatchSampler
from distillery.data.writer import LatentRecord, shard_path, write_latent_shards, write_shard

__all__ = [
    "SCHEMA",
    "LatentBatchLoader",
    "LatentDataset",
    "LatentRecord",
    "ShardedBatchSampler",
    "collate_latents",
    "pad_prompt_embedding",
    "read_empty_prompt_embedding",
    "shard_path",
    "tensor_from_bytes",
    "tensor_to_record_fields",
    "write_empty_prompt_embedding",
    "write_latent_shards",
    "write_shard",
]
