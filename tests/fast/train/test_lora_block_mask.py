"""The mixed-adapter LoRA pass as one GEMM pair per layer (lora_layer.py's block mask), at the model level.

Every case runs one mixed batch through the tiny model and, for each row, the same row through its own
adapter alone (LoraAdapters.activate, peft's single-adapter path): the logits of every row and each
adapter's gradient of a cross-entropy loss must agree at 1e-5 in fp32 (gradients: relative to each
tensor's norm). The adapters' B matrices
are random (not peft's zeros), so a row that reached another adapter's columns, or a gradient that took
another tenant's rows, is off by O(1). In float64 the two agree at 1e-15 (checked by hand): what 1e-5
allows in fp32 is summation order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from transformers import AutoModelForCausalLM

from miles.train.backends.compile import compile_decoder_layers
from miles.train.backends.compute import causal_lm
from miles.train.backends.lora import LoraAdapters
from miles.train.backends.lora_layer import MixedRows, mixed_rows
from miles.types import LoraSpec

SEQ = 7  # every row the same length: no padding, the base computes each row identically in both runs


def _lora(model_dir: Path, specs: dict[str, LoraSpec]) -> LoraAdapters:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    lora = LoraAdapters(model, str(model_dir))
    generator = torch.Generator().manual_seed(1)
    for key, spec in specs.items():
        adapter = lora.create(key, spec)
        with torch.no_grad():
            for name, param in lora.named_parameters(adapter):
                if ".lora_B." in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return lora


def _inputs(rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets, [rows, SEQ] each."""
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, vocab, (rows, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per row, the summed next-token cross entropy, weighted by the row's number (rows differ)."""
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return -(logprobs.sum(-1) * torch.arange(1, len(targets) + 1))


def _mixed(lora: LoraAdapters, keys: list[str], ids: torch.Tensor, targets: torch.Tensor):
    """Logits of the mixed batch, and each adapter's gradient of the summed loss."""
    adapters = [lora.get(key) for key in dict.fromkeys(keys)]
    per_adapter = lora.activate_many(adapters)
    with lora.mixed_batch([lora.get(key).name for key in keys]):
        logits = lora.model(input_ids=ids).logits
    params = [p for named in per_adapter for _, p in named]
    grads = torch.autograd.grad(_loss(logits, targets).sum(), params, allow_unused=True)
    named_grads = {}
    for adapter, named in zip(adapters, per_adapter, strict=True):
        for name, _ in named:
            named_grads[(adapter.key, name)] = grads[len(named_grads)]
    return logits.detach(), named_grads


def _alone(lora: LoraAdapters, keys: list[str], ids: torch.Tensor, targets: torch.Tensor):
    """The same through each adapter alone (the whole batch, so the base computes exactly as in the mixed
    pass): each row's logits from its own adapter's run, each adapter's gradient from its own rows."""
    logits, grads = torch.empty(0), {}
    for key in dict.fromkeys(keys):
        named = lora.activate(lora.get(key))
        mine = torch.tensor([k == key for k in keys])
        with torch.compiler.set_stance("force_eager"):
            out = lora.model(input_ids=ids).logits
        own_grads = torch.autograd.grad(_loss(out, targets)[mine].sum(), [p for _, p in named])
        grads.update({(key, name): grad for (name, _), grad in zip(named, own_grads, strict=True)})
        rows = mine.view(-1, 1, 1)
        logits = torch.where(rows, out.detach(), logits) if logits.numel() else out.detach() * rows
    return logits, grads


def _assert_same(lora: LoraAdapters, keys: list[str]) -> None:
    ids, targets = _inputs(len(keys), lora.model.config.vocab_size)
    got_logits, got = _mixed(lora, keys, ids, targets)
    want_logits, want = _alone(lora, keys, ids, targets)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    assert set(got) == set(want) and want
    for name, grad in want.items():  # per tensor, relative to its norm (elements near 0 carry no scale)
        assert float((got[name] - grad).norm()) <= 1e-5 * float(grad.norm()), name


CASES = {
    "two adapters, rows interleaved": ({"a": 2, "b": 8}, ["a", "b", "b", "a"]),
    "three adapters, one of rank 1": ({"a": 1, "b": 4, "c": 8}, ["c", "a", "b", "a", "c"]),
    "four adapters, reverse order": ({"a": 8, "b": 2, "c": 4, "d": 1}, ["d", "c", "b", "a"]),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_block_mask_pass_equals_each_row_alone(tiny_model_dir: Path, case: str) -> None:
    ranks, keys = CASES[case]
    lora = _lora(
        tiny_model_dir, {k: LoraSpec(rank=r, alpha=16.0, seed=i) for i, (k, r) in enumerate(ranks.items())}
    )
    _assert_same(lora, keys)


def test_an_adapter_without_rows_and_one_without_attention_modules(tiny_model_dir: Path) -> None:
    """Adapter `mlp` has no attention modules (those layers give it zero blocks: its rows get the base
    there); adapter `idle` is trainable in the pass but has no rows: it gets no gradient at all."""
    specs = {
        "a": LoraSpec(rank=4, alpha=16.0, seed=0),
        "mlp": LoraSpec(rank=2, alpha=8.0, seed=1, train_attn=False),
        "idle": LoraSpec(rank=3, seed=2),
    }
    lora = _lora(tiny_model_dir, specs)
    _assert_same(lora, ["mlp", "a", "mlp"])
    idle = lora.get("idle")
    lora.activate_many([lora.get("a"), idle])
    ids, _ = _inputs(2, lora.model.config.vocab_size)
    with lora.mixed_batch([lora.get("a").name] * 2):
        lora.model(input_ids=ids).logits.sum().backward()
    assert all(p.grad is None for _, p in lora.named_parameters(idle))
    assert all(p.grad is not None for _, p in lora.named_parameters(lora.get("a")))


def test_mixed_rows_mask_blocks_follow_sorted_adapters() -> None:
    mixed = mixed_rows(["b", "a", "b"], {"a": 2, "b": 3}, dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(mixed, MixedRows) and mixed.adapters == ("a", "b") and mixed.ranks == (2, 3)
    want = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 1, 1, 1]], dtype=torch.float32)
    torch.testing.assert_close(mixed.mask, want)
    with pytest.raises(ValueError, match="without a rank: \\['c'\\]"):
        mixed_rows(["c"], {"a": 2}, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="at least one row"):
        mixed_rows([], {"a": 2}, dtype=torch.float32, device=torch.device("cpu"))


