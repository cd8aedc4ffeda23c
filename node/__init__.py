"""fedemu.node — the runtime: processes, mailboxes, monitors, the wire format and the
broker. It moves bytes and ndarrays and knows nothing of learning (no torch here)."""
from .broker import Broker
from .wire import BROKER_NODE
from .runtime import (
    TIMEOUT,
    Behaviour,
    BehaviourProcess,
    Down,
    Message,
    Node,
    NodeError,
    Process,
    Stalled,
    ThreadProcess,
)
from .security import KeyFileError, RunKeys
from .wire import Pid, WireError, message

__all__ = [
    "BROKER_NODE", "Behaviour", "BehaviourProcess", "Broker", "Down", "KeyFileError", "Message", "Node",
    "NodeError", "Pid", "Process", "RunKeys", "Stalled", "TIMEOUT", "ThreadProcess", "WireError", "message",
]
