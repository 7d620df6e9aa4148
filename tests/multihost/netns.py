"""Separate network stacks on one machine: Linux network namespaces joined by a bridge.

Each "host" is a namespace with its own veth interface and address on a private /24 that
exists only inside these namespaces; the bridge lives in a namespace of its own, so the
machine's real network is never touched. Needs root and iproute2.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

SUBNET = "10.213.77"  # only ever configured inside the namespaces made here


class NetnsUnavailable(RuntimeError):
    pass


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise NetnsUnavailable(f"`{' '.join(cmd)}` failed: {res.stderr.strip()}")


@dataclass
class Hosts:
    """Namespaces name -> address; `exec_argv(name, argv)` runs argv inside one."""

    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    addresses: dict[str, str] = field(default_factory=dict)
    switch: str = ""

    def ns(self, name: str) -> str:
        return f"dfl-{self.tag}-{name}"

    def exec_argv(self, name: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(name), *argv]

    def create(self, names: list[str]) -> "Hosts":
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root")
        if shutil.which("ip") is None:
            raise NetnsUnavailable("iproute2's `ip` is not installed")
        self.switch = f"dfl-{self.tag}-sw"
        _ip("netns", "add", self.switch)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("link", "set", "br0", "up", ns=self.switch)
        for i, name in enumerate(names, start=1):
            ns, addr = self.ns(name), f"{SUBNET}.{i}"
            _ip("netns", "add", ns)
            # veth pair: "eth0" inside the host, "p<i>" on the switch's bridge
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", self.switch)
            _ip("link", "set", f"p{i}", "master", "br0", ns=self.switch)
            _ip("link", "set", f"p{i}", "up", ns=self.switch)
            _ip("addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            self.addresses[name] = addr
        return self

    def destroy(self) -> None:
        for name in list(self.addresses) + [None]:
            ns = self.ns(name) if name else self.switch
            if ns:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
