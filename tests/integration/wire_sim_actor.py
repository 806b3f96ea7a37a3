"""A simulated actor process (no model) for the wire tests: register, lease, "generate", push
groups, heartbeat.

    python -m tests.integration.wire_sim_actor --target HOST:PORT --token T [--gen-delay-s S] ...

It speaks the real contract (protos/ over gRPC, dapo.wire over ZMQ) with the real deadlines.
Groups: G samples of random tokens; accuracy all 1 (dropped by dynamic sampling) when
``prompt_id % filter_mod == 0``, else mixed. Prints ``REGISTERED <id>`` and ``LEASED <ids>``
lines so tests can act at the right moment. Leaves cleanly on SIGTERM or a shutdown heartbeat.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

import grpc
import numpy as np
import zmq

from dapo.runtime import apply_service_env
from dapo.wire import TrajectoryGroup, encode_group
from actors.client import CoordinatorClient, CoordinatorError


class SimActor:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.client = CoordinatorClient(args.target, args.token, timeout_s=args.rpc_timeout_s)
        self.rng = np.random.default_rng(args.seed)
        self.stop = False
        self.counters = {"groups_pushed": 0, "push_failures": 0}
        self.ctx = zmq.Context()
        self.push: zmq.Socket | None = None
        self.last_heartbeat_s = 0.0

    def register(self) -> None:
        reg = self.client.register(self.args.name, engine="sim")
        self.actor_id, self.run_id, self.version, self.run = reg.actor_id, reg.run_id, reg.current_version, reg.run
        if self.push is None:
            self.push = self.ctx.socket(zmq.PUSH)
            self.push.setsockopt(zmq.SNDTIMEO, int(self.args.rpc_timeout_s * 1000))
            self.push.setsockopt(zmq.SNDHWM, self.args.sndhwm)
            self.push.setsockopt(zmq.LINGER, 2000)
            self.push.connect(reg.zmq_endpoint)
        print(f"REGISTERED {self.actor_id}", flush=True)

    def heartbeat(self) -> None:
        if time.monotonic() - self.last_heartbeat_s < self.run.heartbeat_interval_s:
            return
        try:
            hb = self.client.heartbeat(self.actor_id, self.version, **self.counters)
        except CoordinatorError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND:
                raise
            self.register()  # declared dead while stopped: come back as a new actor
            return
        self.last_heartbeat_s = time.monotonic()
        self.version = hb.latest_version  # weights "load" instantly
        self.stop = self.stop or hb.shutdown

    def wait(self, seconds: float) -> None:
        """Sleep while heartbeating (generation time, or a lease retry)."""
        end = time.monotonic() + seconds
        while not self.stop and time.monotonic() < end:
            self.heartbeat()
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))

    def make_group(self, lease) -> TrajectoryGroup:
        g, max_len = self.run.num_samples_per_prompt, self.run.max_response_tokens
        lengths = self.rng.integers(1, max_len + 1, size=g).astype(np.int32)
        total = int(lengths.sum())
        if lease.prompt_id % self.args.filter_mod == 0:
            acc = np.ones(g, np.float32)
        else:
            acc = (np.arange(g) % 2).astype(np.float32)
        return TrajectoryGroup(
            run_id=self.run_id, actor_id=self.actor_id, lease_id=lease.lease_id, prompt_id=lease.prompt_id,
            prompt_ids=np.asarray(lease.prompt_token_ids, np.int32),
            response_ids=self.rng.integers(0, 100, total).astype(np.int32),
            logprobs=-self.rng.random(total).astype(np.float32), loss_mask=np.ones(total, np.uint8),
            response_lengths=lengths, versions=np.full(g, self.version, np.int64),
            version_changes=np.zeros((0, 3), np.int64), rewards=acc * 2 - 1, acc=acc, scores=acc,
            finish_reasons=("stop",) * g)

    def run_loop(self) -> None:
        self.register()
        while not self.stop:
            self.heartbeat()
            try:
                resp = self.client.lease(self.actor_id, self.run.prompts_per_lease, self.version)
            except CoordinatorError as exc:
                if exc.code != grpc.StatusCode.NOT_FOUND:
                    raise
                self.register()
                continue
            if not resp.leases:
                self.version = max(self.version, resp.latest_version)
                self.wait(max(resp.retry_after_s, 0.01))
                continue
            print("LEASED " + ",".join(str(lease.prompt_id) for lease in resp.leases), flush=True)
            self.wait(self.args.gen_delay_s)
            for lease in resp.leases:
                try:
                    self.push.send_multipart(encode_group(self.make_group(lease), self.args.token), copy=False)
                    self.counters["groups_pushed"] += 1
                except zmq.Again:
                    self.counters["push_failures"] += 1
                    self.client.return_leases(self.actor_id, [lease.lease_id])
        self.client.leave(self.actor_id)
        print("LEFT", flush=True)


def main() -> int:
    apply_service_env()
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--name", default="sim")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rpc-timeout-s", type=float, default=5.0)
    p.add_argument("--gen-delay-s", type=float, default=0.0)
    p.add_argument("--filter-mod", type=int, default=1 << 30)
    p.add_argument("--sndhwm", type=int, default=100)
    actor = SimActor(p.parse_args())
    signal.signal(signal.SIGTERM, lambda *_: setattr(actor, "stop", True))
    actor.run_loop()
    actor.push.close(linger=2000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
