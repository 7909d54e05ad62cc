"""Tests of the latent data layer: format codecs, shard writing, dataset, collation, sampling."""

from __future__ import annotations

import itertools
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from distillery.common.errors import UserError
from distillery.data import (
    LatentBatchLoader,
    LatentDataset,
    LatentRecord,
    ShardedBatchSampler,
    collate_latents,
    read_empty_prompt_embedding,
    tensor_from_bytes,
    tensor_to_record_fields,
    write_empty_prompt_embedding,
    write_latent_shards,
    write_shard,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().view(_INT_VIEW[a.dtype]), b.contiguous().view(_INT_VIEW[b.dtype]))


def special_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random values plus NaN, ±inf, -0.0 and a subnormal, so equality must be bitwise."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g).to(dtype)
    flat = t.view(-1)
    specials = [float("nan"), float("inf"), float("-inf"), -0.0, torch.finfo(dtype).tiny / 4]
    flat[: min(len(specials), flat.numel())] = torch.tensor(specials[: flat.numel()]).to(dtype)
    return t


def make_record(i: int, dtype: torch.dtype, text_len: int, latent_shape=(4, 2, 3, 5), dim: int = 6) -> LatentRecord:
    return LatentRecord(
        id=f"clip-{i:03d}",
        caption=f"caption {i}",
        latent=special_tensor(latent_shape, dtype, seed=i),
        text_embedding=special_tensor((text_len, dim), dtype, seed=1000 + i),
        num_frames=5,
        height=24,
        width=40,
        fps=8.0,
        source=f"synthetic/{i}",
    )


# ---------------------------------------------------------------- format codecs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 3, 2, 5), (7, 6), (0, 6)])
def test_codec_round_trip_bitwise(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = special_tensor(shape, dtype)
    buf, s, name = tensor_to_record_fields(t)
    assert isinstance(buf, bytes) and s == list(shape) and name == str(dtype).removeprefix("torch.")
    assert len(buf) == t.numel() * t.element_size()
    back = tensor_from_bytes(buf, s, name)
    assert_bitwise(back, t)
    back.add_(0)  # writable


def test_codec_rejects_other_dtypes_and_bad_sizes() -> None:
    with pytest.raises(ValueError, match="float64"):
        tensor_to_record_fields(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="bytes"):
        tensor_from_bytes(b"\x00" * 6, [2], "float32")
    with pytest.raises(ValueError, match="int8"):
        tensor_from_bytes(b"", [0], "int8")


# ---------------------------------------------------------------- writing + reading


def test_dataset_round_trip_mixed_dtypes_and_lengths(tmp_path: Path) -> None:
    # 2-byte rows of odd element count before float32 rows put float32 data at unaligned offsets.
    order = [torch.float16, torch.float32, torch.bfloat16, torch.float32]
    records = [
        make_record(i, order[i % 4], text_len=[0, 3, 7, 1, 2][i % 5], latent_shape=(3, 1, 1, 3), dim=5)
        for i in range(10)
    ]
    write_latent_shards(records, tmp_path, rows_per_shard=4)
    ds = LatentDataset(tmp_path)
    assert len(ds) == len(records)
    for i, rec in enumerate(records):
        item = ds[i]
        assert item["id"] == rec.id and item["caption"] == rec.caption
        assert_bitwise(item["latents"], rec.latent)
        assert_bitwise(item["text_embedding"], rec.text_embedding)
    assert ds[-1]["id"] == records[-1].id
    with pytest.raises(IndexError):
        ds[len(records)]


def test_shards_are_zstd_sized_and_leave_no_temp_files(tmp_path: Path) -> None:
    records = [make_record(i, torch.bfloat16, text_len=2) for i in range(7)]
    paths = write_latent_shards(iter(records), tmp_path, rows_per_shard=3, split="validation")
    folder = tmp_path / "validation"
    assert paths == [folder / f"shard-0000{k}.parquet" for k in range(3)]
    assert sorted(p.name for p in folder.iterdir()) == [p.name for p in paths]  # nothing else left
    assert [pq.ParquetFile(p).metadata.num_rows for p in paths] == [3, 3, 1]
    meta = pq.ParquetFile(paths[0]).metadata
    for rg in range(meta.num_row_groups):
        for c in range(meta.num_columns):
            assert meta.row_group(rg).column(c).compression == "ZSTD"
    table = pq.read_table(paths[2])
    assert table.column("source").to_pylist() == ["synthetic/6"]
    assert table.column("num_frames").type == pa.int32() and table.column("fps").type == pa.float32()
    assert LatentDataset(tmp_path, "validation")[6]["id"] == "clip-006"


def test_write_shard_is_atomic_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "train" / "shard-00000.parquet"
    write_shard([make_record(0, torch.float32, 2)], target)
    before = target.read_bytes()

    def failing_write(table, where, **kwargs):
        Path(where).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", failing_write)
    with pytest.raises(OSError, match="disk full"):
        write_shard([make_record(1, torch.float32, 2)], target)
    assert target.read_bytes() == before
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_missing_or_empty_split_raises_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=str(tmp_path / "train")):
        LatentDataset(tmp_path)
    (tmp_path / "train").mkdir()
    with pytest.raises(UserError, match="no \\*.parquet shards"):
        LatentDataset(tmp_path)


