"""`python -m miles.job.ports`: the job script's port claims on a node (the logic: `miles.contract.ports`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import click

from miles.contract.ports import PortError, claim_ports, shell_lines


def parse_specs(specs: Sequence[str], option: str, form: str, value: Callable[[str], object]) -> dict:
    """`option` values of the given form (NAME, a separator, a VALUE) as {NAME: value(VALUE)}; a malformed
    one is a usage error naming it."""
    sep = form.removeprefix("NAME")[0]  # what follows NAME in the form: ":" or "="
    parsed = {}
    for spec in specs:
        name, found, raw = spec.partition(sep)
        try:
            if not (found and name):
                raise ValueError
            parsed[name] = value(raw)
        except ValueError:
            raise click.BadParameter(f"{spec!r}: expected {form}", param_hint=option) from None
    return parsed


def positive(raw: str) -> int:
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(raw)
    return int(raw)


def port_span(raw: str) -> tuple[int, int]:
    first, _, last = raw.partition("-")
    span = (positive(first), positive(last))
    if span[0] > span[1]:
        raise ValueError(raw)
    return span


@click.command()
@click.option("--owner", type=int, required=True, help="The pid whose lifetime the claim lasts.")
@click.option("--name", "names", multiple=True, help="A single port to pick (repeat).")
@click.option("--range", "ranges", multiple=True, metavar="NAME:SIZE", help="A contiguous range (repeat).")
@click.option(
    "--fixed", multiple=True, metavar="NAME=PORT", help="A port the preset pins: checked free, claimed."
)
@click.option(
    "--fixed-range", "fixed_ranges", multiple=True, metavar="NAME=FIRST-LAST", help="A pinned range."
)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True)
def main(
    owner: int,
    names: tuple[str, ...],
    ranges: tuple[str, ...],
    fixed: tuple[str, ...],
    fixed_ranges: tuple[str, ...],
    out: Path,
) -> None:
    """Claim ports on this node for OWNER (free ones picked, pinned ones checked) and write NAME=port lines
    to OUT."""
    sizes = parse_specs(ranges, "--range", "NAME:SIZE", positive)
    pinned = parse_specs(fixed, "--fixed", "NAME=PORT", positive)
    pinned_ranges = parse_specs(fixed_ranges, "--fixed-range", "NAME=FIRST-LAST", port_span)
    try:
        claim = claim_ports(owner, names, sizes, fixed=pinned, fixed_ranges=pinned_ranges)
    except PortError as exc:
        raise click.ClickException(str(exc)) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(shell_lines(claim))
    tmp.replace(out)


if __name__ == "__main__":
    main()
