"""Many simulated actors in one process: ``--threads`` threads, each a full
tests/integration/wire_sim_actor.SimActor (its own gRPC channel, ZMQ PUSH socket, actor id,
heartbeats, leases). Lightweight: no model. Exits when every thread has left (shutdown heartbeat
or lease denial ``shutting_down``).

    python -m tests.chaos.sim_actor_threads --target HOST:PORT --token T --threads 16 --prefix p0
"""

from __future__ import annotations

import argparse
import sys
import threading

from dapo.runtime import apply_service_env


def main() -> int:
    apply_service_env()
    from tests.integration.wire_sim_actor import SimActor

    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--prefix", default="load")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--filter-mod", type=int, default=5, help="every filter_mod-th prompt is all-correct (filtered)")
    args = p.parse_args()
    actors = [SimActor(argparse.Namespace(target=args.target, token=args.token, name=f"{args.prefix}-{i}",
                                          seed=args.seed * 1000 + i, rpc_timeout_s=10.0, gen_delay_s=0.0,
                                          filter_mod=args.filter_mod, sndhwm=4))
              for i in range(args.threads)]
    failures: list[BaseException] = []

    def serve(actor: SimActor) -> None:
        try:
            actor.run_loop()
        except BaseException as exc:  # noqa: BLE001 - reported by the exit code
            failures.append(exc)
            print(f"{actor.args.name}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        finally:
            if actor.push is not None:
                actor.push.close(linger=2000)

    threads = [threading.Thread(target=serve, args=(a,), daemon=True) for a in actors]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
