"""`miles.utils.tensor_ipc`: SGLang's `/update_weights_from_tensor` payload between unrelated processes
(CPU tensors through shared-memory files), and the allowlist that guards the receiving side."""

from __future__ import annotations

import base64
import io
import os
import pickle
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from miles.utils import tensor_ipc
from miles.utils.tensor_ipc import (
    FlattenedTensorMetadata,
    TensorPayloadError,
    deserialize_flattened_bucket,
    deserialize_named_tensors,
    flatten_bucket,
    serialize_flattened_bucket,
    serialize_named_tensors,
)

# dtypes of different sizes back to back, in an order where each starts at a multiple of its itemsize
# (as plan_buckets(flattened=True) cuts buckets); odd byte counts after the wider ones
MIXED = [
    ("d", torch.arange(4, dtype=torch.float64).view(2, 2).t()),  # not contiguous
    ("b", torch.arange(7, dtype=torch.float32)),
    ("a", torch.randn(3, 5).to(torch.bfloat16)),
    ("c", torch.randn(3).to(torch.float16)),
]

# The sender: a separate interpreter (not a child sharing our authkey) that prints one payload, then
# holds its tensors until told to go, as a trainer must until the engine answered.
SENDER = """
import sys, torch
from miles.utils.tensor_ipc import serialize_named_tensors
torch.manual_seed(0)
base = torch.randn(24)
named = [
    ("a.weight", base[:12].view(3, 4)),   # two views of one storage
    ("a.bias", base[12:]),
    ("b.weight", torch.randn(5, 2).to(torch.bfloat16)),
    ("empty", torch.empty(0)),
]
torch.save(dict(named), sys.argv[1])
print(serialize_named_tensors(named), flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def sent(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    expected_file = tmp_path / "expected.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", SENDER, str(expected_file)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        payload = proc.stdout.readline().strip()
        assert payload, "the sender printed no payload"
        yield payload, torch.load(expected_file)
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=30)


def test_round_trip_between_two_unrelated_processes(sent) -> None:
    payload, expected = sent
    received = deserialize_named_tensors(payload)
    assert [name for name, _ in received] == list(expected)
    for name, tensor in received:
        assert tensor.dtype == expected[name].dtype and tensor.shape == expected[name].shape, name
        assert torch.equal(tensor, expected[name]), name


def test_views_of_one_storage_stay_one_storage(sent) -> None:
    payload, _ = sent
    received = dict(deserialize_named_tensors(payload))
    weight, bias = received["a.weight"], received["a.bias"]
    assert weight.untyped_storage().data_ptr() == bias.untyped_storage().data_ptr()
    assert bias.storage_offset() == 12 and bias.data_ptr() - weight.data_ptr() == 12 * 4
    assert received["b.weight"].untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()


def test_a_payload_that_pickles_a_function_is_refused() -> None:
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    buffer = io.BytesIO()
    ForkingPickler(buffer).dump([("x", Evil())])
    payload = base64.b64encode(buffer.getvalue()).decode()
    with pytest.raises(TensorPayloadError, match=r"posix\.system is not allowed|os\.system is not allowed"):
        deserialize_named_tensors(payload)


def test_a_plain_pickle_of_builtins_is_refused_too() -> None:
    payload = base64.b64encode(pickle.dumps([("x", bytearray(b"abc"))])).decode()
    with pytest.raises(TensorPayloadError, match=r"builtins\.bytearray is not allowed"):
        deserialize_named_tensors(payload)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("not base64!", "not base64"),
        (base64.b64encode(b"\x80\x04garbage").decode(), "does not unpickle"),
        (base64.b64encode(pickle.dumps({"x": 1})).decode(), "list of"),
        (base64.b64encode(pickle.dumps([("x", 1)])).decode(), "list of"),
    ],
)
def test_malformed_payloads_are_refused(payload: str, message: str) -> None:
    with pytest.raises(TensorPayloadError, match=message):
        deserialize_named_tensors(payload)


def test_cpu_tensors_use_shared_memory_files_whatever_the_global_strategy() -> None:
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"  # Linux default: DupFd
    payload = serialize_named_tensors([("w", torch.arange(6.0))])
    # a shared-memory file name, not a DupFd (which needs the sender's authkey to redeem)
    assert b"rebuild_storage_filename" in base64.b64decode(payload)
    assert b"DupFd" not in base64.b64decode(payload)
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor", "global state untouched"
    ((name, tensor),) = deserialize_named_tensors(payload)
    assert name == "w" and torch.equal(tensor, torch.arange(6.0))


def test_sender_refuses_what_is_not_a_named_tensor() -> None:
    with pytest.raises(TypeError):
        serialize_named_tensors([("w", [1.0, 2.0])])  # type: ignore[list-item]


def test_sglangs_own_deserializer_reads_our_payload() -> None:
    common = pytest.importorskip("sglang.srt.utils.common", reason="sglang wheel not installed")
    base = torch.arange(6.0)
    named = [("w", base[:4].view(2, 2)), ("b", base[4:]), ("h", torch.ones(2, dtype=torch.bfloat16))]
    received = common.MultiprocessingSerializer.deserialize(serialize_named_tensors(named))  # SafeUnpickler
    assert [n for n, _ in received] == ["w", "b", "h"]
    for (_, got), (_, sent) in zip(received, named, strict=True):
        assert got.dtype == sent.dtype and torch.equal(got, sent)


def test_we_read_sglangs_payload_of_shared_memory_files_and_explain_a_dupfd() -> None:
    common = pytest.importorskip("sglang.srt.utils.common", reason="sglang wheel not installed")
    named = [("w", torch.arange(4.0))]
    serialize = common.MultiprocessingSerializer.serialize
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        by_filename = serialize(named, output_str=True)
    finally:
        torch.multiprocessing.set_sharing_strategy("file_descriptor")
    ((name, tensor),) = deserialize_named_tensors(by_filename)
    assert name == "w" and torch.equal(tensor, named[0][1])
    with pytest.raises(TensorPayloadError, match=r"storage_fd is not allowed.*file_descriptor"):
        deserialize_named_tensors(serialize([("w", torch.arange(4.0))], output_str=True))


def test_a_flattened_bucket_round_trips_back_to_back() -> None:
    buffer, metadata = flatten_bucket(MIXED)
    assert [m.start_idx for m in metadata] == [0, 32, 60, 90] and buffer.numel() == 96
    assert all(m.end_idx - m.start_idx == m.numel for m in metadata)
    received = deserialize_flattened_bucket(serialize_flattened_bucket(buffer, metadata))
    assert [n for n, _ in received] == [n for n, _ in MIXED]
    for (_, got), (_, sent) in zip(received, MIXED, strict=True):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
    MIXED[1][1].add_(1.0)  # the bucket is a copy: the sender may step on at once
    assert torch.equal(dict(received)["b"], torch.arange(7, dtype=torch.float32))
    MIXED[1][1].sub_(1.0)


def test_a_misaligned_order_is_refused_not_padded() -> None:
    with pytest.raises(ValueError, match="plan the buckets with flattened=True"):
        flatten_bucket([MIXED[2], MIXED[1]])  # a float32 at byte 30


def test_sglangs_own_code_reads_our_flattened_bucket() -> None:
    """SGLang's unpickler (its allowlist) and its FlattenedTensorBucket.reconstruct_tensors, as its
    weight updater runs them for load_format="flattened_bucket"."""
    common = pytest.importorskip("sglang.srt.utils.common", reason="sglang wheel not installed")
    bucket = pytest.importorskip("sglang.srt.weight_sync.tensor_bucket")
    payload = serialize_flattened_bucket(*flatten_bucket(MIXED))
    assert b"miles" not in base64.b64decode(payload), "no class of ours on the wire"
    data = common.MultiprocessingSerializer.deserialize(payload)
    assert all(isinstance(m, bucket.FlattenedTensorMetadata) for m in data["metadata"])
    rebuilt = bucket.FlattenedTensorBucket(
        flattened_tensor=data["flattened_tensor"], metadata=data["metadata"]
    ).reconstruct_tensors()
    for (name, got), (sent_name, sent) in zip(rebuilt, MIXED, strict=True):
        assert name == sent_name and got.dtype == sent.dtype and torch.equal(got, sent)


def _bucket_payload(metadata: list, buffer: torch.Tensor | None = None) -> str:
    """A flattened bucket as a hostile or buggy sender could write it: any metadata, SGLang's class name."""
    out = io.BytesIO()
    tensor_ipc._pickler(out, 3).dump(
        {
            "flattened_tensor": torch.zeros(64, dtype=torch.uint8) if buffer is None else buffer,
            "metadata": metadata,
        }
    )
    raw = out.getvalue().replace(
        b"cmiles.utils.tensor_ipc\nFlattenedTensorMetadata",
        b"csglang.srt.weight_sync.tensor_bucket\nFlattenedTensorMetadata",
    )
    return base64.b64encode(raw).decode()


