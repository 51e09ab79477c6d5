"""Messages between two processes over a pair of OS pipes, with no lock, semaphore or condition shared between
them: a side that dies at any moment, even half-way through a message, is an end of file for the other side, never
a wait that only the dead side could end. Every wait is bounded, so that its caller can check what else it must (a
stop request, the other side's exit code) between two tries.

A message is a pickle (tensors inline, no file descriptors passed) behind its 8-byte length.
"""

from __future__ import annotations

import os
import pickle
import selectors
import struct
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["NOTHING", "Link", "PeerGone", "link_pair"]

HEADER = struct.Struct("<Q")
_Selector = getattr(selectors, "PollSelector", selectors.DefaultSelector)  # poll(2): no descriptor of its own
NOTHING = object()  # what :meth:`Link.receive` returns when no message came in time


class PeerGone(ConnectionError):
    """The process at the other end of a :class:`Link` closed it or died."""


class Link:
    """One process's end of a two-way link: ``incoming`` is read, ``outgoing`` written (pipe ends, as
    :func:`link_pair` makes them and a spawned child receives them)."""

    def __init__(self, incoming: Connection, outgoing: Connection) -> None:
        self.incoming, self.outgoing = incoming, outgoing
        os.set_blocking(
            outgoing.fileno(), False
        )  # a full pipe is a bounded wait (see send), not a blocked write

    def send(self, message: Any, on_full: Callable[[], None] | None = None, poll: float = 0.5) -> None:
        """Write ``message``; while the pipe is full (the other side is not reading yet) wait ``poll`` seconds at
        a time, calling ``on_full()`` once first. :class:`PeerGone` if the other side has closed its end."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        data = memoryview(HEADER.pack(len(payload)) + payload)
        fd, sent, full = self.outgoing.fileno(), 0, False
        while sent < len(data):
            try:
                sent += os.write(fd, data[sent:])
            except BlockingIOError:
                if not full and on_full is not None:
                    on_full()
                full = True
                _wait_until(fd, selectors.EVENT_WRITE, poll)
            except (BrokenPipeError, OSError) as error:
                raise PeerGone(f"the other side closed the link ({error})") from None

    def receive(self, timeout: float) -> Any:
        """The next message, or :data:`NOTHING` if none starts within ``timeout`` seconds; :class:`PeerGone` at the
        end of the stream (the other side closed its end or died, also in the middle of a message)."""
        fd = self.incoming.fileno()
        if not _wait_until(fd, selectors.EVENT_READ, timeout):
            return NOTHING
        (size,) = HEADER.unpack(self._read(fd, HEADER.size))
        return pickle.loads(self._read(fd, size))

    @staticmethod
    def _read(fd: int, size: int) -> bytes:
        chunks, left = [], size
        while left:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:  # every writer is gone: a message that started is never finished
                raise PeerGone("the other side closed the link")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        self.incoming.close()
        self.outgoing.close()


def _wait_until(fd: int, event: int, timeout: float) -> bool:
    """Whether ``fd`` became readable or writable (``event``) within ``timeout`` seconds; by poll/epoll, which take
    any descriptor (``select.select`` refuses those >= 1024, and a run may hold that many: shared-memory weights
    open one per trainable tensor)."""
    with _Selector() as selector:
        selector.register(fd, event)
        return bool(selector.select(max(timeout, 0.0)))


def link_pair(context: Any) -> tuple[Link, tuple[Connection, Connection]]:
    """A link for this process and the two pipe ends for a child process (pass them as the child's arguments,
    build its :class:`Link` from them there, and close them here once it has started: then the child's death
    closes the pipes)."""
    to_child_read, to_child_write = context.Pipe(duplex=False)
    from_child_read, from_child_write = context.Pipe(duplex=False)
    return Link(from_child_read, to_child_write), (to_child_read, from_child_write)
