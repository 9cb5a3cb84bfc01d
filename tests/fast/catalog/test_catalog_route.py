"""GET /api/v1/catalog over a runtime whose create_model goes through a real CatalogController, and how a
capacity refusal reaches the client (the whole text, the JSON details, no SDK retry)."""

from __future__ import annotations

from pathlib import Path

import httpx

from miles.catalog.controller import CatalogController
from miles.catalog.errors import CapacityError
from miles.contract.catalog import PoolNode
from miles.types import LoraSpec
from tests.fast.catalog.memory_backend import Clock, MemoryBackend, catalog_model
from tests.fast.gateway.runtime_double import BASE, DoubleRuntime, asgi_client, double_app

KEY = "tml-catalog-key-0001"


class CatalogDouble(DoubleRuntime):
    """The gateway's runtime double, with handles placed by a real controller (one LoRA slot, 2 GPUs)."""

    def __init__(self) -> None:
        super().__init__()
        backend = MemoryBackend([PoolNode("10.0.0.1", 2, is_head=True)])
        self.controller = CatalogController([catalog_model(BASE, lora_slots=1)], backend, clock=Clock())

    async def create_model(self, model_id: str, base_model: str, lora: LoraSpec | None) -> None:
        await self.controller.acquire(model_id, base_model, "lora" if lora else "full", lora)
        await super().create_model(model_id, base_model, lora)

    def catalog(self) -> dict:
        return self.controller.snapshot()


async def create_model(client: httpx.AsyncClient, seq: int) -> dict:
    headers = {"X-API-Key": KEY}
    sid = (await client.post("/api/v1/create_session", json={"tags": []}, headers=headers)).json()[
        "session_id"
    ]
    body = {"session_id": sid, "model_seq_id": seq, "base_model": BASE, "lora_config": {"rank": 4}}
    request_id = (await client.post("/api/v1/create_model", json=body, headers=headers)).json()["request_id"]
    for _ in range(100):
        answer = await client.post(
            "/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers
        )
        if answer.json().get("type") != "try_again":
            return answer.json()
    raise AssertionError("create_model never finished")


async def test_the_catalog_route_needs_a_key_and_shows_the_controller_snapshot(tmp_path: Path) -> None:
    runtime = CatalogDouble()
    async with asgi_client(double_app(tmp_path, runtime, {KEY: "alpha"}, long_poll_s=0.2)) as client:
        refused = await client.get("/api/v1/catalog")
        assert refused.status_code == 401 and "API key" in refused.json()["detail"]
        assert (await client.get("/api/v1/catalog", headers={"X-API-Key": "wrong"})).status_code == 401
        model_id = (await create_model(client, 0))["model_id"]
        shown = await client.get("/api/v1/catalog", headers={"X-API-Key": KEY})
        assert shown.status_code == 200
        (model,) = shown.json()["models"]
        (instance,) = model["instances"]
        assert [t["model_id"] for t in instance["tenants"]] == [model_id]
        assert shown.json()["pool"]["free_gpus"] == 0
        bearer = await client.get("/api/v1/catalog", headers={"Authorization": f"Bearer {KEY}"})
        assert bearer.json() == runtime.catalog()


async def test_a_runtime_without_a_catalog_shows_its_models_as_resident(tmp_path: Path) -> None:
    async with asgi_client(double_app(tmp_path, DoubleRuntime(), {KEY: "alpha"})) as client:
        shown = (await client.get("/api/v1/catalog", headers={"X-API-Key": KEY})).json()
    assert shown["pool"] is None
    assert [(m["name"], m["resident"], m["instances"]) for m in shown["models"]] == [(BASE, True, [])]


async def test_a_capacity_refusal_reaches_the_client_naming_model_and_free_gpus(tmp_path: Path) -> None:
    runtime = CatalogDouble()
    async with asgi_client(double_app(tmp_path, runtime, {KEY: "alpha"}, long_poll_s=0.2)) as client:
        assert "model_id" in await create_model(client, 0)
        refused = await create_model(client, 1)
    assert f"no capacity for model '{BASE}' (lora)" in refused["error"]
    assert "free GPUs by node: 10.0.0.1: 0" in refused["error"]


async def test_a_capacity_error_answered_by_a_route_is_409_with_details_and_no_retry(tmp_path: Path) -> None:
    app = double_app(tmp_path, DoubleRuntime(), {KEY: "alpha"})

    @app.get("/api/v1/refuse_for_test")
    async def refuse() -> None:
        raise CapacityError("tiny-a", "full", 2, {"10.0.0.1": 1})

    async with asgi_client(app) as client:
        answer = await client.get("/api/v1/refuse_for_test")
    assert answer.status_code == 409 and answer.headers["x-should-retry"] == "false"
    body = answer.json()
    assert body["type"] == "capacity_error" and "needs 2 GPU(s) on one node" in body["detail"]
    assert body["details"] == {
        "model": "tiny-a",
        "train_mode": "full",
        "asked": {"gpus_on_one_node": 2},
        "free": {"10.0.0.1": 1},
    }


def test_the_tinker_sdk_honours_the_no_retry_header() -> None:
    """The SDK retries a 409 unless told not to: the header this gateway sends on capacity errors."""
    from tinker._base_client import BaseClient

    response = httpx.Response(409, headers={"x-should-retry": "false"})
    assert BaseClient._should_retry(object.__new__(BaseClient), response) is False
    assert BaseClient._should_retry(object.__new__(BaseClient), httpx.Response(409)) is True
