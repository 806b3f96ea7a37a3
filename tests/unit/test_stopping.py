"""dapo.launch.stopping: what a launcher's Ctrl-C does before its children run and for the first
one while they run (the at-once kill of running children: tests/integration/test_operator.py)."""

from __future__ import annotations

import signal

import pytest

from dapo.launch.stopping import StopRequests


def test_the_first_signal_asks_for_a_graceful_stop_and_says_a_second_stops_at_once(capsys):
    stop = StopRequests("dapo run", "the actors return their leases")
    stop.watch(123456789, "learner")
    stop.handle(signal.SIGINT, None)
    assert (stop.why, stop.signals) == ("SIGINT", 1)
    assert capsys.readouterr().err == ("dapo run: stopping (SIGINT): the actors return their leases; SIGINT again "
                                       "stops at once\n")


def test_a_signal_before_any_child_runs_unwinds_at_once(capsys):
    stop = StopRequests("dapo run", "x", lambda: "never asked: nothing ran")
    stop.stopping = True  # start-up: nothing to stop gracefully
    with pytest.raises(SystemExit) as exited:  # not os._exit: a model build's temporary folder is removed
        stop.handle(signal.SIGTERM, None)
    assert exited.value.code == 1 and stop.why == ""
    assert capsys.readouterr().err == "dapo run: stopped (SIGTERM) before starting anything\n"
