"""Side-channel receiver half: raw TCP range reads from the learner's side channel
(``learner/transports/side_channel.py``): a 4-byte LE length + ``WeightRangeRequest``, answered
with the range's raw bytes, received straight into the destination (``recv_into``)."""

from __future__ import annotations

import socket
import struct
import time

from actors.transports.base import WeightFetchError
from protos import coordinator_pb2 as pb
from protos.transports import set_kernel_timeouts


class SideChannelClient:
    """One persistent connection; ``read_into`` is a ``base.RangeReader``."""

    def __init__(self, endpoint: str, auth_token: str, timeout_s: float) -> None:
        host, _, port = endpoint.rpartition(":")
        self._addr = (host, int(port))
        self._token = auth_token
        self._timeout_s = timeout_s
        self._sock: socket.socket | None = None

    def _connect(self) -> socket.socket:
        if self._sock is None:
            deadline = time.monotonic() + self._timeout_s
            while True:
                try:
                    self._sock = socket.create_connection(self._addr, timeout=self._timeout_s)
                    break
                except OSError as exc:  # the learner may not be listening yet: retry until the deadline
                    if time.monotonic() > deadline:
                        raise WeightFetchError(f"cannot connect to weight side channel {self._addr}: {exc}") from exc
                    time.sleep(0.05)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_kernel_timeouts(self._sock, self._timeout_s)
        return self._sock

    def read_into(self, dst: memoryview, version: int, offset: int) -> None:
        """Fill ``dst`` with bytes [offset, offset + len(dst)) of ``version``."""
        sock = self._connect()
        req = pb.WeightRangeRequest(auth_token=self._token, version=version, offset_bytes=offset,
                                    length_bytes=len(dst)).SerializeToString()
        try:
            sock.sendall(struct.pack("<I", len(req)) + req)
            got = 0
            while got < len(dst):
                n = sock.recv_into(dst[got:])
                if n == 0:
                    raise ConnectionError(f"learner closed the side channel after {got} of {len(dst)} bytes "
                                          f"(version {version} no longer held, or the request was rejected)")
                got += n
        except (OSError, ConnectionError) as exc:  # SO_RCVTIMEO expiring reads as EAGAIN (BlockingIOError)
            self.close()
            why = f"timed out after {self._timeout_s} s" if isinstance(exc, (BlockingIOError, TimeoutError)) else exc
            raise WeightFetchError(f"side-channel read of version {version} [{offset}, +{len(dst)}) failed: {why}") \
                from exc

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
