"""A two-model catalog in a real job on the 3-node local Slurm cluster (issue 13): the real driver, one
2-GPU instance per node at most, the tiny model under two names. Nothing starts before a tenant asks;
two LoRA tenants share an instance, a second model starts on another node, the first model's instance
is released when its tenants leave, and its node's GPUs are then taken by the other model (reuse) until
the pool is full and the next request is refused with the capacity error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from jobtools import launcher_json, run_logs, wait_until
from stacktools import stack_preset, wait_healthy
from tinker import types

ROWS = [[5, 17, 300, 42, 9, 77, 512, 3], [40, 41, 42, 43, 44, 45]]


def catalog_preset() -> dict:
    preset = stack_preset("catalog-slurm", nodes=3)
    preset["gpus_per_node"] = 2  # logical; one 2-GPU instance per node
    entry = {"init": "tiny", "gpus_per_instance": 2, "max_lora_rank": 8, "max_context": 512}
    preset["catalog"] = [
        {"name": "tiny-a", "lora_slots": 2} | entry,
        {"name": "tiny-b", "lora_slots": 1} | entry,
    ]
    preset["model"]["name"] = "tiny-a"
    return preset


def batch() -> list[types.Datum]:
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(row[:-1]),
            loss_fn_inputs={"target_tokens": row[1:], "weights": [1.0] * (len(row) - 1)},
        )
        for row in ROWS
    ]


def train_step(client: Any) -> tuple[float, float]:
    before = client.forward_backward(batch(), "cross_entropy").result().metrics["loss:sum"]
    client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    after = client.forward_backward(batch(), "cross_entropy").result().metrics["loss:sum"]
    return before, after


class Job:
    def __init__(self, status: dict) -> None:
        self.key = Path(status["api_key_file"]).read_text().strip()
        self.url = status["gateway_url"]
        self.service = tinker.ServiceClient(base_url=self.url, api_key=self.key)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-Key": self.key}, trust_env=False, timeout=60)

    def catalog(self) -> dict:
        with self.http() as http:
            answer = http.get("/api/v1/catalog")
        assert answer.status_code == 200, answer.text
        return answer.json()

    def instances(self, model: str) -> list[dict]:
        return next(m for m in self.catalog()["models"] if m["name"] == model)["instances"]

    def unload(self, model_id: str) -> None:
        with self.http() as http:
            request_id = http.post("/api/v1/unload_model", json={"model_id": model_id}).json()["request_id"]
            wait_until(
                lambda: (
                    http.post("/api/v1/retrieve_future", json={"request_id": request_id}).json().get("type")
                    != "try_again"
                ),
                60,
                f"unload of {model_id}",
            )


def test_two_model_catalog_starts_shares_releases_and_reuses(
    slurm_cluster, runs_dir: Path, write_preset, slurm_jobs: list[str]
) -> None:
    sub = launcher_json("submit", "--preset", str(write_preset(catalog_preset())), "--scheduler", "slurm")
    slurm_jobs.append(sub["job_id"])
    run_dir = Path(sub["run_dir"])
    job = Job(wait_healthy(sub))
    first = job.catalog()
    assert [m["name"] for m in first["models"]] == ["tiny-a", "tiny-b"]
    assert all(m["instances"] == [] for m in first["models"])  # lazy: no instance before a tenant
    assert first["pool"]["free_gpus"] == 6, first

    a1 = job.service.create_lora_training_client(base_model="tiny-a", rank=4, seed=1).result()
    a2 = job.service.create_lora_training_client(base_model="tiny-a", rank=4, seed=2).result()
    (shared,) = job.instances("tiny-a")  # both tenants on one instance
    assert {t["model_id"] for t in shared["tenants"]} == {a1.model_id, a2.model_id}
    for client in (a1, a2):
        before, after = train_step(client)
        assert after < before, run_logs(run_dir)
    b1 = job.service.create_lora_training_client(base_model="tiny-b", rank=4).result()
    (b_instance,) = job.instances("tiny-b")
    assert b_instance["node"] != shared["node"]
    train_step(b1)

    job.unload(a1.model_id)
    train_step(a2)  # the peer's departure leaves the instance serving
    job.unload(a2.model_id)
    wait_until(lambda: job.instances("tiny-a") == [], 60, "tiny-a's instance released")
    assert job.catalog()["pool"]["free_gpus"] == 4

    b2 = job.service.create_lora_training_client(base_model="tiny-b", rank=4).result()
    b3 = job.service.create_lora_training_client(base_model="tiny-b", rank=4).result()
    nodes = {i["node"] for i in job.instances("tiny-b")}
    assert len(nodes) == 3 and shared["node"] in nodes  # tiny-a's GPUs went to tiny-b
    train_step(b3)
    with pytest.raises(Exception, match=r"no capacity for model 'tiny-b'"):
        job.service.create_lora_training_client(base_model="tiny-b", rank=4).result()
    assert job.catalog()["pool"]["free_gpus"] == 0
    del b2

    launcher_json("cancel", sub["run_id"])
    wait_until(
        lambda: launcher_json("status", sub["run_id"])["state"] not in ("RUNNING", "PENDING"),
        90,
        f"the job to end\n{run_logs(run_dir)}",
    )


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
