"""64 actors (the production actor loop with a fake engine: 4 processes x 16 threads, no model)
against one coordinator + replay queue on loopback, with a consumer slower than they produce:
queue memory stays bounded, nothing is lost or trained twice, and the backpressure shows in the
counters.
bench/load_actors.py runs the same for longer and records the numbers."""

from __future__ import annotations

import pytest

from tests.chaos.load import run_load

pytestmark = pytest.mark.slow

QUEUE_MAX_GROUPS = 12
"""Below k x N = 16 (the staleness slots while a step trains), so lease credit (queue_full) binds."""


@pytest.mark.timeout(180)
def test_64_actors_bounded_queue_nothing_lost_backpressure_counted() -> None:
    r = run_load(num_actors=64, num_processes=4, duration_s=12.0, queue_max_groups=QUEUE_MAX_GROUPS)
    assert r.actors_registered == 64 and r.actor_exit_codes == [0, 0, 0, 0], r.actor_errors
    assert r.steps >= 5, r.steps
    # bounded: the replay buffer never held more than its cap; lease credit kept it there
    assert 0 < r.max_depth_groups <= QUEUE_MAX_GROUPS
    assert r.audit["in_flight"] + r.audit["queued"] <= QUEUE_MAX_GROUPS
    denials = r.denials()
    assert denials.get("queue_full", 0) > 64, denials  # backpressure, counted
    # RSS: whatever grows, grows in the first half (warm-up); the second half stays flat
    assert r.rss_growth_second_half_bytes < 64 << 20, r.rss_bytes
    # nothing lost, nothing trained twice; every received message is accounted for
    assert len(r.trained) == len(set(r.trained)) == r.steps * 8
    assert (r.audit["lost"], r.audit["duplicates"], r.audit["unknown"]) == (0, 0, 0), r.audit
    assert r.audit["trained"] == len(r.trained) and r.audit["in_flight"] == 0  # every actor left cleanly
    q = r.queue
    at_receive = sum(v for k, v in q.items() if k.startswith("dropped/") and k != "dropped/stale_at_consumption")
    assert q["received_messages"] == q["accepted"] + q["filtered"] + at_receive
    # groups too old when their batch was taken went back to the cursor, not to waste
    assert q.get("dropped/stale_at_consumption", 0) == r.coordinator.get("groups_requeued_stale", 0)
    assert q["filtered"] > 0 and r.audit["filtered"] == q["filtered"]
