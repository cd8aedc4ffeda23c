"""Local nodes fork from the zygote (launch/running/zygote.py, issue 53): real zygote, real
forked processes, real runs; each compared with the old path (FEDEMU_ZYGOTE=0)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedemu.launch.running.zygote import SWITCH_ENV, Zygote
from fedemu.server.runlog import read_events

from .test_transport_regression import WALL_FIELDS


def _fork(zygote: Zygote, args: list[str], out: Path):
    with open(out, "ab") as f:
        node = zygote.request(args, f.fileno())
    node.started()
    return node


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def test_a_forked_process_is_what_the_command_would_be(tmp_path):
    zygote = Zygote()
    try:
        # One that fails at once: the same exit code and last words as the command's.
        args = ["node", "worker", "--broker", "ipc:///nowhere", "--run-dir", str(tmp_path), "--workers", "1"]
        node = _fork(zygote, args, tmp_path / "forked.out")
        assert node.parent_threads == 1  # the zygote forked with no thread but its own
        code = node.wait(120)
        old = subprocess.run([sys.executable, "-m", "fedemu.launch", *args], capture_output=True, text=True)
        assert code == old.returncode != 0
        forked = (tmp_path / "forked.out").read_text().strip().splitlines()
        assert forked[-1] == old.stderr.strip().splitlines()[-1]
        # One that runs until stopped: its command line, session and parent; it dies of the signal.
        endpoint = tmp_path / "broker.endpoint"
        args = ["broker", "--bind", f"ipc://{tmp_path}/broker", "--endpoint-file", str(endpoint)]
        node = _fork(zygote, args, tmp_path / "broker.out")
        deadline = time.monotonic() + 60
        while not endpoint.exists():
            assert node.poll() is None, (tmp_path / "broker.out").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        cmdline = Path(f"/proc/{node.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        assert [a.decode() for a in cmdline] == [sys.executable, "-m", "fedemu.launch", *args]
        stat = _stat(node.pid)
        assert int(stat[1]) == zygote.proc.pid  # its parent
        assert int(stat[3]) == node.pid  # a session of its own
        node.terminate()
        assert node.wait(30) == -signal.SIGTERM
    finally:
        zygote.close()
    assert zygote.proc.returncode == 0


def test_a_stop_signal_the_moment_a_process_forks_is_not_lost(tmp_path):
    """A launcher stopped while it started the server signals the node as soon as the
    zygote names its pid, before the child has replaced the zygote's SIG_IGN: the signal
    must wait for the child, not vanish (the server then never stopped: a failed run)."""
    zygote = Zygote()
    try:
        zygote.ready.wait(120)
        for i in range(5):
            # A broker runs until stopped: were the signal lost, it would outlive the wait.
            args = ["broker", "--bind", f"ipc://{tmp_path}/broker-{i}"]
            node = _fork(zygote, args, tmp_path / f"broker-{i}.out")
            node.terminate()
            assert node.wait(30) == -signal.SIGTERM, (tmp_path / f"broker-{i}.out").read_text()
    finally:
        zygote.close()


# `fedemu` as its entry point runs it, saying at its exit whether the launcher imported torch.
_LAUNCHER = ("import atexit, sys\n"
             "atexit.register(lambda: print('launcher imported torch:', 'torch' in sys.modules))\n"
             "from fedemu.launch.cli import entry\n"
             "entry()\n")


def _launch(run_dir: Path, zygote: str, *sets: str) -> subprocess.Popen:
    argv = [sys.executable, "-c", _LAUNCHER, "launch", "--out", str(run_dir), "--workers", "2",
            "--set", "run.target_accuracy=0", "--set", "data.clients=20", "--set", "algorithm.C=0.2"]
    for item in sets:
        argv += ["--set", item]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, SWITCH_ENV: zygote})


def _wall_free(events: list[dict]) -> list[dict]:
    return [{k: v for k, v in e.items() if k not in WALL_FIELDS} for e in events]


@pytest.mark.mnist
def test_a_run_from_the_zygote_is_the_run_without_it(tmp_path):
    runs = {}
    for zygote in ("1", "0"):
        run_dir = tmp_path / f"zygote-{zygote}"
        proc = _launch(run_dir, zygote, "run.rounds=2")
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output
        # With the zygote the config's checks ran in a process forked from it (launcher.resolve_config).
        assert f"launcher imported torch: {zygote == '0'}" in output
        runs[zygote] = run_dir
        for name in ("server", "worker-0", "worker-1"):
            said = "forked from the zygote" in (run_dir / "logs" / f"{name}.log").read_text()
            assert said == (zygote == "1"), name
    summaries = {z: json.loads((d / "summary.json").read_text()) for z, d in runs.items()}
    assert summaries["1"]["weights_sha256"] == summaries["0"]["weights_sha256"]
    assert _wall_free(read_events(runs["1"])) == _wall_free(read_events(runs["0"]))
    assert sorted(p.name for p in (runs["1"] / "logs").iterdir()) == sorted(p.name for p in (runs["0"] / "logs").iterdir())


def test_a_config_refused_in_the_zygote_is_refused_as_without_it(tmp_path):
    """Every problem named, the same words and exit status, and no run directory."""
    ended = {}
    for zygote in ("1", "0"):
        run_dir = tmp_path / f"zygote-{zygote}"
        ended[zygote] = subprocess.run(
            [sys.executable, "-m", "fedemu.launch", "launch", "--out", str(run_dir), "--set", "run.rounds=0",
             "--set", "model.name=lstm", "--set", "algorithm.name=fedavgg"],
            capture_output=True, text=True, timeout=120, env={**os.environ, SWITCH_ENV: zygote})
        assert not run_dir.exists()
    assert (ended["1"].returncode, ended["1"].stderr) == (ended["0"].returncode, ended["0"].stderr)
    assert ended["1"].returncode == 1
    for named in ("3 problems", "run.rounds = 0", "'lstm'", "'fedavgg'"):
        assert named in ended["1"].stderr


@pytest.mark.mnist
def test_a_run_stopped_while_its_nodes_run_ends_interrupted_and_leaves_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = _launch(run_dir, "1", "run.rounds=500", "run.clock=wall")
    deadline = time.monotonic() + 120
    while not any(e["event"] == "round" for e in read_events(run_dir)):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "no round finished"
        time.sleep(0.2)
    found = subprocess.run(["pgrep", "-f", f"node server .*--run-dir {run_dir}"], capture_output=True, text=True)
    server = int(found.stdout.split()[0])
    parent = int(_stat(server)[1])
    assert b"fedemu.launch.running.zygote" in Path(f"/proc/{parent}/cmdline").read_bytes()
    assert int(_stat(parent)[1]) == proc.pid  # the zygote is the launcher's child
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    deadline = time.monotonic() + 30
    while Path(f"/proc/{parent}").exists() or Path(f"/proc/{server}").exists():  # the zygote too
        assert time.monotonic() < deadline, "the zygote or a node outlived its launcher"
        time.sleep(0.1)


_ENDING = r"""
import atexit, logging, sys, threading, time
from fedemu.launch.running.lifecycle import exit_without_teardown

