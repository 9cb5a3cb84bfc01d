"""Hybrid lanes on real Ray actors over real gloo groups: the optimizer trajectory never depends on who
computed a batch. Each lane is a HybridLane actor with its own copy of a tiny model; the reference is one
TransformersBackend in this process trained on the same data. The tests run in file order on one trainer
(later ones change its membership on purpose)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray

from miles.train.backends.transformers_backend import TransformersBackend
from miles.train.commands import ForwardBackward, OptimStep, Reset
from miles.train.hybrid.coordinator import HybridTrainer, JoinFailed, Lane, MembershipError
from miles.train.hybrid.core_lane import core_lane
from miles.train.hybrid.fence import Stamp
from miles.train.hybrid.lane import LANE_CONCURRENCY_GROUPS, HybridLane
from miles.train.hybrid.state import state_entries
from miles.train.worker import ACTOR_CONCURRENCY_GROUPS, TrainerWorker
from miles.types import AdamParams, Datum, LoraSpec
from tests.fast.local_ray import init_local_ray

VOCAB = 1024
RUN = "run-elastic-test"
# Lanes sum the same gradients in another order (fp32 rounding, about 1e-9 here). Adam's first steps divide
# by sqrt(v) + eps, so a gradient element near 0 turns that rounding into up to lr of difference when eps is
# tiny; eps = 1e-4 bounds the amplification at lr / eps = 10 and leaves every element comparable at 1e-6.
ADAM = AdamParams(learning_rate=1e-3, eps=1e-4, weight_decay=0.01, grad_clip_norm=1.0)
RemoteLane = ray.remote(num_cpus=1, concurrency_groups=LANE_CONCURRENCY_GROUPS)(HybridLane)


def make_batch(seed: int, lengths: tuple[int, ...]) -> list[Datum]:
    rng = np.random.default_rng(seed)
    batch = []
    for n in lengths:
        tokens = rng.integers(0, VOCAB, n + 1).astype(np.int64)
        weights = rng.uniform(0.0, 1.0, n).astype(np.float32)
        batch.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights}))
    return batch


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory: pytest.TempPathFactory):
    init_local_ray(tmp_path_factory.mktemp("ray"), num_cpus=6, num_gpus=0)
    yield
    ray.shutdown()


def new_lane(name: str) -> Lane:
    actor = RemoteLane.options(name=f"{name}-{uuid.uuid4().hex[:6]}").remote(name, group_timeout_s=10)
    return Lane(name, actor)


async def start_lanes(lanes: list[Lane], model: Path, mode: str, run: str = RUN) -> None:
    await asyncio.gather(*(lane.actor.setup.remote(run, str(model), mode) for lane in lanes))


class Trajectory:
    """The hybrid trainer and the one-lane reference, fed the same steps."""

    def __init__(self, trainer: HybridTrainer, reference: TransformersBackend, key: str) -> None:
        self.trainer, self.reference, self.key = trainer, reference, key
        self.seed = 0

    async def step(self, speeds: dict[str, float] | None, lengths=((5, 9, 3, 7), (6, 4))) -> None:
        self.trainer.pinned_speeds = speeds
        for part in lengths:
            self.seed += 1
            batch = make_batch(self.seed, part)
            ours = await self.trainer.forward_backward(self.key, batch, "cross_entropy", {})
            ref = self.reference.forward_backward(self.key, batch, "cross_entropy", {})
            assert len(ours.logprobs) == len(batch)
            for got, want in zip(ours.logprobs, ref.logprobs, strict=True):
                np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
        ours_metrics = await self.trainer.optim_step(self.key, ADAM)
        ref_metrics = self.reference.optim_step(self.key, ADAM)
        assert ours_metrics["grad_norm:mean"] == pytest.approx(ref_metrics["grad_norm:mean"], rel=1e-5)
        await self.assert_equal_state()

    async def assert_equal_state(self) -> None:
        want = {name: t.detach().numpy() for name, t in state_entries(self.reference, self.key)}
        assert any("::exp_avg_sq" in name for name in want) and any("::step" in name for name in want)
        for lane in self.trainer.lanes:
            got = await lane.actor.snapshot.remote(self.key)
            assert set(got) == set(want), lane.name
            for name, value in want.items():
                np.testing.assert_allclose(
                    got[name], value, atol=1e-6, rtol=1e-6, err_msg=f"{lane.name} {name}"
                )


@pytest.fixture(scope="module")
def full(ray_session, tiny_model_dir: Path) -> Trajectory:
    return asyncio.run(start_full(tiny_model_dir))


async def start_full(tiny_model_dir: Path) -> Trajectory:
    lanes = [new_lane(name) for name in ("core", "lane-a", "lane-b")]
    await start_lanes(lanes, tiny_model_dir, "full")
    trainer = HybridTrainer(RUN, lanes[0], call_timeout_s=90)
    await trainer.start()
    for lane in lanes[1:]:
        await trainer.join(lane)
    reference = TransformersBackend(str(tiny_model_dir), train_mode="full")
    return Trajectory(trainer, reference, "model-1")


async def test_one_core_and_two_lanes_follow_the_one_lane_trajectory(full: Trajectory) -> None:
    trainer = full.trainer
    assert [lane.name for lane in trainer.lanes] == ["core", "lane-a", "lane-b"]
    await full.step({"core": 1.0, "lane-a": 1.0, "lane-b": 1.0})  # even shares
    shares = trainer.shares(make_batch(0, (5, 9, 3, 7)))
    trainer.pinned_speeds = {"core": 5.0, "lane-a": 1.0, "lane-b": 1e-6}
    assert [s.size for s in trainer.shares(make_batch(0, (5, 9, 3, 7)))] == [3, 1, 0]
    assert [s.size for s in shares] != [3, 1, 0]
    await full.step({"core": 5.0, "lane-a": 1.0, "lane-b": 1e-6})  # uneven, lane-b gets no datums
    await full.step(None)  # shares from the measured speeds


async def test_stale_wrong_and_replayed_deliveries_are_rejected_on_every_lane(full: Trajectory) -> None:
    trainer, key = full.trainer, full.key
    step, version, epoch = trainer._steps["full"], trainer._versions["full"], trainer.epoch
    released = trainer.last_command_id  # the step just released (step - 1)
    before = [await lane.actor.digest.remote(key) for lane in trainer.lanes]
    for stamp, command_id, reason in (
        (Stamp(RUN, epoch - 1, step, version), uuid.uuid4().hex, "stale membership epoch"),
        (Stamp(RUN, epoch, step + 1, version), uuid.uuid4().hex, "wrong step"),
        (Stamp(RUN, epoch, step, version + 1), uuid.uuid4().hex, "wrong state version"),
        (Stamp("another-run", epoch, step, version), uuid.uuid4().hex, "foreign run"),
        (Stamp(RUN, epoch, step - 1, version - 1), released, "wrong step"),  # a late record of a release
        (Stamp(RUN, epoch, step, version), released, "replayed delivery"),  # its payload, restamped
    ):
        refs = [lane.actor.optim_step.remote(key, ADAM, stamp, command_id) for lane in trainer.lanes]
        for ref in refs:
            with pytest.raises(Exception, match=reason):
                await ref
    assert [await lane.actor.digest.remote(key) for lane in trainer.lanes] == before
    assert await trainer.counters(key) == [(step, version)] * len(trainer.lanes)
    await full.step(None)  # and training goes on, on the same trajectory


async def test_a_lane_dying_mid_step_aborts_it_and_the_step_is_recomputed_on_the_rest(
    full: Trajectory,
) -> None:
    trainer, key = full.trainer, full.key
    epoch = trainer.epoch
    batch = make_batch(100, (5, 9, 3, 7, 4))
    trainer.pinned_speeds = {"core": 1.0, "lane-a": 1.0, "lane-b": 1.0}
    await trainer.forward_backward(key, batch, "cross_entropy", {})
    full.reference.forward_backward(key, batch, "cross_entropy", {})
    ray.kill(trainer.lanes[1].actor)  # lane-a holds part of this step's gradient
    trainer.pinned_speeds = None
    await trainer.optim_step(key, ADAM)
    full.reference.optim_step(key, ADAM)
    assert [lane.name for lane in trainer.lanes] == ["core", "lane-b"] and trainer.epoch == epoch + 1
    await full.assert_equal_state()
    await full.step(None)
    await trainer.leave("lane-a")  # its engine's return later: already out, nothing changes
    assert [lane.name for lane in trainer.lanes] == ["core", "lane-b"] and trainer.epoch == epoch + 1
    with pytest.raises(MembershipError, match="lane-a"):
        await trainer.leave("lane-a")  # once only


async def test_a_failed_join_changes_nothing_and_a_lane_leaving_and_rejoining_keeps_the_trajectory(
    full: Trajectory, tiny_model_dir: Path
) -> None:
    trainer = full.trainer
    doomed = new_lane("lane-c")
    ray.kill(doomed.actor)  # gone before it could join
    with pytest.raises(JoinFailed, match="lane-c"):
        await trainer.join(doomed)
    assert [lane.name for lane in trainer.lanes] == ["core", "lane-b"]
    await full.step(None)
    lane_b = trainer.lanes[1]
    await trainer.leave("lane-b")
    await full.step(None)  # lane-b's state is now a step behind
    # a joiner whose state cannot be taken (set up for LoRA): the members were already in the new
    # epoch's group and waiting in the transfer; they go back to the old membership, state unchanged
    await lane_b.actor.setup.remote(RUN, str(tiny_model_dir), "lora")
    epoch = trainer.epoch
    with pytest.raises(JoinFailed, match="lane-b"):
        await trainer.join(lane_b)
    assert [lane.name for lane in trainer.lanes] == ["core"] and trainer.epoch == epoch + 2
    await full.step(None)
    await lane_b.actor.setup.remote(RUN, str(tiny_model_dir), "full")  # back at the initial weights
    await trainer.join(lane_b)  # it takes the core's state before its first step
    await full.assert_equal_state()
    await full.step({"core": 1.0, "lane-b": 2.0})


@pytest.fixture(scope="module")
def lora(full: Trajectory, tiny_model_dir: Path) -> tuple[Trajectory, Lane]:
    """Two of the full trainer's lane processes, set up again as a LoRA trainer of a new run."""
    return asyncio.run(start_lora(full, tiny_model_dir))


