"""Who may talk to a run's broker: its keys, its token, and its private socket.

On one machine (a local run) the broker listens on a unix socket in a directory only
this user can enter (:func:`private_ipc_endpoint`): other users' processes cannot
connect at all, which the kernel enforces. Every node of the run proves it belongs
with the run's *token* (:func:`new_token`, a file of mode 0600 that the launcher writes
and hands to the nodes), sent in its ``hello``: a process of this user that lacks it (a
stray script, another run's node, a fuzzer) is refused and never joins the run, so it
can neither steer it nor freeze its virtual clock. With hosts (``--machines``,
``--slurm``) the broker listens on TCP and CURVE keys keep everyone else out, as follows.

Authentication across machines: the broker accepts only nodes that hold the run's keys.

ZeroMQ CURVE: the broker's ROUTER is a CURVE server with its own keypair; every node
of the run is a CURVE client with the run's one client keypair and knows the server's
public key. The broker's ZAP handler (see :class:`ZapHandler`) accepts exactly the
run's client public key, so a node without keys (a NULL handshake) or with other keys
is refused during the handshake, before it can send a single frame to the broker.
Traffic is encrypted as a side effect.

Threat model: a shared LAN where other users can reach the broker's port. Keys are
made per run (:meth:`RunKeys.generate`), written 0600 (:meth:`RunKeys.save`) and
handed to worker hosts over SSH; a node that holds them is trusted as part of the run
(it can still only send well-formed, size-checked messages: the broker and nodes
check every frame). Nodes hold only :meth:`RunKeys.for_nodes` (no server secret).

Key file (JSON, one object; keys are Z85 text, 40 characters each)::

    {"fedemu_run_keys": 1,
     "server_public": "...", "server_secret": "...",   # server_secret: broker only
     "client_public": "...", "client_secret": "..."}
"""
from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import socket as pysocket
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import zmq
import zmq.utils.z85
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("fedemu.security")
broker_log = logging.getLogger("fedemu.broker")  # the broker's refusals, in the broker's log as before

FORMAT_VERSION = 1
_KEY_NAMES = ("server_public", "server_secret", "client_public", "client_secret")
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP specification (RFC 27)
ZAP_DOMAIN = b"fedemu"


