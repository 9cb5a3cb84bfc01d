import pytest

from miles.runtime.adapters import AdapterResidency


def test_least_recently_used_adapters_over_the_limit_are_evicted() -> None:
    residency = AdapterResidency(2)
    for name in ("a", "b", "c"):
        residency.touch(name)
    assert residency.victims() == ["a"]
    residency.touch("b")  # b used again: c is now the oldest
    residency.touch("d")
    assert residency.victims() == ["c"]
    assert residency.loaded() == ["b", "d"]
    assert residency.victims() == []


def test_an_adapter_in_use_is_never_evicted() -> None:
    residency = AdapterResidency(1)
    residency.acquire("a")
    residency.touch("b")
    residency.touch("c")
    assert residency.victims() == ["b"]  # a is older but a request samples from it
    assert residency.loaded() == ["a", "c"]  # over the limit until a is released
    residency.release("a")
    assert residency.victims() == ["a"]
    with residency.using("c"):
        residency.touch("d")
        assert residency.victims() == []  # c in use, d the newest: both stay for now
    assert residency.victims() == ["c"]


def test_limit_must_keep_one() -> None:
    with pytest.raises(ValueError, match="at least one"):
        AdapterResidency(0)
