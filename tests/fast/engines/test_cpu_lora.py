"""LoRA from a PEFT directory: loading changes outputs (as peft's own model does), unloading restores."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.engines.errors import EngineError, EngineRefused
from miles.engines.sglang_client import SGLangApiClient
from miles.utils.http import close_clients

PROMPT = [21, 8, 300, 44]


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir: Path, tmp_path_factory) -> tuple[Path, object]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    config = LoraConfig(
        r=4,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "down_proj", "lm_head"],
        init_lora_weights=False,  # random A and B: the adapter must visibly change outputs
    )
    peft_model = get_peft_model(base, config).eval()
    out = tmp_path_factory.mktemp("adapter")
    peft_model.save_pretrained(str(out))
    return out, peft_model


async def test_load_generate_unload(cpu_engine, adapter_dir, sequence_logprobs) -> None:
    path, peft_model = adapter_dir
    client = SGLangApiClient(cpu_engine.url)
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    try:
        base = await client.generate(input_ids=PROMPT, sampling_params=params, return_logprob=True)
        answer = await client.load_lora_adapter("tuned", str(path))
        assert answer["success"] is True and answer["loaded_adapters"] == {"tuned": str(path.resolve())}
        with pytest.raises(EngineRefused, match="already loaded"):
            await client.load_lora_adapter("tuned", str(path))

        tuned = await client.generate(
            input_ids=PROMPT, sampling_params=params, return_logprob=True, lora_path="tuned"
        )
        tuned_lps = [lp for lp, _, _ in tuned["meta_info"]["output_token_logprobs"]]
        expected = sequence_logprobs(peft_model, PROMPT, tuned["output_ids"])
        assert tuned_lps == pytest.approx(expected, abs=1e-4)
        base_lps = [lp for lp, _, _ in base["meta_info"]["output_token_logprobs"]]
        assert tuned_lps != pytest.approx(base_lps, abs=1e-3)

        # a request without lora_path still sees the base weights while the adapter is loaded
        plain = await client.generate(input_ids=PROMPT, sampling_params=params, return_logprob=True)
        assert plain["output_ids"] == base["output_ids"]
        plain_lps = [lp for lp, _, _ in plain["meta_info"]["output_token_logprobs"]]
        assert plain_lps == pytest.approx(base_lps, abs=1e-5)

        assert (await client.unload_lora_adapter("tuned"))["loaded_adapters"] == {}
        with pytest.raises(EngineError, match="not loaded"):
            await client.generate(input_ids=PROMPT, sampling_params=params, lora_path="tuned")
        restored = await client.generate(input_ids=PROMPT, sampling_params=params, return_logprob=True)
        assert restored["output_ids"] == base["output_ids"]
        with pytest.raises(EngineRefused, match=r"adapter_config\.json"):
            await client.load_lora_adapter("broken", str(path.parent))
    finally:
        await close_clients()
