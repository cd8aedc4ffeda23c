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
import resource
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest
import zmq

from fedemu.server.runlog import read_events
from fedemu.common.ml import data
from fedemu.common.ml.datasets.mnist import Mnist

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


@needs_root
@pytest.mark.slow
def test_a_file_system_full_at_the_start_leaves_no_partial_file_and_says_why(tmp_path):
    """Issue 41: a tmpfs full while the run started gave "the broker exited with code 1:
    (no output)" and left broker.tmp. Three sizes: the launcher's own files, the broker's
    address and the server's start each meet the full disk first (4 KB pages)."""
    cache = tmp_path / "cache"
    tiny_mnist(cache)
    for size in ("8k", "12k", "16k"):
        disk = tmp_path / f"disk-{size}"
        disk.mkdir()
        _mount(disk, f"size={size}")
        try:
            run_dir = disk / "run"
            proc, _ = tiny_launch(tmp_path, *SYNC, out=run_dir)
            output, _ = proc.communicate(timeout=120)
            assert proc.returncode == 1, output
            assert "No space left on device" in output or f"the file system of {run_dir} is full" in output, output
            assert_left_clean(run_dir)
            files = {p.relative_to(run_dir).as_posix(): p for p in run_dir.rglob("*") if p.is_file()}
            assert not [name for name in files if name.endswith(".tmp")], (size, sorted(files))
            whole = {"config.toml": tomllib.loads, "network.json": json.loads, "summary.json": json.loads,
                     "broker.endpoint": lambda text: text.endswith("\n") and text.startswith("tcp://") or 1 / 0}
            for name, parse in whole.items():
                if name in files:
                    parse(files[name].read_text())  # whole, or it raises
            assert "summary.reserve" not in files or files["summary.reserve"].stat().st_size == 4096
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
    with pytest.raises(RunLogError):  # the per-client rows and the timeline too: the log is closed
        log.table("clients.csv", ("round", "client", "outcome"), [(2, 0, "answered")])
    summary = log.summary(status="failed", reason=str(log.failed))
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert not (tmp_path / "summary.reserve").exists()  # its room was used for the summary


# --- resource exhaustion, and runs that trained nothing ----------------------------------------

REPOSITORY = Path(__file__).resolve().parents[1]  # the nodes import tests.greedy_clients from here
# What a run that ran out of memory names, whichever allocation failed first: a client's
# tensor, a node's thread, a library's map, an abort or the OOM killer.
MEMORY_WORDS = ("memory", "allocate", "thread", "bad_alloc", "map", "SIGABRT", "SIGKILL")


def _no_core_dumps() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))


@pytest.mark.slow
def test_workers_killed_by_sigbus_are_named_in_their_faults_and_the_summary(tmp_path):
    """Issue 41: a data cache cut short during a run kills the worker nodes, which map it,
    with SIGBUS at their next read of it; the run said "deadlock: 0 live clients"."""
    proc, run_dir = tiny_launch(tmp_path, *SYNC, preexec_fn=_no_core_dumps)
    wait_for(lambda: evaluations(run_dir) >= 1, "no round", proc=proc)
    os.truncate(data.folder("mnist", tmp_path / "cache") / "train_x.npy", 0)  # the server reads only test_x now
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode == 1, output
    assert_left_clean(run_dir)
    faults = [e for e in assert_log_whole(run_dir) if e["event"] == "fault"]
    assert {e["client"] for e in faults} == {0, 1, 2, 3}, faults
    for e in faults:
        assert e["reason"].startswith("noconnection: worker-") and "killed by SIGBUS (a memory-mapped file" in e["reason"]
    summary = summary_of(run_dir)
    assert summary["status"] == "failed" and summary["reason"].startswith("every client is lost: 4 clients lost: 2 "
                                                                          "noconnection: worker-"), summary
    assert "killed by SIGBUS" in summary["reason"] and "deadlock" not in summary["reason"]
    assert "warning: worker-0 killed by SIGBUS" in output and "warning: worker-1 killed by SIGBUS" in output


