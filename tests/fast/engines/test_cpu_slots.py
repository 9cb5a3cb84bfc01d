"""The fixed-slot decode batch (slots.py) against the dynamic one (kvbatch.py): the same rows ending and
joining, step by step, give the same logits and tokens, through every move the slots make (a wider joiner
shifting the batch right, freed columns reclaimed on the left, regrowing for rows or columns, a freed slot
taken again). On CPU the slots run eagerly; on CUDA (the `cuda` cases, skipped without a GPU; the device
runs them through tests/gpu/run_rl_loop.sh) they are replayed as CUDA graphs (graphs.py), which must also
follow weights that change in place or move. And which decode path a runner picks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from miles.contract.engine_args import cpu_engine_parser
from miles.engines.cpu import graphs, slots
from miles.engines.cpu.graphs import DecodeOptions, resolve_mode
from miles.engines.cpu.runner import ModelRunner
from miles.engines.cpu.sampling import SamplingConfig
from miles.engines.cpu.step import GroupPlan, RowPlan, StepStats, run_group_step

GREEDY = SamplingConfig(temperature=0.0)


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def runners(request: pytest.FixtureRequest, tiny_model_dir: Path) -> dict[str, ModelRunner]:
    """`dynamic` (the reference) and `slots`: eager on CPU, CUDA graphs on CUDA; fp32 both."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    device = torch.device(request.param, 0) if request.param == "cuda" else torch.device("cpu")
    made = {
        cache: ModelRunner(str(tiny_model_dir), device, "float32", decode=DecodeOptions(cache=cache))
        for cache in ("dynamic", "slots")
    }
    assert made["slots"].decode_mode == ("graphs" if device.type == "cuda" else "slots")
    return made


class Captures:
    """The slots runner's graph captures and replays since the test began (its DecodeCounts)."""

    def __init__(self, runner) -> None:
        self.runner, self.start = runner, runner.decode_counts.as_dict()

    def __getitem__(self, key: str) -> int:
        return self.runner.decode_counts.as_dict()[key] - self.start[key]


@pytest.fixture
def captures(runners) -> Captures:
    return Captures(runners["slots"])