async def start_lora(full: Trajectory, tiny_model_dir: Path) -> tuple[Trajectory, Lane]:
    core, lane = (Lane(old.name, old.actor) for old in full.trainer.lanes[:2])
    assert (core.name, lane.name) == ("core", "lane-b")
    await start_lanes([core, lane], tiny_model_dir, "lora", run=RUN + "-lora")
    trainer = HybridTrainer(RUN + "-lora", core, call_timeout_s=90)
    await trainer.start()
    reference = TransformersBackend(str(tiny_model_dir), train_mode="lora")
    spec = LoraSpec(rank=4, seed=7)
    await trainer.create_adapter("adapter-1", spec)
    reference.create_adapter("adapter-1", spec)
    return Trajectory(trainer, reference, "adapter-1"), lane


async def test_lora_lane_joining_mid_run_and_leaving_later_keeps_the_one_lane_trajectory(lora) -> None:
    trajectory, joiner = lora
    trainer = trajectory.trainer
    await trajectory.step(None)  # the core alone
    await trainer.join(joiner)  # created the adapter, then took the core's adapter and Adam state
    await trajectory.assert_equal_state()
    await trajectory.step({"core": 1.0, "lane-b": 3.0})
    await trajectory.step({"core": 1.0, "lane-b": 1e-6})  # the lane computes nothing
    await trainer.leave("lane-b")
    await trajectory.step(None)


