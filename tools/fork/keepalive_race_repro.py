"""Reproduce the keep-alive race between pooled HTTP clients and SGLang-like engines (uvicorn keep-alive).

A connection idle for GAP seconds is reused by the client just as the server's keep-alive timer closes it:
the request meets a reset (httpx ReadError / RemoteProtocolError). This tool starts engines (uvicorn
subprocesses with a configurable keep-alive, serving update_weights_from_distributed and friends) and
drives them with either client:

  base   httpx's defaults: idle connections kept 5 s (the same as SGLang's default keep-alive)
  fixed  miles.utils.http's profile: idle connections expire after 2 s, below any engine's keep-alive

Requests are sent GAP - offset seconds after the previous response, offset uniform in [0, JITTER] ms, so the
client reuses its connection right around the moment the server gives up on it. The race window is about
two one-way link latencies wide; --latency-ms puts a relay in front of each engine that delays every byte
(and the close) each way, modelling an inter-node hop (0: bare loopback, where the window is microseconds).
Modes:

  scan       one client process per engine, sequential requests
  broadcast  one client fans each bucket out to every engine concurrently (as the weight push does)
  starved    broadcast, starved of CPU as the incident's head node was: the client is pinned to one core
             that --busy-procs busy processes share with it, and --busy-threads busy threads compete
             for its interpreter (a loaded trainer rank 0)

and, with --a3, a run of SGLangApiClient against an engine that cuts every response once: the idempotent
calls (pause/continue/update_weight_version without abort) are retried and succeed,
update_weights_from_distributed is raised and not retried.

On a cluster's CPU node instead of here: --submit slurm (submitit's Slurm executor) or --submit pbs (a
generated script sent with qsub: PBS Professional has no submitit executor), with --partition (the Slurm
partition or PBS queue), --time and --cpus; the table is printed here when the job ends.

Examples:
  python tools/fork/keepalive_race_repro.py --modes broadcast,starved --clients base,fixed --engines 8
  python tools/fork/keepalive_race_repro.py --gap 2.2 --engine-keepalive 2.2 --rounds 3 --a3
  python tools/fork/keepalive_race_repro.py --submit slurm --partition cpu --time 00:30:00 --engines 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ENGINE_PATH = "/update_weights_from_distributed"


# ----- the engine side ---------------------------------------------------------------------------------


class RaceEngineApp:
    """Answers every POST with SGLang's success body; with `cut_first`, the first try of each path is cut."""

    def __init__(self, cut_first: bool = False) -> None:
        self.cut_first = cut_first
        self.seen: set[str] = set()

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        path = scope["path"]
        body = json.dumps({"success": True, "message": "ok", "status": "ok"}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if self.cut_first and path not in self.seen:
            self.seen.add(path)
            raise ConnectionResetError("cut this response: the client sees the connection drop")
        await send({"type": "http.response.body", "body": body})


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Forward bytes (then the close) `delay_s` after they arrive, in order: one direction of a link."""
    loop = asyncio.get_running_loop()
    pending: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def forward() -> None:
        while True:
            due, chunk = await pending.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not chunk:
                writer.close()
                return
            try:
                writer.write(chunk)
                await writer.drain()
            except (ConnectionError, RuntimeError):
                pass  # the far side is gone; its close is on its way through the other direction

    sender = asyncio.create_task(forward())
    while True:
        try:
            chunk = await reader.read(65536)
        except ConnectionError:
            chunk = b""
        pending.put_nowait((loop.time() + delay_s, chunk))
        if not chunk:
            break
    await sender


async def _serve_link(port: int, delay_s: float) -> asyncio.Server:
    """A TCP relay adding `delay_s` each way in front of the engine: an inter-node hop on loopback."""

    async def relay(down_reader: asyncio.StreamReader, down_writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.gather(_pipe(down_reader, up_writer, delay_s), _pipe(up_reader, down_writer, delay_s))

    return await asyncio.start_server(relay, "127.0.0.1", 0)


async def _serve_async(keepalive: float, cut_first: bool, latency_ms: float) -> None:
    import uvicorn

    from miles.utils.serving import bind_free_socket

    sock = bind_free_socket("127.0.0.1")
    config = uvicorn.Config(
        RaceEngineApp(cut_first), timeout_keep_alive=keepalive, log_level="critical", lifespan="off"
    )
    server = uvicorn.Server(config)
    engine = asyncio.create_task(server.serve(sockets=[sock]))
    port = sock.getsockname()[1]
    if latency_ms > 0:
        link = await _serve_link(port, latency_ms / 1000)
        port = link.sockets[0].getsockname()[1]
    print(port, flush=True)
    await engine


def serve(keepalive: float, cut_first: bool, latency_ms: float) -> None:
    """Engine subprocess: print the port clients should use, then serve until killed."""
    asyncio.run(_serve_async(keepalive, cut_first, latency_ms))


@contextmanager
def engines(
    count: int, keepalive: float, latency_ms: float = 0.0, cut_first: bool = False
) -> Iterator[list[str]]:
    procs = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "serve", "--engine-keepalive", str(keepalive)]
    cmd += ["--latency-ms", str(latency_ms)]
    if cut_first:
        cmd.append("--cut-first")
    try:
        for _ in range(count):
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env))
        urls = [f"http://127.0.0.1:{int(p.stdout.readline())}" for p in procs]
        _wait_listening(urls)
        yield urls
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)


def _wait_listening(urls: list[str], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    for url in urls:
        while True:
            try:
                httpx.post(url + "/health", timeout=2)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


# ----- the client side ---------------------------------------------------------------------------------


@dataclass
class RunResult:
    run: str
    client: str
    engine_keepalive_s: float
    requests: int = 0
    failure_idle_s: list[float] = field(default_factory=list)
    failed_buckets: list[int] = field(default_factory=list)
    starved: dict = field(default_factory=dict)  # busy processes and the cores they shared with the client

    @property
    def failures(self) -> int:
        return len(self.failure_idle_s)


def make_client(kind: str) -> httpx.AsyncClient:
    if kind == "base":
        return httpx.AsyncClient(timeout=30)  # httpx defaults: keepalive_expiry=5.0
    from miles.utils.http import PROFILES, build_async_client

    return build_async_client(PROFILES["engine"])


async def _post(client: httpx.AsyncClient, url: str, last_done: dict[str, float]) -> tuple[bool, float]:
    idle = time.monotonic() - last_done.get(url, time.monotonic())
    try:
        response = await client.post(url + ENGINE_PATH, json={"names": [], "dtypes": [], "shapes": []})
        ok = response.status_code == 200
    except httpx.TransportError:
        ok = False
    last_done[url] = time.monotonic()
    return ok, idle


async def _sleep_until(target: float) -> None:
    """Wake at `target` (time.monotonic) to well under a millisecond: the race window is a few ms wide."""
    await asyncio.sleep(max(0.0, target - time.monotonic() - 0.003))
    while time.monotonic() < target:
        await asyncio.sleep(0)


async def drive(
    urls: list[str], client_kind: str, rounds: int, gap: float, jitter_ms: float, seed: int
) -> dict:
    """Bucket k: POST to every url concurrently; bucket k+1 starts gap - offset after the last answer."""
    rng = random.Random(seed)
    result: dict = {"requests": 0, "failure_idle_s": [], "failed_buckets": []}
    last_done: dict[str, float] = {}
    async with make_client(client_kind) as client:
        for bucket in range(rounds + 1):  # bucket 0 only opens the connections
            outcomes = await asyncio.gather(*(_post(client, url, last_done) for url in urls))
            if bucket:
                result["requests"] += len(outcomes)
                failed = [round(idle, 4) for ok, idle in outcomes if not ok]
                result["failure_idle_s"] += failed
                if failed:
                    result["failed_buckets"].append(bucket)
            if bucket < rounds:
                await _sleep_until(max(last_done.values()) + gap - rng.uniform(0, jitter_ms) / 1000)
    return result


def _drive_in_process(args: tuple) -> dict:
    return asyncio.run(drive(*args))


@contextmanager
def starved_cores(procs: int) -> Iterator[dict]:
    """This process pinned to one core with `procs` busy processes pinned to the same core: the client
    runs only when the scheduler gives it a turn. Yields what the run was starved with (for the report);
    the engines, started before, keep every core."""
    if procs == 0:
        yield {"busy_procs": 0, "client_cores": sorted(os.sched_getaffinity(0))}
        return
    before = os.sched_getaffinity(0)
    core = {min(before)}
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        for _ in range(procs)
    ]
    try:
        for proc in spinners:
            os.sched_setaffinity(proc.pid, core)
        os.sched_setaffinity(0, core)
        yield {"busy_procs": procs, "client_cores": sorted(core)}
    finally:
        os.sched_setaffinity(0, before)
        for proc in spinners:
            proc.kill()
            proc.wait()


@contextmanager
def starved_interpreter(threads: int) -> Iterator[None]:
    """Busy Python threads: the client's event loop only runs when it wins the GIL back."""
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    workers = [threading.Thread(target=spin, daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    try:
        yield
    finally:
        stop.set()
        for w in workers:
            w.join()


def run_mode(mode: str, client: str, urls: list[str], opts: argparse.Namespace) -> RunResult:
    result = RunResult(run=mode, client=client, engine_keepalive_s=opts.engine_keepalive)
    common = (client, opts.rounds, opts.gap, opts.jitter_ms)
    if mode == "scan":
        with mp.get_context("spawn").Pool(len(urls)) as pool:
            parts = pool.map(_drive_in_process, [([u], *common, opts.seed + i) for i, u in enumerate(urls)])
    elif mode in ("broadcast", "starved"):
        starved = mode == "starved"
        with (
            starved_cores(opts.busy_procs if starved else 0) as result.starved,
            starved_interpreter(opts.busy_threads if starved else 0),
        ):
            parts = [asyncio.run(drive(urls, *common, opts.seed))]
    else:
        raise ValueError(f"unknown mode {mode!r}: use scan, broadcast or starved")
    for part in parts:
        result.requests += part["requests"]
        result.failure_idle_s += part["failure_idle_s"]
        result.failed_buckets = sorted(set(result.failed_buckets) | set(part["failed_buckets"]))
    return result


# ----- A3: the client's retry policy against cut responses ---------------------------------------------


async def run_a3(url: str) -> list[dict]:
    from miles.engines.sglang_client import SGLangApiClient
    from miles.utils.http import close_clients

    client = SGLangApiClient(url)
    calls = {
        "pause_generation": lambda: client.pause_generation("retract"),
        "continue_generation": client.continue_generation,
        "update_weight_version(abort_all_requests=False)": lambda: client.update_weight_version(
            "1", abort_all_requests=False
        ),
        "update_weights_from_distributed": lambda: client.update_weights_from_distributed(
            names=["w"], dtypes=["bfloat16"], shapes=[[1]]
        ),
    }
    rows = []
    for name, call in calls.items():
        try:
            await call()
            rows.append({"call": name, "outcome": "retried once, succeeded"})
        except httpx.TransportError as exc:
            rows.append({"call": name, "outcome": f"raised {type(exc).__name__}, not retried"})
    await close_clients()
    return rows


# ----- output ------------------------------------------------------------------------------------------


def format_table(results: list[RunResult]) -> str:
    lines = [
        "| run | client | engine keep-alive | requests | failures (idle s at failure) | failed buckets |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        idles = ", ".join(f"{x:.3f}" for x in sorted(r.failure_idle_s)[:6])
        more = " ..." if r.failures > 6 else ""
        failures = f"{r.failures} ({idles}{more})" if r.failures else "0"
        buckets = f"{len(r.failed_buckets)} ({r.failed_buckets[:8]})" if r.failed_buckets else "0"
        cells = [r.run, r.client, f"{r.engine_keepalive_s:g} s", str(r.requests), failures, buckets]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="keepalive_race_repro.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", nargs="?", default="run", choices=["run", "serve"], help=argparse.SUPPRESS)
    parser.add_argument("--modes", default="scan,broadcast,starved", help="scan,broadcast,starved")
    parser.add_argument("--clients", default="base,fixed", help="comma list of base,fixed")
    parser.add_argument("--engines", type=int, default=4, help="engine processes")
    parser.add_argument("--engine-keepalive", type=float, default=5.0, help="uvicorn timeout_keep_alive (s)")
    parser.add_argument("--gap", type=float, default=5.0, help="seconds from a response to the next request")
    parser.add_argument("--jitter-ms", type=float, default=5.0, help="offset taken off GAP: uniform [0, J]")
    parser.add_argument("--rounds", type=int, default=10, help="buckets per run (after the warm-up request)")
    parser.add_argument(
        "--latency-ms", type=float, default=1.0, help="added one-way link latency (0: bare loopback)"
    )
    parser.add_argument("--busy-threads", type=int, default=2, help="busy threads in starved mode")
    parser.add_argument(
        "--busy-procs", type=int, default=2, help="busy processes on the client's core in starved mode"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--a3", action="store_true", help="also run the retry-policy demonstration")
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON here too")
    parser.add_argument("--cut-first", action="store_true", help=argparse.SUPPRESS)
    cluster = parser.add_argument_group("running on a cluster node")
    cluster.add_argument("--submit", choices=["local", "slurm", "pbs"], default="local", help="where to run")
    cluster.add_argument(
        "--partition", default=None, help="Slurm partition or PBS queue (default: the default)"
    )
    cluster.add_argument("--time", default="00:15:00", help="the job's time limit, HH:MM:SS")
    cluster.add_argument("--cpus", type=int, default=2, help="CPUs the job asks for on its node")
    cluster.add_argument(
        "--folder",
        type=Path,
        default=None,
        help="job files, on a filesystem the nodes share (default: runs/repro)",
    )
    args = parser.parse_args(argv)
    if args.gap <= 0 or args.engines < 1 or args.rounds < 1 or args.cpus < 1:
        parser.error("--gap, --engines, --rounds and --cpus must be positive")
    if args.busy_procs < 0 or args.busy_threads < 0:
        parser.error("--busy-procs and --busy-threads must be >= 0")
    return args


def node_argv(args: argparse.Namespace) -> list[str]:
    """The same reproduction, in local mode, for the node (its --json is chosen by the submitter)."""
    argv = ["--modes", args.modes, "--clients", args.clients, "--engines", str(args.engines)]
    argv += ["--engine-keepalive", str(args.engine_keepalive), "--gap", str(args.gap)]
    argv += ["--jitter-ms", str(args.jitter_ms), "--rounds", str(args.rounds)]
    argv += ["--latency-ms", str(args.latency_ms), "--busy-threads", str(args.busy_threads)]
    argv += ["--busy-procs", str(args.busy_procs)]
    argv += ["--seed", str(args.seed)]
    return [*argv, "--a3"] if args.a3 else argv


def run_on_node(args: argparse.Namespace) -> dict:
    """Submit the reproduction to a node and return its report (with `node`: where it ran)."""
    import node_submit  # next to this file (sys.path[0] when run as a script)

    from launcher.runs import runs_base_dir

    folder = (args.folder or runs_base_dir() / "repro").resolve()
    request = node_submit.NodeRequest(
        folder=folder, time=args.time, cpus=args.cpus, partition=args.partition, name="keepalive-repro"
    )
    submit = node_submit.submit_slurm if args.submit == "slurm" else node_submit.submit_pbs
    try:
        result = submit(Path(__file__).resolve(), node_argv(args), request)
    except (node_submit.NodeRunFailed, ValueError) as exc:
        raise SystemExit(f"keepalive_race_repro: {exc}") from None
    return {**result["report"], "node": result["node"]}


def print_report(report: dict) -> None:
    print(format_table([RunResult(**run) for run in report["runs"]]))
    if "a3" in report:
        print("\nA3 (SGLangApiClient against an engine that cuts the first response of every call):")
        for row in report["a3"]:
            print(f"  {row['call']}: {row['outcome']}")


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds the `engines` context, which stops the engine processes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if args.command == "serve":
        serve(args.engine_keepalive, args.cut_first, args.latency_ms)
        return 0
    if args.submit != "local":
        report = run_on_node(args)
        print(f"ran on {report['node']} ({args.submit})\n")
        print_report(report)
        if args.json:
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        return 0
    results = []
    with engines(args.engines, args.engine_keepalive, args.latency_ms) as urls:
        for mode in args.modes.split(","):
            for client in args.clients.split(","):
                results.append(run_mode(mode.strip(), client.strip(), urls, args))
                print(format_table(results[-1:]).splitlines()[-1], flush=True)
    report: dict = {"runs": [asdict(r) for r in results]}
    if args.a3:
        with engines(1, args.engine_keepalive, cut_first=True) as (url,):
            report["a3"] = asyncio.run(run_a3(url))
    print()
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
