"""The message vocabulary between the server and the clients: the one module both import.

Every class here is a registered wire message (``fedemu.node.message``): it crosses the
broker as msgpack with its ndarrays as raw frames.
"""
from __future__ import annotations

import numpy as np

from fedemu.node import Pid, message

# The built-in local tasks (common/algorithms/tasks.py); a plug-in task is named package.module:Class.
TRAIN = "train"  # FedAvg: E epochs of SGD from the sent weights, return the weights
GRADIENT = "gradient"  # FedSGD, FSVRG phase 1: the full local gradient at the sent weights
SVRG = "svrg"  # FSVRG phase 2: one variance-reduced pass, return the weights


@message
class TrainRequest:
    round: int
    task: str  # TRAIN, GRADIENT, SVRG or a plug-in task's package.module:Class (common.algorithms.tasks)
    weights: np.ndarray  # flat float32 global model
    epochs: int
    batch_size: int  # 0 means the full local set (B = infinity)
    lr: float  # eta; for SVRG the stepsize h (the client uses h / n_k)
    seed: int  # run seed; the client derives its shuffling from (seed, round, client)
    lr_decay: float = 0.0  # Keras-style, per local iteration over the client's life
    compression: dict | None = None  # a task that encodes_update: send the update encoded (CompressionSpec.to_dict())
    keep_at_node: bool = False  # run.aggregation = "nodes": the update stays at the client's node (NodeSums)
    # The algorithm's own inputs to its task (common.algorithms.tasks): names to numbers or
    # arrays (FedProx's mu, FSVRG's full gradient, a plug-in's control variate).
    extra: dict | None = None


@message
class TrainReply:
    round: int
    client: int
    task: str
    update: np.ndarray | None  # trained weights (TRAIN) or gradient (GRADIENT), flat float32
    num_samples: int  # n_k, the weight of this update
    train_loss: float
    compute_s: float  # measured local computation time
    slowdown: float = 1.0  # straggler factor applied: the reply was held (f - 1) * compute_s
    encoded: dict | None = None  # TRAIN with compression: the encoded delta instead of `update`
    # Kept at the node (keep_at_node): `update` is None, and this is what it would have
    # added to the message, charged on the link as if sent (wire.Header.charge).
    link_charge: int = 0
    extra: dict | None = None  # what a plug-in task sends beside its update (common.algorithms.tasks.TaskOutput)
    # The local work's span in emulated time (the run's timeline): when it started, and
    # when it ended on the emulated device, i.e. when this reply entered the uplink.
    started_s: float | None = None
    ended_s: float | None = None


def update_problem(update: object, size: int) -> str | None:
    """What makes a received update unfit to touch a model of ``size`` weights, in words,
    or None: it must be a flat float32 array of that size, every value finite (NaN or
    infinity is what a diverging training gives, a learning rate too high above all).
    The server checks every update before it is folded in; a worker node, before it
    keeps one for its partial sum."""
    if not isinstance(update, np.ndarray):
        return f"an update of type {type(update).__name__}, not an array"
    if update.dtype != np.float32:
        return f"an update of dtype {update.dtype}, not float32"
    if update.shape != (size,):
        return f"an update of shape {update.shape}, not the model's ({size},)"
    finite = np.isfinite(update)  # about 25 us for the 2NN's 199,210 weights
    if not finite.all():
        return f"{size - int(np.count_nonzero(finite))} of its {size} values are NaN or infinite (training diverged)"
    return None


@message
class Cancel:
    """An over-selected round closed without this client's reply: a training still
    running stops, and a reply it holds back (a slow device) is not sent."""

    round: int


# --- asynchronous rules (CO-OP, FedAsync, FedBuff) -------------------------------------------
#
# Request/reply, exactly once: each request (AgeRequest, FetchRequest, Upload) carries the
# client's next request id, and the reply (AgeReply, ModelReply) echoes it. A client that
# gets no reply within AsyncStart.retry_s resends the same request (each further wait is
# longer: retry_wait); the server answers a
# repeat with its stored reply instead of merging again. Models are numbered by the
# server (``model``): the client never has to count what it received.