def test_foreign_or_corrupt_shards_raise_user_error(tmp_path: Path) -> None:
    shard = tmp_path / "train" / "shard-00000.parquet"
    shard.parent.mkdir()
    pq.write_table(pa.table({"id": ["a"], "pixels": [b"xx"]}), shard)
    with pytest.raises(UserError, match=str(shard)) as e:
        LatentDataset(tmp_path)
    assert "missing column 'latent_bytes'" in str(e.value)

    shard.write_bytes(b"not parquet at all")
    with pytest.raises(UserError, match=str(shard)):
        LatentDataset(tmp_path)

    # our schema, but bytes that do not match the recorded shape
    table = pq.read_table(write_shard([make_record(0, torch.float16, 2)], tmp_path / "ok.parquet"))
    bad = table.set_column(
        table.schema.get_field_index("latent_bytes"),
        table.schema.field("latent_bytes"),
        pa.array([b"\x00\x01"], pa.binary()),
    )
    pq.write_table(bad, shard)
    with pytest.raises(UserError, match="row 0: 2 bytes do not match shape"):
        LatentDataset(tmp_path)


# ---------------------------------------------------------------- collation


def test_collate_pads_truncates_and_casts() -> None:
    items = [
        {"latents": torch.full((2, 1, 2, 2), float(i)), "text_embedding": torch.arange(n * 3.0).view(n, 3) + 1,
         "caption": f"c{i}", "id": f"id{i}"}
        for i, n in enumerate([2, 5, 0])
    ]
    batch = collate_latents(items, text_max_length=4)
    assert batch["latents"].shape == (3, 2, 1, 2, 2) and batch["latents"].dtype == torch.float32
    assert torch.equal(batch["latents"][1], items[1]["latents"])
    te = batch["text_embeds"]
    assert te.shape == (3, 4, 3)
    assert batch["text_lengths"].dtype == torch.long and batch["text_lengths"].tolist() == [2, 4, 0]
    assert torch.equal(te[0, :2], items[0]["text_embedding"]) and not te[0, 2:].any()
    assert torch.equal(te[1], items[1]["text_embedding"][:4])  # truncated
    assert not te[2].any()  # empty prompt: all padding
    assert batch["captions"] == ["c0", "c1", "c2"] and batch["ids"] == ["id0", "id1", "id2"]
    te.add_(1)  # a new tensor, not a view of the items
    assert items[0]["text_embedding"][0, 0] == 1

    cast = collate_latents(items, text_max_length=4, dtype=torch.bfloat16)
    assert cast["latents"].dtype == torch.bfloat16 and cast["text_embeds"].dtype == torch.bfloat16


def test_collate_rejects_mismatched_latent_shapes() -> None:
    a = {"latents": torch.zeros(2, 1, 2, 2), "text_embedding": torch.zeros(1, 3), "caption": "", "id": "first"}
    b = {"latents": torch.zeros(2, 1, 2, 4), "text_embedding": torch.zeros(1, 3), "caption": "", "id": "second"}
    with pytest.raises(UserError, match=r"'first' has \[2, 1, 2, 2\], 'second' has \[2, 1, 2, 4\]"):
        collate_latents([a, b], text_max_length=4)
    c = dict(a, id="third", latents=a["latents"].half())
    with pytest.raises(UserError, match="different dtypes"):
        collate_latents([a, c], text_max_length=4)
    assert collate_latents([a, c], text_max_length=4, dtype=torch.float32)["latents"].dtype == torch.float32


def test_empty_prompt_embedding_round_trip(tmp_path: Path) -> None:
    assert read_empty_prompt_embedding(tmp_path) is None
    for t in (special_tensor((3, 6), torch.bfloat16), torch.zeros(0, 6, dtype=torch.float16)):
        path = write_empty_prompt_embedding(tmp_path, t)
        assert path == tmp_path / "empty_prompt.safetensors"
        assert_bitwise(read_empty_prompt_embedding(tmp_path), t)
    assert [p.name for p in tmp_path.iterdir()] == ["empty_prompt.safetensors"]


# ---------------------------------------------------------------- sampling


def take(sampler: ShardedBatchSampler, n: int) -> list[list[int]]:
    return list(itertools.islice(sampler, n))


