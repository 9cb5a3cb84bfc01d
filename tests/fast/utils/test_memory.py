"""Parameters laid out back to back, and finding byte spans that need no packing."""

from __future__ import annotations

import torch

from miles.utils.memory import byte_span, lay_out_back_to_back


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(7, 4)
        self.mid = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight  # tied, as lm_head and the embedding can be
        self.low = torch.nn.Linear(4, 2).to(torch.bfloat16)


def test_parameters_move_into_one_buffer_per_dtype_and_keep_identity_values_and_training() -> None:
    torch.manual_seed(0)
    model = Tied()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    identities = {name: id(p) for name, p in model.named_parameters()}
    assert lay_out_back_to_back(model) == 2  # float32 run, then the bfloat16 layer
    assert {name: id(p) for name, p in model.named_parameters()} == identities
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]) and p.requires_grad
    fp32 = [p.data for p in model.parameters() if p.dtype == torch.float32]
    span = byte_span(fp32)
    assert span is not None and span.numel() == sum(t.numel() * 4 for t in fp32)
    assert model.head.weight is model.embed.weight  # still tied, stored once
    storage = span.untyped_storage().data_ptr()

    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.head(model.mid(model.embed(torch.tensor([1, 2])))).sum().backward()
    model.low(torch.ones(1, 4, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    assert not torch.equal(model.mid.weight.detach(), before["mid.weight"])  # it trained
    assert all(
        p.data.untyped_storage().data_ptr() == storage for p in model.parameters() if p.dtype == torch.float32
    )


def test_byte_span_needs_one_storage_in_order_without_gaps() -> None:
    flat = torch.arange(10, dtype=torch.float32)
    a, b, c = flat[0:4], flat[4:6], flat[7:10]
    assert byte_span([a, b]) is not None and torch.equal(byte_span([a, b]).view(torch.float32), flat[:6])
    assert byte_span([b, a]) is None  # out of order
    assert byte_span([a, c]) is None  # a gap
    assert byte_span([a, torch.zeros(2)]) is None  # another storage
    assert byte_span([flat.view(2, 5).t()]) is None  # not contiguous
    assert byte_span([]) is None
