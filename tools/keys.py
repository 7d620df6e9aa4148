"""`dflash-keygen DIR --name NAME`: make a CurveZMQ keypair (docs/SECURITY.md).

    dflash-keygen keys --name broker     keys/broker.key + keys/broker.key_secret
    dflash-keygen keys --name gpu-host1  keys/gpu-host1.key(_secret), and authorises it:
                                         a copy of the public key in keys/authorized/

Secret key files are written mode 0600. An existing keypair is never overwritten (a
replaced broker key locks out every peer; a replaced peer key locks out that peer)
unless --force. Exit 0 on success, 2 on bad input, 1 if a file cannot be written.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import click
import zmq.auth

from dflash.protocol.curve import AUTHORIZED, BROKER_NAME


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("keys_dir", type=click.Path(file_okay=False))
@click.option("--name", required=True, help=f"Key name: '{BROKER_NAME}' for the broker; for a peer, what its "
              "--curve-name will say (default there: the host name).")
@click.option("--authorize/--no-authorize", default=True, show_default=True,
              help="Copy a peer's public key into KEYS_DIR/authorized/ so the broker admits it.")
@click.option("--force", is_flag=True, help="Replace an existing keypair of that name.")
def main(keys_dir: str, name: str, authorize: bool, force: bool) -> None:
    """Write a CurveZMQ keypair KEYS_DIR/NAME.key (public) and KEYS_DIR/NAME.key_secret (keep
    on its host)."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name.startswith("."):
        click.echo(f"error: --name {name!r}: use letters, digits, '.', '_', '-'", err=True)
        sys.exit(2)
    d = Path(keys_dir)
    public, secret = d / f"{name}.key", d / f"{name}.key_secret"
    if (public.exists() or secret.exists()) and not force:
        click.echo(f"error: {secret} already exists; keep it, or pass --force to replace it", err=True)
        sys.exit(2)
    try:
        d.mkdir(parents=True, exist_ok=True)
        (d / AUTHORIZED).mkdir(exist_ok=True)
        old = os.umask(0o077)  # the secret file is born private, not chmod'ed afterwards
        try:
            zmq.auth.create_certificates(d, name)
        finally:
            os.umask(old)
        public.chmod(0o644)
        if authorize and name != BROKER_NAME:
            shutil.copyfile(public, d / AUTHORIZED / public.name)
    except OSError as e:
        click.echo(f"error: cannot write keys in {d}: {e}", err=True)
        sys.exit(1)
    click.echo(f"wrote {public} and {secret}" + (f"; authorised in {d / AUTHORIZED}/"
                                                 if authorize and name != BROKER_NAME else ""))


if __name__ == "__main__":
    main()
