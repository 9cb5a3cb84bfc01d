"""What a run's directory and its scheduler say about the job: state, driver phase, gateway, API key.

The job and the runtime write small files into the run directory (see `runs.ATTEMPT_FILES`); the
scheduler answers for the job's state. Everything `launcher status` and `launcher wait` show is read here.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import httpx
import yaml

from launcher.runs import JobRecord, Run, record_state
from launcher.schedulers import JobState, State, get_scheduler
from launcher.schedulers.local import read_exit_code
from miles.contract.exit_codes import JobExit
from miles.contract.tls import pinned_tls

HEALTHZ_PATH = "/api/v1/healthz"
GATEWAY_URL_FILE = "gateway_url"  # may be written by the job once it knows the head's address
JOB_ENV_FILE = "job.env"  # written by the job script: export NAME=value lines
PHASE_FILE = "phase"  # written by the runtime
HEALTHY_FILE = "healthy"  # written by the watchdog on the first 200
PORTS_DIR = "ports"  # written by the job: head.env, node-<index>.env
END_REASON_FILE = "end_reason"  # written by the job when a signal ended it
GENERATED_KEY_FILE = "api_key"
HEALTHZ_TIMEOUT_S = 3.0


def current_state(run: Run, record: JobRecord) -> JobState | None:
    """Ask the scheduler, fill in an exit code the job itself recorded, and remember the state.

    None: never submitted. Raises SchedulerError when the scheduler cannot be asked."""
    if record.job_id is None:
        return None
    state = get_scheduler(record.scheduler, run_dir=run.path).status(record.job_id)
    state = with_recorded_exit(state, read_exit_code(run.path))
    state = with_end_reason(state, run.read_optional(END_REASON_FILE))
    if state.state is not State.UNKNOWN:
        record_state(run, state.state.value, state.exit_code)
    return state


def with_recorded_exit(state: JobState, recorded: int | None) -> JobState:
    """Torque-style wrappers report finished jobs without an exit status; the job's own record decides."""
    if not state.state.finished or state.exit_code is not None or recorded is None:
        return state
    if state.state is State.COMPLETED and recorded != 0:
        return JobState(State.FAILED, state.raw, recorded)
    return JobState(state.state, state.raw, recorded)


def with_end_reason(state: JobState, end_reason: str | None) -> JobState:
    """A job that shut itself down on the scheduler's notice before its time limit (USR1) timed out."""
    notice = end_reason is not None and end_reason.startswith("SIGUSR1")
    if state.state.finished and notice and state.exit_code == JobExit.WALLTIME:
        return JobState(State.TIMEOUT, state.raw, state.exit_code)
    return state


def healthz_url(run: Run) -> str | None:
    """The healthz URL: from what the job wrote (gateway_url, or job.env), else the preset's fixed host."""
    written = run.read_optional(GATEWAY_URL_FILE) or job_env(run).get("MILES_GATEWAY_URL")
    if written:
        return written.rstrip("/").removesuffix(HEALTHZ_PATH) + HEALTHZ_PATH
    try:
        preset = yaml.safe_load(run.preset_file.read_text())
        host, port = preset["gateway"]["host"], preset["gateway"]["port"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return None
    if host in ("0.0.0.0", "::", "") or port is None:
        # binds everywhere, or its port is claimed when the job starts: only the job knows the URL
        return None
    scheme = "https" if gateway_tls_cert(run) else "http"
    return f"{scheme}://{host}:{port}{HEALTHZ_PATH}"


def gateway_tls_cert(run: Run) -> Path | None:
    """The preset's gateway.tls_certfile (the gateway serves https with it), or None."""
    try:
        preset = yaml.safe_load(run.preset_file.read_text())
        cert = (preset.get("gateway") or {}).get("tls_certfile")
    except (OSError, AttributeError, yaml.YAMLError):
        return None
    return Path(cert).expanduser() if isinstance(cert, str) and cert else None


def job_env(run: Run) -> dict[str, str]:
    """The `export NAME=value` lines the job script writes to RUN_DIR/job.env (values %q-quoted)."""
    found: dict[str, str] = {}
    for line in (run.read_optional(JOB_ENV_FILE) or "").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            name, value = words[1].split("=", 1)
            found[name] = value
    return found


def api_key_source(run: Run) -> dict[str, str]:
    """The preset's gateway.api_key: `{"file": PATH}`, `{"env": NAME}`, or {} (the job generates one)."""
    try:
        preset = yaml.safe_load(run.preset_file.read_text())
        source = (preset.get("gateway") or {}).get("api_key") or {}
    except (OSError, AttributeError, yaml.YAMLError):
        source = {}
    return source if isinstance(source, dict) else {}


def api_key_file(run: Run) -> str | None:
    source = api_key_source(run)
    if source.get("file"):
        return str(Path(source["file"]).expanduser())
    generated = run.path / GENERATED_KEY_FILE
    return str(generated) if generated.exists() else None


def probe_healthz(url: str, tls_cert: Path | None = None) -> dict[str, object]:
    """GET healthz once; over https, trust exactly the gateway's certificate when given (as the job's
    watchdog does: a private CA is in no trust store here)."""
    try:
        verify = pinned_tls(tls_cert) if tls_cert is not None else True
        # never through http_proxy
        response = httpx.get(url, timeout=HEALTHZ_TIMEOUT_S, trust_env=False, verify=verify)
    except (httpx.HTTPError, OSError) as exc:  # OSError: the certificate file cannot be read
        return {"status_code": None, "error": f"{type(exc).__name__}: {exc}"}
    return {"status_code": response.status_code, "body": response.text.strip()[:500]}


def phase_of(run: Run, state: JobState | None) -> str | None:
    written = run.read_optional(PHASE_FILE)
    if written:
        return written
    running = state is not None and state.state is State.RUNNING
    if running and (run.path / HEALTHY_FILE).exists():
        return "serving"
    return "starting" if running else None
