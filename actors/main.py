"""``dapo actor --learner HOST:PORT [hydra overrides]``: build one engine and run the actor loop."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

log = logging.getLogger("actors")

DESCRIPTION = """\
Start one rollout actor: one inference engine that leases prompts from the learner's
coordinator, samples G responses per prompt, scores them and pushes the groups to the replay
queue, loading new weights as the learner publishes them.

The actor may start before the learner (it waits, retrying with backoff up to
actor.connect_retry_max_s), survives learner restarts, and leaves cleanly on SIGTERM (its
leases go back to the coordinator). Run parameters (G, max tokens, temperature, staleness) come
from the learner; the model architecture and engine from this actor's config.
"""
EPILOG = """\
Everything after the options is a Hydra override, e.g.
  dapo actor --learner 10.0.0.5:50051 transport.auth_token=SECRET actor.engine=torch
  dapo actor --learner 127.0.0.1:50051 actor.update_mode=inflight actor.prometheus_port=9100
Keys: see dapo/config.py (ActorConfig, ModelConfig, TransportConfig) or `dapo config`.
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dapo actor", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--learner", required=True, metavar="HOST:PORT",
                        help="the learner's coordinator (gRPC) address, e.g. 127.0.0.1:50051")
    parser.add_argument("overrides", nargs="*", help="Hydra config overrides (key=value)")
    args = parser.parse_args(argv)
    host, _, port = args.learner.rpartition(":")
    if not host or not port.isdigit():
        parser.error(f"--learner {args.learner!r} is not HOST:PORT (e.g. 127.0.0.1:50051)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s actor %(levelname)s %(name)s: %(message)s")
    from dapo.config import ConfigError, load_config

    try:
        cfg = load_config(args.overrides)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # leave after the current stage, exit 0
        signal.signal(sig, lambda *_: stop.set())

    from transformers import AutoTokenizer

    from actors.client import AuthError, CoordinatorClient, network_fetcher
    from actors.engines import make_engine
    from actors.loop import Actor
    from actors.metrics import ActorMetrics, serve_prometheus
    from actors.verifier import Verifier
    from dapo.tiny import resolve_model_path

    model_path = str(resolve_model_path(cfg))
    engine = make_engine(cfg.actor.engine, model_path, dtype=cfg.model.dtype,
                         max_model_len_tokens=cfg.model.max_model_len_tokens, seed=cfg.actor.seed,
                         enforce_eager=cfg.actor.enforce_eager)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    t = cfg.transport
    client = CoordinatorClient(args.learner, t.auth_token, t.rpc_timeout_s, max_message_bytes=t.max_message_bytes,
                               reconnect_backoff_max_s=cfg.actor.connect_retry_max_s)
    fetch, close_fetch = network_fetcher(args.learner, t.auth_token, t.rpc_timeout_s)
    verifier = Verifier(cfg.actor.verifier_timeout_s, cfg.actor.reward_fn)
    metrics = ActorMetrics()
    stop_prometheus = serve_prometheus(metrics, cfg.actor.prometheus_port) if cfg.actor.prometheus_port > 0 else None
    actor = Actor(cfg, client, engine, verifier, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                  fetch, metrics, stop)
    try:
        return actor.run()
    except (AuthError, ValueError) as exc:  # wrong token, or a config the learner's run cannot use
        log.error("%s", exc)
        return 3
    finally:
        log.info("final: %s", metrics.log_line())
        for close in (verifier.close, close_fetch, client.close, engine.close, stop_prometheus or (lambda: None)):
            close()
