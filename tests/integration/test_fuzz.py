"""Fuzz the live replay queue (100k malformed ZMQ multipart messages) and the live coordinator
(malformed gRPC requests): nothing crashes, every message and call is counted, the services
keep working afterwards. Seeded mutations of valid encodings keep generation cheap."""

from __future__ import annotations

import random

import grpc
import msgpack
import pytest
import zmq

from dapo.wire import WIRE_ERROR_REASONS, encode_group
from protos import AUTH_METADATA_KEY
from protos import coordinator_pb2 as pb
from actors.client import CoordinatorClient
from tests.integration.test_wire_services import make_group
from tests.integration.wire_harness import TOKEN, Learner, make_cfg

pytestmark = pytest.mark.slow

NUM_ZMQ_MESSAGES = 100_000
NUM_GRPC_CALLS = 2_000
CAP_BYTES = 256 << 10
REQUEST_METHOD = {"LeaseRequest": "Lease", "HeartbeatRequest": "Heartbeat", "LeaveRequest": "Leave",
                  "RegisterRequest": "Register", "ReturnLeasesRequest": "ReturnLeases",
                  "FetchWeightsRequest": "FetchWeights"}
QUEUE_REASONS = set(WIRE_ERROR_REASONS) | {"wrong_run", "lease_not_active", "lease_mismatch", "future_version"}


def bad_headers(header: dict) -> list[bytes]:
    """Every header key replaced by values of the wrong type or range, packed once."""
    bad_values = [None, -1, 1.5, "x", [], {}, 1 << 63, [1] * 50, True, [[-1, 0, 0]], ["stop"] * 3]
    out = []
    for key in header:
        for value in bad_values:
            mutated = dict(header, **{key: value})
            out.append(msgpack.packb(mutated, use_bin_type=True))
        out.append(msgpack.packb({k: v for k, v in header.items() if k != key}, use_bin_type=True))
    out.append(msgpack.packb(dict(header, token="wrong"), use_bin_type=True))
    out.append(msgpack.packb(dict(header, run_id="other-run"), use_bin_type=True))
    out.append(msgpack.packb(msgpack.ExtType(5, b"payload"), use_bin_type=True))
    out.append(msgpack.packb([[[[[[[[[[]]]]]]]]]] * 3, use_bin_type=True))
    return out


def mutate(rng: random.Random, frames: list[bytes], headers: list[bytes], big: list[bytes]) -> list[bytes]:
    kind = rng.randrange(10)
    frames = list(frames)
    if kind == 0:  # flip header bytes
        h = bytearray(frames[0])
        for _ in range(rng.randint(1, 4)):
            h[rng.randrange(len(h))] = rng.randrange(256)
        frames[0] = bytes(h)
    elif kind == 1:  # truncate the header
        frames[0] = frames[0][:rng.randrange(len(frames[0]))]
    elif kind == 2:  # random header
        frames[0] = rng.randbytes(rng.randrange(64))
    elif kind == 3:  # wrong frame count
        if rng.random() < 0.5:
            del frames[rng.randrange(len(frames))]
        else:
            frames += [b"x"] * rng.randint(1, 20)
    elif kind == 4:  # resize an array frame
        i = rng.randrange(1, 5)
        frames[i] = frames[i][:-rng.randint(1, 7)] if rng.random() < 0.5 else frames[i] + b"\0" * rng.randint(1, 7)
    elif kind == 5:  # garbage inside an array frame (negative ids, NaN / positive log-probs, mask 255)
        i = rng.randrange(1, 5)
        f = bytearray(frames[i])
        for _ in range(rng.randint(1, 3)):
            f[rng.randrange(len(f))] = rng.choice((0xFF, 0x7F, 0x80, 0x01))
        frames[i] = bytes(f)
    elif kind == 6 or kind == 7:  # a wrong-typed or missing header field
        frames[0] = rng.choice(headers)
    elif kind == 8:
        return big if rng.random() < 0.01 else [b""]
    return frames  # kind 9: a valid message for a lease that is not active


