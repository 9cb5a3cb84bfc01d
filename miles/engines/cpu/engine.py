"""The CPU engine's core: request admission, pause modes, aborts, weight updates, adapters.

All waiting happens on one asyncio.Condition (`_changed`), notified on every state change; model work runs
on one worker thread (`_model_thread`), so forwards, weight loads and adapter switches never overlap.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch

from miles.contract.engine_args import DEFAULT_MAX_RUNNING_REQUESTS
from miles.engines.cpu.batching import StepScheduler
from miles.engines.cpu.graphs import DecodeOptions
from miles.engines.cpu.lora import AdapterError
from miles.engines.cpu.memory import KV_CACHE, WEIGHTS, MemoryState, empty_device_cache
from miles.engines.cpu.requests import HOLDS_KV, Phase, RequestHandle
from miles.engines.cpu.runner import ModelRunner
from miles.engines.cpu.versions import record_change
from miles.engines.errors import EngineRefused
from miles.engines.sglang_client import DIGEST_ACTION
from miles.engines.weight_group import GroupHandle, create_weight_update_group
from miles.utils import delta
from miles.utils.tensor_ipc import TensorPayloadError, deserialize_flattened_bucket, deserialize_named_tensors

log = logging.getLogger(__name__)
T = TypeVar("T")
PauseMode = Literal["abort", "retract", "in_place"]
GROUP_TIMEOUT_S = 1800.0  # like SGLang: torch's default; the trainer side bounds the push anyway


@dataclass
class TensorLoads:
    """What `/update_weights_from_tensor` payloads cost this engine, summed (/server_info's
    `tensor_loads`): unpickling maps the sender's memory (an IPC handle opened per storage), copying
    moves the bytes into the parameters."""

    payloads: int = 0
    tensors: int = 0
    unpickle_s: float = 0.0
    copy_s: float = 0.0

    def add(self, tensors: int, unpickle_s: float, copy_s: float) -> None:
        self.payloads += 1
        self.tensors += tensors
        self.unpickle_s += unpickle_s
        self.copy_s += copy_s

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in vars(self).items()}


class Engine:
    def __init__(
        self,
        model_path: str,
        *,
        served_model_name: str | None = None,
        legacy: bool = False,
        max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS,
        memory_saver: bool = False,
        weights_cpu_backup: bool = False,
        dtype: str = "auto",
        decode: DecodeOptions = DecodeOptions(),
    ) -> None:
        self.model_path = model_path
        self.dtype = dtype
        self.decode = decode
        self.served_model_name = served_model_name or model_path
        self.legacy = legacy
        self.runner: ModelRunner | None = None
        self.tensor_loads = TensorLoads()  # /update_weights_from_tensor's cost, for /server_info
        self.load_error: BaseException | None = None
        self.weight_version = "default"
        self.pause_mode: PauseMode | None = None
        self.session_open = False
        self.groups: dict[str, GroupHandle] = {}
        self.memory = MemoryState(memory_saver=memory_saver, weights_cpu_backup=weights_cpu_backup)
        self._memory_lock = asyncio.Lock()  # one release/resume at a time, as SGLang's scheduler runs them
        self._requests: dict[str, RequestHandle] = {}
        self._writers = 0
        self._changed = asyncio.Condition()
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-engine-model")
        self.scheduler = StepScheduler(self, max_running_requests)  # steps admitted requests, batched

    # ----- lifecycle -------------------------------------------------------------------------------------

    async def load(self) -> None:
        try:
            self.runner = await self.on_model_thread(
                lambda: ModelRunner(self.model_path, dtype=self.dtype, decode=self.decode)
            )
        except Exception as exc:  # reported by /health as 503 and in the log
            self.load_error = exc
            log.exception("loading %s failed", self.model_path)
        async with self._changed:
            self._changed.notify_all()

    async def wait_loaded(self) -> None:
        await self._wait(lambda: self.ready or self.load_error is not None)
        if self.runner is None:
            raise EngineRefused(f"the model failed to load: {self.load_error}")

    @property
    def ready(self) -> bool:
        return self.runner is not None

    def model(self) -> ModelRunner:
        if self.runner is None:
            raise EngineRefused("the model is still loading")
        return self.runner

    async def close(self) -> None:
        for group in self.groups.values():
            group.destroy()
        self.groups.clear()
        self.scheduler.close()
        self._model_thread.shutdown(wait=False, cancel_futures=True)

    async def on_model_thread(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, fn)

    # ----- requests --------------------------------------------------------------------------------------

    async def _wait(self, predicate: Callable[[], bool]) -> None:
        async with self._changed:
            await self._changed.wait_for(predicate)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def new_rid(self) -> str:
        return uuid.uuid4().hex

    def register(self, rid: str) -> RequestHandle:
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        handle = RequestHandle(rid)
        self._requests[rid] = handle
        return handle

    async def finish(self, handle: RequestHandle) -> None:
        if handle.phase is not Phase.FINISHED:
            handle.move(Phase.FINISHED)
        self._requests.pop(handle.rid, None)
        await self._notify()

    def _may_run(self) -> bool:
        # released weights or KV cache hold requests back like a pause (SGLang leaves that to the caller)
        unpaused = self.pause_mode is None and not self.memory.gates_requests
        return unpaused and self._writers == 0 and self.ready

    async def admit(self, handle: RequestHandle) -> None:
        """WAITING -> RUNNING once the engine is loaded, not paused, its memory not released and no weight
        update holds the gate."""
        await self._wait(lambda: handle.aborted or self._may_run())
        if not handle.aborted:
            handle.move(Phase.RUNNING)

    def must_park(self, handle: RequestHandle) -> bool:
        return self.pause_mode is not None and not handle.aborted

    def count(self, phases: frozenset[Phase]) -> int:
        return sum(1 for h in self._requests.values() if h.phase in phases)

    async def abort(self, rid: str = "", abort_all: bool = False) -> None:
        for handle in list(self._requests.values()):
            # n > 1 expands one rid into "<rid>_<i>" sub-requests; aborting the rid aborts them all
            if abort_all or (rid and (handle.rid == rid or handle.rid.startswith(f"{rid}_"))):
                handle.aborted = True
        await self._notify()

    # ----- pause / cache ---------------------------------------------------------------------------------

    async def pause(self, mode: PauseMode) -> None:
        """Pause; returns once no request is stepping (aborted ones finished, others parked)."""
        self.pause_mode = mode
        if mode == "abort":
            await self.abort(abort_all=True)
        await self._notify()
        await self._wait(lambda: self.count(frozenset({Phase.RUNNING})) == 0)

    async def resume(self) -> None:
        self.pause_mode = None
        await self._notify()

    def flush_refusal(self) -> str | None:
        """Why the cache cannot be flushed now (requests holding KV), or None."""
        holding = self.count(HOLDS_KV)
        if holding:
            waiting = self.count(frozenset({Phase.WAITING, Phase.RETRACTED}))
            return (
                f"Cache not flushed because there are pending requests. #queue-req: {waiting}, "
                f"#running-req: {holding}"
            )
        return None

    # ----- weight updates --------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def exclusive_weights(self) -> AsyncIterator[None]:
        """Writer side of the model: new requests wait, running ones finish first (at once when paused)."""
        self._writers += 1
        try:
            await self._wait(lambda: self.count(frozenset({Phase.RUNNING})) == 0)
            yield
        finally:
            self._writers -= 1
            await self._notify()

    async def init_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        if group_name in self.groups:
            raise EngineRefused(f"weight update group {group_name!r} already exists; destroy it first")
        if backend == "nccl" and not torch.cuda.is_available():
            raise EngineRefused("backend 'nccl' needs CUDA, and this engine runs on CPU: use backend 'gloo'")
        group = await asyncio.to_thread(
            create_weight_update_group,
            master_address=master_address,
            master_port=master_port,
            rank=rank_offset,  # one rank per engine: the CPU engine has no tensor parallelism
            world_size=world_size,
            backend=backend,
            group_name=group_name,
            timeout_s=GROUP_TIMEOUT_S,
        )
        self.groups[group_name] = group

    def destroy_group(self, group_name: str) -> None:
        group = self.groups.pop(group_name, None)
        if group is None:
            raise EngineRefused("The group to be destroyed does not exist.")
        group.destroy()

    def begin_session(self) -> None:
        if self.session_open:
            raise EngineRefused("A weight-update session is already open; call end_weight_update() first.")
        self.session_open = True

    def end_session(self) -> None:
        if not self.session_open:
            raise EngineRefused("There is no weight-update session open; call begin_weight_update() first.")
        self.session_open = False

    def check_session(self, operation: str = "update_weights_from_distributed") -> None:
        if not self.legacy and not self.session_open:
            raise EngineRefused(
                f"{operation} must run between begin_weight_update() and end_weight_update()."
            )

    def _group_and_specs(
        self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]
    ) -> tuple[GroupHandle, Specs, torch.device]:
        group = self.groups.get(group_name)
        if group is None:
            raise EngineRefused(
                f"weight update group {group_name!r} does not exist; call init_weights_update_group"
            )
        specs = [
            (n, _torch_dtype(d), [int(x) for x in s]) for n, d, s in zip(names, dtypes, shapes, strict=True)
        ]
        for name, _, shape in specs:
            if any(x < 0 for x in shape):
                raise EngineRefused(f"shape of {name!r} has a negative dimension: {shape}")
        device = self.model().device if group.backend == "nccl" else torch.device("cpu")
        return group, specs, device

    async def receive_bucket(
        self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]], flattened: bool
    ) -> list[tuple[str, torch.Tensor]]:
        group, specs, device = self._group_and_specs(group_name, names, dtypes, shapes)
        runner = self.model()

        def receive() -> list[tuple[str, torch.Tensor]]:
            # One hop onto the model thread for the whole bucket (finding the target, the receive): each
            # hop costs a thread wake-up, and a push makes one request per bucket. The model is exclusive
            # to this update meanwhile (exclusive_weights), so the blocking receive holds up nothing.
            if flattened:
                return _receive_flat(group, specs, device, runner.flat_target(specs, device))
            return _receive_tensors(group, specs, device, runner.tensor_targets(specs, device))

        return await self.on_model_thread(receive)

    async def receive_delta(
        self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]
    ) -> None:
        """One bucket of a delta push (docs/weights.md "Delta push"): a header and a payload broadcast,
        applied to the bucket's tensors (`_apply_delta`), which must hold what the full push before sent
        (the bytes the trainer diffs against). Both broadcasts are received before anything is refused, so
        the trainer's side of the bucket always completes."""
        group, specs, wire = self._group_and_specs(group_name, names, dtypes, shapes)
        runner = self.model()

        def receive_and_apply() -> None:
            header = torch.empty(delta.HEADER_WORDS, dtype=torch.int64, device=wire)
            group.broadcast(header, src=0)
            try:
                nbytes = delta.payload_nbytes(header.cpu())
            except delta.DeltaFormatError as exc:  # the payload's size is unknown: the group is out of step
                raise EngineRefused(f"delta bucket refused: {exc}") from exc
            payload = torch.empty(nbytes, dtype=torch.uint8, device=wire)
            group.broadcast(payload, src=0)
            # applied where the weights are (a gloo payload crossed on the host: it is the small part)
            try:
                _apply_delta(runner, specs, header.cpu(), payload.to(runner.device))
            except delta.DeltaFormatError as exc:
                raise EngineRefused(f"delta bucket refused: {exc}; push the full weights") from exc

        await self.on_model_thread(receive_and_apply)

    async def checksums(self, action: str, skip: list[str]) -> dict[str, str]:
        """/weights_checker: one checksum per parameter, by `action` (see protocol.CheckWeightsReq)."""
        if action not in CHECKSUMS:
            raise EngineRefused(f"Unsupported action={action!r}: this engine answers {sorted(CHECKSUMS)}")
        runner = self.model()
        checksum = CHECKSUMS[action]

        def compute() -> dict[str, str]:
            return checksum([(n, t) for n, t in runner.base_weights() if not any(s in n for s in skip)])

        return await self.on_model_thread(compute)

    async def load_received(self, named: list[tuple[str, torch.Tensor]]) -> None:
        runner = self.model()
        if not named:  # received in place: loaded already, no hop to the model thread
            return
        unknown = await self.on_model_thread(lambda: runner.load_weights(named))
        if unknown:
            raise _partially_updated(unknown)

    async def load_tensor_payload(self, payload: str, *, flattened: bool = False) -> None:
        """Copy the tensors of one `serialized_named_tensors` entry (`flattened`: one flattened bucket)
        into the parameters. They are the sender's memory, mapped (CUDA IPC, shared memory): copied,
        synchronised and let go on the model thread, before the caller answers and the sender may free
        them."""
        runner = self.model()
        unpickle = deserialize_flattened_bucket if flattened else deserialize_named_tensors

        def load() -> list[str]:
            started = time.perf_counter()
            named = unpickle(payload)
            mapped = time.perf_counter()
            try:
                return runner.load_weights(named, copy=True)
            finally:
                if runner.device.type == "cuda":
                    torch.cuda.synchronize(runner.device)
                self.tensor_loads.add(len(named), mapped - started, time.perf_counter() - mapped)

        try:
            unknown = await self.on_model_thread(load)
        except TensorPayloadError as exc:
            raise EngineRefused(f"Failed to update weights from tensor: {exc}") from exc
        if unknown:
            raise _partially_updated(unknown)

    async def set_version(self, new_version: str, abort_all_requests: bool) -> None:
        if abort_all_requests:
            await self.abort(abort_all=True)
            await self._wait(lambda: self.count(HOLDS_KV) == 0)
        self.change_version(new_version)

    def change_version(self, new_version: str) -> None:
        """Every live request records the version its tokens so far were sampled under (versions.py)."""
        if new_version == self.weight_version:
            return
        for handle in self._requests.values():
            if handle.state is not None and handle.phase is not Phase.FINISHED:
                record_change(handle.state.version_events, self.weight_version, len(handle.state.output_ids))
        self.weight_version = new_version

    # ----- memory occupation (memory.py) -----------------------------------------------------------------

    def _idle(self) -> bool:
        """SGLang's `is_fully_idle(ignore_waiting=paused)`: nothing holds a KV cache or updates weights, and
        nothing waits to run, unless paused (or memory is released: those requests wait for the resume)."""
        if self.count(HOLDS_KV) or self._writers:
            return False
        waiting = self.count(frozenset({Phase.WAITING, Phase.RETRACTED}))
        return waiting == 0 or self.pause_mode is not None or self.memory.gates_requests

    async def release_memory(self, tags: list[str] | None) -> None:
        """release_memory_occupation: refused unless idle; from then on new requests wait. Frees memory
        only with the memory saver (SGLang's --enable-memory-saver)."""
        chosen = self.memory.tags(tags)
        runner = self.model()
        async with self._memory_lock:
            self.memory.check_release(idle=self._idle())
            self.memory.released.update(chosen)  # no await since the idle check: nothing was admitted
            if not self.memory.memory_saver:
                return
            if WEIGHTS in chosen:
                backup = self.memory.weights_cpu_backup
                await self.on_model_thread(lambda: runner.release_weights_memory(cpu_backup=backup))
            if KV_CACHE in chosen:  # finished requests' caches sit in torch's allocator: give them back
                await self.on_model_thread(lambda: empty_device_cache(runner.device))

    async def resume_memory(self, tags: list[str] | None) -> None:
        """resume_memory_occupation: every tag named must be released; requests run again once neither
        weights nor kv_cache is released."""
        chosen = self.memory.tags(tags)
        runner = self.model()
        async with self._memory_lock:
            self.memory.check_resume(chosen)
            if WEIGHTS in chosen and self.memory.memory_saver:
                await self.on_model_thread(runner.resume_weights_memory)
            self.memory.released.difference_update(chosen)
        await self._notify()

    # ----- adapters --------------------------------------------------------------------------------------

    async def load_adapter(self, name: str, path: str) -> None:
        runner = self.model()
        if name in runner.adapters:
            raise EngineRefused(f"The LoRA adapter {name!r} is already loaded; unload it first.")
        try:
            await self.on_model_thread(lambda: runner.add_adapter(name, path))
        except (AdapterError, OSError) as exc:
            raise EngineRefused(f"Failed to load LoRA adapter {name!r} from {path!r}: {exc}") from exc

    async def unload_adapter(self, name: str) -> None:
        runner = self.model()
        if name not in runner.adapters:
            raise EngineRefused(f"The LoRA adapter {name!r} is not loaded.")
        await self.on_model_thread(lambda: runner.remove_adapter(name))

    def loaded_adapters(self) -> dict[str, str]:
        return {name: a.path for name, a in self.runner.adapters.items()} if self.runner else {}


