"""``python -m learner [torchrun flags] [hydra overrides]`` == ``dapo learner ...``.

Re-executes itself under torchrun with ``--nproc-per-node=learner.num_ranks``; each rank runs
``learner.main``. torchrun's own multi-node flags pass through unchanged.
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
    # exec: signals (Ctrl-C, SIGTERM from `dapo run`) go straight to torchrun, which forwards them.
    os.execvpe(sys.executable, cmd, {**os.environ, **service_env()})


if __name__ == "__main__":
    main()
