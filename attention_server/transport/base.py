"""The transport seam (in the shape of vllm-project/afd-plugin's connectors).

    ExpertTransport.send(layer, micro_batch, x, plan) -> Pending   never waits for a worker
    Pending.wait() -> partials in plan order                       blocks; fails over to replicas;
                                                                   raises ExpertWorkerError

One `Channel` per worker carries frames (protos/frames.py) over the data plane the factory
chose for that worker (shared memory, TCP or a gRPC stream). In-flight work is keyed by
(layer, micro-batch), so a schedule may keep several micro-batches in the experts at once.
Errors are transport-neutral: every plane raises ExpertWorkerError with a Cause.
"""
from __future__ import annotations

import collections
import enum
import itertools
import logging
import socket
import ssl
import struct
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from attention_server import metrics
from attention_server.config import MAX_MICROBATCHES
from attention_server.partition import DispatchPlan, ShardSlice
from protos.codec import CodecError
from protos.frames import FrameError, Header, Kind, status_name
from protos.placement import Placement
from protos.security import Security

logger = logging.getLogger(__name__)


# What a send or receive past its kernel deadline raises (a TLS socket: its want-read/write errors).
TIMED_OUT = (TimeoutError, BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


def kernel_deadlines(sock: socket.socket, send_s: float, receive_s: float) -> None:
    """Keep `sock` blocking (Python's own timeouts make it non-blocking with a poll before every
    call: twice the system calls, and a receive loop per chunk) and let the kernel bound each send
    and receive instead: one that waits longer raises BlockingIOError.

    Not on TLS: Python's ssl module retries a blocking read that the kernel timed out, forever;
    there Python's own timeout, `receive_s` for both directions, raises TimeoutError."""
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(receive_s)
        return
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(send_s))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(receive_s))


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


class Cause(enum.Enum):
    UNAVAILABLE = "unavailable"  # unreachable, connection refused, reset or closed
    DEADLINE = "deadline"  # no answer within the request timeout
    REFUSED = "refused"  # the worker answered with an error status
    UNAUTHENTICATED = "unauthenticated"  # the worker refused this node's certificate or token


class ExpertWorkerError(RuntimeError):
    """A worker failed a request: unreachable, too slow, or it refused the request."""

    def __init__(self, worker: int, endpoint: str, cause: Cause, details: str, status: str | None = None):
        super().__init__(f"expert worker {worker} at {endpoint}: {status or cause.name}: {details}")
        self.worker, self.endpoint, self.cause, self.details, self.status = worker, endpoint, cause, details, status

    def without_traceback(self) -> ExpertWorkerError:
        """The same error, holding no frame (and so no buffer or channel) alive: to keep."""
        return ExpertWorkerError(self.worker, self.endpoint, self.cause, self.details, self.status)


@dataclass(frozen=True, slots=True)
class Answer:
    """A worker's reply: the partial [T_w, H] float32 (an echo's bytes, for probes) and the
    nanoseconds the worker spent in its experts."""

    tensor: torch.Tensor
    compute_ns: int = 0


class Channel(ABC):
    """One worker over one data plane; used by one thread (the model's forward) at a time.

    A channel connects once. After its connection is lost or closed every send fails with
    Cause.UNAVAILABLE: a worker process that comes back (perhaps another one, on the same port)
    is only used again through a fresh channel, after the handshake (rejoin.py)."""

    plane: ClassVar[str]

    def __init__(self, worker: int, endpoint: str, timeout_s: float):
        self.worker, self.endpoint, self.timeout_s = worker, endpoint, timeout_s
        self.deadline_s = timeout_s  # how long a receive waits; the transport adapts it (Deadlines)
        self._requests = itertools.count(1)

    def set_deadline(self, seconds: float) -> None:
        self.deadline_s = seconds

    def next_request(self) -> int:
        return next(self._requests)

    @abstractmethod
    def send(self, layer: int, slot: int, x: torch.Tensor, part: ShardSlice) -> int:
        """Start computing `part` of x [T, H] on this worker, its frame and reply in buffer `slot`;
        returns the request id to receive."""

    @abstractmethod
    def send_echo(self, payload: memoryview) -> int:
        """A transport probe: the worker sends `payload` back unchanged, computing nothing."""

    @abstractmethod
    def receive(self, request: int) -> Answer:
        """The answer to a sent request. Its tensor may be a view into this channel's buffers
        that stays valid until the next send in the same slot."""

    @abstractmethod
    def close(self) -> None: ...

    def error(self, cause: Cause, details: str, status: str | None = None) -> ExpertWorkerError:
        if cause is Cause.REFUSED:  # the other causes are counted when the worker is marked down
            metrics.TRANSPORT_ERRORS.labels(str(self.worker), cause.value).inc()
        return ExpertWorkerError(self.worker, self.endpoint, cause, details, status)


