"""CurveZMQ: every connection encrypted, every peer authenticated by its public key.

On with `--curve-keys DIR` (made by `dflash-keygen`: broker.key, broker.key_secret, NAME.key_secret,
authorized/NAME.key). ZAP admits a client only if its key is in `authorized/` (docs/SECURITY.md).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from dflash.runtime.logs import get_logger

from .errors import DFlashError

log = get_logger()

BROKER_NAME = "broker"
AUTHORIZED = "authorized"


class CurveKeyError(DFlashError):
    """A key file is missing or unreadable; the message names the file and the fix."""


@dataclass(frozen=True)
class CurveServer:
    """The broker's side: its keypair and the folder of authorised client keys."""

    public: bytes = field(repr=False)
    secret: bytes = field(repr=False)
    authorized: Path

    def apply(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)


@dataclass(frozen=True)
class CurveClient:
    """A peer's side: its keypair and the broker's public key."""

    public: bytes = field(repr=False)
    secret: bytes = field(repr=False)
    server_public: bytes = field(repr=False)
    name: str = ""

    def apply(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise CurveKeyError(f"no key file {path} (make it with: dflash-keygen {path.parent} --name "
                            f"{path.name.split('.')[0]})")
    try:
        public, sec = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise CurveKeyError(f"cannot read key file {path}: {e}") from None
    if secret and not sec:
        raise CurveKeyError(f"{path} holds no secret key")
    return public, sec


def server_keys(keys_dir: str | os.PathLike) -> CurveServer:
    """The broker's keys from `keys_dir`. Raises CurveKeyError."""
    d = Path(keys_dir)
    public, secret = _load(d / f"{BROKER_NAME}.key_secret", secret=True)
    if not (d / AUTHORIZED).is_dir():
        raise CurveKeyError(f"no folder {d / AUTHORIZED} of authorised peer keys (dflash-keygen {d} --name NAME "
                            "makes a peer key and authorises it)")
    return CurveServer(public, secret, d / AUTHORIZED)


def client_keys(keys_dir: str | os.PathLike, name: str | None = None) -> CurveClient:
    """A peer's keys: DIR/broker.key and DIR/NAME.key_secret (NAME: this host's). Raises CurveKeyError."""
    d = Path(keys_dir)
    name = name or socket.gethostname()
    server_public, _ = _load(d / f"{BROKER_NAME}.key", secret=False)
    public, secret = _load(d / f"{name}.key_secret", secret=True)
    return CurveClient(public, secret, server_public, name)


class KeyRing:
    """ZAP credentials provider: is this client key in the authorised folder (re-read when it changes)?"""

    def __init__(self, folder: Path, on_denied: Callable[[str], None] | None = None):
        self.folder = folder
        self.on_denied = on_denied or (lambda key: None)
        self._seen: tuple | None = None  # (name, size, mtime) of each file at the last read
        self.names: dict[bytes, str] = {}  # z85 public key -> file name without .key

    def _reload(self) -> None:
        # a listing per connection catches files replaced in place, which the folder's mtime would not
        try:
            files = sorted(self.folder.glob("*.key"))
            seen = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
        except OSError:
            self.names, self._seen = {}, None  # folder gone: nobody is authorised (fail closed)
            return
        if seen == self._seen:
            return
        names = {}
        for p in files:
            try:
                public, _ = zmq.auth.load_certificate(p)
            except (OSError, ValueError):
                continue  # a half-copied file: it counts once it is whole (its size changes)
            names[public] = p.name[: -len(".key")]
        self.names, self._seen = names, seen

    def callback(self, domain: str, z85_key: bytes) -> bool:
        self._reload()
        if z85_key in self.names:
            return True
        self.on_denied(z85_key.decode("ascii", "replace"))
        return False


class _Authenticator(ThreadAuthenticator):
    """ThreadAuthenticator whose User-Id is the key's name, so the broker can say which key a peer used."""

    keyring: KeyRing

    def curve_user_id(self, client_public_key: bytes) -> str:
        z85_key = z85.encode(client_public_key)  # ZAP passes the raw 32 bytes
        return self.keyring.names.get(z85_key, z85_key.decode("ascii"))


def start_authenticator(ctx: zmq.Context, server: CurveServer,
                        on_denied: Callable[[str], None] | None = None) -> ThreadAuthenticator:
    """Serve ZAP for `ctx`'s CURVE server sockets. Start it BEFORE binding: libzmq lets every client
    in while no ZAP handler runs."""
    auth = _Authenticator(ctx)
    auth.keyring = KeyRing(server.authorized, on_denied)
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=auth.keyring)
    return auth


def key_name(frame) -> str | None:
    """The authorised key name a message came with (its ZAP User-Id), or None without Curve."""
    try:
        uid = frame.get("User-Id")
    except (AttributeError, zmq.ZMQError):
        return None
    return uid or None


def client_from(keys_dir: str | None, name: str | None) -> CurveClient | None:
    """`--curve-keys`/`--curve-name` as a link's `curve=` argument (protocol/links.py). Raises CurveKeyError."""
    return client_keys(keys_dir, name) if keys_dir else None
