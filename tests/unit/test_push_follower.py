"""actors.transports.base.PushFollower.take: a follower that has received before waits (bounded) for
an announced version instead of handing the actor nothing, so the actor does not fetch it again."""

from __future__ import annotations

import threading

import torch

from actors.transports.base import PushFollower


class Scripted(PushFollower):
    """Offers version 1 at once, version 2 once ``release`` is set."""

    def __init__(self) -> None:
        self.first, self.release = threading.Event(), threading.Event()
        super().__init__("scripted-follower")

    def _run(self) -> None:
        self._offer(1, {"w": torch.ones(2)})
        self.first.set()
        self.release.wait(10)
        if not self._closed.is_set():
            self._offer(2, {"w": torch.full((2,), 2.0)})


def test_an_announced_version_is_waited_for_and_handed_over():
    f = Scripted()
    assert f.first.wait(10)
    assert f.take(1)[0] == 1
    wait_for = f._arrived.wait_for

    def waiting(predicate, timeout):  # version 2 is sent only once take() is waiting for it
        f.release.set()
        return wait_for(predicate, timeout)

    f._arrived.wait_for = waiting
    version, state = f.take(2, timeout_s=10)
    assert version == 2 and torch.equal(state["w"], torch.full((2,), 2.0))
    f.close()


def test_no_wait_before_the_first_version_or_after_close():
    f = Scripted.__new__(Scripted)
    f.first, f.release = threading.Event(), threading.Event()
    f.release.set()
    f._run = lambda: None  # a push that never delivers
    PushFollower.__init__(f, "silent-follower")
    g = Scripted()
    assert g.first.wait(10) and g.take(1)[0] == 1
    g.close()
    # Neither waits its 600 s: nothing received yet (no reason to believe 5 is coming), and closed.
    for follower, version in ((f, 5), (g, 2)):
        got = []
        call = threading.Thread(target=lambda: got.append(follower.take(version, timeout_s=600)))
        call.start()
        call.join(10)
        assert not call.is_alive() and got == [None]
