"""SGLangApiClient against real uvicorn servers on loopback: retries, errors, payload shapes."""

from __future__ import annotations

import json
import socket
from collections import Counter
from typing import Any

import httpx
import pytest
import torch

from miles.engines.errors import EngineError, EngineRefused, EngineUnauthorized
from miles.engines.sglang_client import SGLangApiClient, dtype_name
from miles.utils.http import close_clients
from miles.utils.serving import ServerThread

OK = {"success": True, "message": "ok"}


class ScriptedEngine:
    """An ASGI app that answers per path from a script; a path in `reset_once` has its first response cut."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.bodies: dict[str, list[Any]] = {}
        self.headers: list[dict[str, str]] = []
        self.reset_once: set[str] = set()
        self.reset_always: set[str] = set()
        self.answers: dict[str, tuple[int, Any]] = {}

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        self.calls[path] += 1
        self.bodies.setdefault(path, []).append(json.loads(body) if body else None)
        self.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        cut = path in self.reset_always or (path in self.reset_once and self.calls[path] == 1)
        status, answer = self.answers.get(path, (200, OK))
        raw = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        if cut:
            # Headers promised a body; dying now makes uvicorn drop the connection mid-response, which the
            # client sees exactly like a connection reset under it (httpx.RemoteProtocolError).
            raise RuntimeError("simulated connection reset")
        await send({"type": "http.response.body", "body": raw})


@pytest.fixture(scope="module")
def scripted():
    app = ScriptedEngine()
    with ServerThread(app, timeout_keep_alive=5) as srv:
        yield app, srv


@pytest.fixture
async def engine(scripted):
    app, srv = scripted
    app.reset()
    yield app, SGLangApiClient(srv.url)
    await close_clients()


def _free_unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_reset_during_pause_is_retried_once_and_succeeds(engine) -> None:
    app, client = engine
    app.reset_once = {"/pause_generation", "/continue_generation", "/update_weight_version"}
    assert (await client.pause_generation("retract"))["success"] is True
    await client.continue_generation()
    await client.update_weight_version("7", abort_all_requests=False)
    assert app.calls["/pause_generation"] == 2
    assert app.calls["/continue_generation"] == 2
    assert app.calls["/update_weight_version"] == 2
    assert app.bodies["/pause_generation"] == [{"mode": "retract"}] * 2


async def test_a_second_reset_is_not_retried_again(engine) -> None:
    app, client = engine
    app.reset_always = {"/pause_generation"}
    with pytest.raises(httpx.RemoteProtocolError):
        await client.pause_generation()
    assert app.calls["/pause_generation"] == 2


@pytest.mark.parametrize(
    ("path", "call"),
    [
        (
            "/update_weights_from_distributed",
            lambda c: c.update_weights_from_distributed(names=["w"], dtypes=["float32"], shapes=[[2]]),
        ),
        (
            "/init_weights_update_group",
            lambda c: c.init_weights_update_group(
                master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2, backend="gloo"
            ),
        ),
        ("/update_weight_version", lambda c: c.update_weight_version("3")),
        ("/begin_weight_update", lambda c: c.begin_weight_update()),
        ("/load_lora_adapter", lambda c: c.load_lora_adapter("a", "/p")),
        ("/generate", lambda c: c.generate(input_ids=[1], sampling_params={})),
    ],
)
async def test_reset_on_non_idempotent_calls_is_raised_not_retried(engine, path, call) -> None:
    app, client = engine
    app.reset_once = {path}
    with pytest.raises(httpx.RemoteProtocolError) as info:
        await call(client)
    assert app.calls[path] == 1
    assert any(path in note for note in info.value.__notes__)


async def test_refused_connection_is_not_retried(monkeypatch) -> None:
    client = SGLangApiClient(f"http://127.0.0.1:{_free_unused_port()}")
    sends = Counter()
    original = SGLangApiClient._send_once

    async def counting(self, *args):
        sends["n"] += 1
        return await original(self, *args)

    monkeypatch.setattr(SGLangApiClient, "_send_once", counting)
    with pytest.raises(httpx.ConnectError):
        await client.pause_generation()
    assert sends["n"] == 1
    assert await client.health() is False
    await close_clients()


async def test_error_statuses_raise_with_the_engine_answer_and_are_not_retried(engine) -> None:
    app, client = engine
    app.answers["/pause_generation"] = (500, b"Internal Server Error")
    with pytest.raises(EngineError) as info:
        await client.pause_generation()
    assert info.value.status_code == 500 and info.value.body == "Internal Server Error"
    assert app.calls["/pause_generation"] == 1

    refusal = {"success": False, "message": "must run between begin_weight_update() and end_weight_update()"}
    app.answers["/update_weights_from_distributed"] = (400, refusal)
    with pytest.raises(EngineRefused, match="must run between") as refused:
        await client.update_weights_from_distributed(names=["w"], dtypes=["float32"], shapes=[[1]])
    assert refused.value.body == refusal
    assert any("must run between" in note for note in refused.value.__notes__)

    app.answers["/load_lora_adapter"] = (200, {"success": False, "error_message": "no such dir"})
    with pytest.raises(EngineRefused, match="no such dir"):
        await client.load_lora_adapter("a", "/nope")

    app.answers["/flush_cache"] = (400, b"Cache not flushed: 2 requests running")
    with pytest.raises(EngineRefused, match="requests running"):
        await client.flush_cache()

    app.answers["/model_info"] = (401, {"error": "Unauthorized"})
    with pytest.raises(EngineUnauthorized):
        await client.model_info()


async def test_payloads_match_sglang(engine, scripted) -> None:
    app, client = engine
    await client.update_weights_from_distributed(
        names=["a", "b"],
        dtypes=[torch.bfloat16, "torch.float32"],
        shapes=[(2, 3), [4]],
        weight_version="5",
        load_format="flattened_bucket",
    )
    sent = app.bodies["/update_weights_from_distributed"][0]
    assert sent == {
        "names": ["a", "b"],
        "dtypes": ["bfloat16", "float32"],
        "shapes": [[2, 3], [4]],
        "group_name": "weight_update_group",
        "flush_cache": False,
        "weight_version": "5",
        "load_format": "flattened_bucket",
    }
    await client.update_weight_version("9")
    assert app.bodies["/update_weight_version"][0] == {"new_version": "9", "abort_all_requests": True}
    await client.generate(
        input_ids=[1, 2], sampling_params={"max_new_tokens": 3}, return_logprob=True, rid="r"
    )
    assert app.bodies["/generate"][0] == {
        "input_ids": [1, 2],
        "sampling_params": {"max_new_tokens": 3},
        "return_logprob": True,
        "rid": "r",
    }
    with pytest.raises(ValueError, match="equal lengths"):
        await client.update_weights_from_distributed(names=["a"], dtypes=[], shapes=[[1]])

    keyed = SGLangApiClient(scripted[1].url, api_key="sekret")
    await keyed.continue_generation()
    assert app.headers[-1]["authorization"] == "Bearer sekret"


async def test_legacy_dialect_skips_session_calls(engine, scripted) -> None:
    app, _ = engine
    legacy = SGLangApiClient(scripted[1].url, weight_api="legacy")
    assert await legacy.begin_weight_update() is None
    assert await legacy.end_weight_update() is None
    assert app.calls["/begin_weight_update"] == app.calls["/end_weight_update"] == 0
    current = SGLangApiClient(scripted[1].url)
    await current.begin_weight_update()
    await current.end_weight_update()
    assert app.calls["/begin_weight_update"] == app.calls["/end_weight_update"] == 1


async def test_health_reflects_status(engine) -> None:
    app, client = engine
    assert await client.health() is True
    app.answers["/health"] = (503, b"")
    assert await client.health() is False


def test_dtype_names_and_bad_arguments() -> None:
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_name("torch.float16") == "float16"
    with pytest.raises(ValueError, match="not a torch dtype"):
        dtype_name("bf16")
    with pytest.raises(ValueError, match="weight_api"):
        SGLangApiClient("http://x", weight_api="new")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="base_url"):
        SGLangApiClient("localhost:30000")
