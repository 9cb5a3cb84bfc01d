"""The offload's contract where no GPU is (tests/gpu/test_offload_cuda.py moves real CUDA memory)."""

from __future__ import annotations

import pytest
import torch

from miles.train.backends.offload import offload, reload


def test_unknown_kinds_are_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"cannot offload \['activations'\]; choose among"):
        offload(["activations"], [], [], torch.device("cpu"))


def test_a_cpu_trainer_moves_nothing() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    optimizer = torch.optim.AdamW([param])
    optimizer.step()
    state, moved = offload(["optimizer", "gradients"], [optimizer], [param], torch.device("cpu"))
    assert state.empty and moved == {"optimizer": 0, "gradients": 0}
    assert param.grad is not None and reload(state) == 0
