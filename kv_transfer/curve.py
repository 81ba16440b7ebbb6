"""CURVE authentication for every ZMQ socket bound beyond loopback (the
frontend's ROUTER/PULL, the KV receivers).

One run has one set of keys, generated at start-up (`CurveKeys.generate`):
a server pair every bound socket uses, and a client pair every connecting
socket uses. A server also checks, through ZAP, that a client presents the
run's client public key, so a peer needs both the server's public key and the
client secret to be heard. Keys reach workers inside their WorkerSpec (through
Ray's object transfer, or multiprocessing's pipe), or through a file written
with mode 0600 (`write` / `read`); they never enter the run's config, which is
written to the run directory. On loopback without keys nothing changes; a
bind beyond loopback without keys is refused (`check_bind`)."""
from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import asdict, dataclass

import zmq


class CurveRequired(ValueError):
    """A bind beyond loopback was asked for without CURVE keys."""


@dataclass(frozen=True)
class CurveKeys:
    server_public: str          # z85
    server_secret: str
    client_public: str
    client_secret: str

    @classmethod
    def generate(cls) -> "CurveKeys":
        sp, ss = zmq.curve_keypair()
        cp, cs = zmq.curve_keypair()
        return cls(sp.decode(), ss.decode(), cp.decode(), cs.decode())

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "CurveKeys | None":
        return None if d is None else cls(**d)

    def write(self, path: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_dict(), f)

    @classmethod
    def read(cls, path: str) -> "CurveKeys":
        if os.stat(path).st_mode & 0o077:
            raise PermissionError(f"{path}: CURVE keys readable by others (mode must be 0600)")
        with open(path) as f:
            return cls(**json.load(f))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False          # a name or an interface: not provably loopback


def check_bind(host: str, keys: "CurveKeys | dict | None", what: str) -> None:
    if keys is None and not is_loopback(host):
        raise CurveRequired(f"{what}: refusing to bind {host} (not loopback) without CURVE keys; "
                            f"set runtime.curve=true to generate them per run, or bind a loopback address")


def _keys(keys: "CurveKeys | dict | None") -> "CurveKeys | None":
    return CurveKeys.from_dict(keys) if isinstance(keys, dict) else keys


def server_keys(sock: zmq.Socket, keys: "CurveKeys | dict | None", host: str, what: str, auth=None):
    """Before bind: refuse beyond loopback without keys; with keys, make `sock` a
    CURVE server. Returns the context's ZAP authenticator (started here unless
    `auth` is given), which the caller stops before terminating the context."""
    check_bind(host, keys, what)
    k = _keys(keys)
    if k is None:
        return auth
    if auth is None:
        auth = _authenticator(sock.context, k.client_public)
    sock.curve_secretkey = k.server_secret.encode()
    sock.curve_publickey = k.server_public.encode()
    sock.curve_server = True
    return auth


def client_keys(sock: zmq.Socket, keys: "CurveKeys | dict | None") -> None:
    """Before connect: with keys, authenticate `sock` to the run's CURVE servers."""
    k = _keys(keys)
    if k is None:
        return
    sock.curve_serverkey = k.server_public.encode()
    sock.curve_publickey = k.client_public.encode()
    sock.curve_secretkey = k.client_secret.encode()


class _OnlyKey:
    def __init__(self, allowed: bytes):
        self.allowed = allowed

    def callback(self, domain, key) -> bool:
        return key == self.allowed


def _authenticator(ctx: zmq.Context, client_public: str):
    """A ZAP handler on `ctx` that admits only the run's client key."""
    from zmq.auth.thread import ThreadAuthenticator
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_OnlyKey(client_public.encode()))
    return auth


def stop_authenticator(auth) -> None:
    """Call before ctx.term(): the ZAP thread holds a socket of the context."""
    if auth is not None:
        auth.stop()
