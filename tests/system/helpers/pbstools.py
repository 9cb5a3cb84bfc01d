"""Helpers for system tests on the real OpenPBS cluster (../shared/pbs-local): is it up, PBS's own qstat,
and running the launcher as a normal user (MoM neither tracks nor kills root's processes, so a realistic
qdel or walltime test runs the job as `cloudsdk`)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from launcher.schedulers.pbs import parse_qstat_full, pbs_bin_dir

PBS_USER = "cloudsdk"
USER_VENV = Path("/tmp/miles-user-venv")  # root's python lives under /root (mode 700)
SITE_PACKAGES = (
    Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
)


def pbs_tool(name: str) -> str:
    bin_dir = pbs_bin_dir()
    return str(bin_dir / name) if bin_dir else name


def pbs_unavailable() -> str | None:
    """Why the OpenPBS cluster cannot be used, or None when it can."""
    bin_dir = pbs_bin_dir()
    if bin_dir is None or not (bin_dir / "qsub").is_file():
        return "no PBS_EXEC in /etc/pbs.conf: run ../shared/pbs-local/start-pbs.sh"
    try:
        out = subprocess.run([pbs_tool("pbsnodes"), "-a"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"pbsnodes failed: {exc}"
    free = out.stdout.count("state = free")
    if out.returncode != 0 or free < 3:
        return f"the OpenPBS cluster needs 3 free nodes (pbsnodes: {out.stdout.strip()[:200]!r})"
    return None


def qstat_x(job_id: str) -> dict[str, str]:
    """`qstat -x -f` of a job (finished ones included), PBS's own command."""
    out = subprocess.run([pbs_tool("qstat"), "-x", "-f", job_id], capture_output=True, text=True, timeout=30)
    return parse_qstat_full(out.stdout)


def user_python() -> Path:
    """A python the PBS user can run, with this venv's packages (built once per machine)."""
    python = USER_VENV / "bin" / "python"
    if not python.exists():
        system = shutil.which("python3", path="/usr/bin")
        if system is None:
            raise RuntimeError("/usr/bin/python3 is missing: apt-get install python3")
        version = subprocess.run(
            [system, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True
        )
        if version.stdout.strip() != str(sys.version_info[:2]):
            raise RuntimeError(
                f"{system} is Python {version.stdout.strip()}, the packages need {sys.version_info[:2]}"
            )
        subprocess.run([system, "-m", "venv", "--without-pip", str(USER_VENV)], check=True)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    files = {
        USER_VENV / "lib" / version / "site-packages" / "miles-shared.pth": (
            f"import site; site.addsitedir({str(SITE_PACKAGES)!r})\n"  # runs the editable install's .pth too
        ),
        USER_VENV
        / "bin"
        / "ray": f"#!{python}\nimport sys\nfrom ray.scripts.scripts import main\nsys.exit(main())\n",
    }
    for path, text in files.items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    subprocess.run(["chmod", "-R", "a+rX", str(USER_VENV)], check=True)
    (USER_VENV / "bin" / "ray").chmod(0o755)
    return python


def user_dir(prefix: str) -> Path:
    """A fresh directory the PBS user owns (run dirs must be writable by the job's user)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    user = pwd.getpwnam(PBS_USER)
    os.chown(path, user.pw_uid, user.pw_gid)
    return path


def as_user(argv: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    """Run argv as the PBS user with a clean environment (plus `env`)."""
    base = {"HOME": pwd.getpwnam(PBS_USER).pw_dir, "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    full = [f"{k}={v}" for k, v in (base | env).items()]
    return subprocess.run(
        ["runuser", "-u", PBS_USER, "--", "env", "-i", *full, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/tmp",
    )


def user_launcher(runs_dir: Path, *args: str) -> Any:
    """`launcher ARGS --json` as the PBS user; the parsed answer."""
    python = user_python()
    result = as_user([str(python), "-m", "launcher", *args, "--json"], {"MILES_RUNS_DIR": str(runs_dir)})
    assert result.returncode == 0, f"launcher {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout)
