"""A flow-level model of TCP for every client's connection: when each message crossing
a link completes, given per-packet loss, a drop-tail buffer and the server's shared links.

One long-lived connection per client carries both directions, each a byte stream with
its own sender (congestion window, RTT estimator, retransmission timer), stepped once
per round trip, not per packet. Times are emulated seconds, sizes bytes, rates bytes/s.
Wire bytes count every segment's header (``header_bytes``: IPv4 20 + TCP 20 + the
timestamp option 12, the option Linux and ns-3 send on every segment); payload bytes
are the message's own. Every random decision is drawn from a named stream
(node/streams.py) of (seed, purpose, link, direction, the flow's draw counter).

The package, one concept a file (read scheduler.py first, then connection.py):

* ``scheduler.py``: :class:`TcpTransport`, the interface node/net/emulator.py calls
  (send, next_arrival, arrivals, fail, update) and the event heap behind it;
* ``connection.py``: a direction's sender: opening, rounds planned and released,
  the retransmission timer firing, a connection failing;
* ``window.py``: the congestion window: slow start and HyStart, CUBIC or Reno,
  the reduction after a loss, the restart after idle;
* ``recovery.py``: what the ACKs say: the RTT estimator and RTO (RFC 6298), SACK fast
  retransmit with PRR, the state after a timeout;
* ``losses.py``: where segments are lost: on the link (Bernoulli, Gilbert-Elliott) and
  where a full buffer's drops fall in a round;
* ``bottleneck.py``: a round's segments queued, served and delivered; a client's own
  link's buffer;
* ``shared.py``: the server's shared links: service in proportion to what each flow
  has queued there, their buffer;
* ``speculation.py``: simulating ahead and rolling back, so answers never depend on
  when the model was asked;
* ``state.py``: the records handed back (:class:`Arrival`, :class:`Failure`) and the
  senders' state (messages, rounds, flows);
* ``presets.py``: the TCP followed (:data:`LINUX`, or ns-3's :data:`NS3_337` for the
  fidelity benchmark) and the defaults: delayed ACKs, :func:`default_buffer`.

The mixins that make up :class:`TcpTransport` (connection, bottleneck, shared,
speculation) keep the original method names on one object, so a subclass can still
override one (bench/transport_launch.py overrides ``_queue_round``).
"""
from __future__ import annotations

import sys
import types

from ..profiles import DOWN, UP
from . import presets
from .presets import LINUX, NS3_337, Stack, default_buffer
from .scheduler import TcpTransport
from .state import Arrival, Failure

__all__ = ["Arrival", "Failure", "TcpTransport", "default_buffer", "DOWN", "UP"]


class _Package(types.ModuleType):
    """``tcp.STACK``: the stack the model follows, kept in presets.py where the code
    reads it, so that ``tcp.STACK = tcp.NS3_337`` (bench/transport_fidelity.py) still
    switches the model, as it did when this package was one module."""

    @property
    def STACK(self) -> Stack:  # noqa: N802 (a module constant's name)
        return presets.STACK

    @STACK.setter
    def STACK(self, stack: Stack) -> None:  # noqa: N802
        presets.STACK = stack


sys.modules[__name__].__class__ = _Package
