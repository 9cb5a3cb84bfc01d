"""search_checkpoints (tinker 0.39's POST /api/v1/checkpoints/search, raw HTTP: the 0.38 SDK on the index
has no such call) over checkpoints the real 0.38 SDK saved: filters, owners, newest first, and a cursor
that pages without gaps or repeats while new checkpoints arrive. Each answered checkpoint parses as the
SDK's own Checkpoint type."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import tinker
from runtime_double import BASE, DoubleRuntime
from tinker import types

from tests.fast.local_gateway import local_gateway

OWNER, STRANGER = "tml-search-owner-0001", "tml-search-strangr-01"


@pytest.fixture
def served(tmp_path: Path):
    with local_gateway(DoubleRuntime(), tmp_path / "ckpt", {OWNER: "owner", STRANGER: "stranger"}) as url:
        yield url


def _trained(url: str, key: str) -> tinker.TrainingClient:
    client = (
        tinker.ServiceClient(base_url=url, api_key=key).create_lora_training_client(BASE, rank=4).result()
    )
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    client.forward_backward([datum], "cross_entropy").result()
    return client


def _search(url: str, key: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/api/v1/checkpoints/search", json=body, headers={"X-API-Key": key})


def _paths(answer: httpx.Response) -> list[str]:
    assert answer.status_code == 200, answer.text
    checkpoints = [types.Checkpoint.model_validate(c) for c in answer.json()["checkpoints"]]
    return [c.tinker_path for c in checkpoints]


def test_filters_match_exactly_and_results_come_newest_first(served) -> None:
    client = _trained(served, OWNER)
    first = client.save_state("a", user_metadata={"recipe": "sft", "step": "1"}).result().path
    sampler = client.save_weights_for_sampler("b", ttl_seconds=7200, user_metadata={"recipe": "sft"})
    sampler = sampler.result().path
    last = client.save_state("c", user_metadata={"recipe": "rl"}).result().path

    assert _paths(_search(served, OWNER)) == [last, sampler, first]
    assert _paths(_search(served, OWNER, user_metadata={"recipe": "sft"})) == [sampler, first]
    assert _paths(_search(served, OWNER, user_metadata={"recipe": "sft", "step": "1"})) == [first]
    assert _paths(_search(served, OWNER, checkpoint_type="sampler")) == [sampler]
    (found,) = _search(served, OWNER, checkpoint_type="sampler").json()["checkpoints"]
    assert found["user_metadata"] == {"recipe": "sft"} and found["expires_at"] is not None  # the SDK's ttl
    assert _paths(_search(served, OWNER, checkpoint_type="training")) == [last, first]
    assert _paths(_search(served, OWNER, base_models=[BASE, "other/base"])) == [last, sampler, first]
    assert _paths(_search(served, OWNER, base_models=[])) == []  # an empty list matches none
    answer = _search(served, OWNER, limit=1)
    assert answer.json()["checkpoints"][0]["base_model"] == BASE  # 0.39's Checkpoint.base_model


def test_the_cursor_pages_without_gaps_or_repeats_while_checkpoints_arrive(served) -> None:
    client = _trained(served, OWNER)
    saved = [client.save_state(f"s{i}").result().path for i in range(5)]
    seen: list[str] = []
    answer = _search(served, OWNER, limit=2)
    client.save_state("late").result()  # newer than every page still to come: never shifts them
    while True:
        seen += _paths(answer)
        cursor = answer.json()["next_cursor"]
        if cursor is None:
            break
        assert set(cursor) == {"last_created_at", "last_checkpoint_uuid"}
        answer = _search(served, OWNER, limit=2, cursor=cursor)
    assert seen == saved[::-1]


def test_owners_see_only_what_they_may_read(served) -> None:
    client = _trained(served, OWNER)
    private = client.save_state("private").result().path
    shared = client.save_state("shared").result().path
    rest = tinker.ServiceClient(base_url=served, api_key=OWNER).create_rest_client()
    rest.publish_checkpoint_from_tinker_path(shared).result()
    mine = _trained(served, STRANGER).save_state("mine").result().path

    assert _paths(_search(served, STRANGER)) == [mine]  # the default owner: the caller's own
    assert _paths(_search(served, STRANGER, owner={"type": "own"})) == [mine]
    assert _paths(_search(served, STRANGER, owner={"type": "accessible"})) == [mine, shared]
    assert _paths(_search(served, STRANGER, owner={"type": "user", "owner_urns": ["owner"]})) == [shared]
    assert private not in _paths(_search(served, OWNER, owner={"type": "user", "owner_urns": ["stranger"]}))


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"project_ids": ["team-a"]}, "no projects"),
        ({"limit": 0}, "limit"),
        ({"limit": 201}, "limit"),
        ({"owner": {"type": "everyone"}}, "owner"),
        ({"owner": {"type": "user", "owner_urns": []}}, "owner_urns"),
        ({"checkpoint_type": "optimizer"}, "checkpoint_type"),
        ({"cursor": {"last_created_at": "yesterday", "last_checkpoint_uuid": "x"}}, "last_created_at"),
    ],
)
def test_a_bad_search_is_a_4xx_that_names_the_field(served, body: dict, says: str) -> None:
    answer = _search(served, OWNER, **body)
    assert 400 <= answer.status_code < 500 and says in answer.text, answer.text


def test_search_needs_an_api_key(served) -> None:
    assert httpx.post(f"{served}/api/v1/checkpoints/search", json={}).status_code == 401
