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

from miles.errors import UserError
from miles.gateway.tinker.logprobs import TargetLayout
from miles.types import Datum, ForwardBackwardOutput, SampleOutput, TopLogprobs

_DTYPES: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_INT32: np.dtype("<i4"),
}
_MAX_DECOMPRESSED_BYTES = 1 << 30


@dataclass(frozen=True)
class LossSpan:
    """One run of a datum's `loss_fn_input_spans`: `length` consecutive target positions that reproduce
    positions [offset, offset + length) of a sampled sequence's tokens (`sampled`) or of the prompt of the
    request that sampled it. The runs tile `target_tokens` in order."""

    sequence_id: str
    offset: int
    length: int
    sampled: bool


@dataclass
class ForwardBackwardCall:
    """A decoded ForwardBackwardRequest."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_config: dict[str, Any]
    forward_only: bool
    data: list[Datum] = field(default_factory=list)
    # per datum, its loss_fn_input_spans (Datum.with_provenance), or None when it has none
    loss_spans: list[tuple[LossSpan, ...] | None] = field(default_factory=list)


def decompress(body: bytes, content_encoding: str | None) -> bytes:
    encoding = (content_encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding != "zstd":
        raise UserError(f"unsupported Content-Encoding {content_encoding!r}; send zstd or none")
    try:
        return zstandard.ZstdDecompressor().decompress(body, max_output_size=_MAX_DECOMPRESSED_BYTES)
    except zstandard.ZstdError as exc:
        raise UserError(f"body is not valid zstd: {exc}") from exc


def decode_tensor(msg: pb.Tensor, name: str) -> np.ndarray:
    """A dense numpy array from a dense or sparse-CSR proto Tensor."""
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise UserError(f"loss_fn_inputs[{name!r}]: unsupported dtype {pb.DType.Name(msg.dtype)}")
    shape = tuple(int(s) for s in msg.shape)
    if msg.HasField("sparse_csr"):
        return _dense_from_csr(msg.sparse_csr, dtype, shape, name)
    flat = np.frombuffer(msg.dense, dtype=dtype)
    if not shape:
        shape = (flat.size,)
    if math.prod(shape) != flat.size:
        raise UserError(f"loss_fn_inputs[{name!r}]: shape {list(shape)} does not match {flat.size} values")
    return flat.reshape(shape).astype(dtype.newbyteorder("="), copy=True)


def _dense_from_csr(csr: pb.SparseCsr, dtype: np.dtype, shape: tuple[int, ...], name: str) -> np.ndarray:
    if len(shape) != 2:
        raise UserError(f"loss_fn_inputs[{name!r}]: sparse CSR needs a 2-D shape, got {list(shape)}")
    values = np.frombuffer(csr.values, dtype=dtype)
    crow = np.frombuffer(csr.crow_indices, dtype="<i8")
    cols = np.frombuffer(csr.col_indices, dtype="<i8")
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


def _decode_datum(msg: pb.Datum, index: int) -> Datum:
    pieces: list[np.ndarray] = []
    for chunk in msg.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise UserError(f"data[{index}]: {kind} chunks are not supported; send encoded_text tokens")
        pieces.append(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4"))
    tokens = np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, dtype=np.int64)
    inputs = {name: decode_tensor(t, name) for name, t in msg.loss_fn_inputs.items()}
    return Datum(model_input=tokens, loss_fn_inputs=inputs)


def _loss_spans(msg: pb.Datum) -> tuple[LossSpan, ...] | None:
    if not msg.loss_fn_input_spans:
        return None
    spans = []
    for span in msg.loss_fn_input_spans:
        kind = span.WhichOneof("span")
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


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise UserError(f"body is not a ForwardBackwardRequest protobuf: {exc}") from exc
    if not msg.model_id:
        raise UserError("ForwardBackwardRequest.model_id is empty")
    return ForwardBackwardCall(
        model_id=msg.model_id,
        seq_id=int(msg.seq_id),
        loss_fn=msg.loss_fn,
        loss_config=_loss_config(msg),
        forward_only=bool(msg.forward_only),
        data=[_decode_datum(d, i) for i, d in enumerate(msg.data)],
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


def _tensor(values: np.ndarray, dtype: int) -> pb.Tensor:
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
