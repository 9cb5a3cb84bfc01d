"""Weight deltas on CUDA agree with the CPU bit for bit: the digest of a tensor is the same number on both
devices (the engine may hold its weights on either side of the trainer's), and a bucket encoded on the
GPU is the payload the CPU would build and applies on either device to the same bytes."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from miles.utils import delta


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.uint8])
def test_the_digest_is_the_same_number_on_cpu_and_cuda(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 255, (3 * delta.DIGEST_CHUNK * 8 + 13,), dtype=torch.uint8, generator=g)
    usable = base.numel() - base.numel() % torch.empty((), dtype=dtype).element_size()
    cpu = base[:usable].view(dtype)
    assert delta.digest(cpu) == delta.digest(cpu.cuda())
    view = cpu[1:-1]  # unaligned, odd length
    assert delta.digest(view) == delta.digest(view.cuda())


@pytest.mark.parametrize("density", [0.0, 0.02, 0.155, 0.9])
def test_a_bucket_encoded_on_cuda_is_the_cpu_payload_and_applies_on_both(density: float) -> None:
    g = torch.Generator().manual_seed(1)
    old = (torch.randn(1 << 20, generator=g) * 0.02).to(torch.bfloat16)
    new = old.clone()
    bits = new.view(torch.int16)
    moved = torch.rand(old.numel(), generator=g) < density
    bits[moved] += torch.randint(-3, 4, (int(moved.sum()),), generator=g, dtype=torch.int16)
    bits[:5] = torch.tensor([0, -32768, 32767, 0x7FC1, -1], dtype=torch.int16)  # +-0, NaN payloads, edges
    old_b, new_b = old.view(torch.uint8), new.view(torch.uint8)
    on_cpu = delta.encode_bucket(old_b, new_b)
    on_gpu = delta.encode_bucket(old_b.cuda(), new_b.cuda())
    assert on_gpu.kind == on_cpu.kind and torch.equal(on_gpu.header, on_cpu.header)
    assert torch.equal(on_gpu.payload.cpu(), on_cpu.payload)
    for device in ("cpu", "cuda"):
        target = old_b.clone().to(device)
        delta.apply_bucket(target, on_gpu.header, on_gpu.payload.to(device))
        assert torch.equal(target.cpu(), new_b), device


def test_packed_digests_on_cuda_equal_the_cpu_digests() -> None:
    """digest_many packs small tensors on a GPU by default: the numbers must be the CPU's, one by one."""
    g = torch.Generator().manual_seed(2)
    named = [(f"norm.{i}", torch.randn(1024 + i, generator=g).to(torch.bfloat16)) for i in range(50)]
    named += [("empty", torch.empty(0)), ("rows", torch.randn(3, delta.DIGEST_CHUNK + 5, generator=g))]
    named += [
        ("transposed", torch.randn(40, 24, generator=g).t()),
        ("odd", torch.arange(13, dtype=torch.uint8)),
    ]
    on_cpu = delta.digest_many(named, packed=False)
    assert delta.digest_many([(n, t.cuda()) for n, t in named]) == on_cpu
