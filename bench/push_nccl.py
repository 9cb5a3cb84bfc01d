"""Full-weight push without Ray or HTTP vs a raw broadcast of the same bytes, same processes, same run.

    python3 bench/push_nccl.py [--json] [--bucket-mib 512,64] [--repeats 5]   # 2 GPUs, nccl
    python bench/push_nccl.py --small                                        # tiny model, CPU, gloo

Trainer process (GPU `--trainer-gpu`): TransformersBackend, full fine-tuning, takes one AdamW step, then
runs the weight sender's steps (miles.weights.sender) as a trainer actor runs them in a real push.
Driver process (this one, GPU `--engine-gpu`): hosts the CPU engine's `Engine` (on CUDA when there is one)
and runs the real driver, `miles.weights.push.push_full_weights`, under the real InferenceController
bracket. Its engine client calls `Engine` the way the engine's HTTP routes do; only the transport (HTTP,
Ray) is left out. Buckets come from `miles.utils.buckets.plan_buckets`, as in the real push.

Per bucket size it reports: the whole push (with the weight-update group's creation), its data phase
(after the join until the engine's device holds and has loaded every byte), a raw broadcast of the same
bucket sizes between the same two processes (fixed buffers, no packing), and the split that explains the
gap: trainer-side pack, engine-side unpack + load, each timed on its own with the device synchronised.
Correctness, every run: after the push the engine's tensors equal the trainer's (per-tensor sums, exactly)
and its logprobs equal the trainer's, while before the push (after the trainer's step) they did not.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the lent machines forbid NVLink multicast

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from miles.engines.cpu.engine import Engine  # noqa: E402
from miles.engines.sglang_client import DELTA_LOAD_FORMAT  # noqa: E402
from miles.engines.weight_group import create_weight_update_group, pick_master_port  # noqa: E402
from miles.rollout.cell_state import SERVING_STATES, CellState, check_transition  # noqa: E402
from miles.rollout.controller import InferenceController  # noqa: E402
from miles.utils.buckets import TensorMeta, pack_flat, plan_buckets, unpack_flat  # noqa: E402
from miles.weights.push import PushConfig, drop_kept_group, push_full_weights  # noqa: E402
from miles.weights.sender import Describe  # noqa: E402

PROBE_TOKENS = 96
_T0 = time.perf_counter()


def _log(message: str) -> None:
    """Progress on stderr: where a run that hangs in a collective stopped."""
    print(
        f"[push_nccl {os.getpid()} +{time.perf_counter() - _T0:.1f}s] {message}", file=sys.stderr, flush=True
    )


def _visible(first: str, other: str) -> str:
    """CUDA_VISIBLE_DEVICES for one process: its own GPU first (so "cuda" and every thread's default device
    are that GPU), the peer's second (so NCCL sees the peer and can use its peer-to-peer path)."""
    return f"{first},{other}"


# `--model deep`: Qwen3-0.6B's layers and tensor count, each tensor tiny (about 2 MB in all in fp32).
DEEP_WIDTHS = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16
)
STEP_LR = 1e-3  # large enough that one AdamW step moves bf16 weights (and so the logprobs) visibly


