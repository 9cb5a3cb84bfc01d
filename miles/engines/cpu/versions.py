"""Which weight version each generated token was sampled under, as SGLang 0.5.23 reports it (pure).

When an engine's weight version changes while requests run (an in-place weight update: generation paused
in place, weights replaced, generation continued), each running request records the old version and how
many tokens it had generated (SGLang's WeightVersionEvent). A finished request's meta_info then carries
`weight_versions`: spans `{"version", "start", "end"}` over its output tokens, and `weight_version`, the
last span's version (sglang/srt/utils/weight_versions.py: compute_weight_version_spans and
add_weight_versions_to_meta_info), so an off-policy RL loop can weigh each token by the policy that
sampled it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VersionEvent:
    old_version: str
    output_tokens: int  # tokens generated under `old_version` (and earlier versions) when it changed


def record_change(events: list[VersionEvent], old_version: str, output_tokens: int) -> None:
    """A request with `output_tokens` generated so far saw the version change (nothing before a token)."""
    if output_tokens > 0:
        events.append(VersionEvent(old_version, output_tokens))


def version_spans(events: list[VersionEvent], current: str, output_tokens: int) -> list[dict[str, Any]]:
    """Consecutive spans of output tokens by the version that sampled them (SGLang's rules: a version
    that changed before any further token adds no span; equal neighbours merge)."""
    spans: list[dict[str, Any]] = []
    changes = [(e.old_version, e.output_tokens) for e in events] + [(current, output_tokens)]
    for version, end in changes:
        end = min(end, output_tokens)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans


def finished_meta(events: list[VersionEvent], current: str, output_tokens: int) -> dict[str, Any]:
    """meta_info's `weight_versions` and `weight_version` of a finished request."""
    spans = version_spans(events, current, output_tokens)
    visible = [s for s in spans if s["start"] < output_tokens or not s["start"]]
    return {"weight_versions": visible, "weight_version": visible[-1]["version"]}
