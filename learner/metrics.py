"""Learner metrics sinks (rank 0): JSONL (always), TensorBoard, W&B (optional), Prometheus (flag).

One record per training step: a flat dict with ``step``, ``time_s`` (since the learner started)
and namespaced keys with units (``time/train_s``, ``train/loss``, ``weights/bytes``). JSONL is the
source of truth (dapo.plots and ``dapo run`` read it); the others mirror it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Mapping

log = logging.getLogger(__name__)


class MetricsLogger:
    def __init__(self, run_dir: str | Path, *, wandb: bool = False, prometheus_port: int = 0,
                 prometheus_host: str = "127.0.0.1", config: Mapping | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._t0 = time.monotonic()
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)  # line-buffered: tails see whole lines
        self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        self._wandb = None
        if wandb:
            try:
                import wandb as wandb_mod
            except ImportError:
                log.warning("learner.wandb=true but wandb is not installed; logging to JSONL/TensorBoard only")
            else:
                self._wandb = wandb_mod.init(project="dapo", dir=str(self.run_dir), config=dict(config or {}))
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
