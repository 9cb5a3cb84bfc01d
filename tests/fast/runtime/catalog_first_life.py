"""A catalog controller's first life, as its own Ray driver (the restart test SIGKILLs it mid-life).

`python -m tests.fast.runtime.catalog_first_life SPEC.json`: SPEC names the Ray address, the Ray
namespace, the Redis URL and key prefix, the tiny model's directory and where to write what it did. It
starts a resident model's instance and one LoRA handle on it and one on a dynamic model (its own
instance; books in Redis), trains the resident's tenant a step, writes its forward-only losses before and
after and the books, then waits to be killed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import ray

from bench.tiny_catalog import build_router, tiny_catalog_model
from miles.contract.catalog import CatalogModel
from miles.seam.requests import ForwardBackwardRequest, OptimStepRequest
from miles.state.redis_store import RedisStateStore
from miles.types import AdamParams, Datum, LoraSpec

ROWS = [[5, 17, 300, 42, 9, 77, 512, 3], [40, 41, 42, 43, 44, 45]]


def restart_models() -> list[CatalogModel]:
    """The resident model whose instance survives the restart, and the dynamic one whose trainer dies
    meanwhile."""
    return [tiny_catalog_model("tiny-live", "lora", resident=True), tiny_catalog_model("tiny-dead", "lora")]


def train_batch() -> list[Datum]:
    return [
        Datum(np.asarray(r[:-1]), {"target_tokens": np.asarray(r[1:]), "weights": np.ones(len(r) - 1)})
        for r in ROWS
    ]


async def first_life(spec: dict[str, Any]) -> None:
    store = RedisStateStore(spec["redis_url"], key_prefix=spec["prefix"])
    router = build_router(
        restart_models(),
        Path(spec["model_dir"]),
        Path(spec["log_dir"]),
        store=store,
        namespace=spec["namespace"],
    )
    await router.controller.recover()
    await router.start()
    live, dead = restart_models()
    await asyncio.gather(
        router.create_model("alice", live.name, LoraSpec(rank=4)),
        router.create_model("bob", dead.name, LoraSpec(rank=4)),
    )
    base = await router.forward_backward(
        ForwardBackwardRequest("alice", train_batch(), "cross_entropy", {}, True)
    )
    await router.forward_backward(ForwardBackwardRequest("alice", train_batch(), "cross_entropy", {}, False))
    await router.optim_step(OptimStepRequest("alice", AdamParams(learning_rate=1e-2)))
    probe = await router.forward_backward(
        ForwardBackwardRequest("alice", train_batch(), "cross_entropy", {}, True)
    )
    books = {i.spec.model.name: [i.instance_id, i.spec.epoch] for i in router.controller.instances()}
    done = {"base_loss": base.metrics["loss:sum"], "loss": probe.metrics["loss:sum"], "instances": books}
    Path(spec["out"]).write_text(json.dumps(done))
    await asyncio.Event().wait()  # killed here, mid-life: no close(), nothing released


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    ray.init(address=spec["ray_address"], namespace=spec["namespace"], log_to_driver=False)
    asyncio.run(first_life(spec))


if __name__ == "__main__":
    main()
