import os
from typing import NoReturn

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


# --- prerequisites a host may lack ------------------------------------------------------


def missing_prerequisite(why: str) -> NoReturn:
    """The one rule for a test whose prerequisite this host lacks (root, network
    namespaces, sshd, Slurm, a mountable tmpfs): it skips and says why; under CI
    (CI=true) it fails, so a CI host that lost a prerequisite cannot pass by skipping."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true, but this test cannot run: {why}", pytrace=False)
    pytest.skip(why)


def needs(why_not: str | None) -> pytest.MarkDecorator:
    """Marks a test that needs what this host may lack: ``why_not`` says what is missing
    (None: nothing is). Handled by missing_prerequisite before the test's fixtures."""
    return pytest.mark.prerequisite(why_not)


def pytest_configure(config):
    config.addinivalue_line("markers", "prerequisite(why_not): what the host lacks for this test, or None "
                                       "(tests/conftest.py: needs)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    for mark in item.iter_markers("prerequisite"):
        if mark.args[0] is not None:
            missing_prerequisite(mark.args[0])
