"""`dapo run`: a learner and N actors as separate local processes, with a live progress view.

    dapo run [overrides]
      ├─ builds the embedded tiny model once (model.path=builtin:tiny) so children never race
      ├─ picks free ports for any port given as 0, so that learner and actors start together
      ├─ writes the resolved config (model path, ports) to <run_dir>/config.resolved.json
      ├─ python -m learner.main --config FILE   (one rank: no torchrun process in between)
      │  python -m dapo.launch.learner_pool --config FILE   (W > 1 ranks: torchrun, signal forwarding)
      ├─ python -m actors --learner H:P <config>   × run.num_actors   (concurrently with the learner)
      ├─ tails <run_dir>/metrics.jsonl → progress bar (step, version, accuracy, reward, ...);
      │  off a terminal a plain line every run.progress_every_steps steps instead
      ├─ prints the start-up breakdown once the first step is trained
      └─ at the end: stop actors, PNG of the curves, HF export; the last line: time to target

Every child runs in its own session with a parent-death signal, so Ctrl-C (or a kill of this
process) never leaves orphans: actors get SIGTERM first (they return their leases), then the
learner (it writes its final checkpoint), then anything left is killed by process group. A
Ctrl-C while the run is stopping (a second one, or one during the curves and the export) kills
every child at once (dapo/launch/stopping.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from dapo.config import DapoConfig, make_run_dir, save_resolved
from dapo.launch import latest_checkpoint, reserve_port, resolve_config, signal_on_parent_death, spawn, token_env
from dapo.launch.stopping import StopRequests
from dapo.rundir import claim_or_exit
from dapo.runtime import apply_service_env

HELP = """\
Start a learner and run.num_actors actors on this machine and train until learner.total_steps
(or run.max_wall_time_s, or run.target_accuracy with run.stop_at_target=true).
Everything after the flags is a Hydra override, e.g.
  dapo run run.num_actors=2 learner.num_ranks=2 algorithm.max_staleness_steps=2
Writes run.run_dir: config.resolved.json, metrics.jsonl, curves.png, tensorboard/, checkpoints/, hf/, logs/.
Each run gets a folder of its own: by default runs/<date>-<time>, with runs/latest pointing to the
newest; a run.run_dir=FOLDER that holds another run is refused unless learner.resume=latest continues
it or run.overwrite=true replaces it.
Data, model, resume target and optional packages are checked before anything starts (exit 2, one line).
Progress: a live line on a terminal; elsewhere (nohup, SLURM, CI) a plain line every
run.progress_every_steps steps. Ctrl-C stops gracefully (actors return their leases, the learner writes
its final checkpoint, then curves and the HF export); a second Ctrl-C stops at once (exit 1).
"""

STOP_GRACE_S = 30.0
PORT_KEYS = {"transport": ("grpc_port", "zmq_port"), "weights": ("side_channel_port", "collective_port")}
REGISTERED_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) actor INFO actors.loop: registered as", re.M)
EXCEPTION_LINE = re.compile(r"^\[rank\d+\]: [\w.]*(Error|Exception|Stalled)\w*: ")


class Child:
    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self._terminated = False
        # A session of its own (its process group is killed as one), and SIGTERM when the launcher dies.
        self.proc = spawn(argv, lambda: signal_on_parent_death(signal.SIGTERM), env, start_new_session=True,
                          stdout=self._log, stderr=subprocess.STDOUT)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        """SIGTERM, once: a second one stops a service at once, without its graceful exit."""
        if self.alive() and not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM the child itself (`dapo learner` forwards it to its ranks, which write a final
        checkpoint; signalling torchrun directly would make it exit 1), wait up to grace_s, then
        SIGKILL the child's whole process group (torchrun's workers share it: none survives)."""
        self.terminate()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        self._log.close()
        return self.proc.returncode


