"""TrainerWorker: the Ray actor of one data-parallel rank, wrapping one TrainBackend.

Trainer commands (miles.train.commands) arrive as objects through `execute`, by Ray call or over the
command channel the driver opens (`open_channel`, miles.train.channel), one at a time either way; the actor
has no method per command. `ping` answers in its own concurrency group.

Rendezvous: rank 0 opens a TCPStore on its node IP with an OS-chosen port (no fixed port, no pick-then-bind
race) and shares (ip, port); then every rank joins the default torch.distributed group through that store,
gloo on CPU (logical GPUs) and nccl on CUDA. The class is plain Python so it can be tested without Ray;
TrainerCell wraps it with `ray.remote`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, TypeVar

import ray
import torch
import torch.distributed as torch_dist

from miles.errors import UserError
from miles.train.backends.factory import build_backend
from miles.train.backends.transformers_backend import TransformersBackend
from miles.train.channel import ChannelServer
from miles.train.commands import TrainerCommand
from miles.train.dist import DistContext

log = logging.getLogger(__name__)
R = TypeVar("R")

DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
# Liveness probes run in their own Ray concurrency group, so a rank busy with a long forward_backward still
# answers `ping` at once and only a dead (or wedged-process) rank fails the probe.
HEALTH_GROUP = "health"
ACTOR_CONCURRENCY_GROUPS = {HEALTH_GROUP: 1}
CORE_LANE = "core"  # the core trainer cell's lane name in every membership


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise UserError(f"unknown torch dtype {dtype!r}; use e.g. 'float32' or 'bfloat16'")
    return value


class TrainerWorker:
    def __init__(self, rank: int, world_size: int, *, torch_threads: int = 1) -> None:
        os.environ.setdefault("OMP_NUM_THREADS", str(torch_threads))
        torch.set_num_threads(torch_threads)
        self.rank = rank
        self.world_size = world_size
        self._store: torch_dist.TCPStore | None = None
        self._backend: TransformersBackend | None = None
        self._core_lane: Any = None  # a HybridLane over this rank's backend, once elastic uses it
        # Commands arrive by Ray call and by the command channel (miles.train.channel): one at a time.
        self._command_lock = threading.Lock()
        self._channel: ChannelServer | None = None
        self._cuda_device: int | None = None  # set where the backend was built, for the channel's thread

    # ---- bring-up ---------------------------------------------------------------------------------

    def open_rendezvous(self) -> tuple[str, int]:
        """Rank 0 only: start the group's store on this node; returns (ip, port) for the other ranks."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 opens the rendezvous")
        ip = node_ip()
        self._store = torch_dist.TCPStore(
            ip, 0, world_size=self.world_size, is_master=True, wait_for_workers=False
        )
        return ip, self._store.port

    def setup(
        self,
        master: tuple[str, int] | None,
        model_path: str,
        train_mode: str,
        backend_kwargs: Mapping[str, Any] | None = None,
        collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
        log_dir: str | None = None,
    ) -> dict[str, Any]:
        """Join the DP group (when world_size > 1) and load the backend; returns where this rank runs.

        `log_dir`: this rank logs to log_dir/trainer-rank<r>.log (the job's logs/, a shared file system)."""
        if log_dir:
            _log_to_file(f"{log_dir}/trainer-rank{self.rank}.log")
        kwargs = dict(backend_kwargs or {})
        device = kwargs.pop("device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = resolve_dtype(kwargs.pop("dtype", torch.float32))
        dist = None
        if self.world_size > 1:
            self._join_group(master, device, collective_timeout_s)
            dist = DistContext(self.rank, self.world_size)
        backend = kwargs.pop("backend", "transformers")  # model.backend; megatron also takes `parallel`
        self._backend = build_backend(
            backend, model_path, train_mode=train_mode, device=device, dtype=dtype, dist=dist, **kwargs
        )
        if torch.cuda.is_available() and device.startswith("cuda"):
            self._cuda_device = torch.cuda.current_device()  # a thread's own: the channel's thread sets it
        where = {"rank": self.rank, "node_ip": node_ip(), "pid": os.getpid(), "device": device}
        log.info(
            "trainer rank %d of %d ready: %s, %s %s", self.rank, self.world_size, where, train_mode, dtype
        )
        return where

    def _join_group(self, master: tuple[str, int] | None, device: str, timeout_s: float) -> None:
        if master is None:
            raise ValueError("a multi-rank trainer needs rank 0's rendezvous address")
        timeout = timedelta(seconds=timeout_s)
        store = self._store
        if store is None:
            store = torch_dist.TCPStore(master[0], master[1], world_size=self.world_size, is_master=False)
        backend = "nccl" if device.startswith("cuda") else "gloo"
        torch_dist.init_process_group(
            backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout
        )

    @property
    def backend(self) -> TransformersBackend:
        if self._backend is None:
            raise RuntimeError("TrainerWorker.setup() has not run")
        return self._backend

    # ---- commands (every rank gets every command) ---------------------------------------------------

    def execute(self, command: TrainerCommand[R]) -> R | None:
        """Run one trainer command on this rank's backend (None on ranks other than 0 for rank-0 commands)."""
        if command.rank0_only and self.rank != 0:
            return None
        with self._command_lock:
            return command.run(self.backend)

    def open_channel(self, key: bytes) -> tuple[str, int]:
        """Listen for the driver's command channel (on this node's IP, an OS-chosen port); a driver proves
        `key` before it is heard. A second call (a driver that re-adopted this rank) replaces the listener."""
        if self._channel is not None:
            self._channel.close()
        self._channel = ChannelServer(key, node_ip(), self.execute, on_thread=self._channel_thread_start)
        return self._channel.address

    def _channel_thread_start(self) -> None:
        if self._cuda_device is not None:
            torch.cuda.set_device(self._cuda_device)

    # ---- the core lane of elastic hybrid training (docs/elastic.md) ---------------------------------

    def lane_call(self, method: str, *args: Any) -> Any:
        """This rank as part of the hybrid lanes' core lane: `method` of a HybridLane over this rank's
        backend. Rank 0 meets the lanes (their store and group sit beside the default group, which is
        never rebuilt); the other ranks of a core of several ranks take part in its steps only
        (miles/train/hybrid/core_lane.py says which calls reach every rank)."""
        if self._core_lane is None:
            # imported here: the lane module imports this one (concurrency groups, node_ip)
            from miles.train.hybrid.lane import HybridLane

            self._core_lane = HybridLane(CORE_LANE, torch_threads=torch.get_num_threads())
        with self._command_lock:
            if method == "adopt":
                return self._core_lane.adopt(args[0], self.backend)
            return getattr(self._core_lane, method)(*args)

    # ---- diagnostics ------------------------------------------------------------------------------

    @ray.method(concurrency_group=HEALTH_GROUP)
    def ping(self) -> int:
        return self.rank

    def shutdown(self) -> None:
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()


def _log_to_file(path: str) -> None:
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(min(root.level or logging.INFO, logging.INFO))
    logging.captureWarnings(True)
