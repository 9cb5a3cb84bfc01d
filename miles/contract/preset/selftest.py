"""`selftest:`: the job runs a scripted check of its own pieces instead of serving (`launcher selftest`;
docs/first-job.md). The launcher sets `enabled`; the thresholds are the user's to tune."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from miles.contract.preset.base import StrictModel


class SelftestOptions(StrictModel):
    """What `launcher selftest` checks against. A preset submitted for real never needs this section."""

    enabled: bool = Field(
        False,
        description="Run the self-test sequence after bring-up (every engine call, a training step, a push, "
        "the sampler-vs-trainer check, the watchdog), then end the job; set by `launcher selftest`.",
    )
    kl_threshold: float = Field(
        1e-3,
        gt=0,
        description="Largest |kl_sample_train_v1| (mean sampler logprob minus trainer logprob over sampled "
        "tokens) that passes; bf16 engines land near 1e-5, float32 near 1e-7.",
    )
    collective_mb: float = Field(
        64, gt=0, le=4096, description="MiB each rank all-reduces and broadcasts in the interconnect check."
    )
    interconnect_gbps: float | None = Field(
        None,
        gt=0,
        description="The interconnect's nominal bandwidth in GB/s (e.g. 25 for one 200 Gb/s HDR link); the "
        "collective row prints the measured bus bandwidth against it. None = the measured figure alone.",
    )
    drill: Literal["none", "dead_trainer"] = Field(
        "none",
        description="A fault drill: `dead_trainer` kills the trainer before the training step, so the "
        "`train` row must fail naming the dead trainer and the job must end (how a broken trainer reports).",
    )
