"""The distributed optimizer's state gathered whole and cut again for another DP layout (zero_state.py), on
megatron-core over gloo on CPU (bf16 weights, fp32 main weights), as a megatron hybrid lane is built.

A core of DP 2 takes two AdamW steps; its state is gathered on rank 0 (some parameter is split between the
two ranks) and loaded into a DP 1 trainer, whose main weights, moments, steps and bf16 weights then equal
the core's exactly; the DP 1 trainer's state gathered and loaded into a fresh DP 2 core gives each rank
its original shard back bit for bit, and its next step is the original core's, bit for bit. (The model
has three layers: with two, the DP halves of its gradient buffer meet at a parameter boundary.)

A lane sharing a step through HybridLane is test_megatron_lane_cpu.py. Skips without megatron-core.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("megatron.core", reason="megatron-core is the gpu extra")

from miles.engines.weight_group import pick_master_port
from miles.train.megatron.zero_state import FIELDS, Piece, WholeParam, assemble
from miles.types import AdamParams, Datum
from tests.fast.train.megatron.ranks import join_gloo, running

pytestmark = pytest.mark.slow

ADAM = AdamParams(learning_rate=1e-2, weight_decay=0.01)


def _batch(vocab: int, seed: int) -> list[Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for n in (5, 9, 7, 12):
        tokens = rng.integers(0, vocab, n + 1)
        data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(n, np.float32)}))
    return data


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with three layers: the two DP halves of its gradient buffer meet inside a parameter
    (two layers split it at a parameter boundary)."""
    from miles.models.tiny import TinyModelSpec, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("three-layers"), TinyModelSpec(num_hidden_layers=3))


def _save_whole(whole: dict[str, WholeParam], path: Path) -> None:
    tensors = {f"{name}::{k}": v for name, state in whole.items() for k, v in state.tensors.items()}
    tensors.update({f"{name}::step": torch.tensor(state.step or 0.0) for name, state in whole.items()})
    save_file(tensors, str(path))


def _load_whole(path: Path) -> dict[str, WholeParam]:
    flat = load_file(str(path))
    whole: dict[str, WholeParam] = {}
    for key, tensor in flat.items():
        name, field = key.split("::")
        state = whole.setdefault(name, WholeParam({}, None))
        if field == "step":
            state.step = float(tensor)
        else:
            state.tensors[field] = tensor
    return whole


def _rank(rank: int, world: int, port: int, model_dir: str, out: str, phase: str, results: Any) -> None:
    """One trainer rank of `phase`: `core` trains DP 2 and gathers; `lane` loads DP 1, gathers, steps;
    `back` loads the lane's state into DP 2 and steps."""
    from miles.train.backends.megatron_backend import MegatronBackend
    from miles.train.dist import DistContext
    from miles.train.megatron import zero_state
    from miles.train.megatron.cpu import run_on_cpu

    try:
        run_on_cpu()
        join_gloo(rank, world, port)
        backend = MegatronBackend(
            model_dir, train_mode="full", device="cpu", dtype=torch.bfloat16, dist=DistContext(rank, world)
        )
        named = list(backend.gpt.named_parameters())
        out_dir = Path(out)
        got: dict[str, Any] = {}
        if phase == "core":
            for seed in (1, 2):
                backend.forward_backward("full", _batch(backend.vocab_size, seed), "cross_entropy", {})
                backend.optim_step("full", ADAM)
            pieces = zero_state.local_pieces(backend.optimizer, named)
            got["pieces"] = {
                n: (p.start, p.end, p.step, {k: v.numpy().copy() for k, v in p.tensors.items()})
                for n, p in pieces.items()
            }
            whole = backend.whole_optimizer_state()
            if rank == 0:
                _save_whole(whole, out_dir / "core.safetensors")
                save_file({n: p.detach().clone() for n, p in named}, str(out_dir / "core_bf16.safetensors"))
        else:
            source = "core" if phase == "lane" else "lane"
            backend.load_whole_optimizer_state(_load_whole(out_dir / f"{source}.safetensors"))
            pieces = zero_state.local_pieces(backend.optimizer, named)
            got["pieces"] = {
                n: (p.start, p.end, p.step, {k: v.numpy().copy() for k, v in p.tensors.items()})
                for n, p in pieces.items()
            }
            got["bf16"] = {n: p.detach().float().numpy().copy() for n, p in named}
            whole = backend.whole_optimizer_state()
            if phase == "lane" and rank == 0:
                _save_whole(whole, out_dir / "lane.safetensors")
        backend.forward_backward("full", _batch(backend.vocab_size, 3), "cross_entropy", {})
        backend.optim_step("full", ADAM)
        after = backend.whole_optimizer_state()
        got["after"] = None if after is None else {n: s.tensors["param"].numpy() for n, s in after.items()}
        results.put((rank, got))
    except BaseException as exc:
        results.put((rank, {"error": repr(exc)}))
        raise