def _odd(drop: str | None = None, **fields: object) -> FlattenedTensorMetadata:
    """Metadata whose fields a hostile sender chose: any type, or one missing."""
    meta = _meta(0, 16)
    vars(meta).update(fields)
    if drop:
        del vars(meta)[drop]
    return meta


def _meta(start: int, end: int, shape=(4,), dtype=torch.float32) -> FlattenedTensorMetadata:
    return FlattenedTensorMetadata("w", torch.Size(shape), dtype, start, end, end - start)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (lambda: serialize_named_tensors([("w", torch.ones(2))]), "must be a dict with exactly"),
        (lambda: _bucket_payload([]), "non-empty list"),
        (lambda: _bucket_payload([_meta(0, 16)], torch.zeros(4, 4, dtype=torch.uint8)), "1-D uint8"),
        (lambda: _bucket_payload([_meta(56, 72)]), r"bytes \[56, 72\) of a 64-byte buffer"),
        (lambda: _bucket_payload([_meta(0, 12)]), "do not hold a torch.float32 tensor of shape"),
        (lambda: _bucket_payload([_meta(2, 18)]), "not aligned"),
        (lambda: _bucket_payload([("w", torch.ones(2))]), "must be FlattenedTensorMetadata"),
        (lambda: _bucket_payload([_odd(start_idx="0")]), "must be integers"),
        (lambda: _bucket_payload([_odd(shape=None)]), "is malformed: TypeError"),
        (lambda: _bucket_payload([_odd(dtype="float32")]), "dtype a torch dtype"),
        (lambda: _bucket_payload([_odd(drop="end_idx")]), "is malformed: AttributeError"),
    ],
)
def test_malformed_flattened_buckets_are_refused(payload, message: str) -> None:
    with pytest.raises(TensorPayloadError, match=message):
        deserialize_flattened_bucket(payload())