async def test_an_adapter_removed_while_a_lane_is_lent_can_be_created_again_on_a_fresh_trajectory(
    lora,
) -> None:
    """Removed on every lane, not only the core: the same key created again (another spec) while the
    lane is a member trains on a fresh adapter's trajectory, its step counters from 0."""
    trajectory, joiner = lora
    trainer, key = trajectory.trainer, trajectory.key
    await trainer.join(joiner)
    await trajectory.step({"core": 1.0, "lane-b": 1.0})
    await trainer.lanes[0].actor.remove_adapter.remote(key)  # in a job: the trainer's RemoveAdapter
    await trainer.remove_adapter(key)
    trajectory.reference.remove_adapter(key)
    spec = LoraSpec(rank=2, seed=11)
    await trainer.create_adapter(key, spec)
    trajectory.reference.create_adapter(key, spec)
    await trajectory.step({"core": 1.0, "lane-b": 2.0})
    assert await trainer.counters(key) == [(1, 1), (1, 1)]


# ---- a core of several ranks: the core trainer cell's two DP ranks as the core lane ---------------------

RemoteWorker = ray.remote(num_cpus=1, concurrency_groups=ACTOR_CONCURRENCY_GROUPS)(TrainerWorker)
DP_STEPS = (  # (speeds, batches) per step: even, the core's share of one datum (one core rank idle), no lane
    ({"core": 1.0, "lane-b": 1.0}, ((5, 9, 3, 7), (6, 4))),
    ({"core": 1.0, "lane-b": 4.0}, ((5, 9, 3, 7, 4),)),
    ({"core": 1.0, "lane-b": 1e-6}, ((8, 2, 6),)),
)