def _spawn(target: Any, per_process: list[tuple]) -> dict[Any, dict[str, Any]]:
    """`target(*args, results)` once per `per_process` entry; each puts (its key, what it found)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, results)) for args in per_process]
    with running(procs):
        outcome = dict(results.get(timeout=240) for _ in procs)
    assert all("error" not in r for r in outcome.values()), outcome
    return outcome


def _run(phase: str, world: int, model_dir: Path, out: Path) -> dict[int, dict[str, Any]]:
    port = pick_master_port("127.0.0.1")
    return _spawn(_rank, [(r, world, port, str(model_dir), str(out), phase) for r in range(world)])


def test_a_dp2_state_moves_to_dp1_and_back_exactly(three_layers: Path, tmp_path: Path) -> None:
    core = _run("core", 2, three_layers, tmp_path)
    split = set(core[0]["pieces"]) & set(core[1]["pieces"])
    assert split, "no parameter is split between the two DP ranks: the test would not exercise assembly"
    gathered = _load_whole(tmp_path / "core.safetensors")
    assert all(state.step == 2.0 and set(state.tensors) == set(FIELDS) for state in gathered.values())

    lane = _run("lane", 1, three_layers, tmp_path)[0]
    core_bf16 = load_file(str(tmp_path / "core_bf16.safetensors"))
    for name, (start, end, step, tensors) in lane["pieces"].items():
        assert (start, end, step) == (0, gathered[name].tensors["param"].numel(), 2.0), name
        for field in FIELDS:
            assert np.array_equal(tensors[field], gathered[name].tensors[field].numpy()), (name, field)
        assert np.array_equal(lane["bf16"][name], core_bf16[name].float().numpy()), name  # bf16(main)

    back = _run("back", 2, three_layers, tmp_path)
    for rank in (0, 1):
        assert back[rank]["pieces"].keys() == core[rank]["pieces"].keys()
        for name, (start, end, step, tensors) in back[rank]["pieces"].items():
            original = core[rank]["pieces"][name]
            assert (start, end, step) == original[:3], name
            assert all(np.array_equal(tensors[k], original[3][k]) for k in FIELDS), name

    for name in lane["after"]:  # the next step from the restored state: the same layout, the same bits
        assert np.array_equal(back[0]["after"][name], core[0]["after"][name]), name


def test_assembly_refuses_gaps_overlaps_and_disagreeing_ranks() -> None:
    def piece(start: int, end: int, step: float | None = 1.0) -> Piece:
        return Piece(start, end, {"param": torch.arange(start, end, dtype=torch.float32)}, step)

    whole = assemble([piece(3, 6), piece(0, 3)], 6)
    assert torch.equal(whole.tensors["param"], torch.arange(6, dtype=torch.float32)) and whole.step == 1.0
    with pytest.raises(ValueError, match="gap or overlap"):
        assemble([piece(0, 3), piece(4, 6)], 6)
    with pytest.raises(ValueError, match="gap or overlap"):
        assemble([piece(0, 4), piece(3, 6)], 6)
    with pytest.raises(ValueError, match="cover 3 of 6"):
        assemble([piece(0, 3)], 6)
    with pytest.raises(ValueError, match="disagree"):
        assemble([piece(0, 3, 1.0), piece(3, 6, 2.0)], 6)
