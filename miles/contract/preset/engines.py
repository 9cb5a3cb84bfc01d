"""`engines:`: SGLang servers or the CPU engine, their tensor parallelism, count and arguments."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from miles.contract.preset.base import EnvMap, StrictModel, check_env_names


class EngineOptions(StrictModel):
    kind: Literal["sglang", "cpu"] = Field("sglang", description="SGLang servers or the CPU engine.")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel GPUs per engine.")
    per_node: int | None = Field(
        None, ge=1, description="Engines per engine node; default gpus_per_node / tp_size (cpu: 1)."
    )
    server_args: dict[str, Any] = Field(default_factory=dict, description="Extra engine server arguments.")
    env: EnvMap = Field(default_factory=dict, description="Extra environment of engine processes.")

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: EnvMap) -> EnvMap:
        return check_env_names(value)
