"""Pure parsing of tinker:// paths and REST checkpoint ids."""

from __future__ import annotations

import pytest

from miles.checkpoints import (
    CheckpointNotFound,
    InvalidCheckpointName,
    TinkerPath,
    parse_checkpoint_id,
    parse_tinker_path,
)
from miles.checkpoints.paths import checked_new_path


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (
            "tinker://sess-0001:train:0/weights/ckpt-001",
            TinkerPath("sess-0001:train:0", "weights", "ckpt-001"),
        ),
        (
            "tinker://a1b2:train:12/sampler_weights/s.v_2",
            TinkerPath("a1b2:train:12", "sampler_weights", "s.v_2"),
        ),
        (
            "tinker://a1b2:train:12/external_weights/hf",
            TinkerPath("a1b2:train:12", "external_weights", "hf"),
        ),
    ],
)
def test_parses_valid_paths(path: str, expected: TinkerPath) -> None:
    parsed = parse_tinker_path(path)
    assert parsed == expected
    assert parsed.uri == path


@pytest.mark.parametrize(
    "path",
    [
        "",
        "sess:train:0/weights/x",
        "http://sess:train:0/weights/x",
        "tinker://sess:train:0/weights",
        "tinker://sess:train:0/weights/x/y",
        "tinker://sess:train:0/other_weights/x",
        "tinker://sess:train:0/weights/..",
        "tinker://sess:train:0/weights/.",
        "tinker://sess:train:0/weights/",
        "tinker://../weights/x",
        "tinker://.staging/weights/x",
        "tinker:///etc/weights/x",
        "tinker://sess:train:0/weights/%2e%2e",
        "tinker://sess:train:0/weights/a b",
        "tinker://sess:train:0/weights/a\x00b",
        None,
        42,
    ],
)
def test_rejects_everything_else_as_not_found(path: object) -> None:
    with pytest.raises(CheckpointNotFound):
        parse_tinker_path(path)


def test_checkpoint_ids_contain_one_slash() -> None:
    assert parse_checkpoint_id("m:train:0", "weights/000020") == TinkerPath("m:train:0", "weights", "000020")
    for bad in ["weights", "sampler_weights", ".", "", "weights/../x", "weights/a/b", "/etc/passwd", "x/y"]:
        with pytest.raises(CheckpointNotFound):
            parse_checkpoint_id("m:train:0", bad)
    with pytest.raises(CheckpointNotFound):
        parse_checkpoint_id("..", "weights/x")


def test_new_paths_explain_what_to_fix() -> None:
    with pytest.raises(InvalidCheckpointName, match="letters, digits"):
        checked_new_path("m:train:0", "weights", "../up")
    with pytest.raises(InvalidCheckpointName, match="kind"):
        checked_new_path("m:train:0", "other_weights", "x")
    with pytest.raises(InvalidCheckpointName, match="model id"):
        checked_new_path("/abs", "weights", "x")
