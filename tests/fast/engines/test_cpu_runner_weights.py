"""How the CPU engine's model takes pushed weights: a received bucket becomes the parameters' memory
(no copy), the next push with the same buckets is received in place, and anything else is copied."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.engines.cpu.runner import ModelRunner
from miles.utils.buckets import TensorMeta, pack_flat, plan_buckets, unpack_flat

PROMPT = [5, 17, 2, 40, 9]


@pytest.fixture
def runner(tiny_model_dir: Path) -> ModelRunner:
    return ModelRunner(str(tiny_model_dir), device=torch.device("cpu"))


def buckets_of(runner: ModelRunner) -> list[list[TensorMeta]]:
    metas = [TensorMeta.of(name, p.data) for name, p in runner.params.items()]
    total = sum(m.nbytes for m in metas)
    return plan_buckets(metas, total // 3 + 1, flattened=True)


def specs_of(bucket: list[TensorMeta]) -> list[tuple[str, torch.dtype, list[int]]]:
    return [(m.name, getattr(torch, m.dtype), list(m.shape)) for m in bucket]


def new_weights(runner: ModelRunner, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: p.data + 0.1 * torch.randn(p.shape, generator=gen) for name, p in runner.params.items()}


def received_as(bucket: list[TensorMeta], buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return list(zip([m.name for m in bucket], unpack_flat(buffer, bucket), strict=True))


def logits(runner: ModelRunner) -> torch.Tensor:
    return runner.forward(PROMPT, None, None)[0]


def test_a_received_bucket_is_adopted_and_the_next_one_lands_in_place(runner: ModelRunner) -> None:
    buckets = buckets_of(runner)
    assert len(buckets) >= 3
    cpu = torch.device("cpu")
    for seed in (1, 2):
        weights = new_weights(runner, seed)
        targets = [runner.flat_target(specs_of(b), cpu) for b in buckets]
        for bucket, target in zip(buckets, targets, strict=True):
            packed = pack_flat([weights[m.name] for m in bucket], bucket)
            if target is None:  # first push: a fresh receive buffer
                received = packed.clone()
            else:  # second push: the bytes land in the parameters' own memory
                target.copy_(packed)
                received = target
            assert runner.load_weights(received_as(bucket, received)) == []
            first = runner.params[bucket[0].name].data
            assert first.data_ptr() == received.data_ptr(), "the received memory is the parameters' memory"
        for name, tensor in weights.items():
            assert torch.equal(runner.params[name].data, tensor), name
        if seed == 2:  # whatever the loaded model's layout, after one push every bucket lands in place
            assert all(t is not None for t in targets)
    expected = ModelRunner(runner.model_path, device=cpu)
    expected.load_weights(list(weights.items()))
    torch.testing.assert_close(logits(runner), logits(expected), rtol=0, atol=0)


def test_a_different_order_or_dtype_is_not_received_in_place(runner: ModelRunner) -> None:
    bucket = max(buckets_of(runner), key=len)
    assert len(bucket) > 1
    weights = new_weights(runner, 3)
    packed = pack_flat([weights[m.name] for m in bucket], bucket)
    runner.load_weights(received_as(bucket, packed))
    specs = specs_of(bucket)
    cpu = torch.device("cpu")
    assert runner.flat_target(specs, cpu) is not None
    assert runner.flat_target(specs[::-1], cpu) is None
    assert runner.flat_target([(n, torch.bfloat16, s) for n, _, s in specs], cpu) is None


def test_other_dtypes_are_copied_in_not_adopted(runner: ModelRunner) -> None:
    name, param = next(iter(runner.params.items()))
    before = param.data.data_ptr()
    value = (param.data + 1).to(torch.bfloat16)
    assert runner.load_weights([(name, value)]) == []
    assert param.dtype == torch.float32 and param.data.data_ptr() == before
    assert torch.equal(param.data, value.float())
    assert runner.load_weights([("no.such.weight", value)]) == ["no.such.weight"]


def test_an_active_adapter_is_folded_out_before_receiving_in_place(
    runner: ModelRunner, tmp_path: Path
) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(runner.model_path, dtype=torch.float32)
    config = LoraConfig(r=2, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(str(tmp_path))
    bucket = buckets_of(runner)[0]
    weights = new_weights(runner, 4)
    packed = pack_flat([weights[m.name] for m in bucket], bucket)
    runner.load_weights(received_as(bucket, packed))
    runner.add_adapter("a", str(tmp_path))
    runner.forward(PROMPT, None, "a")  # folds the adapter's delta into the weights
    assert runner.active_adapter == "a"
    target = runner.flat_target(specs_of(bucket), torch.device("cpu"))
    assert runner.active_adapter is None
    assert target is not None and torch.equal(target, packed), "the memory holds the base weights again"


@pytest.mark.parametrize("in_place", [True, False])
def test_a_delta_bucket_lands_whether_or_not_the_parameters_lie_back_to_back(
    tiny_model_dir: Path, in_place: bool
) -> None:
    """After a full push received in place the delta applies to the parameters' own bucket; on weights as
    loaded (separate tensors) it applies to a packed copy that is copied back. Either way: bit-exact.
    A parameter held in another dtype than sent is refused, unchanged."""
    from miles.engines.cpu.engine import _apply_delta
    from miles.engines.errors import EngineRefused
    from miles.utils import delta

    runner = ModelRunner(str(tiny_model_dir), device=torch.device("cpu"), dtype="bfloat16")
    bucket = next(b for b in buckets_of(runner) if len(b) > 2)
    specs = specs_of(bucket)
    old = [runner.params[m.name].data.clone() for m in bucket]
    if in_place:
        runner.load_weights(received_as(bucket, pack_flat(old, bucket)))
        assert runner.flat_target(specs, runner.device) is not None
    else:
        assert runner.flat_target(specs, runner.device) is None
    new = [t.clone() for t in old]
    new[0].view(torch.int16).view(-1)[::7] += 1  # one ulp on every 7th value of the first tensor
    new[-1].view(-1)[0] = -new[-1].view(-1)[0]
    encoded = delta.encode_bucket(pack_flat(old, bucket), pack_flat(new, bucket))
    assert encoded.kind != "dense"
    _apply_delta(runner, specs, encoded.header, encoded.payload)
    for meta, want in zip(bucket, new, strict=True):
        assert torch.equal(runner.params[meta.name].data.view(torch.int16), want.view(torch.int16)), meta.name

    fp32 = ModelRunner(str(tiny_model_dir), device=torch.device("cpu"))  # auto on CPU: float32
    before = {m.name: fp32.params[m.name].data.clone() for m in bucket}
    with pytest.raises(EngineRefused, match="another dtype or shape than sent"):
        _apply_delta(fp32, specs, encoded.header, encoded.payload)
    assert all(torch.equal(fp32.params[n].data, t) for n, t in before.items())
