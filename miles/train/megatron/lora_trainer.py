"""The megatron backend's LoRA commands: per-adapter AdamW steps, state and exports in PEFT names.

Each adapter has its own torch AdamW (fused), as in the transformers backend; megatron's DDP and distributed
optimizer are for full fine-tuning only. Gradients accumulate in the adapter parameters' `.grad` until
optim_step, which sums them over data-parallel ranks (optim_guard's prepare / reduce, so running out of
memory while preparing the step changes nothing), sums the output layer's A over TP (see lora.py), measures
the norm with TP-sharded tensors counted once, clips and steps. Under pipeline parallelism each stage steps
its own layers' parameters, and the norm is the whole adapter's (the stages' squared sums all-reduced over
the pipeline group), so the clipping and the step equal pipeline 1's; a stage without any of the adapter's
layers (an adapter on the output layer only) has no optimizer but still takes part in the collectives.

Checkpoints and exports hold whole tensors in PEFT names, gathered over TP, written by global rank 0: the
very files the transformers backend writes (miles_state.json, weights.safetensors, optimizer.safetensors /
.json; adapter_config.json + adapter_model.safetensors), so they resume under any TP / PP / DP layout and
the engines load the adapter as they load a transformers-backend one. Adam's moments map like the weights
(they are elementwise). Under pipeline parallelism rank 0 collects the other stages' tensors (lora.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as torch_dist
from megatron.core import parallel_state
from safetensors.torch import load_file, save_file

from miles.errors import UserError
from miles.train.backends import optim
from miles.train.backends.lora import lora_config, spec_from_json, spec_to_json
from miles.train.backends.optim_guard import (
    optim_step_out_of_memory_error,
    prepare_step,
    reduce_gradients,
)
from miles.train.backends.step_guard import any_rank_failed, release_memory
from miles.train.dist import DistContext
from miles.train.megatron.lora import MegatronAdapter, MegatronLoraAdapters, gather_stages
from miles.types import AdamParams, LoraSpec

STATE_META = "miles_state.json"
STATE_WEIGHTS = "weights.safetensors"
STATE_FORMAT = 1
MOMENTS = ("exp_avg", "exp_avg_sq")


class MegatronLoraTrainer:
    def __init__(self, adapters: MegatronLoraAdapters, dp: DistContext, device: torch.device) -> None:
        self.adapters = adapters
        self.dp = dp
        self.device = device
        self.world = DistContext(torch_dist.get_rank(), torch_dist.get_world_size())

    # ---- training ------------------------------------------------------------------------------

    def activate(self, key: str) -> MegatronAdapter:
        adapter = self.adapters.get(key)
        self.adapters.activate(adapter)
        return adapter

    def optim_step(self, key: str, adam: AdamParams) -> dict[str, float]:
        optim.validate_adam(adam)
        adapter = self.activate(key)
        params = adapter.parameters()
        # a pipeline stage without the adapter's layers has no optimizer, but joins every collective
        optimizer = adapter.optimizer or (optim.new_adamw(params, adam) if params else None)
        prepared, failure = (
            prepare_step(optimizer, params, self.dp) if optimizer is not None else (None, None)
        )
        if any_rank_failed(failure is not None, self.world, self.device):  # TP / PP peers too: no hang
            if prepared is not None:
                prepared.undo()
            release_memory(self.device)
            raise optim_step_out_of_memory_error(failure, len(params))
        if optimizer is not None and prepared is not None:  # (both or neither)
            reduce_gradients(prepared, params, self.dp)
            _sum_partial_over_tp(params)
            optim.apply_hyperparams(optimizer, adam)
        grad_norm = _clip_over_model_parallel(params, adam.grad_clip_norm, self.device)
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        adapter.optimizer, adapter.stepped = optimizer, True
        return {"grad_norm:mean": grad_norm, "learning_rate:mean": adam.learning_rate}

    def reset(self, key: str) -> None:
        adapter = self.adapters.get(key)
        self.adapters.load_local(adapter, adapter.initial)
        for param in adapter.parameters():
            param.grad = None
        adapter.optimizer, adapter.stepped = None, False

    def hf_gradients(self, key: str) -> dict[str, torch.Tensor]:
        """This rank's accumulated gradients in PEFT names, whole (collected as `whole_hf`; zeros where none):
        before optim_step sums them over DP ranks (and the output layer's A over TP ranks)."""
        adapter = self.adapters.get(key)
        named = adapter.named_parameters()
        grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in named}
        return self.adapters.whole_hf(adapter, grads)

    # ---- state ---------------------------------------------------------------------------------

    def save_state(self, key: str, path: Path, *, with_optimizer: bool) -> None:
        adapter = self.adapters.get(key)
        weights = self.adapters.hf_weights(adapter)
        saved_optimizer = with_optimizer and adapter.stepped
        moments = self._hf_moments(adapter) if saved_optimizer else {}
        adam_states = gather_stages(_adam_state(adapter)) if saved_optimizer else None
        if self.world.is_primary:
            path = Path(path)
            path.mkdir(parents=True, exist_ok=True)
            save_file(_cpu(weights), str(path / STATE_WEIGHTS))
            if adam_states is not None:  # a stage with layers has one (the last stage always has)
                _write_optimizer(next(a for a in adam_states if a is not None), moments, path)
            meta = {
                "format": STATE_FORMAT,
                "train_mode": "lora",
                "backend": "megatron",
                "lora_spec": spec_to_json(adapter.spec),
                "has_optimizer": saved_optimizer,
                "optimizer_empty": with_optimizer and not adapter.stepped,
            }
            (path / STATE_META).write_text(json.dumps(meta, indent=2) + "\n")
        torch_dist.barrier()

    def _hf_moments(self, adapter: MegatronAdapter) -> dict[str, dict[str, torch.Tensor]]:
        named = adapter.named_parameters()
        state = adapter.optimizer.state if adapter.optimizer is not None else {}
        return {m: self.adapters.whole_hf(adapter, {n: state[p][m] for n, p in named}) for m in MOMENTS}

    def load_state(
        self, key: str, path: Path, *, with_optimizer: bool, create: Callable[[str, LoraSpec], object]
    ) -> None:
        """Weights (and Adam) from a LoRA checkpoint of either backend; a key that does not exist yet is
        created with the checkpoint's spec (`create(key, spec)`)."""
        path = Path(path)
        meta = _read_meta(path)
        saved = spec_from_json(meta["lora_spec"])
        if not self.adapters.has(key):
            create(key, saved)
        adapter = self.adapters.get(key)
        _check_same_modules(adapter.spec, saved, path, key)
        self.adapters.load_hf(adapter, load_file(str(path / STATE_WEIGHTS)))
        for param in adapter.parameters():
            param.grad = None
        adapter.optimizer, adapter.stepped = None, False
        if with_optimizer and not meta.get("optimizer_empty"):
            if not meta.get("has_optimizer"):
                raise UserError(
                    f"checkpoint {path} was saved without optimizer state (a sampler snapshot or "
                    "save_state without the optimizer); load it without the optimizer"
                )
            adapter.optimizer, adapter.stepped = self._read_optimizer(adapter, path), True

    def _read_optimizer(self, adapter: MegatronAdapter, path: Path) -> torch.optim.Optimizer | None:
        """The adapter's AdamW with the checkpoint's state for this stage's layers (None: it has none)."""
        tensors = load_file(str(path / optim.OPTIMIZER_TENSORS))
        meta = json.loads((path / optim.OPTIMIZER_META).read_text())
        named = adapter.named_parameters()
        if not named:
            return None
        optimizer = optim.new_adamw([p for _, p in named])
        per_moment = {}
        for moment in MOMENTS:
            hf = {k.split("::", 1)[0]: v for k, v in tensors.items() if k.endswith(f"::{moment}")}
            per_moment[moment] = self.adapters.to_local(adapter, hf)
        step = next(v for k, v in tensors.items() if k.endswith("::step"))
        state_dict = optimizer.state_dict()
        state_dict["state"] = {
            index: {"step": step.clone(), **{m: per_moment[m][name] for m in MOMENTS}}
            for index, (name, _) in enumerate(named)
        }
        for group in state_dict["param_groups"]:
            group.update(lr=meta["lr"], betas=tuple(meta["betas"]), eps=meta["eps"], weight_decay=meta["wd"])
        optimizer.load_state_dict(state_dict)
        return optimizer

    # ---- exports -------------------------------------------------------------------------------

    def export_adapter(self, key: str, path: Path) -> None:
        """A standard PEFT directory: adapter_config.json + adapter_model.safetensors (rank 0 writes)."""
        adapter = self.adapters.get(key)
        weights = self.adapters.hf_weights(adapter)
        if self.world.is_primary:
            path = Path(path)
            path.mkdir(parents=True, exist_ok=True)
            lora_config(adapter.spec, self.adapters.model_path).save_pretrained(str(path))
            save_file(_cpu(weights), str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        torch_dist.barrier()

    def merged_deltas(self, key: str) -> dict[str, torch.Tensor]:
        """HF weight name -> the adapter's delta (scale x B A), whole, fp32 on the CPU, on global rank 0 (on
        every rank at pipeline 1); a collective on every rank."""
        adapter = self.adapters.get(key)
        weights = _cpu(self.adapters.hf_weights(adapter))
        deltas = {}
        for name, a in weights.items():
            if ".lora_A." in name:
                module = name.removeprefix("base_model.model.").split(".lora_A.")[0]
                b = weights[name.replace(".lora_A.", ".lora_B.")]
                deltas[f"{module}.weight"] = (b.float() @ a.float()) * adapter.scale
        return deltas


def _adam_state(adapter: MegatronAdapter) -> dict | None:
    """This stage's Adam step count and hyperparameters (equal on every stage); None on a stage without
    layers."""
    optimizer = adapter.optimizer
    if optimizer is None:
        return None
    group = optimizer.param_groups[0]
    step = next(iter(optimizer.state.values()))["step"]
    meta = {
        "lr": group["lr"],
        "betas": list(group["betas"]),
        "eps": group["eps"],
        "wd": group["weight_decay"],
    }
    return {"step": step.detach().to("cpu", copy=True), "meta": meta}


def _write_optimizer(adam_state: dict, moments: dict[str, dict[str, torch.Tensor]], path: Path) -> None:
    """optim.save_optimizer's files: `<PEFT name>::<state key>` tensors and the group's json."""
    tensors = {f"{name}::step": adam_state["step"].clone() for name in moments[MOMENTS[0]]}  # unshared
    for moment, hf in moments.items():
        tensors.update({f"{name}::{moment}": t for name, t in hf.items()})
    save_file(_cpu(tensors), str(path / optim.OPTIMIZER_TENSORS))
    (path / optim.OPTIMIZER_META).write_text(json.dumps(adam_state["meta"]) + "\n")


def _read_meta(path: Path) -> dict:
    meta_path = path / STATE_META
    if not meta_path.is_file():
        raise UserError(f"{path} is not a trainer checkpoint (no {STATE_META})")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != STATE_FORMAT or meta.get("train_mode") != "lora":
        raise UserError(
            f"checkpoint {path} is {meta.get('train_mode')!r} (format {meta.get('format')}); "
            f"this trainer is 'lora' (format {STATE_FORMAT})"
        )
    return meta


def _check_same_modules(current: LoraSpec, saved: LoraSpec, path: Path, key: str) -> None:
    mine = (current.rank, current.train_attn, current.train_mlp, current.train_unembed)
    theirs = (saved.rank, saved.train_attn, saved.train_mlp, saved.train_unembed)
    if mine != theirs:
        raise UserError(
            f"checkpoint {path} holds a LoRA adapter of rank {saved.rank} on different modules or rank than "
            f"model {key} (rank {current.rank}); create the model from the checkpoint instead "
            "(create_training_client_from_state)"
        )


def _cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}


