"""Start real broker and node processes for tests, and make sure they end.

Run as a script (``realprocs.py keyed-broker ...``) it is a broker with run keys: the
same Broker `fedemu broker` runs, until that command takes keys itself.
"""
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

    def broker(self, *extra: str, heartbeat_timeout: float = 1.0, keys: Path | None = None) -> str:
        """A broker process; with ``keys`` (a run key file) it admits only the run's nodes."""
        endpoint_file = self.tmp / "broker.endpoint"
        common = ("--endpoint-file", str(endpoint_file), "--heartbeat-interval", "0.1",
                  "--heartbeat-timeout", str(heartbeat_timeout))
        if keys is None:
            self.broker_proc = self.start(
                "broker", "-m", "fedemu.launch", "broker", "--bind", "tcp://127.0.0.1:0",
                "--log-dir", str(self.tmp), *common, *extra)
        else:
            self.broker_proc = self.start("broker", str(HERE / "realprocs.py"), "keyed-broker",
                                          "--keys", str(keys), *common, *extra)
        deadline = time.monotonic() + 20
        while not endpoint_file.exists():
            assert self.broker_proc.poll() is None, self.log("broker")
            assert time.monotonic() < deadline, "broker did not start"
            time.sleep(0.02)
        return endpoint_file.read_text().strip()

    def peer(self, name: str, broker: str, keys: Path | None = None,
             heartbeat_timeout: float | None = None) -> subprocess.Popen:
        """A peer node process (tests/peer_node.py); ``heartbeat_timeout`` is how long it
        lets the broker be silent before it gives up on it (its default: 1 s)."""
        proc = self.start(name, str(HERE / "peer_node.py"), "--broker", broker, "--name", name,
                          *(("--keys", str(keys)) if keys is not None else ()),
                          *(("--heartbeat-timeout", str(heartbeat_timeout)) if heartbeat_timeout is not None else ()))
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


def keyed_broker_main(argv: list[str]) -> None:
    """A broker with run keys, logging to stderr (which Procs keeps as broker.log)."""
    import argparse
    import logging
    import signal

    from fedemu.node import Broker
    from fedemu.node.security import RunKeys

    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", required=True)
    parser.add_argument("--endpoint-file", required=True)
    parser.add_argument("--heartbeat-interval", type=float, default=0.1)
    parser.add_argument("--heartbeat-timeout", type=float, default=1.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    broker = Broker("tcp://127.0.0.1:0", keys=RunKeys.load(args.keys), heartbeat_interval=args.heartbeat_interval,
                    heartbeat_timeout=args.heartbeat_timeout)
    tmp = Path(args.endpoint_file + ".tmp")
    tmp.write_text(broker.endpoint + "\n")
    os.replace(tmp, args.endpoint_file)  # readers never see half an address
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: broker.stop())
    broker.serve_forever()


if __name__ == "__main__":
    if sys.argv[1:2] != ["keyed-broker"]:
        sys.exit("usage: realprocs.py keyed-broker --keys FILE --endpoint-file FILE")
    keyed_broker_main(sys.argv[2:])