# ----- the trainer process ----------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TrainerOps:
    """What the driver asks of the trainer process; `sender` is the real push's trainer side."""

    def __init__(self, model_dir: str, dtype: torch.dtype) -> None:
        from miles.train.backends.transformers_backend import TransformersBackend

        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.backend = TransformersBackend(
            model_dir, train_mode="full", device=device, dtype=dtype, compile_layers=False
        )
        self.device = self.backend.device

    def sender(self, command: Any) -> Any:
        """One weight-sender step, run as the trainer actor runs it: `command.run(backend)` (commands
        are TrainerCommands) or, on trees before that refactor, `run_sender(backend, command)`."""
        if callable(getattr(command, "run", None)):
            return command.run(self.backend)
        from miles.weights import sender

        return sender.run_sender(self.backend, command)

    def step(self, tokens: np.ndarray, lr: float = STEP_LR) -> float:
        from miles.types import AdamParams

        datum = _datum(tokens)
        out = self.backend.forward_backward("full", [datum, datum], "cross_entropy", {})
        self.backend.optim_step("full", AdamParams(learning_rate=lr))
        return out.metrics["loss:sum"]

    def logprobs(self, tokens: np.ndarray) -> np.ndarray:
        out = self.backend.forward_backward("full", [_datum(tokens)], "cross_entropy", {}, forward_only=True)
        return np.asarray(out.logprobs[0], dtype=np.float64)

    def checksums(self) -> dict[str, tuple[float, float]]:
        return {name: _checksum(t) for name, t in self.backend.iter_hf_weights()}

    def weight_bytes(self) -> dict[str, torch.Tensor]:
        """Every pushed tensor's bytes, to compare with the engine's exactly (small models only)."""
        return {n: t.detach().cpu().contiguous().view(torch.uint8) for n, t in self.backend.iter_hf_weights()}

    def pack_seconds(self, buckets: list[list[str]], repeats: int) -> float:
        """The sender's per-bucket pack (`pack_flat` of the named tensors), all buckets, device synced."""
        tensors = dict(self.backend.iter_hf_weights())
        times = []
        for _ in range(repeats):
            _sync(self.device)
            start = time.perf_counter()
            for names in buckets:
                chosen = [tensors[n].contiguous() for n in names]
                pack_flat(chosen, [TensorMeta.of(n, t) for n, t in zip(names, chosen, strict=True)])
            _sync(self.device)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def raw_send(self, port: int, sizes: list[int], repeats: int, backend: str, device: str = "") -> None:
        group = _join_raw(port, 0, backend)
        device = device or self.device
        buffers = [torch.randint(0, 255, (s,), dtype=torch.uint8, device=device) for s in sizes]
        flag = torch.zeros(1, device=device)
        for _ in range(repeats):
            group.broadcast(flag, src=0)
            for buffer in buffers:
                group.broadcast(buffer, src=0)
            group.broadcast(flag, src=1)  # the receiver's ack: the next round starts only after it
            _sync(self.device)
        group.destroy()


def _datum(tokens: np.ndarray) -> Any:
    from miles.types import Datum

    weights = np.ones(len(tokens) - 1, dtype=np.float32)
    return Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights})


def _checksum(tensor: torch.Tensor) -> tuple[float, float]:
    wide = tensor.detach().double()
    return float(wide.sum()), float(wide.abs().sum())


def _join_raw(port: int, rank: int, backend: str) -> Any:
    return create_weight_update_group(
        master_address="127.0.0.1", master_port=port, rank=rank, world_size=2, backend=backend,
        group_name="raw", timeout_s=300,
    )  # fmt: skip