async def start_dp_core(tiny_model_dir: Path) -> list[Any]:
    workers = [RemoteWorker.remote(rank, 2) for rank in range(2)]
    master = await workers[0].open_rendezvous.remote()
    await asyncio.gather(*(w.setup.remote(master, str(tiny_model_dir), "full") for w in workers))
    return workers


async def snapshots(actors: list[Any], call: str, key: str) -> list[dict[str, np.ndarray]]:
    if call == "lane_call":
        return list(await asyncio.gather(*(a.lane_call.remote("snapshot", key) for a in actors)))
    return list(await asyncio.gather(*(a.snapshot.remote(key) for a in actors)))


async def test_a_core_of_two_ranks_with_a_lane_follows_the_two_rank_trajectory(
    ray_session, tiny_model_dir: Path
) -> None:
    """Two core ranks + one lane against the same two ranks alone (plain DP commands), same data: every
    rank and the lane end each step with the reference's parameters, Adam moments and step counts."""
    lane, key, run = new_lane("lane-b"), "model-1", RUN + "-dp"
    workers, _ = await asyncio.gather(
        start_dp_core(tiny_model_dir), start_lanes([lane], tiny_model_dir, "full", run=run)
    )
    core = await core_lane(workers, run)  # adopt: nothing loaded again, no group touched
    reference: list[list[dict[str, np.ndarray]]] = []
    for seed, (_, batches) in enumerate(DP_STEPS):
        for i, lengths in enumerate(batches):
            command = ForwardBackward(key, make_batch(100 + 10 * seed + i, lengths), "cross_entropy", {})
            await asyncio.gather(*(w.execute.remote(command) for w in workers))
        await asyncio.gather(*(w.execute.remote(OptimStep(key, ADAM)) for w in workers))
        reference.append(await snapshots(workers, "lane_call", key))
    await asyncio.gather(*(w.execute.remote(Reset(key)) for w in workers))

    trainer = HybridTrainer(run, core, call_timeout_s=90)
    await trainer.start()
    await trainer.join(lane)
    for seed, (speeds, batches) in enumerate(DP_STEPS):
        trainer.pinned_speeds = speeds
        for i, lengths in enumerate(batches):
            await trainer.forward_backward(key, make_batch(100 + 10 * seed + i, lengths), "cross_entropy", {})
        await trainer.optim_step(key, ADAM)
        got = [*await snapshots(workers, "lane_call", key), *await snapshots([lane.actor], "snapshot", key)]
        want = reference[seed][0]
        assert all(set(state) == set(want) for state in [*got, reference[seed][1]])
        for who, state in zip(("core rank 0", "core rank 1", "lane"), got, strict=True):
            for name, value in want.items():
                np.testing.assert_allclose(state[name], value, atol=1e-6, rtol=1e-6, err_msg=f"{who} {name}")
    assert await trainer.counters(key) == [(3, 4), (3, 4)]  # the join's transfer took one version
    for actor in [*workers, lane.actor]:
        ray.kill(actor)
