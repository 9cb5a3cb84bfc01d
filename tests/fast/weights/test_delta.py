"""Weight deltas (miles/weights/delta.py, pure): bit-exact round trips, the byte rule, the digest."""

from __future__ import annotations

import pytest
import torch

from miles.weights.delta import (
    CHOSEN_KINDS,
    ENCODERS,
    KINDS,
    apply,
    choose,
    choose_kind,
    digest,
    encode_sparse,
    pack_bits,
    unpack_bits,
    wire_bytes,
)

DENSITIES = [0.0, 1e-4, 0.02, 0.3, 1.0]
SIZES = [(1,), (13,), (7, 11), (3, 5, 9)]  # none a multiple of 8


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def pair(shape: tuple[int, ...], density: float, seed: int = 0, dtype=torch.bfloat16):
    """old random; new = old with a `density` share of elements (at least one if > 0) given other bits."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(shape, generator=g).to(dtype)
    numel = old.numel()
    count = 0 if density == 0 else max(1, round(density * numel))
    where = torch.randperm(numel, generator=g)[:count]
    new_bits = bits(old).clone().view(-1)
    new_bits[where] ^= torch.randint(1, 2**15, (count,), generator=g, dtype=torch.int16)
    return old, new_bits.view(dtype).view(shape), count


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("shape", SIZES)
def test_every_kind_round_trips_bit_exactly(kind, density, shape) -> None:
    old, new, count = pair(shape, density)
    encoded = ENCODERS[kind](old, new)
    target = old.clone()
    apply(target, encoded)
    assert_bit_equal(target, new)
    if kind != "dense":
        assert encoded.changed == count


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("density", [0.02, 0.3, 1.0])
def test_apply_writes_through_a_non_contiguous_view(kind, density) -> None:
    old, new, _ = pair((9, 7), density, seed=1, dtype=torch.float16)
    buffer = torch.zeros(9, 20, dtype=torch.float16)
    view = buffer[:, 3:17:2]  # 9 x 7, strided: a slice of a fused parameter
    assert not view.is_contiguous()
    view.copy_(old)
    apply(view, ENCODERS[kind](old, new))
    assert_bit_equal(buffer[:, 3:17:2], new)
    untouched = torch.ones(9, 20, dtype=torch.bool)
    untouched[:, 3:17:2] = False
    assert torch.equal(buffer[untouched], torch.zeros(int(untouched.sum()), dtype=torch.float16))


def test_nan_payloads_and_signed_zeros_survive() -> None:
    old = torch.zeros(10, dtype=torch.bfloat16)
    new_bits = torch.tensor([0x7FC1, 0x7F81, -32768, 0, 1, 0x7FC1, 0, 0, 0, 0], dtype=torch.int16)
    new = new_bits.view(torch.bfloat16)
    for kind in KINDS:
        target = old.clone()
        apply(target, ENCODERS[kind](old, new))
        assert torch.equal(bits(target), new_bits), kind


@pytest.mark.parametrize("kind", KINDS)
def test_payload_sizes_match_the_byte_formulas(kind) -> None:
    old, new, count = pair((3, 37), 0.1, seed=2)
    encoded = ENCODERS[kind](old, new)
    if kind == "xor_zlib":
        assert encoded.nbytes == len(encoded.blob)
        return
    assert encoded.nbytes == wire_bytes(kind, old.numel(), count)
    payload = [encoded.values, encoded.indices, encoded.mask]
    assert encoded.nbytes == sum(t.numel() * t.element_size() for t in payload if t is not None)


def test_byte_formulas() -> None:
    assert wire_bytes("dense", 100, 7) == 200
    assert wire_bytes("sparse", 100, 7) == 7 * 6
    assert wire_bytes("bitmask", 100, 7) == 13 + 7 * 2  # ceil(100 / 8) mask bytes
    with pytest.raises(ValueError, match="measured"):
        wire_bytes("xor_zlib", 100, 7)


def crossovers(numel: int) -> tuple[int, int]:
    """The largest changed counts at which sparse (6k < ceil(n/8) + 2k) and bitmask (< 2n) still win."""
    mask_bytes = (numel + 7) // 8
    last_sparse = max(k for k in range(numel + 1) if 6 * k < mask_bytes + 2 * k)
    last_bitmask = max(k for k in range(numel + 1) if mask_bytes + 2 * k < 2 * numel)
    return last_sparse, last_bitmask


@pytest.mark.parametrize("numel", [1001, 4099])
def test_choose_picks_sparse_then_bitmask_then_dense_at_the_byte_crossovers(numel) -> None:
    last_sparse, last_bitmask = crossovers(numel)
    assert 0 < last_sparse < last_bitmask < numel
    assert choose_kind(numel, 0) == "sparse"
    assert choose_kind(numel, last_sparse) == "sparse"
    assert choose_kind(numel, last_sparse + 1) == "bitmask"
    assert choose_kind(numel, last_bitmask) == "bitmask"
    assert choose_kind(numel, last_bitmask + 1) == "dense"
    assert choose_kind(numel, numel) == "dense"
    for changed in (0, last_sparse, last_sparse + 1, last_bitmask, last_bitmask + 1, numel):
        kind = choose_kind(numel, changed)
        assert wire_bytes(kind, numel, changed) == min(wire_bytes(k, numel, changed) for k in CHOSEN_KINDS)


@pytest.mark.parametrize("where", ["sparse", "bitmask", "dense"])
def test_choose_builds_the_chosen_form_and_it_round_trips(where) -> None:
    numel = 1001
    last_sparse, last_bitmask = crossovers(numel)
    count = {"sparse": last_sparse, "bitmask": last_sparse + 1, "dense": last_bitmask + 1}[where]
    old, new, n = pair((numel,), count / numel, seed=3)
    assert n == count
    encoded = choose(old, new)
    assert encoded.kind == where
    assert encoded.changed == count
    assert encoded.nbytes == min(wire_bytes(k, numel, count) for k in CHOSEN_KINDS)
    target = old.clone()
    apply(target, encoded)
    assert_bit_equal(target, new)


def test_pack_bits_round_trips_on_odd_lengths() -> None:
    for numel in (1, 7, 8, 9, 23):
        mask = torch.rand(numel, generator=torch.Generator().manual_seed(numel)) < 0.5
        packed = pack_bits(mask)
        assert packed.dtype == torch.uint8 and packed.numel() == (numel + 7) // 8
        assert torch.equal(unpack_bits(packed, numel), mask)
    assert pack_bits(torch.tensor([True, False, False, True])).tolist() == [0b1001]


def test_apply_refuses_a_shape_or_dtype_mismatch() -> None:
    old, new, _ = pair((4, 6), 0.3)
    encoded = encode_sparse(old, new)
    with pytest.raises(ValueError, match=r"for \(4, 6\) torch.bfloat16 cannot apply to \(6, 4\)"):
        apply(torch.zeros(6, 4, dtype=torch.bfloat16), encoded)
    with pytest.raises(ValueError, match=r"cannot apply to \(4, 6\) torch.float16"):
        apply(torch.zeros(4, 6, dtype=torch.float16), encoded)


def test_encoders_refuse_mismatched_pairs_and_other_dtypes() -> None:
    old, new, _ = pair((5,), 0.3)
    with pytest.raises(ValueError, match="old and new differ"):
        choose(old, new[:4])
    with pytest.raises(ValueError, match="2-byte float"):
        choose(old.float(), new.float())


def test_digest_is_a_function_of_content_dtype_and_length() -> None:
    a, _, _ = pair((3, 41), 0.0, seed=4)
    assert digest(a) == digest(a.clone()) == digest(a.reshape(-1))
    assert 0 <= digest(a) < 2**64
    assert digest(a) != digest(a.view(torch.float16))  # same bits, another dtype
    zeros = torch.zeros(8, dtype=torch.bfloat16)
    assert digest(zeros) != digest(zeros[:7])  # same (zero) bits, another length
    strided = torch.zeros(3, 82, dtype=torch.bfloat16)
    strided[:, ::2] = a
    assert digest(strided[:, ::2]) == digest(a)


def test_digest_detects_one_flipped_element_anywhere() -> None:
    a, _, _ = pair((257,), 0.0, seed=5)
    base = digest(a, chunk=64)  # several chunks
    for index in range(a.numel()):
        for flip in (1, 0x4000, -32768):
            b = bits(a).clone()
            b[index] ^= flip
            assert digest(b.view(torch.bfloat16), chunk=64) != base, (index, flip)


def test_digest_detects_swapped_elements() -> None:
    a, _, _ = pair((100,), 0.0, seed=6)
    base = digest(a)
    for i, j in [(0, 1), (0, 99), (17, 64), (98, 99)]:
        b = a.clone()
        b[i], b[j] = a[j], a[i]
        assert not torch.equal(bits(a[i]), bits(a[j]))
        assert digest(b) != base, (i, j)


def test_digest_detects_a_shifted_slice() -> None:
    a, _, _ = pair((200,), 0.0, seed=7)
    base = digest(a)
    for start, stop, by in [(10, 60, 1), (0, 199, 1), (50, 150, 3), (100, 200, -7)]:
        b = a.clone()
        b[start:stop] = a[start + by : stop + by]
        assert digest(b) != base, (start, stop, by)
    rolled = torch.roll(a, 1)
    assert digest(rolled) != base


def test_digest_after_a_delta_push_matches_on_both_sides() -> None:
    old, new, _ = pair((33, 17), 0.02, seed=8)
    engine = old.clone()
    assert digest(engine) != digest(new)
    apply(engine, choose(old, new))
    assert digest(engine) == digest(new)
