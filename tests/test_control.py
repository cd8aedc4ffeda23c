"""The control protocol's one table (node/control.py): what each side accepts, and that
every op the code sends is in it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedemu.node import control

NODE_DIR = Path(__file__).parent.parent / "node"


def test_check_names_what_is_wrong():
    assert control.check({"op": "whereis", "name": "server", "ref": 3}, control.BROKER) == "whereis"
    with pytest.raises(control.ControlError, match="is not a map with an 'op'"):
        control.check(["op", "hb"], control.BROKER)
    with pytest.raises(control.ControlError, match="unknown control op 'advance' for a broker"):
        control.check({"op": "advance", "now": 1.0, "count": 0}, control.BROKER)  # a node's op, not the broker's
    with pytest.raises(control.ControlError, match="control 'whereis' lacks ref"):
        control.check({"op": "whereis", "name": "server"}, control.BROKER)
    with pytest.raises(control.ControlError, match="control 'shutdown' comes from the broker only"):
        control.check({"op": "shutdown"}, control.NODE, from_broker=False)
    assert control.check({"op": "monitor", "watcher": None, "targets": [[1, 2]]}, control.NODE,
                         from_broker=False) == "monitor"  # relayed between nodes


def test_every_op_the_runtime_and_broker_send_is_in_the_table():
    sent = set()
    for path in NODE_DIR.rglob("*.py"):
        sent |= set(re.findall(r'"op": "([a-z_]+)"', path.read_text()))
    tabled = {name for _, name in control.OPS}
    assert len(sent) >= 25 and sent <= tabled, sorted(sent - tabled)
    assert tabled - sent == set()  # and the table lists nothing nobody sends


def test_the_ops_that_steer_the_run_are_for_its_controllers_only():
    """A worker node (not a controller) may not stop the run, announce rounds, change the
    links or start the clock; it may do everything else a node does."""
    assert control.CONTROLLER_OPS == {"shutdown", "round", "set_links", "clock_start"}
    for (receiver, name), op in control.OPS.items():
        if receiver != control.BROKER:
            continue
        body = {"op": name, **{field: 1 for field in op.required}}
        assert control.check(body, control.BROKER, controller=True) == name
        if name in control.CONTROLLER_OPS:
            with pytest.raises(control.NotEntitled, match=f"control '{name}' is for the run's controllers only"):
                control.check(body, control.BROKER, controller=False)
        else:
            assert control.check(body, control.BROKER, controller=False) == name
    with pytest.raises(control.NotEntitled, match="comes from the broker only"):  # the other kind of role
        control.check({"op": "refused", "reason": "x"}, control.NODE, from_broker=False)