@message
class AsyncStart:
    """Start training asynchronously from ``weights``; the client loops on its own."""

    rule: str  # the algorithm (algorithms.reference): the client finds its policy by it
    weights: np.ndarray
    age: int  # the client's initial age a_k (CO-OP: 0) or model version
    epochs: int
    batch_size: int
    lr: float
    lr_decay: float
    seed: int
    # What the rule's client policy needs (AsyncRule.client_payload: CO-OP's age filter).
    extra: dict | None = None
    compression: dict | None = None  # upload the delta from the base model encoded (CompressionSpec.to_dict())
    model: int = 0  # the server's number for this model (its count of models sent to this client)
    retry_s: float = 0.0  # emulated seconds without a reply before a request is resent; 0: never


@message
class TaskStart(AsyncStart):
    """An AsyncStart for one task (algorithm.concurrency): train once from this model,
    upload, and wait for the next start (TaskDone ends the task), where an AsyncStart's
    client loops on every ModelReply for ever. A type of its own, so AsyncStart stays
    the same bytes on the wire (and today's runs the same timing)."""


@message
class AgeRequest:
    """CO-OP: a client that finished training asks the server's age a."""

    client: int
    age: int  # a_k, for the server's books
    request: int = 0  # the client's request id, echoed by the reply


@message
class AgeReply:
    age: int
    request: int = 0  # the id of the AgeRequest this answers


@message
class FetchRequest:
    """CO-OP: an outdated client fetches the global model."""

    client: int
    request: int = 0


@message
class ModelReply:
    """The global model and its age, after a fetch or a merge."""

    weights: np.ndarray
    age: int
    request: int = 0  # the id of the FetchRequest or Upload this answers
    model: int = 0  # the server's number for this model, as in AsyncStart


@message
class Upload:
    client: int
    update: np.ndarray | None  # local weights, or the delta from the base model (is_delta); None if encoded
    is_delta: bool
    age: int  # a_k: the age/version of the model this update was trained from
    num_samples: int
    train_loss: float
    compute_s: float
    slowdown: float = 1.0
    # Which model from the server this update was trained from: the `model` number of the
    # AsyncStart or ModelReply it came in. It names the base an encoded delta is relative
    # to, and seeds its compression as the round does in FedAvg.
    base: int = 0
    # With compression: the delta from that base, encoded. The server decodes it into
    # `update` (the delta if is_delta, else base model + delta) before merging.
    encoded: dict | None = None
    request: int = 0
    started_s: float | None = None  # the local update's span in emulated time, as TrainReply's
    ended_s: float | None = None


@message
class TaskDone:
    """The server ends a client's task (algorithm.concurrency): its upload (request
    ``request``) was taken, or (request 0) the server gave its place to another client.
    The client drops its work and waits for its next AsyncStart."""

    request: int = 0
    reason: str = "uploaded"


@message
class CheckIn:
    """A client whose device came back online tells the server it is available for a
    task (algorithm.concurrency), as a real device checks in: the server, which cannot
    see devices go offline, stops choosing a client whose task timed out until then."""

    client: int


@message
class TrainAgain:
    """A client's note to itself: run another local update (CO-OP over-active)."""


# A request unanswered after retry_s is resent, and each further resend of it waits twice
# as long, up to this many doublings: a congested server (or its uplink) is not buried
# in repeats, each of which may cost it a model's worth of bytes.
RETRY_DOUBLINGS = 3


def retry_wait(retry_s: float, resends: int) -> float:
    """Seconds to wait for a reply after ``resends`` resends of the same message."""
    return retry_s * 2 ** min(resends, RETRY_DOUBLINGS)


@message
class RetryDue:
    """A client's timer: if request ``request`` is still unanswered, resend it."""

    request: int


@message
class TrainerDue:
    """A worker node's cohort trainer's timer to itself: its earliest held job is due
    (worker/cohorts.py)."""


@message
class AsyncStop:
    reason: str


@message
class WorkerReady:
    """A worker node tells the server which clients it hosts, and their pids."""

    node: str
    clients: list  # [[client id, Pid], ...]
    sums: Pid | None = None  # the node's NodeSums (run.aggregation = "nodes")


@message
class SumRequest:
    """The server, as a phase closes, to a worker node's NodeSums: the sum of the kept
    updates of these clients (those whose replies counted)."""

    round: int
    task: str
    clients: list


@message
class SumReply:
    """A worker node's partial sum (ExactSum.state()) of the clients asked for; those
    whose update it does not hold are ``missing``."""

    round: int
    task: str
    node: str
    state: dict
    missing: list


def client_name(k: int) -> str:
    return f"client/{k}"


def as_pid_map(clients: list) -> dict[int, Pid]:
    return {int(k): pid for k, pid in clients}
