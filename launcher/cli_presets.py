"""CLI commands that need no scheduler: presets list/show/validate, render, roles."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from launcher.defaults import load_user_layers, load_user_preset
from launcher.layers import annotated_yaml
from launcher.preset_reference import reference_markdown
from launcher.presets import list_presets, load_preset, preset_path
from launcher.render import SCHEDULERS, render_job_script
from miles.contract.nodes import IP_MODES
from miles.contract.roles import plan_from_node_file

set_option = click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a preset key (repeatable)."
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2))


@click.group("presets")
def presets_group() -> None:
    """List, show and validate presets."""


@presets_group.command("list")
@json_option
def presets_list(as_json: bool) -> None:
    """The shipped presets."""
    presets = [load_preset(name, env={}) for name in list_presets()]
    if as_json:
        _echo_json([{"name": p.name, "nodes": p.nodes, "description": p.description} for p in presets])
        return
    table = Table("name", "nodes", "train", "gpus/node", "engines", "description")
    for p in presets:
        engines = f"{p.engines.kind} tp{p.engines.tp_size}"
        table.add_row(p.name, str(p.nodes), str(p.train_nodes), str(p.gpus_per_node), engines, p.description)
    Console(width=140).print(table)


@presets_group.command("show")
@click.argument("name")
@click.option(
    "--resolved",
    is_flag=True,
    help="Every default filled, the defaults file, env and --set applied; each value's source as a comment.",
)
@set_option
@json_option
def presets_show(name: str, resolved: bool, overrides: tuple[str, ...], as_json: bool) -> None:
    """Show preset NAME (a shipped name or a YAML path)."""
    if as_json:
        _echo_json(load_user_preset(name, overrides).model_dump(mode="json"))
    elif resolved or overrides:
        preset, layers = load_user_layers(name, overrides)
        click.echo(annotated_yaml(preset.model_dump(mode="json"), layers.source_of), nl=False)
    else:
        click.echo(preset_path(name).read_bytes().decode("utf-8"), nl=False)


@presets_group.command("validate")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@set_option
@json_option
def presets_validate(file: str, overrides: tuple[str, ...], as_json: bool) -> None:
    """Check a preset file; exit status 1 with the bad keys named if it is invalid."""
    preset = load_user_preset(file, overrides)
    if as_json:
        _echo_json({"valid": True, "name": preset.name, "file": str(Path(file).resolve())})
    else:
        click.echo(
            f"{file}: valid preset {preset.name} ({preset.nodes} nodes, {preset.train_nodes} training)"
        )


@presets_group.command("doc")
def presets_doc() -> None:
    """Print the presets reference (docs/presets.md) generated from the preset models."""
    click.echo(reference_markdown(), nl=False)


@click.command("render")
@click.option("--preset", "preset_name", required=True, help="Shipped preset name or YAML path.")
@click.option("--scheduler", type=click.Choice(SCHEDULERS), required=True)
@set_option
@click.option(
    "-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Write here, not stdout."
)
@click.option(
    "--run-dir", type=click.Path(file_okay=False, path_type=Path), help="Run directory the script uses."
)
@click.option("--python", default=sys.executable, show_default=True, help="Python of the miles-hpc install.")
def render_command(
    preset_name: str,
    scheduler: str,
    overrides: tuple[str, ...],
    output: Path | None,
    run_dir: Path | None,
    python: str,
) -> None:
    """Render the job script of a preset (preview; `launcher submit` renders into a run directory)."""
    preset = load_user_preset(preset_name, overrides)
    run_dir = (run_dir or Path("runs") / f"{preset.name}-preview").resolve()
    script = render_job_script(preset, scheduler, run_dir, python)
    if output is None:
        click.echo(script, nl=False)
    else:
        output.write_text(script)
        if output.is_file():  # a script file becomes executable; never a device such as /dev/null
            output.chmod(0o755)
        click.echo(f"wrote {output} ({scheduler}, run dir {run_dir})", err=True)


@click.command("roles")
@click.option(
    "--nodefile",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    required=True,
    help="One 'NAME' or 'NAME IP' per line (PBS_NODEFILE repeats collapse).",
)
@click.option("--head", required=True, help="Name of the node running the job script.")
@click.option("--train-nodes", type=int, required=True)
@click.option(
    "--ip-mode",
    type=click.Choice(IP_MODES),
    default="hostname",
    show_default=True,
    help="How to get IPs missing from the node file (loopback-index: TEST MODE, node i -> 127.0.0.(2+i)).",
)
@click.option("--tsv", type=click.Path(dir_okay=False, path_type=Path), help="Write roles.tsv here.")
@click.option(
    "--colocated", is_flag=True, help="Every node trains and serves (colocate.enabled; train-nodes = nodes)."
)
@json_option
def roles_command(
    nodefile: Path,
    head: str,
    train_nodes: int,
    ip_mode: str,
    tsv: Path | None,
    colocated: bool,
    as_json: bool,
) -> None:
    """Plan node roles: sorted by IP, the head last; trainers first, engines the rest."""
    plan = plan_from_node_file(nodefile.read_text(), head, train_nodes, ip_mode, colocated)
    if tsv is not None:
        tsv.write_text(plan.to_tsv())
    if as_json:
        _echo_json(plan.to_json())
    else:
        click.echo(plan.summary_line())


COMMANDS: tuple[click.Command | Callable[..., Any], ...] = (presets_group, render_command, roles_command)


def register(group: click.Group) -> None:
    """Attach this module's commands to the top-level group."""
    for command in COMMANDS:
        group.add_command(command)  # type: ignore[arg-type]