def _partially_updated(unknown: list[str]) -> EngineRefused:
    return EngineRefused(
        f"Failed to update weights: {unknown} are not parameters of this model (or differ in shape). "
        "The weights are partially updated; discard this engine's weights and push again."
    )


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise EngineRefused(f"{name!r} is not a torch dtype name (send e.g. 'bfloat16')")
    return dtype


Specs = list[tuple[str, torch.dtype, list[int]]]


def _apply_delta(runner: ModelRunner, specs: Specs, header: torch.Tensor, payload: torch.Tensor) -> None:
    """One delta bucket onto the parameters: in place where they lie back to back as the bucket (after a
    full push received in place), else onto a packed copy of them that is then copied back. Either way
    the parameters must hold the bucket's tensors in the sent dtypes and shapes."""
    device = runner.device
    target = runner.flat_target(specs, device)
    if target is not None:
        delta.apply_bucket(target, header, payload)
        return
    params = runner.tensor_targets(specs, device)
    if any(p is None for p in params):
        missing = [name for (name, _, _), p in zip(specs, params, strict=True) if p is None]
        raise EngineRefused(
            f"delta bucket refused: this engine holds {missing[:3]} in another dtype or shape than sent "
            "(start it with --dtype as the trainer sends)"
        )
    views = [p.reshape(-1).view(torch.uint8) for p in params]  # type: ignore[union-attr]
    packed = torch.cat(views)
    delta.apply_bucket(packed, header, payload)
    offset = 0
    for view in views:
        view.copy_(packed[offset : offset + view.numel()])
        offset += view.numel()


