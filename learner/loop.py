"""The learner's service loop: one training step per batch of N groups, then publish version v+1.

```
 rank 0                                   every rank (same collectives, same order)
 ───────────────────────────────────────  ──────────────────────────────────────────────────
 replay.get_batch ─ control broadcast ──> wait_batch   (WAIT slices keep peers inside their timeout)
 from_groups: advantages, packing plan ─> scatter      rank 0 -> each rank its packed share
                                          train        π_prox, M mini-batches × micro-batches, AdamW
                                          gather       full state dict -> rank 0
 publisher: SENDERS[weights.backend]   <─ publish      version v+1; coordinator.set_version
 evaluator (every K steps, sampled)                    (rank 0, a forked process, or eval leases to
                                                        the actors: training goes on; step records
                                                        wait in order for its result)
                                          checkpoint   every K steps (DCP + coordinator state)
                                          heap trim    free heap pages back to the OS (dapo/heap.py)
 metrics.jsonl, trained_prompts.jsonl  <─ log          (the audit line is written before publish)
```
"""

from __future__ import annotations

import json
import signal
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import psutil
import torch
import torch.distributed as dist

from dapo.config import DapoConfig
from dapo.heap import heap_stats, release_free_heap
from dapo.rundir import carried_config
from learner import checkpoint
from learner.batch import batch_metrics, from_groups, scatter_batch
from learner.rank0 import Rank0Services
from learner.snapshots import read_index, save_snapshot, snapshot_root
from learner.trainer import Trainer

WAIT, BATCH, STOP, ERROR = 0, 1, 2, 3


class StopFlag:
    """SIGTERM/SIGINT set it; rank 0 turns it into a STOP broadcast at the next batch boundary."""

    def __init__(self) -> None:
        self.reason = ""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._set)

    def _set(self, signum: int, _frame: object) -> None:
        self.reason = signal.Signals(signum).name


@contextmanager
def timed(times: dict[str, float], stage: str) -> Iterator[None]:
    t0 = time.perf_counter()
    yield
    times[f"time/{stage}_s"] = time.perf_counter() - t0


def run(cfg: DapoConfig, trainer: Trainer, services: Rank0Services | None, *, start_step: int,
        model_path: str, stop: StopFlag) -> int:
    """Train until ``learner.total_steps`` (or STOP); returns the last completed step.

    A failure of rank-0-only work (publish, evaluation, logging) is kept in ``failure`` and carried
    to every rank by the next control broadcast (ERROR + its message): the other ranks are waiting
    there, and would otherwise sit until ``learner.collective_timeout_s`` and die of a gloo timeout."""
    step, last_ckpt = start_step, start_step
    failure: BaseException | None = None
    while not cfg.learner.total_steps or step < cfg.learner.total_steps:
        t, t_step = {}, time.perf_counter()
        with timed(t, "wait_batch"):
            groups = next_batch(cfg, services, stop, trainer.device, failure)
        if groups is None:
            break
        with timed(t, "scatter"):
            batch = from_groups(groups, cfg.algorithm, version=step) if services else None  # step = version trained at
            shard = scatter_batch(batch, num_minibatches=cfg.algorithm.num_minibatches_per_step,
                                  max_tokens_per_microbatch=cfg.learner.max_tokens_per_microbatch,
                                  device=trainer.device)
        with timed(t, "train"):
            train = trainer.train_step(shard)
        with timed(t, "gather"):
            state_dict = trainer.version_state_dict()  # with LoRA the adapters alone
        step += 1
        if services and cfg.learner.save_weights_every_steps and step % cfg.learner.save_weights_every_steps == 0:
            with timed(t, "save_weights"):
                save_weights(cfg, state_dict, model_path, step)
        evaluating = bool(services and services.evaluator and step % cfg.learner.eval_every_steps == 0)
        pub: dict[str, float] = {}
        if services:
            try:
                with open(services.audit_path, "a") as f:  # before publish/checkpoint: the audit never lags
                    f.write(json.dumps({"step": step, "prompt_ids": [int(g.prompt_id) for g in groups]}) + "\n")
                pub = publish_version(services, state_dict, step, evaluating, t)
            except Exception as exc:  # noqa: BLE001 - every rank raises it at the next broadcast
                failure = exc
        if cfg.learner.checkpoint_every_steps and step % cfg.learner.checkpoint_every_steps == 0:
            with timed(t, "checkpoint"):
                save_checkpoint(cfg, trainer, services, step, model_path)
            last_ckpt = step
        t["time/heap_trim_s"] = release_free_heap()  # this step's freed buffers: RSS flat (dapo/heap.py)
        if services and failure is None:
            try:
                log_step(services, step, groups, batch, {**t, **train, **pub}, time.perf_counter() - t_step,
                         evaluating)
            except Exception as exc:  # noqa: BLE001 - as above
                failure = exc
    if step != last_ckpt:
        save_checkpoint(cfg, trainer, services, step, model_path)
    if services is None:  # ranks > 0: rank 0's WAITs while it waits for the last evaluations, then the outcome
        while broadcast_control(WAIT, None, trainer.device) == WAIT:
            pass
        return step
    if failure is None:
        try:
            flush_records(services, block=True, stop=stop, keepalive=peers_keepalive(cfg, trainer.device))
        except Exception as exc:  # noqa: BLE001 - as above
            failure = exc
    broadcast_control(STOP, failure, trainer.device)  # the run's outcome, on every rank
    return step


