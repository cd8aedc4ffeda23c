"""The machines of a multi-machine run: parsing ``--machines`` / ``--hostfile``, and
the OpenSSH command lines that reach them.

fedemu uses the system's ``ssh`` so that ~/.ssh/config, keys and the agent work as
they do for the user; it always runs non-interactively (BatchMode) so a missing key is
an error, never a password prompt that hangs the launcher.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path


class HostError(ValueError):
    """A host list or host file that cannot be used; the message names the entry."""


@dataclass(frozen=True)
class Host:
    name: str  # as ssh knows it: a DNS name, an address or a ~/.ssh/config alias
    user: str | None = None
    port: int | None = None
    slots: int | None = None  # worker nodes on this host; None: its core count
    python: str | None = None  # interpreter with fedemu installed; None: --remote-python

    @property
    def label(self) -> str:
        """A file-name-safe name for logs (several entries may share one machine)."""
        return re.sub(r"[^A-Za-z0-9_.-]", "_", self.name if self.port is None else f"{self.name}_{self.port}")

    def __str__(self) -> str:
        text = f"{self.user}@{self.name}" if self.user else self.name
        return f"{text}:{self.port}" if self.port is not None else text


_HOST_RE = re.compile(r"^(?:(?P<user>[A-Za-z0-9_][A-Za-z0-9_.-]*)@)?(?P<name>[A-Za-z0-9_.-]+|\[[0-9a-fA-F:]+\])"
                      r"(?::(?P<port>\d+))?$")


def parse_host(text: str, where: str) -> Host:
    """``[user@]host[:port] [slots=N] [python=PATH]``; ``where`` names the entry in errors."""
    words = text.split()
    if not words:
        raise HostError(f"{where}: empty host entry")
    match = _HOST_RE.match(words[0])
    if not match:
        raise HostError(f"{where}: {words[0]!r} is not [user@]host[:port]")
    port = int(match["port"]) if match["port"] else None
    if port is not None and not 0 < port < 65536:
        raise HostError(f"{where}: port {port} is outside 1..65535")
    options: dict[str, str] = {}
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if not sep or key not in ("slots", "python") or not value:
            raise HostError(f"{where}: unknown option {word!r} (expected slots=N or python=PATH)")
        options[key] = value
    slots = None
    if "slots" in options:
        if not options["slots"].isdigit() or int(options["slots"]) < 1:
            raise HostError(f"{where}: slots must be a positive integer, got {options['slots']!r}")
        slots = int(options["slots"])
    return Host(match["name"].strip("[]"), match["user"], port, slots, options.get("python"))


def parse_machines(text: str) -> list[Host]:
    """``--machines h1,alice@h2:2222,h3``."""
    entries = [item.strip() for item in text.split(",")]
    hosts = [parse_host(item, f"--machines entry {i + 1}") for i, item in enumerate(entries) if item]
    return _checked(hosts, "--machines")


def parse_hostfile(path: str | Path) -> list[Host]:
    """One host per line as in :func:`parse_host`; ``#`` starts a comment."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise HostError(f"cannot read host file {path}: {exc.strerror}") from None
    hosts = [parse_host(line.split("#", 1)[0], f"{path}:{n}") for n, line in enumerate(lines, 1)
             if line.split("#", 1)[0].strip()]
    return _checked(hosts, str(path))


def _checked(hosts: list[Host], source: str) -> list[Host]:
    if not hosts:
        raise HostError(f"{source}: no hosts given")
    seen: set[tuple] = set()
    for host in hosts:
        key = (host.user, host.name, host.port)
        if key in seen:  # two entries for one login would double its workers by accident
            raise HostError(f"{source}: host {host} is listed twice; use slots=N for more worker nodes")
        seen.add(key)
    return hosts


def ssh_argv(host: Host, remote: list[str], ssh_config: str | None = None, connect_timeout: int = 10) -> list[str]:
    """The ``ssh`` command running ``remote`` (an argv, quoted for the remote shell)."""
    argv = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={connect_timeout}",
            # A dead host or link is noticed by ssh too, not only by the broker's heartbeats.
            "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3", "-T"]
    if ssh_config:
        argv += ["-F", ssh_config]
    if host.port is not None:
        argv += ["-p", str(host.port)]
    if host.user:
        argv += ["-l", host.user]
    return argv + [host.name, "--", shlex.join(remote)]
