"""One place where every `launcher` command's errors become a clean line (or a JSON object) and exit 1.

`install(main)` wraps the callback of every registered command. What a command raises that is the user's
to fix (a bad preset, a run that does not exist, a path it cannot write, a scheduler refusal, ...) is
printed as `Error: <message>` on stderr, or, when the command was given `--json`, as
`{"error": <message>, "hint": <hint or null>}` on stdout, and the exit status is 1 (a ClickException's
own status). A bug (anything else) still shows its traceback. Commands raise `CliError(message, hint)`
for their own refusals.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import jinja2

from launcher.render import RenderError
from launcher.runs import RUNS_DIR_ENV, RunLookupError, runs_base_dir
from launcher.schedulers import SchedulerError
from miles.contract.nodes import NodeIpError
from miles.contract.ports import PortError
from miles.contract.preset import PresetError
from miles.contract.roles import RoleError

_HANDLED = "_miles_errors_handled"
USER_ERRORS: tuple[type[BaseException], ...] = (
    click.ClickException,
    PresetError,
    RenderError,
    RunLookupError,
    SchedulerError,
    PortError,
    RoleError,
    NodeIpError,
    jinja2.TemplateError,
    OSError,
    UnicodeError,
)


class CliError(click.ClickException):
    """A refusal with a hint on how to fix it (the hint goes into the JSON error's `hint`)."""

    def __init__(self, message: str, hint: str | None = None, exit_code: int = 1):
        super().__init__(message)
        self.hint = hint
        self.exit_code = exit_code  # type: ignore[misc]  # click declares a class default; it reads this one


def describe(exc: BaseException) -> tuple[str, str | None]:
    """(message, hint) for an error the user can fix."""
    if isinstance(exc, click.ClickException):
        return exc.format_message(), getattr(exc, "hint", None)
    if isinstance(exc, PresetError):
        return str(exc), "`launcher presets doc` lists every preset key, its type and its default"
    if isinstance(exc, RunLookupError):
        return str(
            exc
        ), "`launcher runs` lists the runs (`--all` also those of the defaults file's runs_dirs)"
    if isinstance(exc, SchedulerError):
        return str(exc), "`launcher doctor --scheduler NAME` checks the scheduler's commands"
    if isinstance(exc, PortError):
        return str(exc), "free ports on this node, or pin the ports in the preset (ray.*_port, gateway.port)"
    if isinstance(exc, jinja2.TemplateNotFound):
        return (
            f"job script template {exc.name} not found",
            "the install is incomplete: reinstall miles-hpc (templates ship with the package)",
        )
    if isinstance(exc, jinja2.TemplateError):
        return f"job script template error: {exc}", "reinstall miles-hpc, or fix the edited template"
    if isinstance(exc, OSError):
        return _os_error(exc)
    if isinstance(exc, UnicodeError):
        return f"a file is not UTF-8 text: {exc}", "save it as UTF-8"
    return str(exc), None


def _os_error(exc: OSError) -> tuple[str, str | None]:
    where = exc.filename if exc.filename is not None else "a file"
    message = f"{where}: {exc.strerror or exc}"
    hint = "check that the directory exists and that you may write there"
    runs_base = runs_base_dir()
    if exc.filename is not None and Path(str(exc.filename)).resolve().is_relative_to(runs_base):
        hint = f"the runs directory {runs_base} is unusable: set {RUNS_DIR_ENV} to a directory you can write"
    return message, hint


def handle_errors(callback: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a command callback so that user errors end it cleanly (see the module doc)."""
    if getattr(callback, _HANDLED, False):
        return callback

    @functools.wraps(callback)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return callback(*args, **kwargs)
        except USER_ERRORS as exc:
            message, hint = describe(exc)
            code = exc.exit_code if isinstance(exc, click.ClickException) else 1
            report(message, hint, as_json=bool(kwargs.get("as_json")))
            raise click.exceptions.Exit(code) from None

    setattr(wrapper, _HANDLED, True)
    return wrapper


def report(message: str, hint: str | None, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({"error": message, "hint": hint}))
        return
    if hint:  # after a one-line message in parentheses; under a list of problems on a line of its own
        message += f"\n  hint: {hint}" if "\n" in message else f" (hint: {hint})"
    click.echo(f"Error: {message}", err=True)


def json_usage_errors(command: click.Command) -> None:
    """A command line click refuses (a bad option value, a missing argument) is, under --json, the same
    JSON object on stdout (exit status 2, click's own for usage errors) instead of usage text."""
    parse_args = command.parse_args

    def parse_or_report(ctx: click.Context, args: list[str]) -> list[str]:
        wants_json = "--json" in args
        try:
            return parse_args(ctx, args)
        except click.UsageError as exc:
            if not wants_json:
                raise
            report(exc.format_message(), f"`{ctx.command_path} --help` lists the options", as_json=True)
            raise click.exceptions.Exit(exc.exit_code) from None

    command.parse_args = parse_or_report  # type: ignore[method-assign]


def install(group: click.Group) -> None:
    """Wrap every command of `group` (and of its sub-groups); call it after the last command is added."""
    for command in group.commands.values():
        if isinstance(command, click.Group):
            install(command)
        elif not getattr(command.callback, _HANDLED, False):
            json_usage_errors(command)
        if command.callback is not None:
            command.callback = handle_errors(command.callback)


def installed_everywhere(group: click.Group) -> list[str]:
    """Names of the commands whose errors are not handled here (a test keeps this empty)."""
    missing = []
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            missing += [f"{name} {sub}" for sub in installed_everywhere(command)]
        if command.callback is not None and not getattr(command.callback, _HANDLED, False):
            missing.append(name)
    return missing