out = sys.argv[1]
logging.basicConfig(filename=out + ".log", level=logging.INFO)
atexit.register(lambda: open(out + ".atexit", "w").write("ran"))

def late():
    time.sleep(0.3)
    open(out + ".thread", "w").write("joined")

threading.Thread(target=late).start()  # not a daemon: a normal exit waits for it
logging.getLogger("t").info("the last log line")
print("the last words, unflushed", end="")
sys.stderr.write("and on stderr")

class Finalised:
    def __del__(self):
        open(out + ".teardown", "w").write("torn down")

kept = Finalised()  # freed only by the interpreter's teardown of this module
exit_without_teardown(3)
"""


def test_a_process_ends_without_teardown_but_loses_nothing(tmp_path):
    out = str(tmp_path / "p")
    ended = subprocess.run([sys.executable, "-c", _ENDING, out], capture_output=True, text=True, timeout=120)
    assert ended.returncode == 3, ended.stderr
    assert ended.stdout == "the last words, unflushed"
    assert ended.stderr == "and on stderr"
    assert Path(out + ".thread").read_text() == "joined"
    assert Path(out + ".atexit").read_text() == "ran"
    assert "the last log line" in Path(out + ".log").read_text()
    assert not Path(out + ".teardown").exists()  # what it saves: the modules' teardown


@pytest.mark.parametrize("argv, code", [(["check", "--set", "run.rounds=zero"], 2), (["no-such-command"], 2),
                                        (["--help"], 0)])
def test_the_command_exits_as_click_says(argv, code):
    ended = subprocess.run([sys.executable, "-m", "fedemu.launch", *argv], capture_output=True, text=True,
                           timeout=120)
    assert ended.returncode == code, ended.stderr
    assert (ended.stdout if code == 0 else ended.stderr).strip()
