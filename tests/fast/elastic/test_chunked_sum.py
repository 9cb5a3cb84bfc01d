"""The lanes' gradient sum in bounded chunks (group.chunk_segments): every element once, in order, a
large tensor cut across chunks, no chunk over the bound, and the write-back lands in the tensors."""

from __future__ import annotations

import pytest
import torch

from miles.train.hybrid.group import chunk_segments, gather_segments, scatter_segments


def test_chunks_cover_every_element_once_within_the_bound() -> None:
    tensors = [
        torch.arange(7.0),
        torch.arange(100.0, 103.0).view(3, 1),
        torch.zeros(0),
        torch.arange(10.0, 22.0),
    ]
    chunks = list(chunk_segments(tensors, 5))
    assert all(sum(end - start for _, start, end in chunk) <= 5 for chunk in chunks)
    flat = torch.cat([gather_segments(chunk) for chunk in chunks])
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in tensors]))
    assert len(chunks) == 5  # 22 elements in chunks of 5: the first tensor is cut after 5


def test_a_sum_written_back_through_the_chunks_reaches_every_tensor_in_its_dtype() -> None:
    tensors = [torch.ones(4, 3, dtype=torch.bfloat16), torch.full((5,), 2.0)]
    for chunk in chunk_segments(tensors, 4):
        summed = gather_segments(chunk) * 3  # what a reduction over three replicas would give
        scatter_segments(summed, chunk)
    assert tensors[0].dtype == torch.bfloat16 and torch.equal(
        tensors[0], torch.full((4, 3), 3.0, dtype=torch.bfloat16)
    )
    assert torch.equal(tensors[1], torch.full((5,), 6.0))


def test_a_non_contiguous_tensor_is_refused() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        list(chunk_segments([torch.zeros(3, 4).t()], 5))
