"""A ZMTP 3.0 peer over a plain TCP socket (RFC 23/ZMTP), NULL mechanism only: it can
send frames no ZeroMQ library would (a size header with no body, a message that never
ends), which is what an attacker on the network can do.
"""

from __future__ import annotations

import socket
import struct
import time

SIGNATURE = b"\xff" + b"\x00" * 8 + b"\x7f"
MORE, LONG, COMMAND = 0x01, 0x02, 0x04


class RawZmtp:
    def __init__(self, host: str, port: int, socket_type: bytes, timeout_s: float = 5.0):
        """Connect and greet. Raises ConnectionError if the server drops us in the handshake."""
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.sendall(SIGNATURE + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31)
        greeting = self._read(64)
        self.peer_mechanism = greeting[12:32].rstrip(b"\x00")
        body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
        self.sock.sendall(bytes([COMMAND, len(body)]) + body)

    def _read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("peer closed the connection")
            out += chunk
        return out

    def frame_header(self, size: int, more: bool) -> bytes:
        return bytes([LONG | (MORE if more else 0)]) + struct.pack(">Q", size)

    def send_frame(self, data: bytes, more: bool = False) -> None:
        self.sock.sendall(self.frame_header(len(data), more) + data)

    def closed_by_peer(self, within_s: float) -> bool:
        """True if the other side closed (or reset) the connection within `within_s`."""
        end = time.monotonic() + within_s
        self.sock.settimeout(0.05)
        while time.monotonic() < end:
            try:
                if self.sock.recv(65536) == b"":
                    return True
            except socket.timeout:
                continue
            except (ConnectionResetError, BrokenPipeError):
                return True
        return False

    def close(self) -> None:
        self.sock.close()