@pytest.mark.slow
def test_a_run_under_an_address_space_limit_ends_naming_the_cause(tmp_path):
    """Issue 41: under `prlimit --as=1200000000`, 100,000 clients at C = 0.01 held their
    run for good with only a `start` event: a worker node that could not encode a crashed
    client's DOWN left it counted busy, so virtual time never moved. The same limit here,
    with 1,000 one-example clients a round on each worker node: their held replies alone
    (0.8 MB each) are more than the limit leaves a node beside its libraries."""
    limit = 1_200_000_000  # bytes of address space, each process of the run

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        _no_core_dumps()

    proc, run_dir = tiny_launch(tmp_path, "data.partition='sample'", "data.clients=2000", "algorithm.C=1.0",
                                "run.rounds=5", preexec_fn=limited)
    output, _ = proc.communicate(timeout=300)  # a hang is what this guards against; the run ends in seconds
    # Which process meets the limit first is a race: the run fails (every client lost, or
    # the broker dead of a MemoryError), or goes on with the clients that could train (a
    # node's trainer holds the round's jobs until due, their one cohort fails to allocate,
    # and each then trains alone: worker/cohorts.py). Either way it ends and names why.
    assert proc.returncode in (0, 1), output
    assert_left_clean(run_dir)
    events = assert_log_whole(run_dir)
    assert events[-1]["event"] == "end", events[-3:]
    summary = summary_of(run_dir)
    assert summary["status"] in ("failed", "completed"), summary
    assert summary["status"] == "failed" or any(e["event"] == "fault" for e in events), summary
    named = summary["reason"] + " ".join(e["reason"] for e in events if e["event"] == "fault")
    assert any(word in named for word in MEMORY_WORDS), summary["reason"]
    assert not summary["reason"].startswith("deadlock: 0 live clients"), summary["reason"]


def _memory_cgroup(name: str, limit: int) -> tuple[Path, str] | None:
    """A new memory cgroup holding at most ``limit`` bytes, and the file a process joins
    it by; None where this host lets no test make one (not root, no memory controller)."""
    v1 = Path("/sys/fs/cgroup/memory")
    v2 = Path("/sys/fs/cgroup")
    try:
        if (v1 / "memory.limit_in_bytes").exists():
            group = v1 / name
            group.mkdir()
            (group / "memory.limit_in_bytes").write_text(str(limit))
        elif "memory" in (v2 / "cgroup.subtree_control").read_text().split():
            group = v2 / name
            group.mkdir()
            (group / "memory.max").write_text(str(limit))
            (group / "memory.swap.max").write_text("0")
        else:
            return None
    except OSError:
        return None
    return group, str(group / "cgroup.procs")


@pytest.mark.slow
def test_a_worker_killed_by_the_oom_killer_is_named(tmp_path):
    """A memory cgroup (where the host lets a test make one): the kernel's OOM killer ends
    a process of the run with SIGKILL; the run names it, by the cgroup's OOM-kill count."""
    made = _memory_cgroup(f"fedemu-test-{os.getpid()}", 2_000_000_000)
    if made is None:
        pytest.skip("no memory cgroup can be made here (needs root and a memory controller)")
    group, procs_file = made

    def join() -> None:
        Path(procs_file).write_text(str(os.getpid()))  # before exec: every process of the run is in it
        _no_core_dumps()

    try:
        # 1,000 one-example clients a round on each worker node: their held replies (0.8 MB
        # each) are more than the 2 GB the cgroup leaves beside the run's processes.
        proc, run_dir = tiny_launch(tmp_path, "data.partition='sample'", "data.clients=2000", "algorithm.C=1.0",
                                    "run.rounds=5", preexec_fn=join)
        output, _ = proc.communicate(timeout=300)
        assert_left_clean(run_dir)
        events = assert_log_whole(run_dir)
        summary = summary_of(run_dir)
        named = summary["reason"] + " ".join(e["reason"] for e in events if e["event"] == "fault")
        assert "SIGKILL (the kernel's OOM killer" in named, (summary, output[-2000:])
    finally:
        deadline = time.monotonic() + 30
        while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.1)
        group.rmdir()


@pytest.mark.slow
def test_a_run_whose_every_client_crashed_is_failed_not_completed(tmp_path):
    """Issue 41: every client crashed (out of memory) and the summary said `completed`,
    "ran 2 rounds", with 0 uploads."""
    proc, run_dir = tiny_launch(tmp_path, "algorithm.name=tests.greedy_clients:GreedyFedAvg", "run.rounds=2",
                                env={**os.environ, "PYTHONPATH": str(REPOSITORY)}, cwd=REPOSITORY)
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode == 1, output
    summary = summary_of(run_dir)
    assert summary["status"] == "failed" and summary["aggregations"] == 0 and summary["uploads"] == 0, summary
    assert summary["reason"].startswith("no client answered: every client asked (4) was lost before it could; 4 "
                                        "clients lost: 4 crash: MemoryError: Unable to allocate 4.00 EiB"), summary
    faults = [e for e in assert_log_whole(run_dir) if e["event"] == "fault"]
    assert len(faults) == 4 and all("MemoryError" in e["reason"] for e in faults)
    assert "warning: nothing was aggregated: the final model is the initial one" in output


