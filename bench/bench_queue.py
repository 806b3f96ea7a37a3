"""Replay-queue ingestion rate vs raw ZMQ PUSH/PULL of the same bytes, in the same run.

    .venv/bin/python bench/bench_queue.py [--groups 1500] [--reps 3] [--append bench/results/queue.md]

A sender process (the "actor") pushes pre-encoded trajectory groups (dapo.wire frames, one
lease each) as fast as it can. Two receivers, alternating per repetition:
- raw:   a plain PULL socket, ``recv_multipart()``, nothing else;
- queue: learner.replay.ReplayQueue (receive thread: decode + validate, complete the lease with a
         Coordinator, dynamic-sampling filter, buffer) plus a consumer thread calling
         ``get_batch`` (staleness check, mark trained), as the learner would.
Time runs from the sender's first send (CLOCK_MONOTONIC is shared between processes) until the
receiver has handled the last group. Two shapes: the paper-like G=16 x 512 tokens and the tiny
default G=8 x 48 tokens (per-message overhead dominates there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import harness

harness.one_thread()

import numpy as np  # noqa: E402
import zmq  # noqa: E402

from dapo.wire import TrajectoryGroup, encode_group  # noqa: E402

TOKEN = "bench-token"


def build_frames(spec: dict) -> list[list[bytes]]:
    rng = np.random.default_rng(0)
    g, mean_len = spec["G"], spec["response_tokens"]
    out = []
    for lease_id, prompt_id in spec["leases"]:
        lengths = rng.integers(mean_len // 2, mean_len * 3 // 2 + 1, size=g).astype(np.int32)
        total = int(lengths.sum())
        acc = (np.arange(g) % 2).astype(np.float32)
        group = TrajectoryGroup(
            run_id=spec["run_id"], actor_id=spec["actor_id"], lease_id=lease_id, prompt_id=prompt_id,
            prompt_ids=np.arange(spec["prompt_tokens"], dtype=np.int32),  # the leased prompt (Source below)
            response_ids=rng.integers(0, 32000, total).astype(np.int32),
            logprobs=-rng.random(total).astype(np.float32), loss_mask=np.ones(total, np.uint8),
            response_lengths=lengths, versions=np.zeros(g, np.int64), version_changes=np.zeros((0, 3), np.int64),
            rewards=acc * 2 - 1, acc=acc, scores=acc, finish_reasons=("stop",) * g)
        out.append(encode_group(group, TOKEN))
    return out


def sender(spec_path: str, endpoint: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    messages = build_frames(spec)  # encoded before the clock starts: we measure transport + queue
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDTIMEO, 60_000)
    push.connect(endpoint)
    print(json.dumps({"t0": time.monotonic()}), flush=True)
    for frames in messages:
        push.send_multipart(frames, copy=False)
    push.close(linger=60_000)
    ctx.term()


def start_sender(spec: dict, endpoint: str, tmp: Path) -> tuple[subprocess.Popen, Path]:
    path = tmp / "spec.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.Popen([sys.executable, __file__, "--role", "sender", "--spec", str(path), "--endpoint", endpoint],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(harness.ROOT)})
    return proc, path


def sender_t0(proc: subprocess.Popen) -> float:
    return json.loads(proc.stdout.readline())["t0"]


def run_raw(spec: dict, tmp: Path) -> tuple[float, float, int]:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVTIMEO, 60_000)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    proc, _ = start_sender(spec, f"tcp://127.0.0.1:{port}", tmp)
    nbytes = 0
    cpu0 = time.thread_time()
    for _ in range(len(spec["leases"])):
        nbytes += sum(len(f) for f in pull.recv_multipart())
    t1 = time.monotonic()
    cpu_s = time.thread_time() - cpu0
    elapsed = t1 - sender_t0(proc)
    proc.wait(timeout=60)
    pull.close(linger=0)
    ctx.term()
    return elapsed, cpu_s, nbytes


def run_queue(args: argparse.Namespace, shape: dict, tmp: Path) -> tuple[float, float]:
    """The queue as the learner runs it: a consumer thread takes batches of --batch-groups with
    get_batch while groups arrive. Returns (wall s, receiver-thread CPU s)."""
    from dapo.config import AlgorithmConfig, DapoConfig, TransportConfig
    from learner.coordinator import Coordinator
    from learner.replay import ReplayQueue

    class TimedQueue(ReplayQueue):
        cpu_s = 0.0

        def _receive_loop(self) -> None:
            cpu0 = time.thread_time()
            try:
                super()._receive_loop()
            finally:
                self.cpu_s = time.thread_time() - cpu0

    n, batch = args.groups, args.batch_groups
    cfg = DapoConfig(transport=TransportConfig(host="127.0.0.1", zmq_port=0, auth_token=TOKEN, queue_max_groups=256),
                     algorithm=AlgorithmConfig(num_prompts_per_step=batch, num_samples_per_prompt=shape["G"],
                                               num_minibatches_per_step=1, max_staleness_steps=1 << 20))
    cfg.actor.max_response_tokens = shape["response_tokens"] * 3 // 2  # build_frames' longest

    class Source:
        def __len__(self) -> int:
            return n

        def get(self, index: int) -> tuple[list[int], str, str]:
            return list(range(shape["prompt_tokens"])), "bench", ""

    # Lease every group up front (credit = n), so the sender never waits for the coordinator.
    coord = Coordinator(Source(), num_prompts_per_step=batch, max_staleness_steps=1 << 20, queue_max_groups=n,
                        heartbeat_timeout_s=3600, lease_timeout_s=3600)
    actor = coord.register("bench")
    leases = coord.lease(actor, n, 0).leases
    assert len(leases) == n, coord.counters()
    spec = dict(shape, run_id=coord.run_id, actor_id=actor, leases=[(g.lease_id, g.prompt_id) for g in leases])
    queue = TimedQueue(cfg, coord, vocab_size=32000)  # build_frames draws ids below it
    endpoint = queue.start()
    consumed: list = []
    done_s: list[float] = []

    def consumer() -> None:
        while len(consumed) < n:
            consumed.extend(queue.get_batch(timeout_s=60))
        done_s.append(time.monotonic())

    thread = threading.Thread(target=consumer)
    thread.start()
    proc, _ = start_sender(spec, endpoint, tmp)
    t0 = sender_t0(proc)
    thread.join(timeout=120)
    counts = queue.counters()
    proc.wait(timeout=60)
    queue.close()
    assert counts["accepted"] == n and len(consumed) == n, counts
    return done_s[0] - t0, queue.cpu_s


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="bench", choices=["bench", "sender"])
    p.add_argument("--spec", default="")
    p.add_argument("--endpoint", default="")
    p.add_argument("--groups", type=int, default=1536, help="groups per repetition (a multiple of --batch-groups)")
    p.add_argument("--batch-groups", type=int, default=32, help="N: groups per get_batch of the consumer")
    p.add_argument("--reps", type=int, default=3)
    harness.add_append(p)
    args = p.parse_args()
    if args.role == "sender":
        sender(args.spec, args.endpoint)
        return 0
    assert args.groups % args.batch_groups == 0, "--groups must be a multiple of --batch-groups"
    shapes = {"G=16 x 512 tok": dict(G=16, response_tokens=512, prompt_tokens=128),
              "G=8 x 48 tok": dict(G=8, response_tokens=48, prompt_tokens=32)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for label, shape in shapes.items():
            raw, queue = [], []
            for _ in range(args.reps):  # interleaved, so load changes hit both alike
                spec = dict(shape, run_id="raw", actor_id=1, leases=[(i + 1, i) for i in range(args.groups)])
                raw.append(run_raw(spec, tmp))
                queue.append(run_queue(args, shape, tmp))
            raw_s, raw_cpu_s = statistics.median(r[0] for r in raw), statistics.median(r[1] for r in raw)
            queue_s, queue_cpu_s = statistics.median(q[0] for q in queue), statistics.median(q[1] for q in queue)
            nbytes, n = raw[0][2], args.groups
            row = {"shape": label, "groups": n, "mb_per_group": nbytes / n / 1e6,
                   "raw_groups_s": n / raw_s, "raw_mb_s": nbytes / raw_s / 1e6,
                   "queue_groups_s": n / queue_s, "queue_mb_s": nbytes / queue_s / 1e6, "ratio": raw_s / queue_s,
                   "raw_cpu_us_per_group": raw_cpu_s / n * 1e6, "queue_cpu_us_per_group": queue_cpu_s / n * 1e6,
                   "load_avg_1m": os.getloadavg()[0]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    harness.emit(result(args, rows), args.append)
    return 0


def result(args: argparse.Namespace, rows: list[dict]) -> str:
    load = ", ".join(f"{r['load_avg_1m']:.1f}" for r in rows)
    notes = (f"pyzmq {zmq.__version__} / libzmq {zmq.zmq_version()}; 1-min load average during the runs: {load}. "
             "Median of the reps, raw and queue interleaved; MB = 1e6 bytes; one sender process, receiver in the "
             "bench process; time from the sender's first send to the last group handled. queue = PULL + "
             "decode/validate + lease completion + dynamic-sampling filter, with a consumer thread taking batches of "
             f"{args.batch_groups} groups via get_batch (staleness check, mark trained); raw = recv_multipart of the "
             "same bytes. ratio = queue rate / raw rate (goal >= 0.5). CPU = receiving thread's CPU time per group "
             "(less sensitive to the machine's load than wall time).")
    lines = ["| shape | MB/group | raw groups/s | raw MB/s | queue groups/s | queue MB/s | ratio | raw CPU us/group "
             "| queue CPU us/group |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['mb_per_group']:.3f} | {r['raw_groups_s']:.0f} | {r['raw_mb_s']:.0f} | "
                     f"{r['queue_groups_s']:.0f} | {r['queue_mb_s']:.0f} | {r['ratio']:.2f} | "
                     f"{r['raw_cpu_us_per_group']:.0f} | {r['queue_cpu_us_per_group']:.0f} |")
    return harness.section("Replay-queue ingestion (bench/bench_queue.py)", "\n".join(lines), notes=notes)


if __name__ == "__main__":
    sys.exit(main())
