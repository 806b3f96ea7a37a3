"""``transport.*``: addresses, the auth token and timeouts of the wire (gRPC, ZeroMQ)."""

from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass

from dapo.auth_token import PUBLIC_TOKEN
from dapo.config.base import _check


@dataclass(kw_only=True)
class TransportConfig:
    host: str = "127.0.0.1"
    """Address the learner's services bind to. Loopback by default; set 0.0.0.0 (with a token)
    to accept actors from other hosts."""
    grpc_port: int = 50051
    """Coordinator gRPC port (register, heartbeat, leases, weight announcements, status)."""
    zmq_port: int = 50052
    """Replay-queue ZeroMQ PULL port (trajectory groups)."""
    auth_token: str = PUBLIC_TOKEN
    """Shared secret actors present in gRPC metadata and the ZMQ header. Change it whenever
    services bind beyond loopback, and keep it where other users cannot read it: ``DAPO_TOKEN`` in
    the environment or ``auth_token_file`` (dapo/auth_token.py; where several give a token they
    must agree, the public default counting as none). Given here on a command line it is readable
    by every user of the machine (``ps``): refused beyond loopback, warned about on it. Configs that
    dapo writes or prints hold ``<redacted>``."""
    auth_token_file: str = ""
    """A file that holds the token (surrounding whitespace ignored), readable by its owner only: a
    file that its group or other users may access is refused (``chmod 600 FILE``). '' = none.
    Children started by a launcher read it again themselves."""
    max_message_bytes: int = 64 << 20
    """Largest accepted ZMQ trajectory message or gRPC message, in bytes."""
    rpc_timeout_s: float = 10.0
    """Deadline of every gRPC call and socket operation, in seconds."""
    heartbeat_timeout_s: float = 10.0
    """An actor silent this long is declared dead and its leases are re-issued, in seconds."""
    shutdown_drain_s: float = 5.0
    """At the end of a run the learner keeps its services up at most this long, until every actor
    has heard the shutdown (next heartbeat) and left, so none finds the learner gone mid-call, in
    seconds. 0 = stop at once."""
    queue_max_groups: int = 256
    """Replay-queue high-water mark: at most this many decoded groups held, in groups."""
    lease_timeout_s: float = 600.0
    """A lease not completed this long after it was issued is re-issued to another actor, even
    if its actor still heartbeats (e.g. its groups are rejected as malformed), in seconds."""
    lease_retry_after_s: float = 0.25
    """How long an actor refused a lease (staleness bound, full queue) waits before asking
    again, in seconds."""
    curve_server_secret_key: str = ""
    """Z85 CURVE secret key of the replay queue ('' = no encryption). Actors then need
    ``curve_server_public_key``. On a command line quote it and write any ``${`` in it as ``\\${``:
    Z85 keys hold characters of Hydra's grammar, and ``${`` starts an interpolation."""
    curve_server_public_key: str = ""
    """Z85 CURVE public key of the replay queue, given to actors outside a trusted network (quoted
    and escaped on a command line as the secret key)."""

    def __post_init__(self) -> None:
        for key in ("grpc_port", "zmq_port"):
            _check(0 <= getattr(self, key) < 65536, f"transport.{key}", getattr(self, key), "a TCP port in [0, 65535]")
        _check(len(self.auth_token) > 0, "transport.auth_token", self.auth_token, "a non-empty string")
        _check(self.rpc_timeout_s > 0, "transport.rpc_timeout_s", self.rpc_timeout_s, "> 0")
        _check(self.heartbeat_timeout_s > 0, "transport.heartbeat_timeout_s", self.heartbeat_timeout_s, "> 0")
        _check(self.shutdown_drain_s >= 0, "transport.shutdown_drain_s", self.shutdown_drain_s, ">= 0")
        _check(self.queue_max_groups >= 1, "transport.queue_max_groups", self.queue_max_groups, ">= 1")
        _check(self.lease_timeout_s > 0, "transport.lease_timeout_s", self.lease_timeout_s, "> 0")
        _check(self.lease_retry_after_s >= 0, "transport.lease_retry_after_s", self.lease_retry_after_s, ">= 0")


DEFAULT_AUTH_TOKEN = next(f.default for f in dataclasses.fields(TransportConfig) if f.name == "auth_token")


def is_loopback(host: str) -> bool:
    """127.x, ::1 and ``localhost``; any other name may resolve to a public interface."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def public_bind_error(t: TransportConfig) -> str | None:
    """Why the services must not start with this transport config, or None. The default token is
    printed in the README: beyond loopback anyone who reaches the ports could act as an actor."""
    if is_loopback(t.host) or t.auth_token != DEFAULT_AUTH_TOKEN:
        return None
    return (f"transport.host={t.host} accepts connections from other machines, but transport.auth_token is the "
            f"public default {DEFAULT_AUTH_TOKEN!r}: anyone who can reach the ports could register as an actor and "
            "push groups. Generate a token with\n"
            "  python -c \"import secrets; print(secrets.token_hex(16))\"\n"
            "and give it to the learner and to every actor as DAPO_TOKEN=<token> in their environment, or in a "
            "file only they can read: transport.auth_token_file=FILE (chmod 600 FILE); never as transport.auth_token "
            "on a command line (or bind to loopback: transport.host=127.0.0.1).")