def test_a_run_that_aggregated_nothing_says_why_and_is_failed_only_if_nobody_could_answer():
    from fedemu.server.outcome import losses, nothing_aggregated

    crashed = [{"client": 3, "reason": "crash: MemoryError: x"}, {"client": 5, "reason": "crash: MemoryError: x"},
               {"client": 6, "reason": "noconnection: worker-1 killed by SIGBUS"}]
    assert losses(crashed) == ("3 clients lost: 2 crash: MemoryError: x; 1 noconnection: worker-1 killed by SIGBUS")
    status, reason = nothing_aggregated("ran 2 rounds", {3, 5, 6}, crashed, "0 replies in time")
    assert status == "failed" and reason.startswith("no client answered: every client asked (3) was lost")
    # A deadline that cut every reply, or drop-outs: the run ran its course, and says it learnt nothing.
    status, reason = nothing_aggregated("ran 2 rounds", {3, 5, 6, 7}, crashed, "0 replies in time, 1 after the deadline")
    assert status == "completed"
    assert reason == ("ran 2 rounds; nothing was aggregated, the final model is the initial one (0 replies in time, "
                      "1 after the deadline)")


# --- stops during start-up ------------------------------------------------------------------


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (its SigCgt mask)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (signum - 1) & 1)


@pytest.mark.slow
def test_a_launcher_stopped_before_its_run_directory_exists_says_so(tmp_path):
    """Issue 41: the launcher died silently. Its handlers come first (a few ms after it
    starts); the run directory after the config, which builds the model (torch)."""
    proc, run_dir = tiny_launch(tmp_path, *SYNC)
    wait_for(lambda: _catches(proc.pid, signal.SIGTERM), "the launcher never caught SIGTERM", proc=proc)
    assert not run_dir.exists()
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert "fedemu launch: stopped by SIGTERM before the run directory was made; nothing ran" in output
    assert not run_dir.exists()


STARTING = {"config written": lambda run_dir: (run_dir / "config.toml").exists(),
            "server importing": lambda run_dir: (run_dir / "logs" / "server.out").exists()}


@pytest.mark.slow
@pytest.mark.parametrize("point", list(STARTING))
def test_a_stop_signal_during_start_up_ends_the_run_interrupted(tmp_path, point):
    """Issue 41: SIGTERM while the run started (its directory made, the server importing)
    gave `failed` ("the server node ended (killed by SIGTERM) without a summary")."""
    proc, run_dir = tiny_launch(tmp_path, *SYNC)
    wait_for(lambda: STARTING[point](run_dir), point, proc=proc, timeout=120)
    assert not any(e["event"] == "start" for e in read_events(run_dir))  # still starting
    proc.send_signal(signal.SIGTERM)
    stopped = time.monotonic()
    output, _ = proc.communicate(timeout=60)
    print(f"ended {time.monotonic() - stopped:.1f} s after the signal")  # a few seconds on a quiet host
    assert proc.returncode == 128 + signal.SIGTERM, output
    summary = summary_of(run_dir)
    assert summary["status"] == "interrupted" and "terminated (SIGTERM)" in summary["reason"], (summary, output)
    assert_left_clean(run_dir)


@pytest.mark.slow
def test_a_sweep_stopped_while_its_point_starts_up_says_interrupted_in_summary_and_index(tmp_path):
    """Issue 41: such points said `failed` in summary.json and `interrupted` in sweep.db."""
    from .test_sweep import rows, tiny_sweep

    spec = tiny_sweep(tmp_path)
    # Points that do not end by themselves (as tiny_launch's runs): the stop, not the point's
    # last round, ends the first. From a ready zygote its two rounds took 0.2 s, within a poll.
    spec.write_text(spec.read_text().replace("rounds = 2\n", "rounds = 100000\n"))
    out = tmp_path / "sw"
    argv = [sys.executable, "-m", "fedemu.launch", "sweep", str(spec), "--out", str(out), "--parallel", "1"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _LAUNCHED.append(proc)
    point = out / "runs" / "E=1"
    wait_for(lambda: (point / "logs" / "server.out").exists(), "the first point never started", proc=proc,
             timeout=120)
    assert not any(e["event"] == "start" for e in read_events(point))
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=90)
    assert proc.returncode == 128 + signal.SIGTERM, output
    summary = summary_of(point)
    assert summary["status"] == "interrupted" and "terminated (SIGTERM)" in summary["reason"], (summary, output)
    assert rows(out)["E=1"]["status"] == "interrupted"
    assert_left_clean(point)


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


