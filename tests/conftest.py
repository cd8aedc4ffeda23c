import pytest

from .realprocs import Procs


@pytest.fixture
def procs(tmp_path):
    """Real broker and node processes for a test; all stopped afterwards."""
    p = Procs(tmp_path)
    yield p
    p.close()
