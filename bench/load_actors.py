"""Load: N actors (the production actor loop with a fake engine, threads in a few processes) stream
trajectory groups to one coordinator + replay queue + gRPC server on loopback; a consumer trains
slower than they produce. Records queue depth, learner-side RSS over time, lease denials
(backpressure), throughput and the exactly-once audit.

    .venv/bin/python bench/load_actors.py [--actors 64] [--processes 4] [--duration-s 120] [--record bench/RELIABILITY.md]

The CI version is tests/chaos/test_load.py (64 actors, 12 s).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import harness

harness.service_env()

from tests.chaos.load import run_load  # noqa: E402

MB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--actors", type=int, default=64)
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--duration-s", type=float, default=120.0)
    ap.add_argument("--queue-max-groups", type=int, default=32)
    ap.add_argument("--max-response-tokens", type=int, default=256)
    ap.add_argument("--record", type=Path)
    args = ap.parse_args()
    r = run_load(num_actors=args.actors, num_processes=args.processes, duration_s=args.duration_s,
                 queue_max_groups=args.queue_max_groups, max_response_tokens=args.max_response_tokens)
    rss = [b for _, b in r.rss_bytes]
    q, c, a = r.queue, r.coordinator, r.audit
    problems = []
    if r.max_depth_groups > r.queue_max_groups:
        problems.append(f"queue depth {r.max_depth_groups} > cap {r.queue_max_groups}")
    if (a["lost"], a["duplicates"], a["unknown"]) != (0, 0, 0) or len(r.trained) != len(set(r.trained)):
        problems.append(f"audit {a}")
    if r.actors_registered != args.actors or any(r.actor_exit_codes):
        problems.append(f"{r.actors_registered} actors registered, exit codes {r.actor_exit_codes}")
    summary = {
        "actors": r.actors_registered, "duration_s": r.duration_s, "steps": r.steps,
        "groups_received": q["received_messages"], "groups_per_s": round(q["received_messages"] / r.duration_s, 1),
        "MB_received": round(q["received_bytes"] / MB, 1), "trained": len(r.trained),
        "max_depth_groups": r.max_depth_groups, "queue_max_groups": r.queue_max_groups,
        "rss_MB": {"min": round(min(rss) / MB), "max": round(max(rss) / MB),
                   "growth_second_half": round(r.rss_growth_second_half_bytes / MB, 1)},
        "lease_denials": r.denials(), "leases_issued": c.get("leases_issued", 0),
        "stale_at_consumption": q.get("dropped/stale_at_consumption", 0), "filtered": q.get("filtered", 0),
        "audit": a, "problems": problems,
    }
    print(json.dumps(summary, indent=1))
    if args.record:
        s = summary
        lines = [
            f"### Load, {harness.now()}", "", harness.provenance(), "",
            f"- {s['actors']} fake-engine actors ({args.processes} processes), {s['duration_s']:g} s: "
            f"{s['groups_received']:g} groups received ({s['groups_per_s']} groups/s, {s['MB_received']} MB), "
            f"{s['trained']} trained in {s['steps']} steps",
            f"- queue depth max {s['max_depth_groups']} (cap transport.queue_max_groups = {s['queue_max_groups']}); "
            f"learner-side RSS {s['rss_MB']['min']}-{s['rss_MB']['max']} MB, growth over the second half "
            f"{s['rss_MB']['growth_second_half']} MB",
            f"- backpressure: lease denials {s['lease_denials']} of {s['leases_issued']} leases issued; "
            f"stale at consumption {s['stale_at_consumption']:g} (re-issued)",
            f"- audit: {s['audit']}",
            f"- result: {'PASS' if not problems else 'FAIL: ' + '; '.join(problems)}",
        ]
        harness.emit("\n".join(lines), args.record)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