def peers_keepalive(cfg: DapoConfig, device: torch.device) -> Callable[[], None]:
    """Rank 0's tick while it blocks at the end of the run (the last evaluation may take up to its
    job timeout, minutes): a WAIT broadcast at most every slice, so that the other ranks, waiting for
    the run's outcome, stay inside ``learner.collective_timeout_s``."""
    slice_s, last = min(1.0, cfg.learner.collective_timeout_s / 4), [time.monotonic()]

    def tick() -> None:
        if time.monotonic() - last[0] >= slice_s:
            broadcast_control(WAIT, None, device)
            last[0] = time.monotonic()
    return tick


def next_batch(cfg: DapoConfig, services: Rank0Services | None, stop: StopFlag, device: torch.device,
               failure: BaseException | None = None) -> list | None:
    """Rank 0 waits for N groups in slices, broadcasting WAIT between slices so the other ranks'
    collective timeout never fires while actors are slow; BATCH, STOP or ERROR ends the wait
    (ERROR at once when rank 0 already has a ``failure``)."""
    # Short slices: a SIGTERM is acted on within ~1 s (torchrun SIGKILLs ranks 30 s after SIGTERM).
    slice_s = min(1.0, cfg.learner.collective_timeout_s / 4)
    t0 = time.monotonic()
    deadline = t0 + cfg.learner.batch_wait_timeout_s
    while True:
        code, groups, error = WAIT, None, failure
        if services is not None:
            try:
                code, groups = _wait_slice(services, stop, deadline, slice_s) if error is None else (ERROR, None)
            except TimeoutError as exc:
                code, error = ERROR, TimeoutError(
                    f"learner: no batch after waiting {time.monotonic() - t0:.1f} s "
                    f"(learner.batch_wait_timeout_s={cfg.learner.batch_wait_timeout_s:g}): {exc}")
            except Exception as exc:  # noqa: BLE001 - e.g. DynamicSamplingStalled, EvaluationFailed: stop all ranks
                code, error = ERROR, exc
        code = broadcast_control(code, error, device)
        if code == BATCH:
            return groups if services is not None else []
        if code == STOP:
            return None


