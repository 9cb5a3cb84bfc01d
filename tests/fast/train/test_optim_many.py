"""Several LoRA models' optim_steps in one command (backends/optim_many.py, coalescer.OptimStepMany), and
switching the active adapter without peft's walk (lora.py): each against the model's own step and
against an adapter that is the only one on its backend (peft's own routing, never switched)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import torch

from miles.errors import UserError
from miles.train.coalescer import ForwardBackwardCoalescer, ForwardBackwardMany, OptimStepMany
from miles.train.commands import ForwardBackward, OptimStep
from miles.types import AdamParams, LoraSpec

from .test_coalescer import RecordingTrainer
from .test_multi_tenant import TENANTS, _assert_same_output, _backend, _requests

# per model: its own learning rate, clipping (0.05 clips the tiny model's norms of ~1-10) and decay
ADAMS = [
    AdamParams(learning_rate=1e-2),
    AdamParams(learning_rate=3e-3, grad_clip_norm=0.05, weight_decay=0.1),
    AdamParams(learning_rate=5e-3, beta1=0.8, beta2=0.9),
]


def _weights(backend, key: str) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in backend.named_trainable_parameters(key)}


def test_merged_optim_steps_equal_each_models_own_and_a_bad_one_fails_alone(tiny_model_dir: Path) -> None:
    tenants = TENANTS[:3]
    alone, merged = _backend(tiny_model_dir, tenants), _backend(tiny_model_dir, tenants)
    for round_index, seed in enumerate((0, 50)):
        for request in _requests(tenants, seed=seed):
            request.run(alone)
            request.run(merged)
        adams = list(ADAMS)
        if round_index == 1:  # c's step is refused: its gradients stay pending, a and b step
            adams[2] = replace(ADAMS[2], eps=-1.0)
        steps = tuple(OptimStep(key, adam) for (key, *_), adam in zip(tenants, adams, strict=True))
        got = OptimStepMany(steps).run(merged)
        for step, outcome in zip(steps, got, strict=True):
            if step.adam.eps < 0:
                assert isinstance(outcome, UserError) and "eps must be > 0" in str(outcome)
                continue
            assert outcome == alone.optim_step(step.key, step.adam)  # the same norm, bit for bit
        for key, *_ in tenants:
            want, have = _weights(alone, key), _weights(merged, key)
            assert all(torch.equal(have[name], want[name]) for name in want), key
    pending = {n: p.grad for n, p in merged.named_trainable_parameters("tenant:c")}
    expected = {n: p.grad for n, p in alone.named_trainable_parameters("tenant:c")}
    assert all(torch.equal(pending[n], expected[n]) for n in expected)


async def test_waiting_optim_steps_go_as_one_command_and_no_model_is_overtaken(tiny_model_dir: Path) -> None:
    """b's forward_backward, a's forward-only, a's training pass and two optim_steps, all waiting: a's
    training pass never goes before its forward-only request, and the optim_steps share one command."""
    trainer = RecordingTrainer(_backend(tiny_model_dir))
    alone = _backend(tiny_model_dir)
    coalescer = ForwardBackwardCoalescer(trainer.run, window_s=0.2)
    a, b = _requests()[:2]
    only = ForwardBackward(a.key, a.data, a.loss_fn, a.loss_config, True)
    steps = [OptimStep(TENANTS[2][0], ADAMS[0]), OptimStep(TENANTS[3][0], ADAMS[1])]
    for request in (TENANTS[2][0], TENANTS[3][0]):
        for one in _requests():
            if one.key == request:
                one.run(trainer.backend)
                one.run(alone)
    got = await asyncio.gather(*(coalescer.submit(r) for r in (b, only, a, *steps)))
    kinds = [
        (type(c).__name__, [r.key for r in c.requests] if hasattr(c, "requests") else [c.key])
        for c in trainer.commands
    ]
    assert kinds == [
        ("ForwardBackward", [b.key]),
        ("ForwardBackward", [a.key]),  # forward-only: a's first request
        ("ForwardBackward", [a.key]),
        ("OptimStepMany", [s.key for s in steps]),
    ]
    assert not isinstance(trainer.commands[0], ForwardBackwardMany) and trainer.commands[1].forward_only
    _assert_same_output(got[1], only.run(alone))
    assert got[3:] == [alone.optim_step(s.key, s.adam) for s in steps]


def test_switching_adapters_routes_and_trains_as_each_adapter_alone(tiny_model_dir: Path) -> None:
    """One backend switches among four adapters (one created after the others had run, one with the
    unembedding); each adapter alone on its own backend is the reference. Two steps each: B != 0, so a
    misrouted row shows. Only the routed adapter's parameters require gradients."""
    specs = {key: LoraSpec(rank=rank, alpha=16.0, seed=10 + i) for i, (key, rank, *_) in enumerate(TENANTS)}
    specs["tenant:d"] = replace(specs["tenant:d"], train_unembed=True, train_mlp=False)
    shared = _backend(tiny_model_dir, [])
    requests = {r.key: r for r in _requests()}
    for key in list(specs)[:3]:
        shared.create_adapter(key, specs[key])
    order = ["tenant:a", "tenant:b", "tenant:c", "tenant:a", "tenant:d", "tenant:b", "tenant:d", "tenant:c"]
    refs = {}
    for step, key in enumerate(order):
        if key not in shared.model_keys():
            shared.create_adapter(key, specs[key])
        if key not in refs:
            refs[key] = _backend(tiny_model_dir, [])
            refs[key].create_adapter(key, specs[key])
        got, want = requests[key].run(shared), requests[key].run(refs[key])
        _assert_same_output(got, want)
        trainable = {id(p) for p in shared.lora.model.parameters() if p.requires_grad}
        assert trainable == {id(p) for _, p in shared.named_trainable_parameters(key)}
        assert shared.optim_step(key, ADAMS[step % 3]) == refs[key].optim_step(key, ADAMS[step % 3])
