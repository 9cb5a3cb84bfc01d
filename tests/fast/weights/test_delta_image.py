"""The trainer's image of what a group's engines hold, and the driver's choices around it (pure): which
pushes send deltas, why the others do not, and which tensors an engine's digests disagree on."""

from __future__ import annotations

import pytest
import torch

from miles.utils import delta
from miles.utils.buckets import TensorMeta
from miles.weights.delta_check import image_differences
from miles.weights.delta_image import EngineImage, fresh_image
from miles.weights.kept_group import DeltaOff, DeltaPace, KeptGroup, delta_mode, fallback_reason
from miles.weights.sender import GroupSpec

METAS = {
    "a": TensorMeta("a", "bfloat16", (2, 3)),
    "b": TensorMeta("b", "float32", (2,)),
    "c": TensorMeta("c", "bfloat16", (4,)),
}
PLAN = (("a", "b"), ("c",))


def _bucket(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(2, 3, generator=g).to(torch.bfloat16),
        "b": torch.randn(2, generator=g),
        "c": torch.randn(4, generator=g).to(torch.bfloat16),
    }


def test_an_image_records_buckets_and_views_each_tensor_in_its_dtype_and_shape() -> None:
    w = _weights(0)
    image = EngineImage(PLAN, METAS)
    assert not image.complete
    sent = _bucket(w["a"], w["b"])
    image.record(0, sent)
    image.record(1, _bucket(w["c"]))
    assert image.complete
    sent.zero_()  # the image is a copy: the sender's buffer is reused for the next push
    views = dict(image.tensors())
    for name in METAS:
        assert views[name].dtype == w[name].dtype and torch.equal(views[name], w[name])
    assert image.digests() == delta.digest_many(w.items())


def test_encoding_against_the_image_rebuilds_the_new_bucket_and_moves_the_image_on() -> None:
    old, new = _weights(0), _weights(0)
    new["a"][0, 0] += 1.0
    image = EngineImage(PLAN, METAS)
    image.record(0, _bucket(old["a"], old["b"]))
    engine = _bucket(old["a"], old["b"])
    encoded = image.encode(0, _bucket(new["a"], new["b"]))
    assert encoded.changed >= 1
    delta.apply_bucket(engine, encoded.header, encoded.payload)
    assert torch.equal(engine, _bucket(new["a"], new["b"]))
    assert torch.equal(image.buckets[0], engine), "the image is what the engines hold now"
    with pytest.raises(RuntimeError, match="no image of bucket 1"):
        image.encode(1, _bucket(new["c"]))


def test_a_recording_push_of_the_same_plan_reuses_the_last_images_memory() -> None:
    last = EngineImage(PLAN, METAS)
    last.record(0, _bucket(*_weights(0).values())[:32])
    again = fresh_image(PLAN, METAS, last)
    assert again.buckets[0] is last.buckets[0]
    assert fresh_image((("a",),), METAS, last).buckets == [None]


def test_deltas_go_only_over_the_kept_group_whose_image_was_checked() -> None:
    spec = GroupSpec("127.0.0.1", 1, 2, "g")
    checked, unchecked = KeptGroup(spec, (), delta_ready=True), KeptGroup(spec, ())
    assert delta_mode(True, True, checked, None) == "send"
    assert delta_mode(True, False, checked, None) == "record"  # a fresh group: new processes
    assert delta_mode(True, True, unchecked, None) == "record"
    assert delta_mode(True, True, None, None) == "record"
    refused = DeltaOff("engines_refuse", "engine 0 refused")
    assert delta_mode(True, True, checked, refused) == "off"
    assert delta_mode(False, True, checked, None) == "off"
    assert fallback_reason("send", True, None) is None
    assert fallback_reason("record", True, None) == "no_image"
    assert fallback_reason("off", True, refused) == "engines_refuse"
    assert fallback_reason("off", True, DeltaOff("slower", "")) == "slower"
    assert fallback_reason("off", False, None) is None


def test_deltas_go_off_after_two_delta_pushes_in_a_row_slower_than_the_last_full_one() -> None:
    pace = DeltaPace()
    assert pace.after("send", 9.0) is None, "no full push to compare with yet"
    assert pace.after("record", 1.0) is None
    assert pace.after("send", 2.0) is None, "one slow push may be a cold start"
    assert pace.after("send", 0.5) is None and pace.slower == 0, "a faster one starts the count again"
    assert pace.after("send", 1.5) is None
    assert pace.after("off", 5.0) is None, "a plain full push neither counts nor resets"
    off = pace.after("send", 1.2)
    assert off is not None and off.reason == "slower" and "1.200 s vs 1.000 s" in off.detail
    pace = DeltaPace()
    pace.after("record", 2.0)
    assert all(pace.after("send", 0.3) is None for _ in range(5)), "deltas that pay stay on"


def test_image_differences_name_what_differs_or_is_missing_in_the_trainers_order() -> None:
    image = {"b": "2", "a": "1", "c": "3"}
    answer = {"success": True, "ranks": [{"checksums": {"a": "1", "b": "9"}}]}
    assert image_differences(image, answer) == ["b", "c"]
    assert image_differences(image, {"ranks": [{"checksums": image}]}) == []
    assert image_differences(image, "not json") == ["b", "a", "c"]


def test_the_push_keeps_its_pace_on_the_controller_and_turns_deltas_off() -> None:
    from types import SimpleNamespace

    from miles.weights.push import PushConfig, pace_deltas

    controller = SimpleNamespace(delta_off=None, delta_pace=None)
    paced, kept_on = PushConfig(delta=True), PushConfig(delta=True, delta_pace=False)
    for mode, seconds in (("record", 1.0), ("send", 3.0), ("send", 3.0)):
        pace_deltas(controller, kept_on, mode, seconds)  # type: ignore[arg-type]
    assert controller.delta_off is None and controller.delta_pace is None
    for mode, seconds in (("record", 1.0), ("send", 3.0), ("send", 3.0)):
        pace_deltas(controller, paced, mode, seconds)  # type: ignore[arg-type]
    assert controller.delta_off.reason == "slower"
