"""``dapo learner [torchrun flags] [hydra overrides]``: composes the config once, writes it to
``<run.run_dir>/config.resolved.json`` and runs torchrun with ``--nproc-per-node=learner.num_ranks``
as a child; each rank runs ``learner.main --config`` that file. torchrun's own multi-node flags pass
through unchanged. SIGTERM/SIGINT are forwarded to the ranks (graceful stop with a final checkpoint,
exit 0); a second one kills the ranks and torchrun at once. A bind beyond loopback with the default
auth token is refused here, before anything starts.

Multi-node (``--rdzv-endpoint`` or ``--master-addr`` given): gloo, left to itself, binds its full mesh
to the address this host's name resolves to, on many machines a loopback one (``127.0.1.1 host`` in
/etc/hosts), so the other nodes' ranks are told to connect to 127.x and fail ("Gloo connectFullMesh
failed ... remote=[127.0.0.1]"). So the ranks get ``GLOO_SOCKET_IFNAME`` = the interface of this
node's route to the rendezvous host: the one holding the source address the kernel picks for it
(on the rendezvous host itself, the interface holding the endpoint's address). A
``GLOO_SOCKET_IFNAME`` already in the environment wins (collectives on another network). NCCL picks
its own interfaces (``NCCL_SOCKET_IFNAME``) and is left alone.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Mapping

from dapo.config import DapoConfig, save_resolved
from dapo.launch import die_with_parent, kill_tree, latest_checkpoint, resolve_config, spawn, token_env
from dapo.rundir import LATEST, claim_or_exit
from protos.net import route_source_address

HELP = """\
usage: dapo learner [TORCHRUN FLAGS] [--shell-exit-codes] [HYDRA OVERRIDES | --config FILE]

Start the learner pool: learner.num_ranks ranks under torchrun (FSDP2; gloo on CPU, NCCL on GPU).
Rank 0 also serves the coordinator (gRPC, transport.grpc_port), the replay queue (ZeroMQ PULL,
transport.zmq_port) and the weight publisher (weights.backend, on weights.side_channel_port and,
for the collective, weights.collective_port).

Examples:
  dapo learner                                     # embedded default: tiny model, built-in task
  dapo learner learner.num_ranks=2 learner.total_steps=50 run.run_dir=runs/a
  dapo learner learner.resume=latest run.run_dir=runs/a          # continue a killed run
  DAPO_TOKEN=SECRET dapo learner transport.host=0.0.0.0       # accept remote actors (a token of your own)
  dapo learner --config FILE.json   # a resolved config as a launcher writes it, no overrides (its
                                    # run.run_dir obeys the same rules: new, or learner.resume set)
