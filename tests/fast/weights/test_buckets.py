"""Bucketing by bytes and the flattened-bucket layout (pure)."""

from __future__ import annotations

import pytest
import torch

from miles.utils.buckets import (
    DEFAULT_BUCKET_BYTES,
    TensorMeta,
    dtype_from_name,
    dtype_name,
    flat_offsets,
    pack_flat,
    plan_buckets,
    unpack_flat,
)


def meta(name: str, numel: int, dtype: str = "float32") -> TensorMeta:
    return TensorMeta(name=name, dtype=dtype, shape=(numel,))


def names(buckets: list[list[TensorMeta]]) -> list[list[str]]:
    return [[m.name for m in b] for b in buckets]


def test_default_limit_is_512_mib() -> None:
    assert DEFAULT_BUCKET_BYTES == 512 * 2**20


def test_buckets_fill_up_to_the_limit_in_order() -> None:
    metas = [meta("a", 10), meta("b", 10), meta("c", 10), meta("d", 5)]  # 40, 40, 40, 20 bytes
    assert names(plan_buckets(metas, 80)) == [["a", "b"], ["c", "d"]]
    assert names(plan_buckets(metas, 79)) == [["a"], ["b"], ["c", "d"]]


def test_tensor_larger_than_limit_gets_its_own_bucket() -> None:
    metas = [meta("small", 2), meta("huge", 1000), meta("tail", 2)]
    assert names(plan_buckets(metas, 64)) == [["small"], ["huge"], ["tail"]]


def test_every_tensor_is_in_exactly_one_bucket_and_order_is_kept() -> None:
    metas = [meta(f"t{i}", (i * 37) % 50 + 1, "bfloat16" if i % 3 else "float32") for i in range(60)]
    buckets = plan_buckets(metas, 100)
    flat = [m for b in buckets for m in b]
    assert flat == metas
    for bucket in buckets:
        assert len(bucket) == 1 or sum(m.nbytes for m in bucket) <= 100


def test_flattened_plan_closes_a_bucket_before_a_misaligned_tensor() -> None:
    metas = [meta("odd_bf16", 3, "bfloat16"), meta("f32", 2, "float32"), meta("f32b", 2, "float32")]
    assert names(plan_buckets(metas, 1000)) == [["odd_bf16", "f32", "f32b"]]
    flat = plan_buckets(metas, 1000, flattened=True)
    assert names(flat) == [["odd_bf16"], ["f32", "f32b"]]
    for bucket in flat:
        flat_offsets(bucket)  # no error: every offset aligned


def test_flat_offsets_refuse_misaligned_layout() -> None:
    with pytest.raises(ValueError, match="flattened=True"):
        flat_offsets([meta("x", 1, "int8"), meta("y", 1, "float32")])


def test_pack_unpack_round_trip_mixed_dtypes() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [
        torch.randint(0, 100, (2, 2), generator=gen),
        torch.randn(3, 4, generator=gen),
        torch.randn(6, generator=gen).to(torch.bfloat16),
    ]
    metas = [TensorMeta.of(f"t{i}", t) for i, t in enumerate(tensors)]
    buffer = pack_flat(tensors, metas)
    assert buffer.dtype == torch.uint8 and buffer.numel() == sum(m.nbytes for m in metas)
    for original, restored in zip(tensors, unpack_flat(buffer.clone(), metas), strict=True):
        assert restored.dtype == original.dtype and torch.equal(restored, original)


def test_dtype_names_have_no_torch_prefix() -> None:
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_from_name("torch.float32") is torch.float32
    with pytest.raises(ValueError, match="unknown tensor dtype"):
        dtype_from_name("float33")


def test_bad_limit_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        plan_buckets([meta("a", 1)], 0)


def test_a_one_byte_limit_is_allowed_and_gives_every_tensor_its_own_bucket() -> None:
    metas = [meta("a", 1, "int8"), meta("b", 1, "int8"), meta("c", 2, "int8")]
    assert names(plan_buckets(metas, 1)) == [["a"], ["b"], ["c"]]


def test_an_empty_bucket_packs_to_an_empty_byte_buffer() -> None:
    buffer = pack_flat([], [])
    assert buffer.dtype == torch.uint8 and buffer.shape == (0,)
    assert unpack_flat(buffer, []) == []
