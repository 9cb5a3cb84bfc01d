"""TrainerCell: the Ray actors of one data-parallel trainer group, with an explicit lifecycle.

NEW -> STARTING -> ALIVE -> ERRORED -> STOPPED (any state may stop; see TRANSITIONS). A command goes to
every rank; the first failure that is not a user error marks the cell ERRORED at once, before its actors
are confirmed dead, and raises RemoteCommandError. A user error (preflight: every rank refuses the same
batch symmetrically) leaves the cell ALIVE so the next batch trains.

Commands are submitted to all ranks synchronously, without an await in between, so concurrent calls reach
every rank in the same order and collectives cannot interleave. Nothing here blocks the event loop: Ray
object refs are awaited, never ray.get.

Commands travel over each rank's command channel (miles.train.channel: a TCP stream, 2-2.5 ms less per
command than an actor call around a compute) once the cell has opened them, else as `execute` actor calls:
a channel that cannot be opened (a firewall between nodes, say) is logged and the actor calls serve. When
a channel ends, its commands in flight fail (erroring the cell, as a rank dying mid-call does) and the ranks
are probed at once, so a dead rank errors the cell without waiting for the next probe; if they all answer,
the next command opens the channels again.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from asyncio import FIRST_EXCEPTION
from collections.abc import Sequence
from typing import Any, TypeVar

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.cluster.named import InstanceNames
from miles.errors import IllegalTransition
from miles.train.channel import ChannelLostError, CommandChannel, dumps, new_key
from miles.train.commands import TrainerCommand
from miles.train.errors import RemoteCommandError, TrainerUnavailableError
from miles.train.worker import ACTOR_CONCURRENCY_GROUPS, DEFAULT_COLLECTIVE_TIMEOUT_S, TrainerWorker

log = logging.getLogger(__name__)
R = TypeVar("R")
LOSS_CAUSE_WAIT_S = 3.0  # how long a lost channel's command waits for Ray to say why its rank died


class TrainerCellState(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    ALIVE = "alive"
    ERRORED = "errored"
    STOPPED = "stopped"


TRANSITIONS: dict[TrainerCellState, frozenset[TrainerCellState]] = {
    TrainerCellState.NEW: frozenset({TrainerCellState.STARTING, TrainerCellState.STOPPED}),
    TrainerCellState.STARTING: frozenset(
        {TrainerCellState.ALIVE, TrainerCellState.ERRORED, TrainerCellState.STOPPED}
    ),
    TrainerCellState.ALIVE: frozenset({TrainerCellState.ERRORED, TrainerCellState.STOPPED}),
    TrainerCellState.ERRORED: frozenset({TrainerCellState.STOPPED}),
    TrainerCellState.STOPPED: frozenset(),
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
        command_channel: bool = True,
    ) -> None:
        self.index = index
        self._names = names  # rank actors named "trainer-<rank>" (a restarted driver re-adopts them)
        self._actor_options = {"num_cpus": num_cpus_per_actor, "num_gpus": num_gpus_per_actor}
        self._torch_threads = torch_threads
        self._start_timeout_s = start_timeout_s
        self._user_error_grace_s = user_error_grace_s
        self._collective_timeout_s = collective_timeout_s
        self._state = TrainerCellState.NEW
        self._actors: list[Any] = []
        self.error: RemoteCommandError | None = None
        self.ranks_info: list[dict[str, Any]] = []
        self._channel_wanted = command_channel  # False once opening failed: the actor calls serve
        self._channels: list[CommandChannel] = []
        self._channels_opening = asyncio.Lock()  # concurrent commands wait for one opening, then all use it
        self._background: set[asyncio.Task[Any]] = set()

    # ---- state ------------------------------------------------------------------------------------

    @property
    def state(self) -> TrainerCellState:
        return self._state

    @property
    def is_alive(self) -> bool:
        return self._state is TrainerCellState.ALIVE

    @property
    def command_path(self) -> str:
        """How commands reach the ranks now: "channel" (miles.train.channel) or "actor calls"."""
        return "channel" if self._channels else "actor calls"

    @property
    def actors(self) -> list[Any]:
        """The rank actors, rank order (for fault drills and the weight push)."""
        return list(self._actors)

    def _transition(self, new: TrainerCellState) -> None:
        if new not in TRANSITIONS[self._state]:
            raise IllegalTransition(f"trainer cell {self.index}: {self._state.value} -> {new.value}")
        log.info("trainer cell %d: %s -> %s", self.index, self._state.value, new.value)
        self._state = new

    def _mark_errored(self, error: RemoteCommandError) -> None:
        if self._state in (TrainerCellState.STARTING, TrainerCellState.ALIVE):
            self.error = error
            self._transition(TrainerCellState.ERRORED)
            if self._channels:
                # commands still in flight end now (a rank's node that vanished leaves its connection
                # silent until TCP keep-alive gives up, minutes later; a probe sees it sooner)
                self._in_background(self._close_channels())

    def problem(self) -> str | None:
        """Why the cell cannot serve, or None when it is alive."""
        if self._state is TrainerCellState.ALIVE:
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
        self._transition(TrainerCellState.STARTING)
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
                args = (master, model_path, train_mode, backend_kwargs, self._collective_timeout_s, log_dir)
                self.ranks_info = await self._all_ranks(
                    "setup", [actor.setup.remote(*args) for actor in self._actors]
                )
        except asyncio.CancelledError:
            await self.stop()
            raise
        except Exception as exc:
            self._mark_errored(RemoteCommandError.from_exception("start", exc))
            await self.stop()
            raise self.error or RemoteCommandError.from_exception("start", exc) from exc
        await self._open_channels()
        self._transition(TrainerCellState.ALIVE)

    async def adopt(self, actors: Sequence[Any], timeout_s: float = 10.0) -> None:
        """Take over rank actors another driver started (rank order; their model and tenants' state as
        they are): ALIVE once every rank answers a ping, else ERRORED with the cause."""
        self._transition(TrainerCellState.STARTING)
        self._actors = list(actors)
        try:
            await asyncio.wait_for(asyncio.gather(*(_await_ref(a.ping.remote()) for a in actors)), timeout_s)
        except Exception as exc:
            self._mark_errored(RemoteCommandError.from_exception("adopt", exc))
            raise self.error or RemoteCommandError.from_exception("adopt", exc) from exc
        await self._open_channels()
        self._transition(TrainerCellState.ALIVE)

    async def stop(self) -> None:
        """Kill the actors (idempotent); the placement group belongs to the caller."""
        if self._state is not TrainerCellState.STOPPED:
            self._transition(TrainerCellState.STOPPED)
        await self._close_channels()
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
        """Run `command` on every rank; its answer from their results (rank 0's, unless it combines them)."""
        return command.combine(await self.run_all(command))

    async def run_all(self, command: TrainerCommand[R]) -> list[R]:
        """Run `command` on every rank; every rank's result, rank order."""
        if not self.is_alive:
            raise TrainerUnavailableError(command.name, self.problem() or "trainer cell is not alive")
        if self._channels and not self._channels[0].usable_here():
            await self._close_channels()  # opened on another event loop: new ones are opened here
        if self._channel_wanted and not self._channels:
            async with self._channels_opening:  # the ranks' channels ended: open them again
                if self._channel_wanted and not self._channels:
                    await self._open_channels()
        try:
            results = await self._all_ranks(command.name, self._submit(command))
        except RemoteCommandError as error:
            if not error.is_user_error:
                self._mark_errored(error)
            raise
        return results

    def _submit(self, command: TrainerCommand[R]) -> list[Any]:
        """Start `command` on every rank (no await in between); one awaitable per rank, rank order."""
        if self._channels:
            payload = dumps(command)  # once for all ranks
            return [channel.submit(payload) for channel in self._channels]
        return [actor.execute.remote(command) for actor in self._actors]

    async def _all_ranks(self, what: str, started: list[Any]) -> list[Any]:
        """`started`: one awaitable per rank (a Ray ref or a channel's future); `what` names it in errors."""
        tasks = [asyncio.ensure_future(_await_ref(ref)) for ref in started]
        try:
            done, pending = await asyncio.wait(tasks, return_when=FIRST_EXCEPTION)
            failed = [t for t in done if t.exception() is not None]
            if not failed:
                return [t.result() for t in tasks]
            error = RemoteCommandError.from_exception(what, failed[0].exception())
            if error.is_user_error:
                error = await self._confirm_user_error(what, error, pending)
            else:
                if isinstance(error, ChannelLostError):
                    error = await self._cause_of_loss(what, error)
                self._mark_errored(error)  # at once: do not wait for the other ranks
            raise error
        finally:
            for task in tasks:
                task.cancel()  # only the local waiters; ranks finish their share themselves

    async def _cause_of_loss(self, what: str, error: ChannelLostError) -> RemoteCommandError:
        """A channel ended under a command. Ray knows why a rank died (killed, out of memory, its node
        lost) and says so in its answer to a ping: that is the cause, if it comes within a moment."""
        if not self._actors:
            return error
        pings = [asyncio.ensure_future(_await_ref(actor.ping.remote())) for actor in self._actors]
        try:
            done, _ = await asyncio.wait(pings, timeout=LOSS_CAUSE_WAIT_S, return_when=FIRST_EXCEPTION)
        finally:
            for ping in pings:
                ping.cancel()
        died = [ping.exception() for ping in done if not ping.cancelled() and ping.exception() is not None]
        return RemoteCommandError.from_exception(what, died[0]) if died else error

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

    # ---- the command channels (miles.train.channel) -----------------------------------------------

    async def _open_channels(self) -> None:
        """Open one channel per rank, or none: on any failure the actor calls serve from now on."""
        if not self._channel_wanted or not self._actors:
            return
        key = new_key()
        try:
            addresses = await asyncio.gather(*(actor.open_channel.remote(key) for actor in self._actors))
            connects = [CommandChannel.connect(r, tuple(address), key) for r, address in enumerate(addresses)]
            tried = await asyncio.gather(*connects, return_exceptions=True)
        except Exception as exc:  # the fallback serves whatever went wrong; the log says what
            self._no_channel(exc)
            return
        opened = [channel for channel in tried if isinstance(channel, CommandChannel)]
        failed = [exc for exc in tried if isinstance(exc, BaseException)]
        if failed:
            for channel in opened:
                await channel.close()
            if isinstance(failed[0], asyncio.CancelledError):
                raise failed[0]
            self._no_channel(failed[0])
            return
        for channel in opened:
            channel.on_lost(self._channel_lost)
        self._channels = opened

    def _no_channel(self, exc: BaseException) -> None:
        self._channel_wanted = False
        log.warning(
            "trainer cell %d: no command channel (%s: %s); commands go as Ray actor calls",
            self.index,
            type(exc).__name__,
            exc,
        )

    def _channel_lost(self, channel: CommandChannel) -> None:
        """A rank's channel ended: its commands in flight failed (which errors the cell), the other ranks'
        channels close, and the ranks are probed now, so a dead rank is seen at once. A rank still alive
        gets new channels with the next command."""
        if channel not in self._channels:
            return  # an earlier set's, already dropped
        channels, self._channels = self._channels, []
        for other in channels:
            if other is not channel:
                self._in_background(other.close())
        log.warning("trainer cell %d: %s", self.index, channel.lost)
        if self.is_alive:
            self._in_background(self.probe())

    def _in_background(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _close_channels(self) -> None:
        channels, self._channels = self._channels, []
        for channel in channels:
            if channel.usable_here():
                await channel.close()
            else:
                channel.abandon()


async def _await_ref(ref: Any) -> Any:
    return await ref
