"""A TCP relay in front of one engine that resets the driver's connection in the middle of a bucket.

Fault injection for the weight push (tests/fast/rollout/test_engine_faults_ray.py, bench/soak.py): the
driver's engine client points at the relay; the relay passes everything through to the engine except the
POST /update_weights_from_distributed requests that `cut` picks (counted from 1 over the relay's life),
which it resets (RST: SO_LINGER 0) after the whole request reached the engine (`deliver=True`: the engine
joins the bucket's broadcast) or after half its body (the engine never joins it, so the trainer and the
other engines wait in that broadcast).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable

import httpx

MARK = b"POST /update_weights_from_distributed"


class ResetRelay:
    def __init__(self, engine_url: str, cut: int | Callable[[int], bool], *, deliver: bool) -> None:
        """`cut`: the number of the one request to reset, or a rule that says for each number."""
        self.upstream = httpx.URL(engine_url)
        self.cut = (lambda n: n == cut) if isinstance(cut, int) else cut
        self.deliver = deliver
        self.seen = 0  # update_weights_from_distributed requests that reached the relay
        self.resets = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        """Listen on a free loopback port; the URL the driver's client should use."""
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _relay(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(self.upstream.host, self.upstream.port)
        back = asyncio.create_task(_pipe(up_r, down_w))
        try:
            while chunk := await down_r.read(65536):
                if MARK in chunk:
                    self.seen += 1
                    if self.cut(self.seen):
                        await self._reset(chunk, down_r, down_w, up_w)
                        return
                up_w.write(chunk)
                await up_w.drain()
        except ConnectionError:
            pass
        finally:
            back.cancel()
            up_w.close()

    async def _reset(
        self,
        chunk: bytes,
        down_r: asyncio.StreamReader,
        down_w: asyncio.StreamWriter,
        up_w: asyncio.StreamWriter,
    ) -> None:
        head, _, body = chunk.partition(b"\r\n\r\n")
        length = int(next(v for k, v in _headers(head) if k == b"content-length"))
        while len(body) < length:
            body += await down_r.read(65536)
        sent = head + b"\r\n\r\n" + (body if self.deliver else body[: length // 2])
        up_w.write(sent)
        await up_w.drain()
        await asyncio.sleep(0.2)  # the engine is in the bucket's receive (or waits for the body's rest)
        sock = down_w.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        down_w.transport.abort()
        self.resets += 1


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except ConnectionError:
        pass
    writer.close()


def _headers(head: bytes) -> list[tuple[bytes, bytes]]:
    lines = head.split(b"\r\n")[1:]
    return [(k.strip().lower(), v.strip()) for k, _, v in (line.partition(b":") for line in lines)]