class Progress:
    """Tails metrics.jsonl: on a terminal one live line redrawn per update (tqdm); elsewhere (nohup,
    SLURM, CI logs), where each redraw would append a carriage return to one endless line, a plain
    line every ``every_steps`` trained steps and at the last."""

    def __init__(self, metrics_path: Path, total_steps: int, every_steps: int = 10, stream=None,
                 since_unix_s: float = 0.0) -> None:
        """``since_unix_s``: plain lines for records of this start only (a resumed run's file holds its history)."""
        from tqdm import tqdm

        self.path = metrics_path
        self.offset = 0
        self.records: list[dict] = []
        self.stream = stream or sys.stderr
        self.plain = not self.stream.isatty()
        self.total_steps, self.every_steps, self.t0 = total_steps, every_steps, time.monotonic()
        self.since_unix_s = since_unix_s
        self.bar = tqdm(total=total_steps or None, unit="step", dynamic_ncols=True, desc="dapo run",
                        file=self.stream, disable=self.plain)

    def poll(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        # Only consume complete lines: the learner may be mid-write.
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        new = [json.loads(line) for line in chunk[:end].splitlines() if line.strip()]
        for rec in new:
            self.records.append(rec)
            if self.plain:
                self.plain_line(rec)
                continue
            self.bar.update(max(0, int(rec["step"]) - self.bar.n))
            self.bar.set_postfix_str(self.postfix(rec), refresh=False)
        if new and not self.plain:
            self.bar.refresh()
        return new

    def plain_line(self, rec: dict) -> None:
        step = int(rec["step"])
        due = step % self.every_steps == 0 or step == self.total_steps
        if "time/step_s" in rec and due and rec.get("unix_time_s", self.since_unix_s) >= self.since_unix_s:
            total = f"/{self.total_steps}" if self.total_steps else ""
            print(f"dapo run: step {step}{total} {self.postfix(rec)} ({time.monotonic() - self.t0:.0f} s)",
                  file=self.stream, flush=True)

    def write(self, text: str) -> None:
        """A message line that leaves the live line intact below it."""
        self.bar.write(text, file=self.stream)

    def last(self, key: str) -> float | None:
        return progress_last(self.records, key)

    def postfix(self, rec: dict) -> str:
        def fmt(key: str, spec: str) -> str:
            value = rec.get(key, self.last(key))
            return "-" if value is None else format(value, spec)

        return (f"v={fmt('version', '.0f')} acc={fmt('train/accuracy', '.2f')} "
                f"eval={fmt('eval/accuracy', '.2f')} R={fmt('train/reward', '+.2f')} "
                f"stale={fmt('staleness/mean_steps', '.2f')} tok/s={fmt('throughput/tokens_per_s', '.0f')} "
                f"actors={fmt('actors/alive', '.0f')}")


def main(argv: list[str] | None = None) -> int:
    apply_service_env()
    parser = argparse.ArgumentParser(prog="dapo run", description=HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (see `dapo config`)")
    args = parser.parse_args(argv)
    started_unix_s = time.time()
    stop = StopRequests("dapo run", "the actors return their leases, the learner writes its final checkpoint, then "
                        "the curves and the HF export", lambda: f"no export; latest checkpoint: "
                        f"{latest_checkpoint(run_dir) or 'none'}").install()
    stop.stopping = True  # until the children run there is nothing to stop gracefully: a Ctrl-C exits now
    cfg, config_path = prepare(args.overrides)
    run_dir = Path(cfg.run.run_dir)

    learner_argv, learner_env = learner_command(cfg.learner.num_ranks, config_path)
    # The token goes to every child in its environment: the config file they read holds none.
    learner = Child("learner", learner_argv, run_dir / "logs", {**learner_env, **token_env(cfg)})
    # The ports are known before the learner is up: actors start now and register as soon as the
    # coordinator answers (they retry while it does not), instead of waiting for it to be ready.
    addr = f"{_connect_host(cfg.transport.host)}:{cfg.transport.grpc_port}"
    actors = [Child(f"actor{i}", actor_command(addr, config_path, cfg.actor.seed + i), run_dir / "logs",
                    token_env(cfg)) for i in range(cfg.run.num_actors)]
    for child in (learner, *actors):
        stop.watch(child.proc.pid, child.name)
    stop.stopping = False
    spawned_unix_s = time.time()
    print(f"dapo run: learner pid {learner.proc.pid}, actors {[a.proc.pid for a in actors]}; "
          f"logs in {run_dir / 'logs'}", file=sys.stderr)

    progress = Progress(run_dir / "metrics.jsonl", cfg.learner.total_steps, cfg.run.progress_every_steps,
                        since_unix_s=started_unix_s)
    try:
        watch(stop, progress, learner, actors, cfg, started_unix_s, spawned_unix_s)
    finally:
        stop.stopping = True  # a Ctrl-C from here on (leaving, checkpoint, curves, export) stops at once
        # Actors first (they return their leases), all at once, then the learner (final checkpoint).
        for child in actors:
            child.terminate()
        for child in actors:
            child.stop(STOP_GRACE_S)
        learner_rc = learner.stop(STOP_GRACE_S)
        progress.poll()
        progress.bar.close()
    print(f"dapo run: stopped: {stop.why}", file=sys.stderr)
    if learner_rc not in (0, None) and not stop.why.startswith(("SIG", "run.", "eval/")):
        print(f"dapo run: the learner failed; the end of {learner.log_path}:\n{_error_tail(learner.log_path)}",
              file=sys.stderr)
    actors_failed = stop.why.startswith(EVERY_ACTOR_FAILED)
    if actors_failed:
        print(f"dapo run: {actors[0].name}'s error ({actors[0].log_path}):\n{_actor_error(actors[0].log_path)}",
              file=sys.stderr)
    rc = _finish(run_dir, progress.records, cfg, learner_rc, started_unix_s, stop)
    return 1 if actors_failed else rc


EVERY_ACTOR_FAILED = "every actor failed"


def watch(stop: StopRequests, progress: Progress, learner: Child, actors: list[Child], cfg: DapoConfig,
          started_unix_s: float, spawned_unix_s: float) -> None:
    """Show progress until something stops the run (``stop.why``): the learner's exit, a limit, the
    target, a signal, or every actor failing (nobody is left to generate: the learner would wait for
    batches until learner.batch_wait_timeout_s)."""
    t0, startup_shown = time.monotonic(), False
    while not stop.why:
        progress.poll()
        # This start's records only: a resumed run's metrics.jsonl holds its whole history.
        ours = [r for r in progress.records if r.get("unix_time_s", 0) >= started_unix_s]
        if not startup_shown and any("time/step_s" in r for r in ours):
            startup_shown = True
            progress.write(startup_breakdown(Path(cfg.run.run_dir), ours, started_unix_s, spawned_unix_s))
        if not learner.alive():
            stop.why = f"learner exited ({learner.proc.returncode})"
        elif cfg.run.max_wall_time_s and time.monotonic() - t0 > cfg.run.max_wall_time_s:
            stop.why = f"run.max_wall_time_s={cfg.run.max_wall_time_s:g} reached"
        elif cfg.run.stop_at_target and (progress.last("eval/accuracy") or 0) >= cfg.run.target_accuracy:
            stop.why = f"eval/accuracy reached run.target_accuracy={cfg.run.target_accuracy}"
        for actor in actors:
            if not actor.alive() and not getattr(actor, "reported", False):
                actor.reported = True
                rc = actor.proc.returncode
                progress.write(f"dapo run: {actor.name} left the run (exit 0)" if rc == 0
                               else f"dapo run: {actor.name} exited ({rc}); see {actor.log_path}")
        failed = [a for a in actors if not a.alive() and a.proc.returncode != 0]
        if actors and len(failed) == len(actors) and not stop.why:
            stop.why = f"{EVERY_ACTOR_FAILED}: " + ", ".join(f"{a.name} exit {a.proc.returncode}" for a in failed)
        time.sleep(0.5)  # UI refresh period, not synchronisation


def prepare(overrides: list[str]) -> tuple[DapoConfig, Path]:
    """The run's config, composed once and completed (the model folder, a free port for each port
    given as 0), and the file it was written to for the learner; a fresh run folder (0700 when new)."""
    cfg = resolve_config("dapo run", overrides, starts_actors=True)  # checked before any folder is claimed
    cfg = claim_or_exit(cfg, "dapo run")  # a new folder, or its own run's
    run_dir = make_run_dir(cfg.run.run_dir)
    (run_dir / "logs").mkdir(exist_ok=True)
    cfg = with_learner_threads(with_free_ports(cfg))
    return cfg, save_resolved(cfg)


def with_learner_threads(cfg):
    """``cfg`` with ``learner.num_threads`` given as 0 (auto) decided for a learner that shares this
    machine with the run's actors: the CPUs left after one per actor (a vLLM or torch actor runs one
    thread), divided among the ranks, at least 1. On 2 cores beside one vLLM actor a SmolLM2 learner
    with 2 threads ran no faster end to end than with 1 (bench/RESULTS.md "Learner threads"): the
    actor generates about half of each step, and the second thread slows it as much as it speeds
    the learner. ``dapo learner`` alone counts every CPU as the learner's (dapo.runtime.learner_threads)."""
    if cfg.learner.num_threads:
        return cfg
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, (cpus - cfg.run.num_actors) // cfg.learner.num_ranks)
    return replace(cfg, learner=replace(cfg.learner, num_threads=threads))


def _finish(run_dir: Path, records: list[dict], cfg, learner_rc: int | None, started_unix_s: float,
            stop: StopRequests | None = None) -> int:
    from dapo.plots import plot_run

    if records:
        png = plot_run(records, run_dir / "curves.png", title=f"dapo run — {cfg.algorithm.name}")
        print(f"dapo run: curves in {png}", file=sys.stderr)
    ckpt = latest_checkpoint(run_dir)
    if ckpt:
        out = run_dir / "hf"
        # It takes seconds (a Python with torch, the checkpoint read): say so, and how to skip it.
        print(f"dapo run: writing the HF export of {ckpt.name} to {out} (Ctrl-C skips it; `dapo export {ckpt} "
              f"OUT` writes one later)", file=sys.stderr, flush=True)
        # A session of its own: a terminal's Ctrl-C reaches `dapo run` alone, which kills it (``stop``).
        export = spawn([sys.executable, "-m", "learner.export", str(ckpt), str(out)],
                       lambda: signal_on_parent_death(signal.SIGTERM), start_new_session=True)
        if stop is not None:
            stop.watch(export.pid, "the export")
        rc = export.wait()
        print(f"dapo run: HF export of {ckpt.name} in {out}" if rc == 0
              else f"dapo run: export failed (exit {rc})", file=sys.stderr)
    if records:  # the last line: what a user looks for first
        print(target_line(records, cfg.run.target_accuracy, started_unix_s) + groups_suffix(records), file=sys.stderr)
    return 0 if learner_rc == 0 else 1


def target_line(records: list[dict], target: float, started_unix_s: float) -> str:
    from dapo.plots import time_to_target

    if not any("eval/accuracy" in r for r in records):  # learner.eval_every_steps=0: say what there is
        steps = [r for r in records if "time/step_s" in r]
        batch = progress_last(records, "train/accuracy")
        return (f"dapo run: {len(steps)} step(s) trained, no held-out evaluation (learner.eval_every_steps=0)"
                + (f"; the last batch's accuracy {batch:.3f}" if batch is not None else ""))
    hit = time_to_target(records, "eval/accuracy", target)
    first = next((r["eval/accuracy"] for r in records if "eval/accuracy" in r), None)
    last = progress_last(records, "eval/accuracy")
    if not hit:
        return f"dapo run: eval accuracy {first} -> {last}; target {target} not reached"
    wall_s = _unix_time_at_step(records, hit[0], 'eval/accuracy') - started_unix_s
    if wall_s < 0:  # a resumed run that had reached it before this start
        return f"dapo run: eval accuracy {first} -> {last}; target {target} reached at step {hit[0]:.0f}, before the resume"
    return (f"dapo run: eval accuracy {first} -> {last}; target {target} reached at step {hit[0]:.0f} in "
            f"{wall_s:.1f} s of wall time from `dapo run` ({hit[1]:.0f} s into training)")


def groups_suffix(records: list[dict]) -> str:
    """'; N groups generated for M trained (...)' from the last step record's coordinator counters
    (dapo.selection.summary), '' when no record has them."""
    from dapo.selection import summary

    last = next((r for r in reversed(records) if "coordinator/groups_trained" in r), None)
    text = summary({k.removeprefix("coordinator/"): v for k, v in last.items()}) if last else ""
    return f"; {text}" if text else ""


def with_free_ports(cfg):
    """``cfg`` with every port given as 0 replaced by a port that is free now. The learner
    binds them a moment later (another process could take one in between: the learner then fails
    to bind and says so); knowing them up front lets the actors start alongside the learner."""
    chosen, holders = {section: {} for section in PORT_KEYS}, []
    for section, keys in PORT_KEYS.items():
        for key in (k for k in keys if getattr(getattr(cfg, section), k) == 0):
            holders.append(reserve_port(_connect_host(cfg.transport.host)))  # held: no two keys share a port
            chosen[section][key] = holders[-1].getsockname()[1]
    for sock in holders:
        sock.close()
    return replace(cfg, **{section: replace(getattr(cfg, section), **ports) for section, ports in chosen.items()})


def _connect_host(host: str) -> str:
    """Where local actors reach a learner bound to ``host`` (a wildcard bind is reached on loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def learner_command(num_ranks: int, config_path: Path) -> tuple[list[str], dict[str, str]]:
    """(argv, extra env) of the learner, given the resolved config. One rank runs ``learner.main``
    directly with the environment torchrun would give it: torchrun is a whole Python process with its
    own torch import (~2 s of CPU on a 2-core machine, before the rank even starts) that only waits on
    one child. Several ranks go through ``dapo learner`` (torchrun, signal forwarding)."""
    if num_ranks > 1:
        return [sys.executable, "-m", "dapo.launch.learner_pool", "--config", str(config_path)], {}
    with reserve_port("127.0.0.1") as master:
        port = master.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return [sys.executable, "-m", "learner.main", "--config", str(config_path)], env


def actor_command(learner_addr: str, config_path: Path, seed: int) -> list[str]:
    """`dapo actor` on the launcher's resolved config (no compose of its own) with its own sampling seed."""
    return [sys.executable, "-m", "actors", "--learner", learner_addr, "--config", str(config_path), f"actor.seed={seed}"]


def startup_breakdown(run_dir: Path, records: list[dict], started_unix_s: float, spawned_unix_s: float) -> str:
    """One line: when each start-up milestone happened, in seconds after `dapo run` started."""
    def at(t: float | None) -> str:
        return "-" if t is None else f"{t - started_unix_s:.1f} s"

    ready = next((r["unix_time_s"] for r in records if r.get("step") == 0 and "unix_time_s" in r), None)
    # A reused run_dir keeps earlier runs' logs (appended to): only what happened after this start counts.
    logs = [log.read_text(errors="replace") for log in (run_dir / "logs").glob("actor*.log")]
    registered = [t for log in logs for stamp in REGISTERED_LINE.findall(log)
                  if (t := datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()) >= started_unix_s]
    groups = [json.loads(line)["unix_time_s"] for path in (run_dir / "logs").glob("generations-*.jsonl")
              for line in path.read_text().split("\n")[:-1]]  # complete lines only: the actor may be writing
    first_group = min((t for t in groups if t >= started_unix_s), default=None)
    first_step = next((r["unix_time_s"] for r in records if "time/step_s" in r), None)
    return (f"dapo run: start-up: children started {at(spawned_unix_s)}, learner serving version 0 {at(ready)}, "
            f"first actor registered {at(min(registered, default=None))}, first lease generated {at(first_group)}, "
            f"first step trained {at(first_step)} (after `dapo run` started)")


def _actor_error(log_path: Path) -> str:
    """An actor's last ERROR line (actors/main.py logs one on every failure), else its last line."""
    lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    errors = [ln for ln in lines if " ERROR " in ln]
    return (errors or lines or ["(empty log)"])[-1]


def _error_tail(log_path: Path, max_lines: int = 3) -> str:
    """The learner's own error lines (torchrun's wrapper traceback that follows is noise)."""
    lines = log_path.read_text(errors="replace").splitlines()
    errors = [ln for ln in lines if EXCEPTION_LINE.match(ln)]
    return "\n".join((errors or lines)[-max_lines:])


def _unix_time_at_step(records: list[dict], step: float, key: str) -> float:
    """When the record of ``step`` with ``key`` was known: its evaluation's end when it has one
    (the learner evaluates in the background, after the step's own time)."""
    rec = next(r for r in records if r["step"] == step and key in r and "unix_time_s" in r)
    return float(rec.get("time/eval_done_unix_s", rec["unix_time_s"]))


def progress_last(records: list[dict], key: str) -> float | None:
    return next((float(r[key]) for r in reversed(records) if key in r), None)


if __name__ == "__main__":
    sys.exit(main())
