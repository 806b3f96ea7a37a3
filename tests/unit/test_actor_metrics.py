"""Actor metrics: counters and stage times add up; the Prometheus endpoint serves them."""

from __future__ import annotations

import urllib.request

import pytest

from actors.metrics import ActorMetrics, prometheus_name, serve_prometheus


def test_snapshot_sums_stages_and_counts():
    m = ActorMetrics()
    m.add("tokens_generated", 300)
    m.add("groups_pushed", 3)
    m.add_time("generate", 1.5)
    m.add_time("generate", 0.5)
    m.add_time("fetch_weights", 0.25)
    m.add_time("load_weights", 0.5)
    m.add_time("weight_wait", 1.0)  # e.g. for a pushed version
    m.add_time("lease_wait", 2.0)
    m.add_time("learner_wait", 4.0)
    m.add_time("push", 8.0)  # busy, not idle
    s = m.snapshot()
    assert s["actor/tokens_generated"] == 300 and s["time/generate_s"] == 2.0
    assert s["actor/generate_tokens_per_s"] == 150.0
    assert s["idle/lease_wait_s"] == 2.0 and s["idle/weight_wait_s"] == 1.75 and s["idle/learner_wait_s"] == 4.0
    assert s["idle/total_s"] == 7.75  # what heartbeats report as idle_ms
    assert s["actor/weight_load_s_last"] == 0.5
    assert 0 < s["actor/tokens_per_s"] and s["actor/groups_per_s"] == pytest.approx(3 / s["actor/wall_s"], rel=0.5)
    with pytest.raises(AssertionError):
        m.add("no_such_counter")


def test_prometheus_names():
    assert prometheus_name("actor/tokens_per_s") == "dapo_actor_tokens_per_s"
    assert prometheus_name("time/generate_s") == "dapo_actor_time_generate_s"
    assert prometheus_name("idle/lease_wait_s") == "dapo_actor_idle_lease_wait_s"


@pytest.mark.timeout(30)
def test_prometheus_endpoint_serves_the_snapshot():
    from tests.procs import free_ports

    port, = free_ports(1)  # the endpoint binds it right after
    m = ActorMetrics()
    m.add("verifier_errors", 2)
    stop = serve_prometheus(m, port)
    try:
        m.add("verifier_errors", 1)  # read at scrape time, not at start
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        stop()
    assert "dapo_actor_verifier_errors 3.0" in body
    assert "dapo_actor_tokens_per_s " in body