def trainer_main(conn: Any, model_dir: str, dtype_name: str, visible: str | None, watchdog_s: float) -> None:
    if visible is not None:  # before anything touches CUDA in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    if watchdog_s > 0:
        faulthandler.dump_traceback_later(watchdog_s, exit=True)
    torch.set_num_threads(4)
    try:
        ops = TrainerOps(model_dir, getattr(torch, dtype_name))
        conn.send(("ok", str(ops.device)))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    while True:
        op, args = conn.recv()
        if op == "stop":
            return
        try:
            conn.send(("ok", getattr(ops, op)(*args)))
        except BaseException as exc:
            conn.send(("error", f"{op}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class TrainerProcess:
    """The trainer in its own process, a TrainerClient of push_full_weights for the sender's steps."""

    def __init__(self, model_dir: Path, dtype: str, visible: str | None, watchdog_s: float = 0.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        args = (child, str(model_dir), dtype, visible, watchdog_s)
        self._proc = ctx.Process(target=trainer_main, args=args)
        self._proc.start()
        self._lock = threading.Lock()
        self.device = self._reply()

    def _reply(self) -> Any:
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"trainer process: {value}")
        return value

    def request(self, op: str, *args: Any) -> Any:
        with self._lock:
            self._conn.send((op, args))
            return self._reply()

    async def run(self, command: Any) -> Any:
        return await asyncio.to_thread(self.request, "sender", command)

    def stop(self) -> None:
        with self._lock:
            self._conn.send(("stop", ()))
        self._proc.join(60)
        if self._proc.is_alive():
            self._proc.kill()


# ----- the engine, in this process -------------------------------------------------------------------------


class DirectEngineClient:
    """The SGLangApiClient calls push_full_weights makes, answered by an in-process Engine the way the CPU
    engine's HTTP routes answer them (miles/engines/cpu/server.py); a refusal raises."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # Measurement only: when the group was joined, and when the device had loaded the last bucket
        # (the one synchronisation added, after the last bucket, where nothing else is queued behind it).
        self.expect_buckets = 0
        self.received = 0
        self.marks: dict[str, float] = {}

    async def pause_generation(self, mode: str = "abort") -> None:
        await self.engine.pause(mode)  # type: ignore[arg-type]

    async def continue_generation(self) -> None:
        await self.engine.resume()

    async def flush_cache(self, timeout_s: float = 0.0) -> None:
        if refusal := self.engine.flush_refusal():
            raise RuntimeError(refusal)

    async def begin_weight_update(self) -> None:
        self.engine.begin_session()
        self.received = 0
        self.marks = {}

    async def end_weight_update(self) -> None:
        self.engine.end_session()

    async def init_weights_update_group(self, **group: Any) -> None:
        await self.engine.init_group(**group)
        self.marks["joined"] = time.perf_counter()

    async def destroy_weights_update_group(self, group_name: str) -> None:
        self.engine.destroy_group(group_name)

    async def update_weights_from_distributed(
        self, *, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
        flush_cache: bool = False, load_format: str | None = None,
    ) -> None:  # fmt: skip
        self.engine.check_session()
        self.marks.setdefault("joined", time.perf_counter())  # a kept group: the transfer starts here
        async with self.engine.exclusive_weights():
            if load_format == DELTA_LOAD_FORMAT:
                await self.engine.receive_delta(group_name, names, dtypes, shapes)
            else:
                flat = load_format == "flattened_bucket"
                named = await self.engine.receive_bucket(group_name, names, dtypes, shapes, flat)
                await self.engine.load_received(named)
        self.received += 1
        if self.received == self.expect_buckets:
            _sync(self.engine.model().device)
            self.marks["landed"] = time.perf_counter()

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> None:
        await self.engine.set_version(new_version, abort_all_requests)

    async def weights_checker(self, action: str = "checksum") -> dict[str, Any]:
        checksums = await self.engine.checksums(action, [])  # the route's answer, less success/message
        return {"success": True, "ranks": [{"checksums": checksums}]}

    async def health(self, timeout_s: float | None = None) -> bool:
        return self.engine.ready


@dataclass
class DirectEngineCell:
    """What InferenceController reads of an engine cell, for the in-process engine."""

    client: DirectEngineClient
    state: CellState = CellState.PENDING_WEIGHTS  # loaded from disk, not the trainer's weights yet
    name: str = "engine cell 0 (in process)"
    gpus: int = 1
    problem: str | None = None

    @property
    def serving(self) -> bool:
        return self.state in SERVING_STATES

    def _move(self, new: CellState) -> None:
        check_transition(self.name, self.state, new)
        self.state = new

    def mark_ready(self) -> None:
        self._move(CellState.READY)

    def mark_pending(self) -> None:
        if self.state is CellState.READY:
            self._move(CellState.PENDING_WEIGHTS)

    def mark_failed(self, reason: str) -> None:
        self.problem = reason
        self._move(CellState.FAILED)


# ----- measurements ----------------------------------------------------------------------------------------


@dataclass
class BucketRun:
    bucket_mib: float
    buckets: int
    bytes: int
    push_s: float  # whole push_full_weights + the engine's device synchronised
    transfer_s: float  # the engine joined the group -> its device has loaded the last bucket
    phases: dict[str, float]  # PushReport.seconds of the median push
    raw_s: float  # raw broadcast of the same bucket sizes, fixed buffers
    pack_s: float  # trainer: pack_flat of every bucket
    unpack_load_s: float  # engine: views + clone of every bucket, then load_received
    push_gbps: float = 0.0
    transfer_gbps: float = 0.0
    raw_gbps: float = 0.0
    transfer_over_raw: float = 0.0  # the headline: push bytes/s over raw bytes/s
    push_over_raw: float = 0.0

    def __post_init__(self) -> None:
        self.push_gbps = self.bytes / self.push_s / 1e9
        self.transfer_gbps = self.bytes / self.transfer_s / 1e9
        self.raw_gbps = self.bytes / self.raw_s / 1e9
        self.transfer_over_raw = self.raw_s / self.transfer_s
        self.push_over_raw = self.raw_s / self.push_s


@dataclass
class Check:
    max_diff_before: float  # engine vs trainer logprobs after the trainer's step, before any push
    max_diff_after: float  # the same after the push
    tensors: int
    tensors_equal: int  # per-tensor (sum, |sum|) identical on both sides
    step_loss: float


@dataclass
class Report:
    device: str
    model: str
    dtype: str
    tensors: int
    model_bytes: int
    check: Check
    runs: list[BucketRun] = field(default_factory=list)


async def timed_push(
    controller: InferenceController, trainer: TrainerProcess, config: PushConfig, client: DirectEngineClient
) -> tuple[Any, float, float]:
    """(PushReport, whole push seconds, transfer seconds); the push of one bucket plan, timed."""
    start = time.perf_counter()
    report = await push_full_weights(controller, trainer, config)
    _sync(client.engine.model().device)
    end = time.perf_counter()
    if client.received != report.buckets or "landed" not in client.marks:
        raise RuntimeError(f"the engine got {client.received} buckets, the push sent {report.buckets}")
    return report, end - start, client.marks["landed"] - client.marks["joined"]


def raw_seconds(trainer: TrainerProcess, sizes: list[int], repeats: int, backend: str, device) -> float:
    """Broadcast fixed buffers of `sizes` from the trainer process; timed here, between synchronisations.
    Both sides' buffers are on `device` (the host for gloo's raw wire)."""
    port = pick_master_port("127.0.0.1")
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(trainer.request, "raw_send", port, sizes, repeats, backend, str(device))
        group = _join_raw(port, 1, backend)
        buffers = [torch.empty(s, dtype=torch.uint8, device=device) for s in sizes]
        flag = torch.zeros(1, device=device)
        times = []
        for _ in range(repeats):
            group.broadcast(flag, src=0)
            _sync(device)
            start = time.perf_counter()
            for buffer in buffers:
                group.broadcast(buffer, src=0)
            _sync(device)
            times.append(time.perf_counter() - start)
            group.broadcast(flag, src=1)
        group.destroy()
        sent.result()
    return statistics.median(times)


async def unpack_load_seconds(engine: Engine, buckets: list[list[TensorMeta]], repeats: int) -> float:
    """The engine's post-wire work per bucket: views into the flat buffer (as `_receive` makes them), then
    `load_received`. The buffers hold the engine's own weights, so loading changes nothing."""
    runner = engine.model()
    buffers = [pack_flat([runner.params[m.name].detach() for m in b], b) for b in buckets]
    times = []
    for _ in range(repeats):
        _sync(runner.device)
        start = time.perf_counter()
        for buffer, bucket in zip(buffers, buckets, strict=True):
            named = [(m.name, t) for m, t in zip(bucket, unpack_flat(buffer, bucket), strict=True)]
            await engine.load_received(named)
        _sync(runner.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def engine_logprobs(engine: Engine, tokens: np.ndarray) -> np.ndarray:
    logits, _ = engine.model().forward(tokens.tolist(), None, None)
    logp = torch.log_softmax(logits.double(), -1)[:-1]
    return logp.gather(-1, torch.as_tensor(tokens[1:])[:, None])[:, 0].numpy()


def engine_checksums(engine: Engine, names: list[str]) -> dict[str, tuple[float, float]]:
    params = engine.model().params
    return {name: _checksum(params[name]) for name in names}


# ----- the run ----------------------------------------------------------------------------------------------


def write_model(path: Path, model: str, dtype: torch.dtype, device: str) -> None:
    """Config (Qwen3-0.6B's shape or the tiny test shape), the tiny tokenizer, seeded random weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    from miles.models.tiny import TinyModelSpec, build_config, build_tokenizer

    build_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    if model in ("qwen3-0.6b", "deep"):
        from train_throughput import QWEN3_0_6B

        shape = dict(QWEN3_0_6B)
        if model == "deep":  # Qwen3-0.6B's 311 tensors at tiny widths: the push's control dominates
            shape.update(DEEP_WIDTHS, vocab_size=TinyModelSpec().vocab_size)
        config = Qwen3Config(**shape, **ids)
    else:
        config = build_config(TinyModelSpec(), ids["eos_token_id"], ids["pad_token_id"])
    torch.manual_seed(0)
    with torch.device(device):
        net = AutoModelForCausalLM.from_config(config, dtype=dtype)
    net.save_pretrained(str(path), safe_serialization=True)


async def run(args: argparse.Namespace, model_dir: Path) -> Report:
    engine = Engine(str(model_dir))
    await engine.load()
    await engine.wait_loaded()
    device = engine.model().device
    _log(f"engine loaded on {device}")
    visible = _visible(args.trainer_gpu, args.engine_gpu) if args.backend == "nccl" else None
    trainer = TrainerProcess(model_dir, args.dtype, visible, args.watchdog_s)
    _log(f"trainer ready on {trainer.device}")
    try:
        client = DirectEngineClient(engine)
        controller = InferenceController([DirectEngineCell(client)])
        check = await push_and_check(controller, trainer, client, args)
        report = Report(str(device), args.model, args.dtype, check.tensors, 0, check)
        _log(f"check done: {check}")
        for mib in args.bucket_mib:
            report.runs.append(await measure(controller, trainer, client, args, mib))
            _log(f"{mib:g} MiB buckets measured")
        report.model_bytes = report.runs[0].bytes if report.runs else 0
        await drop_kept_group(controller, trainer)  # both sides at once, before the processes exit
        return report
    finally:
        trainer.stop()
        await engine.close()


async def bucket_plan(trainer: TrainerProcess, bucket_bytes: int) -> list[list[TensorMeta]]:
    info = await asyncio.to_thread(trainer.request, "sender", Describe())  # the push's own tensor list
    return plan_buckets(info.tensors, bucket_bytes, flattened=True)


async def push_and_check(controller, trainer: TrainerProcess, client: DirectEngineClient, args) -> Check:
    engine = client.engine
    vocab = engine.model().model.config.vocab_size
    tokens = np.random.default_rng(7).integers(0, vocab, PROBE_TOKENS + 1).astype(np.int64)
    loss = await asyncio.to_thread(trainer.request, "step", tokens)
    _log("trainer step done")
    wanted = await asyncio.to_thread(trainer.request, "logprobs", tokens)
    before = float(np.abs(engine_logprobs(engine, tokens) - wanted).max())
    config = PushConfig(bucket_bytes=int(args.bucket_mib[-1] * 2**20), backend=args.backend)
    client.expect_buckets = len(await bucket_plan(trainer, config.bucket_bytes))
    await timed_push(controller, trainer, config, client)
    _log("first push done")
    after = float(np.abs(engine_logprobs(engine, tokens) - wanted).max())
    sums = await asyncio.to_thread(trainer.request, "checksums")
    mine = engine_checksums(engine, list(sums))
    equal = sum(1 for name, value in sums.items() if mine[name] == value)
    return Check(before, after, len(sums), equal, loss)


async def measure(
    controller, trainer: TrainerProcess, client: DirectEngineClient, args, mib: float
) -> BucketRun:
    config = PushConfig(bucket_bytes=int(mib * 2**20), backend=args.backend)
    engine, device = client.engine, client.engine.model().device
    buckets = await bucket_plan(trainer, config.bucket_bytes)
    client.expect_buckets = len(buckets)
    await timed_push(controller, trainer, config, client)  # warm-up
    _log(f"{mib:g} MiB: warm-up push done")
    pushes = [await timed_push(controller, trainer, config, client) for _ in range(args.repeats)]
    pushes.sort(key=lambda run: run[2])
    report, push_s, transfer_s = pushes[len(pushes) // 2]  # the median transfer
    sizes = [sum(m.nbytes for m in b) for b in buckets]
    raw_s = await asyncio.to_thread(raw_seconds, trainer, sizes, args.repeats + 1, args.backend, device)
    bucket_names = [[m.name for m in b] for b in buckets]
    pack_s = await asyncio.to_thread(trainer.request, "pack_seconds", bucket_names, args.repeats)
    unpack_s = await unpack_load_seconds(engine, buckets, args.repeats)
    if sum(sizes) != report.bytes:
        raise SystemExit(f"the push moved {report.bytes} bytes, the raw run {sum(sizes)}: unfair comparison")
    return BucketRun(
        mib, report.buckets, report.bytes, push_s, transfer_s, report.seconds, raw_s, pack_s, unpack_s
    )


async def run_delta(args: argparse.Namespace, model_dir: Path) -> dict:
    """--delta: trainer and engine on one device, gloo between them; per lr and repeat a recording push,
    a step at that lr, then the delta push, the full push of the same weights and a raw broadcast."""
    from delta_report import delta_line, delta_row, delta_summary, timed_pair

    engine = Engine(str(model_dir), dtype=args.dtype)  # holds what the trainer sends
    await engine.load()
    await engine.wait_loaded()
    trainer = TrainerProcess(model_dir, args.dtype, None, args.watchdog_s)
    _log(f"engine on {engine.model().device}, trainer on {trainer.device}")
    bucket_bytes = int(args.bucket_mib[0] * 2**20)
    full = PushConfig(bucket_bytes=bucket_bytes, backend="gloo")
    deltas = PushConfig(bucket_bytes=bucket_bytes, backend="gloo", delta=True, delta_pace=False)
    vocab = engine.model().model.config.vocab_size
    results: dict[float, list[dict]] = {}
    try:
        client = DirectEngineClient(engine)
        controller = InferenceController([DirectEngineCell(client)])

        def push(config: PushConfig):
            return push_full_weights(controller, trainer, config)

        sizes = [sum(m.nbytes for m in b) for b in await bucket_plan(trainer, bucket_bytes)]
        await push_full_weights(controller, trainer, full)  # warm-up
        for lr in args.lrs:
            results[lr] = []
            for repeat in range(args.repeats):
                await push_full_weights(controller, trainer, deltas)  # records the image, untimed
                tokens = np.random.default_rng(repeat).integers(0, vocab, PROBE_TOKENS + 1).astype(np.int64)
                await asyncio.to_thread(trainer.request, "step", tokens, lr)
                sent, delta_s, whole, full_s = await timed_pair(push, deltas, full)
                raw_s = await asyncio.to_thread(raw_seconds, trainer, sizes, 2, "gloo", torch.device("cpu"))
                results[lr].append(delta_row(sent, delta_s, whole, full_s, raw_s))
                _log(delta_line(lr, results[lr][-1]))
        await drop_kept_group(controller, trainer)
        return {"device": str(engine.model().device), "model": args.model, "bucket_bytes": bucket_bytes,
                "model_bytes": sum(sizes), "lrs": delta_summary(results)}  # fmt: skip
    finally:
        trainer.stop()
        await engine.close()


def table(report: Report) -> str:
    check = report.check
    lines = [
        f"device {report.device}, model {report.model} {report.dtype}, {report.tensors} tensors",
        f"check: max |logprob diff| before push {check.max_diff_before:.4g}, after "
        f"{check.max_diff_after:.4g}; tensors equal {check.tensors_equal}/{check.tensors}",
        "| bucket MiB | buckets | GB | raw GB/s | push GB/s | x raw | whole push GB/s | x raw | "
        "prepare s | buckets s | finish s | pack s | wire s | unpack+load s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report.runs:
        p = r.phases
        lines.append(
            f"| {r.bucket_mib:g} | {r.buckets} | {r.bytes / 1e9:.3f} | {r.raw_gbps:.1f} | "
            f"{r.transfer_gbps:.1f} | {r.transfer_over_raw:.2f} | "
            f"{r.push_gbps:.2f} | {r.push_over_raw:.3f} | "
            f"{p['prepare']:.4f} | {p['buckets']:.4f} | {p['finish']:.4f} | {r.pack_s:.4f} | {r.raw_s:.4f} | "
            f"{r.unpack_load_s:.4f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="tiny model, float32, CPU, gloo")
    parser.add_argument("--model", choices=("qwen3-0.6b", "deep", "tiny"), default=None)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None)
    parser.add_argument("--bucket-mib", default=None, help="comma list, e.g. 512,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--trainer-gpu", default="0")
    parser.add_argument("--engine-gpu", default="1")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--watchdog-s", type=float, default=0.0, help="dump stacks and exit after this long")
    parser.add_argument(
        "--delta", action="store_true", help="delta vs full push after a step at each --lrs; one device, gloo"
    )
    parser.add_argument("--lrs", default="1e-5,1e-6", help="--delta: learning rates of the steps")
    args = parser.parse_args(argv)
    args.lrs = [float(x) for x in args.lrs.split(",")]
    args.backend = "gloo" if args.small or args.delta else "nccl"
    args.model = args.model or ("tiny" if args.small else "qwen3-0.6b")
    args.dtype = args.dtype or ("float32" if args.small else "bfloat16")
    default_mib = "0.25,0.0625" if args.small else ("512" if args.delta else "512,64")
    try:
        args.bucket_mib = [float(x) for x in (args.bucket_mib or default_mib).split(",")]
    except ValueError:
        parser.error(f"--bucket-mib takes a comma list of sizes in MiB, got {args.bucket_mib!r}")
    if args.repeats < 1 or any(m <= 0 for m in args.bucket_mib):
        parser.error("--repeats and every --bucket-mib must be positive")
    return args


def main(argv: list[str] | None = None) -> Report:
    args = parse_args(argv)
    if args.watchdog_s > 0:
        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    if args.backend == "nccl":  # this process is the engine: the engine's GPU is its "cuda"
        os.environ["CUDA_VISIBLE_DEVICES"] = _visible(args.engine_gpu, args.trainer_gpu)
        if not torch.cuda.is_available():
            sys.exit("the nccl bench needs CUDA GPUs; use --small on CPU")
    with tempfile.TemporaryDirectory(prefix="miles-push-nccl-") as tmp:
        on_gpu = args.backend == "nccl" or (args.delta and torch.cuda.is_available())
        write_model(Path(tmp), args.model, getattr(torch, args.dtype), "cuda" if on_gpu else "cpu")
        if args.delta:
            from delta_report import print_summary

            result = asyncio.run(run_delta(args, Path(tmp)))
            print_summary(result["lrs"], sys.stderr if args.json else None)
            if args.json:
                print(json.dumps(result), flush=True)
            return result  # type: ignore[return-value]
        report = asyncio.run(run(args, Path(tmp)))
    print(table(report), file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.json:
        print(json.dumps(asdict(report)), flush=True)
    return report


if __name__ == "__main__":
    main()
