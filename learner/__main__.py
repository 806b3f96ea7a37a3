"""``python -m learner [torchrun flags] [hydra overrides]`` == ``dapo learner ...``.

Runs torchrun with ``--nproc-per-node=learner.num_ranks`` as a child; each rank runs
``learner.main``. torchrun's own multi-node flags pass through unchanged. SIGTERM/SIGINT are
forwarded to the ranks (graceful stop with a final checkpoint, exit 0); a second one kills the
ranks and torchrun at once. A bind beyond loopback with the default auth token is refused here,
before anything starts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

HELP = """\
usage: dapo learner [TORCHRUN FLAGS] [HYDRA OVERRIDES]

Start the learner pool: learner.num_ranks ranks under torchrun (FSDP2; gloo on CPU, NCCL on GPU).
Rank 0 also serves the coordinator (gRPC, transport.grpc_port), the replay queue (ZeroMQ PULL,
transport.zmq_port) and the weight publisher (weights.backend, on weights.side_channel_port and,
for the collective, weights.collective_port).

Examples:
  dapo learner                                     # embedded default: tiny model, built-in task
  dapo learner learner.num_ranks=2 learner.total_steps=50 run.run_dir=runs/a
  dapo learner learner.resume=latest run.run_dir=runs/a          # continue a killed run
  dapo learner transport.host=0.0.0.0 transport.auth_token=SECRET  # accept remote actors
Multi-node (torchrun's flags, given before the overrides):
  dapo learner --nnodes=2 --node-rank=0 --rdzv-endpoint=HOST:29400 --rdzv-id=run1 learner.num_ranks=8
  (learner.num_ranks is the ranks per node; only global rank 0 serves actors.)

Stopping: Ctrl-C / SIGTERM stops at the next batch boundary: the final checkpoint is written, the
actors are told to leave (they return their leases), and the learner exits 0 with one line saying
so. A second Ctrl-C / SIGTERM kills the ranks at once (no final checkpoint; exit 1).
  --shell-exit-codes   exit 128 + the signal number (130 for SIGINT, 143 for SIGTERM) after a
                       requested stop instead of 0, as shells and some schedulers expect.

Security: with transport.host other than loopback (127.x, localhost, ::1) the default
transport.auth_token is refused at start-up; generate one with
  python -c "import secrets; print(secrets.token_hex(16))"

Writes run.run_dir: metrics.jsonl, trained_prompts.jsonl, tensorboard/, checkpoints/step_<N>/.
Every key is documented in dapo/config.py; `dapo config [overrides]` prints the resolved config.
"""

# torchrun flags that take a value (given as --flag VALUE or --flag=VALUE).
TORCHRUN_VALUE_FLAGS = {"--nnodes", "--node-rank", "--node_rank", "--rdzv-endpoint", "--rdzv_endpoint",
                        "--rdzv-id", "--rdzv_id", "--rdzv-backend", "--rdzv_backend", "--rdzv-conf", "--rdzv_conf",
                        "--master-addr", "--master_addr", "--master-port", "--master_port", "--max-restarts",
                        "--max_restarts", "--monitor-interval", "--monitor_interval", "--log-dir", "--log_dir",
                        "--redirects", "--tee", "--local-addr", "--local_addr", "--signals-to-handle",
                        "--signals_to_handle"}
TORCHRUN_SWITCHES = {"--standalone"}


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun flags, hydra overrides)."""
    torchrun, overrides, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in TORCHRUN_SWITCHES:
            torchrun.append(arg)
        elif name in TORCHRUN_VALUE_FLAGS:
            torchrun.append(arg)
            if "=" not in arg:
                torchrun.append(argv[i + 1])
                i += 1
        elif arg.startswith("--"):
            raise SystemExit(f"dapo learner: unknown flag {arg!r}; torchrun flags: "
                             f"{sorted(TORCHRUN_VALUE_FLAGS | TORCHRUN_SWITCHES)}; see --help")
        else:
            overrides.append(arg)
        i += 1
    return torchrun, overrides


SHELL_EXIT_CODES = "--shell-exit-codes"
"""Our own switch (not torchrun's): exit 128 + signal number after a requested stop."""


def main() -> None:
    argv = sys.argv[1:]
    if "-h" in argv or "--help" in argv:
        print(HELP)
        return
    # From here on a Ctrl-C is a stop request, never a KeyboardInterrupt traceback.
    received: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: received.append(signum))
    shell_exit_codes = SHELL_EXIT_CODES in argv
    argv = [a for a in argv if a != SHELL_EXIT_CODES]
    from dapo.config import ConfigError, load_config, public_bind_error
    from dapo.runtime import service_env

    torchrun, overrides = split_args(argv)
    try:
        cfg = load_config(overrides)
    except ConfigError as exc:
        print(f"dapo learner: {exc}", file=sys.stderr)
        raise SystemExit(2)
    refusal = public_bind_error(cfg.transport)
    if refusal:
        print(f"dapo learner: {refusal}", file=sys.stderr)
        raise SystemExit(2)
    if received:
        print(f"dapo learner: stopped ({signal_name(received[0])}) before starting anything", flush=True)
        raise SystemExit(128 + received[0] if shell_exit_codes else 0)
    if not any(a.split("=")[0] in ("--nnodes", "--rdzv-endpoint", "--rdzv_endpoint", "--master-addr",
                                   "--master_addr") for a in torchrun):
        torchrun.append("--standalone")  # single node: torchrun picks a free rendezvous port itself
    if not any(a.split("=")[0] in ("--signals-to-handle", "--signals_to_handle") for a in torchrun):
        torchrun.append("--signals-to-handle=SIGHUP,SIGQUIT")  # not SIGINT/SIGTERM: see run_torchrun
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.learner.num_ranks}", *torchrun,
           "-m", "learner.main", *overrides]
    rc = run_torchrun(cmd, {**os.environ, **service_env()}, received, cfg.run.run_dir)
    raise SystemExit(128 + received[0] if received and rc == 0 and shell_exit_codes else rc)


