"""Learner metrics sinks (rank 0): JSONL (always), TensorBoard, W&B (optional), Prometheus (flag).

One record per training step: a flat dict with ``step``, ``time_s`` (since the learner started; a
resumed run's clock goes on from its last record) and namespaced keys with units (``time/train_s``,
``train/loss``, ``weights/bytes``). JSONL is the source of truth (dapo.plots and ``dapo run`` read
it); the others mirror it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Mapping

log = logging.getLogger(__name__)


class MetricsLogger:
    def __init__(self, run_dir: str | Path, *, wandb: Mapping[str, Any] | None = None, prometheus_port: int = 0,
                 prometheus_host: str = "127.0.0.1", config: Mapping | None = None) -> None:
        """``wandb``: the keyword arguments of ``wandb.init`` (learner/wandb_run.py), None = no W&B."""
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # A resumed run appends to its history (learner/history.py cut it back to the checkpoint's
        # step): its clock goes on from the last record, and TensorBoard hides its own later steps.
        last = last_record(self.run_dir / "metrics.jsonl")
        self._t0 = time.monotonic() - (float(last["time_s"]) if last else 0.0)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)  # line-buffered: tails see whole lines
        self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=int(last["step"]) + 1 if last else None)
        self._wandb = None
        if wandb is not None:
            import wandb as wandb_mod  # a run asking for it without the package is refused at start-up

            self._wandb = wandb_mod.init(**wandb, config=dict(config or {}))
        self._gauges: dict = {}
        self._prom = None
        if prometheus_port:
            import prometheus_client

            self._prom = prometheus_client.CollectorRegistry()
            prometheus_client.start_http_server(prometheus_port, addr=prometheus_host, registry=self._prom)

    def stamp(self) -> dict[str, float]:
        """The time now as a record carries it (``log`` takes a record's own stamp when it has one).
        unix_time_s: lets `dapo run` measure from its own start (start-up included)."""
        return {"time_s": time.monotonic() - self._t0, "unix_time_s": time.time()}

    def log(self, step: int, values: Mapping[str, float]) -> dict[str, float]:
        record = {"step": step, **self.stamp()}
        record.update({k: float(v) for k, v in values.items()})
        self._jsonl.write(json.dumps(record) + "\n")
        finite = {k: v for k, v in record.items() if k != "step" and math.isfinite(v)}
        for k, v in finite.items():
            self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(finite, step=step)
        if self._prom is not None:
            from prometheus_client import Gauge

            for k, v in finite.items():
                name = "dapo_learner_" + "".join(c if c.isalnum() else "_" for c in k)
                if name not in self._gauges:
                    self._gauges[name] = Gauge(name, k, registry=self._prom)
                self._gauges[name].set(v)
        return record

    def close(self) -> None:
        self._jsonl.close()
        self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def last_record(path: Path, tail_bytes: int = 1 << 16) -> dict | None:
    """The last complete record of a metrics.jsonl (None when there is none), reading its tail only."""
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        start = max(0, f.seek(0, 2) - tail_bytes)
        f.seek(start)
        lines = f.read().split(b"\n")
    for line in reversed(lines[1:] if start else lines):  # from mid-file, the first line is partial
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None
