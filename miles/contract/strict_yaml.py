"""YAML read the YAML 1.2 way: no YAML 1.1 surprises in presets, `--set` values or the defaults file.

PyYAML follows YAML 1.1, where `yes`/`on` are booleans, `010` is octal 8 and `12:00:00` is the base-60
integer 43200. Here only `true`/`false` are booleans and only plain decimals are numbers; every other
plain scalar stays a string, so the strict preset models refuse `nodes: yes` instead of reading 1, and a
walltime written `12:00:00` arrives as that text.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

_BOOL = "tag:yaml.org,2002:bool"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_TIMESTAMP = "tag:yaml.org,2002:timestamp"
_YAML11_ONLY = (_BOOL, _INT, _FLOAT, _TIMESTAMP)


class StrictLoader(yaml.SafeLoader):
    """SafeLoader with the YAML 1.2 core schema's booleans and numbers (and no timestamps)."""


StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _YAML11_ONLY]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
StrictLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
StrictLoader.add_implicit_resolver(_INT, re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$"), list("-+0123456789"))
# Floats as YAML 1.1 writes them (a dot, a signed exponent): every scalar read here as a number is one
# PyYAML's dumper would also read as a number, so text it writes unquoted (`1e-5`) reads back as text.
StrictLoader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"^(?:[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def load(text: str) -> Any:
    """Parse one YAML document with the strict scalar rules (raises yaml.YAMLError)."""
    return yaml.load(text, Loader=StrictLoader)  # a SafeLoader subclass: safe
