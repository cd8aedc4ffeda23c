"""The broker: the ZeroMQ ROUTER every node connects to, which routes every message,
keeps the run's members, plays the network (through :mod:`fedemu.node.net`) and owns
the run's time (wall or virtual)."""
from .broker import Broker

__all__ = ["Broker"]
