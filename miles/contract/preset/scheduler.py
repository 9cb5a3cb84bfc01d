"""`scheduler:`: PBS Professional directives and Slurm `#SBATCH` options, and the defaults that follow
from the preset's GPUs."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from miles.contract.preset.base import StrictModel
from miles.contract.walltimes import pbs_walltime, slurm_time


class PbsOptions(StrictModel):
    """PBS Professional directives (ABCI style: -P group, -q resource type, -l select, -l walltime)."""

    project: str | None = Field(None, description="Group passed as `#PBS -P` (ABCI: required).")
    project_required: bool = Field(
        False, description="Refuse to submit without a real `project` (ABCI: every job names its group)."
    )
    queue: str | None = Field(None, description="Queue / resource type passed as `#PBS -q` (ABCI: rt_HF).")
    whole_nodes: bool = Field(
        False,
        description="The queue allocates whole nodes (ABCI rt_HF): `-l select=N` only, no chunk "
        "resources and no `-l place`.",
    )
    ncpus: int | None = Field(None, ge=1, description="Chunk `ncpus`; none = not asked (site default).")
    ngpus: int | None = Field(
        None, ge=0, description="Chunk `ngpus`; default = the preset's gpus_per_node; 0 = not asked."
    )
    select_extras: str = Field(
        "", description="Appended to the chunk of `-l select=`, e.g. `:mpiprocs=1:mem=64gb`; empty for none."
    )
    place: str | None = Field(
        "scatter:excl", description="`-l place=`: one chunk per node, nodes not shared; none = not asked."
    )
    walltime: str = Field(
        "01:00:00",
        description="`#PBS -l walltime=`, [[HH:]MM:]SS (minutes, seconds 0-59); a number is seconds.",
    )
    rerunnable: bool = Field(
        False,
        description="`-r y`: PBS may rerun the job after a node failure or preemption (default `-r n`).",
    )
    job_name: str | None = Field(None, description="`#PBS -N`; default `miles-<preset name>`.")
    extra_directives: list[str] = Field(
        default_factory=list, description="Extra `#PBS` lines, each without the `#PBS ` prefix."
    )
    launch: Literal["pbs_tmrsh", "pbsdsh", "mpirun", "ssh"] = Field(
        "pbs_tmrsh",
        description="How the job starts Ray on the other nodes: `pbs_tmrsh HOST` (PBS's TM interface, "
        "processes stay under the job), `pbsdsh -n INDEX`, `mpirun` (binding off) or `ssh`.",
    )
    mpi: Literal["openmpi", "intelmpi"] = Field(
        "openmpi",
        description="launch mpirun: whose mpirun (Open MPI `--bind-to none`, Intel MPI `I_MPI_PIN=0`).",
    )

    @field_validator("walltime", mode="before")
    @classmethod
    def _walltime(cls, value: Any) -> str:
        return pbs_walltime(value)

    @field_validator("select_extras")
    @classmethod
    def _select(cls, value: str) -> str:
        if value and not re.fullmatch(r"(:[A-Za-z_]+=[A-Za-z0-9_.]+)+", value):
            raise ValueError("select_extras must be ':key=value' pairs, e.g. ':mpiprocs=1:mem=64gb'")
        if value and re.search(r":(ncpus|ngpus)=", value):
            raise ValueError("set ncpus and ngpus with scheduler.pbs.ncpus / scheduler.pbs.ngpus")
        return value

    @field_validator("place")
    @classmethod
    def _place(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[a-z]+(:[a-z]+(=[A-Za-z0-9_]+)?)*", value):
            raise ValueError("place must look like scatter:excl, pack, free:shared or vscatter")
        return value


class SlurmOptions(StrictModel):
    """Slurm `#SBATCH` options."""

    partition: str | None = Field(None, description="`--partition`; none = the cluster default.")
    account: str | None = Field(None, description="`--account`; none = your default account.")
    time: str = Field(
        "01:00:00",
        description="`--time`, e.g. 01:00:00 or 2-00:00:00 (fields in range); a number is minutes.",
    )
    gpus_per_node: int | None = Field(
        None, ge=0, description="`--gpus-per-node`; default = the preset's gpus_per_node; 0 = no GPU request."
    )
    exclusive: bool | None = Field(
        None, description="`--exclusive` (whole nodes); default: on when the job asks for GPUs."
    )
    cpus_per_task: int | None = Field(
        None,
        ge=1,
        description="`--cpus-per-task` (one task per node: the CPUs Ray gets); none = Slurm default.",
    )
    mem: str | None = Field(
        None,
        description="`--mem` per node, e.g. 200G; default `0` (all of it) when exclusive, else not asked.",
    )
    signal: str | None = Field(
        "B:USR1@120",
        description="`--signal`: the batch shell gets USR1 this many seconds before the time limit and "
        "shuts down in order; none = not asked.",
    )
    requeue: bool = Field(False, description="`--requeue` (opt-in); default `--no-requeue`.")
    job_name: str | None = Field(None, description="`--job-name`; default `miles-<preset name>`.")
    extra_directives: list[str] = Field(
        default_factory=list, description="Extra `#SBATCH` lines, each without the `#SBATCH ` prefix."
    )

    @field_validator("time", mode="before")
    @classmethod
    def _time(cls, value: Any) -> str:
        return slurm_time(value)

    @field_validator("mem")
    @classmethod
    def _mem(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"\d+[KMGT]?", value):
            raise ValueError("mem must be a size like 0, 64000, 200G (0 = all of the node's memory)")
        return value

    @field_validator("signal")
    @classmethod
    def _signal(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"(B:|R:|RB:|BR:)?(USR1|USR2|TERM|INT|URG)@\d+", value):
            raise ValueError("signal must look like B:USR1@120 ([B:]SIGNAL@SECONDS)")
        return value


class SchedulerOptions(StrictModel):
    pbs: PbsOptions = Field(default_factory=PbsOptions, description="PBS Professional options.")
    slurm: SlurmOptions = Field(default_factory=SlurmOptions, description="Slurm options.")


def resolve_slurm(slurm: SlurmOptions, gpus_per_node: int) -> None:
    if slurm.gpus_per_node is None:
        slurm.gpus_per_node = gpus_per_node
    if slurm.exclusive is None:
        slurm.exclusive = slurm.gpus_per_node > 0  # GPU jobs own their nodes
    if slurm.mem is None and slurm.exclusive:
        slurm.mem = "0"  # all of each node's memory


def resolve_pbs(pbs: PbsOptions, gpus_per_node: int) -> None:
    if pbs.whole_nodes:  # the queue defines the node: ABCI's `-l select=N` form
        pbs.ncpus = pbs.ngpus = pbs.place = None
    elif pbs.ngpus is None:
        pbs.ngpus = gpus_per_node
