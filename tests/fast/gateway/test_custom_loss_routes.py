"""create_custom_loss over raw HTTP (the SDK's request shape): advertised in /client/config, refused with a
JSON 400 that names the operation, idempotent per (session, custom_loss_seq_id), owned by its session."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch.nn.functional as F
from runtime_double import DoubleRuntime, asgi_client, double_app
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

OWNER, STRANGER = "tml-owner-key-00001", "tml-stranger-key-01"


def _loss(logprobs, advantages):
    loss = -(F.softplus(logprobs) * advantages).sum()
    return loss, {"custom/loss:sum": loss.detach()}


def _body(session_id: str, seq: int, fn=_loss) -> dict[str, Any]:
    handle = trace_loss(fn, {"logprobs": 1, "advantages": 1}, session_id)
    return {
        "session_id": session_id,
        "custom_loss_seq_id": seq,
        "name": handle.name,
        "inputs": [item.model_dump() for item in handle.inputs],
        "graph": encode_graph(handle).model_dump(),
        "type": "create_custom_loss",
    }


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    app = double_app(tmp_path, DoubleRuntime(), {OWNER: "owner", STRANGER: "stranger"}, long_poll_s=0.2)
    async with asgi_client(app) as client:
        yield client


async def _post(
    client: httpx.AsyncClient, route: str, body: dict[str, Any], key: str = OWNER
) -> httpx.Response:
    return await client.post(f"/api/v1/{route}", json=body, headers={"X-API-Key": key})


async def _session(client: httpx.AsyncClient, key: str = OWNER) -> str:
    return (await _post(client, "create_session", {}, key)).json()["session_id"]


async def test_client_config_advertises_server_side_losses_as_the_settings_say(tmp_path: Path) -> None:
    for setting in (True, False):
        app = double_app(tmp_path, DoubleRuntime(), {OWNER: "owner"}, custom_loss_server_side=setting)
        async with asgi_client(app) as client:
            config = (await _post(client, "client/config", {})).json()
        assert config["custom_loss_server_side"] is setting


async def test_a_loss_is_stored_once_per_seq_id_and_answered_with_its_loss_id(client) -> None:
    sid = await _session(client)
    first = await _post(client, "create_custom_loss", _body(sid, 0))
    again = await _post(client, "create_custom_loss", _body(sid, 0))  # the SDK's retry
    assert first.status_code == again.status_code == 200
    assert first.json()["request_id"] == again.json()["request_id"]
    result = await _post(client, "retrieve_future", {"request_id": first.json()["request_id"]})
    assert result.json() == {"loss_id": f"{sid}:loss:0", "type": "create_custom_loss"}

    def other(logprobs, advantages):
        return (logprobs * advantages).sum(), {}

    clash = await _post(client, "create_custom_loss", _body(sid, 0, other))
    assert clash.status_code == 400 and "already names another loss" in clash.json()["detail"]


async def test_refusals_are_json_400s_that_name_what_to_fix(client) -> None:
    sid = await _session(client)
    body = _body(sid, 0)
    body["graph"]["nodes"][2]["target"] = "builtins.eval"
    refused = await _post(client, "create_custom_loss", body)
    assert refused.status_code == 400
    assert "calls 'builtins.eval', which is not on this server's allow-list" in refused.json()["detail"]
    nested = _body(sid, 1)
    nested["graph"]["nodes"][2]["args"].append({"pickle": "gASV..."})
    refused = await _post(client, "create_custom_loss", nested)
    assert refused.status_code == 400 and "unknown argument encoding 'pickle'" in refused.json()["detail"]
    assert (await _post(client, "create_custom_loss", _body(sid, 2))).status_code == 200


async def test_only_the_sessions_owner_stores_a_loss_in_it(client) -> None:
    sid = await _session(client)
    stranger = await _post(client, "create_custom_loss", _body(sid, 0), key=STRANGER)
    assert stranger.status_code == 404
    await _post(client, f"sessions/{sid}/finish", {})
    ended = await _post(client, "create_custom_loss", _body(sid, 0))
    assert ended.status_code == 410
