"""copy_weights through the real tinker SDK: a copy of a readable checkpoint in a new training run of the
caller's, sharing the source's files (hard links), surviving the source's deletion, never trained, the same
copy for a retried request; another tenant's checkpoint only once published."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import tinker
from runtime_double import BASE, DoubleRuntime
from tinker import types

from tests.fast.local_gateway import local_gateway

OWNER, STRANGER = "tml-copy-owner-00001", "tml-copy-stranger-01"


@pytest.fixture
def served(tmp_path: Path):
    runtime = DoubleRuntime()
    with local_gateway(runtime, tmp_path / "ckpt", {OWNER: "owner", STRANGER: "stranger"}) as url:
        yield url, tmp_path / "ckpt", runtime


def _saved(service: tinker.ServiceClient, name: str) -> str:
    client = service.create_lora_training_client(base_model=BASE, rank=4).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    client.forward_backward([datum], "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return client.save_state(name).result().path


def _file(root: Path, tinker_path: str) -> Path:
    """The checkpoint's state file where the manager lays it out: root/model_id/kind/name."""
    path = root.joinpath(*tinker_path.removeprefix("tinker://").split("/"), "state.json")
    assert path.is_file(), f"no files of {tinker_path}"
    return path


def test_a_copy_shares_the_files_outlives_the_source_and_is_never_trained(served) -> None:
    url, root, runtime = served
    service = tinker.ServiceClient(base_url=url, api_key=OWNER)
    rest = service.create_rest_client()
    source = _saved(service, "step-1")
    copy = rest.copy_weights(source, "proj-archive").result()
    model_id = copy.removeprefix("tinker://").split("/")[0]
    assert copy.endswith("/weights/step-1") and model_id.startswith("copy-") and copy != source
    assert os.stat(_file(root, source)).st_ino == os.stat(_file(root, copy)).st_ino  # no bytes duplicated
    run = rest.get_training_run(model_id).result()
    assert run.user_metadata == {"project_id": "proj-archive"} and run.last_checkpoint.tinker_path == copy

    rest.delete_checkpoint_from_tinker_path(source).result()
    restored = service.create_training_client_from_state(copy).result()  # the copy is whole without it
    assert runtime.models[restored.model_id] == runtime.models[source.removeprefix("tinker://").split("/")[0]]

    answer = httpx.post(
        f"{url}/api/v1/optim_step",
        json={"model_id": model_id, "adam_params": {"learning_rate": 1e-3}},
        headers={"X-API-Key": OWNER},
    )
    assert answer.status_code == 400 and "cannot be trained" in answer.json()["detail"]


def test_a_retried_copy_is_the_same_copy_and_bad_requests_say_what_to_fix(served) -> None:
    url, _, _ = served
    source = _saved(tinker.ServiceClient(base_url=url, api_key=OWNER), "step-2")

    def copy(key: str, **extra) -> httpx.Response:
        body = {"source_path": source, "destination_project_id": "p", **extra}
        headers = {"X-API-Key": OWNER, "X-Idempotency-Key": key}
        return httpx.post(f"{url}/api/v1/copy_weights", json=body, headers=headers)

    first, again, other = copy("k1"), copy("k1"), copy("k2")
    assert first.status_code == again.status_code == other.status_code == 200
    assert first.json() == again.json() != other.json()
    with ThreadPoolExecutor(4) as pool:  # retries racing each other: one copy, one answer
        raced = list(pool.map(copy, ["k4"] * 4))
    assert [r.status_code for r in raced] == [200] * 4 and len({r.text for r in raced}) == 1
    rest = tinker.ServiceClient(base_url=url, api_key=OWNER).create_rest_client()
    runs = [r.training_run_id for r in rest.list_training_runs().result().training_runs]
    assert sum(run.startswith("copy-") for run in runs) == 3  # k1, k2, k4
    assert "between 3600" in copy("k3", ttl_seconds=60).json()["detail"]
    token = httpx.post(
        f"{url}/api/v1/copy_weights",
        json={"source_path": source, "destination_project_id": "p"},
        headers={"X-API-Key": OWNER, "X-Tinker-Weights-Access-Token": "t"},
    )
    assert token.status_code == 400 and "publish" in token.json()["detail"]


def test_another_tenants_checkpoint_is_copied_only_once_published(served) -> None:
    url, _, _ = served
    owner = tinker.ServiceClient(base_url=url, api_key=OWNER).create_rest_client()
    source = _saved(tinker.ServiceClient(base_url=url, api_key=OWNER), "shared")
    stranger = tinker.ServiceClient(base_url=url, api_key=STRANGER).create_rest_client()
    with pytest.raises(tinker.NotFoundError):
        stranger.copy_weights(source, "mine").result()
    owner.publish_checkpoint_from_tinker_path(source).result()
    copy = stranger.copy_weights(source, "mine").result()
    copy_run = copy.removeprefix("tinker://").split("/")[0]
    assert copy_run in [r.training_run_id for r in stranger.list_training_runs().result().training_runs]
    owner.unpublish_checkpoint_from_tinker_path(source).result()
    assert stranger.get_weights_info_by_tinker_path(copy).result().base_model == BASE  # theirs now
