"""megatron's optimizer: built for full fine-tuning, stepped with Tinker's per-step AdamW parameters, and its
state saved and restored per rank without pickle.

With the distributed optimizer each data-parallel rank owns a shard of the fp32 main parameters and of Adam's
moments; megatron's inner optimizers (torch AdamW without apex / Transformer Engine) hold exactly that shard.
Saving it shard by shard (one safetensors file per TP x DP rank) keeps a resume bit-exact and never gathers
the optimizer on one rank; a checkpoint therefore loads only under the same TP and DP sizes.
"""

from __future__ import annotations

import collections
import math
from pathlib import Path

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from safetensors.torch import load_file, save_file

from miles.train.backends import optim
from miles.types import AdamParams

MAIN_PARAMS = "main_params.safetensors"


def wrap_ddp(model: torch.nn.Module) -> DistributedDataParallel:
    """megatron's DDP: fp32 gradient buffers, summed (not averaged) over DP ranks, sharded for the
    distributed optimizer."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def build_optimizer(ddp: DistributedDataParallel, dtype: torch.dtype):
    config = OptimizerConfig(
        optimizer="adam",
        lr=AdamParams().learning_rate,
        weight_decay=0.0,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=True,
        clip_grad=math.inf,
    )
    # no overrides: weight decay applies to every parameter, as in the transformers backend (megatron's
    # default exempts norms and biases)
    return get_megatron_optimizer(config, [ddp], config_overrides={}, use_gloo_process_groups=False)


def optimizer_parts(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def apply_hyperparams(optimizer, adam: AdamParams, *, clip: bool = True) -> None:
    """This request's AdamW hyperparameters; `clip=False`: the caller clipped (megatron only measures)."""
    for group in optimizer.param_groups:
        group["lr"] = adam.learning_rate
        group["betas"] = (adam.beta1, adam.beta2)
        group["eps"] = adam.eps
        group["weight_decay"] = adam.weight_decay
    for part in optimizer_parts(optimizer):
        # an infinite bound measures the norm and never scales
        part.config.clip_grad = adam.grad_clip_norm if clip and adam.grad_clip_norm > 0 else math.inf


def step(optimizer, ddp: DistributedDataParallel, adam: AdamParams) -> float:
    """One AdamW step with this request's hyperparameters; returns the gradient norm before clipping."""
    apply_hyperparams(optimizer, adam)
    # megatron's own: the DP reduce-scatter, and the TP all-reduce of the replicated parameters each TP rank
    # sees only part of (q/k norms always, every norm under sequence parallelism)
    finalize_model_grads([ddp])
    _, grad_norm, _ = optimizer.step()
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    return float(grad_norm or 0.0)


def _inner_params(optimizer) -> list[tuple[str, torch.nn.Parameter, torch.optim.Optimizer]]:
    """This rank's fp32 main-parameter shards, named by (optimizer, group, index): stable across runs of
    the same layout."""
    named = []
    for o, part in enumerate(optimizer_parts(optimizer)):
        inner = part.optimizer
        for g, group in enumerate(inner.param_groups):
            named += [(f"{o}.{g}.{i}", param, inner) for i, param in enumerate(group["params"])]
    return named


def save(optimizer, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    named = _inner_params(optimizer)
    save_file({n: p.detach().to("cpu").contiguous() for n, p, _ in named}, str(directory / MAIN_PARAMS))
    for o, part in enumerate(optimizer_parts(optimizer)):
        mine = [(n, p) for n, p, inner in named if inner is part.optimizer]
        sub = directory / f"part{o}"
        sub.mkdir(exist_ok=True)
        optim.save_optimizer(part.optimizer, [n for n, _ in mine], [p for _, p in mine], sub)


def load(optimizer, ddp: DistributedDataParallel, directory: Path) -> None:
    """Main parameters and Adam state of this rank's shard; the model's weights follow from the main ones."""
    saved = load_file(str(directory / MAIN_PARAMS))
    named = _inner_params(optimizer)
    if set(saved) != {n for n, _, _ in named}:
        raise ValueError(f"{directory}: optimizer shards of another layout ({len(saved)} vs {len(named)})")
    with torch.no_grad():
        for name, param, _ in named:
            param.copy_(saved[name])
    for o, part in enumerate(optimizer_parts(optimizer)):
        mine = [(n, p) for n, p, inner in named if inner is part.optimizer]
        optim.load_optimizer(
            part.optimizer, [n for n, _ in mine], [p for _, p in mine], directory / f"part{o}"
        )
        part._copy_main_params_to_model_params()
    ddp.start_param_sync(force_sync=True)  # each DP rank wrote its shard: gather the whole weights back


def reset(optimizer) -> None:
    """A fresh Adam over the model's current weights (main parameters re-read from the model)."""
    for part in optimizer_parts(optimizer):
        part.optimizer.state = collections.defaultdict(dict)
    optimizer.reload_model_params()
