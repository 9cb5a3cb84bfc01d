"""Hostile input: malformed ids, malformed forward_backward protobufs, zstd bombs and oversized bodies are
refused with a 4xx and a JSON body that names the problem; memory stays bounded while refusing them."""

from __future__ import annotations

import io
import json
import os
import resource
from pathlib import Path

import httpx
import numpy as np
import pytest
import zstandard
from runtime_double import BASE, DoubleRuntime, asgi_client, double_app
from tinker.proto import tinker_public_pb2 as pb

KEY = "tml-hostile-tenant-0001"
HEADERS = {"X-API-Key": KEY}
PROTO = {**HEADERS, "Content-Type": "application/x-protobuf"}
LIMIT = 1 << 20  # max_body_bytes in these tests


def _app(tmp_path: Path):
    return double_app(tmp_path, DoubleRuntime(), {KEY: "a"}, max_body_bytes=LIMIT)


async def _model(client: httpx.AsyncClient) -> str:
    session = (await client.post("/api/v1/create_session", json={}, headers=HEADERS)).json()["session_id"]
    body = {"session_id": session, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 1}}
    created = (await client.post("/api/v1/create_model", json=body, headers=HEADERS)).json()
    await client.post("/api/v1/retrieve_future", json={"request_id": created["request_id"]}, headers=HEADERS)
    return created["model_id"]


def _refused(response: httpx.Response, status: int, *words: str) -> None:
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    for word in words:
        assert word in detail, detail


# The nine routes a schema fuzzer made answer 500 on an empty id, and the others that take one.
EMPTY_ID_BODIES = {
    "get_info": {"model_id": ""},
    "load_weights": {"model_id": "", "path": "tinker://x/weights/y"},
    "optim_step": {"model_id": "", "adam_params": {"learning_rate": 1e-4}},
    "retrieve_future": {"request_id": ""},
    "save_weights": {"model_id": "", "path": "w"},
    "save_weights_for_sampler": {"model_id": "", "path": "s"},
    "session_heartbeat": {"session_id": ""},
    "unload_model": {"model_id": ""},
    "create_sampling_session": {"session_id": "", "sampling_session_seq_id": 0, "base_model": BASE},
    "create_model": {"session_id": "", "model_seq_id": 0, "base_model": BASE},
    "asample": {
        "sampling_session_id": "",
        "prompt": {"chunks": [{"tokens": [1]}]},
        "sampling_params": {"max_tokens": 1},
    },
}
MALFORMED_IDS = ["", " ", "a b", "x" * 300, "sess\x00", "../etc/passwd", "\u00e9t\u00e9", ":leading"]


@pytest.mark.parametrize("route", sorted(EMPTY_ID_BODIES))
async def test_malformed_ids_are_a_400_naming_the_field(tmp_path: Path, route: str) -> None:
    async with asgi_client(_app(tmp_path)) as client:
        body = EMPTY_ID_BODIES[route]
        field = next(k for k, v in body.items() if v == "")
        for bad in MALFORMED_IDS:
            response = await client.post(f"/api/v1/{route}", json={**body, field: bad}, headers=HEADERS)
            _refused(response, 400, field)


async def test_malformed_model_id_in_a_forward_backward_protobuf_is_a_400(tmp_path: Path) -> None:
    async with asgi_client(_app(tmp_path)) as client:
        for bad in ("", "a b", "x" * 300):
            body = pb.ForwardBackwardRequest(model_id=bad, seq_id=1, loss_fn="cross_entropy")
            response = await client.post(
                "/api/v1/forward_backward", content=body.SerializeToString(), headers=PROTO
            )
            _refused(response, 400, "model_id")


def _tensor(values: np.ndarray, dtype: int, shape: list[int] | None = None) -> pb.Tensor:
    return pb.Tensor(dense=values.tobytes(), dtype=dtype, shape=shape if shape is not None else [values.size])


def _request(model_id: str, inputs: dict[str, pb.Tensor], tokens: bytes | None = None) -> bytes:
    datum = pb.Datum()
    chunk = datum.model_input.add()
    chunk.encoded_text.tokens = tokens if tokens is not None else np.arange(4, dtype="<i4").tobytes()
    for name, tensor in inputs.items():
        datum.loss_fn_inputs[name].CopyFrom(tensor)
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    msg.data.append(datum)
    return msg.SerializeToString()


def _targets() -> pb.Tensor:
    return _tensor(np.arange(4, dtype="<i8"), pb.DTYPE_INT64)


