"""What one OS process of a run does: the broker, the server node, or a worker node.

The launcher starts each as ``fedemu broker ...`` / ``fedemu node ROLE ...``. The broker
takes its settings on its command line and in ``network.json``; a node reads its own from
the run directory's ``settings.json`` (written once by the launcher from the resolved
config: ``config.settings``), without the config's loading and validation. Each logs to
``logs/<name>.log`` there.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import tomllib
from pathlib import Path

import numpy as np

from fedemu.common.ml import split
from fedemu.node import Broker, Node, NodeError
from fedemu.node.net.network_spec import NetworkSpec
from fedemu.node.security import RunKeys, load_token
from fedemu.server.runlog import RunLog, write_text_atomically
from fedemu.server.tensorboard import TensorBoardLog

from ..config.settings import POPULATION_FILE, read_process_settings
from .lifecycle import STOP_SIGNALS, parent_died, stop_reason

log = logging.getLogger("fedemu.launch")


def setup_logging(run_dir: Path | None, name: str, verbose: bool = False, stream_info: bool = False) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    handlers[0].setLevel(logging.DEBUG if verbose else logging.INFO if stream_info else logging.WARNING)
    if run_dir is not None:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(run_dir / "logs" / f"{name}.log")
        file_handler.setLevel(logging.DEBUG if verbose else logging.INFO)
        handlers.append(file_handler)
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
        handlers=handlers,
        force=True,
    )


def run_broker(bind: str, endpoint_file: Path | None, heartbeat_interval: float, heartbeat_timeout: float,
               max_message_bytes: int, network_file: Path | None = None, keys_file: Path | None = None,
               token_file: Path | None = None, controllers: tuple[str, ...] | None = None) -> None:
    network, clock = None, "wall"
    if network_file is not None:
        spec = json.loads(network_file.read_text())
        network = NetworkSpec.from_config(spec["network"], spec["num_clients"], spec["seed"], spec["time_scale"])
        clock = spec.get("clock", "wall")
    broker = Broker(bind, heartbeat_interval=heartbeat_interval, heartbeat_timeout=heartbeat_timeout,
                    max_message_bytes=max_message_bytes, network=network, clock=clock,
                    token=_token(token_file), controllers=controllers,
                    **({"keys": _keys(keys_file)} if keys_file else {}))
    if endpoint_file is not None:
        write_text_atomically(endpoint_file, broker.endpoint + "\n")  # readers never see half an address
    print(broker.endpoint, flush=True)
    stopped_by: list[int] = []

    def stop(signum: int, _frame) -> None:
        stopped_by.append(signum)
        broker.stop()

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)
    broker.serve_forever()
    if stopped_by:  # die of the signal, once closed: the launcher then sees how the broker ended
        log.info("broker stopped by %s", signal.Signals(stopped_by[0]).name)
        signal.signal(stopped_by[0], signal.SIG_DFL)
        os.kill(os.getpid(), stopped_by[0])


def read_config(run_dir: Path) -> dict:
    return tomllib.loads((run_dir / "config.toml").read_text())


def _settings(run_dir: Path, kind: str):
    return read_process_settings(run_dir, kind)


def _keys(keys_file: Path | None):
    if keys_file is None:
        return None
    return RunKeys.load(keys_file)


def _token(token_file: Path | None) -> str | None:
    if token_file is None:
        return None
    return load_token(token_file)


def _node(name: str, broker: str, settings, keys_file: Path | None = None, pool_nice: int = 0,
          token_file: Path | None = None) -> Node:
    secured = {"keys": _keys(keys_file)} if keys_file else {}
    # exit_on_failure: a node whose own machinery fails (out of memory) ends its process,
    # which its launcher sees and names (Node._fail).
    return Node(name, broker, heartbeat_interval=settings.heartbeat_interval_s,
                heartbeat_timeout=settings.heartbeat_timeout_s, pool_size=1, pool_nice=pool_nice,
                token=_token(token_file), exit_on_failure=True, **secured).start()


def _set_torch_threads(settings, workers: int) -> None:
    # lazy: imports torch (~1.2 s), which the module's other paths do without
    import torch

    # Virtual time promises the same weights on any host and placement: a thread count
    # that followed the cores would change how float sums are split, so it is one.
    auto = 1 if settings.clock == "virtual" else max(1, (os.cpu_count() or 1) // max(workers, 1))
    threads = settings.torch_threads or auto
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)


def _device(settings, node: str, server: bool = False):
    """The torch device run.device names on this host, prepared (devices.use_device). The
    server only evaluates: on a host without the GPU the workers train on (a laptop
    launching onto GPU hosts), it evaluates on the CPU and says so."""
    # lazy: imports torch (~1.2 s), which the module's other paths do without
    from fedemu.common.ml import devices

    try:
        device = devices.torch_device(settings.device)
    except devices.DeviceUnavailable as exc:
        if not server:
            raise
        log.warning("the server evaluates on the CPU: %s", exc)
        device = devices.torch_device("cpu")
    log.info("%s computes on %s", node, devices.use_device(device))
    return device


def run_server_node(broker: str, run_dir: Path, workers: int, keys_file: Path | None = None,
                    token_file: Path | None = None) -> int:
    """The server node: hosts the server process; returns the exit code."""
    # lazy: imports torch (~1.2 s), which the module's other paths do without
    from fedemu.common import algorithms
    from fedemu.server.async_engine import AsyncEngine, Concurrency
    from fedemu.server.engine import Stop
    from fedemu.server.round_engine import RoundEngine

    from fedemu.worker.hosting import warm_up

    own = _settings(run_dir, "server")
    algo = own.algorithm
    _set_torch_threads(own.node, 1)
    device = _device(own.node, "the server", server=True)
    # With data.folds, the held-out fold is the test set (Nilsson's cross-validation).
    run_data, _ = split.run_data(own.data_spec(), shares=False)
    rule = algorithms.get(algo["name"]).from_config(algo)  # a plug-in is imported here, on the server's host
    population = run_dir / POPULATION_FILE
    # the trace files' sha256, for the start event
    settings = own.engine_settings(workers, str(device),
                                   json.loads(population.read_text())["traces"] if population.exists() else None)
    runlog = RunLog(run_dir)
    tensorboard = None
    if own.tensorboard:
        tensorboard = TensorBoardLog(run_dir, (run_dir / "config.toml").read_text())
        runlog.listeners.append(tensorboard.on_event)
    model = own.model_spec()
    if not rule.synchronous:
        engine = AsyncEngine(settings, rule, model, run_data, runlog, lr=algo["lr"], lr_decay=algo["lr_decay"],
                             on_deadlock=algo["on_deadlock"], concurrency=Concurrency.from_config(algo))
    else:
        engine = RoundEngine(settings, rule, model, run_data, runlog)
    # Round 1's evaluation is not a cold start.
    warm_up(run_data, np.arange(min(10, len(run_data.train_y))), model, device)
    machines = run_dir / "machines.json"
    if machines.exists():  # where every client runs is part of the experiment (Nilsson)
        runlog.event("machines", **json.loads(machines.read_text()))
    node = _node("server", broker, own.node, keys_file, token_file=token_file)
    result: dict = {}
    finished = threading.Event()

    def serve(proc) -> None:
        try:
            result.update(engine.run(proc))
        except Exception as exc:  # even the summary could not be written (a dead disk)
            log.exception("the server could not finish its run")
            result.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
        finally:
            finished.set()

    pid = node.spawn(serve, name="server")

    def stop(status: str, reason: str) -> None:
        node.send(pid, Stop(status, reason))

    signalled = threading.Event()

    def on_signal(signum: int, _frame) -> None:
        # Off the signal handler: it runs between any two bytecodes of the main thread,
        # which may hold the very lock a delivery takes (a launcher killed outright sends
        # a parent-death signal per thread of it: the second one hung the server). Once.
        if not signalled.is_set():
            signalled.set()
            threading.Thread(target=lambda: stop("interrupted", stop_reason(signum)), daemon=True).start()

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    node.on_close.append(lambda reason: stop("failed", f"lost the broker: {node.broker_lost}" if node.broker_lost
                                             else f"server node closed: {reason}"))
    # The engine writes its summary even when the node closed. Timed waits: a stop signal
    # may land on any thread, and its handler runs only when this one runs Python code.
    while not finished.wait(0.1):
        pass
    runlog.close()
    if tensorboard is not None:
        tensorboard.close()
    # A launcher killed outright took the broker with it (and each node has its own
    # parent-death signal): asking a dead broker to stop the nodes would only wait.
    if not node.closed.is_set() and not parent_died():
        node.shutdown_all()
        node.wait(10)
    node.close("run finished")
    return 0 if result.get("status") == "completed" else 1


def run_worker_node(broker: str, run_dir: Path, index: int, workers: int, keys_file: Path | None = None,
                    token_file: Path | None = None) -> int:
    # lazy: imports torch (~1.2 s), which the module's other paths do without
    from fedemu.worker.hosting import host_clients
    from fedemu.worker.placement import placement

    own = _settings(run_dir, "worker")
    stragglers = own.straggler_spec()
    _set_torch_threads(own.node, workers)
    device = _device(own.node, f"worker-{index}")
    run_data, shards = split.run_data(own.data_spec())
    node = _node(f"worker-{index}", broker, own.node, keys_file, pool_nice=own.pool_nice, token_file=token_file)
    stopped_by: list[int] = []

    def stop(signum: int, _frame) -> None:
        stopped_by.append(signum)
        threading.Thread(target=node.close, args=(stop_reason(signum),), daemon=True).start()

    for sig in STOP_SIGNALS:
        # The server decides when the run ends; a worker only leaves when told, or
        # when its node is closed (broker lost, shutdown, a signal).
        signal.signal(sig, stop)
    try:
        host_clients(node, run_data, shards, placement(own.clients, workers)[index],
                     own.model_spec(), startup_timeout=own.startup_timeout_s,
                     stragglers=stragglers, compute=own.compute_model(run_dir),
                     restarts=own.restart_clients, device=device, cohorts=own.cohorts)
    except (NodeError, TimeoutError):
        if not node.closed.is_set():
            raise
        # Closed while it started up (a stop signal, the broker lost): how it closed is its end.
    node.wait()
    if stopped_by:  # die of the signal, once closed: the launcher then names what stopped this node
        signal.signal(stopped_by[0], signal.SIG_DFL)
        os.kill(os.getpid(), stopped_by[0])
    if node.failure:  # the last line of its output: what the launcher reports as its cause
        print(f"fedemu: node {node.name} failed: {node.failure}", file=sys.stderr, flush=True)
        return 1
    return 0
