"""The README's demo: the whole stack on this machine through the launcher, then a tinker-SDK client.

    python -m miles.demo [--preset tiny-cpu] [--keep]

1. `launcher submit --preset tiny-cpu --scheduler local` (the embedded default scheduler);
2. wait until `launcher status` reports healthz 200, showing the driver's bring-up phases;
3. a few supervised steps through the real `tinker` SDK with the loss printed, a sample;
4. `launcher cancel` (unless --keep), so nothing is left running.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

console = Console()
READY_TIMEOUT_S = 600


def launcher(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "launcher", *args, "--json"], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise SystemExit(f"launcher {' '.join(args)} failed:\n{out.stdout}{out.stderr}")
    return json.loads(out.stdout)


def wait_healthy(run_id: str) -> dict:
    deadline = time.monotonic() + READY_TIMEOUT_S
    with console.status("submitting") as status:
        while time.monotonic() < deadline:
            info = launcher("status", run_id)
            code = (info.get("healthz") or {}).get("status_code")
            status.update(f"job {info['state'].lower()}, phase [bold]{info.get('phase') or '-'}[/]")
            if code == 200:
                return info
            if info["state"] in ("FAILED", "COMPLETED", "CANCELLED", "TIMEOUT"):
                raise SystemExit(f"the job ended before it was healthy: see `launcher logs {run_id}`")
            time.sleep(1.0)
    raise SystemExit(f"not healthy after {READY_TIMEOUT_S} s: see `launcher logs {run_id}`")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m miles.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny-cpu")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--keep", action="store_true", help="leave the job running afterwards")
    args = parser.parse_args(argv)

    started = time.monotonic()
    sub = launcher("submit", "--preset", args.preset, "--scheduler", "local")  # the job picks its ports
    run_id = sub["run_id"]
    console.print(f"[bold]submitted[/] {run_id} (job {sub['job_id']}), run dir {sub['run_dir']}")
    code = 1
    try:
        info = wait_healthy(run_id)
        console.print(f"[green]healthy[/] after {time.monotonic() - started:.0f} s at {info['gateway_url']}")
        from miles import demo_client

        client_args = [
            "--base-url", info["gateway_url"],
            "--api-key-file", info["api_key_file"],
            "--tokenizer", str(Path(sub["run_dir"]) / "model"),
            "--base-model", "tiny-qwen3",
            "--steps", str(args.steps),
        ]  # fmt: skip
        code = demo_client.run(demo_client.parser().parse_args(client_args))
    finally:
        if not args.keep:
            launcher("cancel", run_id)
            console.print(f"[bold]cancelled[/] {run_id}; logs stay in {sub['run_dir']}/logs")
    sys.exit(code)


if __name__ == "__main__":
    main()