def _wait_slice(services: Rank0Services, stop: StopFlag, deadline: float, slice_s: float) -> tuple[int, list | None]:
    """Rank 0: one slice of the wait: (BATCH, groups), (STOP, None) or (WAIT, None); TimeoutError at ``deadline``."""
    flush_records(services)  # evaluations that finished while waiting
    if stop.reason:
        return STOP, None
    services.publisher.sync_new_members()  # bounded by weights.sync_timeout_s
    try:
        return BATCH, services.replay.get_batch(min(slice_s, max(deadline - time.monotonic(), 0.01)))
    except TimeoutError:
        if time.monotonic() >= deadline:
            raise
        if services.lines is not None:  # "waiting for actors: start one with ..." while there is none
            services.lines.waiting(len(services.coordinator.status()["actors"]))
        return WAIT, None


ERROR_MESSAGE_BYTES = 4096


class Rank0Failed(RuntimeError):
    """Raised on ranks > 0: rank 0 failed; the message is rank 0's error."""


def broadcast_control(code: int, error: BaseException | None, device: torch.device) -> int:
    """Every rank: rank 0's control ``code`` (ERROR whenever rank 0 has an ``error``), and with ERROR
    the error's text. Returns the code; raises on ERROR: rank 0 its own exception, the others
    ``Rank0Failed`` with its message (no pickling: the text travels as a fixed-size byte tensor)."""
    rank0 = dist.get_rank() == 0
    ctrl = torch.tensor([ERROR if rank0 and error is not None else code], dtype=torch.int64, device=device)
    dist.broadcast(ctrl, 0)  # NCCL: on the GPU
    if int(ctrl.cpu()[0]) != ERROR:
        return int(ctrl.cpu()[0])
    text = torch.zeros(ERROR_MESSAGE_BYTES, dtype=torch.uint8)
    if rank0:
        raw = f"{type(error).__name__}: {error}".encode()[:ERROR_MESSAGE_BYTES]
        text[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    text = text.to(device)
    dist.broadcast(text, 0)
    if rank0:
        raise error or RuntimeError("learner rank 0 failed")
    raise Rank0Failed("learner rank 0 failed: " + bytes(text.cpu().numpy()).rstrip(b"\0").decode(errors="replace"))


def publish(services: Rank0Services | None, state_dict: dict[str, torch.Tensor], version: int) -> dict[str, float]:
    if services is None:
        return {}
    # Publishing makes `version` fetchable (and broadcasts it) before it is announced: from
    # begin_publish on, actors that already hold it may lease and push; set_version announces it.
    services.coordinator.begin_publish(version)
    out = services.publisher.publish(state_dict, version)
    services.coordinator.set_version(version)
    for err in services.publisher.errors.values():  # a failed sender; the version is still served by the others
        print(f"learner: {err}", flush=True)
    return out


def publish_version(services: Rank0Services, state_dict: dict[str, torch.Tensor], version: int, evaluate: bool,
                    times: dict[str, float]) -> dict[str, float]:
    """``publish``, and with ``evaluate`` submit the version to the evaluator: the forked one after
    the publish (off the critical path: it copies the weights, the next step starts now), the actors'
    one before it (its eval job must be open before any actor can hold the version)."""
    evaluator = services.evaluator if evaluate else None
    first = evaluator is not None and evaluator.submits_before_publish
    if first:
        with timed(times, "eval_submit"):
            evaluator.submit(state_dict, version)
    with timed(times, "publish"):
        out = publish(services, state_dict, version)
    if evaluator is not None and not first:
        with timed(times, "eval_submit"):
            evaluator.submit(state_dict, version)
    return out


def publish_initial(services: Rank0Services, state_dict: dict[str, torch.Tensor], step: int, *,
                    log_record: bool = True) -> None:
    """Version ``step`` before the first training step: actors sync to it; eval gives the curve's start.
    ``log_record`` False (a resumed run whose history has that step's record): publish only."""
    evaluate = log_record and services.evaluator is not None
    publish_version(services, state_dict, step, evaluate, {})
    if log_record:
        hold(services, step, {"version": float(step)}, awaits_eval=evaluate)
        flush_records(services)


def snapshot_due(cfg: DapoConfig, step: int) -> bool:
    """Version ``step`` is one ``learner.save_weights_every_steps`` keeps (0 and every K-th) and has no
    snapshot yet (a resumed run's snapshot of its start step is the stopped run's, kept with its time)."""
    every = cfg.learner.save_weights_every_steps
    return bool(every) and step % every == 0 and all(
        int(e["step"]) != step for e in read_index(snapshot_root(cfg.run.run_dir)))


def save_weights(cfg: DapoConfig, state_dict: dict[str, torch.Tensor], model_path: str, step: int) -> None:
    """Version ``step`` as an HF folder (``learner.save_weights_every_steps``, learner/snapshots.py)."""
    save_snapshot(state_dict, model_path, snapshot_root(cfg.run.run_dir), step, getattr(torch, cfg.model.dtype),
                  carried_config(cfg))


def save_checkpoint(cfg: DapoConfig, trainer: Trainer, services: Rank0Services | None, step: int,
                    model_path: str) -> None:
    run_state = {"step": step, "version": step, "coordinator": services.coordinator.state_dict(),
                 "replay": services.replay.state_dict()} if services else None
    checkpoint.save(cfg.run.run_dir, step, trainer.model, trainer.optimizer, trainer.scheduler, run_state,
                    model_path, carried_config(cfg) if services else None)


def hold(services: Rank0Services, step: int, values: dict[str, float], *, awaits_eval: bool) -> None:
    """Queue a step record, stamped with the time now (held records carry the time of their step,
    not of their logging); ``flush_records`` logs it in step order."""
    services.held_records.append((step, {**values, **services.metrics.stamp()}, awaits_eval))


def flush_records(services: Rank0Services, *, block: bool = False, stop: StopFlag | None = None,
                  keepalive: Callable[[], None] = lambda: None) -> None:
    """Log held records in order, each one awaiting an evaluation once its result is in (``block``:
    wait for it; a stop request (``stop``) during that wait logs the rest without their
    evaluations instead). A record is never logged before an earlier one, so metrics.jsonl stays
    in step order with the evaluation inside the record of the version it evaluated."""
    def stopping() -> bool:  # asked every slice of a blocking wait: the peers' keepalive goes with it
        keepalive()
        return bool(stop and stop.reason)

    while services.held_records:
        step, values, awaits_eval = services.held_records[0]
        if awaits_eval:
            result = services.evaluator.result(step, block=block, abandon=stopping)
            if result is None and not (block and stopping()):
                return
            if result is None:
                print(f"learner: {stop.reason} while version {step} was being evaluated: its record is logged "
                      "without the evaluation", flush=True)
            values = {**values, **(result or {})}
        record = services.metrics.log(step, values)
        if services.lines is not None:
            services.lines.step(step, record)
        services.held_records.pop(0)


def log_step(services: Rank0Services, step: int, groups: list, batch: Any, values: dict[str, float],
             step_s: float, awaits_eval: bool = False) -> None:
    record = {"version": float(step), **values, **batch_metrics(groups, step - 1), "time/step_s": step_s,
              "learner/idle_fraction": values["time/wait_batch_s"] / max(step_s, 1e-9),
              "throughput/tokens_per_s": float(batch.tokens.numel()) / max(step_s, 1e-9)}
    record["memory/learner_rss_mb"] = psutil.Process().memory_info().rss / 2**20  # rank 0; flat after warm-up
    record.update(heap_stats())  # after the step's trim: what glibc holds in use, free and mmapped
    status = services.coordinator.status()
    record["actors/alive"] = float(len(status["actors"]))
    uptime_ms = sum(a["counters"].get("uptime_ms", 0) for a in status["actors"])  # 0 before a heartbeat
    if uptime_ms:
        record["actors/idle_fraction"] = sum(a["counters"].get("idle_ms", 0) for a in status["actors"]) / uptime_ms
    record.update({f"queue/{k}": float(v) for k, v in services.replay.counters().items()})
    record.update({f"coordinator/{k}": float(v) for k, v in services.coordinator.counters().items()})
    record.update(services.coordinator.selection_metrics())  # since the last step: generated per trained, skips
    hold(services, step, record, awaits_eval=awaits_eval)
    flush_records(services)
