import pytest

from fedemu.node import Node

from .realprocs import Procs


@pytest.fixture
def procs(tmp_path):
    """Real broker and node processes for a test; all stopped afterwards."""
    p = Procs(tmp_path)
    yield p
    p.close()


@pytest.fixture
def nodes(procs):
    """Nodes in this process, connected to a test's broker; closed before the broker stops."""
    made: list[Node] = []

    def make(broker: str, *names: str) -> list[Node]:
        for name in names:
            made.append(Node(name, broker, heartbeat_interval=0.1, heartbeat_timeout=5.0).start())
        return made[-len(names):]

    yield make
    for node in made:
        node.close()
