"""Start real broker and node processes for tests, and make sure they end."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent


class Procs:
    """Every OS process a test started; `close` ends them all (kill as a last resort)."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.started: list[subprocess.Popen] = []

    def start(self, name: str, *argv: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=log,
                                stdin=subprocess.DEVNULL, text=True)
        log.close()
        self.started.append(proc)
        return proc

    def broker(self, *extra: str, heartbeat_timeout: float = 1.0) -> str:
        endpoint_file = self.tmp / "broker.endpoint"
        self.broker_proc = self.start(
            "broker", "-m", "fedemu.launch", "broker", "--bind", "tcp://127.0.0.1:0",
            "--endpoint-file", str(endpoint_file), "--log-dir", str(self.tmp),
            "--heartbeat-interval", "0.1", "--heartbeat-timeout", str(heartbeat_timeout), *extra)
        deadline = time.monotonic() + 20
        while not endpoint_file.exists():
            assert self.broker_proc.poll() is None, self.log("broker")
            assert time.monotonic() < deadline, "broker did not start"
            time.sleep(0.02)
        return endpoint_file.read_text().strip()

    def peer(self, name: str, broker: str) -> subprocess.Popen:
        proc = self.start(name, str(HERE / "peer_node.py"), "--broker", broker, "--name", name)
        line = proc.stdout.readline()
        assert line.strip() == "ready", f"peer {name} did not start: {self.log(name)}"
        return proc

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.started:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout:
                proc.stdout.close()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
