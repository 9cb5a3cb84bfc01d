"""`launcher doctor`: what would stop a job on this cluster, checked from the login node, one line each.

Each check returns a `Check` (ok / warn / fail / skip, what was seen, and the fix). The checks run real
commands (the scheduler's, the job's Python, bash) with short timeouts; none of them submits anything.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from launcher.schedulers import SchedulerError
from launcher.schedulers.pbs import PBS_BIN_ENV, pbs_bin_dir, pbs_command
from miles.contract.ports import PORT_RANGE, pinned_port_free, port_free
from miles.contract.preset import Preset

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
TOOL_TIMEOUT_S = 15.0
IMPORT_TIMEOUT_S = 180.0  # importing torch on a loaded login node takes a while
MIN_BASH = (5, 1)  # the job script waits with `wait -n -p` (bash 5.1)
# Filesystems that are node-local: a run dir there is invisible to the compute nodes
LOCAL_FS_TYPES = {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "ramfs", "zfs", "devtmpfs"}
NODE_LOCAL_PREFIXES = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/local", "/scratch/local")
ENGINE_MODULES = {"sglang": "sglang", "cpu": "miles.engines.cpu.server"}


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail | skip
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def installed_version() -> str:
    try:
        return metadata.version("miles-hpc")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e . in the checkout)"


def _run(argv: Sequence[str], timeout_s: float = TOOL_TIMEOUT_S) -> tuple[int, str]:
    """(exit status, stdout+stderr); a command that cannot start or hangs is exit 127 / 124."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        return 127, f"{argv[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, f"{' '.join(argv)}: no answer within {timeout_s:.0f} s"
    except OSError as exc:
        return 126, f"{argv[0]}: {exc.strerror}"
    return done.returncode, (done.stdout + done.stderr).strip()


# ---------------------------------------------------------------- schedulers


def detect_schedulers(env: Mapping[str, str]) -> list[str]:
    """The batch schedulers whose submit command is here (PBS through pbs.conf, Slurm on PATH)."""
    found = []
    if pbs_bin_dir(env) is not None or shutil.which("qsub"):
        found.append("pbs")
    if shutil.which("sbatch"):
        found.append("slurm")
    return found


def check_slurm() -> Check:
    missing = [tool for tool in ("sbatch", "sinfo", "squeue", "scontrol") if not shutil.which(tool)]
    if missing:
        return Check(
            "slurm", FAIL, f"not on PATH: {', '.join(missing)}", "load Slurm (e.g. `module load slurm`)"
        )
    code, out = _run(["sinfo", "-h", "-o", "%P %a %D"])
    if code != 0:
        return Check(
            "slurm", FAIL, f"sinfo does not answer: {_first_line(out)}", "check SLURM_CONF and slurmctld"
        )
    partitions = [line.split()[0] for line in out.splitlines() if line.split()]
    return Check(
        "slurm", OK, f"sbatch {shutil.which('sbatch')}; partitions: {', '.join(partitions) or 'none'}"
    )


def check_pbs(env: Mapping[str, str]) -> Check:
    fix = f"set PBS_EXEC in /etc/pbs.conf (or $PBS_CONF_FILE), or {PBS_BIN_ENV} to the directory of qsub"
    try:
        bin_dir = pbs_bin_dir(env)
        qsub, qstat = pbs_command("qsub", bin_dir), pbs_command("qstat", bin_dir)
    except SchedulerError as exc:
        return Check("pbs", FAIL, str(exc), fix)
    code, out = _run([qstat, "-B"])
    if code != 0:
        return Check(
            "pbs",
            FAIL,
            f"qstat -B does not answer: {_first_line(out)}",
            "check PBS_SERVER and the pbs server",
        )
    server = out.splitlines()[-1].split()[0] if out.strip() else "?"
    return Check("pbs", OK, f"qsub {qsub}; server {server} answers")


def check_scheduler(name: str, env: Mapping[str, str]) -> Check:
    if name == "slurm":
        return check_slurm()
    if name == "pbs":
        return check_pbs(env)
    return Check("local", OK, "runs jobs on this machine (tests and single-node trials)")


# ---------------------------------------------------------------- run directory


def mount_of(path: Path, mounts_text: str) -> tuple[str, str]:
    """(mount point, filesystem type) holding `path`, from the text of /proc/mounts."""
    best = ("/", "unknown")
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (path == Path(point) or Path(point) in path.parents) and len(point) >= len(best[0]):
            best = (point, fields[2])
    return best


def check_run_dir(base: Path, schedulers: Sequence[str], mounts_text: str) -> Check:
    """The runs directory must be writable, and on a filesystem the compute nodes share."""
    existing = next((p for p in (base, *base.parents) if p.exists()), Path("/"))
    if not os.access(existing, os.W_OK):
        return Check(
            "run dir",
            FAIL,
            f"{base}: cannot write in {existing}",
            "set MILES_RUNS_DIR to a directory you own",
        )
    point, fstype = mount_of(base.resolve(), mounts_text)  # resolve() follows what exists of it
    batch = [s for s in schedulers if s != "local"]
    if not batch:
        return Check("run dir", OK, f"{base} ({fstype}); local jobs only")
    fix = "set MILES_RUNS_DIR to a directory on the shared filesystem (home, /groups, lustre ...)"
    if any(str(base) == p or str(base).startswith(p + "/") for p in NODE_LOCAL_PREFIXES):
        return Check("run dir", WARN, f"{base} is node-local: compute nodes do not see it", fix)
    if fstype in LOCAL_FS_TYPES:
        return Check("run dir", WARN, f"{base} is on {fstype} ({point}), a node-local filesystem type", fix)
    return Check("run dir", OK, f"{base} on {fstype} ({point})")


# ---------------------------------------------------------------- the job's Python


def import_probe_code(modules: Sequence[str]) -> str:
    return (
        "import importlib, json\n"
        "found = {}\n"
        f"for name in {list(modules)!r}:\n"
        "    module = importlib.import_module(name)\n"
        "    found[name] = getattr(module, '__version__', 'ok')\n"
        "print(json.dumps(found))\n"
    )


def runtime_modules(preset: Preset | None) -> list[str]:
    modules = ["torch", "ray", "miles.driver.serve"]
    if preset is not None:
        modules.append(ENGINE_MODULES[preset.engines.kind])
    return modules


def check_job_python(python: str, preset: Preset | None) -> Check:
    """Run the job's Python, as the job will, and import the runtime it needs."""
    modules = runtime_modules(preset)
    code, out = _run([python, "-c", import_probe_code(modules)], timeout_s=IMPORT_TIMEOUT_S)
    fix = f"install the runtime into that Python: {python} -m pip install 'miles-hpc[runtime]'"
    if code != 0:
        error = [line for line in out.splitlines() if line.strip()][-1:] or [f"exit {code}"]
        return Check("job python", FAIL, f"{python} cannot import the runtime: {error[0]}", fix)
    versions = json.loads(out.splitlines()[-1])
    shown = ", ".join(name if version == "ok" else f"{name} {version}" for name, version in versions.items())
    return Check("job python", OK, f"{python}: {shown}")


# ---------------------------------------------------------------- model, ports, bash


def check_model(preset: Preset | None, env: Mapping[str, str]) -> Check:
    if preset is None:
        return Check("model", SKIP, "no preset given", "add --preset NAME to check its model")
    from launcher.submit_checks import model_problem

    problem = model_problem(preset, env)
    if problem:
        return Check(
            "model", FAIL, problem, "pre-download it into an HF cache the nodes see (docs/cluster-setup.md)"
        )
    where = preset.model.path or "built by the job (init: tiny)"
    return Check("model", OK, f"{preset.model.name}: {where}")


def check_preset(preset: Preset | None, schedulers: Sequence[str]) -> Check:
    """What `launcher submit` would refuse besides the model: engine args, the PBS project."""
    if preset is None:
        return Check("preset", SKIP, "no preset given", "add --preset NAME to check it")
    from launcher.schedulers.pbs import project_problems
    from launcher.submit_checks import engine_args_problem

    engine_problem = engine_args_problem(preset)
    problems = [engine_problem] if engine_problem else []
    if "pbs" in schedulers:
        problems += project_problems(preset.scheduler.pbs.project, preset.scheduler.pbs.project_required)
    if problems:
        return Check("preset", FAIL, "; ".join(problems), "the --set named above, or the defaults file")
    return Check("preset", OK, f"{preset.name}: {preset.nodes} node(s), engines {preset.engines.kind}")


def ephemeral_range(text: str) -> tuple[int, int] | None:
    numbers = [int(n) for n in re.findall(r"\d+", text)]
    return (numbers[0], numbers[1]) if len(numbers) >= 2 else None


def check_ports(preset: Preset | None, ephemeral_text: str) -> Check:
    """The preset's fixed ports are free here, and the range jobs pick from is outside the ephemeral one."""
    fixed: dict[str, int | None] = {}
    if preset is not None:
        fixed = {
            "gateway.port": preset.gateway.port,
            "ray.gcs_port": preset.ray.gcs_port,
            "ray.client_server_port": preset.ray.client_server_port,
        }
    busy = [f"{key} {port}" for key, port in fixed.items() if port is not None and not pinned_port_free(port)]
    if busy:
        return Check(
            "ports",
            FAIL,
            f"in use on this node: {', '.join(busy)}",
            "unset them (picked free per job) or choose others",
        )
    ephemeral = ephemeral_range(ephemeral_text)
    low, high = PORT_RANGE
    if ephemeral and ephemeral[0] < high and ephemeral[1] >= low:
        return Check(
            "ports",
            WARN,
            f"the ephemeral range {ephemeral[0]}-{ephemeral[1]} overlaps the pick range {low}-{high - 1}",
            "pin ports (ray.gcs_port, ray.node_port_base, gateway.port) outside the ephemeral range",
        )
    sample = [port for port in range(low, low + 200) if port_free(port)]
    if not sample:
        return Check(
            "ports", FAIL, f"no free port in {low}-{low + 199}", "stop what holds them, or pin other ports"
        )
    shown = f"{ephemeral[0]}-{ephemeral[1]}" if ephemeral else "unknown"
    return Check("ports", OK, f"picked per job from {low}-{high - 1}, below the ephemeral range {shown}")


def bash_version(text: str) -> tuple[int, int] | None:
    match = re.search(r"version (\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_bash(bash: str = "/bin/bash") -> Check:
    code, out = _run([bash, "--version"])
    version = bash_version(out) if code == 0 else None
    need = ".".join(map(str, MIN_BASH))
    if version is None:
        return Check("bash", FAIL, f"{bash}: {_first_line(out)}", f"install bash >= {need} on the nodes")
    shown = ".".join(map(str, version))
    if version < MIN_BASH:
        return Check(
            "bash", FAIL, f"{bash} is {shown}; the job script needs {need} (wait -n -p)",
            f"install bash >= {need} (or load a newer bash module) on login and compute nodes",
        )  # fmt: skip
    return Check("bash", OK, f"{bash} {shown}")


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "(no output)")


def exit_status(checks: Sequence[Check]) -> int:
    """0 when nothing failed (warnings are allowed), else 1."""
    return 1 if any(check.status == FAIL for check in checks) else 0
