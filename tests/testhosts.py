"""Test hosts on this machine: network namespaces joined by veth pairs, each running
its own OpenSSH server with a key made for the test.

Each host has its own network stack and address, so fedemu reaches it only over its
veth link and SSH, as it would reach another machine on a LAN; the file system is
shared, so the same Python and fedemu install serve on every host.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

SSHD = "/usr/sbin/sshd"


def unavailable_reason() -> str | None:
    """Why test hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns) for test hosts"
    if not shutil.which("ip"):
        return "needs iproute2 (ip netns) for test hosts"
    if not os.path.exists(SSHD) or not shutil.which("ssh") or not shutil.which("ssh-keygen"):
        return "needs OpenSSH (apt-get install openssh-server openssh-client) to run sshd on test hosts"
    return None


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout


@contextlib.contextmanager
def subnet_reserved(candidates: range):
    """A second octet X, in ``candidates``, that no address of this host's 10.X.0.0/16
    uses, held until the block's addresses are added: concurrent test sessions and
    pytest-xdist workers each get their own (an octet derived from the pid collided
    now and then). The lock file orders the choosing across processes."""
    with open("/run/fedemu-test-subnets.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        used = {int(octet) for octet in re.findall(r"inet 10\.(\d+)\.", _run("ip", "-o", "-4", "addr"))}
        free = [x for x in candidates if x not in used]
        if not free:
            raise RuntimeError(f"no free 10.X.0.0/16 for test hosts: every X in {candidates} is in use")
        yield free[0]


class TestHosts:
    """``count`` hosts named h1..hN in an ssh config file (:attr:`ssh_config`)."""

    __test__ = False  # not a test class, despite the name

    def __init__(self, workdir: Path, count: int) -> None:
        self.dir = workdir
        self.count = count
        tag = os.getpid() % 10000  # concurrent test sessions must not share names
        self.namespaces = [f"fedemu-{tag}-h{i}" for i in range(1, count + 1)]
        self.veths = [f"fe{tag}h{i}" for i in range(1, count + 1)]
        self.subnet: int | None = None  # chosen in up()
        self.addresses: list[str] = []
        self.ssh_config = self.dir / "ssh_config"
        self.sshd: list[subprocess.Popen] = []

    @property
    def names(self) -> list[str]:
        return [f"h{i}" for i in range(1, self.count + 1)]

    def up(self) -> "TestHosts":
        self.dir.mkdir(parents=True, exist_ok=True)
        key, host_key = self.dir / "id_ed25519", self.dir / "host_ed25519"
        for path in (key, host_key):
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path))
        (self.dir / "authorized_keys").write_text((self.dir / "id_ed25519.pub").read_text())
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        config_lines = []
        with subnet_reserved(range(100, 200)) as subnet:
            self.subnet = subnet
            self.addresses = [f"10.{subnet}.{i}.2" for i in range(1, self.count + 1)]
            for i, (ns, veth) in enumerate(zip(self.namespaces, self.veths), 1):
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _run("ip", "addr", "add", f"10.{subnet}.{i}.1/24", "dev", veth)
        for i, (ns, veth, address) in enumerate(zip(self.namespaces, self.veths, self.addresses), 1):
            _run("ip", "link", "set", veth, "up")
            _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            sshd_config = self.dir / f"sshd_config-h{i}"
            sshd_config.write_text("\n".join([
                f"ListenAddress {address}", "Port 22", f"HostKey {host_key}",
                f"AuthorizedKeysFile {self.dir / 'authorized_keys'}", f"PidFile {self.dir / f'sshd-h{i}.pid'}",
                "PermitRootLogin prohibit-password", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
                "UsePAM no", "StrictModes no", "PrintMotd no", "LogLevel VERBOSE", ""]))
            log = open(self.dir / f"sshd-h{i}.log", "ab")
            self.sshd.append(subprocess.Popen(["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", str(sshd_config)],
                                              stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            log.close()
            config_lines += [f"Host h{i}", f"  HostName {address}", "  User root", f"  IdentityFile {key}",
                             "  IdentitiesOnly yes", "  StrictHostKeyChecking no", "  UserKnownHostsFile /dev/null",
                             "  LogLevel ERROR", ""]
        self.ssh_config.write_text("\n".join(config_lines))
        for name in self.names:
            self._wait_for_ssh(name)
        return self

    def ssh(self, host: str, *command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(["ssh", "-F", str(self.ssh_config), "-o", "BatchMode=yes", host, "--", *command],
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def _wait_for_ssh(self, host: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.ssh(host, "true").returncode == 0:
                return
            if time.monotonic() > deadline:
                log = (self.dir / f"sshd-{host}.log").read_text(errors="replace")
                raise RuntimeError(f"sshd on test host {host} did not answer: {log[-500:]}")
            time.sleep(0.2)

    def processes(self, host: str) -> dict[int, str]:
        """Processes living in ``host``'s namespace other than its sshd listener:
        pid -> command line."""
        index = self.names.index(host)
        found = {}
        for pid in _run("ip", "netns", "pids", self.namespaces[index]).split():
            if int(pid) == self.sshd[index].pid:
                continue
            try:
                found[int(pid)] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue  # it ended meanwhile
        return found

    def wait_until_empty(self, host: str, timeout: float = 20) -> dict[int, str]:
        """The processes still left on ``host`` after ``timeout`` (empty: none)."""
        deadline = time.monotonic() + timeout
        while (left := self.processes(host)) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def down(self) -> None:
        for proc in self.sshd:
            proc.terminate()
        for proc in self.sshd:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
        for ns in self.namespaces:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:  # a leftover is a test failure, reported by the test; not left running
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

