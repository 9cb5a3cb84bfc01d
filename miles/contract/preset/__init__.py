"""The preset: one YAML file that describes a job, resolved at submit (every default filled) and handed
to the job in the run directory. One module per section; `preset.py` holds the whole and its checks."""

from miles.contract.preset.base import PresetError
from miles.contract.preset.colocate import engine_release_tags
from miles.contract.preset.files import read_resolved
from miles.contract.preset.gateway import DEAD_PROBES_ENV, parse_dead_probes
from miles.contract.preset.preset import (
    Preset,
    lora_batch_window_ms,
    preset_to_yaml,
    resolve,
    state_key_prefix,
)

__all__ = [
    "DEAD_PROBES_ENV",
    "Preset",
    "PresetError",
    "engine_release_tags",
    "lora_batch_window_ms",
    "parse_dead_probes",
    "preset_to_yaml",
    "read_resolved",
    "resolve",
    "state_key_prefix",
]
