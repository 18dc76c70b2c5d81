"""The transport seam (in the shape of vllm-project/afd-plugin's connectors).

    ExpertTransport.send(layer, micro_batch, x, plan) -> Pending   never waits for a worker
    Pending.wait() -> partials in plan order                       blocks; raises ExpertWorkerError

One `Channel` per worker carries frames (protos/frames.py) over the data plane the factory
chose for that worker (shared memory, TCP or a gRPC stream). In-flight work is keyed by
(layer, micro-batch), so a schedule may keep several micro-batches in the experts at once.
Errors are transport-neutral: every plane raises ExpertWorkerError with a Cause.
"""
from __future__ import annotations

import enum
import itertools
import socket
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from attention_server.partition import DispatchPlan, WorkerSlice
from protos.codec import CodecError
from protos.frames import FrameError


def kernel_deadlines(sock: socket.socket, timeout_s: float) -> None:
    """Keep `sock` blocking (Python's own timeouts make it non-blocking with a poll before every
    call: twice the system calls, and a receive loop per chunk) and let the kernel bound each send
    and receive instead: one that waits longer raises BlockingIOError."""
    seconds = int(timeout_s)
    limit = struct.pack("ll", seconds, int((timeout_s - seconds) * 1e6))
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)


class Cause(enum.Enum):
    UNAVAILABLE = "unavailable"  # unreachable, connection refused, reset or closed
    DEADLINE = "deadline"  # no answer within the request timeout
    REFUSED = "refused"  # the worker answered with an error status


class ExpertWorkerError(RuntimeError):
    """A worker failed a request: unreachable, too slow, or it refused the request."""

    def __init__(self, worker: int, endpoint: str, cause: Cause, details: str, status: str | None = None):
        super().__init__(f"expert worker {worker} at {endpoint}: {status or cause.name}: {details}")
        self.worker, self.endpoint, self.cause, self.status = worker, endpoint, cause, status


@dataclass(frozen=True, slots=True)
class Answer:
    """A worker's reply: the partial [T_w, H] float32 (an echo's bytes, for probes) and the
    nanoseconds the worker spent in its experts."""

    tensor: torch.Tensor
    compute_ns: int = 0


class Channel(ABC):
    """One worker over one data plane; used by one thread (the model's forward) at a time."""

    plane: ClassVar[str]

    def __init__(self, worker: int, endpoint: str, timeout_s: float):
        self.worker, self.endpoint, self.timeout_s = worker, endpoint, timeout_s
        self._requests = itertools.count(1)

    def next_request(self) -> int:
        return next(self._requests)

    @abstractmethod
    def send(self, layer: int, micro_batch: int, x: torch.Tensor, part: WorkerSlice) -> int:
        """Start computing `part` of x [T, H] on this worker; returns the request id to receive."""

    @abstractmethod
    def send_echo(self, payload: memoryview) -> int:
        """A transport probe: the worker sends `payload` back unchanged, computing nothing."""

    @abstractmethod
    def receive(self, request: int) -> Answer:
        """The answer to a sent request. Its tensor may be a view into this channel's buffers
        that stays valid until the next send of the same micro-batch."""

    @abstractmethod
    def close(self) -> None: ...

    def error(self, cause: Cause, details: str, status: str | None = None) -> ExpertWorkerError:
        return ExpertWorkerError(self.worker, self.endpoint, cause, details, status)


class OrderedChannel(Channel):
    """A channel whose replies come back on one connection; a reply read while waiting for
    another is kept until its own receive."""

    def __init__(self, worker: int, endpoint: str, timeout_s: float):
        super().__init__(worker, endpoint, timeout_s)
        self.sock: socket.socket | None = None
        self.arrived: dict[int, Answer | ExpertWorkerError] = {}

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
        if isinstance(err, (TimeoutError, BlockingIOError)):  # the kernel's receive deadline
            return self.lost(f"no answer within {self.timeout_s:g} s", Cause.DEADLINE)
        if isinstance(err, (FrameError, CodecError)):
            return self.lost(f"unreadable reply: {err}", Cause.REFUSED)
        return self.lost(str(err))

    def lost(self, details: str, cause: Cause = Cause.UNAVAILABLE, status: str | None = None) -> ExpertWorkerError:
        """The connection can no longer be trusted: drop it (the next send reconnects)."""
        self.close()
        return self.error(cause, details, status)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.arrived.clear()


@dataclass(slots=True)
class Pending:
    """One layer's requests for one micro-batch, one per slice of `plan`."""

    plan: DispatchPlan
    calls: list[tuple[Channel, int]]
    compute_ns: list[int] = field(default_factory=list)  # each worker's time in its experts, after wait()

    def wait(self) -> list[torch.Tensor]:
        """[T_w, H] float32 partials in plan order (whatever order they arrive in).

        Every reply is collected before the first error is raised, so no channel is left holding
        an answer nobody will read.
        """
        partials, first_error = [], None
        for channel, request in self.calls:
            try:
                answer = channel.receive(request)
                partials.append(answer.tensor)
                self.compute_ns.append(answer.compute_ns)
            except ExpertWorkerError as err:
                first_error = first_error or err
        if first_error is not None:
            partials.clear()  # views into channel buffers: let them go with this frame
            try:
                raise first_error
            finally:
                first_error = None  # no frame <-> exception cycle holding this frame alive
        return partials


class ExpertTransport:
    """The channels to all workers, and the work in flight on them."""

    def __init__(self, channels: list[Channel]):
        self.channels = channels
        self.in_flight: dict[tuple[int, int], Pending] = {}

    def send(self, layer: int, micro_batch: int, x: torch.Tensor, plan: DispatchPlan) -> Pending:
        """x: [T, H] layer input. Only workers with pairs get a request."""
        key = (layer, micro_batch)
        assert key not in self.in_flight, f"layer {layer} micro-batch {micro_batch} is already in flight"
        x = x.detach().cpu().contiguous()
        calls = [(self.channels[p.worker], self.channels[p.worker].send(layer, micro_batch, x, p)) for p in plan.slices]
        self.in_flight[key] = pending = Pending(plan, calls)
        return pending

    def take(self, layer: int, micro_batch: int) -> Pending:
        """The work `send` started for (layer, micro_batch), no longer in flight once taken."""
        return self.in_flight.pop((layer, micro_batch))

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
