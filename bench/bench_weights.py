"""Weight push throughput, learner -> one actor process on loopback, vs raw TCP in the same run.

    .venv/bin/python bench/bench_weights.py [--sizes-mb 100 500] [--reps 3] [--append bench/results/weights.md]

Modes (the actor is a separate process; MB = 1e6 bytes; best / median of --reps):
  raw         sendall(memoryview) -> recv_into a preallocated buffer (the reference)
  network     learner.transports side channel -> actors.transports.side_channel.SideChannelClient.read_into
              (transfer only; + blake3 verify of every chunk reported separately)
  collective  CollectiveSender -> CollectiveWeightReceiver (ProcessGroupGloo), 64 MiB buckets,
              timed on the learner (broadcast of all buckets); verify reported separately
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness

harness.one_thread()

import torch  # noqa: E402

TOKEN = "bench"


def payload(size_mb: int) -> dict[str, torch.Tensor]:
    n = size_mb * 1_000_000 // 4
    parts = 8
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.rand(n // parts, generator=g) for i in range(parts)}


def actor_main(args: argparse.Namespace) -> None:
    from actors.transports.collective import CollectiveWeightReceiver
    from actors.transports.side_channel import SideChannelClient
    from dapo.weights import WeightManifest, bad_chunks

    torch.set_num_threads(1)
    if args.mode == "raw":
        buf = torch.empty(args.nbytes, dtype=torch.uint8)
        buf.fill_(0)  # page faults before timing (both paths reuse buffers)
        mv = memoryview(buf.numpy())
        s = socket.create_connection(("127.0.0.1", args.port))
        for _ in range(args.reps):
            t0 = time.perf_counter()
            s.sendall(b"g")
            got = 0
            while got < args.nbytes:
                got += s.recv_into(mv[got:])
            print(json.dumps({"transfer_s": time.perf_counter() - t0}), flush=True)
    elif args.mode == "network":
        man = WeightManifest.from_json(Path(args.manifest).read_bytes())
        buf = torch.empty(man.total_bytes, dtype=torch.uint8)
        buf.fill_(0)  # page faults before timing, as for raw
        client = SideChannelClient(f"127.0.0.1:{args.port}", TOKEN, 60.0)
        for _ in range(args.reps):
            t0 = time.perf_counter()
            client.read_into(memoryview(buf.numpy()), man.version, 0)
            t1 = time.perf_counter()
            assert bad_chunks(buf, man) == []
            print(json.dumps({"transfer_s": t1 - t0, "verify_s": time.perf_counter() - t1}), flush=True)
    else:
        rx = CollectiveWeightReceiver("127.0.0.1", args.port, "bench-actor", timeout_s=120.0)
        for _ in range(args.reps + 1):
            _, _, st = rx.receive()
            print(json.dumps({"transfer_s": st.transfer_s, "verify_s": st.verify_s}), flush=True)


def _actor(mode: str, port: int, nbytes: int, reps: int, manifest: str = "") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--actor", mode, "--port", str(port), "--nbytes", str(nbytes),
                             "--reps", str(reps), "--manifest", manifest], stdout=subprocess.PIPE, text=True)


def run_raw(sd: dict[str, torch.Tensor], reps: int) -> list[float]:
    from dapo.weights import flatten_state_dict

    buf, _ = flatten_state_dict(sd, version=0, chunk_bytes=4 << 20)
    srv = socket.create_server(("127.0.0.1", 0))
    proc = _actor("raw", srv.getsockname()[1], buf.numel(), reps)
    conn, _ = srv.accept()
    mv = memoryview(buf.numpy())
    for _ in range(reps):
        conn.recv(1)
        conn.sendall(mv)
    out = [json.loads(line)["transfer_s"] for line in proc.stdout]
    proc.wait(60)
    return out


def run_network(sd: dict[str, torch.Tensor], reps: int, tmp: Path) -> tuple[list[float], list[float]]:
    from learner.publisher import WeightPublisher
    from learner.transports import SenderOptions

    pub = WeightPublisher("side_channel", SenderOptions("127.0.0.1", TOKEN, timeout_s=60.0), chunk_bytes=4 << 20)
    pub.publish(sd, version=1)
    man_path = tmp / "manifest.json"
    man_path.write_bytes(pub.store.latest().to_json())
    proc = _actor("network", int(pub.senders["side_channel"].endpoint.rpartition(":")[2]), 0, reps, str(man_path))
    rows = [json.loads(line) for line in proc.stdout]
    proc.wait(60)
    pub.close()
    return [r["transfer_s"] for r in rows], [r["verify_s"] for r in rows]


def run_collective(sd: dict[str, torch.Tensor], reps: int) -> tuple[list[float], list[float], list[float]]:
    from learner.publisher import WeightPublisher
    from learner.transports import SenderOptions

    pub = WeightPublisher("collective", SenderOptions("127.0.0.1", TOKEN, timeout_s=120.0, bucket_bytes=64 << 20),
                          chunk_bytes=4 << 20)
    proc = _actor("collective", pub.senders["collective"].port, 0, reps)
    version, times, serialise = 0, [], []
    while len(times) < reps + 1:  # the first push also builds the group: not timed
        version += 1
        m = pub.publish(sd, version=version)
        serialise.append(m["time/serialise_s"])
        if m.get("weights/collective_members"):
            times.append(m["time/collective_transfer_s"])
        else:
            time.sleep(0.05)
    rows = [json.loads(line) for line in proc.stdout]
    proc.wait(60)
    pub.close()
    return times[1:], [r["verify_s"] for r in rows[1:]], serialise


def fmt(nbytes: int, times: list[float]) -> str:
    rates = sorted((nbytes / t / 1e6 for t in times), reverse=True)
    return f"{rates[0]:.0f} / {statistics.median(rates):.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--actor", choices=["raw", "network", "collective"])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--nbytes", type=int, default=0)
    ap.add_argument("--manifest", default="")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 500])
    harness.add_append(ap)
    args = ap.parse_args()
    if args.actor:
        args.mode = args.actor
        actor_main(args)
        return
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes_mb:
            sd = payload(size)
            nbytes = sum(t.numel() * 4 for t in sd.values())
            raw = run_raw(sd, args.reps)
            net, net_verify = run_network(sd, args.reps, Path(tmp))
            coll, coll_verify, ser = run_collective(sd, args.reps)
            med = lambda xs: statistics.median(nbytes / t / 1e6 for t in xs)  # noqa: E731
            rows.append((size, fmt(nbytes, raw), fmt(nbytes, net), f"{med(net) / med(raw):.2f}", fmt(nbytes, coll),
                         f"{med(coll) / med(raw):.2f}", f"{med(net_verify):.0f}", f"{statistics.median(ser):.2f}"))
            print(json.dumps({"size_mb": size, "raw_s": raw, "network_s": net, "collective_s": coll,
                              "verify_s": net_verify + coll_verify, "serialise_s": ser}), flush=True)
    table = ["| size | raw TCP MB/s | network (side channel) MB/s | ratio | collective (gloo) MB/s | ratio | "
             "blake3 verify MB/s | learner serialise s |", "|---|---|---|---|---|---|---|---|"]
    table += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    notes = (f"torch {torch.__version__}. MB = 1e6 bytes, best / median of {args.reps}; ratio = median / median "
             "of raw TCP measured in the same run. float32 payload.")
    harness.emit(harness.section("Weight push throughput (bench/bench_weights.py)", "\n".join(table), notes=notes),
                 args.append)


if __name__ == "__main__":
    main()