def _tp_group():
    return parallel_state.get_tensor_model_parallel_group()


def _sum_partial_over_tp(params: Sequence[torch.nn.Parameter]) -> None:
    for param in params:
        if getattr(param, "lora_tp_partial_grad", False):
            torch_dist.all_reduce(param.grad, group=_tp_group())


def _squared_sum(params: Sequence[torch.nn.Parameter], device: torch.device) -> torch.Tensor:
    if not params:
        return torch.zeros((), device=device)
    return torch.stack([p.grad.float().square().sum() for p in params]).sum()  # type: ignore[union-attr]


def _clip_over_model_parallel(
    params: Sequence[torch.nn.Parameter], grad_clip_norm: float, device: torch.device
) -> float:
    """The whole adapter's gradient norm before clipping: TP shards summed over TP, replicated tensors
    counted once, every pipeline stage's summed over the pipeline group; clips in place when
    grad_clip_norm > 0 (the same coefficient as torch's clip_grad_norm_)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pipeline = parallel_state.get_pipeline_model_parallel_world_size()
    if tp == 1 and pipeline == 1:
        return optim.clip_and_measure(params, grad_clip_norm)
    total = _squared_sum([p for p in params if p.lora_tp_sharded], device)
    if tp > 1:
        torch_dist.all_reduce(total, group=_tp_group())
    total = total + _squared_sum([p for p in params if not p.lora_tp_sharded], device)
    if pipeline > 1:
        torch_dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    norm = float(total.sqrt())
    if grad_clip_norm > 0 and math.isfinite(norm):
        coefficient = min(1.0, grad_clip_norm / (norm + 1e-6))
        for param in params:
            param.grad.mul_(coefficient)  # type: ignore[union-attr]
    return norm
