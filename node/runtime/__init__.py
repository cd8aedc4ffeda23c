"""The node runtime: a node (one OS process) and its processes, mailboxes, monitors,
timers and clock, and the I/O thread that talks to the broker."""
from .process import TIMEOUT, Behaviour, BehaviourProcess, Down, Message, NodeError, Process, Stalled, ThreadProcess
from .runtime import Node

__all__ = ["TIMEOUT", "Behaviour", "BehaviourProcess", "Down", "Message", "Node", "NodeError", "Process", "Stalled",
           "ThreadProcess"]
