"""A model-free actor for learner integration tests: real gRPC, ZMQ and weight paths, fake samples.

    python tests/integration/sim_actor.py --learner HOST:PORT --token T --out FILE
        [--weight-path network|collective --collective-port P] [--corrupt-first-fetch] [--group-size G]

Registers, leases prompts, pushes groups of G random responses (accuracy mixed so dynamic
sampling keeps them), keeps its weights current on the chosen path (checksums verified by the
client) and appends one JSON line per weight load to --out. On shutdown it fetches the final
version (network path), leaves, and exits; also exits when the learner goes away.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import zmq  # noqa: E402

from actors.transports.collective import CollectiveWeightReceiver  # noqa: E402
from actors.transports.network import NetworkWeightClient  # noqa: E402
from actors.transports.side_channel import SideChannelClient  # noqa: E402
from dapo.wire import TrajectoryGroup, encode_group  # noqa: E402
from actors.client import CoordinatorClient, CoordinatorError  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--learner", required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--weight-path", default="network")
    ap.add_argument("--collective-port", type=int, default=0)
    ap.add_argument("--corrupt-first-fetch", action="store_true")
    ap.add_argument("--vocab", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-s", type=float, default=300.0)
    ap.add_argument("--save-final", default="", help="save the last network-fetched weights (safetensors)")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    out = open(args.out, "a", buffering=1)
    corrupt = {"left": 1 if args.corrupt_first_fetch else 0}

    def flip(buf):
        if corrupt["left"] and buf.numel() > 100:
            buf[buf.numel() // 2] ^= 0x40
            corrupt["left"] -= 1

    client = CoordinatorClient(args.learner, args.token, timeout_s=10.0)
    client.wait_ready(60.0)
    reg = client.register(f"sim-{os.getpid()}")
    actor_id, g_size = reg.actor_id, reg.run.num_samples_per_prompt
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.SNDTIMEO, 10_000)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(reg.zmq_endpoint)
    state = {"version": -1}

    def log(path, version, stats):
        out.write(json.dumps({"path": path, "version": version, "refetched": stats.refetched_chunks,
                              "bytes": stats.bytes, "transfer_s": stats.transfer_s}) + "\n")

    if args.weight_path == "collective":
        net = NetworkWeightClient(args.learner, args.token, timeout_s=10.0)
        side = {"c": None}

        def repair(dst, version, offset):
            if side["c"] is None:
                side["c"] = SideChannelClient(net.info().side_channel_endpoint, args.token, 10.0)
            side["c"].read_into(dst, version, offset)

        host = args.learner.rpartition(":")[0]
        rx = CollectiveWeightReceiver(host, args.collective_port, f"sim-{os.getpid()}", timeout_s=30.0,
                                      repair_read=repair, after_receive=flip)

        def receive_loop():
            while True:
                try:
                    version, _, stats = rx.receive()
                except Exception as exc:  # noqa: BLE001 - learner gone or group rebuilt: keep trying
                    out.write(json.dumps({"error": str(exc)[:200]}) + "\n")
                    time.sleep(0.2)
                    continue
                state["version"] = version
                log("collective", version, stats)

        threading.Thread(target=receive_loop, daemon=True).start()
    else:
        net = NetworkWeightClient(args.learner, args.token, timeout_s=10.0, after_receive=flip)

    t_end = time.monotonic() + args.max_s
    while time.monotonic() < t_end:
        try:
            hb = client.heartbeat(actor_id, max(state["version"], 0))
            if args.weight_path == "network" and hb.latest_version > state["version"]:
                try:
                    version, weights, stats = net.receive(actor_id)
                    state["version"] = version
                    if args.save_final:
                        from safetensors.torch import save_file

                        save_file({k: v.clone() for k, v in weights.items()}, args.save_final + ".tmp",
                                  metadata={"version": str(version)})
                        os.replace(args.save_final + ".tmp", args.save_final)
                    log("network", version, stats)
                except grpc.RpcError:
                    pass  # nothing published yet (UNAVAILABLE)
            if hb.shutdown:  # after fetching: the run's final version is the one tests compare
                client.leave(actor_id)
                break
            if state["version"] < 0:
                time.sleep(0.05)
                continue
            lease = client.lease(actor_id, 4, state["version"])
            if not lease.leases:
                time.sleep(min(lease.retry_after_s, 0.2) or 0.02)
                continue
            for pl in lease.leases:
                lens = rng.integers(1, 9, g_size).astype(np.int32)
                acc = np.zeros(g_size, np.float32)
                acc[: g_size // 2] = 1.0  # mixed: dynamic sampling keeps the group
                total = int(lens.sum())
                group = TrajectoryGroup(
                    run_id=reg.run_id, actor_id=actor_id, lease_id=pl.lease_id, prompt_id=pl.prompt_id,
                    prompt_ids=np.asarray(pl.prompt_token_ids, np.int32),
                    response_ids=rng.integers(0, args.vocab, total).astype(np.int32),
                    logprobs=-rng.random(total).astype(np.float32) * 2, loss_mask=np.ones(total, np.uint8),
                    response_lengths=lens, versions=np.full(g_size, state["version"], np.int64),
                    version_changes=np.zeros((0, 3), np.int64), rewards=acc * 2 - 1, acc=acc,
                    scores=acc.copy(), finish_reasons=tuple("stop" for _ in range(g_size)))
                try:
                    push.send_multipart(encode_group(group, args.token))
                except zmq.Again:  # queue full for SNDTIMEO: the lease times out and is re-issued
                    pass
        except CoordinatorError as exc:
            if "UNAVAILABLE" in str(exc) or "DEADLINE" in str(exc):
                break  # learner gone
            raise
    out.close()
    os._exit(0)


if __name__ == "__main__":
    main()
