"""megatron-core's real GPTModel (built on CPU, one gloo rank): the mapping's names and shapes are its
parameters, and an HF checkpoint loaded into it exports back exactly. Skips without the gpu extra.

A forward pass cannot run here: megatron-core 0.16.1's rotary embedding moves its frequencies to
`torch.cuda.current_device()` and its distributed optimizer allocates on 'cuda' (tests/gpu/test_megatron.py
runs those on a GPU)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
from safetensors.torch import load_file

pytest.importorskip("megatron.core", reason="megatron-core is the gpu extra")

from miles.contract.preset.model import ParallelLayout
from miles.contract.shape import ModelShape
from miles.train.megatron.weights import tensor_rules


@pytest.fixture
def one_rank() -> Iterator[None]:
    from megatron.core import parallel_state

    torch_dist.init_process_group("gloo", store=torch_dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        torch_dist.destroy_process_group()


def test_megatrons_gpt_has_the_mappings_names_and_shapes_and_round_trips(
    one_rank, tiny_model_dir: Path
) -> None:
    from miles.train.megatron import model as mcore

    shape = ModelShape.from_model_dir(tiny_model_dir)
    mcore.init_parallel(ParallelLayout(), seed=0)
    gpt = mcore.build_gpt(shape, ParallelLayout(), torch.float32)
    params = {name: tuple(p.shape) for name, p in gpt.named_parameters()}
    assert sorted(params) == sorted(rule.mcore_name for rule in tensor_rules(shape))
    hf = load_file(str(tiny_model_dir / "model.safetensors"))
    mcore.load_hf_weights(gpt, tiny_model_dir, shape)
    qkv = dict(gpt.named_parameters())["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert params["decoder.layers.0.self_attention.linear_qkv.weight"] == tuple(qkv.shape) == (128, 64)
    exported = dict(mcore.iter_hf_tensors(gpt, shape))
    assert exported.keys() == hf.keys()
    assert all(torch.equal(exported[name], hf[name]) for name in hf)
    for rule in tensor_rules(shape):  # tagged as megatron's gradient norm and optimizer expect
        param = dict(gpt.named_parameters())[rule.mcore_name]
        sharded = rule.tp_kind != "replicated"
        assert getattr(param, "tensor_model_parallel", False) is sharded, rule.mcore_name
        if sharded:
            assert param.partition_dim == (1 if rule.tp_kind == "row" else 0), rule.mcore_name
    core = gpt.decoder.layers[0].self_attention.core_attention
    assert type(core).__name__ == "SdpaCoreAttention"  # the local spec's own would materialise [s, s]