def _malformed_bodies(model_id: str) -> dict[str, tuple[bytes, str]]:
    """name -> (body, a word the refusal must contain)."""
    valid = _request(model_id, {"target_tokens": _targets()})
    huge_csr = pb.Tensor(
        dtype=pb.DTYPE_FLOAT32,
        shape=[1, 1 << 40],  # a terabyte once dense
        sparse_csr=pb.SparseCsr(
            values=np.ones(1, "<f4").tobytes(),
            crow_indices=np.array([0, 1], "<i8").tobytes(),
            col_indices=np.array([0], "<i8").tobytes(),
        ),
    )
    # a length-delimited field (data = 3) that declares 2**62 bytes
    absurd_length = bytes([0x1A]) + bytes([0xFF] * 8 + [0x3F])
    return {
        "random bytes": (os.urandom(4096), "ForwardBackwardRequest"),
        "truncated": (valid[: len(valid) // 2], "ForwardBackwardRequest"),
        "absurd declared length": (absurd_length, "ForwardBackwardRequest"),
        "absurd declared shape (sparse)": (_request(model_id, {"weights": huge_csr}), "max_body_bytes"),
        "unknown dtype": (
            _request(model_id, {"target_tokens": pb.Tensor(dense=b"\0" * 8, dtype=77)}),
            "dtype",
        ),
        "mismatched shape": (
            _request(model_id, {"target_tokens": _tensor(np.arange(4, dtype="<i8"), pb.DTYPE_INT64, [3, 3])}),
            "shape",
        ),
        "negative shape": (
            _request(
                model_id, {"target_tokens": _tensor(np.arange(4, dtype="<i8"), pb.DTYPE_INT64, [-2, -2])}
            ),
            "negative",
        ),
        "ragged values": (
            _request(
                model_id, {"target_tokens": pb.Tensor(dense=b"\0" * 7, dtype=pb.DTYPE_INT64, shape=[1])}
            ),
            "whole number",
        ),
        "ragged tokens": (
            _request(model_id, {"target_tokens": _targets()}, tokens=b"\0" * 5),
            "whole number",
        ),
    }


async def test_malformed_forward_backward_protobufs_are_refused_with_a_json_4xx(tmp_path: Path) -> None:
    async with asgi_client(_app(tmp_path)) as client:
        model_id = await _model(client)
        for name, (body, word) in _malformed_bodies(model_id).items():
            response = await client.post("/api/v1/forward_backward", content=body, headers=PROTO)
            assert 400 <= response.status_code < 500, (name, response.status_code, response.text)
            if response.status_code == 404:  # random bytes can parse as a message naming another model
                continue
            assert word in response.json()["detail"], (name, response.json())
        # the model still trains: nothing above reached it
        good = _request(model_id, {"target_tokens": _targets()})
        response = await client.post("/api/v1/forward_backward", content=good, headers=PROTO)
        assert response.status_code == 200, response.text


def _bomb(decompressed: int) -> bytes:
    """A zstd frame of zeros that declares its (large) content size: kilobytes on the wire."""
    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=3).stream_writer(out, size=decompressed, closefd=False) as writer:
        zeros = b"\0" * (16 << 20)
        for _ in range(decompressed // len(zeros)):
            writer.write(zeros)
    return out.getvalue()


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def test_a_zstd_bomb_is_a_413_and_memory_stays_bounded(tmp_path: Path) -> None:
    bomb = _bomb(2 << 30)  # 2 GiB of zeros declared and compressed
    assert len(bomb) < LIMIT  # passes the body limit: only decompression can stop it
    async with asgi_client(_app(tmp_path)) as client:
        await _model(client)
        before = _peak_rss_mib()
        response = await client.post(
            "/api/v1/forward_backward", content=bomb, headers={**PROTO, "Content-Encoding": "zstd"}
        )
        grown = _peak_rss_mib() - before
    _refused(response, 413, f"decompresses to more than {LIMIT} bytes", "max_body_bytes")
    assert response.json()["type"] == "request_too_large"
    assert grown < 128, f"peak RSS grew {grown:.0f} MiB while refusing a 2 GiB bomb"


async def test_a_cut_short_zstd_body_is_a_400(tmp_path: Path) -> None:
    async with asgi_client(_app(tmp_path)) as client:
        model_id = await _model(client)
        packed = zstandard.ZstdCompressor().compress(_request(model_id, {"target_tokens": _targets()}))
        headers = {**PROTO, "Content-Encoding": "zstd"}
        response = await client.post("/api/v1/forward_backward", content=packed[:-3], headers=headers)
        _refused(response, 400, "cut short")
        response = await client.post("/api/v1/forward_backward", content=packed, headers=headers)
        assert response.status_code == 200, response.text


async def test_bodies_over_the_limit_are_a_413_before_auth_and_unread(tmp_path: Path) -> None:
    big = b"\0" * (LIMIT + 1)
    async with asgi_client(_app(tmp_path)) as client:
        for headers in (PROTO, {"Content-Type": "application/x-protobuf"}):  # with and without a key
            response = await client.post("/api/v1/forward_backward", content=big, headers=headers)
            _refused(response, 413, str(LIMIT), "max_body_bytes")
        # JSON routes and the OpenAI routes, in each API's error shape
        response = await client.post(
            "/api/v1/create_session", content=big, headers={**HEADERS, "Content-Type": "application/json"}
        )
        _refused(response, 413, "max_body_bytes")
        response = await client.post(
            "/v1/completions", content=big, headers={"Authorization": f"Bearer {KEY}"}
        )
        assert response.status_code == 413 and "max_body_bytes" in response.json()["error"]["message"]

        # chunked (no Content-Length): counted while read, refused past the limit
        async def chunks():
            for _ in range(LIMIT // 65536 + 2):
                yield b"\0" * 65536

        response = await client.post("/api/v1/forward_backward", content=chunks(), headers=PROTO)
        _refused(response, 413, "max_body_bytes")

        async def small():
            yield b'{"tags": []}'

        headers = {**HEADERS, "Content-Type": "application/json"}
        response = await client.post("/api/v1/create_session", content=small(), headers=headers)
        assert response.status_code == 200, response.text


BIG = 10**40  # a JSON integer beyond int64


async def test_integers_beyond_int64_are_a_400_naming_the_field(tmp_path: Path) -> None:
    async with asgi_client(_app(tmp_path)) as client:
        model_id = await _model(client)
        session = model_id.split(":", 1)[0]
        prompt = {"chunks": [{"tokens": [1, 2, 3]}]}
        cases = [
            (
                "create_model",
                {"session_id": session, "model_seq_id": BIG, "base_model": BASE},
                "model_seq_id",
            ),
            (
                "create_sampling_session",
                {"session_id": session, "sampling_session_seq_id": BIG, "base_model": BASE},
                "sampling_session_seq_id",
            ),
            ("save_weights", {"model_id": model_id, "path": "w", "ttl_seconds": BIG}, "ttl_seconds"),
            ("save_weights", {"model_id": model_id, "path": "w", "seq_id": BIG}, "seq_id"),
            ("optim_step", {"model_id": model_id, "seq_id": -BIG, "adam_params": {}}, "seq_id"),
            (
                "asample",
                {"base_model": BASE, "prompt": {"chunks": [{"tokens": [BIG]}]}, "sampling_params": {}},
                "tokens",
            ),
            (
                "asample",
                {"base_model": BASE, "prompt": prompt, "sampling_params": {"max_tokens": BIG}},
                "max_tokens",
            ),
            ("asample", {"base_model": BASE, "prompt": prompt, "sampling_params": {"seed": BIG}}, "seed"),
        ]
        for route, body, field in cases:
            # httpx's json= refuses nothing, but spell the body out: the integer must reach the server as is
            content = json.dumps(body)
            headers = {**HEADERS, "Content-Type": "application/json"}
            response = await client.post(f"/api/v1/{route}", content=content, headers=headers)
            _refused(response, 400, field)
        openai = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        for body, field in (({"prompt": [BIG]}, "prompt"), ({"prompt": "hi", "seed": BIG}, "seed")):
            content = json.dumps({"model": BASE, "max_tokens": 1, **body})
            response = await client.post("/v1/completions", content=content, headers=openai)
            assert response.status_code == 400 and field in response.json()["error"]["message"], response.text


async def test_hostile_target_prompt_logprobs_are_a_400_without_allocating(tmp_path: Path) -> None:
    base = {
        "base_model": BASE,
        "prompt": {"chunks": [{"tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 1},
    }
    tensors = {
        # a sparse matrix whose dense form would take 16 TiB
        "cells": {
            "dtype": "int64",
            "shape": [2, 1 << 40],
            "data": [1],
            "sparse_crow_indices": [0, 1, 1],
            "sparse_col_indices": [0],
        },
        "list of integers": {"dtype": "int64", "shape": [2, 1], "data": [BIG, 1]},
        "integer lists": {
            "dtype": "int64",
            "shape": [2, 1],
            "data": [1],
            "sparse_crow_indices": [0, BIG, 1],
            "sparse_col_indices": [0],
        },
    }
    async with asgi_client(_app(tmp_path)) as client:
        for word, tensor in tensors.items():
            content = json.dumps({**base, "target_prompt_logprobs": tensor})
            headers = {**HEADERS, "Content-Type": "application/json"}
            response = await client.post("/api/v1/asample", content=content, headers=headers)
            _refused(response, 400, "target_prompt_logprobs", word)
