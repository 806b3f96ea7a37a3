"""``python -m learner [torchrun flags] [hydra overrides]`` == ``dapo learner ...``.

Runs torchrun with ``--nproc-per-node=learner.num_ranks`` as a child; each rank runs
``learner.main``. torchrun's own multi-node flags pass through unchanged. SIGTERM/SIGINT are
forwarded to the ranks (graceful stop with a final checkpoint, exit 0).
"""

from __future__ import annotations

import os
import sys

HELP = """\
usage: dapo learner [TORCHRUN FLAGS] [HYDRA OVERRIDES]

Start the learner pool: learner.num_ranks ranks under torchrun (FSDP2; gloo on CPU, NCCL on GPU).
Rank 0 also serves the coordinator (gRPC, transport.grpc_port), the replay queue (ZeroMQ PULL,
transport.zmq_port) and the weight publisher (raw TCP side channel transport.weight_port, or the
collective group on transport.collective_port with transport.weight_path=collective).

Examples:
  dapo learner                                     # embedded default: tiny model, built-in task
  dapo learner learner.num_ranks=2 learner.total_steps=50 run.run_dir=runs/a
  dapo learner learner.resume=latest run.run_dir=runs/a          # continue a killed run
  dapo learner transport.host=0.0.0.0 transport.auth_token=SECRET  # accept remote actors
Multi-node (torchrun's flags, given before the overrides):
  dapo learner --nnodes=2 --node-rank=0 --rdzv-endpoint=HOST:29400 --rdzv-id=run1 learner.num_ranks=8
  (learner.num_ranks is the ranks per node; only global rank 0 serves actors.)

Writes run.run_dir: metrics.jsonl, trained_prompts.jsonl, tensorboard/, checkpoints/step_<N>/.
Every key is documented in dapo/config.py; `dapo config [overrides]` prints the resolved config.
"""

# torchrun flags that take a value (given as --flag VALUE or --flag=VALUE).
TORCHRUN_VALUE_FLAGS = {"--nnodes", "--node-rank", "--node_rank", "--rdzv-endpoint", "--rdzv_endpoint",
                        "--rdzv-id", "--rdzv_id", "--rdzv-backend", "--rdzv_backend", "--rdzv-conf", "--rdzv_conf",
                        "--master-addr", "--master_addr", "--master-port", "--master_port", "--max-restarts",
                        "--max_restarts", "--monitor-interval", "--monitor_interval", "--log-dir", "--log_dir",
                        "--redirects", "--tee", "--local-addr", "--local_addr"}
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


def main() -> None:
    argv = sys.argv[1:]
    if "-h" in argv or "--help" in argv:
        print(HELP)
        return
    from dapo.config import ConfigError, load_config
    from dapo.runtime import service_env

    torchrun, overrides = split_args(argv)
    try:
        cfg = load_config(overrides)
    except ConfigError as exc:
        print(f"dapo learner: {exc}", file=sys.stderr)
        raise SystemExit(2)
    if not any(a.split("=")[0] in ("--nnodes", "--rdzv-endpoint", "--rdzv_endpoint", "--master-addr",
                                   "--master_addr") for a in torchrun):
        torchrun.append("--standalone")  # single node: torchrun picks a free rendezvous port itself
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.learner.num_ranks}", *torchrun,
           "-m", "learner.main", *overrides]
    raise SystemExit(run_torchrun(cmd, {**os.environ, **service_env()}))


def run_torchrun(cmd: list[str], env: dict[str, str]) -> int:
    """Run torchrun as a child; SIGTERM/SIGINT go to the ranks themselves.

    torchrun turns a SIGTERM into a failed run (exit 1, SIGKILL after 30 s). Signalling the ranks
    instead lets them stop at the next batch boundary, write a final checkpoint and exit 0, and
    torchrun then exits 0. torchrun dies with this process (PR_SET_PDEATHSIG), and the ranks die
    with torchrun (learner.main), so a kill -9 here leaves nothing behind.
    """
    import signal
    import subprocess

    import psutil

    from learner.main import die_with_parent

    proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent)

    def forward(signum: int, _frame: object) -> None:
        try:
            ranks = psutil.Process(proc.pid).children()
        except psutil.NoSuchProcess:
            return
        for rank in ranks:
            try:
                rank.send_signal(signum)
            except psutil.NoSuchProcess:
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return proc.wait()


if __name__ == "__main__":
    main()
