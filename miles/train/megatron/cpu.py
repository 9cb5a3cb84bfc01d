"""megatron-core on CPU: the few places megatron-core 0.16.1 asks for CUDA, pointed at the CPU.

Its rotary embedding moves its frequencies to `torch.cuda.current_device()` (and, under context
parallelism, slices them with a pinned index), its optimizer and gradient-norm code allocate small
buffers on 'cuda', its distributed optimizer accepts only `torch.cuda.*Tensor` parameters, its pipeline
schedule synchronises the CUDA stream, and under sequence parallelism its embedding forks the CUDA RNG
tracker. `run_on_cpu` redirects exactly those, process-wide and once: the megatron backend calls it when
its device is the CPU (a trainer process on CPU, for development and CI, has no CUDA to lose), so the
model maths, the TP/DP/PP collectives (gloo) and the backend's own logic run for real without a GPU.
"""

from __future__ import annotations

import contextlib
import types

import torch

_applied = False


def _cpu(device):
    return "cpu" if device is not None and str(device).startswith("cuda") else device


def run_on_cpu() -> None:
    """The few places megatron-core asks for CUDA, pointed at the CPU (this process, once)."""
    global _applied
    if _applied:
        return
    _applied = True
    import megatron.core.models.common.embeddings.rope_utils as rope_utils
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.pipeline_parallel.p2p_communication as p2p
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as rng
    import megatron.core.utils as utils

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None  # the pipeline's p2p exchange waits on its stream
    proxy = types.ModuleType("torch_on_cpu")
    proxy.__dict__.update(vars(torch))
    for name in ("tensor", "zeros", "empty"):
        real = getattr(torch, name)
        # no pinned host memory without CUDA (the rotary table's context-parallel slice asks for it)
        setattr(
            proxy,
            name,
            lambda *a, _real=real, **k: _real(
                *a, **{**k, "device": _cpu(k.get("device")), "pin_memory": False}
            ),
        )
    for module in (optimizer, clip_grads, utils, schedules, p2p, rope_utils):
        module.torch = proxy
    real_type = torch.Tensor.type

    def cuda_type_name(self, *args, **kwargs):
        name = real_type(self, *args, **kwargs)
        if args or kwargs or name not in ("torch.FloatTensor", "torch.BFloat16Tensor"):
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type_name
    rng.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()  # no dropout anywhere
    # a tied model's last pipeline stage moves its embedding copy to CUDA before all-reducing it
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
