"""StableReinforce provenance: the sampler logprobs this gateway recorded, in place of the client's copy.

Every sample's result stays in its future (`FutureRepository`, kept `future_ttl_s`, one day by default),
and each sampled sequence is named `{request_id}:{index}` (the future's `sample_sequence_ids`, which the
SDK hands out as `SampledSequence.sequence_id`). A `stable_reinforce` datum with `loss_fn_input_spans`
(`Datum.with_provenance`) names, for each run of its target positions, the sequence that run reproduces.
At the positions of a sampled run the loss uses the logprobs the engine reported for exactly those
tokens, after checking they are the tokens sampled; prompt runs keep the client's `logprobs`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

import numpy as np
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from miles.errors import UserError
from miles.gateway.tinker.codec import LossSpan
from miles.state.futures import FutureRecord, FutureState
from miles.types import Datum

# A sampled sequence: its tokens (int64) and the engine's logprob of each (float32).
Sampled = tuple[np.ndarray, np.ndarray]
FindFuture = Callable[[str], Awaitable[FutureRecord | None]]  # the caller's own future, or None


async def with_recorded_logprobs(
    data: Sequence[Datum], spans: Sequence[tuple[LossSpan, ...] | None], find_future: FindFuture
) -> list[Datum]:
    """`data` with each sampled run's `logprobs` replaced by what sampling recorded."""
    cache: dict[str, list[Sampled]] = {}
    out: list[Datum] = []
    for index, (datum, datum_spans) in enumerate(zip(data, spans, strict=True)):
        if datum_spans is None:
            out.append(datum)
            continue
        sequences = {}
        for span in datum_spans:
            if span.sampled and span.sequence_id not in sequences:
                sequences[span.sequence_id] = await _sampled(span.sequence_id, find_future, cache)
        try:
            out.append(overlay(datum, datum_spans, sequences))
        except UserError as exc:
            raise UserError(f"datum {index}: {exc}") from exc
    return out


def overlay(datum: Datum, spans: Sequence[LossSpan], sequences: dict[str, Sampled]) -> Datum:
    """Pure: the datum with the recorded logprobs at its sampled runs (tokens checked)."""
    targets = datum.loss_fn_inputs.get("target_tokens")
    old = datum.loss_fn_inputs.get("logprobs")
    if targets is None or old is None or targets.ndim != 1 or len(old) != len(targets):
        return datum  # preflight names what is missing or misshapen
    covered = sum(span.length for span in spans)
    if covered != len(targets):
        raise UserError(
            f"loss_fn_input_spans cover {covered} positions but target_tokens has {len(targets)}; "
            "the runs must tile it"
        )
    logprobs = np.array(old, dtype=np.float32, copy=True)
    position = 0
    for span in spans:
        if span.sampled:
            tokens, recorded = sequences[span.sequence_id]
            end = span.offset + span.length
            if end > len(tokens):
                raise UserError(
                    f"span [{span.offset}, {end}) of sequence {span.sequence_id} is past its "
                    f"{len(tokens)} sampled tokens"
                )
            if not np.array_equal(targets[position : position + span.length], tokens[span.offset : end]):
                raise UserError(
                    f"target_tokens[{position}:{position + span.length}] are not the tokens sampled at "
                    f"[{span.offset}, {end}) of sequence {span.sequence_id}"
                )
            logprobs[position : position + span.length] = recorded[span.offset : end]
        position += span.length
    return replace(datum, loss_fn_inputs={**datum.loss_fn_inputs, "logprobs": logprobs})


async def _sampled(sequence_id: str, find_future: FindFuture, cache: dict[str, list[Sampled]]) -> Sampled:
    request_id, _, index_text = sequence_id.rpartition(":")
    if request_id not in cache:
        cache[request_id] = await _sample_result(request_id, sequence_id, find_future)
    sequences = cache[request_id]
    if not index_text.isdigit() or int(index_text) >= len(sequences):
        raise UserError(f"sequence_id {sequence_id!r} names no sequence of sample {request_id}")
    return sequences[int(index_text)]


async def _sample_result(request_id: str, sequence_id: str, find_future: FindFuture) -> list[Sampled]:
    record = await find_future(request_id) if request_id else None
    if record is None or record.kind != "Sample":
        raise UserError(
            f"sequence_id {sequence_id!r} was not sampled by this key on this job, or its record expired "
            "(samples are kept for future_ttl_s, one day by default)"
        )
    body = record.result_bytes()
    if record.state is not FutureState.COMPLETE or body is None:
        raise UserError(f"sample {request_id} of sequence_id {sequence_id!r} has no result ({record.state})")
    msg = pb.SampleResponse()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise UserError(f"the recorded sample {request_id} cannot be read: {exc}") from exc
    return [
        (
            np.frombuffer(seq.tokens, dtype="<i4").astype(np.int64),
            np.frombuffer(seq.logprobs, dtype="<f4").astype(np.float32),
        )
        for seq in msg.sequences
    ]
