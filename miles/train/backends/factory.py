"""The trainer backend a preset names (model.backend), built lazily: megatron-core loads only if asked."""

from __future__ import annotations

import importlib.util
from typing import Any

from miles.errors import UserError
from miles.train.backends.base import TrainBackend

BACKENDS = ("transformers", "megatron")


def build_backend(name: str, model_path: str, *, train_mode: str, **kwargs: Any) -> TrainBackend:
    """`kwargs`: the backend's own (device, dtype, dist, ...); `parallel` only for megatron."""
    if name == "transformers":
        from miles.train.backends.transformers_backend import TransformersBackend

        return TransformersBackend(model_path, train_mode=train_mode, **kwargs)
    if name == "megatron":
        if importlib.util.find_spec("megatron") is None:
            raise UserError(
                "model.backend megatron needs megatron-core on the trainer nodes; install the gpu extra: "
                "pip install 'miles-hpc[runtime,gpu]'"
            )
        from miles.train.backends.megatron_backend import MegatronBackend

        return MegatronBackend(model_path, train_mode=train_mode, **kwargs)
    raise UserError(f"unknown trainer backend {name!r}; use one of {', '.join(BACKENDS)}")