@pytest.mark.timeout(120)
def test_fuzz_replay_queue_and_coordinator() -> None:
    cfg = make_cfg(transport=dict(max_message_bytes=CAP_BYTES, queue_max_groups=64))
    learner = Learner(cfg, 100)
    rng = random.Random(1234)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDTIMEO, 30_000)
    push.connect(learner.queue.endpoint)
    client = CoordinatorClient(learner.target, TOKEN, timeout_s=10)
    try:
        reg = client.register("fuzzer")
        run_id = learner.coordinator.run_id
        leases = client.lease(reg.actor_id, 8, 0).leases
        bases = [encode_group(make_group(run_id, reg.actor_id, lease, 0, g=2 + i, length=1 + 3 * i), TOKEN)
                 for i, lease in enumerate(leases)]
        # Return them: a mutation that happens to stay valid is then counted as `lease_not_active`.
        assert client.return_leases(reg.actor_id, [lease.lease_id for lease in leases]).num_returned == 8
        headers = bad_headers(msgpack.unpackb(bases[0][0], raw=False))
        big = [bases[0][0]] + [b"\0" * (CAP_BYTES // 3)] * 4  # over the total cap, each frame under it
        for _ in range(NUM_ZMQ_MESSAGES):
            frames = mutate(rng, rng.choice(bases), headers, big)
            push.send_multipart(frames, copy=False)
        buffer = learner.queue.buffer
        def settled(c: dict[str, int]) -> bool:
            return sum(v for k, v in c.items() if k.startswith("dropped/") or k in ("accepted", "filtered")) >= NUM_ZMQ_MESSAGES

        assert buffer.wait_until(settled, timeout_s=60), buffer.counts
        counts = learner.queue.counters()
        dropped = {k.split("/", 1)[1]: v for k, v in counts.items() if k.startswith("dropped/")}
        assert counts["received_messages"] == NUM_ZMQ_MESSAGES
        assert set(dropped) <= QUEUE_REASONS, set(dropped) - QUEUE_REASONS  # no internal_error
        assert sum(dropped.values()) == NUM_ZMQ_MESSAGES, counts
        assert counts.get("accepted", 0) == 0 and counts["depth_groups"] == 0
        assert len(dropped) >= 10, dropped  # the mutations reach most validation paths

        # gRPC: garbage bodies, out-of-range fields, wrong tokens, unknown methods.
        channel = grpc.insecure_channel(learner.target)
        methods = ["Register", "Heartbeat", "Lease", "ReturnLeases", "Leave", "Status", "GetWeightInfo", "FetchWeights"]
        good = ((AUTH_METADATA_KEY, TOKEN),)
        requests = [pb.LeaseRequest(actor_id=reg.actor_id, num_prompts=-5), pb.LeaseRequest(actor_id=-1, num_prompts=1),
                    pb.HeartbeatRequest(actor_id=reg.actor_id, weight_version=-3), pb.LeaveRequest(actor_id=99),
                    pb.RegisterRequest(actor_name="n" * 1000), pb.ReturnLeasesRequest(actor_id=7, lease_ids=[1] * 5000),
                    pb.FetchWeightsRequest(version=-1, offset_bytes=-7)]
        calls = 0
        for _ in range(NUM_GRPC_CALLS):
            method = rng.choice(methods)
            kind = rng.randrange(4)
            if kind == 0:
                body, metadata = rng.randbytes(rng.randrange(1, 40)), good
            elif kind == 1:
                request = rng.choice(requests)
                body, metadata, method = request.SerializeToString(), good, REQUEST_METHOD[type(request).__name__]
            elif kind == 2:
                body, metadata = b"", rng.choice(((), ((AUTH_METADATA_KEY, "nope"),), ((AUTH_METADATA_KEY, ""),)))
            else:
                body, metadata, method = b"", good, rng.choice(["Nope", "Register2", ""])
            stream = method == "FetchWeights"
            path = f"/dapo.v1.Coordinator/{method}"
            try:
                if stream:
                    list(channel.unary_stream(path)(body, timeout=10, metadata=metadata))
                else:
                    channel.unary_unary(path)(body, timeout=10, metadata=metadata)
            except grpc.RpcError as exc:
                assert exc.code() != grpc.StatusCode.INTERNAL, exc.details()
            calls += 1
        channel.close()
        rpc = {k: v for k, v in client.status().counters.items() if k.startswith("rpc/")}
        assert sum(rpc.values()) == calls + 3, rpc  # + Register, Lease, ReturnLeases above
        assert rpc["rpc/unauthenticated"] > 0 and rpc["rpc/invalid_argument"] > 0 and rpc["rpc/unimplemented"] > 0

        # Both services still work: a real group for a real lease is accepted.
        reg = client.register("after-fuzz")  # the fuzzer sent no heartbeats: it was declared dead
        lease = client.lease(reg.actor_id, 1, 0).leases
        assert lease, "coordinator stopped leasing"
        push.send_multipart(encode_group(make_group(run_id, reg.actor_id, lease[0], 0), TOKEN))
        assert buffer.wait_until(lambda c: c.get("accepted", 0) == 1, timeout_s=10)
    finally:
        push.close(linger=0)
        ctx.term()
        client.close()
        learner.close()
