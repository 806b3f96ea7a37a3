"""Per-actor metrics: throughput, idle time, weight loads, verifier errors.

Namespace ``actor/``: counters (monotonic since start), ``time/<stage>`` (seconds spent in each
loop stage, summed) and rates over the wall time since start. ``idle/lease_wait_s``,
``idle/weight_wait_s`` and ``idle/learner_wait_s`` are the async-health numbers: time the engine
sat unused because the coordinator gave no prompts (staleness bound, queue credit), because weights
were awaited (a pushed version, a fetch and its retries, the load) or because the learner did not
answer (its backoff); ``idle/total_s`` is their sum (``idle_ms`` in heartbeats, the learner's
``actors/idle_fraction``).

Optional Prometheus endpoint (``actor.prometheus_port > 0``): the same numbers as
``dapo_actor_*`` gauges, read at scrape time from ``snapshot()`` (no second bookkeeping).

``GenerationLog``: one JSON line per generated group, written just before its push, with the
policy versions the engine reported for its tokens: the ground truth of a staleness audit that
does not rely on the learner's own books (tests/chaos/cluster.py joins it with the learner's
trained_prompts.jsonl).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Callable, Iterator, Sequence

log = logging.getLogger(__name__)

COUNTERS = ("groups_pushed", "samples_generated", "tokens_generated", "verifier_errors", "verifier_timeouts",
            "weight_loads", "weight_loads_collective", "push_failures", "leases_granted", "leases_returned",
            "registrations", "learner_lost", "learner_unreachable", "eval_prompts_sampled", "eval_results_refused",
            "eval_reports_failed",
            "episodes", "turns", "tool_calls", "tool_failures", "observation_tokens", "env_errors", "env_timeouts")
"""Counter names (all start at 0)."""
IDLE_STAGES = {"lease_wait": ("lease_wait",), "weight_wait": ("fetch_weights", "load_weights", "weight_wait"),
               "learner_wait": ("learner_wait",)}
"""``idle/<name>_s``: the stages in which the engine sits unused, summed."""


class ActorMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self.counters: dict[str, int] = {k: 0 for k in COUNTERS}
        self.stage_s: dict[str, float] = defaultdict(float)
        """Seconds spent per stage (``lease``, ``generate``, ``score``, ``push``, ``evaluate``, ``fetch_weights``,
        ``load_weights``, and the idle ones of IDLE_STAGES)."""
        self.last_stage_s: dict[str, float] = {}
        self.weight_version = 0

    def add(self, name: str, value: int = 1) -> None:
        assert name in self.counters, name
        with self._lock:
            self.counters[name] += value

    def add_time(self, stage: str, seconds: float) -> None:
        with self._lock:
            self.stage_s[stage] += seconds
            self.last_stage_s[stage] = seconds

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time a loop stage as ``time/<name>``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add_time(name, time.perf_counter() - start)

    def snapshot(self) -> dict[str, float]:
        """All metrics, flat, units in the keys."""
        with self._lock:
            wall_s = time.monotonic() - self._start
            out: dict[str, float] = {f"actor/{k}": float(v) for k, v in self.counters.items()}
            out.update({f"time/{k}_s": v for k, v in self.stage_s.items()})
            out["actor/wall_s"] = wall_s
            out["actor/weight_version"] = float(self.weight_version)
            out["actor/tokens_per_s"] = self.counters["tokens_generated"] / max(wall_s, 1e-9)
            out["actor/groups_per_s"] = self.counters["groups_pushed"] / max(wall_s, 1e-9)
            gen_s = self.stage_s.get("generate", 0.0)
            out["actor/generate_tokens_per_s"] = self.counters["tokens_generated"] / gen_s if gen_s else 0.0
            for name, stages in IDLE_STAGES.items():
                out[f"idle/{name}_s"] = sum(self.stage_s.get(k, 0.0) for k in stages)
            out["idle/total_s"] = sum(out[f"idle/{name}_s"] for name in IDLE_STAGES)
            out["actor/weight_load_s_last"] = self.last_stage_s.get("load_weights", 0.0)
            return out

    def log_line(self) -> str:
        s = self.snapshot()
        return (f"v{int(s['actor/weight_version'])} groups={int(s['actor/groups_pushed'])} "
                f"tok/s={s['actor/tokens_per_s']:.0f} (generating {s['actor/generate_tokens_per_s']:.0f}) "
                f"groups/s={s['actor/groups_per_s']:.2f} idle lease={s['idle/lease_wait_s']:.1f}s "
                f"weights={s['idle/weight_wait_s']:.1f}s learner={s['idle/learner_wait_s']:.1f}s "
                f"weight_loads={int(s['actor/weight_loads'])} "
                f"(collective {int(s['actor/weight_loads_collective'])}) "
                f"verifier_errors={int(s['actor/verifier_errors'])} "
                f"push_failures={int(s['actor/push_failures'])} time/ "
                + " ".join(f"{k[5:-2]}={v:.1f}s" for k, v in sorted(s.items()) if k.startswith("time/")))


class GenerationLog:
    """Append-only JSONL ``<run_dir>/logs/<file_name>``, one line per group (keys in ``record``) with
    the oldest and newest policy version of its tokens, as the engine reported them.

    Written only where the run folder exists on this host (``dapo run`` and the learner create
    it; a shared filesystem): an actor elsewhere, or one built from a default config in a test,
    leaves no stray folder behind. A write error is logged once and ends the log, never the actor."""

    def __init__(self, run_dir: Path, file_name: str) -> None:
        self.run_dir = run_dir
        self.path = run_dir / "logs" / file_name
        self._file: IO[str] | None = None
        self._failed = False

    def record(self, *, run_id: str, actor_id: int, lease_id: int, prompt_id: int,
               token_versions: Sequence[Sequence[int]], num_correct: int) -> None:
        """``token_versions``: per sample, the policy version of each of its tokens; ``num_correct``:
        samples the verifier judged correct (what a study of selective leasing's predictors reads:
        bench/fact_signal.py)."""
        flat = [int(v) for sample in token_versions for v in sample]
        if not flat or self._failed:
            return
        line = json.dumps({"run_id": run_id, "actor_id": int(actor_id), "lease_id": int(lease_id),
                           "prompt_id": int(prompt_id), "min_token_version": min(flat),
                           "max_token_version": max(flat), "num_samples": len(token_versions),
                           "num_correct": int(num_correct), "num_tokens": len(flat), "unix_time_s": time.time()})
        try:
            if self._file is None:
                if not self.run_dir.is_dir():  # checked until it appears: the learner may create it later
                    return
                self.path.parent.mkdir(exist_ok=True)
                self._file = open(self.path, "a")
            # Flushed per line: a kill -9 right after the push still leaves the record on disk.
            self._file.write(line + "\n")
            self._file.flush()
        except OSError as exc:
            self._failed = True
            log.warning("generation log %s: %s; no more generation records from this actor", self.path, exc)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def prometheus_name(key: str) -> str:
    """``actor/tokens_per_s`` -> ``dapo_actor_tokens_per_s``; ``time/generate_s`` -> ``dapo_actor_time_generate_s``."""
    body = key[len("actor/"):] if key.startswith("actor/") else key
    return "dapo_actor_" + re.sub(r"[^a-zA-Z0-9_]", "_", body)


def serve_prometheus(metrics: ActorMetrics, port: int, host: str = "127.0.0.1") -> Callable[[], None]:
    """Serve ``metrics`` at http://host:port/metrics; returns the function that stops serving."""
    from prometheus_client import start_http_server
    from prometheus_client.core import CollectorRegistry, GaugeMetricFamily

    class _Collector:
        def collect(self):  # called per scrape
            for key, value in sorted(metrics.snapshot().items()):
                yield GaugeMetricFamily(prometheus_name(key), key, value=value)

    registry = CollectorRegistry()
    registry.register(_Collector())
    server, thread = start_http_server(port, addr=host, registry=registry)
    log.info("actor metrics served at http://%s:%d/metrics", host, port)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5.0)

    return stop
