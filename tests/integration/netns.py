"""A private network of Linux network namespaces for multi-host tests: one "host" per namespace.

```
 hub namespace: bridge br0 (no address)
   ├── hub-<name> ══ veth ══ eth-<name> 10.213.<subnet>.<i>/24   namespace <prefix>-<name>
   └── ...
```

Every address exists only inside namespaces created here; the machine's own namespace gets no
address, route or interface (each veth is created straight into its namespaces), so no traffic
leaves them. Names carry the test process's PID and a random tag (concurrent runs never share a
namespace); ``close()`` deletes every namespace (its veths and the bridge go with it). Needs root
and iproute2's ``ip``; ``Network.skip_reason()`` says why not where that is missing.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import shutil
import subprocess
from dataclasses import dataclass

IP_TIMEOUT_S = 10.0
"""Deadline of each ``ip`` command."""


def ip(*args: str) -> str:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if out.returncode:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    ifname: str
    """Its interface (the veth into the bridge); ``hub_ifname`` is the bridge's end of it."""
    hub_ifname: str
    address: str

    def exec_prefix(self) -> list[str]:
        """Command prefix that runs a command inside this host's namespace (``ip netns exec``
        execs the command itself: the process started is the command, same PID)."""
        return ["ip", "netns", "exec", self.netns]


class Network:
    def __init__(self, subnet: int) -> None:
        self.subnet = subnet
        self.prefix = f"dapo-{os.getpid()}-{secrets.token_hex(3)}"
        self.hub = f"{self.prefix}-hub"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        try:
            self._add_namespace(self.hub)
            ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            ip("-n", self.hub, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def skip_reason() -> str:
        """'' where namespaces can be made here, else why not (for pytest.skip)."""
        if shutil.which("ip") is None:
            return "needs iproute2's `ip` (not on PATH)"
        if os.geteuid() != 0:
            return "needs root to create network namespaces (`ip netns add`)"
        probe = f"dapo-probe-{os.getpid()}-{secrets.token_hex(3)}"
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
        if made.returncode:
            return f"`ip netns add` failed here: {made.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=IP_TIMEOUT_S)
        return ""

    def _add_namespace(self, netns: str) -> None:
        ip("netns", "add", netns)
        self._namespaces.append(netns)  # from here on close() deletes it
        ip("-n", netns, "link", "set", "lo", "up")

    def add_host(self, name: str) -> Host:
        """A namespace with one interface on the bridge and address 10.213.<subnet>.<1, 2, ...>."""
        assert len(name) <= 10, f"interface names (eth-{name}) must fit in 15 characters"
        host = Host(name, f"{self.prefix}-{name}", f"eth-{name}", f"hub-{name}",
                    f"10.213.{self.subnet}.{len(self.hosts) + 1}")
        self._add_namespace(host.netns)
        ip("link", "add", host.ifname, "netns", host.netns, "type", "veth", "peer", "name", host.hub_ifname,
           "netns", self.hub)
        ip("-n", self.hub, "link", "set", host.hub_ifname, "master", "br0")
        ip("-n", self.hub, "link", "set", host.hub_ifname, "up")
        ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.ifname)
        ip("-n", host.netns, "link", "set", host.ifname, "up")
        self.hosts[name] = host
        return host

    def partition(self, host: Host) -> None:
        """Cut the host's cable: its bridge port goes down, so packets both ways are dropped
        silently (no reset: its TCP connections stay open and retransmit), as on a real link loss."""
        ip("-n", self.hub, "link", "set", host.hub_ifname, "down")

    def heal(self, host: Host) -> None:
        ip("-n", self.hub, "link", "set", host.hub_ifname, "up")

    def pids(self) -> dict[str, list[int]]:
        """The processes still inside each namespace (``ip netns pids``), where there are any."""
        left = {ns: [int(p) for p in ip("netns", "pids", ns).split()] for ns in self._namespaces}
        return {ns: pids for ns, pids in left.items() if pids}

    def close(self) -> None:
        """SIGKILL what is still inside (by PID: only processes this test started can be in
        namespaces it made), then delete every namespace made here."""
        for pids in self.pids().values():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        errors = []
        for netns in reversed(self._namespaces):
            try:
                ip("netns", "del", netns)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                errors.append(str(exc))
        self._namespaces.clear()
        if errors:
            raise RuntimeError("; ".join(errors))
