"""The trainer-worker link (pods.pipes) on file descriptors numbered 1024 and up: a run with shared-memory weights
opens one descriptor per trainable tensor before its pipes (an all-linear LoRA on a large model holds over a
thousand), and ``select.select`` refuses any descriptor past 1023."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import resource
import threading
from collections.abc import Iterator

import pytest

from pods.pipes import NOTHING, Link, PeerGone, link_pair

HIGH = 1100  # descriptors held open before the link's pipes are made


@contextlib.contextmanager
def many_open_descriptors(count: int) -> Iterator[None]:
    """``count`` descriptors held open (the soft RLIMIT_NOFILE raised where it is lower), closed after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = count + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        if hard != resource.RLIM_INFINITY and hard < wanted:
            pytest.skip(f"RLIMIT_NOFILE's hard limit {hard} is below {wanted}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(count)]
    try:
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def high_link() -> Iterator[tuple[Link, Link]]:
    """Both ends of a link, in this process, on pipes whose descriptors are all >= 1024."""
    with many_open_descriptors(HIGH):
        mine, (child_in, child_out) = link_pair(multiprocessing.get_context("spawn"))
        theirs = Link(child_in, child_out)
        fds = [end.fileno() for end in (mine.incoming, mine.outgoing, child_in, child_out)]
        assert min(fds) >= 1024, fds
        try:
            yield mine, theirs
        finally:
            mine.close()
            theirs.close()


def test_messages_cross_a_link_whose_descriptors_are_past_1023(high_link: tuple[Link, Link]) -> None:
    mine, theirs = high_link
    assert mine.receive(0.05) is NOTHING  # a bounded wait with nothing to read
    theirs.send(("batch", 3))
    assert mine.receive(5.0) == ("batch", 3)


def test_a_full_pipe_past_1023_waits_for_the_reader(high_link: tuple[Link, Link]) -> None:
    """A message far larger than a pipe's buffer: the writer waits on the full pipe until the reader drains it."""
    mine, theirs = high_link
    message = ("batch", b"x" * (4 << 20))
    full = threading.Event()
    writer = threading.Thread(target=theirs.send, args=(message,), kwargs={"on_full": full.set, "poll": 0.05})
    writer.start()
    assert full.wait(30), "the pipe never filled"
    assert mine.receive(30.0) == message
    writer.join(30)
    assert not writer.is_alive()


def test_a_closed_end_past_1023_is_peer_gone(high_link: tuple[Link, Link]) -> None:
    mine, theirs = high_link
    theirs.close()
    with pytest.raises(PeerGone):
        mine.receive(5.0)
    with pytest.raises(PeerGone):
        mine.send(("weights", 1))
