"""LoRA adapters on megatron-core's GPT: several named adapters on one frozen base, one active at a time.

megatron-core 0.16.1 has no LoRA of its own (it lives in Megatron-Bridge / NeMo), so this module adds it
explicitly. The base model is left untouched (its parameter names, its checkpoint load and its HF export stay
as they are): a forward hook on each target layer adds the active adapter's delta to the layer's output, and
the output layer's delta is applied by the logprob code (`output_delta`), which runs that layer itself.

Tensor parallelism, per layer kind (see lora_weights for the shards):
- column-parallel (linear_qkv, linear_fc1): the input gathered over the sequence when sequence parallel (its
  gradient split back, not summed: the LoRA branch gives every rank the full one), h = x A^T, then
  megatron's copy-to-TP region (identity forward, all-reduce backward: each rank's h gradient comes only from
  its own B rows), then this rank's B rows. A's gradient is then whole and identical on every TP rank.
- row-parallel (linear_proj, linear_fc2): h = x_r A_r^T summed over TP, then B whole, then scattered over
  the sequence when sequence parallel, as the base layer's output is.
- the output layer: the logprob code passes the whole sequence, replicated, and sums the TP ranks' input
  gradients itself; A's gradient is then partial per TP rank and is summed over TP before the step.

Pipeline parallelism: each stage holds the adapter layers of its own decoder layers (and the last stage the
output layer's), drawn from the same random stream as the whole adapter at pipeline 1, so every layout
starts from the same weights. Whole PEFT-named tensors (checkpoints, exports) come from every stage: each
stage gathers its layers over TP, and the first stage's rank (global rank 0 for the first data-parallel
replica) collects the other stages' over the pipeline group (`whole_hf`). A whole adapter read from a file
is checked whole, names and shapes, on every rank (the same answer everywhere), then each stage takes its
layers.

Adapter weights are fp32 whatever the base dtype, and the delta is computed in fp32 and added before casting
back, as peft does; the scale is alpha / rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)

from miles.contract.shape import ModelShape
from miles.errors import UserError
from miles.train.backends.lora import DEFAULT_LORA_ALPHA, init_seed, lora_config
from miles.train.megatron import lora_weights as lw
from miles.types import LoraSpec


def initial_hf_adapter(
    shape: ModelShape, spec: LoraSpec, seed: int, keep: list[lw.LoraRule] | None = None
) -> dict[str, torch.Tensor]:
    """A fresh adapter in PEFT names, as peft initialises one (A Kaiming-uniform, B zero), from `seed`:
    the same on every rank and under every layout. `keep`: only these layers' tensors (a pipeline stage's);
    the others are still drawn, one at a time, so that the random stream is the whole adapter's."""
    wanted = set(lw.hf_names(keep, shape)) if keep is not None else None
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for rule in lw.lora_rules(shape, spec):
        for name, size in lw.hf_shapes(rule, shape, spec.rank).items():
            tensor = torch.zeros(size)
            if ".lora_A." in name:
                torch.nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)
            if wanted is None or name in wanted:
                state[name] = tensor
    return state


@dataclass
class LoraLayer:
    """One adapter's (A, B) on one megatron layer, this rank's shards, and how B's rows pick their A."""

    rule: lw.LoraRule
    a: torch.nn.Parameter
    b: torch.nn.Parameter
    rows_of_part: list[torch.Tensor]  # this rank's output rows of each HF part
    inverse: torch.Tensor | None  # puts the parts' outputs back in the layer's row order (None: one part)

    def apply_b(self, h: torch.Tensor) -> torch.Tensor:
        return lw.apply_b(h, self.b, self.rows_of_part, self.inverse)


def _layer(rule: lw.LoraRule, a: torch.Tensor, b: torch.Tensor, shape: ModelShape) -> LoraLayer:
    tp, tp_rank = _tp()
    ids = lw.part_ids(rule, shape, tp, tp_rank).to(b.device)
    rows, inverse = lw.part_rows(ids, len(rule.hf_modules))
    param_a, param_b = torch.nn.Parameter(a), torch.nn.Parameter(b)
    # which tensors megatron-style TP cuts: the gradient norm sums those over TP and counts the rest once
    param_a.lora_tp_sharded = rule.a_kind != "replicated" and tp > 1
    param_b.lora_tp_sharded = rule.b_kind != "replicated" and tp > 1
    param_a.lora_tp_partial_grad = rule.module == lw.UNEMBED_LAYER and tp > 1
    return LoraLayer(rule, param_a, param_b, rows, inverse)


def _tp() -> tuple[int, int]:
    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )


@dataclass
class MegatronAdapter:
    key: str
    spec: LoraSpec
    scale: float
    layers: dict[str, LoraLayer]  # by megatron module path (this pipeline stage's layers)
    initial: dict[str, torch.Tensor]  # this rank's megatron-named shards as created, CPU: reset() copies them
    # None before the first step, and on a pipeline stage that holds none of the adapter's layers
    optimizer: torch.optim.Optimizer | None = None
    stepped: bool = False  # has Adam state (on every stage alike, also one without layers)

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """megatron names (`module.lora_A.weight`), this rank's shards."""
        pairs = []
        for layer in self.layers.values():
            pairs += [(layer.rule.a_name, layer.a), (layer.rule.b_name, layer.b)]
        return pairs

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named_parameters()]


