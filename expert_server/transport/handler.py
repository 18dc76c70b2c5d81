"""One request in, one answer out: validate -> compute -> count, for every plane.

The unary gRPC Forward (protobuf), the gRPC frame stream and the TCP and shared-memory planes all
go through `ExpertHandler`, so a request is validated, computed, counted and refused the same
way whichever plane carried it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import torch

from expert_server import metrics
from expert_server.experts import LocalExperts
from expert_server.status import status_for
from protos import frames
from protos.frames import Header, Kind

if TYPE_CHECKING:
    from expert_server.transport.base import ReplyDelayConfig
    from kernels.backends.base import PreparedExperts

logger = logging.getLogger(__name__)
_thread = threading.local()  # a computing thread's inference mode, entered once (enter_thread)


class Refused(Exception):
    """A request answered with an error status instead of a partial."""

    def __init__(self, code: grpc.StatusCode, reason: str):
        super().__init__(reason)
        self.code, self.reason = code, reason


@dataclass(frozen=True, slots=True)
class Reply:
    """A reply frame: its header, and the partial [T, H] float32 (PARTIAL) or the payload bytes
    (ERROR, ECHO, and a PARTIAL computed into the plane's reply space); each plane writes them
    where its payloads go."""

    header: Header
    partial: torch.Tensor | None = None
    payload: bytes | memoryview = b""

    @property
    def rows(self) -> int:
        """Token rows of the partial it carries (0 for echoes and errors)."""
        return self.header.rows if self.header.kind == Kind.PARTIAL else 0

    def payload_bytes(self) -> bytes | memoryview:
        return frames.tensor_bytes(self.partial) if self.partial is not None else self.payload


class ExpertHandler:
    """This worker's experts behind every plane; one computation at a time."""

    def __init__(self, experts: LocalExperts, reply_delay: ReplyDelayConfig | None = None):
        self.experts = experts
        self.reply_delay = reply_delay  # benchmarks only (make bench-pingpong)
        self._compute = threading.Lock()
        self._ok = metrics.REQUESTS.labels(grpc.StatusCode.OK.name)
        self._torch_threads = torch.get_num_threads()  # as the main thread set it (--num-threads)

    def enter_thread(self, computes: bool = True) -> None:
        """Run first in every thread that uses torch. OpenMP's thread count is per thread: a thread
        that never set it runs torch's kernels on a team of every core, whose helpers spin
        between kernels (measured: a 2 x 128 matmul loop took 9x the CPU in a new thread).

        A thread that `computes` requests stays in inference mode for its life: no autograd
        bookkeeping on any tensor operation of a request, and no mode to enter per request (that
        cost 12 us of a decode request's 285 on the development machine)."""
        torch.set_num_threads(self._torch_threads)
        if computes:
            _thread.inference_mode = torch.inference_mode()
            _thread.inference_mode.__enter__()

    def forward(self, layer: int, hidden: torch.Tensor, pair_rows: torch.Tensor, pair_experts: torch.Tensor,
                pair_weights: torch.Tensor, payload_bytes: int) -> tuple[torch.Tensor, int]:  # fmt: skip
        """(partial [T, H] float32, nanoseconds in the experts); raises Refused, counted either way."""
        start = time.perf_counter()
        metrics.BYTES_RECEIVED.inc(payload_bytes)
        try:
            batch = self.experts.make_batch(layer, hidden, pair_rows, pair_experts, pair_weights)
            with self._compute:
                compute_start = time.perf_counter_ns()
                partial = self.experts.forward(batch)
                compute_ns = time.perf_counter_ns() - compute_start
        except Exception as exc:  # mapped to a status; the worker keeps serving
            if status_for(exc) == grpc.StatusCode.INTERNAL:
                logger.exception("Forward failed on layer %d", layer)
            raise self.refusal(exc) from None
        metrics.BYTES_SENT.inc(partial.numel() * partial.element_size())
        metrics.ROWS.inc(partial.shape[0])
        metrics.PAIRS.inc(batch.num_pairs)
        self._ok.inc()
        metrics.FORWARD_SECONDS.observe(time.perf_counter() - start)
        return partial, compute_ns

    def hold(self, extras: Mapping[tuple[int, int], PreparedExperts]) -> None:
        """Switch the extra experts requests may name (LocalExperts.hold) between two computations."""
        with self._compute:
            self.experts.hold(extras)

    def handle(self, header: Header, payload: memoryview | bytearray | bytes,
               out: memoryview | None = None) -> Reply:  # fmt: skip
        """A request frame whose `payload` holds exactly header.payload bytes -> the reply frame.

        A plane may pass `out`, writable room for a FORWARD's reply payload (and a writable
        `payload`): the common request is then computed from its frame's bytes into it
        (LocalExperts.forward_frame), and the reply's payload is that memory, its partial None."""
        try:
            header.check_payload()
            if header.kind == Kind.ECHO:
                return Reply(Header(Kind.ECHO, header.request, payload=len(payload)), payload=payload)
            if header.kind != Kind.FORWARD:
                raise frames.FrameError(f"a worker answers FORWARD and ECHO frames, not {header.kind.name}")
            if out is not None and (reply := self._forward_frame(header, payload, out)) is not None:
                return reply
            t = frames.read_forward(header, payload)
            partial, compute_ns = self.forward(header.layer, t.hidden, t.pair_rows, t.pair_experts, t.pair_weights,
                                               header.payload)  # fmt: skip
        except Refused as refused:
            return self.error(header.request, refused)
        except Exception as exc:  # a frame that does not decode
            return self.error(header.request, self.refusal(exc))
        return Reply(frames.partial_header(header.request, *partial.shape, compute_ns), partial=partial)

    def _forward_frame(self, header: Header, payload: memoryview, out: memoryview) -> Reply | None:
        """forward() on the frame's bytes, counted alike; None when the experts do not take it."""
        start = time.perf_counter()
        with self._compute:
            compute_start = time.perf_counter_ns()
            if not self.experts.forward_frame(header, payload, out):
                return None
            compute_ns = time.perf_counter_ns() - compute_start
        size = frames.partial_payload(header.rows, header.hidden)
        metrics.BYTES_RECEIVED.inc(header.payload)
        metrics.BYTES_SENT.inc(size)
        metrics.ROWS.inc(header.rows)
        metrics.PAIRS.inc(header.pairs)
        self._ok.inc()
        metrics.FORWARD_SECONDS.observe(time.perf_counter() - start)
        header = frames.partial_header(header.request, header.rows, header.hidden, compute_ns)
        return Reply(header, payload=out[:size])

    @staticmethod
    def refusal(exc: Exception) -> Refused:
        """The status a failed request gets, counted once."""
        code = status_for(exc)
        metrics.REQUESTS.labels(code.name).inc()
        return Refused(code, f"{type(exc).__name__}: {exc}")

    @staticmethod
    def error(request: int, refused: Refused) -> Reply:
        header, message = frames.error_frame(request, refused.code.value[0], refused.reason)
        return Reply(header, payload=message)

    def refuse_stream(self, err: Exception) -> Reply:
        """The reply to a frame header that could not be read (on TCP the stream's framing is lost)."""
        return self.error(0, self.refusal(err))
