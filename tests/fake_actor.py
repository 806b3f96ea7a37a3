"""Production actors without a model: ``actors.loop.Actor`` with the real CoordinatorClient,
GroupPusher, heartbeats, leases and weight paths, driven by tests/fake_engine.py; ``--threads``
of them in one process.

    python -m tests.fake_actor --learner HOST:PORT --token T [--threads N] [--easy-every K]
        [--hold-file PATH] [--fetch-weights [--corrupt-first-fetch] [--report FILE]] [--eval-delay-s S] [overrides]

``overrides``: Hydra config overrides, as ``dapo actor`` takes them (e.g. the learner's collective
port).
Weights: by default a fetch returns the version the coordinator announced, with no tensors (the
wire tests run no weight publisher); ``--fetch-weights`` fetches them over the network path
(``NetworkWeightClient``; ``--corrupt-first-fetch`` flips a byte of the first transfer, which the
client must repair), and the run's weight backend (e.g. the collective) works as in ``dapo actor``.
``--report FILE`` writes, at exit, per actor: every network fetch (version, chunks refetched),
every version loaded and the loop's counters (e.g. ``weight_loads_collective``), and saves each
version loaded as ``FILE.v<N>.safetensors`` (one actor per process). ``--hold-file``: generation waits
until that file exists. SIGTERM, or the learner's shutdown, stops every actor; exit 0 when every
actor's loop returned, 1 when one raised.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from dapo.runtime import apply_service_env

if TYPE_CHECKING:
    from actors.loop import Actor
    from dapo.config import DapoConfig
    from tests.fake_engine import FakeEngine

NO_RUN_DIR = "/nonexistent/fake-actor-run"
"""The actors' run folder: generation records are written only where it exists."""


def build_actor(learner: str, cfg: DapoConfig, engine: FakeEngine, stop: threading.Event, *,
                fetch: Callable[[int], tuple[int, dict]] | None = None) -> Actor:
    """An Actor as ``actors/main.py`` builds it, with the fake engine and verifier. ``fetch``:
    the weight fetch (default: the announced version, no tensors)."""
    from actors.client import CoordinatorClient
    from actors.loop import Actor
    from actors.metrics import ActorMetrics
    from tests.fake_engine import FakeVerifier, decode

    client = CoordinatorClient(learner, cfg.transport.auth_token, cfg.transport.rpc_timeout_s,
                               reconnect_backoff_max_s=cfg.actor.connect_retry_max_s)
    actor = Actor(cfg, client, engine, FakeVerifier(), decode,
                  fetch or (lambda _actor_id: (actor.latest_version, {})), ActorMetrics(), stop)
    return actor


def slow(evaluate: Callable[[], None], delay_s: float, stop: threading.Event) -> Callable[[], None]:
    """``Actor.evaluate`` that takes ``delay_s`` longer (a slow held-out evaluation)."""
    def delayed() -> None:
        stop.wait(delay_s)
        evaluate()
    return delayed


def recording_fetcher(learner: str, token: str, corrupt_first: bool):
    """(fetch, records): the network path's fetch as ``actors.client.network_fetcher`` does it,
    recording each fetch."""
    from actors.client import LearnerUnavailable
    from actors.transports.base import WeightFetchError
    from actors.transports.network import NetworkWeightClient

    records: list[dict] = []
    corrupt = [corrupt_first]

    def flip(buf) -> None:
        if corrupt[0]:
            buf[buf.numel() // 2] ^= 0x40
            corrupt[0] = False

    weights = NetworkWeightClient(learner, token, timeout_s=10.0, after_receive=flip)

    def fetch(actor_id: int):
        try:
            version, state, stats = weights.receive(actor_id)
        except WeightFetchError as exc:
            raise LearnerUnavailable(f"weight fetch from {learner}: {exc}") from None
        records.append({"version": version, "refetched": stats.refetched_chunks, "bytes": stats.bytes,
                        "tensors": len(state), "base_fetches": weights.base_fetches})
        return version, state

    return fetch, records


def main() -> int:
    apply_service_env()
    p = argparse.ArgumentParser()
    p.add_argument("--learner", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--easy-every", type=int, default=0, help="prompts whose first token is a multiple are all right")
    p.add_argument("--hold-file", default="")
    p.add_argument("--fetch-weights", action="store_true")
    p.add_argument("--corrupt-first-fetch", action="store_true")
    p.add_argument("--report", default="")
    p.add_argument("--eval-delay-s", type=float, default=0.0, help="each held-out batch is reported this much later")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s fake-actor %(threadName)s %(levelname)s "
                                                      "%(name)s: %(message)s")
    from actors.main import stop_on_signals
    from dapo.config import load_config
    from tests.fake_engine import FakeEngine

    cfg = load_config([f"transport.auth_token={args.token}", f"run.run_dir={NO_RUN_DIR}", *args.overrides])
    stop = threading.Event()
    stop_on_signals(stop)

    def hold() -> None:
        while args.hold_file and not Path(args.hold_file).exists() and not stop.wait(0.05):
            pass

    actors, records, failures = [], [], []
    for _ in range(args.threads):
        fetch, fetched = (recording_fetcher(args.learner, args.token, args.corrupt_first_fetch)
                          if args.fetch_weights else (None, []))
        engine = FakeEngine(easy_every=args.easy_every, hold=hold, keep_weights=bool(args.report), lora=cfg.lora)
        actors.append(build_actor(args.learner, cfg, engine, stop, fetch=fetch))
        if args.eval_delay_s:
            actors[-1].evaluate = slow(actors[-1].evaluate, args.eval_delay_s, stop)
        records.append(fetched)

    def serve(actor: Actor) -> None:
        try:
            actor.run()
        except BaseException as exc:  # noqa: BLE001 - reported by the exit code
            failures.append(exc)
            logging.exception("actor loop failed")
        finally:
            actor.client.close()

    threads = [threading.Thread(target=serve, args=(a,), name=f"actor{i}") for i, a in enumerate(actors)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if args.report:
        from safetensors.torch import save_file

        Path(args.report).write_text(json.dumps([
            {"fetches": fetched, "loaded": a.engine.loaded, "counters": a.metrics.counters,
             "base_loads": a.engine.base_loads, "adapter_loads": a.engine.adapter_loads}
            for a, fetched in zip(actors, records)]))
        for version, state in actors[0].engine.weights.items():
            save_file(state, f"{args.report}.v{version}.safetensors")
    return 1 if failures else 0


if __name__ == "__main__":
    from actors.main import exit_without_teardown

    exit_without_teardown(main())