def test_sampler_ranks_partition_the_single_process_batch() -> None:
    n, b = 23, 3
    single = take(ShardedBatchSampler(n, 2 * b, rank=0, world_size=1, seed=7), 12)
    ranks = [take(ShardedBatchSampler(n, b, rank=r, world_size=2, seed=7), 12) for r in range(2)]
    for step in range(12):
        r0, r1 = ranks[0][step], ranks[1][step]
        assert len(r0) == len(r1) == b
        assert not set(r0) & set(r1)
        assert r0 + r1 == single[step]
    steps = n // (2 * b)  # 3 full global batches per epoch, tail of 5 dropped
    assert ShardedBatchSampler(n, b, 0, 2, 7).steps_per_epoch == steps
    epoch0 = [i for batch in single[:steps] for i in batch]
    assert len(set(epoch0)) == len(epoch0) == steps * 2 * b


def test_sampler_epochs_reshuffle() -> None:
    s = ShardedBatchSampler(40, 10, rank=0, world_size=1, seed=0)
    batches = take(s, 8)
    e0, e1 = sum(batches[:4], []), sum(batches[4:], [])
    assert sorted(e0) == sorted(e1) == list(range(40))
    assert e0 != e1
    assert s.epoch == 1
    assert take(ShardedBatchSampler(40, 10, 0, 1, seed=1), 4) != batches[:4]  # seed matters


def test_sampler_without_drop_last_covers_every_sample() -> None:
    s = ShardedBatchSampler(10, 2, rank=1, world_size=2, seed=3, drop_last=False)
    assert s.steps_per_epoch == 3
    both = [take(ShardedBatchSampler(10, 2, r, 2, 3, drop_last=False), 3) for r in range(2)]
    seen = {i for rank in both for batch in rank for i in batch}
    assert seen == set(range(10))


@pytest.mark.parametrize("consumed", [2, 4, 5, 8, 9])  # mid-epoch, at/after an epoch boundary (4 per epoch)
def test_sampler_resume_is_exact(consumed: int) -> None:
    reference = take(ShardedBatchSampler(17, 2, rank=1, world_size=2, seed=11), consumed + 6)
    first = ShardedBatchSampler(17, 2, rank=1, world_size=2, seed=11)
    take(first, consumed)
    sd = first.state_dict()
    assert set(sd) == {"epoch", "batches_in_epoch", "seed", "num_samples"}
    resumed = ShardedBatchSampler(17, 2, rank=1, world_size=2, seed=11)
    resumed.load_state_dict(dict(sd))
    assert resumed.epoch == first.epoch
    assert take(resumed, 6) == reference[consumed:]
    # a 1-rank run with the same global batch resumes at the same position
    single = ShardedBatchSampler(17, 4, rank=0, world_size=1, seed=11)
    single.load_state_dict(sd)
    assert [b[2:] for b in take(single, 6)] == reference[consumed:]


def test_sampler_user_errors() -> None:
    s = ShardedBatchSampler(17, 2, rank=0, world_size=2, seed=0)
    take(s, 3)
    other = ShardedBatchSampler(18, 2, rank=0, world_size=2, seed=0)
    with pytest.raises(UserError, match="17 samples.*now has 18"):
        other.load_state_dict(s.state_dict())
    with pytest.raises(UserError, match="has 5 samples.*global batch of 6"):
        ShardedBatchSampler(5, 3, rank=0, world_size=2, seed=0)


def test_batch_loader_yields_collated_batches_and_resumes(tmp_path: Path) -> None:
    records = [make_record(i, torch.float16, text_len=i % 4) for i in range(9)]
    write_latent_shards(records, tmp_path, rows_per_shard=4)
    ds = LatentDataset(tmp_path)
    loader = LatentBatchLoader(ds, ShardedBatchSampler(len(ds), 2, 0, 1, seed=5), text_max_length=3,
                               dtype=torch.float32)
    batches = list(itertools.islice(loader, 6))
    assert loader.epoch == 1
    b0 = batches[0]
    assert b0["latents"].shape == (2, 4, 2, 3, 5) and b0["latents"].dtype == torch.float32
    assert b0["text_embeds"].shape == (2, 3, 6)
    expect = [records[int(i.split("-")[1])] for i in b0["ids"]]
    assert b0["captions"] == [r.caption for r in expect]
    assert torch.equal(b0["latents"][0].nan_to_num(), expect[0].latent.float().nan_to_num())

    again = LatentBatchLoader(ds, ShardedBatchSampler(len(ds), 2, 0, 1, seed=5), text_max_length=3)
    fresh = LatentBatchLoader(ds, ShardedBatchSampler(len(ds), 2, 0, 1, seed=5), text_max_length=3)
    list(itertools.islice(fresh, 3))
    again.load_state_dict(fresh.state_dict())
    assert [b["ids"] for b in itertools.islice(again, 3)] == [b["ids"] for b in batches[3:]]
