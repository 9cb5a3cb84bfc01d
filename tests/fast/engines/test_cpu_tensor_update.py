"""`/update_weights_from_tensor` on the CPU engine: a second process (the trainer's place) hands over handles
to its weights; the engine copies them in. SGLang 0.5.23's session rule, payload list and answers."""

from __future__ import annotations

import base64
import contextlib
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import httpx
import pytest
import torch

from miles.engines.cpu.memory import WEIGHTS_RELEASED
from miles.engines.errors import EngineRefused
from miles.engines.sglang_client import SGLangApiClient
from miles.utils.http import close_clients
from miles.utils.serving import ServerThread
from miles.utils.tensor_ipc import flatten_bucket, serialize_flattened_bucket, serialize_named_tensors

PROMPT = [3, 14, 15, 92, 65]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
SESSION_RULE = "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"

# The trainer's place: loads the tiny model, perturbs every weight, saves the result for the reference
# model, prints the payload (argv[4] "flattened": one flattened bucket) and keeps its tensors alive until
# told (the engine maps their memory).
SENDER = """
import sys, torch
from transformers import AutoModelForCausalLM
from miles.utils.tensor_ipc import flatten_bucket, serialize_flattened_bucket, serialize_named_tensors
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
gen = torch.Generator().manual_seed(int(sys.argv[3]))
named = [(n, p.detach() + 0.5 * torch.randn(p.shape, generator=gen)) for n, p in model.named_parameters()]
torch.save(dict(named), sys.argv[2])
if sys.argv[4] == "flattened":
    buffer, metadata = flatten_bucket(named)
    print(serialize_flattened_bucket(buffer, metadata), flush=True)
else:
    print(serialize_named_tensors(named), flush=True)
sys.stdin.readline()
"""


@contextlib.contextmanager
def trainer_process(
    model_dir: Path, out: Path, seed: int, form: str = "tensors"
) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """(payload, the weights it points at), from a separate interpreter that holds them until the end."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-c", SENDER, str(model_dir), str(out), str(seed), form]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        payload = proc.stdout.readline().strip()
        assert payload, "the sender printed no payload"
        yield payload, torch.load(out)
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=60)


@pytest.fixture
async def client(cpu_engine: ServerThread):
    yield SGLangApiClient(cpu_engine.url)
    await close_clients()


async def _greedy(client: SGLangApiClient) -> dict:
    return await client.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)


def _logprobs(out: dict) -> list[float]:
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def _reference(model_dir: Path, weights: dict[str, torch.Tensor]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.load_state_dict(weights)
    return model


@pytest.mark.parametrize("form", ["tensors", "flattened"])
async def test_weights_from_a_second_process_reach_the_engine(
    client, cpu_engine, tiny_model_dir, tmp_path, sequence_logprobs, form: str
) -> None:
    before = await _greedy(client)
    runner = cpu_engine.app.state.engine.runner
    pointers = {name: p.data_ptr() for name, p in runner.params.items()}
    load_format = "flattened_bucket" if form == "flattened" else None
    seed = 1 if form == "tensors" else 2  # the engine is the module's: each case sends new weights
    with trainer_process(tiny_model_dir, tmp_path / "sent.pt", seed, form) as (payload, sent):
        await client.begin_weight_update()
        try:
            answer = await client.update_weights_from_tensor(
                [payload], load_format=load_format, weight_version="t1"
            )
        finally:
            await client.end_weight_update()
    assert answer == {"success": True, "message": "Success Weight version updated to t1."}
    # copied into the engine's own memory: the sender has exited, its memory is gone
    assert {name: p.data_ptr() for name, p in runner.params.items()} == pointers

    after = await _greedy(client)
    assert after["meta_info"]["weight_version"] == "t1"
    assert _logprobs(after) != pytest.approx(_logprobs(before), abs=1e-3), "new weights must change outputs"
    local = _reference(tiny_model_dir, sent)
    assert _logprobs(after) == pytest.approx(sequence_logprobs(local, PROMPT, after["output_ids"]), abs=1e-4)
    generated = local.generate(torch.tensor([PROMPT]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert after["output_ids"] == generated[0, len(PROMPT) :].tolist()


async def test_an_update_outside_a_session_is_refused(client, cpu_engine) -> None:
    payload = serialize_named_tensors([("lm_head.weight", torch.zeros(1024, 64))])
    r = httpx.post(
        cpu_engine.url + "/update_weights_from_tensor", json={"serialized_named_tensors": [payload]}
    )
    assert r.status_code == 400 and r.json()["success"] is False
    assert SESSION_RULE in r.json()["message"]


@pytest.mark.parametrize("count", [0, 2])
async def test_the_payload_list_needs_one_entry_per_tp_rank(client, count: int) -> None:
    payload = serialize_named_tensors([("lm_head.weight", torch.zeros(1024, 64))])
    await client.begin_weight_update()
    try:
        with pytest.raises(
            EngineRefused, match=f"has {count} entries; it needs one per tensor-parallel rank"
        ):
            await client.update_weights_from_tensor([payload] * count)
    finally:
        await client.end_weight_update()


async def test_a_payload_in_the_other_format_is_refused_and_loads_nothing(client) -> None:
    before = _logprobs(await _greedy(client))
    pairs = [("lm_head.weight", torch.zeros(1024, 64))]
    flattened = serialize_flattened_bucket(*flatten_bucket(pairs))
    await client.begin_weight_update()
    try:
        with pytest.raises(EngineRefused, match="must be a dict with exactly") as refused:
            await client.update_weights_from_tensor(
                [serialize_named_tensors(pairs)], load_format="flattened_bucket"
            )
        assert refused.value.status_code == 400
        with pytest.raises(EngineRefused, match=r"list of \(name, tensor\) pairs"):
            await client.update_weights_from_tensor([flattened])
    finally:
        await client.end_weight_update()
    assert _logprobs(await _greedy(client)) == before, "nothing was loaded"


async def test_an_update_while_weights_are_released_is_refused(client) -> None:
    before = _logprobs(await _greedy(client))
    payload = serialize_named_tensors([("lm_head.weight", torch.zeros(1024, 64))])
    await client.release_memory_occupation(["weights"])
    await client.begin_weight_update()
    try:
        with pytest.raises(EngineRefused) as refused:
            await client.update_weights_from_tensor([payload])
        assert refused.value.body == {"success": False, "message": WEIGHTS_RELEASED}
    finally:
        await client.end_weight_update()
        await client.resume_memory_occupation(["weights"])
    assert _logprobs(await _greedy(client)) == before, "nothing was loaded"


async def test_a_payload_that_is_not_tensors_is_refused_and_the_engine_serves_on(client) -> None:
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > /dev/null",))

    buffer = io.BytesIO()
    ForkingPickler(buffer).dump([("lm_head.weight", Evil())])
    evil = base64.b64encode(buffer.getvalue()).decode()
    await client.begin_weight_update()
    try:
        with pytest.raises(EngineRefused, match=r"system is not allowed in a tensor payload"):
            await client.update_weights_from_tensor([evil])
        with pytest.raises(EngineRefused, match="not parameters of this model"):
            await client.update_weights_from_tensor([serialize_named_tensors([("no.such", torch.ones(2))])])
    finally:
        await client.end_weight_update()
    assert len((await _greedy(client))["output_ids"]) == GREEDY["max_new_tokens"]