class OrderedChannel(Channel):
    """A channel whose replies come back on one connection; a reply read while waiting for
    another is kept until its own receive."""

    security: Security  # what the plane presents (each plane's __init__ sets it)

    def __init__(self, worker: int, endpoint: str, timeout_s: float):
        super().__init__(worker, endpoint, timeout_s)
        self.sock: socket.socket | None = None
        self.closed = False
        self.arrived: dict[int, Answer | ExpertWorkerError] = {}

    def set_deadline(self, seconds: float) -> None:
        super().set_deadline(seconds)
        if self.sock is not None:
            kernel_deadlines(self.sock, self.timeout_s, seconds)

    @abstractmethod
    def read_reply(self) -> tuple[int, Answer | ExpertWorkerError]:
        """The next reply: (request, its answer or the refusal it carries). Raises
        ExpertWorkerError when the connection itself is lost, which loses every reply on it."""

    def receive(self, request: int) -> Answer:
        while request not in self.arrived:
            replied, result = self.read_reply()
            self.arrived[replied] = result
        result = self.arrived.pop(request)
        if isinstance(result, ExpertWorkerError):
            raise result
        return result

    def receive_failed(self, err: Exception) -> ExpertWorkerError:
        """The error a failed read of a reply becomes; the connection is dropped either way."""
        if isinstance(err, TIMED_OUT):  # the kernel's receive deadline
            return self.lost(f"no answer within {self.deadline_s:.3g} s", Cause.DEADLINE)
        if isinstance(err, (FrameError, CodecError)):
            return self.lost(f"unreadable reply: {err}", Cause.REFUSED)
        return self.lost(str(err))

    def lost(self, details: str, cause: Cause = Cause.UNAVAILABLE, status: str | None = None) -> ExpertWorkerError:
        """The connection can no longer be trusted: drop it, and with it this channel."""
        self.close()
        return self.error(cause, details, status)

    def connected(self) -> socket.socket:
        """The connection, made on first use; UNAVAILABLE once it was lost or closed."""
        if self.sock is None:
            if self.closed:
                raise self.error(Cause.UNAVAILABLE, "connection closed")
            self.sock = self.connect()
        return self.sock

    @abstractmethod
    def connect(self) -> socket.socket:
        """A new connection to the worker's data plane."""

    def greeted(self, sock: socket.socket, where: str, reply: Header | None, reason: bytes) -> socket.socket:
        """`sock` once the worker answered our HELLO with its own; else closed, UNAUTHENTICATED.
        reply: the worker's first frame (None: it closed the connection); reason: an ERROR's text."""
        if reply is not None and reply.kind == Kind.HELLO:
            return sock
        sock.close()
        if reply is not None and reply.kind == Kind.ERROR:
            raise self.error(Cause.UNAUTHENTICATED, f"{where}: {bytes(reason).decode(errors='replace')}",
                             status_name(reply.status))  # fmt: skip
        raise self.error(Cause.UNAUTHENTICATED, f"{where}: the worker closed the connection instead of answering "
                         f"our HELLO (over {self.security.describe()}: a worker closes what it cannot authenticate)")

    def close(self) -> None:
        self.closed = True
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.arrived.clear()


@dataclass(slots=True)
class Call:
    """One slice of a plan on its way: the replica it went to and the request to receive."""

    worker: int
    channel: Channel
    request: int
    sent_at: float = 0.0  # time.perf_counter() after the send


DEADLINE_MULTIPLE = 10.0  # a worker's receive deadline: this many times its recent p99 round trip,
DEADLINE_FLOOR_S = 1.0  # but at least this, and at most the request timeout (--expert-timeout)
DEADLINE_WINDOW = 256  # round trips the p99 is taken over
DEADLINE_UPDATE_EVERY = 64  # round trips between updates; a (re)joined worker has the timeout until then


class Deadlines:
    """Receive deadlines that follow each worker's measured latency, so that a worker that stops
    answering costs about DEADLINE_FLOOR_S of stall, not the whole request timeout."""

    def __init__(self, num_workers: int):
        self.samples = [collections.deque(maxlen=DEADLINE_WINDOW) for _ in range(num_workers)]
        self.pending = [0] * num_workers  # round trips since the last update

    def observe(self, channel: Channel, seconds: float) -> None:
        w = channel.worker
        self.samples[w].append(seconds)
        self.pending[w] += 1
        if self.pending[w] < DEADLINE_UPDATE_EVERY:
            return
        self.pending[w] = 0
        ordered = sorted(self.samples[w])
        p99 = ordered[int(0.99 * (len(ordered) - 1))]
        deadline = min(channel.timeout_s, max(DEADLINE_FLOOR_S, DEADLINE_MULTIPLE * p99))
        if deadline != channel.deadline_s:
            channel.set_deadline(deadline)
            metrics.WORKER_DEADLINE.labels(str(w)).set(deadline)

    def reset(self, channel: Channel) -> None:
        """A fresh channel (a rejoined worker, maybe a new process warming up): the full timeout again."""
        self.samples[channel.worker].clear()
        self.pending[channel.worker] = 0
        metrics.WORKER_DEADLINE.labels(str(channel.worker)).set(channel.deadline_s)


