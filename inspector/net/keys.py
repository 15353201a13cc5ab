"""CurveZMQ key files: a server key pair, client key pairs, and the server's allow-list of clients.

A key directory made by ``inspector serve --keygen DIR`` holds ``server.key`` (public: give it to
clients), ``server.key_secret`` (stays on the server) and ``clients/``, the allow-list: the server
accepts exactly the clients whose public key file is in there. ``--keygen DIR --client NAME`` makes a
client pair ``NAME.key``/``NAME.key_secret`` and puts ``NAME.key`` on the allow-list; the client needs
``NAME.key_secret`` and ``server.key``. Secret files are readable by their owner only.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq.auth

SERVER = "server"
ALLOW_LIST = "clients"


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    allow_list: Path


@dataclass(frozen=True)
class ClientKeys:
    public: bytes
    secret: bytes
    server_public: bytes


def keygen(directory: str | os.PathLike, client: str | None = None) -> list[Path]:
    """Make the server's pair (and allow-list directory) if missing, or a client's pair; the files made."""
    directory = Path(directory)
    (directory / ALLOW_LIST).mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    name = client or SERVER
    if name == SERVER and (directory / f"{SERVER}.key_secret").exists():
        raise ValueError(f"{directory} already holds a server key pair; remove it first to make a new one")
    if client is not None and (not client.isidentifier() or client == SERVER):
        raise ValueError(f"a client name is a plain word (letters, digits, _), not {client!r}")
    public, secret = (Path(p) for p in zmq.auth.create_certificates(str(directory), name))
    os.chmod(secret, 0o600)
    made = [public, secret]
    if client is not None:
        made.append(Path(shutil.copy(public, directory / ALLOW_LIST / public.name)))
    return made


def server_keys(directory: str | os.PathLike) -> ServerKeys:
    directory = Path(directory)
    public, secret = _pair(directory / f"{SERVER}.key_secret")
    allow_list = directory / ALLOW_LIST
    if not any(allow_list.glob("*.key")):
        raise ValueError(f"{allow_list} allows no client yet: add one with inspector serve --keygen {directory} "
                         "--client NAME")
    return ServerKeys(public, secret, allow_list)


def client_keys(client_secret: str | os.PathLike, server_public: str | os.PathLike) -> ClientKeys:
    public, secret = _pair(Path(client_secret))
    try:
        server, _ = zmq.auth.load_certificate(str(server_public))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the server's public key from {server_public}: {e}") from None
    return ClientKeys(public, secret, server)


def _pair(path: Path) -> tuple[bytes, bytes]:
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read a key pair from {path}: {e}") from None
    if secret is None:
        raise ValueError(f"{path} holds a public key only; a secret key file ends in .key_secret")
    return public, secret