def test_compiled_layers_serve_many_adapter_sets_without_recompiling(tiny_model_dir: Path) -> None:
    """Compiled decoder layers (dynamo with a counting backend): ten different sets of adapters of
    different ranks and widths, and single adapters, run through graphs compiled for the first ones: no
    recompile after the warm-up, so however many tenants come, no layer reaches dynamo's recompile limit
    (past it a layer runs eagerly, silently; held at dynamo's default of 8 here). Each mixed pass agrees
    with the rows alone (eager) at 1e-5, and each single adapter's compiled logits with its eager ones.
    Before routes were
    tensors, every adapter (its name, its parameters' requires_grad) compiled a graph of its own and the
    fifth set hit the limit."""
    torch._dynamo.reset()
    ranks = (2, 3, 4, 6, 8)
    specs = {f"t{i}": LoraSpec(rank=ranks[i % len(ranks)], alpha=8.0 + i, seed=i) for i in range(12)}
    lora = _lora(tiny_model_dir, specs)
    counter = CompileCounter()
    with torch._dynamo.config.patch(recompile_limit=8, force_parameter_static_shapes=True):
        compile_decoder_layers(causal_lm(lora.model), backend=counter)
        torch._dynamo.config.recompile_limit = 8  # compile_decoder_layers raised it
        _assert_same(lora, ["t0", "t1", "t1", "t0"])
        _assert_single_same(lora, "t2")
        warm = counter.frame_count
        assert 0 < warm <= 4
        for i in range(1, 11):  # 10 more sets: 2-4 adapters, total widths 5 to 21
            keys = [f"t{i}", f"t{i + 1}", f"t{(i * 5) % 12}", f"t{i}"][: 2 + i % 3]
            _assert_same(lora, keys + keys[:1] * (4 - len(keys)))
            _assert_single_same(lora, f"t{(i + 3) % 12}")
        assert counter.frame_count == warm


def _assert_single_same(lora: LoraAdapters, key: str) -> None:
    ids, _ = _inputs(4, lora.model.config.vocab_size)
    lora.activate(lora.get(key))
    compiled = lora.model(input_ids=ids).logits
    with torch.compiler.set_stance("force_eager"):
        eager = lora.model(input_ids=ids).logits
    compiled.sum().backward()  # the training graph too (parameters require grad)
    lora.model.zero_grad(set_to_none=True)
    torch.testing.assert_close(compiled.detach(), eager.detach(), rtol=1e-5, atol=1e-5)
