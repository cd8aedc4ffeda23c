"""The node's process table: which processes live here, under which names, and who
watches whom. Spawning, registering, exits and monitors, local and across nodes.

Apart from the node (runtime.py) because these tables and their one lock are a job of
their own: every change to who is alive, what a name means or who gets a ``Down`` is
made here, so exactly one ``Down`` per monitor can be checked in one place. Control
messages about monitors (``monitor``, ``demonitor``, ``down`` from other nodes) are
decoded by node_control.py and applied here.
"""
from __future__ import annotations

import itertools
import logging
import threading
from typing import Any, Callable

from .process import Behaviour, BehaviourProcess, Down, NodeError, Process, ThreadProcess, crash_reason
from ..wire import BROKER_PID, Pid

log = logging.getLogger("fedemu.node")


class ProcessTable:
    """Node's processes, names and monitors (a mixin of :class:`~fedemu.node.runtime.Node`;
    ``self._state`` guards them)."""

    def _init_table(self) -> None:
        self._ids = itertools.count(1)  # id 0 is the node itself
        self._procs: dict[int, Process] = {}
        self._names: dict[str, Process] = {}
        self._monitors: dict[int, list[tuple[int, Pid]]] = {}  # local target id -> (ref, watcher)
        self._out_monitors: dict[int, tuple[Pid, Pid]] = {}  # ref -> (watcher, remote target)

    def spawn(self, fn: Callable, *args: Any, name: str | None = None, link: int | None = None) -> Pid:
        """Run ``fn(proc, *args)`` in a thread process; it ends when ``fn`` returns
        (reason ``normal``) or raises (reason ``crash: ...``)."""
        proc = ThreadProcess(self, Pid(self.name, next(self._ids)))
        self._busy_up()  # runnable from birth until it blocks in a receive, or ends
        try:
            self._add(proc, name, link)
        except Exception:
            self._busy_down()
            raise

        def run() -> None:
            reason = "normal"
            try:
                fn(proc, *args)
            except Exception as exc:
                reason = crash_reason(exc)
            try:
                self._exit(proc, reason)
            except BaseException as exc:  # its DOWN could not be sent: the node's books are broken
                self._fail(f"ending {proc.pid}", exc)
            self._busy_down()

        try:
            threading.Thread(target=run, name=f"{self.name}-{proc.pid.id}", daemon=True).start()
        except RuntimeError as exc:  # no thread to be had (memory, a limit on threads): it never ran
            self._exit(proc, f"crash: cannot start its thread: {exc}")
            self._busy_down()
            raise NodeError(f"node {self.name} cannot start a thread for a process: {exc}") from exc
        return proc.pid

    def spawn_behaviour(self, behaviour: Behaviour, name: str | None = None, link: int | None = None) -> Pid:
        proc = BehaviourProcess(self, Pid(self.name, next(self._ids)), behaviour)
        self._add(proc, name, link)
        try:
            behaviour.started(proc)
        except Exception as exc:
            self._exit(proc, crash_reason(exc))
        return proc.pid

    def _add(self, proc: Process, name: str | None, link: int | None) -> None:
        self._check_open()
        with self._state:
            self._procs[proc.pid.id] = proc
        if name is not None:
            self.register(name, proc.pid, link)

    def _check_open(self) -> None:
        if self.closed.is_set():
            raise NodeError(f"node {self.name} is closed ({self.close_reason})")

    def register(self, name: str, pid: Pid, link: int | None = None) -> None:
        self.register_many([(name, pid, link)])

    def register_many(self, entries: list[tuple[str, Pid, int | None]]) -> None:
        """Register global names in one message to the broker (thousands of clients)."""
        with self._state:
            for name, pid, _ in entries:
                proc = self._procs.get(pid.id)
                if proc is None or pid.node != self.name:
                    raise NodeError(f"cannot register {name!r}: {pid} is not a live local process")
                if name in self._names and self._names[name] is not proc:
                    raise NodeError(f"name {name!r} is already registered on {self.name}")
                self._names[name] = proc
                proc.names.append(name)
        self._send_ctl(BROKER_PID, {"op": "register", "entries": [list(e) for e in entries]})

    def processes(self) -> list[Process]:
        with self._state:
            return list(self._procs.values())

    def _exit(self, proc: Process, reason: str) -> None:
        with self._state:
            if not proc.alive:
                return
            proc.alive = False
            self._procs.pop(proc.pid.id, None)
            for name in proc.names:
                self._names.pop(name, None)
            watchers = self._monitors.pop(proc.pid.id, [])
        if proc.names and not self.closed.is_set():
            self._send_ctl(BROKER_PID, {"op": "unregister", "names": proc.names, "pid": proc.pid})
        if isinstance(proc, BehaviourProcess):
            try:
                proc.behaviour.stopped(proc, reason)
            except Exception:
                log.exception("stopped() of %s raised", proc)
        log.debug("%s exited: %s", proc, reason)
        for ref, watcher in watchers:
            self._send_down(watcher, Down(ref, proc.pid, reason))

    def _send_down(self, watcher: Pid, down: Down) -> None:
        if watcher.node == self.name:
            self._deliver_local(down.pid, watcher.id, down)
        else:
            self._send_ctl(Pid(watcher.node, 0), {"op": "down", "down": down, "watcher": watcher})

    def _monitor(self, watcher: Pid, targets: list[Pid]) -> list[int]:
        """A ref per target (in order); the targets on each other node are watched with one
        control message to it, not one each (a server watching 100,000 clients sends one
        per worker node)."""
        for target in targets:
            if not isinstance(target, Pid):
                raise TypeError(f"monitor needs a Pid, not {target!r}; resolve names with whereis()")
        refs = [next(self._refs) for _ in targets]
        local_dead, remote = [], {}
        with self._state:
            closed = self.closed.is_set()
            for ref, target in zip(refs, targets):
                if target.node == self.name:
                    if target.id in self._procs:
                        self._monitors.setdefault(target.id, []).append((ref, watcher))
                    else:
                        local_dead.append(Down(ref, target, "noproc"))
                elif closed:
                    local_dead.append(Down(ref, target, "noconnection"))
                else:
                    self._out_monitors[ref] = (watcher, target)
                    remote.setdefault(target.node, []).append([ref, target.id])
        for down in local_dead:
            self._send_down(watcher, down)
        for node, watched in remote.items():
            self._send_ctl(Pid(node, 0), {"op": "monitor", "watcher": watcher, "targets": watched})
        return refs

    def _demonitor(self, ref: int) -> None:
        with self._state:
            entry = self._out_monitors.pop(ref, None)
            if entry is None:
                for watchers in self._monitors.values():
                    watchers[:] = [w for w in watchers if w[0] != ref]
                return
        watcher, target = entry
        self._send_ctl(Pid(target.node, 0), {"op": "demonitor", "ref": ref, "target": target.id})

    def _fire_noconnection(self, node: str | None) -> None:
        """Resolve every monitor on processes of ``node`` (None: of every remote node)."""
        with self._state:
            lost = [(ref, w, t) for ref, (w, t) in self._out_monitors.items() if node is None or t.node == node]
            for ref, _, _ in lost:
                del self._out_monitors[ref]
            if node is not None:
                for watchers in self._monitors.values():
                    watchers[:] = [w for w in watchers if w[1].node != node]
        for ref, watcher, target in lost:
            self._deliver_local(target, watcher.id, Down(ref, target, "noconnection"))

    def _remote_monitor(self, src_node: str, watcher: Any, targets: Any) -> None:
        """Another node's process ``watcher`` monitors local processes: ``targets`` is a
        list of [ref, target id]."""
        # Kept until the targets exit: check now, or an exit would fail on them.
        if not (isinstance(watcher, Pid) and watcher.node == src_node and isinstance(targets, list)
                and all(isinstance(t, list) and len(t) == 2 and type(t[0]) is int and type(t[1]) is int
                        for t in targets)):
            raise TypeError("monitor needs a watcher pid of the sending node and a list of [ref, target id]")
        dead = []
        with self._state:
            for ref, target_id in targets:
                if target_id in self._procs:
                    self._monitors.setdefault(target_id, []).append((ref, watcher))
                else:
                    dead.append(Down(ref, Pid(self.name, target_id), "noproc"))
        for down in dead:
            self._send_down(watcher, down)

    def _remote_demonitor(self, target_id: Any, ref: Any) -> None:
        with self._state:
            watchers = self._monitors.get(target_id, [])
            watchers[:] = [w for w in watchers if w[0] != ref]

    def _remote_down(self, down: Any) -> None:
        """A process this node's process monitored on another node ended."""
        if not isinstance(down, Down):
            raise TypeError(f"down carries {type(down).__name__}, not a Down")
        with self._state:
            entry = self._out_monitors.pop(down.ref, None)
        if entry is not None:  # absent: already resolved (exactly one Down)
            # After the process's last messages, even if they are still held.
            self._held.arrive(down.pid, entry[0].id, down, None)
