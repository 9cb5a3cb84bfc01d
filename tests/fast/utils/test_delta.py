"""Weight deltas (miles/utils/delta.py, pure): bit-exact round trips, the byte rule, the bucket codec
and its format checks, the digest."""

from __future__ import annotations

import re
import zlib
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.utils import delta as delta_module
from miles.utils.delta import (
    CHOSEN_KINDS,
    DIGEST_CHUNK,
    ENCODERS,
    HEADER_WORDS,
    KIND_CODES,
    KINDS,
    MAGIC,
    BucketDelta,
    DeltaFormatError,
    apply,
    apply_bucket,
    bucket_payload_bytes,
    choose,
    choose_kind,
    digest,
    digest_many,
    encode_bitmask_i8,
    encode_bucket,
    encode_sparse,
    pack_bits,
    payload_nbytes,
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


def stepped(old_bits: torch.Tensor, density: float, seed: int, max_step: int = 1) -> torch.Tensor:
    """Flat int16 `old_bits` with a `density` share (at least one if > 0) moved by a nonzero step of at
    most `max_step` either way, int16 wrapping: how a bf16 image moves in a small optimizer step."""
    g = torch.Generator().manual_seed(seed)
    numel = old_bits.numel()
    count = 0 if density == 0 else max(1, round(density * numel))
    where = torch.randperm(numel, generator=g)[:count]
    size = torch.randint(1, max_step + 1, (count,), generator=g, dtype=torch.int32)
    sign = torch.randint(0, 2, (count,), generator=g, dtype=torch.int32) * 2 - 1
    new_bits = old_bits.reshape(-1).clone()
    new_bits[where] += (size * sign).to(torch.int16)
    return new_bits


def with_escapes(numel: int, changed: int, escapes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 pair with `changed` elements changed, the first `escapes` of them by a step beyond int8."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(numel, generator=g).to(torch.bfloat16)
    where = torch.randperm(numel, generator=g)[:changed]
    step = torch.ones(changed, dtype=torch.int16)
    step[:escapes] = 1000
    new_bits = bits(old).clone()
    new_bits[where] += step
    return old, new_bits.view(torch.bfloat16)


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
    escapes = 0 if encoded.escapes is None else encoded.escapes.numel()
    assert encoded.nbytes == wire_bytes(kind, old.numel(), count, escapes=escapes)
    payload = [encoded.values, encoded.indices, encoded.mask, encoded.diffs, encoded.escapes]
    assert encoded.nbytes == sum(t.numel() * t.element_size() for t in payload if t is not None)


def test_byte_formulas() -> None:
    assert wire_bytes("dense", 100, 7) == 200
    assert wire_bytes("sparse", 100, 7) == 7 * 6
    assert wire_bytes("bitmask", 100, 7) == 13 + 7 * 2  # ceil(100 / 8) mask bytes
    assert wire_bytes("bitmask_i8", 100, 7) == 13 + 7
    assert wire_bytes("bitmask_i8", 100, 7, escapes=3) == 13 + 7 + 3 * 2
    with pytest.raises(ValueError, match="measured"):
        wire_bytes("xor_zlib", 100, 7)


def crossovers(numel: int) -> tuple[int, int]:
    """The largest changed counts at which sparse (6k < ceil(n/8) + 2k) and bitmask (< 2n) still win
    when bitmask_i8 is out of the running (every change escapes)."""
    mask_bytes = (numel + 7) // 8
    last_sparse = max(k for k in range(numel + 1) if 6 * k < mask_bytes + 2 * k)
    last_bitmask = max(k for k in range(numel + 1) if mask_bytes + 2 * k < 2 * numel)
    return last_sparse, last_bitmask


@pytest.mark.parametrize("numel", [1001, 4099])
def test_choose_picks_sparse_then_bitmask_then_dense_at_the_byte_crossovers(numel) -> None:
    last_sparse, last_bitmask = crossovers(numel)
    assert 0 < last_sparse < last_bitmask < numel
    assert choose_kind(numel, 0) == "sparse"
    assert choose_kind(numel, last_sparse, escapes=last_sparse) == "sparse"
    assert choose_kind(numel, last_sparse + 1, escapes=last_sparse + 1) == "bitmask"
    assert choose_kind(numel, last_bitmask, escapes=last_bitmask) == "bitmask"
    assert choose_kind(numel, last_bitmask + 1, escapes=last_bitmask + 1) == "dense"
    assert choose_kind(numel, numel, escapes=numel) == "dense"
    for changed in (0, last_sparse, last_sparse + 1, last_bitmask, last_bitmask + 1, numel):
        kind = choose_kind(numel, changed, escapes=changed)
        sizes = [wire_bytes(k, numel, changed, escapes=changed) for k in CHOSEN_KINDS]
        assert wire_bytes(kind, numel, changed, escapes=changed) == min(sizes)


@pytest.mark.parametrize("numel", [1001, 4099])
def test_choose_picks_sparse_then_bitmask_i8_then_dense_without_escapes(numel) -> None:
    mask_bytes = (numel + 7) // 8
    last_sparse = max(k for k in range(numel + 1) if 6 * k < mask_bytes + k)  # ties go to bitmask_i8
    assert choose_kind(numel, last_sparse) == "sparse"
    for changed in range(last_sparse + 1, numel + 1, 97):
        assert choose_kind(numel, changed) == "bitmask_i8", changed
    assert choose_kind(numel, numel) == "bitmask_i8"  # a small step everywhere is still 9/16 of dense
    # with every element changed, escapes push it past dense (ties go to dense)
    last_i8 = max(e for e in range(numel + 1) if mask_bytes + numel + 2 * e < 2 * numel)
    assert choose_kind(numel, numel, escapes=last_i8) == "bitmask_i8"
    assert choose_kind(numel, numel, escapes=last_i8 + 1) == "dense"


def test_bitmask_i8_ties_bitmask_at_half_escapes_and_loses_past_it() -> None:
    numel, changed = 1000, 200
    assert choose_kind(numel, changed, escapes=100) == "bitmask_i8"  # 125 + 200 + 200 = 125 + 400
    assert choose_kind(numel, changed, escapes=101) == "bitmask"
    for escapes, want in [(100, "bitmask_i8"), (101, "bitmask")]:
        old, new = with_escapes(numel, changed, escapes, seed=escapes)
        encoded = choose(old, new)
        assert encoded.kind == want and encoded.changed == changed
        assert encoded.nbytes == 125 + 400
        target = old.clone()
        apply(target, encoded)
        assert_bit_equal(target, new)


@pytest.mark.parametrize("where", ["sparse", "bitmask", "dense"])
def test_choose_builds_the_chosen_form_and_it_round_trips(where) -> None:
    numel = 1001
    last_sparse, last_bitmask = crossovers(numel)
    count = {"sparse": last_sparse, "bitmask": last_sparse + 1, "dense": last_bitmask + 1}[where]
    old, new = with_escapes(numel, count, count, seed=3)  # every step escapes: bitmask_i8 cannot win
    encoded = choose(old, new)
    assert encoded.kind == where
    assert encoded.changed == count
    sizes = [wire_bytes(k, numel, count, escapes=count) for k in CHOSEN_KINDS]
    assert encoded.nbytes == min(sizes)
    target = old.clone()
    apply(target, encoded)
    assert_bit_equal(target, new)


@pytest.mark.parametrize(
    ("density", "step", "want"),
    [(0.15, 1, "bitmask_i8"), (0.02, 1, "sparse"), (1.0, None, "dense"), (1.0, 1, "bitmask_i8")],
)
def test_choose_at_realistic_densities(density, step, want) -> None:
    numel = 100_000
    old = torch.randn(numel, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    if step is None:  # every element somewhere else: a full push
        new = torch.randn(numel, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    else:
        new = stepped(bits(old), density, seed=13, max_step=step).view(torch.bfloat16)
    encoded = choose(old, new)
    assert encoded.kind == want
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
    base = digest(a, chunk=16)  # 65 words (the last half padding): five chunks
    for index in range(a.numel()):
        for flip in (1, 0x4000, -32768):
            b = bits(a).clone()
            b[index] ^= flip
            assert digest(b.view(torch.bfloat16), chunk=16) != base, (index, flip)


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


# --- bitmask_i8 ----------------------------------------------------------------------------------------

# (old bits, new bits, the int8 sent): steps inside [-127, 127] go as is, wrapping around int16; others
# escape with -128 and send the new bits
I8_CASES = [
    (0x3F80, 0x3F81, 1),  # 1.0 up one ulp
    (0x3F80, 0x3F7F, -1),  # 1.0 down one ulp
    (0x1000, 0x1000 + 127, 127),
    (0x1000, 0x1000 - 127, -127),
    (0x1000, 0x1000 + 128, -128),  # just past int8: escapes
    (0x1000, 0x1000 - 128, -128),
    (0x0000, -32768, -128),  # +0 -> -0: a step of 2^15
    (-32768, 0x0000, -128),  # -0 -> +0
    (-32768, -32767, 1),  # -0 -> the smallest negative subnormal
    (0x7FFF, -32768, 1),  # wraps: 32767 + 1 = -32768
    (-1, 0x0000, 1),  # wraps: 0xFFFF + 1 = 0
    (0x7F80, 0x7F81, 1),  # +inf -> a signalling NaN
    (0x7FC0, 0x7FC1, 1),  # NaN -> another NaN payload
    (0x7FC0, 0x7F80, -64),  # NaN -> +inf
    (-128, -256, -128),  # 0xFF80 (-inf) -> 0xFF00: escapes
    (0x7F80, -128, -128),  # +inf -> -inf
]


def test_bitmask_i8_sends_steps_and_escapes_bit_exactly() -> None:
    old_bits = torch.tensor([o for o, _, _ in I8_CASES] + [0x1234, 0x7FC1], dtype=torch.int16)
    new_bits = torch.tensor([n for _, n, _ in I8_CASES] + [0x1234, 0x7FC1], dtype=torch.int16)  # 2 kept
    old, new = old_bits.view(torch.bfloat16), new_bits.view(torch.bfloat16)
    encoded = encode_bitmask_i8(old, new)
    assert encoded.diffs.dtype == torch.int8 and encoded.escapes.dtype == torch.int16
    assert encoded.diffs.tolist() == [d for _, _, d in I8_CASES]
    escaped_new = [n for _, n, d in I8_CASES if d == -128]
    assert encoded.escapes.tolist() == escaped_new
    assert encoded.changed == len(I8_CASES)
    assert encoded.nbytes == wire_bytes("bitmask_i8", 18, len(I8_CASES), escapes=len(escaped_new))
    assert unpack_bits(encoded.mask, 18).tolist() == [True] * len(I8_CASES) + [False, False]
    target = old.clone()
    apply(target, encoded)
    assert torch.equal(bits(target), new_bits)


def test_bitmask_i8_apply_refuses_a_short_escape_list() -> None:
    old, new = with_escapes(50, 10, 3, seed=21)
    encoded = encode_bitmask_i8(old, new)
    assert encoded.escapes.numel() == 3
    broken = replace(encoded, escapes=encoded.escapes[:2])
    with pytest.raises(ValueError, match="3 escapes in its diffs but 2 values"):
        apply(old.clone(), broken)


# --- bucket codec --------------------------------------------------------------------------------------


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def bucket_stepped(nbytes: int, density: float, seed: int, max_step: int = 1):
    """An even-length bucket pair: its int16 words moved as `stepped` moves them."""
    old = torch.randn(nbytes // 2, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    old = old.view(torch.uint8)
    new = stepped(old.view(torch.int16), density, seed + 1, max_step).view(torch.uint8)
    return old, new


def round_trip(old: torch.Tensor, new: torch.Tensor) -> BucketDelta:
    """encode, check the header against the payload, apply to a copy of old: it must become new."""
    delta = encode_bucket(old, new)
    assert delta.header.dtype == torch.int64 and delta.header.shape == (HEADER_WORDS,)
    assert delta.header.device.type == "cpu"
    assert payload_nbytes(delta.header) == delta.nbytes == delta.payload.numel()
    assert delta.payload.dtype == torch.uint8 and delta.payload.dim() == 1
    assert delta.dense_bytes == new.numel()
    target = old.clone()
    apply_bucket(target, delta.header, delta.payload)
    assert torch.equal(target, new)
    return delta


def expected_bucket_kind(old: torch.Tensor, new: torch.Tensor) -> tuple[str, int, int]:
    """The kind, changed and escapes the byte rule gives, counted here independently of the codec."""
    nbytes = new.numel()
    if nbytes % 2:
        return "dense", int((old != new).sum()), 0
    old_w, new_w = old.view(torch.int16).int(), new.view(torch.int16).int()
    changed = old_w != new_w
    step = (new_w - old_w)[changed]
    step = (step + 32768) % 65536 - 32768  # int16 wrapping
    escapes = int((step.abs() > 127).sum())
    count = int(changed.sum())
    sizes = {k: bucket_payload_bytes(k, nbytes, count, escapes) for k in CHOSEN_KINDS}
    kind = min(CHOSEN_KINDS, key=lambda k: sizes[k])
    return kind, count, escapes if kind == "bitmask_i8" else 0


@pytest.mark.parametrize(
    ("density", "max_step", "want"),
    [
        (0.15, 1, "bitmask_i8"),
        (0.02, 1, "sparse"),
        (0.15, 30000, "bitmask"),  # nearly every step escapes
        (1.0, 30000, "dense"),
        (0.0, 1, "sparse"),  # nothing changed: an empty payload
    ],
)
def test_bucket_round_trips_and_picks_the_smallest_kind(density, max_step, want) -> None:
    old, new = bucket_stepped(20_000, density, seed=31, max_step=max_step)
    delta = round_trip(old, new)
    kind, changed, escapes = expected_bucket_kind(old, new)
    assert delta.kind == kind == want
    assert delta.changed == changed
    header = delta.header.tolist()
    assert header == [MAGIC, KIND_CODES[want], delta.nbytes, 20_000, changed, escapes, 0, 0]


def test_a_bucket_where_nothing_changed_sends_nothing_and_leaves_the_target_alone() -> None:
    old = random_bytes(1000, seed=32)
    delta = encode_bucket(old, old.clone())
    assert delta.kind == "sparse" and delta.changed == 0 and delta.nbytes == 0
    target = old.clone()
    apply_bucket(target, delta.header, delta.payload)
    assert torch.equal(target, old)


def test_the_dense_payload_is_new_itself() -> None:
    old, new = random_bytes(64, seed=33), random_bytes(64, seed=34)
    delta = round_trip(old, new)
    assert delta.kind == "dense" and delta.payload.data_ptr() == new.data_ptr()


@pytest.mark.parametrize("nbytes", [1, 7, 1001])
def test_odd_length_buckets_are_dense(nbytes) -> None:
    old = random_bytes(nbytes, seed=35)
    new = old.clone()
    new[nbytes // 2] ^= 1  # one byte: a sparse form would be far smaller, but words are undefined
    delta = round_trip(old, new)
    assert delta.kind == "dense" and delta.changed == 1 and delta.nbytes == nbytes


def test_an_empty_bucket_round_trips() -> None:
    empty = torch.empty(0, dtype=torch.uint8)
    delta = round_trip(empty, empty.clone())
    assert delta.kind == "dense" and delta.nbytes == 0 and delta.changed == 0


def test_fp32_data_as_bucket_bytes() -> None:
    g = torch.Generator().manual_seed(36)
    old_f = torch.randn(5000, generator=g)
    new_f = old_f.clone()
    new_f[::7] += 1e-6  # low mantissa bits of some floats: their low int16 halves change
    new_f[3] = float("nan")
    new_f[10] = -0.0
    old, new = old_f.view(torch.uint8), new_f.view(torch.uint8)
    delta = round_trip(old, new)
    assert delta.kind == expected_bucket_kind(old, new)[0]
    assert delta.kind != "dense"


def test_payload_sections_are_aligned_so_the_receiver_views_them_in_place() -> None:
    """The wire layout, as the other side reads it: sections in order, each at an 8-byte offset."""
    old, new = bucket_stepped(2 * 1003, 0.01, seed=37, max_step=1)  # 1003 words: a partial mask byte
    new16 = new.view(torch.int16).clone()
    new16[5] += 1000  # one escape
    new = new16.view(torch.uint8)
    changed_at = (old.view(torch.int16) != new16).nonzero().view(-1)
    c = changed_at.numel()
    sparse = encode_bucket(old, new)
    assert sparse.kind == "sparse"
    index_end = 4 * c
    assert torch.equal(sparse.payload[:index_end].view(torch.int32).long(), changed_at)
    values_at = -(-index_end // 8) * 8
    assert torch.equal(sparse.payload[values_at:].view(torch.int16), new16[changed_at])
    assert sparse.nbytes == values_at + 2 * c
    assert wire_bytes("sparse", 1003, c) <= sparse.nbytes < wire_bytes("sparse", 1003, c) + 8

    old, new = bucket_stepped(2 * 1003, 0.2, seed=38, max_step=1)
    new16 = new.view(torch.int16).clone()
    new16[5] = new16[5] ^ 0x4000  # one escape
    new = new16.view(torch.uint8)
    i8 = encode_bucket(old, new)
    assert i8.kind == "bitmask_i8"
    c, e = i8.changed, int(i8.header[5])
    assert e == 1
    assert torch.equal(unpack_bits(i8.payload[:126], 1003), old.view(torch.int16) != new16)
    diffs = i8.payload[128 : 128 + c].view(torch.int8)  # ceil(1003 / 8) = 126 mask bytes, then 2 pad
    escapes_at = 128 + -(-c // 8) * 8
    assert int((diffs == -128).sum()) == 1
    assert i8.payload[escapes_at:].view(torch.int16).tolist() == [int(new16[5])]
    assert i8.nbytes == escapes_at + 2
    assert i8.payload[126:128].tolist() == [0, 0]  # padding is zero: the bytes depend on old and new only


@settings(max_examples=300, deadline=None)
@given(
    nbytes=st.integers(min_value=0, max_value=700),
    density=st.sampled_from([0.0, 0.01, 0.05, 0.2, 0.6, 1.0]),
    max_step=st.sampled_from([1, 127, 128, 300, 32767]),
    seed=st.integers(min_value=0, max_value=2**20),
)
def test_bucket_round_trip_property(nbytes, density, max_step, seed) -> None:
    """Any pair: the receiver rebuilds new byte for byte, the kind is the smallest by the byte rule, and
    the encoding is a function of (old, new)."""
    old = random_bytes(nbytes, seed)
    if nbytes % 2:
        new = old.clone()
        flip = torch.rand(nbytes, generator=torch.Generator().manual_seed(seed + 1)) < density
        new[flip] ^= 0x5A
    else:
        new = stepped(old.view(torch.int16), density, seed + 1, max_step).view(torch.uint8)
    delta = round_trip(old, new)
    kind, changed, escapes = expected_bucket_kind(old, new)
    assert (delta.kind, delta.changed, int(delta.header[5])) == (kind, changed, escapes)
    assert delta.nbytes == bucket_payload_bytes(kind, nbytes, changed, escapes)
    again = encode_bucket(old.clone(), new.clone())
    assert torch.equal(again.header, delta.header) and torch.equal(again.payload, delta.payload)


def test_apply_bucket_writes_through_a_view_at_an_odd_offset() -> None:
    old, new = bucket_stepped(400, 0.15, seed=39)
    delta = encode_bucket(old, new)
    assert delta.kind == "bitmask_i8"
    memory = torch.full((403,), 7, dtype=torch.uint8)
    view = memory[1:401]  # cannot be read as int16 in place
    view.copy_(old)
    apply_bucket(view, delta.header, delta.payload)
    assert torch.equal(memory[1:401], new)
    assert memory[0] == 7 and memory[401:].tolist() == [7, 7]


def test_bucket_payload_bytes_is_wire_bytes_plus_alignment() -> None:
    for kind, sections in [("sparse", 2), ("bitmask", 2), ("bitmask_i8", 3)]:
        for words, changed, escapes in [(1003, 17, 5), (8, 8, 0), (1, 1, 1), (0, 0, 0)]:
            escapes = escapes if kind == "bitmask_i8" else 0
            size = bucket_payload_bytes(kind, 2 * words, changed, escapes)
            exact = wire_bytes(kind, words, changed, escapes=escapes)
            assert exact <= size < exact + 8 * (sections - 1) or size == exact == 0
    assert bucket_payload_bytes("dense", 1001, 3) == 1001
    assert bucket_payload_bytes("bitmask_i8", 2 * 1003, 13, 1) == 128 + 16 + 2  # 126 + 2 pad, 13 + 3 pad


# --- bucket format errors ----------------------------------------------------------------------------


def encoded_kind(kind: str, nbytes: int = 2 * 1003):
    """(old, new, delta) of `kind` for a bucket of `nbytes` bytes."""
    plan = {"sparse": (0.01, 1), "bitmask": (0.2, 30000), "bitmask_i8": (0.2, 1), "dense": (1.0, 30000)}
    density, max_step = plan[kind]
    old, new = bucket_stepped(nbytes, density, seed=41, max_step=max_step)
    new16 = new.view(torch.int16).clone()
    if kind == "bitmask_i8":
        new16[7] ^= 0x4000  # one escape
    new = new16.view(torch.uint8)
    delta = encode_bucket(old, new)
    assert delta.kind == kind
    return old, new, delta


def corrupt_header(delta: BucketDelta, word: int, value: int) -> torch.Tensor:
    header = delta.header.clone()
    header[word] = value
    return header


def assert_refused(old, header, payload, match: str, target=None) -> None:
    target = old.clone() if target is None else target
    before = target.clone()
    with pytest.raises(DeltaFormatError, match=match):
        apply_bucket(target, header, payload)
    assert torch.equal(target, before)  # checked before the first write


def test_format_error_is_a_value_error() -> None:
    assert issubclass(DeltaFormatError, ValueError)


@pytest.mark.parametrize("kind", ["sparse", "bitmask", "bitmask_i8", "dense"])
def test_header_errors(kind) -> None:
    old, _, delta = encoded_kind(kind)
    h, p = delta.header, delta.payload
    bad_magic = corrupt_header(delta, 0, MAGIC ^ 1)
    with pytest.raises(DeltaFormatError, match="bad magic"):
        payload_nbytes(bad_magic)
    assert_refused(old, bad_magic, p, "bad magic")
    assert_refused(old, h.int(), p, r"int64 \[8\]")
    assert_refused(old, h[:7], p, r"int64 \[8\]")
    assert_refused(old, h.view(1, 8), p, r"int64 \[8\]")
    for code in (4, 7, -1):  # xor_zlib is never sent
        with pytest.raises(DeltaFormatError, match=f"unknown kind code {code}"):
            payload_nbytes(corrupt_header(delta, 1, code))
    assert_refused(old, corrupt_header(delta, 2, int(h[2]) + 8), p, "payload size")
    assert_refused(old, corrupt_header(delta, 6, 1), p, "reserved")
    assert_refused(old, h, p[:-1], "payload bytes")
    assert_refused(old, h, p.view(torch.int8), "payload bytes")
    assert_refused(old, h, p, "2006-byte bucket", target=torch.zeros(2008, dtype=torch.uint8))
    assert_refused(old, h, p, "2006-byte bucket", target=old.view(torch.int16).clone())
    assert_refused(old, corrupt_header(delta, 4, 1004), p, "changed 1004 is outside")
    assert_refused(old, corrupt_header(delta, 4, -1), p, "changed -1 is outside")


@pytest.mark.parametrize("kind", ["sparse", "bitmask", "bitmask_i8"])
def test_a_valid_but_wrong_kind_code_is_refused(kind) -> None:
    old, _, delta = encoded_kind(kind)
    for other, code in KIND_CODES.items():
        if other != kind:
            assert_refused(old, corrupt_header(delta, 1, code), delta.payload, "payload size|escapes")


def test_escapes_outside_bitmask_i8_and_odd_lengths_outside_dense_are_refused() -> None:
    old, _, delta = encoded_kind("sparse")
    assert_refused(old, corrupt_header(delta, 5, 1), delta.payload, "sparse bucket has no escapes")
    old, _, delta = encoded_kind("bitmask_i8")
    too_many = int(delta.header[4]) + 1
    assert_refused(old, corrupt_header(delta, 5, too_many), delta.payload, "escapes .* is outside")
    odd = corrupt_header(delta, 3, 2005)
    with pytest.raises(DeltaFormatError, match="odd-length bucket"):
        payload_nbytes(odd)


def test_out_of_range_sparse_indices_are_refused() -> None:
    old, _, delta = encoded_kind("sparse")
    for bad in (1003, 2**30, -1):
        payload = delta.payload.clone()
        payload[:4].view(torch.int32)[0] = bad
        assert_refused(old, delta.header, payload, "sparse index out of range")


@pytest.mark.parametrize("kind", ["bitmask", "bitmask_i8"])
def test_mask_popcount_and_padding_bits_are_checked(kind) -> None:
    old, _, delta = encoded_kind(kind)
    mask = delta.payload[:126]
    first_set = int(unpack_bits(mask, 1003).nonzero()[0])
    cleared = delta.payload.clone()
    cleared[first_set // 8] ^= 1 << (first_set % 8)
    assert_refused(old, delta.header, cleared, "mask popcount")
    first_clear = int((~unpack_bits(mask, 1003)).nonzero()[0])
    added = delta.payload.clone()
    added[first_clear // 8] ^= 1 << (first_clear % 8)
    assert_refused(old, delta.header, added, "mask popcount")
    spare = delta.payload.clone()
    spare[125] |= 0x80  # 1003 = 125 * 8 + 3: bits 3..7 of byte 125 are past the end
    assert_refused(old, delta.header, spare, "past the end")


def test_bitmask_i8_diffs_are_checked() -> None:
    old, _, delta = encoded_kind("bitmask_i8")
    diffs_at = 128
    diffs = delta.payload[diffs_at : diffs_at + delta.changed].view(torch.int8)
    plain = int((diffs != -128).nonzero()[0])
    extra_escape = delta.payload.clone()
    extra_escape[diffs_at + plain] = 0x80  # -128
    assert_refused(old, delta.header, extra_escape, "2 escapes in the diffs, the header says 1")
    zero = delta.payload.clone()
    zero[diffs_at + plain] = 0
    assert_refused(old, delta.header, zero, "zero step")


def test_value_corruption_passes_the_checks_and_the_digest_catches_it() -> None:
    old, new, delta = encoded_kind("sparse")
    payload = delta.payload.clone()
    payload[-1] ^= 0x01  # a value's bits, not the structure
    target = old.clone()
    apply_bucket(target, delta.header, payload)
    assert not torch.equal(target, new)
    assert digest(target) != digest(new)


# --- digest (any dtype) ------------------------------------------------------------------------------

_M64 = 2**64


def reference_mix(x: int) -> int:
    x ^= x >> 30
    x = x * 0xBF58476D1CE4E5B9 % _M64
    x ^= x >> 27
    x = x * 0x94D049BB133111EB % _M64
    return x ^ (x >> 31)


def reference_fold(x: int) -> int:
    x ^= x >> 16
    return x ^ (x >> 32)  # x ^ x>>16 ^ x>>32 ^ x>>48


def reference_digest(data: bytes, dtype: torch.dtype, chunk: int) -> int:
    """The digest's definition in plain Python integers: what any implementation must reproduce."""
    words = [int.from_bytes(data[i : i + 8].ljust(8, b"\0"), "little") for i in range(0, len(data), 8)]
    words = [reference_fold(x) for x in words]
    weights = [reference_mix(j + 1) | 1 for j in range(chunk)]
    total = 0
    for k in range(0, len(words), chunk):
        s = sum(w * x for w, x in zip(weights, words[k : k + chunk], strict=False)) % _M64
        total += reference_mix((s + (k // chunk) * 0x9E3779B97F4A7C15) % _M64)
    h = reference_mix((total % _M64) ^ len(data))
    return reference_mix(h ^ zlib.crc32(str(dtype).encode()))


@pytest.mark.parametrize(
    "tensor",
    [
        random_bytes(77, seed=51),
        torch.randn(3, 5, generator=torch.Generator().manual_seed(52)),
        torch.randint(-(2**62), 2**62, (9,), generator=torch.Generator().manual_seed(53)),
        torch.tensor([True, False, True]),
        torch.empty(0, dtype=torch.bfloat16),
    ],
    ids=["uint8-77", "fp32", "int64", "bool", "empty"],
)
def test_digest_matches_its_definition(tensor) -> None:
    data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    assert digest(tensor, chunk=4) == reference_digest(data, tensor.dtype, 4)
    assert digest(tensor) == reference_digest(data, tensor.dtype, DIGEST_CHUNK)


def test_digest_detects_any_flipped_bit_at_the_edges() -> None:
    nbytes = 8 * DIGEST_CHUNK + 13  # two chunks, the second ending in a zero-padded word
    data = random_bytes(nbytes, seed=54)
    base = digest(data)
    boundary = 8 * DIGEST_CHUNK
    seen = {base}
    for at in (0, 7, 8, boundary - 1, boundary, nbytes - 6, nbytes - 5, nbytes - 1):  # last: 5 in a word
        for bit in range(8):
            flipped = data.clone()
            flipped[at] ^= 1 << bit
            value = digest(flipped)
            assert value != base, (at, bit)
            seen.add(value)
    assert len(seen) == 1 + 8 * 8  # and no two of them collide


def test_digest_covers_every_dtype_and_layout() -> None:
    g = torch.Generator().manual_seed(55)
    fp32 = torch.randn(33, 17, generator=g)
    for tensor in [
        fp32,
        torch.randint(-(2**40), 2**40, (101,), generator=g),
        torch.rand(99, generator=g) < 0.5,
        random_bytes(1001, seed=56),
        fp32.to(torch.float64),
        fp32.to(torch.complex64),
    ]:
        base = digest(tensor)
        assert digest(tensor.clone()) == base
        changed = tensor.clone().reshape(-1)
        changed[changed.numel() // 2] = ~changed[changed.numel() // 2] if tensor.dtype == torch.bool else 0
        assert not torch.equal(changed, tensor.reshape(-1))
        assert digest(changed) != base, tensor.dtype
    transposed = fp32.t()
    assert not transposed.is_contiguous()
    assert digest(transposed) == digest(transposed.contiguous()) != digest(fp32)
    assert digest(fp32[:, ::3]) == digest(fp32[:, ::3].contiguous())


def test_digest_separates_dtypes_and_lengths_of_equal_bytes() -> None:
    raw = torch.randint(
        -(2**15), 2**15, (64,), generator=torch.Generator().manual_seed(57), dtype=torch.int16
    )
    views = [
        raw,
        raw.view(torch.bfloat16),
        raw.view(torch.float16),
        raw.view(torch.uint8),
        raw.view(torch.int64),
    ]
    assert len({digest(v) for v in views}) == len(views)
    zeros = torch.zeros(16, dtype=torch.uint8)
    assert len({digest(zeros[:n]) for n in range(17)}) == 17  # the same zero words, other lengths


def test_digest_of_a_misaligned_view_spanning_blocks() -> None:
    nbytes = 9 * 8 * DIGEST_CHUNK + 5  # more than one block of rows and a tail
    memory = random_bytes(nbytes + 3, seed=58)
    view = memory[3:]
    assert view.storage_offset() % 8
    assert digest(view) == digest(view.clone())
    changed = view.clone()
    changed[8 * 8 * DIGEST_CHUNK] ^= 1  # the first byte of the second block
    assert digest(changed) != digest(view)


def test_digest_many_gives_16_hex_digits_per_name_in_order() -> None:
    g = torch.Generator().manual_seed(59)
    named = [(f"layer.{i}.weight", torch.randn(7, i + 1, generator=g).to(torch.bfloat16)) for i in range(24)]
    named.append(("bias", torch.zeros(3, dtype=torch.int64)))
    digests = digest_many(iter(named))
    assert list(digests) == [name for name, _ in named]
    for name, tensor in named:
        assert re.fullmatch(r"[0-9a-f]{16}", digests[name])
        assert digests[name] == f"{digest(tensor):016x}"
    assert any(int(d, 16) >= 2**63 for d in digests.values())  # the top bit set, still unsigned
    assert digest_many([]) == {}


def test_digest_detects_pairs_of_sign_flips_at_the_top_of_words() -> None:
    """Without the fold each of these flips adds exactly 2^63 to its chunk's sum, so any two cancel."""
    base_bits = (
        torch.randn(64, generator=torch.Generator().manual_seed(60)).to(torch.bfloat16).view(torch.int16)
    )
    base = digest(base_bits.view(torch.bfloat16))
    tops = range(3, 64, 4)  # element 4k + 3 holds bits 48..63 of word k
    seen = {base}
    for i in tops:
        for j in tops:
            if i < j:
                flipped = base_bits.clone()
                flipped[[i, j]] ^= -32768
                seen.add(digest(flipped.view(torch.bfloat16)))
    assert len(seen) == 1 + 16 * 15 // 2


def _mixed_tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Every layout the packed digest must lay end to end: empty, tails of 1-7 bytes, several rows, a
    non-contiguous view, a misaligned view, several dtypes."""
    g = torch.Generator().manual_seed(seed)
    memory = random_bytes(3 * 8 * DIGEST_CHUNK + 11, seed=seed)
    return [
        ("empty", torch.empty(0, dtype=torch.bfloat16)),
        ("byte", random_bytes(1, seed=seed + 1)),
        ("norm", torch.randn(1023, generator=g).to(torch.bfloat16)),
        ("rows", torch.randn(5, DIGEST_CHUNK + 3, generator=g).to(torch.bfloat16)),
        ("misaligned", memory[3:]),
        ("transposed", torch.randn(33, 17, generator=g).t()),
        ("int64", torch.randint(-(2**62), 2**62, (9,), generator=g)),
        ("bool", torch.rand(13, generator=g) < 0.5),
        ("empty_again", torch.empty(0, 4)),
        ("fp16", torch.randn(2 * DIGEST_CHUNK, generator=g).to(torch.float16)),
    ]


@pytest.mark.parametrize("pack_bytes", [1 << 40, 1 << 20, 1], ids=["one_pack", "several_packs", "alone"])
def test_packed_digests_equal_the_per_tensor_digest(monkeypatch, pack_bytes: int) -> None:
    monkeypatch.setattr(delta_module, "_PACK_BYTES", pack_bytes)
    named = _mixed_tensors(seed=61)
    digests = digest_many(named, packed=True)
    assert digests == digest_many(named, packed=False)
    assert digests == {name: f"{digest(t):016x}" for name, t in named}


def test_packed_digest_matches_the_definition_with_small_chunks() -> None:
    """Chunks of 4 words put many rows in every tensor: the rows' bounds and indices in the pack."""
    tensors = [t for _, t in _mixed_tensors(seed=62)][:6]
    words = delta_module._packed_digest_words(tensors, chunk=4).tolist()
    for tensor, word in zip(tensors, words, strict=True):
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        assert word & (2**64 - 1) == reference_digest(data, tensor.dtype, 4) == digest(tensor, chunk=4)


def test_packed_digest_still_detects_one_flipped_bit_in_each_tensor() -> None:
    named = _mixed_tensors(seed=63)
    base = digest_many(named, packed=True)
    for index, (name, tensor) in enumerate(named):
        if tensor.numel() == 0:
            continue
        flipped = tensor.contiguous().clone()
        flipped.view(torch.uint8).view(-1)[-1] ^= 0x10
        changed = digest_many([*named[:index], (name, flipped), *named[index + 1 :]], packed=True)
        assert {k for k in base if base[k] != changed[k]} == {name}
