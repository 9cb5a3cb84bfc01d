"""LocalRuntime with concurrent LoRA tenants: their forward_backward requests share one trainer command
(ForwardBackwardCoalescer) and each result equals the tenant run alone on its own backend."""

from __future__ import annotations

import asyncio
from pathlib import Path

from miles.runtime.local import LocalRuntime
from miles.seam.requests import ForwardBackwardRequest
from miles.train.backends.transformers_backend import TransformersBackend
from miles.types import LoraSpec
from miles.utils.http import close_clients
from tests.fast.train.test_multi_tenant import TENANTS, _assert_same_grads, _assert_same_output, _requests


async def test_concurrent_tenants_share_a_pass_through_the_local_runtime(tiny_model_dir: Path) -> None:
    alone = TransformersBackend(str(tiny_model_dir), train_mode="lora")
    runtime = await LocalRuntime.start(tiny_model_dir, model_name="tiny", lora_batch_window_s=600.0)
    try:
        for index, (key, rank, _, _) in enumerate(TENANTS):
            spec = LoraSpec(rank=rank, alpha=16.0, seed=10 + index)
            alone.create_adapter(key, spec)
            await runtime.create_model(key, "tiny", spec)
        requests = _requests()
        calls = [
            runtime.forward_backward(
                ForwardBackwardRequest(r.key, list(r.data), r.loss_fn, dict(r.loss_config), False)
            )
            for r in requests
        ]
        # every model has one waiting: one command at once; waiting out the 600 s window fails here
        got = await asyncio.wait_for(asyncio.gather(*calls), timeout=120)
        stats = runtime.coalescer.stats
        assert (stats.requests, stats.commands, stats.largest) == (len(TENANTS), 1, len(TENANTS))
        backend = runtime._trainer.backend
        for result, request in zip(got, requests, strict=True):
            _assert_same_output(result, request.run(alone))
            _assert_same_grads(backend, alone, request.key)
        # a released model is no companion: the others' requests stop waiting for it
        assert runtime.coalescer.active_models() == {key for key, *_ in TENANTS}
        await runtime.release_model(TENANTS[0][0])
        assert runtime.coalescer.active_models() == {key for key, *_ in TENANTS[1:]}
    finally:
        await runtime.close()
        await close_clients()
