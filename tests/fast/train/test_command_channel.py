"""The command channel (miles.train.channel) over loopback, without Ray: order, errors, the key, a lost rank.

The rank's side (`ChannelServer`) runs on threads of this process, or in a child process where a test kills
it; the driver's side (`CommandChannel`) on the test's event loop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest

from miles.errors import Category, UserError
from miles.train.channel import ChannelLostError, ChannelServer, CommandChannel, _proof, dumps, new_key
from miles.train.errors import RemoteCommandError

UNPICKLED: list[str] = []


@dataclass(frozen=True)
class Echo:
    value: object
    delay_s: float = 0.0
    name: str = "echo"


@dataclass(frozen=True)
class Refuse:
    message: str
    name: str = "refuse"


@dataclass(frozen=True)
class Unanswerable:
    name: str = "unanswerable"


class Tripwire:
    """Unpickling it is recorded: a connection that did not prove the key must never get that far."""

    def __reduce__(self):
        return (UNPICKLED.append, ("tripwire",))


def handle(command: object) -> object:
    if isinstance(command, Refuse):
        raise UserError(command.message)
    if isinstance(command, Unanswerable):
        return threading.Lock()  # cannot be pickled back
    assert isinstance(command, Echo)
    time.sleep(command.delay_s)
    return command.value


@pytest.fixture
def server():
    key = new_key()
    served = ChannelServer(key, "127.0.0.1", handle)
    yield served, key
    served.close()


async def test_commands_are_answered_in_order_with_their_results(server) -> None:
    served, key = server
    channel = await CommandChannel.connect(0, served.address, key)
    big = np.arange(3_000_000, dtype=np.float32)  # 12 MB: frames larger than one socket buffer
    futures = [channel.submit(dumps(Echo(i, delay_s=0.02 if i == 0 else 0.0))) for i in range(5)]
    futures.append(channel.submit(dumps(Echo(big))))
    answers = await asyncio.gather(*futures)
    assert answers[:5] == [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(answers[5], big)
    await channel.close()


async def test_a_failing_command_keeps_its_category_and_the_channel_serves_on(server) -> None:
    served, key = server
    channel = await CommandChannel.connect(0, served.address, key)
    with pytest.raises(RemoteCommandError) as refused:
        await channel.submit(dumps(Refuse("datum 3: weights has 4 entries, tokens 5")))
    assert refused.value.is_user_error and refused.value.cause_type == "UserError"
    assert refused.value.method == "refuse" and "datum 3" in refused.value.cause_message
    assert "handle" in refused.value.remote_traceback
    with pytest.raises(RemoteCommandError) as unanswerable:
        await channel.submit(dumps(Unanswerable()))
    assert unanswerable.value.category is Category.SERVER and "lock" in unanswerable.value.cause_message
    assert await channel.submit(dumps(Echo("still here"))) == "still here"
    await channel.close()


async def test_a_cancelled_waiter_does_not_shift_the_answers(server) -> None:
    served, key = server
    channel = await CommandChannel.connect(0, served.address, key)
    slow = channel.submit(dumps(Echo("slow", delay_s=0.2)))
    slow.cancel()
    assert await channel.submit(dumps(Echo("next"))) == "next"
    await channel.close()


async def test_a_wrong_key_is_refused_before_anything_is_unpickled(server) -> None:
    served, _ = server
    UNPICKLED.clear()
    with pytest.raises((ConnectionError, EOFError)):
        await CommandChannel.connect(0, served.address, new_key())
    # a raw client that skips the proof and sends a frame: closed, never unpickled
    raw = socket.create_connection(served.address, timeout=5)
    raw.recv(32)
    payload = dumps(Tripwire())
    raw.sendall(len(payload).to_bytes(8, "big") + payload + b"\0" * 64)
    assert hung_up(raw)
    assert UNPICKLED == []


async def test_a_proof_for_another_nonce_is_refused(server) -> None:
    served, key = server
    raw = socket.create_connection(served.address, timeout=5)
    nonce = raw.recv(32)
    raw.sendall(_proof(key, bytes(reversed(nonce))))  # a replayed proof is for another nonce
    assert hung_up(raw)


async def test_a_rank_thread_that_cannot_run_commands_refuses_the_channel() -> None:
    """As a rank whose channel thread cannot take its CUDA device: the driver's connect fails (and the
    cell falls back to actor calls) instead of a channel that loses its first command."""
    key = new_key()

    def no_device() -> None:
        raise RuntimeError("CUDA error: invalid device ordinal")

    served = ChannelServer(key, "127.0.0.1", handle, on_thread=no_device)
    try:
        with pytest.raises((ConnectionError, EOFError)):
            await CommandChannel.connect(0, served.address, key)
    finally:
        served.close()


def hung_up(raw: socket.socket) -> bool:
    """The rank closed the connection without a word (a reset when our bytes were left unread)."""
    raw.settimeout(15)
    try:
        return raw.recv(1) == b""
    except ConnectionResetError:
        return True
    finally:
        raw.close()


RANK_SCRIPT = """
import sys, time
from miles.train.channel import ChannelServer
server = ChannelServer(bytes.fromhex(sys.argv[1]), "127.0.0.1", lambda command: time.sleep(command))
print(server.address[1], flush=True)
time.sleep(600)
"""


async def test_a_rank_that_dies_mid_command_fails_its_commands_and_the_channel() -> None:
    key = new_key()
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK_SCRIPT, key.hex()], stdout=subprocess.PIPE, text=True, env=os.environ
    )
    try:
        port = int(await asyncio.to_thread(rank.stdout.readline))
        channel = await CommandChannel.connect(3, ("127.0.0.1", port), key)
        lost: list[CommandChannel] = []
        channel.on_lost(lost.append)
        assert await channel.submit(dumps(0.0)) is None
        in_flight = [channel.submit(dumps(30.0)), channel.submit(dumps(0.0))]
        await asyncio.sleep(0.3)
        rank.send_signal(signal.SIGKILL)
        for future in in_flight:
            with pytest.raises(ChannelLostError, match="trainer rank 3 ended"):
                await asyncio.wait_for(future, 10)
        assert lost == [channel] and channel.lost
        with pytest.raises(ChannelLostError):
            channel.submit(dumps(0.0))
        await channel.close()
        assert lost == [channel]  # once, and not for the driver's own close
    finally:
        rank.kill()
        rank.wait()
