"""Render a resolved preset into a job script (PBS Pro, Slurm or the local scheduler).

Jinja2 with StrictUndefined; every preset value reaches the script through a quoting filter:
`q` (shlex.quote) for shell words, `directive` for `#PBS`/`#SBATCH` option values (quoted, and no
control characters, so a value can never start a new script line).
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import Any

import jinja2

from launcher.runs import ATTEMPT_FILES
from launcher.shipped import shipped_dir
from miles.contract.exit_codes import shell_settings
from miles.contract.preset import Preset, resolve

SCHEDULERS: tuple[str, ...] = ("pbs", "slurm", "local")
TEMPLATES_DIR = shipped_dir("templates")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class RenderError(ValueError):
    """The preset cannot be rendered for this scheduler; the message says what to change."""


def shell_quote(value: Any) -> str:
    return shlex.quote(str(value))


def directive_value(value: Any) -> str:
    text = str(value)
    if _CONTROL.search(text):
        raise RenderError(f"scheduler directive value {text!r} contains a control character (e.g. a newline)")
    return shlex.quote(text) if text else ""


def directive_line(value: Any) -> str:
    """An extra directive is passed through as options, so only control characters are refused."""
    text = str(value).strip()
    if _CONTROL.search(text):
        raise RenderError(f"extra directive {text!r} contains a control character (e.g. a newline)")
    return text


def env_name(value: Any) -> str:
    if not _ENV_NAME.fullmatch(str(value)):
        raise RenderError(f"{value!r} is not a valid environment variable name")
    return str(value)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES_DIR),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        # shell uses `{#` (`${#array[@]}`), so Jinja comments get delimiters shell never has
        comment_start_string="{#-jinja",
        comment_end_string="jinja-#}",
    )
    env.filters.update(
        q=shell_quote, directive=directive_value, directive_line=directive_line, envname=env_name
    )
    return env


def render_job_script(preset: Preset, scheduler: str, run_dir: Path, python: str = sys.executable) -> str:
    """The job script text for `scheduler`, running out of the absolute `run_dir` with `python`."""
    if scheduler not in SCHEDULERS:
        raise RenderError(f"unknown scheduler {scheduler!r}: use one of {', '.join(SCHEDULERS)}")
    if scheduler == "local" and preset.nodes != 1:
        raise RenderError(
            f"the local scheduler runs one node but preset {preset.name} has nodes={preset.nodes}: "
            "use --set nodes=1 --set train_nodes=1, or submit to pbs/slurm"
        )
    run_dir = Path(run_dir)
    if not run_dir.is_absolute():
        raise RenderError(f"run dir {run_dir} must be absolute (the job runs from another directory)")
    if not Path(python).is_absolute():
        raise RenderError(f"python {python!r} must be an absolute path (nodes start with a minimal PATH)")
    resolved = resolve(preset)
    template = _environment().get_template(f"{scheduler}/job.sh.j2")
    return template.render(
        p=resolved,
        scheduler=scheduler,
        run_dir=str(run_dir),
        python=python,
        exit_codes=shell_settings(),
        attempt_files=ATTEMPT_FILES,
        node_cpus=(resolved.scheduler.pbs.ncpus or "") if scheduler == "pbs" else "",
    )