# --- strangers and garbage at the broker during a run ------------------------------------------

# A virtual-time run: whatever a stranger or a buggy node does to it, it must end with the
# weights, and at the emulated time, of the same run left alone.
VIRTUAL_RUN = ["run.clock=virtual", "algorithm.name=fedavg", "run.rounds=8", "algorithm.deadline_s=60"]


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> dict:
    """The summary of VIRTUAL_RUN left alone."""
    proc, run_dir = tiny_launch(tmp_path_factory.mktemp("undisturbed"), *VIRTUAL_RUN)
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, output
    return summary_of(run_dir)


def assert_as_if_undisturbed(proc: subprocess.Popen, output: str, run_dir: Path, undisturbed: dict) -> None:
    assert proc.returncode == 0, output
    summary = summary_of(run_dir)
    assert summary["status"] == "completed" and summary["rounds"] == undisturbed["rounds"]
    assert (summary["weights_sha256"], summary["emulated_s"]) == (undisturbed["weights_sha256"],
                                                                 undisturbed["emulated_s"])
    assert summary["faults"] == 0
    assert_log_whole(run_dir)
    assert_left_clean(run_dir)


def endpoint_of(run_dir: Path, proc: subprocess.Popen) -> str:
    wait_for(lambda: (run_dir / "broker.endpoint").exists(), "the broker never started", proc=proc)
    return (run_dir / "broker.endpoint").read_text().strip()


def raw_dealer(ctx: zmq.Context, endpoint: str, name: bytes) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, name)
    sock.connect(endpoint)
    return sock


def forged_reply(client: int, round_: int, update: np.ndarray):
    from fedemu.common.messages import TRAIN, TrainReply

    return TrainReply(round=round_, client=client, task=TRAIN, update=update, num_samples=100, train_loss=0.0,
                      compute_s=0.0)


def malformed_to_server(src) -> list[list]:
    """What the issue froze runs with: a body that leaves an array frame unreferenced, and
    one that is not msgpack."""
    from fedemu.node import wire

    header = wire.pack_header(wire.USER, src, "server")
    return [[header, wire.pack_body("x")[0], b"\0" * 16], [header, b"\xc1"]]


