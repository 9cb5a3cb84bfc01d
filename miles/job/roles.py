"""`python -m miles.job.roles`: the job script's role plan, written to roles.tsv and logged in one line
(`node roles: ...`). The plan itself is `miles.contract.roles`, the one planner."""

from __future__ import annotations

from pathlib import Path

import click

from miles.contract.nodes import IP_MODES, NodeIpError
from miles.contract.roles import RoleError, plan_from_node_file


@click.command()
@click.option("--nodefile", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True)
@click.option("--head", required=True, help="Name of the node running the job script.")
@click.option("--train-nodes", type=int, required=True)
@click.option("--ip-mode", type=click.Choice(IP_MODES), required=True)
@click.option("--tsv", type=click.Path(dir_okay=False, path_type=Path), required=True)
@click.option("--colocated", is_flag=True, help="Every node trains and serves (colocate.enabled).")
def main(nodefile: Path, head: str, train_nodes: int, ip_mode: str, tsv: Path, colocated: bool) -> None:
    """Plan node roles (sorted by IP, the head last; trainers first, engines the rest) into TSV."""
    try:
        plan = plan_from_node_file(nodefile.read_text(), head, train_nodes, ip_mode, colocated)
    except (RoleError, NodeIpError) as exc:
        raise click.ClickException(str(exc)) from None
    tsv.write_text(plan.to_tsv())
    click.echo(plan.summary_line())


if __name__ == "__main__":
    main()
