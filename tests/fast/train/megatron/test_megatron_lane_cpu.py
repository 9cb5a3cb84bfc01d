"""HybridLane over the megatron backend (replica.py), on CPU over gloo: a DP 2 megatron core (two adopted
HybridLanes, as a trainer cell's ranks) steps alone, a DP 1 megatron lane joins (the core's state gathered
over its ranks, packed over the lanes' group), and the next step's batch is shared: four datums on the
core, two on the lane, through the fence, the two-level sum and one shared norm. The lanes' state check
passes (every core rank takes part in the gather), the lane's digest equals the core's, and the state
equals the core alone on the whole batches (fp32, to the summation order); the sum runs in chunks of 5,000
elements, most parameters cut across chunks. A delivery stamped with a stale step is refused on every
replica. Each process runs HybridLane methods sent by the test, in the order the
coordinator (HybridTrainer) would send them. Skips without megatron-core.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("megatron.core", reason="megatron-core is the gpu extra")

from miles.engines.weight_group import pick_master_port
from miles.train.hybrid.fence import Stamp
from miles.train.hybrid.group import Membership
from miles.types import AdamParams, Datum
from tests.fast.train.megatron.ranks import join_gloo, stop

pytestmark = pytest.mark.slow

RUN = "megatron-lane-test"
ADAM = AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)
KEY = "full"


def _batch(seed: int, sizes: tuple[int, ...]) -> list[Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for n in sizes:
        tokens = rng.integers(0, 1000, n + 1)
        data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(n, np.float32)}))
    return data


FIRST, SECOND = _batch(1, (5, 9, 7, 12)), _batch(2, (6, 8, 5, 11, 9, 4))


GROUP_TIMEOUT_S = 10  # a dead lane's peer gives up on the lanes' group after this long


def _serve(role: str, port: int, model_dir: str, inbox: Any, outbox: Any) -> None:
    """A core rank (`core0`, `core1`: a DP 2 megatron trainer, its HybridLane adopting it) or the lane:
    run each (method, args) from `inbox` on the HybridLane, answer on `outbox`."""
    import torch

    from miles.train.backends.megatron_backend import MegatronBackend
    from miles.train.dist import DistContext
    from miles.train.hybrid import lane as lane_module
    from miles.train.hybrid.lane import HybridLane
    from miles.train.megatron.cpu import run_on_cpu

    run_on_cpu()
    lane_module.REDUCE_CHUNK_ELEMENTS = 5000  # many chunks, some cutting a parameter: the bounded sum
    lane = HybridLane("lane" if role == "lane" else "core", group_timeout_s=GROUP_TIMEOUT_S)
    if role == "lane":  # its own one-rank world, as a lane on a lent engine's GPUs
        lane.setup(RUN, model_dir, "full", {"backend": "megatron", "device": "cpu", "dtype": torch.float32})
    else:
        rank = int(role[-1])
        join_gloo(rank, 2, port)
        backend = MegatronBackend(
            model_dir, train_mode="full", device="cpu", dtype=torch.float32, dist=DistContext(rank, 2)
        )
        lane.adopt(RUN, backend)
    outbox.put(("ready", None))
    while (command := inbox.get()) is not None:
        method, args = command
        try:
            outbox.put(("ok", getattr(lane, method)(*args)))
        except Exception as exc:
            outbox.put(("error", f"{type(exc).__name__}: {exc}"))


class Replicas:
    """The test's coordinator: processes by role, a method sent to several at once, their answers."""

    def __init__(self, roles: list[str], model_dir: Path) -> None:
        ctx = mp.get_context("spawn")
        port = pick_master_port("127.0.0.1")
        self.queues = {role: (ctx.Queue(), ctx.Queue()) for role in roles}
        self.procs = {
            role: ctx.Process(target=_serve, args=(role, port, str(model_dir), *self.queues[role]))
            for role in roles
        }
        for proc in self.procs.values():
            proc.start()
        for role in roles:
            assert self._answer(role) is None

    def _answer(self, role: str) -> Any:
        status, value = self.queues[role][1].get(timeout=240)
        if status == "error":
            raise AssertionError(f"{role}: {value}")
        return value

    def call(self, roles: list[str], method: str, *args: Any, per_role: dict | None = None) -> dict[str, Any]:
        for role in roles:
            self.queues[role][0].put((method, (per_role or {}).get(role, args)))
        answers: dict[str, Any] = {}
        for role in roles:
            status, value = self.queues[role][1].get(timeout=240)
            answers[role] = value if status == "ok" else RuntimeError(value)
        return answers

    def close(self) -> None:
        for inbox, _ in self.queues.values():
            inbox.put(None)
        stop(list(self.procs.values()))


def _ok(answers: dict[str, Any]) -> dict[str, Any]:
    errors = {role: a for role, a in answers.items() if isinstance(a, Exception)}
    assert not errors, errors
    return answers


CORE = ["core0", "core1"]
ALL = [*CORE, "lane"]


def _core_step(replicas: Replicas, data: list[Datum], stamp: Stamp) -> None:
    _ok(replicas.call(CORE, "forward_backward", KEY, data, (0, len(data)), "cross_entropy", {}))
    _ok(replicas.call(CORE, "optim_step", KEY, ADAM, stamp, f"step-{stamp.step}"))


