"""How an engine process is launched: the CPU engine or SGLang, with argv built as a list (no shell)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

EngineKind = Literal["cpu", "sglang"]


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    kind: EngineKind = "cpu"
    weight_api: Literal["current", "legacy"] = "current"
    api_key: str | None = None
    extra_args: tuple[str, ...] = ()  # appended verbatim to the engine's argv
    env: Mapping[str, str] = field(default_factory=dict)  # per-engine overrides on top of engine_env()
    gpus_per_engine: int = 1
    num_cpus: float = 1
    startup_timeout_s: float = 600.0
    threads: int = 1  # torch threads of the CPU engine
    log_dir: str | None = None  # engine i appends its output to log_dir/engine-<i>.log (shared FS)

    def __post_init__(self) -> None:
        if self.kind not in ("cpu", "sglang"):
            raise ValueError(f"engine kind must be 'cpu' or 'sglang', got {self.kind!r}")
        if self.weight_api not in ("current", "legacy"):
            raise ValueError(f"weight_api must be 'current' or 'legacy', got {self.weight_api!r}")
        if not Path(self.model_path).is_dir():
            raise ValueError(f"engine model_path {self.model_path!r} is not a directory")
        if self.gpus_per_engine < 1:
            raise ValueError(f"gpus_per_engine must be >= 1, got {self.gpus_per_engine}")

    def command(self, host: str, port: int) -> list[str]:
        """The engine's argv; every user-supplied value is one argv element, never shell text."""
        model = str(Path(self.model_path).resolve())
        if self.kind == "cpu":
            argv = [sys.executable, "-m", "miles.engines.cpu", "--model-path", model]
            argv += ["--port", str(port), "--host", host, "--threads", str(self.threads)]
            if self.weight_api == "legacy":
                argv.append("--legacy-weight-api")
        else:
            argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model]
            argv += ["--port", str(port), "--host", host, "--tp-size", str(self.gpus_per_engine)]
            argv += ["--skip-server-warmup", "--enable-metrics"]
        if self.api_key:
            # `--flag=value`: a value starting with "-" must not be read as another option
            argv.append(f"--api-key={self.api_key}")
        return argv + list(self.extra_args)
