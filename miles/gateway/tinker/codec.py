"""Tinker protobuf <-> runtime types.

Uses the SDK's own generated module (`tinker.proto.tinker_public_pb2`) so the field numbers are the
SDK's. Byte fields are raw little-endian numpy buffers; BatchedTensor offsets are BYTE offsets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zstandard
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from miles.errors import TooLargeError, UserError
from miles.gateway.settings import DEFAULT_MAX_BODY_BYTES
from miles.gateway.tinker.ids import check_identifier
from miles.gateway.tinker.logprobs import TargetLayout
from miles.seam.requests import ForwardBackwardRequest
from miles.types import Datum, ForwardBackwardOutput, SampleOutput, TopLogprobs

_DTYPES: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_INT32: np.dtype("<i4"),
}
# zstd's densest block (RLE: a 3-byte header and one byte) stands for at most 128 KiB: one compressed
# byte yields at most 32 KiB. Each step feeds only as many bytes as the budget left could fill at that
# ratio (at least _ZSTD_MIN_STEP), so the output never passes the limit by more than 8 MiB.
_ZSTD_MAX_RATIO = 32 << 10
_ZSTD_MIN_STEP = 256
_ZSTD_MAX_HEADER = 18  # bytes: the longest zstd frame header
# Frames needing a larger window are refused before it is allocated; the SDK compresses at level 3
# (a 2 MiB window), and no level up to 19 needs more than 8 MiB.
_ZSTD_MAX_WINDOW = 8 << 20


@dataclass(frozen=True)
class LossSpan:
    """One run of a datum's `loss_fn_input_spans`: `length` consecutive target positions that reproduce
    positions [offset, offset + length) of a sampled sequence's tokens (`sampled`) or of the prompt of the
    request that sampled it. The runs tile `target_tokens` in order."""

    sequence_id: str
    offset: int
    length: int
    sampled: bool


@dataclass(frozen=True)
class ForwardBackwardCall(ForwardBackwardRequest):
    """A decoded ForwardBackwardRequest: the runtime's request, with what only the gateway reads."""

    seq_id: int = field(kw_only=True)  # the model's order (Operations.submit_ordered)
    # per datum, its loss_fn_input_spans (Datum.with_provenance), or None when it has none
    loss_spans: list[tuple[LossSpan, ...] | None] = field(default_factory=list, kw_only=True)


