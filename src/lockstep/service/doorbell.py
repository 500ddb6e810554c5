"""Doorbells: UDP datagrams on loopback that wake the other side of the queue at once.

The store is the only source of truth; a doorbell only says "look now". The API rings the workers
after queueing a request, a worker rings the API instances after finishing one (the datagram
carries the request id). A lost datagram costs at most one fallback poll interval.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import defaultdict

from sqlalchemy import select

from lockstep.service.db import Endpoint, now


def bind(host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((host, 0))
    sock.setblocking(False)
    return sock


def register(session, role: str, ident: str, sock: socket.socket) -> None:
    host, port = sock.getsockname()
    session.merge(Endpoint(id=ident, role=role, host=host, port=port, last_seen=now()))
    session.commit()


def addresses(session, role: str) -> list[tuple[str, int]]:
    return [(e.host, e.port) for e in session.scalars(select(Endpoint).where(Endpoint.role == role))]


class AddressBook:
    """The live endpoints of a role, re-read from the store at most every `ttl_s` seconds."""

    def __init__(self, sessions, role: str, ttl_s: float = 2.0):
        self.sessions, self.role, self.ttl_s = sessions, role, ttl_s
        self._addrs: list = []
        self._at = -1e9

    def get(self) -> list:
        if time.monotonic() - self._at > self.ttl_s:
            with self.sessions() as s:
                self._addrs = addresses(s, self.role)
            self._at = time.monotonic()
        return self._addrs


def ring(sock: socket.socket, addrs, message: bytes = b"!") -> None:
    for addr in addrs:
        try:
            sock.sendto(message, addr)
        except OSError:
            pass  # a stale endpoint: the store still has the truth


class Waiters:
    """asyncio side of the API's doorbell: long-polls wait here for their request id."""

    def __init__(self):
        self._events: dict[str, list[asyncio.Event]] = defaultdict(list)

    def wait_for(self, request_id: str) -> asyncio.Event:
        ev = asyncio.Event()
        self._events[request_id].append(ev)
        return ev

    def forget(self, request_id: str, ev: asyncio.Event) -> None:
        evs = self._events.get(request_id)
        if evs and ev in evs:
            evs.remove(ev)
            if not evs:
                del self._events[request_id]

    def wake(self, request_id: str) -> None:
        for ev in self._events.get(request_id, ()):
            ev.set()

    def __contains__(self, key: str) -> bool:
        """Whether anything waits for `key`."""
        return key in self._events


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, waiters: Waiters):
        self.waiters = waiters

    def datagram_received(self, data: bytes, addr) -> None:
        self.waiters.wake(data.decode(errors="replace"))


async def listen(sock: socket.socket, waiters: Waiters):
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(lambda: _Protocol(waiters), sock=sock)
    return transport
