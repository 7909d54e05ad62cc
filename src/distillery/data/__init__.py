"""The latent data layer: parquet latent shards (docs/architecture.md §2), datasets, batching and sampling.

- :mod:`.latent_format` — the shard schema and tensor <-> bytes codecs.
- :mod:`.writer` — :class:`LatentRecord` / :class:`PromptRecord` and atomic zstd shard writing.
- :mod:`.prompts` — a prompts file (one prompt a line, or JSONL) read with limits and encoded to a prompt-only set.
- :mod:`.dataset` — :class:`LatentDataset`, :func:`collate_latents`, the empty-prompt embedding.
- :mod:`.sampler` — :class:`ShardedBatchSampler` (rank-sharded, resumable) and :class:`LatentBatchLoader`.
"""

from distillery.data.dataset import (
    LatentDataset,
    collate_latents,
    data_kind,
    pad_prompt_embedding,
    read_empty_prompt_embedding,
    read_text_embeddings,
    write_empty_prompt_embedding,
)
from distillery.data.latent_format import SCHEMA, tensor_from_bytes, tensor_to_record_fields
from distillery.data.sampler import LatentBatchLoader, ShardedBatchSampler
from distillery.data.writer import LatentRecord, PromptRecord, shard_path, write_latent_shards, write_prompt_shard, write_shard

__all__ = [
    "SCHEMA",
    "LatentBatchLoader",
    "LatentDataset",
    "LatentRecord",
    "PromptRecord",
    "ShardedBatchSampler",
    "collate_latents",
    "data_kind",
    "pad_prompt_embedding",
    "read_empty_prompt_embedding",
    "read_text_embeddings",
    "shard_path",
    "tensor_from_bytes",
    "tensor_to_record_fields",
    "write_empty_prompt_embedding",
    "write_latent_shards",
    "write_prompt_shard",
    "write_shard",
]
