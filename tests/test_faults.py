"""The faults users cause, on real processes: stop signals to every kind of process, a
full or read-only disk, a damaged data cache, two launches into one directory, garbage
at the broker. Whatever happens, the run ends with a status and a reason a user can
read, every line of its log parses, and none of its processes is left running.

Each signal goes to its process at a point drawn from a seeded generator (a round
after the first); bench/fault_soak.py runs the whole matrix, many times, at random points.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from fedemu.server.runlog import read_events
from fedemu.worker.ml import data
from fedemu.worker.ml.datasets.mnist import Mnist

from .conftest import missing_prerequisite, needs
from .test_launch import launch, node_pid, processes_of
from .test_sweep import tiny_mnist

# Tiny runs (4 clients, 400 examples), long enough to be hit mid-way; a lost node is
# seen within the 2 s heartbeat timeout.
TINY = ["model.name=2nn", "data.clients=4", "algorithm.C=0.5", "algorithm.E=1", "algorithm.B=10",
        "run.heartbeat_timeout_s=2", "run.torch_threads=1"]
SYNC = ["algorithm.name=fedavg", "run.rounds=100000"]
ASYNC = ["algorithm.name=coop", "algorithm.b_l=1", "algorithm.b_u=3", "algorithm.eval_every_uploads=2",
         "run.rounds=100000"]
ALGORITHMS = {"fedavg": SYNC, "coop": ASYNC}


_LAUNCHED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_launcher_outlives_its_test():
    """A test that fails half-way must not leave its run going: the launcher is killed
    (its processes follow it, by their parent-death signal)."""
    yield
    while _LAUNCHED:
        proc = _LAUNCHED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def tiny_launch(tmp_path: Path, *sets: str, out: Path | None = None, **popen) -> tuple[subprocess.Popen, Path]:
    cache = tmp_path / "cache"
    if not data.folder("mnist", cache).exists():
        tiny_mnist(cache)
    run_dir = out or tmp_path / "run"
    proc = launch(run_dir, f"data.cache_dir='{cache}'", *TINY, *sets, **popen)
    _LAUNCHED.append(proc)
    return proc, run_dir


def wait_for(condition, what: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the launcher ended first: {proc.stdout.read()}")
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def evaluations(run_dir: Path) -> int:
    return max((e["round"] for e in read_events(run_dir) if e["event"] == "round"), default=0)


def broker_pid(run_dir: Path) -> int:
    out = subprocess.run(["pgrep", "-f", f"broker --bind .*{run_dir}"], capture_output=True, text=True).stdout.split()
    assert len(out) == 1, f"expected one broker, found {out}"
    return int(out[0])


def assert_left_clean(run_dir: Path, within: float = 10.0) -> None:
    """No process of the run is alive ``within`` seconds from now."""
    deadline = time.monotonic() + within
    while processes_of(run_dir):
        assert time.monotonic() < deadline, f"processes of the run still alive: {processes_of(run_dir)}"
        time.sleep(0.1)


def assert_log_whole(run_dir: Path) -> list[dict]:
    """Every line of events.jsonl is whole and parses."""
    text = (run_dir / "events.jsonl").read_text()
    assert text == "" or text.endswith("\n"), "a torn last line"
    return [json.loads(line) for line in text.splitlines()]


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


# --- stop signals to every kind of process ------------------------------------------------

# (process, signal, algorithm): every process and signal once, the algorithms alternating.
CASES = [
    ("launcher", "SIGTERM", "fedavg"), ("launcher", "SIGHUP", "coop"), ("launcher", "SIGKILL", "fedavg"),
    ("broker", "SIGTERM", "coop"), ("broker", "SIGHUP", "fedavg"), ("broker", "SIGKILL", "coop"),
    ("server", "SIGTERM", "fedavg"), ("server", "SIGHUP", "coop"), ("server", "SIGKILL", "fedavg"),
    ("worker", "SIGTERM", "coop"), ("worker", "SIGHUP", "fedavg"), ("worker", "SIGKILL", "coop"),
]

SIGNAL_WORDS = {"SIGTERM": "terminated (SIGTERM)", "SIGHUP": "hung up (SIGHUP", "SIGKILL": "SIGKILL"}


def expected_outcome(kind: str, signame: str, launcher_pid: int) -> tuple[str, list[str]]:
    """(status, words the reason must hold) when ``signame`` hits ``kind`` mid-run."""
    if kind == "launcher":
        if signame == "SIGKILL":  # its children get SIGTERM from the kernel
            return "interrupted", [f"its launcher (pid {launcher_pid}) died"]
        return "interrupted", [SIGNAL_WORDS[signame]]
    if kind == "broker":
        how = f"killed by {signame}"
        return "failed", [f"the broker process died ({how})", "lost the broker"]
    if kind == "server":
        if signame == "SIGKILL":
            return "failed", ["the server node ended (killed by SIGKILL) without a summary"]
        return "interrupted", [SIGNAL_WORDS[signame]]
    return "completed", ["wall-time budget"]  # a worker: its clients are lost, the run goes on


@pytest.mark.slow
@pytest.mark.parametrize("kind, signame, algorithm", CASES, ids=["-".join(c) for c in CASES])
def test_a_stop_signal_to_any_process_ends_the_run_cleanly(tmp_path, kind, signame, algorithm):
    point = random.Random(f"{kind}-{signame}-{algorithm}").randint(2, 5)  # evaluations before the signal
    # A worker's loss must be seen (2 s heartbeat timeout) before the run's end: the
    # run ends on wall time, as "completed", seconds after the signal.
    budget = ["run.max_wall_s=12"] if kind == "worker" else []
    proc, run_dir = tiny_launch(tmp_path, *ALGORITHMS[algorithm], *budget)
    try:
        wait_for(lambda: evaluations(run_dir) >= point, f"evaluation {point} never came", proc=proc)
        target = {"launcher": lambda: proc.pid, "broker": lambda: broker_pid(run_dir),
                  "server": lambda: node_pid(run_dir, "server"),
                  "worker": lambda: node_pid(run_dir, "worker-1")}[kind]()
        os.kill(target, getattr(signal, signame))
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    status, words = expected_outcome(kind, signame, proc.pid)
    if kind == "launcher" and signame == "SIGKILL":
        assert proc.returncode == -signal.SIGKILL
        wait_for(lambda: (run_dir / "summary.json").exists(), "no summary after the launcher was killed", 20)
    else:
        assert (proc.returncode == 0) == (status == "completed"), output
    assert_left_clean(run_dir)
    events = assert_log_whole(run_dir)
    summary = summary_of(run_dir)
    assert summary["status"] == status, (summary, output)
    for word in words:
        assert word in summary["reason"], (summary["reason"], output)
    if not (kind == "server" and signame == "SIGKILL"):  # a server killed outright writes nothing more
        assert events[-1]["event"] == "end"
    if kind == "worker":  # worker-1's clients (2, 3) were lost; the others went on
        faults = {e["client"] for e in events if e["event"] == "fault"}
        assert faults == {2, 3}, events
        assert evaluations(run_dir) > point
    if kind == "broker":
        assert summary["faults"] == 0  # the clients were not at fault
    if kind == "launcher" and signame != "SIGKILL":
        assert f"{signame}: stopping the run" in output


# --- the disk -------------------------------------------------------------------------------


def _mount(folder: Path, options: str) -> None:
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True, text=True)
    if done.returncode != 0:
        missing_prerequisite(f"cannot mount a tmpfs here: {done.stderr.strip()}")


def _unmount(folder: Path) -> None:
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


needs_root = needs("needs root to mount a small tmpfs" if os.geteuid() != 0 else None)


@needs_root
@pytest.mark.slow
def test_a_full_disk_ends_the_run_with_a_reason_that_names_the_file(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    _mount(disk, "size=96k")
    try:
        run_dir = disk / "run"
        proc, _ = tiny_launch(tmp_path, *SYNC, out=run_dir)
        output, _ = proc.communicate(timeout=180)  # fills in a few hundred rounds
        assert proc.returncode != 0, output
        assert_left_clean(run_dir)
        assert_log_whole(run_dir)
        summary = summary_of(run_dir)  # written into the room reserved for it
        assert summary["status"] == "failed"
        assert "No space left on device" in summary["reason"] and str(run_dir) in summary["reason"], summary
        assert summary["rounds"] >= 1
    finally:
        _unmount(disk)


def test_a_failed_write_keeps_every_line_whole_and_closes_the_log(tmp_path):
    """The log's own write path on a real failing file (/dev/full answers every write
    with ENOSPC): the error names the file, nothing torn is left, later events refuse."""
    from fedemu.server.runlog import RunLog, RunLogError

    log = RunLog(tmp_path)
    log.event("start", clients=4)
    events = tmp_path / "events.jsonl"
    good = events.read_text()
    log._events._f.close()
    log._events._f = open("/dev/full", "ab")  # stands in for the disk filling up under the open log
    with pytest.raises(RunLogError, match=rf"cannot write {events}: No space left on device"):
        log.event("round", round=1, padding="x" * 10_000)
    assert events.read_text() == good
    with pytest.raises(RunLogError):
        log.event("round", round=2)
    with pytest.raises(RunLogError):  # the per-client rows too: the log is closed
        log.clients([(2, 0, "answered", 10, 0.5, 1.0, 1.0)])
    summary = log.summary(status="failed", reason=str(log.failed))
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert not (tmp_path / "summary.reserve").exists()  # its room was used for the summary


# --- the data cache -------------------------------------------------------------------------

SMALL = {"train": 6, "test": 4}


def _small_cache(tmp_path: Path, monkeypatch) -> tuple[Path, list]:
    monkeypatch.setattr(Mnist, "sizes", SMALL)
    rng = np.random.default_rng(0)
    arrays = {f"{s}_x": rng.integers(0, 256, (n, 28, 28), dtype=np.uint8) for s, n in SMALL.items()}
    arrays |= {f"{s}_y": (np.arange(n) % 10).astype(np.uint8) for s, n in SMALL.items()}
    calls: list = []

    def source(progress):
        calls.append(1)
        return arrays, {"source": "fake"}

    monkeypatch.setattr(Mnist, "sources", lambda self: [("fake", source)])
    return data.fetch("mnist", tmp_path, progress=lambda _: None), calls


def test_a_truncated_cache_is_named_and_fetched_again(tmp_path, monkeypatch):
    folder, calls = _small_cache(tmp_path, monkeypatch)
    path = folder / "train_x.npy"
    size = path.stat().st_size
    os.truncate(path, 100)
    with pytest.raises(data.DatasetError, match=rf"{path} has 100 bytes; it had {size:,} when cached.*--force"):
        data.load("mnist", tmp_path, auto_fetch=False)
    lines: list[str] = []
    data.fetch("mnist", tmp_path, progress=lines.append)
    assert calls == [1, 1]
    assert f"mnist: the cache in {folder} is damaged: {path} has 100 bytes" in lines[0]
    assert data.load("mnist", tmp_path, auto_fetch=False).train_x.shape == (6, 28, 28)
    assert sorted(p.name for p in folder.parent.iterdir()) == ["mnist"]  # the damaged copy is gone


def test_a_flipped_byte_is_caught_by_the_hash_and_force_fetches_anyway(tmp_path, monkeypatch):
    folder, calls = _small_cache(tmp_path, monkeypatch)
    path = folder / "test_x.npy"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # same size: only the hash can tell
    path.write_bytes(bytes(raw))
    assert data.verify(folder, Mnist()).startswith(f"{path} has sha256")
    data.fetch("mnist", tmp_path, progress=lambda _: None)
    assert calls == [1, 1] and data.verify(folder, Mnist()) is None
    data.fetch("mnist", tmp_path, progress=lambda _: None)
    assert calls == [1, 1]  # verified: nothing to do
    data.fetch("mnist", tmp_path, progress=lambda _: None, force=True)
    assert calls == [1, 1, 1]


def test_a_cache_without_recorded_hashes_is_not_trusted(tmp_path, monkeypatch):
    folder, calls = _small_cache(tmp_path, monkeypatch)
    (folder / "SOURCE.json").write_text('{"source": "by hand"}')
    with pytest.raises(data.DatasetError, match="records no file hashes"):
        data.load("mnist", tmp_path, auto_fetch=False)
    data.fetch("mnist", tmp_path, progress=lambda _: None)
    assert calls == [1, 1]


# --- two launches, two sweeps ---------------------------------------------------------------


@pytest.mark.slow
def test_a_second_launch_into_the_same_directory_fails_at_once_naming_the_first(tmp_path):
    # The first run cannot end on its own while the second starts, however slow the host
    # is to start a launcher: it has 100,000 rounds, and is stopped by SIGTERM after.
    first, run_dir = tiny_launch(tmp_path, *SYNC)
    wait_for(lambda: (run_dir / ".lock").exists() and (run_dir / ".lock").read_text().strip(), "no lock", proc=first)
    second, _ = tiny_launch(tmp_path, *SYNC, out=run_dir)
    output2, _ = second.communicate(timeout=120)
    assert first.poll() is None, "the first run ended before the second was refused"
    first.send_signal(signal.SIGTERM)
    output1, _ = first.communicate(timeout=120)
    assert second.returncode != 0, output2
    assert f"{run_dir} is in use by another run (pid {first.pid})" in output2
    events = assert_log_whole(run_dir)
    assert [e["event"] for e in events].count("start") == 1
    assert summary_of(run_dir)["status"] == "interrupted", output1
    # Once it is over, the directory holds a finished run: a third launch is refused too.
    third, _ = tiny_launch(tmp_path, out=run_dir)
    output3, _ = third.communicate(timeout=60)
    assert third.returncode != 0 and "already holds a run" in output3


@pytest.mark.slow
def test_a_second_sweep_into_the_same_directory_fails_naming_the_first(tmp_path):
    from .test_sweep import tiny_sweep

    spec = tiny_sweep(tmp_path)
    # Points too long to end on their own while the second sweep starts, however slow the
    # host; the first sweep is stopped by SIGTERM once the second has been refused.
    spec.write_text(spec.read_text().replace("rounds = 2\n", "rounds = 100000\n"))
    argv = [sys.executable, "-m", "fedemu.launch", "sweep", str(spec), "--out", str(tmp_path / "sw")]
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _LAUNCHED.append(first)
    wait_for(lambda: (tmp_path / "sw" / ".lock").exists() and (tmp_path / "sw" / ".lock").read_text().strip(),
             "no sweep lock", proc=first)
    second = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert first.poll() is None, "the first sweep ended before the second was refused"
    first.send_signal(signal.SIGTERM)
    output, _ = first.communicate(timeout=120)
    assert second.returncode != 0, second.stdout + second.stderr
    assert f"is in use by another `fedemu sweep` (pid {first.pid})" in second.stderr


# --- garbage at the broker during a run -----------------------------------------------------


@pytest.mark.slow
def test_a_run_completes_while_a_stranger_sends_garbage_to_its_broker(tmp_path):
    proc, run_dir = tiny_launch(tmp_path, "algorithm.name=fedavg", "run.rounds=15")
    wait_for(lambda: evaluations(run_dir) >= 1, "no round", proc=proc)
    rng = random.Random(20261124)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect((run_dir / "broker.endpoint").read_text().strip())
    import msgpack

    sent = 0
    try:
        while proc.poll() is None and sent < 5000:
            kind = rng.random()
            if kind < 0.3:  # random bytes
                frames = [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 4))]
            elif kind < 0.7:  # a header that looks almost right
                fields = [rng.choice([1, 2, "x", None]), rng.choice([0, 1, 9]), rng.choice(["server", "worker-0", 7]),
                          rng.randint(-2, 5), rng.choice(["", "worker-1", None]), rng.choice([0, 1, "server", []])]
                frames = [msgpack.packb(fields[: rng.randint(0, 7)]), msgpack.packb({"op": rng.choice(["hb", "stats", "x"])})]
            else:  # a huge frame count or size claim
                frames = [msgpack.packb([1, 0, "intruder", 1, "", "server"]), b"\x00" * rng.randint(0, 4096)] * rng.randint(1, 8)
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK)  # never wait on a broker that has left
            except zmq.Again:
                time.sleep(0.01)
                continue
            sent += 1
            if sent % 100 == 0:
                time.sleep(0.01)
        output, _ = proc.communicate(timeout=180)
    finally:
        sock.close()
        ctx.term()
    assert proc.returncode == 0, output
    assert summary_of(run_dir)["status"] == "completed"
    assert_log_whole(run_dir)
    assert_left_clean(run_dir)
    assert sent >= 100
    assert "dropped message" in (run_dir / "logs" / "broker.log").read_text()


# --- across machines ------------------------------------------------------------------------

from .test_machines import assert_hosts_left_clean, hosts, local_processes_of, needs_hosts  # noqa: E402,F401


@needs_hosts
@pytest.mark.slow
def test_a_launcher_killed_outright_leaves_nothing_on_any_host(hosts, tmp_path):  # noqa: F811
    tiny_mnist(tmp_path / "cache")  # on the file system the test hosts share
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "fedemu.launch", "launch", "--out", str(run_dir), "--machines", "h1,h2",
            "--ssh-config", str(hosts.ssh_config), "--workers", "1", "--set", "run.target_accuracy=0",
            "--set", "run.heartbeat_interval_s=0.2", "--set", f"data.cache_dir='{tmp_path / 'cache'}'"]
    for item in [*TINY, *SYNC]:
        argv += ["--set", item]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _LAUNCHED.append(proc)
    try:
        wait_for(lambda: evaluations(run_dir) >= 2, "round 2 never came", timeout=180, proc=proc)
        assert any("node worker" in cmd for cmd in hosts.processes("h2").values())
        proc.kill()
        proc.communicate(timeout=30)
        killed = time.monotonic()
        for name in hosts.names:
            left = hosts.wait_until_empty(name, timeout=10)
            assert not left, f"processes left on {name}: {left}"
        deadline = killed + 10
        while local_processes_of(run_dir):
            assert time.monotonic() < deadline, local_processes_of(run_dir)
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_log_whole(run_dir)
    summary = summary_of(run_dir)
    assert summary["status"] == "interrupted" and f"its launcher (pid {proc.pid}) died" in summary["reason"]