Multi-node (torchrun's flags, given before the overrides):
  dapo learner --nnodes=2 --node-rank=0 --rdzv-endpoint=HOST:29400 --rdzv-id=run1 learner.num_ranks=8
  (learner.num_ranks is the ranks per node; only global rank 0 serves actors.) Each node's ranks run
  their collectives (gloo) over the interface of its route to the rendezvous host; set
  GLOO_SOCKET_IFNAME=IFACE to use another.

Stopping: Ctrl-C / SIGTERM stops at the next batch boundary: the final checkpoint is written, the
actors are told to leave (they return their leases), and the learner exits 0 with one line saying
so. A second Ctrl-C / SIGTERM kills the ranks at once (no final checkpoint; exit 1).
  --shell-exit-codes   exit 128 + the signal number (130 for SIGINT, 143 for SIGTERM) after a
                       requested stop instead of 0, as shells and some schedulers expect.

Security: with transport.host other than loopback (127.x, localhost, ::1) the default
transport.auth_token is refused at start-up; generate one with
  python -c "import secrets; print(secrets.token_hex(16))"
and give it in the environment (DAPO_TOKEN=...) or in a file only you can read
(transport.auth_token_file=FILE, chmod 600 FILE), never as transport.auth_token=... on the command
line, where every user of the machine can read it (refused beyond loopback, a warning on it).

Writes run.run_dir: config.resolved.json, metrics.jsonl, trained_prompts.jsonl, tensorboard/, checkpoints/.
The default run.run_dir=runs/latest makes a new folder runs/<date>-<time> and points runs/latest to it
(with learner.resume set: continues the run it points to). A folder that holds another run is refused
unless learner.resume=latest continues it (one history: metrics, audit and curves span the whole run)
or run.overwrite=true replaces it.
Every key is documented in dapo/config/ (a module per section); `dapo config [overrides]` prints the resolved config.
"""

# torchrun flags that take a value (given as --flag VALUE or --flag=VALUE; torchrun takes '_' for '-').
TORCHRUN_VALUE_FLAGS = {"--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id", "--rdzv-backend", "--rdzv-conf",
                        "--master-addr", "--master-port", "--max-restarts", "--monitor-interval", "--log-dir",
                        "--redirects", "--tee", "--local-addr", "--signals-to-handle"}
TORCHRUN_SWITCHES = {"--standalone"}


def split_args(argv: list[str]) -> tuple[list[str], list[str], str]:
    """(torchrun flags, hydra overrides, the --config file or '')."""
    torchrun, overrides, config, i = [], [], "", 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0].replace("_", "-")
        if name in TORCHRUN_SWITCHES:
            torchrun.append(arg)
        elif name in TORCHRUN_VALUE_FLAGS:
            torchrun.append(arg)
            if "=" not in arg:
                torchrun.append(argv[i + 1])
                i += 1
        elif name == "--config":
            config = arg.split("=", 1)[1] if "=" in arg else argv[i + 1]
            i += "=" not in arg
        elif arg.startswith("--"):
            raise SystemExit(f"dapo learner: unknown flag {arg!r}; torchrun flags: "
                             f"{sorted(TORCHRUN_VALUE_FLAGS | TORCHRUN_SWITCHES)}; see --help")
        else:
            overrides.append(arg)
        i += 1
    if config and overrides:
        raise SystemExit(f"dapo learner: --config {config} is the whole config; drop the overrides {overrides}")
    return torchrun, overrides, config


SHELL_EXIT_CODES = "--shell-exit-codes"
"""Our own switch (not torchrun's): exit 128 + signal number after a requested stop."""


def main() -> None:
    argv = sys.argv[1:]
    if "-h" in argv or "--help" in argv:
        print(HELP)
        return
    # From here on a Ctrl-C is a stop request, never a KeyboardInterrupt traceback.
    received: list[int] = []
    started: list[bool] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)
        if len(received) > 1 and not started:  # during start-up (a model build, a fetch): at once, unwinding
            print(f"dapo learner: stopped at once (second {signal.Signals(signum).name}) before starting anything",
                  flush=True)
            raise SystemExit(1)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    shell_exit_codes = SHELL_EXIT_CODES in argv
    torchrun, overrides, config = split_args([a for a in argv if a != SHELL_EXIT_CODES])
    cfg = claim_run_dir(resolve_config("dapo learner", overrides, config), torchrun)
    if received:
        print(f"dapo learner: stopped ({signal.Signals(received[0]).name}) before starting anything", flush=True)
        raise SystemExit(128 + received[0] if shell_exit_codes else 0)
    env, note = collective_env(torchrun, os.environ)
    if note:
        print(f"dapo learner: {note}", flush=True)
    # The ranks read the written config, which holds no token: it reaches them in their environment.
    started.append(True)  # a second signal from here on: run_torchrun kills torchrun and the ranks
    rc = run_torchrun(torchrun_command(cfg, torchrun), received, cfg.run.run_dir, {**env, **token_env(cfg)})
    raise SystemExit(128 + received[0] if received and rc == 0 and shell_exit_codes else rc)


def claim_run_dir(cfg: DapoConfig, torchrun: list[str]) -> DapoConfig:
    """``cfg`` with the run folder claimed (dapo/rundir.py) by one node only: the one with ``--node-rank``
    0 (or none given); the others write their shards where it says. Several nodes need a folder
    named by the user: each would make a versioned folder of its own from ``runs/latest``."""
    nodes = {a.split("=")[0].replace("_", "-") for a in torchrun} & {"--nnodes", "--rdzv-endpoint", "--master-addr"}
    if nodes and Path(cfg.run.run_dir).name == LATEST:
        print(f"dapo learner: several nodes ({', '.join(sorted(nodes))}) need one run folder on storage they all "
              f"share: pass run.run_dir=FOLDER (the same on every node)", file=sys.stderr)
        raise SystemExit(2)
    return claim_or_exit(cfg, "dapo learner") if flag_value(torchrun, "--node-rank") in (None, "0") else cfg


def torchrun_command(cfg: DapoConfig, torchrun: list[str]) -> list[str]:
    """torchrun, its ranks running ``learner.main --config`` the resolved config (written now)."""
    given = {a.split("=")[0].replace("_", "-") for a in torchrun}
    if not given & {"--nnodes", "--rdzv-endpoint", "--master-addr"}:
        torchrun = [*torchrun, "--standalone"]  # single node: torchrun picks a free rendezvous port itself
    if "--signals-to-handle" not in given:
        torchrun = [*torchrun, "--signals-to-handle=SIGHUP,SIGQUIT"]  # not SIGINT/SIGTERM: see run_torchrun
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.learner.num_ranks}", *torchrun,
            "-m", "learner.main", "--config", str(save_resolved(cfg))]