def decompress(
    body: bytes, content_encoding: str | None, *, max_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> bytes:
    encoding = (content_encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding != "zstd":
        raise UserError(f"unsupported Content-Encoding {content_encoding!r}; send zstd or none")
    try:
        return _zstd_bounded(body, max_bytes)
    except zstandard.ZstdError as exc:
        raise UserError(f"body is not valid zstd: {exc}") from exc


def _zstd_bounded(body: bytes, max_bytes: int) -> bytes:
    """Every frame of `body`, refused as soon as the output passes `max_bytes`. A frame whose header
    declares a size that fits the budget left is fed whole (zstd fails a frame whose output differs from
    its declared size); any other frame a step at a time. One-shot decompression would allocate whatever
    size the header declares."""
    dctx = zstandard.ZstdDecompressor(max_window_size=_ZSTD_MAX_WINDOW)
    frame, frame_started, fits = dctx.decompressobj(), False, False
    out: list[bytes] = []
    size, pos = 0, 0
    while pos < len(body):
        if not frame_started:
            declared = zstandard.frame_content_size(body[pos : pos + _ZSTD_MAX_HEADER])
            fits = 0 <= declared <= max_bytes - size
        step = len(body) - pos if fits else max(_ZSTD_MIN_STEP, (max_bytes - size) // _ZSTD_MAX_RATIO)
        chunk = frame.decompress(body[pos : pos + step])
        pos += step
        frame_started = True
        size += len(chunk)
        if size > max_bytes:
            raise TooLargeError(
                f"the zstd body decompresses to more than {max_bytes} bytes (gateway setting "
                "max_body_bytes); send the batch in smaller requests"
            )
        out.append(chunk)
        if frame.eof:  # the next frame starts with what this one left over
            pos -= len(frame.unused_data)
            frame, frame_started = dctx.decompressobj(), False
    if frame_started:
        raise UserError("the zstd body ends inside a frame: it was cut short")
    return b"".join(out)


class _DecodeBudget:
    """What the tensors decoded from one request may take in all: a sparse tensor counts at its dense size."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.left = max_bytes

    def take(self, nbytes: int, name: str) -> None:
        self.left -= nbytes
        if self.left < 0:
            raise TooLargeError(
                f"loss_fn_inputs[{name!r}]: the request's tensors decode to more than {self.max_bytes} bytes "
                "(gateway setting max_body_bytes; sparse tensors count at their dense size); send fewer "
                "or smaller datums per request"
            )


def _dtype_name(value: int) -> str:
    try:
        return pb.DType.Name(value)
    except ValueError:  # proto3 enums are open: any number parses
        return str(value)


def decode_tensor(msg: pb.Tensor, name: str, budget: _DecodeBudget | None = None) -> np.ndarray:
    """A dense numpy array from a dense or sparse-CSR proto Tensor."""
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise UserError(f"loss_fn_inputs[{name!r}]: unsupported dtype {_dtype_name(msg.dtype)}")
    shape = tuple(int(s) for s in msg.shape)
    if any(dim < 0 for dim in shape):
        raise UserError(f"loss_fn_inputs[{name!r}]: shape {list(shape)} has a negative dimension")
    budget = budget or _DecodeBudget(DEFAULT_MAX_BODY_BYTES)
    if msg.HasField("sparse_csr"):
        budget.take(math.prod(shape) * dtype.itemsize, name)  # before the dense array is allocated
        return _dense_from_csr(msg.sparse_csr, dtype, shape, name)
    flat = _array(msg.dense, dtype, f"loss_fn_inputs[{name!r}].dense")
    budget.take(flat.nbytes, name)
    if not shape:
        shape = (flat.size,)
    if math.prod(shape) != flat.size:
        raise UserError(f"loss_fn_inputs[{name!r}]: shape {list(shape)} does not match {flat.size} values")
    return flat.reshape(shape).astype(dtype.newbyteorder("="), copy=True)


def _array(raw: bytes, dtype: np.dtype | str, what: str) -> np.ndarray:
    """A read-only view of a little-endian byte field; a length that is no whole number of values is a
    UserError (numpy's own is a ValueError, which would answer 500)."""
    itemsize = np.dtype(dtype).itemsize
    if len(raw) % itemsize:
        raise UserError(f"{what}: {len(raw)} bytes is not a whole number of {itemsize}-byte values")
    return np.frombuffer(raw, dtype=dtype)


def _dense_from_csr(csr: pb.SparseCsr, dtype: np.dtype, shape: tuple[int, ...], name: str) -> np.ndarray:
    if len(shape) != 2:
        raise UserError(f"loss_fn_inputs[{name!r}]: sparse CSR needs a 2-D shape, got {list(shape)}")
    values = _array(csr.values, dtype, f"loss_fn_inputs[{name!r}].sparse_csr.values")
    crow = _array(csr.crow_indices, "<i8", f"loss_fn_inputs[{name!r}].sparse_csr.crow_indices")
    cols = _array(csr.col_indices, "<i8", f"loss_fn_inputs[{name!r}].sparse_csr.col_indices")
    rows, ncols = shape
    valid = (
        crow.size == rows + 1
        and cols.size == values.size
        and (crow.size == 0 or (crow[0] == 0 and crow[-1] == values.size and np.all(np.diff(crow) >= 0)))
        and (cols.size == 0 or (cols.min() >= 0 and cols.max() < ncols))
    )
    if not valid:
        raise UserError(f"loss_fn_inputs[{name!r}]: inconsistent sparse CSR indices for shape {list(shape)}")
    dense = np.zeros(shape, dtype=dtype.newbyteorder("="))
    row_of = np.repeat(np.arange(rows), np.diff(crow))
    dense[row_of, cols] = values
    return dense


def _decode_datum(msg: pb.Datum, index: int, budget: _DecodeBudget) -> Datum:
    pieces: list[np.ndarray] = []
    for chunk in msg.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise UserError(f"data[{index}]: {kind} chunks are not supported; send encoded_text tokens")
        pieces.append(_array(chunk.encoded_text.tokens, "<i4", f"data[{index}].model_input tokens"))
    tokens = np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, dtype=np.int64)
    inputs = {name: decode_tensor(t, name, budget) for name, t in msg.loss_fn_inputs.items()}
    return Datum(model_input=tokens, loss_fn_inputs=inputs)


def _loss_spans(msg: pb.Datum) -> tuple[LossSpan, ...] | None:
    if not msg.loss_fn_input_spans:
        return None
    spans = []
    for span in msg.loss_fn_input_spans:
        kind = span.WhichOneof("span")
        if kind is None:
            raise UserError("a loss_fn_input_spans entry sets neither sampled_tokens nor prompt_tokens")
        run = getattr(span, kind)
        spans.append(LossSpan(run.sequence_id, int(run.offset), int(run.length), kind == "sampled_tokens"))
    return tuple(spans)


def _loss_config(msg: pb.ForwardBackwardRequest) -> dict[str, Any]:
    # The SDK dual-writes numbers into the legacy map; v2 also carries strings and wins when present.
    if msg.loss_fn_config_v2:
        out: dict[str, Any] = {}
        for key, value in msg.loss_fn_config_v2.items():
            kind = value.WhichOneof("value")
            out[key] = value.number if kind == "number" else value.text
        return out
    return {key: float(v) for key, v in msg.loss_fn_config.items()}


def decode_forward_backward(body: bytes, *, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> ForwardBackwardCall:
    """`max_bytes`: what the decoded tensors may take in all (TooLargeError beyond)."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise UserError(f"body is not a ForwardBackwardRequest protobuf: {exc}") from exc
    check_identifier(msg.model_id, "ForwardBackwardRequest.model_id")
    budget = _DecodeBudget(max_bytes)
    return ForwardBackwardCall(
        model_id=msg.model_id,
        seq_id=int(msg.seq_id),
        loss_fn=msg.loss_fn,
        loss_config=_loss_config(msg),
        forward_only=bool(msg.forward_only),
        data=[_decode_datum(d, i, budget) for i, d in enumerate(msg.data)],
        loss_spans=[_loss_spans(d) for d in msg.data],
    )


def _batched_f32(arrays: list[np.ndarray]) -> pb.BatchedTensor:
    # every datum shares the trailing shape ([K] for soft-target logprobs): the SDK reshapes by it
    trailing = list(arrays[0].shape[1:]) if arrays else []
    parts = [np.ascontiguousarray(a, dtype="<f4").reshape(-1) for a in arrays]
    sizes = [p.nbytes for p in parts]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype("<i8")
    data = b"".join(p.tobytes() for p in parts)
    return pb.BatchedTensor(
        data=data, offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32, trailing_shape=trailing
    )


def _metric_key(key: str) -> str:
    if key.count(":") != 1:
        raise ValueError(f"metric key {key!r} must be 'name:reduction' with exactly one colon")
    return key


def encode_forward_backward_output(out: ForwardBackwardOutput) -> bytes:
    if "loss:sum" not in out.metrics:
        raise ValueError("ForwardBackwardOutput.metrics must contain 'loss:sum'")
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(out.logprobs))
    record.fields["logprobs"].CopyFrom(_batched_f32(out.logprobs))
    record.fields["elementwise_loss"].CopyFrom(_batched_f32(out.elementwise_loss))
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    msg.loss_fn_outputs.append(record)
    for key, value in out.metrics.items():
        msg.metrics[_metric_key(key)] = float(value)
    return msg.SerializeToString()


_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


MASK_LOGPROB = -99999.0  # the SDK's empty TopkLogprobs cell (token id 0)


def _topk(rows: list[TopLogprobs | None], k: int) -> pb.TopkLogprobs:
    """Dense N x k matrices; a position without entries is all sentinels (the SDK reads it as None)."""
    ids = np.zeros((len(rows), k), dtype="<i4")
    logprobs = np.full((len(rows), k), MASK_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate((row or [])[:k]):
            ids[i, j], logprobs[i, j] = token, logprob
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(rows))


def _tensor(values: np.ndarray, dtype: pb.DType.ValueType) -> pb.Tensor:
    np_dtype = "<f4" if dtype == pb.DTYPE_FLOAT32 else "<i8"
    dense = np.ascontiguousarray(values, dtype=np_dtype)
    return pb.Tensor(dense=dense.tobytes(), dtype=dtype, shape=list(values.shape))


def _target_tensor(values: np.ndarray, layout: TargetLayout | None) -> pb.Tensor:
    """float32 logprobs in the request's layout: sparse CSR answers only the cells the request listed."""
    if layout is None or layout.crow is None or layout.col is None:
        return _tensor(values, pb.DTYPE_FLOAT32)
    rows = np.repeat(np.arange(layout.shape[0]), np.diff(layout.crow))
    csr = pb.SparseCsr(
        values=np.ascontiguousarray(values[rows, layout.col], dtype="<f4").tobytes(),
        crow_indices=np.ascontiguousarray(layout.crow, dtype="<i8").tobytes(),
        col_indices=np.ascontiguousarray(layout.col, dtype="<i8").tobytes(),
    )
    return pb.Tensor(sparse_csr=csr, dtype=pb.DTYPE_FLOAT32, shape=list(layout.shape))


def encode_sample_output(
    out: SampleOutput,
    *,
    topk_prompt: int = 0,
    topk_sample: int = 0,
    target_layout: TargetLayout | None = None,
) -> bytes:
    """`topk_prompt`/`topk_sample`: the widths asked for (the matrices are that wide even where the engine
    returned fewer entries)."""
    msg = pb.SampleResponse()
    for seq in out.sequences:
        if len(seq.logprobs) != len(seq.tokens):
            raise ValueError(f"{len(seq.tokens)} sampled tokens but {len(seq.logprobs)} logprobs")
        encoded = pb.SampledSequence(
            stop_reason=_STOP_REASONS[seq.stop_reason],
            tokens=np.asarray(seq.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype="<f4").tobytes(),
        )
        if seq.topk is not None and topk_sample > 0:
            encoded.topk_sampled_logprobs.CopyFrom(_topk(seq.topk, topk_sample))
        msg.sequences.append(encoded)
    if out.prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in out.prompt_logprobs]
        if values:
            values[0] = math.nan  # position 0 has no context
        msg.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    if out.topk_prompt is not None and topk_prompt > 0:
        msg.topk_prompt_logprobs.CopyFrom(_topk(out.topk_prompt, topk_prompt))
    if out.target_prompt is not None:
        msg.target_prompt_logprobs.CopyFrom(_target_tensor(out.target_prompt, target_layout))
    if out.alt_tokens is not None and out.alt_logprobs is not None:
        msg.prompt_alt_tokens.tokens.CopyFrom(_tensor(out.alt_tokens, pb.DTYPE_INT64))
        msg.prompt_alt_tokens.logprobs.CopyFrom(_tensor(out.alt_logprobs, pb.DTYPE_FLOAT32))
    return msg.SerializeToString()