def _sha256_checksums(named: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """SGLang's per-tensor checksum on CPU (weight_checker: the first 8 bytes of sha256, big-endian)."""
    out = {}
    for name, tensor in named:
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        out[name] = hashlib.sha256(memoryview(data)).digest()[:8].hex()
    return out


CHECKSUMS = {"checksum": _sha256_checksums, DIGEST_ACTION: delta.digest_many}


def _receive_tensors(
    group: GroupHandle, specs: Specs, device: torch.device, targets: list[torch.Tensor | None]
) -> list[tuple[str, torch.Tensor]]:
    """Blocking: one broadcast per tensor, each into its parameter where one matches, else a new tensor."""
    tensors = [
        target if target is not None else torch.empty(shape, dtype=dtype, device=device)
        for (_, dtype, shape), target in zip(specs, targets, strict=True)
    ]
    works = [group.broadcast_async(t, src=0) for t in tensors]
    for work in works:
        work.wait()
    return [(name, t) for (name, _, _), t in zip(specs, tensors, strict=True)]


def _receive_flat(
    group: GroupHandle, specs: Specs, device: torch.device, target: torch.Tensor | None
) -> list[tuple[str, torch.Tensor]]:
    """Blocking: one broadcast of the whole bucket, into `target` (the parameters' own memory, laid out as
    the bucket) when given, else into a new buffer that the load then adopts as the parameters' memory.
    Received in place, the bucket is loaded already: nothing is returned for `load_received` to do."""
    if target is not None:
        group.broadcast(target, src=0)
        return []
    offsets, total = [], 0
    for name, dtype, shape in specs:
        itemsize = dtype.itemsize
        if total % itemsize:
            raise EngineRefused(
                f"flattened bucket: {name!r} starts at byte {total}, not aligned to {itemsize}"
            )
        offsets.append(total)
        total += math.prod(shape) * itemsize
    buffer = target if target is not None else torch.empty(total, dtype=torch.uint8, device=device)
    group.broadcast(buffer, src=0)
    out = []
    for (name, dtype, shape), start in zip(specs, offsets, strict=True):
        nbytes = math.prod(shape) * dtype.itemsize
        out.append((name, buffer[start : start + nbytes].view(dtype).reshape(shape)))
    return out