def run_torchrun(cmd: list[str], env: dict[str, str], received: list[int], run_dir: str) -> int:
    """Run torchrun as a child; a SIGTERM/SIGINT (appended to ``received`` by main's handler) goes
    to the ranks themselves, a second one kills everything at once (exit 1).

    torchrun turns a SIGTERM or SIGINT into a failed run (a SignalException traceback, exit 1,
    SIGKILL of the ranks after 30 s), and a Ctrl-C in a terminal reaches torchrun too (same
    process group), so torchrun ignores both: it starts with them ignored and its agent does not
    install handlers for them (``--signals-to-handle``). Signalled by this process, the
    ranks stop at the next batch boundary, write a final checkpoint and exit 0, and torchrun then
    exits 0. torchrun dies with this process (PR_SET_PDEATHSIG), and the ranks die with torchrun
    (learner.main), so a kill -9 here leaves nothing behind.
    """
    from dapo.runtime import die_with_parent

    def preexec() -> None:
        die_with_parent()
        for sig in (signal.SIGINT, signal.SIGTERM):  # ignored dispositions survive exec
            signal.signal(sig, signal.SIG_IGN)

    proc = subprocess.Popen(cmd, env=env, preexec_fn=preexec)
    signalled: set[int] = set()
    while True:
        try:
            return proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        if len(received) > 1:
            return kill_now(proc, received[1], run_dir)
        if received:
            forward(proc, received[0], signalled)


def forward(proc: subprocess.Popen, signum: int, signalled: set[int]) -> None:
    """Send ``signum`` once to each rank (torchrun's children) that handles it. A rank inherits
    torchrun's ignored SIGINT/SIGTERM until learner.main installs its stop handler: signalled
    earlier it would drop the request, so a starting rank is signalled on a later call."""
    import psutil

    try:
        ranks = psutil.Process(proc.pid).children()
    except psutil.NoSuchProcess:
        return
    for rank in ranks:
        if rank.pid in signalled or not catches(rank.pid, signum):
            continue
        try:
            rank.send_signal(signum)
        except psutil.NoSuchProcess:
            pass
        signalled.add(rank.pid)


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (Linux: SigCgt in /proc; else assume so)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(line.split()[1] for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return True
    return bool(int(mask, 16) >> (signum - 1) & 1)


def kill_now(proc: subprocess.Popen, signum: int, run_dir: str) -> int:
    """Second signal: SIGKILL torchrun and every rank now; one line; exit 1 (nothing was saved)."""
    import psutil

    from learner.checkpoint import latest_checkpoint

    try:
        procs = [psutil.Process(proc.pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)
    proc.wait()
    latest = latest_checkpoint(run_dir)
    print(f"dapo learner: stopped at once (second {signal_name(signum)}): killed torchrun and {len(procs) - 1} "
          f"rank process(es); no final checkpoint (latest: {latest or 'none'})", flush=True)
    return 1


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


if __name__ == "__main__":
    main()
