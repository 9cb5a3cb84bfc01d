"""A preset mapping built from layers (file, defaults file, environment, `--set`), remembering which layer
set each value, so `launcher presets show --resolved` can say where every value came from."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

Path_ = tuple[str, ...]
BUILT_IN = "default"  # a value no layer set: the preset models' default, or derived from other values
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_YAML11_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null"}


def leaves(data: Mapping[str, Any], prefix: Path_ = ()) -> Iterator[tuple[Path_, Any]]:
    """(path, value) of every leaf; a list, a scalar or an empty mapping is a leaf."""
    for key, value in data.items():
        path = (*prefix, str(key))
        if isinstance(value, Mapping) and value:
            yield from leaves(value, path)
        else:
            yield path, value


@dataclass
class Layered:
    """The raw preset mapping and, per path, the layer that last set it."""

    data: dict[str, Any] = field(default_factory=dict)
    sources: dict[Path_, str] = field(default_factory=dict)

    def put(self, path: Path_, value: Any, source: str) -> None:
        """Set one value; what a layer replaces wholesale (a mapping given as one value) forgets its parts."""
        node = self.data
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = value
        for known in [p for p in self.sources if p[: len(path)] == path]:
            del self.sources[known]
        self.sources[path] = source

    def put_all(self, data: Mapping[str, Any], source: str) -> None:
        for path, value in leaves(data):
            self.put(path, value, source)

    def source_of(self, path: Path_) -> str:
        for end in range(len(path), 0, -1):
            if path[:end] in self.sources:
                return self.sources[path[:end]]
        return BUILT_IN


def annotated_yaml(
    data: Mapping[str, Any], source_of: Callable[[Path_], str], prefix: Path_ = (), indent: int = 0
) -> str:
    """Block YAML of `data` with each leaf's source as a trailing comment; loadable as YAML again.

    Leaves are written in JSON form (a JSON value is also a YAML flow value), so quoting is always right.
    """
    lines = []
    pad = "  " * indent
    for key, value in data.items():
        path = (*prefix, str(key))
        plain = _PLAIN_KEY.fullmatch(str(key)) and str(key).lower() not in _YAML11_WORDS
        name = key if plain else json.dumps(str(key))
        if isinstance(value, Mapping) and value:
            lines.append(f"{pad}{name}:")
            lines.append(annotated_yaml(value, source_of, path, indent + 1).rstrip("\n"))
        else:
            lines.append(f"{pad}{name}: {json.dumps(value)}  # {source_of(path)}")
    return "\n".join(lines) + "\n"
