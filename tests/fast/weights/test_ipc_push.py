"""The driver's side of the colocated push (miles.weights.ipc_push.push_over_ipc) on the real
InferenceController and cell state machine, the engines' HTTP and the trainer faked: each engine gets its
rank's payloads in their formats, and a trainer that copied its buckets frees them before any engine takes
its KV cache back (that memory is the KV cache's)."""

from __future__ import annotations

from typing import Any

import pytest

from miles.engines.config import EngineConfig
from miles.observability.metrics import job_metrics
from miles.rollout.cell_state import CellState
from miles.rollout.controller import InferenceController
from miles.rollout.engine_cell import EngineCell
from miles.rollout.health import HealthCheckConfig
from miles.train.errors import TrainerUnavailableError
from miles.weights.ipc_push import push_over_ipc
from miles.weights.ipc_sender import ReleaseSharedWeights, SharedBuckets, ShareWeightBuckets
from miles.weights.push import PushConfig, PushReport

FLAT = "flattened_bucket"
RANK_SECONDS = [{"plan": 0.001, "pack": 0.004}, {"plan": 0.003, "pack": 0.002, "handles": 0.005}]


class WeightClient:
    def __init__(self, log: list[str], name: str) -> None:
        self.base_url = f"http://{name}"
        self.log, self.name = log, name

    async def health(self, timeout_s: float | None = None) -> bool:
        return True

    async def alive(self, timeout_s: float | None = None) -> bool:
        return True

    async def begin_weight_update(self) -> None:
        self.log.append(f"{self.name} begin")

    async def update_weights_from_tensor(self, payloads: list[str], **fields: Any) -> None:
        self.log.append(f"{self.name} load {payloads[0]} {fields['load_format']} v{fields['weight_version']}")

    async def end_weight_update(self) -> None:
        self.log.append(f"{self.name} end")


class Cell(EngineCell):
    def __init__(self, index: int, config: EngineConfig, log: list[str]) -> None:
        super().__init__(index, config)
        self.log = log

    async def start(self) -> None:
        self.transition(CellState.STARTING)
        self.client = WeightClient(self.log, f"e{self.index}")  # type: ignore[assignment]
        self.transition(CellState.PENDING_WEIGHTS)

    async def stop(self) -> None:
        self.transition(CellState.STOPPED)


class Trainer:
    """Two ranks; rank 1 could not copy its second bucket (short of memory): handles for that one."""

    def __init__(self, log: list[str], forms: list[list[str | None]]) -> None:
        self.log, self.forms = log, forms
        self.to_device: list[bool] = []

    async def run_all(self, command: Any) -> list[Any]:
        self.log.append(f"trainer {command.name}")
        if isinstance(command, ShareWeightBuckets):
            assert command.flattened
            return [
                SharedBuckets([f"r{rank}b{i}" for i in range(2)], [1, 1], [8, 8], None, forms, seconds)
                for rank, (forms, seconds) in enumerate(zip(self.forms, RANK_SECONDS, strict=False))
            ]
        assert isinstance(command, ReleaseSharedWeights)
        self.to_device.append(command.to_device)
        return [0] * len(self.forms)


@pytest.fixture
async def engines(tmp_path):
    log: list[str] = []
    config = EngineConfig(model_path=str(tmp_path))
    health = HealthCheckConfig(interval_s=60, timeout_s=0.5, failure_threshold=2)
    inference = InferenceController([Cell(i, config, log) for i in range(2)], health=health)
    await inference.start()
    yield inference, log
    await inference.stop()


async def _push(
    inference: InferenceController, trainer: Trainer, log: list[str], **config: Any
) -> PushReport:
    async def resume_kv(cell: Any) -> None:
        log.append(f"{cell.client.name} resume kv_cache")

    report = await push_over_ipc(inference, trainer, PushConfig(**config), then=resume_kv)  # type: ignore[arg-type]
    assert report.engines == 2 and report.buckets == 2
    assert [cell.state for cell in inference.cells] == [CellState.READY] * 2
    return report


@pytest.mark.parametrize("to_device", [False, True])
async def test_copied_buckets_are_freed_before_any_engine_resumes_its_kv_cache(
    engines, to_device: bool
) -> None:
    inference, log = engines
    trainer = Trainer(log, [[FLAT, FLAT], [FLAT, None]])
    await _push(inference, trainer, log, ipc_copies_to_device=to_device)
    assert trainer.to_device == [to_device]
    loads = sorted(line for line in log if " load " in line)
    assert loads == ["e0 load r0b0 flattened_bucket v1", "e0 load r0b1 flattened_bucket v1",
                     "e1 load r1b0 flattened_bucket v1", "e1 load r1b1 None v1"]  # fmt: skip
    freed = log.index("trainer release_shared_weights")
    assert all(freed < log.index(f"e{i} resume kv_cache") for i in (0, 1))
    assert all(log.index(f"e{i} end") < log.index(f"e{i} resume kv_cache") for i in (0, 1))


async def test_handles_to_the_weights_cost_no_extra_trainer_call(engines) -> None:
    inference, log = engines
    await _push(inference, Trainer(log, [[None, None], [None, None]]), log)
    assert [line for line in log if line.startswith("trainer")] == ["trainer share_weight_buckets"]


async def test_the_push_reports_the_slowest_ranks_share_steps(engines) -> None:
    inference, log = engines
    sample = job_metrics().registry.get_sample_value
    before = sample("miles_push_seconds_sum", {"kind": "ipc"}) or 0.0
    report = await _push(inference, Trainer(log, [[FLAT, FLAT], [FLAT, FLAT]]), log)
    trainer_steps = {name: s for name, s in report.steps.items() if name.startswith("trainer_")}
    assert trainer_steps == {"trainer_handles": 0.005, "trainer_pack": 0.004, "trainer_plan": 0.003}
    # the push's time is its three phases; describe, quiesce and the ranks' parts lie inside them
    observed = sample("miles_push_seconds_sum", {"kind": "ipc"}) - before
    assert observed == pytest.approx(sum(report.steps[s] for s in ("prepare", "buckets", "release")))
    assert observed < sum(report.steps.values())


async def test_a_dead_trainer_fails_the_push_and_no_engine_serves_half_updated(engines) -> None:
    """A colocated preset without an offload asks the trainer nothing before the push: a dead trainer is
    met here, at the share, and the switch to sampling fails with its problem."""
    inference, log = engines

    class DeadTrainer:
        async def run_all(self, command: Any) -> list[Any]:
            log.append(f"trainer {command.name}")
            raise TrainerUnavailableError(command.name, "trainer rank 0 died (SIGKILL)")

    with pytest.raises(TrainerUnavailableError, match="died"):
        await push_over_ipc(inference, DeadTrainer(), PushConfig())  # type: ignore[arg-type]
    assert inference.ready_cells() == [] and not inference.update_in_progress
    assert {"e0 end", "e1 end"} <= set(log)  # each engine's update session closed
    assert not [line for line in log if " load " in line]