def flag_value(torchrun: list[str], flag: str) -> str | None:
    """The value of torchrun flag ``flag`` (``--flag=V`` or ``--flag V``, '_' for '-'), or None."""
    for i, arg in enumerate(torchrun):
        name, sep, value = arg.partition("=")
        if name.replace("_", "-") == flag:
            return value if sep else torchrun[i + 1]
    return None


def endpoint_host(endpoint: str) -> str:
    """HOST of ``HOST``, ``HOST:PORT`` or ``[IPV6]:PORT`` (torchrun's endpoint forms)."""
    if endpoint.startswith("["):
        return endpoint[1:endpoint.index("]")]
    return endpoint.rsplit(":", 1)[0] if endpoint.count(":") == 1 else endpoint


GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"


def collective_env(torchrun: list[str], environ: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """(environment for the ranks, a line for the user or '') on a multi-node pool: GLOO_SOCKET_IFNAME
    = this node's interface towards the rendezvous host (module docstring); nothing on one node or
    when ``environ`` sets it already."""
    endpoint = flag_value(torchrun, "--rdzv-endpoint") or flag_value(torchrun, "--master-addr")
    if not endpoint or environ.get(GLOO_IFNAME_ENV):
        return {}, ""
    host = endpoint_host(endpoint)
    try:
        address = route_source_address(host)
    except OSError as exc:
        return {}, (f"no route to the rendezvous host {host} found ({exc}); gloo picks an interface from this "
                    f"host's name (set {GLOO_IFNAME_ENV}=IFACE to choose one)")
    ifname = interface_of(address)
    if ifname is None:
        return {}, (f"no interface holds {address}, this node's address towards the rendezvous host {host}; gloo "
                    f"picks one from this host's name (set {GLOO_IFNAME_ENV}=IFACE to choose one)")
    note = (f"the ranks' collectives (gloo) use interface {ifname} ({address}, this node's route to the "
            f"rendezvous host {host}; {GLOO_IFNAME_ENV} chooses another)")
    return {GLOO_IFNAME_ENV: ifname}, note


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds ``address``, or None."""
    import psutil

    def ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
        return ipaddress.ip_address(text.split("%")[0])  # an IPv6 link-local address may carry %scope

    wanted = ip(address)
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family in (socket.AF_INET, socket.AF_INET6) and ip(a.address) == wanted for a in addrs):
            return name
    return None


def run_torchrun(cmd: list[str], received: list[int], run_dir: str, env: dict[str, str] | None = None) -> int:
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
    def preexec() -> None:
        die_with_parent()
        for sig in (signal.SIGINT, signal.SIGTERM):  # ignored dispositions survive exec
            signal.signal(sig, signal.SIG_IGN)

    proc = spawn(cmd, preexec, env)
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
        with contextlib.suppress(psutil.NoSuchProcess):
            rank.send_signal(signum)
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
    ranks = kill_tree(proc.pid)
    proc.wait()
    print(f"dapo learner: stopped at once (second {signal.Signals(signum).name}): killed torchrun and {ranks} "
          f"rank process(es); no final checkpoint (latest: {latest_checkpoint(run_dir) or 'none'})", flush=True)
    return 1


if __name__ == "__main__":
    main()