@dataclass(slots=True)
class Pending:
    """One layer's requests for one micro-batch, one per slice of `plan`."""

    transport: ExpertTransport
    layer: int
    micro_batch: int
    x: torch.Tensor  # the layer input, [T, H] on the host, kept for a re-send to another replica
    plan: DispatchPlan
    calls: list[Call]
    sends: collections.Counter  # requests sent to each worker so far: the next one takes another slot
    compute_ns: list[int] = field(default_factory=list)  # each slice's time in its worker's experts, after wait()

    def wait(self) -> list[torch.Tensor]:
        """[T_s, H] float32 partials in plan order (shard order, whichever replica answered).
        Blocks; raises ExpertWorkerError when a slice cannot be computed (see ExpertTransport)."""
        return self.transport.collect(self)


class ExpertTransport:
    """The channels to all workers, the placement of the experts over them, and the work in flight.

    Each slice of a plan goes to one replica of its shard: Placement.replica_workers with the layer
    plus the micro-batch as the turn, which spreads the shards over their replicas. A worker that
    cannot be reached, drops its connection or does not answer in time is marked down at once, and
    its slices go to the next replica that is up, within the same layer call, so the step completes.
    `on_down` (rejoin.py) then watches the worker and puts it back with a fresh channel once it
    serves the same shards again. Receive deadlines follow each worker's latency (Deadlines). A
    shard with no replica up waits for one up to `loss_timeout_s`
    (requests stall, none fails), then the layer raises an ExpertWorkerError naming its workers.
    A worker that answers with an error (Cause.REFUSED) is not bypassed: the request itself is wrong.
    """

    def __init__(self, channels: list[Channel], placement: Placement, loss_timeout_s: float = 60.0,
                 on_down: Callable[[int], None] | None = None):  # fmt: skip
        assert len(channels) == placement.num_workers, (len(channels), placement)
        self.channels = channels
        self.placement = placement
        # replica order per turn (period R) and shard, looked up for every slice of every layer
        self.replica_order = [[placement.replica_workers(s, t) for s in range(placement.num_workers)]
                              for t in range(placement.replicas)]  # fmt: skip
        self.loss_timeout_s = loss_timeout_s
        self.on_down = on_down
        self.down: dict[int, ExpertWorkerError] = {}  # worker -> why it went down
        self.closed = False
        self.deadlines = Deadlines(len(channels))
        self.round_trips = [metrics.ROUND_TRIP.labels(str(w)) for w in range(len(channels))]
        for channel in channels:
            self.deadlines.reset(channel)
        self.in_flight: dict[tuple[int, int], Pending] = {}
        # Run by the Rejoiner before a worker that was down gets work again (replace.py gives it
        # the current layout's experts); raising keeps the worker out until its next try.
        self.prepare_rejoin: Callable[[int], None] | None = None

    def send(self, layer: int, micro_batch: int, x: torch.Tensor, plan: DispatchPlan) -> Pending:
        """x: [T, H] layer input. Only shards with pairs get a request."""
        key = (layer, micro_batch)
        assert key not in self.in_flight, f"layer {layer} micro-batch {micro_batch} is already in flight"
        x = x.detach().cpu().contiguous()
        sends = collections.Counter()
        calls = [self._send(layer, micro_batch, x, part, sends) for part in plan.slices]
        self.in_flight[key] = pending = Pending(self, layer, micro_batch, x, plan, calls, sends)
        return pending

    def take(self, layer: int, micro_batch: int) -> Pending:
        """The work `send` started for (layer, micro_batch), no longer in flight once taken."""
        return self.in_flight.pop((layer, micro_batch))

    def collect(self, pending: Pending) -> list[torch.Tensor]:
        answers: list[Answer | None] = []
        failed, refused = [], None
        for i, call in enumerate(pending.calls):  # every reply is read before anything is re-sent
            try:
                answers.append(call.channel.receive(call.request))
                round_trip = time.perf_counter() - call.sent_at
                self.deadlines.observe(call.channel, round_trip)
                self.round_trips[call.worker].observe(round_trip)
            except ExpertWorkerError as err:
                answers.append(None)
                if err.cause is Cause.REFUSED:
                    refused = refused or err
                else:
                    self.mark_down(call, err)
                    failed.append(i)
        if refused is not None:
            answers.clear()  # views into channel buffers: let them go with this frame
            try:
                raise refused
            finally:
                refused = None  # no frame <-> exception cycle holding this frame alive
        try:
            for i in failed:
                answers[i] = self._resend(pending, i)
        except ExpertWorkerError:
            answers.clear()  # as above
            raise
        pending.compute_ns[:] = [a.compute_ns for a in answers]
        return [a.tensor for a in answers]

    def _resend(self, pending: Pending, i: int) -> Answer:
        """Slice i again, to the next replica up, until one answers or none is left in time."""
        part = pending.plan.slices[i]
        while True:
            call = pending.calls[i] = self._send(pending.layer, pending.micro_batch, pending.x, part, pending.sends,
                                                 failover=True)  # fmt: skip
            try:
                return call.channel.receive(call.request)
            except ExpertWorkerError as err:
                if err.cause is Cause.REFUSED:
                    raise
                self.mark_down(call, err)

    def _send(self, layer: int, micro_batch: int, x: torch.Tensor, part: ShardSlice, sends: collections.Counter,
              failover: bool = False) -> Call:  # fmt: skip
        """`part` to the first replica up; a failover when it replaces a request that failed or
        a send fails here. A worker's first request of a micro-batch takes slot `micro_batch`;
        another one takes a slot of its own, so that no frame or answer of this micro-batch is
        overwritten before the combine."""
        while True:
            worker = self._replica(part.shard, layer + micro_batch)
            channel = self.channels[worker]
            slot = micro_batch + MAX_MICROBATCHES * sends[worker]
            sends[worker] += 1
            try:
                call = Call(worker, channel, channel.send(layer, slot, x, part), time.perf_counter())
            except ExpertWorkerError as err:
                if err.cause is Cause.REFUSED:
                    raise
                self.mark_down(Call(worker, channel, 0), err)
                failover = True
                continue
            if failover:
                metrics.FAILOVERS.labels(str(worker)).inc()
            return call

    def _replica(self, shard: int, turn: int) -> int:
        """The first replica of `shard` that is up, in this turn's order; waits for one to come
        back (up to loss_timeout_s) when none is."""
        replicas = self.replica_order[turn % self.placement.replicas][shard]
        deadline = None
        while True:
            for worker in replicas:
                if worker not in self.down:
                    return worker
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.loss_timeout_s
                logger.warning("experts [%d, %d): every worker holding them is down (%s); waiting up to %g s for one",
                               *self.placement.shard_range(shard), self._why(replicas), self.loss_timeout_s)  # fmt: skip
            if now >= deadline:
                first = self.down[replicas[0]]
                start, end = self.placement.shard_range(shard)
                raise ExpertWorkerError(first.worker, first.endpoint, first.cause, (
                    f"lost, and no worker holding experts [{start}, {end}) came back within {self.loss_timeout_s:g} s "
                    f"({self._why(replicas)})"))  # fmt: skip
            time.sleep(0.05)

    def _why(self, workers: list[int]) -> str:
        return "; ".join(f"worker {w}: {self.down[w]}" for w in workers if w in self.down)

    def mark_down(self, call: Call, err: ExpertWorkerError) -> None:
        """Take the worker out (once per channel: a stale channel's errors say nothing new)."""
        if call.worker in self.down or self.channels[call.worker] is not call.channel:
            return
        self.down[call.worker] = err.without_traceback()
        call.channel.close()
        metrics.WORKER_UP.labels(str(call.worker)).set(0)
        metrics.TRANSPORT_ERRORS.labels(str(call.worker), err.cause.value).inc()
        logger.warning("expert worker %d is down, its experts go to their other replicas: %s", call.worker, err)
        if self.on_down is not None:
            self.on_down(call.worker)

    def rejoin(self, worker: int, channel: Channel) -> None:
        """Put a worker back with a fresh channel (from the watcher's thread; the model's
        thread picks it up at its next send)."""
        if self.closed:
            channel.close()
            return
        old = self.channels[worker]
        self.deadlines.reset(channel)
        self.channels[worker] = channel
        self.down.pop(worker, None)
        old.close()
        metrics.WORKER_UP.labels(str(worker)).set(1)
        metrics.REJOINS.labels(str(worker)).inc()
        logger.info("expert worker %d is back over %s and gets work again", worker, channel.plane)

    def close(self) -> None:
        self.closed = True
        for channel in self.channels:
            channel.close()
