"""A preset's `engines.server_args` as engine flags, the way SGLang's argparse reads them.

Light on purpose: the launcher checks a preset's server args at submit with it, before any Ray or torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def server_arg_flags(server_args: Mapping[str, Any]) -> list[str]:
    """`{key: value}` as argv: True -> bare flag, None/False -> nothing, a list -> the flag then one element
    per item (nargs options such as --lora-target-modules), a mapping -> JSON (--json-model-override-args),
    anything else -> `--flag=value` (one element: a value like "-1" stays a value)."""
    argv: list[str] = []
    for key, value in server_args.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, list | tuple):
            argv += [flag, *(str(item) for item in value)]
        elif isinstance(value, Mapping):
            argv.append(f"{flag}={json.dumps(value)}")
        elif value not in (None, False):
            argv.append(f"{flag}={value}")
    return argv
