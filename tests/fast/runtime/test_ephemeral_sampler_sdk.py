"""Unnamed sampler saves of a full fine-tuning job are ephemeral (docs/gateway.md, "Sampling clients"):
the real tinker SDK against the real gateway over a RayRuntime whose trainer and engine are fakes (those of
test_ray_runtime_rules; the full-weight push is a recorder). save_weights_and_get_sampling_client writes no
files and makes no checkpoint, its client samples until a later save, then is refused as stale; its id
cannot be opened by path; a named save is written, listed and opens by path as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

from miles.runtime import ray_runtime
from miles.runtime.ray_runtime import RayRuntime
from miles.train import write_behind
from miles.train.commands import StageHfWeights, TrainerCommand
from miles.weights.push import PushReport
from tests.fast.local_gateway import local_gateway
from tests.fast.runtime.test_ray_runtime_rules import BASE, OneEngine, OneEngineInference, card

KEY = "tml-ephemeral-sampler-0001"
PROMPT = types.ModelInput.from_ints([1, 2, 3])
PARAMS = types.SamplingParams(max_tokens=1)


class ExportingTrainer:
    """Records commands; a full-weight snapshot writes a stand-in HF directory, behind its answer as the
    transformers backend does (the file, then the marker the gateway waits for)."""

    def __init__(self) -> None:
        self.commands: list[TrainerCommand[Any]] = []

    async def run(self, command: TrainerCommand[Any]) -> Any:
        self.commands.append(command)
        if isinstance(command, StageHfWeights):
            (command.path / "model.safetensors").write_bytes(b"weights")
            write_behind.written_marker(command.path).write_text("0")
            return True
        return None

    def health_problem(self) -> str | None:
        return None

    async def stop(self) -> None:
        pass


class Served:
    def __init__(self, url: str, trainer: ExportingTrainer, engine: OneEngine, ckpt: Path) -> None:
        self.url, self.trainer, self.engine, self.ckpt = url, trainer, engine, ckpt
        self.pushes: list[Any] = []

    def files(self) -> list[Path]:
        return sorted(p for p in self.ckpt.rglob("*") if p.is_file())

    def exports(self) -> int:
        return sum(isinstance(c, StageHfWeights) for c in self.trainer.commands)


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    trainer, engine = ExportingTrainer(), OneEngine()
    runtime = RayRuntime(card("full"), trainer, OneEngineInference(engine))  # type: ignore[arg-type]
    pushes: list[Any] = []

    async def push_full_weights(inference: Any, trainer: Any, config: Any) -> PushReport:
        pushes.append(trainer)
        return PushReport(version=len(pushes), buckets=0, bytes=0, engines=1)

    monkeypatch.setattr(ray_runtime, "push_full_weights", push_full_weights)
    ckpt = tmp_path / "ckpt"
    with local_gateway(runtime, ckpt, KEY) as url:
        out = Served(url, trainer, engine, ckpt)
        out.pushes = pushes
        yield out


def _sample(sampler: tinker.SamplingClient) -> list[int]:
    return list(sampler.sample(PROMPT, 1, PARAMS).result().sequences[0].tokens)


def test_an_unnamed_save_writes_nothing_samples_and_goes_stale_after_the_next_save(served: Served) -> None:
    service = tinker.ServiceClient(base_url=served.url, api_key=KEY)
    tc = service.create_lora_training_client(base_model=BASE, rank=0).result()
    rest = tinker.RestClient(base_url=served.url, api_key=KEY)

    first = tc.save_weights_and_get_sampling_client().result()
    assert served.files() == [] and served.exports() == 0  # no snapshot written, not even staged
    assert len(served.pushes) == 1  # the push is the snapshot
    assert rest.list_checkpoints(tc.model_id).result().checkpoints == []
    assert _sample(first) == [7]
    headers = {"X-API-Key": KEY}
    sampler = httpx.get(f"{served.url}/api/v1/samplers/{first._sampling_session_id}", headers=headers).json()
    assert sampler["base_model"] == BASE and sampler.get("model_path") is None

    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert _sample(first) == [7]  # nothing pushed since its save: the engines still hold its weights
    second = tc.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.RequestFailedError, match=r"sampler_weights/ephemeral:\d+ is stale") as stale:
        _sample(first)
    assert stale.value.category.value == "user"
    assert _sample(second) == [7]
    assert served.files() == [] and rest.list_checkpoints(tc.model_id).result().checkpoints == []

    # its id names no checkpoint: opening it by path is a clean 404 that says what to do instead
    ephemeral = f"tinker://{tc.model_id}/sampler_weights/ephemeral:0"
    with pytest.raises(tinker.NotFoundError, match="not saved to disk") as refused:
        service.create_sampling_client(model_path=ephemeral).result()
    assert "save_weights_for_sampler(name)" in str(refused.value)
    body = {"session_id": tc.model_id.split(":")[0], "sampling_session_seq_id": 99, "model_path": ephemeral}
    r = httpx.post(f"{served.url}/api/v1/create_sampling_session", json=body, headers=headers)
    assert r.status_code == 404 and "unnamed save" in r.json()["detail"]

    # a named save is written, listed and opens by path as before
    path = tc.save_weights_for_sampler("kept").result().path
    assert path == f"tinker://{tc.model_id}/sampler_weights/kept"
    assert served.exports() == 1 and "model.safetensors" in [p.name for p in served.files()]
    listed = [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
    assert listed == ["sampler_weights/kept"]
    with pytest.raises(tinker.RequestFailedError, match="is stale"):
        _sample(second)
    assert _sample(service.create_sampling_client(model_path=path).result()) == [7]


def test_an_unnamed_inflight_save_is_ephemeral_and_its_clients_follow_the_latest(served: Served) -> None:
    service = tinker.ServiceClient(base_url=served.url, api_key=KEY)
    tc = service.create_lora_training_client(base_model=BASE, rank=0).result()
    first = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    assert _sample(first) == [7]
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    tc.save_weights_and_get_sampling_client(kind="inflight").result()
    assert _sample(first) == [7]  # follows the newer inflight save, never stale
    assert served.files() == [] and served.exports() == 0
