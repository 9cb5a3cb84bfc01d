"""The demo's client: a few supervised steps through the real `tinker` SDK, then a sample.

    python -m miles.demo_client --base-url http://127.0.0.1:8000 --api-key-file runs/<id>/api_key \
        --tokenizer runs/<id>/model --base-model tiny-qwen3

It is what a researcher's script looks like: only `base_url` and the key differ from Tinker's hosted
service. The dataset is bundled (`miles/assets/demo_sft.jsonl`, arithmetic chats); the loss is the
mean per-token cross-entropy over assistant tokens, printed each step.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import tinker
from rich.console import Console
from tinker import types

console = Console(stderr=False)


def load_conversations(limit: int) -> list[list[dict[str, str]]]:
    text = resources.files("miles.assets").joinpath("demo_sft.jsonl").read_text(encoding="utf-8")
    return [json.loads(line)["messages"] for line in text.splitlines()[:limit]]


def conversation_to_datum(tokenizer: Any, messages: list[dict[str, str]]) -> types.Datum:
    """Tokens of the whole chat; weight 1 on the assistant reply, 0 on the prompt."""
    prompt_ids = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True)
    full_ids = tokenizer.apply_chat_template(messages, tokenize=True)
    if hasattr(prompt_ids, "input_ids"):  # transformers 5 may return a BatchEncoding
        prompt_ids, full_ids = prompt_ids["input_ids"], full_ids["input_ids"]
    weights = [0.0] * len(prompt_ids) + [1.0] * (len(full_ids) - len(prompt_ids))
    # position i predicts token i+1
    return types.Datum(
        model_input=types.ModelInput.from_ints(full_ids[:-1]),
        loss_fn_inputs={"target_tokens": full_ids[1:], "weights": weights[1:]},
    )


def mean_token_loss(result: types.ForwardBackwardOutput, data: list[types.Datum]) -> float:
    total_weight = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in data)
    return result.metrics["loss:sum"] / max(total_weight, 1.0)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    api_key = Path(args.api_key_file).read_text().strip() if args.api_key_file else args.api_key
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    data = [conversation_to_datum(tokenizer, m) for m in load_conversations(args.examples)]

    service = tinker.ServiceClient(base_url=args.base_url, api_key=api_key)
    training = service.create_lora_training_client(base_model=args.base_model, rank=args.rank)
    training = training.result() if hasattr(training, "result") else training
    console.print(f"[bold]training[/] {args.base_model} (LoRA rank {args.rank}) on {len(data)} chats")
    losses = []
    for step in range(args.steps):
        fwd = training.forward_backward(data, "cross_entropy")
        opt = training.optim_step(types.AdamParams(learning_rate=args.learning_rate))
        loss = mean_token_loss(fwd.result(), data)
        opt.result()
        losses.append(loss)
        console.print(f"  step {step + 1:2d}/{args.steps}  loss {loss:.4f}")

    sampler = training.save_weights_and_get_sampling_client(name="demo")
    sampler = sampler.result() if hasattr(sampler, "result") else sampler
    question = [{"role": "user", "content": "What is 3 plus 4?"}]
    prompt = tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=True)
    if hasattr(prompt, "input_ids"):
        prompt = prompt["input_ids"]
    out = sampler.sample(
        prompt=types.ModelInput.from_ints(list(prompt)),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=16, temperature=0.0001, seed=0),
    ).result()
    answer = tokenizer.decode(out.sequences[0].tokens, skip_special_tokens=True)
    console.print(f"[bold]sample[/] Q: What is 3 plus 4?  A: {answer!r}")
    summary = {"losses": losses, "sample": answer, "loss_went_down": losses[-1] < losses[0]}
    if args.json:
        print(json.dumps(summary))
    if not summary["loss_went_down"]:
        console.print("[red]the loss did not go down[/]")
        return 1
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m miles.demo_client", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", required=True)
    key = p.add_mutually_exclusive_group(required=True)
    key.add_argument("--api-key")
    key.add_argument("--api-key-file")
    p.add_argument("--tokenizer", required=True, help="directory of the served model's tokenizer")
    p.add_argument("--base-model", required=True)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--examples", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=5e-3)
    p.add_argument("--json", action="store_true", help="also print a JSON summary line")
    return p


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(parser().parse_args(argv)))


if __name__ == "__main__":
    main()