class KeyFileError(ValueError):
    """A key file that cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True)
class RunKeys:
    """A run's CURVE keys, Z85 text. ``server_secret`` is None in a node's copy."""

    server_public: str
    server_secret: str | None
    client_public: str
    client_secret: str

    @classmethod
    def generate(cls) -> RunKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public.decode(), server_secret.decode(), client_public.decode(), client_secret.decode())

    def for_nodes(self) -> RunKeys:
        """The keys a node needs: everything but the broker's secret."""
        return replace(self, server_secret=None)

    def save(self, path: str | Path) -> Path:
        """Write the keys to ``path``, mode 0600, atomically: a reader sees the old file
        or the whole new one, and the secret is never readable by others, not even
        for a moment (the temporary file is created 0600)."""
        data = {"fedemu_run_keys": FORMAT_VERSION,
                **{name: getattr(self, name) for name in _KEY_NAMES if getattr(self, name) is not None}}
        return save_private(path, json.dumps(data, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> RunKeys:
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise KeyFileError(f"run key file {path} does not exist") from None
        except OSError as exc:
            raise KeyFileError(f"run key file {path} cannot be read: {exc.strerror}") from None
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise KeyFileError(f"run key file {path} is not JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("fedemu_run_keys") != FORMAT_VERSION:
            raise KeyFileError(f"run key file {path} is not a fedemu run key file (format {FORMAT_VERSION})")
        for name in _KEY_NAMES:
            value = data.get(name)
            if value is None and name == "server_secret":
                continue
            if not _is_key(value):
                raise KeyFileError(f"run key file {path}: {name} is missing or not a 40-character Z85 key")
        keys = cls(**{name: data.get(name) for name in _KEY_NAMES})
        # A public key that does not belong to its secret would fail every handshake
        # with an obscure error much later: say so now.
        if keys.server_secret is not None and zmq.curve_public(keys.server_secret.encode()).decode() != keys.server_public:
            raise KeyFileError(f"run key file {path}: server_public does not match server_secret")
        if zmq.curve_public(keys.client_secret.encode()).decode() != keys.client_public:
            raise KeyFileError(f"run key file {path}: client_public does not match client_secret")
        return keys

    # --- applying the keys to sockets ------------------------------------------------------

    def make_server(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before bind) a CURVE server with the run's server keys."""
        if self.server_secret is None:
            raise ValueError("these run keys have no server secret (a node's copy): a broker needs the full set")
        sock.curve_server = True
        sock.curve_secretkey = self.server_secret.encode()
        sock.curve_publickey = self.server_public.encode()
        sock.zap_domain = ZAP_DOMAIN

    def make_client(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before connect) a CURVE client of the run's broker."""
        sock.curve_serverkey = self.server_public.encode()
        sock.curve_publickey = self.client_public.encode()
        sock.curve_secretkey = self.client_secret.encode()


def save_private(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path``, mode 0600, atomically: a reader sees the old file or
    the whole new one, and the secret is never readable by others, not even for a
    moment (the temporary file is created 0600)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)  # mkstemp's mode already; explicit, whatever the umask
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# --- the run's token -------------------------------------------------------------------------

TOKEN_BYTES = 24  # 192 random bits, as URL-safe text (32 characters)


def new_token() -> str:
    """A fresh run token: what a node's hello must carry to join the run."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def load_token(path: str | Path) -> str:
    """The token in ``path`` (written by :func:`save_private`); KeyFileError names the
    file and what is wrong."""
    path = Path(path)
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        raise KeyFileError(f"run token file {path} does not exist") from None
    except OSError as exc:
        raise KeyFileError(f"run token file {path} cannot be read: {exc.strerror}") from None
    if len(token) < 16 or not token.isascii() or not token.isprintable():
        raise KeyFileError(f"run token file {path} holds no run token")
    return token


def token_matches(expected: str, given: object) -> bool:
    """Whether a hello's ``given`` token is the run's (in constant time)."""
    return isinstance(given, str) and hmac.compare_digest(expected.encode(), given.encode(errors="replace"))


# --- a socket only this user can reach ---------------------------------------------------------

# sun_path is 108 bytes on Linux, with its terminating NUL: longer ipc:// paths fail to bind.
MAX_IPC_PATH = 107
IPC_SOCKET_NAME = "broker"


def private_ipc_endpoint(parent: str | Path | None = None) -> tuple[Path, str]:
    """(a new directory of mode 0700, an ``ipc://`` endpoint inside it): only this user
    (and root) can connect to a socket there, since no one else may enter the directory.
    In ``parent`` (default: the temporary directory), or /tmp where that path would be
    too long for a unix socket. The caller removes the directory when the run ends."""
    for base in (parent or tempfile.gettempdir(), "/tmp"):
        if len(os.path.join(base, "fedemu-xxxxxxxx", IPC_SOCKET_NAME)) <= MAX_IPC_PATH:
            break
    else:  # pragma: no cover (a /tmp path is always short)
        raise OSError("no directory short enough for a unix socket")
    folder = Path(tempfile.mkdtemp(prefix="fedemu-", dir=base))  # mode 0700, whatever the umask
    os.chmod(folder, 0o700)
    return folder, f"ipc://{folder / IPC_SOCKET_NAME}"


def _is_key(value: object) -> bool:
    if not isinstance(value, str) or len(value) != 40:
        return False
    try:
        return len(zmq.utils.z85.decode(value)) == 32
    except (ValueError, KeyError, TypeError):  # z85 raises KeyError on a bad character
        return False


class ZapHandler:
    """The broker's ZAP handler (RFC 27): accepts a CURVE client whose public key is the
    run's client key, refuses anything else. Not a thread: the broker polls
    :attr:`sock` in its own loop and calls :meth:`handle`, so no lock is needed and a
    refusal is counted where the other counters live.

    ``on_refused(address, reason)`` is called for every refusal."""

    def __init__(self, ctx: zmq.Context, client_public: str, on_refused: Callable[[str, str], None]):
        self._allowed = zmq.utils.z85.decode(client_public)
        self._on_refused = on_refused
        # Bound before the broker binds its ROUTER: with no handler bound, libzmq lets
        # every CURVE client in.
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)

    def handle(self) -> None:
        """Answer every ZAP request that is queued."""
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # [routing id, empty, version, request id, domain, address, identity, mechanism, *credentials]
            if len(frames) < 8 or frames[2] != b"1.0":
                log.warning("malformed ZAP request dropped (%d frames)", len(frames))
                continue
            envelope, request_id = frames[:2], frames[3]
            address, mechanism, credentials = frames[5].decode(errors="replace"), frames[7], frames[8:]
            if mechanism == b"CURVE" and len(credentials) == 1 and credentials[0] == self._allowed:
                status, text = b"200", b"OK"
            else:
                status, text = b"400", b"not a node of this run"
                key = zmq.utils.z85.encode(credentials[0]).decode() if len(credentials) == 1 and len(credentials[0]) == 32 else "none"
                self._on_refused(address, f"{mechanism.decode(errors='replace')} client key {key} is not this run's")
            self.sock.send_multipart([*envelope, b"1.0", request_id, status, text, b"", b""])

    def close(self) -> None:
        self.sock.close(linger=0)


# libzmq's handshake failure codes, for the log.
PROTOCOL_ERRORS = {getattr(zmq, name): name[len("PROTOCOL_ERROR_"):].lower()
                   for name in dir(zmq) if name.startswith("PROTOCOL_ERROR_")}


def pending_monitor_events(monitor: zmq.Socket) -> Iterator[tuple[int, int]]:
    """(event, value) of every event queued on a socket monitor, without waiting: how
    the broker and a node see handshakes that never reach their own code."""
    while True:
        try:
            event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return
        yield event["event"], event["value"]


class Admission:
    """The broker's door with run keys: its ROUTER becomes a CURVE server, and every
    refused connection is counted (``stats.refused``) and logged, whether the ZAP
    handler refused it or the handshake failed before any ZAP request (no CURVE at
    all, a bad server key, garbage), which only the socket's monitor sees. Not a
    thread: the broker polls :attr:`sockets` and calls :meth:`handle`."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, keys: RunKeys, stats: Any) -> None:
        keys.make_server(sock)
        self._sock = sock
        self._stats = stats
        self._zap = ZapHandler(ctx, keys.client_public, self._refused)
        self._monitor = sock.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        self.sockets = (self._zap.sock, self._monitor)
        self._peers: dict[int, str] = {}  # fd -> peer address, from ACCEPTED
        self._failed_handshake: str | None = None
        self._refused_from: dict[str, int] = {}

    def handle(self, sock: zmq.Socket) -> None:
        """``sock`` (one of :attr:`sockets`) has something to read."""
        if sock is self._monitor:
            self._monitor_events()
        else:
            self._zap.handle()

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._zap.close()

    def _refused(self, address: str, reason: str) -> None:
        self._stats.refused += 1
        address = address or "unknown address"
        seen = self._refused_from[address] = self._refused_from.get(address, 0) + 1
        # Every refusal is counted; a peer that keeps retrying is logged at first,
        # then every 100th time, so it cannot flood the log.
        if seen <= 10 or seen % 100 == 0:
            broker_log.warning("refused connection from %s (#%d from there): %s", address, seen, reason)

    def _monitor_events(self) -> None:
        for kind, value in pending_monitor_events(self._monitor):
            if kind == zmq.EVENT_ACCEPTED:
                self._peers[value] = _peer_address(value)
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._failed_handshake = None  # the ZAP handler refused it, and counted it
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                self._failed_handshake = f"no valid CURVE handshake: {PROTOCOL_ERRORS.get(value, f'error {value}')}"
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and self._failed_handshake is None:
                # Often the peer hanging up on us after it saw the mismatch itself.
                detail = zmq.strerror(value) if value else "no detail"
                self._failed_handshake = f"no valid CURVE handshake ({detail}; a node without the run's keys?)"
            elif kind == zmq.EVENT_DISCONNECTED:
                # libzmq reports a failed handshake, then the disconnect of its socket.
                address = self._peers.pop(value, "")
                if self._failed_handshake is not None:
                    self._refused(address, self._failed_handshake)
                    self._failed_handshake = None


def _peer_address(fd: int) -> str:
    """The peer of a just-accepted connection, or "" when it is already gone (a
    client that fails the handshake at once is often closed before this runs)."""
    try:
        sock = pysocket.socket(fileno=os.dup(fd))  # a duplicate, ours to close; family detected
    except OSError:
        return ""
    try:
        peer = sock.getpeername()
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
    except OSError:
        return ""
    finally:
        sock.close()