class Lane:
    """One decode path stepping the scripted rows: its batch and each row's pending token."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.kv, self.rows, self.pending = runner, None, [], {}

    def step(self, keep: list[int], joiners: dict[str, list[int]], horizon: int) -> list[torch.Tensor]:
        kept = [self.rows[i] for i in keep]
        plan = GroupPlan(
            adapter=None,
            kv=self.kv,
            keep=keep,
            decode=[RowPlan(GREEDY, None, True, [self.pending[r]]) for r in kept],
            prefill=[RowPlan(GREEDY, None, True, seq) for seq in joiners.values()],
            horizon=horizon,
        )
        self.kv, results = run_group_step(self.runner, plan, None, StepStats())
        self.rows = kept + list(joiners)
        for row, result in zip(self.rows, results, strict=True):
            self.pending[row] = result.token
        return [result.logits for result in results]


def assert_same(want: list[torch.Tensor], got: list[torch.Tensor], step: int) -> None:
    for row, (a, b) in enumerate(zip(want, got, strict=True)):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=f"step {step}, row {row}")


def test_slots_decode_exactly_as_the_dynamic_cache_through_joins_ends_and_regrows(
    runners, monkeypatch, captures
):
    monkeypatch.setattr(slots, "CAPACITY_QUANTUM", 1)  # exact capacities: the batch runs out of columns
    monkeypatch.setattr(slots, "HORIZON_LIMIT", 3)
    moves = {"shift": [], "regrow": 0}
    shift, regrow = slots._shift, slots.regrow

    def spy_shift(batch, by):
        moves["shift"].append(by)
        shift(batch, by)

    def spy_regrow(*args, **kwargs):
        moves["regrow"] += 1
        return regrow(*args, **kwargs)

    monkeypatch.setattr(slots, "_shift", spy_shift)
    monkeypatch.setattr(slots, "regrow", spy_regrow)
    dynamic, fixed = Lane(runners["dynamic"]), Lane(runners["slots"])
    rng = random.Random(7)
    names = iter(range(1000))
    joiners = {f"r{next(names)}": [rng.randrange(1, 200) for _ in range(n)] for n in (3, 6)}
    for step in range(40):
        keep = [i for i in range(len(dynamic.rows)) if rng.random() > 0.15]
        horizon = rng.randint(1, 5)
        want = dynamic.step(keep, joiners, horizon)
        got = fixed.step(keep, joiners, horizon)
        assert fixed.pending == dynamic.pending, f"step {step}"
        assert_same(want, got, step)
        if isinstance(fixed.kv, slots.SlotBatch):
            free = fixed.kv.free_slots()
            assert fixed.kv.next_pos[free].eq(0).all(), "a free slot's position stays 0"
        joiners = {}
        if rng.random() < 0.3 or not dynamic.rows:
            joiners = {f"r{next(names)}": [rng.randrange(1, 200) for _ in range(rng.randint(1, 14))]}
    assert any(by > 0 for by in moves["shift"]), "a wider joiner shifted the batch right"
    assert any(by < 0 for by in moves["shift"]), "columns no row uses were reclaimed"
    assert moves["regrow"] >= 2
    if fixed.runner.decode_mode == "graphs":
        assert captures["captures"] >= 2 and captures["replays"] > captures["captures"]
        assert captures["capture_failures"] == 0
    else:
        assert captures["replays"] == 0 and captures["eager"] > 0


def test_a_joiner_takes_a_freed_slot_without_new_buffers(runners):
    """The freed slot attended to its own pad tokens while free: none of that may reach the joiner."""
    dynamic, fixed = Lane(runners["dynamic"]), Lane(runners["slots"])
    script = [
        ([], {"a": [5, 6, 7, 8, 9], "b": [8, 9], "c": [1], "d": [2, 3]}),
        ([0, 2, 3], {}),  # b ends: its slot is free
        ([0, 1, 2], {}),
        ([0, 1, 2], {"e": [4]}),
        ([0, 1, 2, 3], {}),
    ]
    for step, (keep, joiners) in enumerate(script):
        want, got = dynamic.step(keep, joiners, 8), fixed.step(keep, joiners, 8)
        assert_same(want, got, step)
        if step == 0:
            batch = fixed.kv
            assert isinstance(batch, slots.SlotBatch) and batch.slots == 4
        if step == 1:
            assert batch.row_slots == [0, 2, 3] and batch.occupied.tolist() == [1, 0, 1, 1]
    assert fixed.kv is batch and batch.row_slots == [0, 2, 3, 1], "e took b's slot in the same buffers"


def test_a_graph_follows_weights_changed_in_place_and_is_captured_again_when_they_move(runners, captures):
    if runners["slots"].decode_mode != "graphs":
        pytest.skip("CUDA graphs: CUDA only")
    lanes = [Lane(runners["dynamic"]), Lane(runners["slots"])]
    name, _ = next(iter(runners["slots"].params.items()))

    def both(keep: list[int], joiners: dict[str, list[int]], step: int) -> None:
        want, got = (lane.step(keep, joiners, 16) for lane in lanes)
        assert_same(want, got, step)

    both([], {"a": [5, 6, 7], "b": [8, 9]}, 0)
    for step in range(1, 4):
        both([0, 1], {}, step)
    assert captures["captures"] == 1
    for lane in lanes:  # in place, as a push receives: the captured graph reads the new values
        lane.runner.params[name].data.mul_(0.5)
    both([0, 1], {}, 4)
    assert captures["captures"] == 1
    for lane in lanes:  # adopted: the parameter's memory moves, the graph must not read the old one
        old = lane.runner.params[name].data
        assert lane.runner.load_weights([(name, old * 2.0)]) == []
        assert lane.runner.params[name].data_ptr() != old.data_ptr()
        del old
    both([0, 1], {}, 5)
    assert captures["captures"] == 2


class HostSyncs(TorchDispatchMode):
    """Records the ops that make the host wait for the device (`.item()`, `nonzero`...): a CUDA graph
    capture refuses them."""

    SYNCING = ("_local_scalar_dense", "nonzero", "is_nonzero", "equal")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(name in str(func) for name in self.SYNCING):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_decode_forward_never_waits_for_the_device(runners):
    """What the graph captures (forward_slots) on this transformers: no op that syncs, on any device."""
    lane = Lane(runners["slots"])
    lane.step([], {"a": [5, 6, 7], "b": [8]}, horizon=4)
    batch = lane.kv
    slots.open_column(batch)
    ids = slots.step_ids(batch, [1, 2]).to(batch.mask.device)
    with HostSyncs() as probe:
        graphs.forward_slots(runners["slots"].model, batch, ids)
    assert probe.seen == []


def test_the_decode_path_follows_the_flags_and_the_model(tiny_model_dir: Path):
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert resolve_mode(DecodeOptions(), cuda, True, "sdpa") == "graphs"
    assert resolve_mode(DecodeOptions(graphs=False), cuda, True, "sdpa") == "slots"
    assert resolve_mode(DecodeOptions(), cpu, True, "sdpa") == "slots"
    assert resolve_mode(DecodeOptions(cache="dynamic"), cuda, True, "sdpa") == "dynamic"
    assert resolve_mode(DecodeOptions(), cuda, False, "sdpa") == "dynamic", "a sliding-window cache"
    assert resolve_mode(DecodeOptions(), cuda, True, "eager") == "dynamic", "eager attention adds the mask"
    with pytest.raises(ValueError, match="decode cache 'paged'"):
        DecodeOptions(cache="paged")
    with pytest.raises(ValueError, match="at least 1"):
        DecodeOptions(graph_max_bs=0)
    args = cpu_engine_parser().parse_args(
        ["--model-path", str(tiny_model_dir), "--port", "1", "--disable-decode-cuda-graph"]
    )
    assert args.disable_decode_cuda_graph and args.cuda_graph_max_bs_decode == 256
