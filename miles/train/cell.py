"""TrainerCell: the Ray actors of one data-parallel trainer group, with an explicit lifecycle.

NEW -> STARTING -> ALIVE -> ERRORED -> STOPPED (any state may stop; see TRANSITIONS). A command goes to
every rank; the first failure that is not a user error marks the cell ERRORED at once, before its actors
are confirmed dead, and raises RemoteCommandError. A user error (preflight: every rank refuses the same
batch symmetrically) leaves the cell ALIVE so the next batch trains.

Commands are submitted to all ranks synchronously, without an await in between, so concurrent calls reach
every rank in the same order and collectives cannot interleave. Nothing here blocks the event loop: Ray
object refs are awaited, never ray.get.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.cluster.named import InstanceNames
from miles.errors import IllegalTransition
from miles.train.commands import TrainerCommand
from miles.train.errors import RemoteCommandError, TrainerUnavailableError
from miles.train.worker import ACTOR_CONCURRENCY_GROUPS, DEFAULT_COLLECTIVE_TIMEOUT_S, TrainerWorker

log = logging.getLogger(__name__)
R = TypeVar("R")


class CellState(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    ALIVE = "alive"
    ERRORED = "errored"
    STOPPED = "stopped"


TRANSITIONS: dict[CellState, frozenset[CellState]] = {
    CellState.NEW: frozenset({CellState.STARTING, CellState.STOPPED}),
    CellState.STARTING: frozenset({CellState.ALIVE, CellState.ERRORED, CellState.STOPPED}),
    CellState.ALIVE: frozenset({CellState.ERRORED, CellState.STOPPED}),
    CellState.ERRORED: frozenset({CellState.STOPPED}),
    CellState.STOPPED: frozenset(),
}


class TrainerCell:
    def __init__(
        self,
        index: int = 0,
        *,
        num_cpus_per_actor: float = 1,
        num_gpus_per_actor: float = 1,
        torch_threads: int = 1,
        start_timeout_s: float = 600,
        user_error_grace_s: float = 30,
        collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
        names: InstanceNames | None = None,
    ) -> None:
        self.index = index
        self._names = names  # rank actors named "trainer-<rank>" (a restarted driver re-adopts them)
        self._actor_options = {"num_cpus": num_cpus_per_actor, "num_gpus": num_gpus_per_actor}
        self._torch_threads = torch_threads
        self._start_timeout_s = start_timeout_s
        self._user_error_grace_s = user_error_grace_s
        self._collective_timeout_s = collective_timeout_s
        self._state = CellState.NEW
        self._actors: list[Any] = []
        self.error: RemoteCommandError | None = None
        self.ranks_info: list[dict[str, Any]] = []

    # ---- state ------------------------------------------------------------------------------------

    @property
    def state(self) -> CellState:
        return self._state

    @property
    def is_alive(self) -> bool:
        return self._state is CellState.ALIVE

    @property
    def actors(self) -> list[Any]:
        """The rank actors, rank order (for fault drills and the weight push)."""
        return list(self._actors)

    def _transition(self, new: CellState) -> None:
        if new not in TRANSITIONS[self._state]:
            raise IllegalTransition(f"trainer cell {self.index}: {self._state.value} -> {new.value}")
        log.info("trainer cell %d: %s -> %s", self.index, self._state.value, new.value)
        self._state = new

    def _mark_errored(self, error: RemoteCommandError) -> None:
        if self._state in (CellState.STARTING, CellState.ALIVE):
            self.error = error
            self._transition(CellState.ERRORED)

    def problem(self) -> str | None:
        """Why the cell cannot serve, or None when it is alive."""
        if self._state is CellState.ALIVE:
            return None
        if self.error is not None:
            return f"trainer cell {self.index} {self._state.value}: {self.error.cause}"
        return f"trainer cell {self.index} is {self._state.value}"

    # ---- lifecycle --------------------------------------------------------------------------------

    async def start(
        self,
        bundles: Sequence[tuple[PlacementGroup, int]],
        *,
        model_path: str,
        train_mode: str,
        log_dir: str | None = None,
        **backend_kwargs: Any,
    ) -> None:
        """One rank per bundle (rank order = bundle order); joins the DP group and loads the model.

        `log_dir`: each rank also logs to log_dir/trainer-rank<r>.log."""
        if not bundles:
            raise ValueError("a trainer cell needs at least one bundle")
        self._transition(CellState.STARTING)
        world_size = len(bundles)
        remote_cls = ray.remote(concurrency_groups=ACTOR_CONCURRENCY_GROUPS)(TrainerWorker)
        for rank, (pg, bundle_index) in enumerate(bundles):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle_index
            )
            named = self._names.actor_options(f"trainer-{rank}") if self._names else {}
            actor = remote_cls.options(scheduling_strategy=strategy, **self._actor_options, **named).remote(
                rank, world_size, torch_threads=self._torch_threads
            )
            self._actors.append(actor)
        try:
            async with asyncio.timeout(self._start_timeout_s):
                master = await self._actors[0].open_rendezvous.remote() if world_size > 1 else None
                self.ranks_info = await self._all_ranks(
                    "setup",
                    lambda actor: actor.setup.remote(
                        master, model_path, train_mode, backend_kwargs, self._collective_timeout_s, log_dir
                    ),
                )
        except asyncio.CancelledError:
            await self.stop()
            raise
        except Exception as exc:
            self._mark_errored(RemoteCommandError.from_exception("start", exc))
            await self.stop()
            raise self.error or RemoteCommandError.from_exception("start", exc) from exc
        self._transition(CellState.ALIVE)

    async def adopt(self, actors: Sequence[Any], timeout_s: float = 10.0) -> None:
        """Take over rank actors another driver started (rank order; their model and tenants' state as
        they are): ALIVE once every rank answers a ping, else ERRORED with the cause."""
        self._transition(CellState.STARTING)
        self._actors = list(actors)
        try:
            await asyncio.wait_for(asyncio.gather(*(_await_ref(a.ping.remote()) for a in actors)), timeout_s)
        except Exception as exc:
            self._mark_errored(RemoteCommandError.from_exception("adopt", exc))
            raise self.error or RemoteCommandError.from_exception("adopt", exc) from exc
        self._transition(CellState.ALIVE)

    async def stop(self) -> None:
        """Kill the actors (idempotent); the placement group belongs to the caller."""
        if self._state is not CellState.STOPPED:
            self._transition(CellState.STOPPED)
        actors, self._actors = self._actors, []
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # already gone
                log.debug("trainer cell %d: kill failed: %s", self.index, exc)

    # ---- liveness ---------------------------------------------------------------------------------

    async def probe(self, timeout_s: float = 10.0) -> bool:
        """Ping every rank (health concurrency group: answered even mid-command).

        A rank whose actor died marks the cell ERRORED at once, so healthz notices a dead trainer that no
        command is running on. A slow answer is not a death: the probe just reports False.
        """
        if not self.is_alive:
            return False
        try:
            await asyncio.wait_for(
                asyncio.gather(*(_await_ref(a.ping.remote()) for a in self._actors)), timeout_s
            )
        except TimeoutError:
            log.warning("trainer cell %d: ping not answered within %.0f s", self.index, timeout_s)
            return False
        except Exception as exc:
            self._mark_errored(RemoteCommandError.from_exception("ping", exc))
            return False
        return True

    # ---- commands ---------------------------------------------------------------------------------

    async def run(self, command: TrainerCommand[R]) -> R:
        """Run `command` on every rank; return rank 0's result."""
        if not self.is_alive:
            raise TrainerUnavailableError(command.name, self.problem() or "trainer cell is not alive")
        try:
            results = await self._all_ranks(command.name, lambda actor: actor.execute.remote(command))
        except RemoteCommandError as error:
            if not error.is_user_error:
                self._mark_errored(error)
            raise
        return results[0]

    async def _all_ranks(self, what: str, submit: Callable[[Any], Any]) -> list[Any]:
        """`submit(actor)` starts the call on one rank and returns its ref; `what` names it in errors."""
        refs = [submit(actor) for actor in self._actors]
        tasks = [asyncio.ensure_future(_await_ref(ref)) for ref in refs]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in done if t.exception() is not None]
            if not failed:
                return [t.result() for t in tasks]
            error = RemoteCommandError.from_exception(what, failed[0].exception())
            if error.is_user_error:
                error = await self._confirm_user_error(what, error, pending)
            else:
                self._mark_errored(error)  # at once: do not wait for the other ranks
            raise error
        finally:
            for task in tasks:
                task.cancel()  # only the local waiters; ranks finish their share themselves

    async def _confirm_user_error(
        self, method: str, error: RemoteCommandError, pending: set[asyncio.Future]
    ) -> RemoteCommandError:
        """A user error stays one only if no other rank fails differently or hangs."""
        if pending:
            done, still = await asyncio.wait(pending, timeout=self._user_error_grace_s)
            if still:
                return RemoteCommandError(
                    method,
                    "RankDivergence",
                    f"a rank raised {error.cause} but others did not finish within "
                    f"{self._user_error_grace_s:.0f} s",
                    error.remote_traceback,
                )
            for task in done:
                exc = task.exception()
                if exc is not None:
                    other = RemoteCommandError.from_exception(method, exc)
                    if not other.is_user_error:
                        return other
        return error


async def _await_ref(ref: Any) -> Any:
    return await ref