@pytest.mark.slow
def test_strangers_and_a_buggy_node_cannot_stop_poison_or_freeze_a_virtual_time_run(tmp_path, undisturbed):
    """While a virtual-time run goes on: another user cannot even connect (where the test
    runs as root); a process of this user without the run's token says hello, asks for
    shutdown, forges replies (NaN, wrongly shaped) and sends malformed messages, and is
    refused; a node holding the token (a buggy one) asks for shutdown, forges replies
    and a WorkerReady, and sends what the issue froze runs with. The run ends as if
    left alone: the same weights, at the same emulated time."""
    from fedemu.node import Node, Pid, wire
    from fedemu.node.security import load_token

    from .test_security import connect_as_nobody

    proc, run_dir = tiny_launch(tmp_path, *VIRTUAL_RUN)
    endpoint = endpoint_of(run_dir, proc)
    if os.geteuid() == 0:
        assert connect_as_nobody(endpoint) == "PermissionError"
    ctx = zmq.Context()
    stranger = raw_dealer(ctx, endpoint, b"evil")
    evil = Pid("evil", 0)
    nan = np.full(199_210, np.nan, np.float32)
    buggy = None
    bursts = 0
    try:
        stranger.send_multipart(wire.encode(wire.CTL, evil, Pid("$broker", 0), {"op": "hello"}))
        assert stranger.poll(30_000) and wire.decode(stranger.recv_multipart())[1]["op"] == "refused"
        buggy = Node("buggy", endpoint, heartbeat_interval=0.2, heartbeat_timeout=30,
                     token=load_token(run_dir / "run.token")).start()
        buggy.shutdown_all()  # not a controller: refused
        server = None
        while proc.poll() is None:
            round_ = evaluations(run_dir) + 1
            for frames in [wire.encode(wire.CTL, evil, Pid("$broker", 0), {"op": "shutdown"}),
                           wire.encode(wire.USER, evil, "server", forged_reply(bursts % 4, round_, nan)),
                           wire.encode(wire.USER, evil, "server", forged_reply(bursts % 4, round_, nan[:7])),
                           *malformed_to_server(evil)]:
                try:
                    stranger.send_multipart(frames, flags=zmq.NOBLOCK)
                except zmq.Again:  # the broker has gone (the run ended): nothing waits
                    break
            while stranger.poll(0):
                stranger.recv_multipart()  # its refusals, read and ignored
            server = server or buggy.whereis("server", timeout=30)
            if server is not None:
                from fedemu.common.messages import WorkerReady

                for k in range(4):  # from a process the requests did not go to
                    buggy.send(server, forged_reply(k, round_, np.zeros(199_210, np.float32)))
                buggy.send(server, WorkerReady("worker-0", [[0, Pid("buggy", 1)]]))
                for frames in malformed_to_server(Pid("buggy", 0)):
                    buggy._outbox.append(frames)  # as they are, past the node's own encoding
                buggy._wake()
                bursts += 1
            time.sleep(0.05)
        output, _ = proc.communicate(timeout=180)
    finally:
        stranger.close()
        ctx.term()
        if buggy is not None:
            buggy.close()
    assert_as_if_undisturbed(proc, output, run_dir, undisturbed)
    assert bursts >= 1
    broker_log = (run_dir / "logs" / "broker.log").read_text()
    assert "refused hello from <evil.0>" in broker_log and "node evil joined" not in broker_log
    assert "control 'shutdown' is for the run's controllers only" in broker_log
    assert "shutdown requested by <server.0>" in broker_log and "shutdown requested by <buggy" not in broker_log
    server_log = (run_dir / "logs" / "server.log").read_text()
    assert "node server dropped a message (malformed)" in server_log
    assert "ignoring a WorkerReady for node 'worker-0' from <buggy.0>" in server_log


@pytest.mark.slow
def test_a_virtual_time_run_ends_as_if_undisturbed_while_a_stranger_sends_garbage_to_its_broker(tmp_path, undisturbed):
    proc, run_dir = tiny_launch(tmp_path, *VIRTUAL_RUN)
    endpoint = endpoint_of(run_dir, proc)
    rng = random.Random(20261124)
    ctx = zmq.Context()
    sock = raw_dealer(ctx, endpoint, b"fuzzer")
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
                frames = [msgpack.packb(fields[: rng.randint(0, 7)]),
                          msgpack.packb({"op": rng.choice(["hb", "stats", "x", "hello", "shutdown", "idle"])})]
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
    assert_as_if_undisturbed(proc, output, run_dir, undisturbed)
    assert sent >= 100
    assert "dropped message" in (run_dir / "logs" / "broker.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", ["server", "nodes"])
def test_a_diverging_clients_nan_update_is_refused_and_named(tmp_path, aggregation):
    """At a learning rate of 1,000 training diverges: a client's update holds NaN or
    infinite values. It never touches the model (summed on the server or on the worker
    node): the client's fault event names the cause, a hint names the rate, the summary
    counts the faults, and the console says so."""
    proc, run_dir = tiny_launch(tmp_path, "run.clock=virtual", "algorithm.name=fedavg", "run.rounds=2",
                                "algorithm.lr=1000", f"run.aggregation={aggregation}")
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, output
    events = assert_log_whole(run_dir)
    faults = [e for e in events if e["event"] == "fault"]
    assert faults and all("update refused:" in e["reason"] and "values are NaN or infinite (training diverged)"
                          in e["reason"] for e in faults)
    [hint] = [e for e in events if e["event"] == "hint"]
    assert "a smaller algorithm.lr (now 1000) may help" in hint["message"]
    summary = summary_of(run_dir)
    assert summary["faults"] == len(faults) and np.isfinite(summary["final_accuracy"])
    rounds = [e for e in events if e["event"] == "round"]
    refused = {(e["round"], e["client"]) for e in faults}
    for r in rounds:  # a refused client is dropped, never among those whose update counted
        assert not {k for k in r["answered"] if (r["round"], k) in refused}
        assert {k for (round_, k) in refused if round_ == r["round"]} <= set(r["dropped"])
    assert f"fault: client {faults[0]['client']} in round {faults[0]['round']}: update refused:" in output


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