@pytest.fixture(scope="module")
def alone(tiny_model_dir: Path) -> dict[str, np.ndarray]:
    """The core alone on FIRST then SECOND: the state both tests compare with."""
    replicas = Replicas(CORE, tiny_model_dir)
    try:
        _ok(replicas.call(["core0"], "open_store"))
        _ok(replicas.call(["core0"], "join_epoch", Membership(RUN, 0, ("core",))))
        _core_step(replicas, FIRST, Stamp(RUN, 0, 0, 0))
        _core_step(replicas, SECOND, Stamp(RUN, 0, 1, 1))
        return _ok(replicas.call(CORE, "snapshot", KEY))["core0"]
    finally:
        replicas.close()


def _lane_joined_after_one_step(replicas: Replicas) -> dict[str, Any]:
    """The core steps alone on FIRST, then the lane joins (epoch 1): every replica's counters."""
    host, port = _ok(replicas.call(["core0"], "open_store"))["core0"]
    _ok(replicas.call(["lane"], "connect", host, port))
    _ok(replicas.call(["core0"], "join_epoch", Membership(RUN, 0, ("core",))))
    _core_step(replicas, FIRST, Stamp(RUN, 0, 0, 0))
    _ok(replicas.call(["core0", "lane"], "join_epoch", Membership(RUN, 1, ("core", "lane"))))
    return _ok(replicas.call(ALL, "receive_state", KEY))


def _shared_second_batch(replicas: Replicas) -> dict[str, tuple]:
    """SECOND's forward_backward, four datums on the core and two on the lane; the calls, per role."""
    shares = {"core0": (0, 4), "core1": (0, 4), "lane": (4, 6)}
    per_role = {role: (KEY, SECOND, shares[role], "cross_entropy", {}) for role in ALL}
    _ok(replicas.call(ALL, "forward_backward", per_role=per_role))
    return per_role


def test_a_megatron_lane_joins_shares_a_step_and_equals_the_core(tiny_model_dir: Path, alone) -> None:
    replicas = Replicas(ALL, tiny_model_dir)
    try:
        counters = _lane_joined_after_one_step(replicas)
        assert counters["core0"] == counters["lane"] == (1, 2)  # the step, and a version for the copy
        per_role = _shared_second_batch(replicas)
        stale = replicas.call(ALL, "optim_step", KEY, ADAM, Stamp(RUN, 1, 0, 2), "stale")
        assert all("rejected" in str(answer) for answer in stale.values()), stale  # every replica refuses
        _ok(replicas.call(ALL, "abort_step", KEY))
        _ok(replicas.call(ALL, "forward_backward", per_role=per_role))
        metrics = _ok(replicas.call(ALL, "optim_step", KEY, ADAM, Stamp(RUN, 1, 1, 2), "step-1"))
        assert metrics["core0"]["grad_norm:mean"] == metrics["lane"]["grad_norm:mean"] > ADAM.grad_clip_norm

        _ok(replicas.call(ALL, "check_state", KEY))  # every core rank gathers; the fingerprints agree
        digests = _ok(replicas.call(ALL, "digest", KEY))
        assert digests["core0"] == digests["lane"] and digests["core1"] == ""
        hybrid = _ok(replicas.call(ALL, "snapshot", KEY))
    finally:
        replicas.close()
    assert hybrid["core0"].keys() == alone.keys()
    for name, value in hybrid["core0"].items():
        np.testing.assert_array_equal(value, hybrid["lane"][name], err_msg=name)
        np.testing.assert_allclose(value, alone[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_lane_dying_mid_step_leaves_the_core_to_recompute_the_step_alone(
    tiny_model_dir: Path, alone
) -> None:
    """The lane dies after its share: the core's rank 0 fails the fence exchange and tells rank 1 (no
    rank waits forever); the core alone in the next epoch drops the step's gradients, recomputes the
    whole batch and steps: its state is the core alone's, as if the lane had never joined."""
    replicas = Replicas(ALL, tiny_model_dir)
    try:
        _lane_joined_after_one_step(replicas)
        _shared_second_batch(replicas)
        replicas.procs["lane"].kill()
        failed = replicas.call(CORE, "optim_step", KEY, ADAM, Stamp(RUN, 1, 1, 2), "step-1")
        assert all(isinstance(answer, Exception) for answer in failed.values()), failed
        assert "rejected on the core's rank 0" in str(failed["core1"]) or "fence failed" in str(
            failed["core1"]
        )

        _ok(replicas.call(["core0"], "join_epoch", Membership(RUN, 2, ("core",))))
        _ok(replicas.call(CORE, "abort_step", KEY))
        _core_step(replicas, SECOND, Stamp(RUN, 2, 1, 2))
        recovered = _ok(replicas.call(CORE, "snapshot", KEY))["core0"]
    finally:
        replicas.procs.pop("lane", None)
        replicas.queues.pop("lane", None)
        replicas.close()
    for name, value in recovered.items():  # the same layout and batches as the core alone: the same bits
        np.testing.assert_array_equal(value, alone[name], err_msg=name)
