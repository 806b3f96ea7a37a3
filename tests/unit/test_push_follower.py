"""actors.transports.base.PushFollower.take: a follower that has received before waits (bounded) for
an announced version instead of handing the actor nothing, so the actor does not fetch it again; the
actor counts that wait as idle."""

from __future__ import annotations

import threading
import time

import torch

from actors import loop as loop_mod
from actors.transports.base import PushFollower
from protos import coordinator_pb2 as pb
from tests.unit.test_actor_loop import FakeClient, make_actor, run_params  # noqa: F401 (make_actor: a fixture)


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


class NeverNext(PushFollower):
    """A push follower that received version 0 and never receives the announced next version;
    ``take_s``: how long each take() took."""

    def __init__(self) -> None:
        self.first, self.take_s = threading.Event(), []
        super().__init__("never-next-follower")
        assert self.first.wait(10)

    def _run(self) -> None:
        self._offer(0, {"v": torch.zeros(())})
        self.first.set()

    def take(self, at_least=-1, timeout_s=0.0):
        start = time.perf_counter()
        try:
            return super().take(at_least, timeout_s)
        finally:
            self.take_s.append(time.perf_counter() - start)


def test_the_actors_wait_for_a_pushed_version_is_idle_time(make_actor, monkeypatch):
    """actors/loop.py: the actor waits up to PUSH_WAIT_S for an announced version to arrive by push;
    the engine sits unused meanwhile, so it counts as weight_wait (idle_ms in heartbeats)."""
    followers = []

    def receiver(*args, **kwargs) -> NeverNext:  # RECEIVERS' signature (actors/transports/base.py)
        followers.append(NeverNext())
        return followers[-1]

    monkeypatch.setitem(loop_mod.RECEIVERS, "collective", receiver)
    monkeypatch.setattr(loop_mod, "PUSH_WAIT_S", 0.2)
    client = FakeClient(current_version=0)
    client.run = run_params(weight_backend="collective")
    client.lease_script = [pb.LeaseResponse(denial=pb.LEASE_DENIAL_WEIGHTS_UNUSABLE, latest_version=1)]
    actor, engine, fetched = make_actor(client)
    engine.during_generate = actor.stop.set
    assert actor.run() == 0
    assert engine.loaded == [0, 1] and fetched == [0, 1]  # version 1 never came: fetched after the wait
    (follower,) = followers
    assert len(follower.take_s) == 2 and follower.take_s[1] >= 0.2  # the initial take does not wait
    snap = actor.metrics.snapshot()
    assert actor.metrics.stage_s["weight_wait"] >= sum(follower.take_s)
    assert snap["idle/total_s"] >= snap["idle/weight_wait_s"] >= sum(follower.take_s)