class MegatronLoraAdapters:
    """The adapters on one GPT and the hooks that route its target layers through the active one."""

    def __init__(self, gpt: torch.nn.Module, shape: ModelShape, model_path: str, device: torch.device):
        for param in gpt.parameters():
            param.requires_grad_(False)
        self.gpt = gpt
        self.shape = shape
        self.model_path = model_path
        self.device = device
        self.pipeline = parallel_state.get_pipeline_model_parallel_world_size()
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        self.active: MegatronAdapter | None = None
        self._adapters: dict[str, MegatronAdapter] = {}
        self._hook_target_layers()

    def rules(self, spec: LoraSpec) -> list[lw.LoraRule]:
        """The LoRA layers of `spec` on this rank's pipeline stage."""
        return lw.lora_rules(self.shape, spec, self.pipeline, self.stage)

    def _hook_target_layers(self) -> None:
        every = LoraSpec(rank=1, train_attn=True, train_mlp=True, train_unembed=False)
        modules = dict(self.gpt.named_modules())
        for rule in self.rules(every):
            modules[rule.module].register_forward_hook(self._make_hook(rule.module))
        # with a frozen embedding the decoder's input needs no gradient, and megatron's full recompute (a
        # checkpoint function) would then return outputs without one: the adapters inside would never learn.
        # Later pipeline stages receive their input with a gradient from megatron's schedule.
        if self.gpt.pre_process:
            self.gpt.embedding.register_forward_hook(_input_needs_grad)

    def _make_hook(self, module_path: str) -> Callable:
        def add_delta(module: torch.nn.Module, args: tuple, output: tuple) -> tuple | None:
            adapter = self.active
            layer = adapter.layers.get(module_path) if adapter is not None else None
            if layer is None:
                return None
            out, bias = output
            delta = _layer_delta(layer, module, args[0], adapter.scale)
            return (out + delta).to(out.dtype), bias

        return add_delta

    # ---- the adapters --------------------------------------------------------------------------

    def keys(self) -> list[str]:
        return list(self._adapters)

    def has(self, key: str) -> bool:
        return key in self._adapters

    def get(self, key: str) -> MegatronAdapter:
        adapter = self._adapters.get(key)
        if adapter is None:
            raise UserError(f"no LoRA adapter {key!r} on this trainer (known: {sorted(self._adapters)})")
        return adapter

    def create(self, key: str, spec: LoraSpec) -> MegatronAdapter:
        if key in self._adapters:
            raise UserError(f"LoRA adapter {key!r} already exists")
        lora_config(spec, self.model_path)  # the transformers backend's checks: rank, alpha, modules
        alpha = DEFAULT_LORA_ALPHA if spec.alpha is None else float(spec.alpha)
        # each stage's part of the whole model's adapter: the pipeline-1 adapter's, at any layout
        initial = initial_hf_adapter(self.shape, spec, init_seed(key, spec), keep=self.rules(spec))
        adapter = MegatronAdapter(key, spec, alpha / spec.rank, {}, {})
        self._install(adapter, initial)
        adapter.initial = {n: p.detach().to("cpu", copy=True) for n, p in adapter.named_parameters()}
        self._adapters[key] = adapter
        return adapter

    def remove(self, key: str) -> None:
        adapter = self.get(key)
        if self.active is adapter:
            self.active = None
        del self._adapters[key]

    def _install(self, adapter: MegatronAdapter, hf: dict[str, torch.Tensor]) -> None:
        tp, tp_rank = _tp()
        rules = self.rules(adapter.spec)
        local = lw.hf_to_local(rules, _pick(hf, rules, self.shape), self.shape, tp, tp_rank)
        adapter.layers = {
            rule.module: _layer(
                rule,
                local[rule.a_name].to(self.device, torch.float32),
                local[rule.b_name].to(self.device, torch.float32),
                self.shape,
            )
            for rule in rules
        }

    def to_local(self, adapter: MegatronAdapter, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's megatron-named shards (on the device, fp32) of a whole adapter's PEFT-named tensors:
        every rank checks the whole adapter (so all refuse a bad one alike), then takes its stage's layers."""
        tp, tp_rank = _tp()
        whole = lw.lora_rules(self.shape, adapter.spec)
        stage = list(_rules(adapter))
        try:
            lw.check_names(whole, hf, self.shape)
            lw.check_shapes(whole, hf, self.shape, adapter.spec.rank)
            local = lw.hf_to_local(stage, _pick(hf, stage, self.shape), self.shape, tp, tp_rank)
        except ValueError as exc:
            raise UserError(f"LoRA adapter {adapter.key!r}: {exc}") from exc
        return {name: t.to(self.device, torch.float32) for name, t in local.items()}

    def load_hf(self, adapter: MegatronAdapter, hf: dict[str, torch.Tensor]) -> None:
        """Set the adapter's weights from a whole adapter's PEFT tensors (each rank takes its shards)."""
        self.load_local(adapter, self.to_local(adapter, hf))

    def load_local(self, adapter: MegatronAdapter, local: dict[str, torch.Tensor]) -> None:
        """Set the adapter's weights from this rank's megatron-named shards."""
        with torch.no_grad():
            for name, param in adapter.named_parameters():
                param.copy_(local[name])

    def activate(self, adapter: MegatronAdapter) -> None:
        """Route the hooked layers through `adapter` and make exactly its parameters trainable."""
        for other in self._adapters.values():
            for param in other.parameters():
                param.requires_grad_(other is adapter)
        self.active = adapter

    def output_delta(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The active adapter's output-layer delta for [n, hidden] whole-sequence inputs, or None."""
        adapter = self.active
        layer = adapter.layers.get(lw.UNEMBED_LAYER) if adapter is not None else None
        if layer is None:
            return None
        scale = adapter.scale
        return lambda hidden: layer.apply_b(hidden.to(torch.float32) @ layer.a.t()) * scale

    # ---- whole tensors in PEFT names ---------------------------------------------------------------

    def gather_hf(self, adapter: MegatronAdapter, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """PEFT-named whole tensors of this stage's layers from this rank's megatron-named ones (`local`: the
        weights, or any tensor of the same shapes such as an Adam moment): a collective over the TP group."""
        hf: dict[str, torch.Tensor] = {}
        for rule in _rules(adapter):
            per_rank = _all_gather_tp({rule.a_name: local[rule.a_name], rule.b_name: local[rule.b_name]})
            hf.update(lw.merge_to_hf([rule], per_rank, self.shape))
        return hf

    def whole_hf(self, adapter: MegatronAdapter, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`gather_hf` of every stage: the whole adapter's tensors (CPU under pipeline parallelism) on global
        rank 0, and on every rank at pipeline 1; a stage's own elsewhere. A collective on every rank."""
        mine = self.gather_hf(adapter, local)
        if self.pipeline == 1:
            return mine
        stages = gather_stages({n: t.detach().to("cpu") for n, t in mine.items()})
        if stages is None:
            return mine
        return {name: tensor for part in stages for name, tensor in part.items()}

    def hf_weights(self, adapter: MegatronAdapter) -> dict[str, torch.Tensor]:
        """The adapter's weights in PEFT names, whole on global rank 0 (see `whole_hf`)."""
        return self.whole_hf(adapter, {n: p.detach() for n, p in adapter.named_parameters()})


def _input_needs_grad(_module: torch.nn.Module, _args: tuple, out: torch.Tensor) -> None:
    if torch.is_grad_enabled() and not out.requires_grad:
        out.requires_grad_(True)


def _rules(adapter: MegatronAdapter) -> Iterator[lw.LoraRule]:
    return (layer.rule for layer in adapter.layers.values())


def _pick(
    hf: dict[str, torch.Tensor], rules: list[lw.LoraRule], shape: ModelShape
) -> dict[str, torch.Tensor]:
    """The tensors of `rules`' layers out of a whole adapter (those it lacks stay absent, to be named)."""
    return {name: hf[name] for name in lw.hf_names(rules, shape) if name in hf}


def gather_stages(part: Any) -> list[Any] | None:
    """Every pipeline stage's `part`, in stage order, on the first stage's TP rank 0 of the first
    data-parallel replica (global rank 0); None on the other ranks (other replicas and TP ranks hold the
    same parts). At pipeline 1, `[part]` on every rank. The parts are small (an adapter, Adam's step): they
    travel as objects over the pipeline group."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return [part]
    if parallel_state.get_tensor_model_parallel_rank() != 0 or parallel_state.get_data_parallel_rank() != 0:
        return None
    first = parallel_state.get_pipeline_model_parallel_first_rank()
    mine = torch_dist.get_rank() == first
    parts: list[Any] | None = (
        [None] * parallel_state.get_pipeline_model_parallel_world_size() if mine else None
    )
    torch_dist.gather_object(part, parts, dst=first, group=parallel_state.get_pipeline_model_parallel_group())
    return parts


def _all_gather_tp(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    tp, _ = _tp()
    if tp == 1:
        return [tensors]
    group = parallel_state.get_tensor_model_parallel_group()
    gathered: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for name, tensor in tensors.items():
        parts = [torch.empty_like(tensor) for _ in range(tp)]
        torch_dist.all_gather(parts, tensor.contiguous(), group=group)
        for rank, part in enumerate(parts):
            gathered[rank][name] = part
    return gathered


def _layer_delta(layer: LoraLayer, module: torch.nn.Module, x: torch.Tensor, scale: float) -> torch.Tensor:
    sequence_parallel = bool(getattr(module, "sequence_parallel", False))
    if layer.rule.row_parallel:
        h = reduce_from_tensor_model_parallel_region(x.to(torch.float32) @ layer.a.t())
        delta = layer.apply_b(h) * scale
        return scatter_to_sequence_parallel_region(delta) if sequence_parallel else delta
    if sequence_parallel:
        x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
    h = copy_to_tensor_model_parallel_region(x.to(torch.float32) @ layer.a.t())
    return layer.apply_b(h) * scale
