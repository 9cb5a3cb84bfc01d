"""The service layer through the app: sampling limits on both APIs, model records on failed creates,
and error categories that survive the trip from a trainer (through Ray) to the client."""

from __future__ import annotations

import asyncio
import traceback
from pathlib import Path

import httpx
import pytest
from ray.exceptions import RayTaskError
from runtime_double import BASE, DoubleRuntime, asgi_client, double_app

from miles.errors import Category, NotFoundError, UserError
from miles.gateway.errors import HTTP_STATUS, describe_failure
from miles.train.errors import RemoteCommandError, TrainerUnavailableError

KEY = "tml-services-key-01"


class CountingRuntime(DoubleRuntime):
    """Counts how many samples run at once; can fail creates and training with chosen errors."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.running = 0
        self.most_running = 0
        self.create_error: BaseException | None = None
        self.train_error: BaseException | None = None

    async def sample(self, *args, **kwargs):
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            return await super().sample(*args, **kwargs)
        finally:
            self.running -= 1

    async def create_model(self, model_id, base_model, lora) -> None:
        if self.create_error is not None:
            raise self.create_error
        await super().create_model(model_id, base_model, lora)

    async def optim_step(self, request):
        if self.train_error is not None:
            raise self.train_error
        return await super().optim_step(request)


@pytest.fixture
async def env(tmp_path: Path, tiny_model_dir: Path):
    runtime = CountingRuntime(tokenizer_path=str(tiny_model_dir))
    settings = {"long_poll_s": 0.3, "openai_sample_timeout_s": 30, "max_concurrent_samples": 1}
    async with asgi_client(double_app(tmp_path, runtime, {KEY: "alpha"}, **settings), timeout=30) as client:
        yield client, runtime


async def _result(client: httpx.AsyncClient, request_id: str) -> dict:
    for _ in range(200):
        r = await client.post(
            "/api/v1/retrieve_future", json={"request_id": request_id}, headers={"X-API-Key": KEY}
        )
        body = r.json()
        if body.get("type") != "try_again":
            return body
    raise AssertionError("future never resolved")


async def _session(client: httpx.AsyncClient) -> str:
    r = await client.post("/api/v1/create_session", json={}, headers={"X-API-Key": KEY})
    return r.json()["session_id"]


async def test_openai_completions_wait_for_the_sample_slots(env) -> None:
    client, runtime = env
    runtime.sample_delay_s = 0.2
    bearer = {"Authorization": f"Bearer {KEY}"}
    body = {"model": BASE, "prompt": "hello", "max_tokens": 2}
    answers = await asyncio.gather(
        *(client.post("/v1/completions", json=body, headers=bearer) for _ in range(3))
    )
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert runtime.most_running == 1, "max_concurrent_samples=1 must hold for OpenAI requests too"


async def test_openai_prompt_longer_than_the_context_is_a_400(env) -> None:
    client, runtime = env
    bearer = {"Authorization": f"Bearer {KEY}"}
    r = await client.post("/v1/completions", json={"model": BASE, "prompt": list(range(600))}, headers=bearer)
    assert r.status_code == 400 and "fewer than 512" in r.json()["error"]["message"]
    assert runtime.most_running == 0


async def test_a_failed_create_leaves_no_model_record(env) -> None:
    client, runtime = env
    sid = await _session(client)
    runtime.create_error = UserError("LoRA rank 4096 is above this job's cap")
    r = await client.post(
        "/api/v1/create_model",
        json={"session_id": sid, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 4096}},
        headers={"X-API-Key": KEY},
    )
    model_id = r.json()["model_id"]
    failed = await _result(client, r.json()["request_id"])
    assert failed == {"error": "LoRA rank 4096 is above this job's cap", "category": "user"}
    gone = await client.get(f"/api/v1/training_runs/{model_id}", headers={"X-API-Key": KEY})
    assert gone.status_code == 404
    runs = await client.get("/api/v1/training_runs", headers={"X-API-Key": KEY})
    assert runs.json()["training_runs"] == []


def _through_ray(cause: Exception) -> RayTaskError:
    try:
        raise cause
    except Exception as exc:
        return RayTaskError("optim_step", traceback.format_exc(), exc)


@pytest.mark.parametrize(
    ("error", "category"),
    [
        (RemoteCommandError.from_exception("optim_step", _through_ray(UserError("bad adam_params"))), "user"),
        (RemoteCommandError.from_exception("optim_step", _through_ray(OSError(28, "No space"))), "server"),
        (TrainerUnavailableError("optim_step", "no trainer cell is alive"), "server"),
    ],
)
async def test_trainer_errors_reach_the_client_with_their_category(env, error, category) -> None:
    client, runtime = env
    sid = await _session(client)
    r = await client.post(
        "/api/v1/create_model",
        json={"session_id": sid, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 4}},
        headers={"X-API-Key": KEY},
    )
    model_id = r.json()["model_id"]
    await _result(client, r.json()["request_id"])
    runtime.train_error = error
    r = await client.post(
        "/api/v1/optim_step",
        json={"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 0.1}},
        headers={"X-API-Key": KEY},
    )
    failed = await _result(client, r.json()["request_id"])
    assert failed["category"] == category
    assert failed["error"].startswith(error.cause_type + ": ")


def test_categories_map_to_status_codes_in_one_table() -> None:
    assert set(HTTP_STATUS) == set(Category)
    user = RemoteCommandError.from_exception("m", _through_ray(UserError("bad")))
    assert describe_failure(user) == ("UserError: bad", Category.USER) and HTTP_STATUS[user.category] == 400
    assert describe_failure(_through_ray(NotFoundError("no such adapter"))) == (
        "no such adapter",
        Category.NOT_FOUND,
    )
    assert describe_failure(_through_ray(RuntimeError("boom\ntrace"))) == (
        "RuntimeError: boom",
        Category.SERVER,
    )
    assert HTTP_STATUS[TrainerUnavailableError("m", "none alive").category] == 503
