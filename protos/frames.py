"""The data planes' message format: one fixed header, then raw row-major tensor bytes.

The TCP, shared-memory and gRPC-stream planes carry the same frames; with protos/codec.py
(the protobuf twin) this is the only code that turns tensors into bytes and back.

    header (little-endian, HEADER.size bytes)
      magic u32, version u16, kind u16, request u64, layer u32, slot u32,
      rows u32, hidden u32, pairs u32, dtype u16, status u16, payload u64, compute_ns u64
    FORWARD  payload: hidden [rows, hidden] `dtype` | pair_rows [pairs] int32 |
                      pair_experts [pairs] int32 | pair_weights [pairs] float32
    PARTIAL  payload: [rows, hidden] float32; compute_ns: the worker's time in its experts
    ERROR    payload: utf-8 reason; status: the gRPC status code's value
    ECHO     payload: bytes the worker sends back unchanged in an ECHO frame (transport probes)
    HELLO    payload: the cluster token (protos/security.py; empty in plaintext). A TCP or
             shared-memory connection opens with one; the worker answers an empty HELLO, or
             an UNAUTHENTICATED ERROR and closes the connection.

A frame never trusts its header: `Header.unpack` checks magic, version and kind, and
`payload_size` derives the byte count the shapes imply, which the receiver compares with the
header's before reading a byte of payload.
"""
from __future__ import annotations

import enum
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import grpc
import numpy as np
import torch

from protos import codec
from protos import expert_pb2 as pb
from protos.streams import recv_into_exactly, send_parts

# Frames over gRPC travel outside protobuf, as the raw bytes of this bidirectional method.
GRPC_SERVICE = f"{pb.DESCRIPTOR.package}.FrameStream"
GRPC_METHOD = f"/{GRPC_SERVICE}/Forward"

MAGIC = 0x454F4D48  # b"HMOE"
FRAME_VERSION = 2  # 2: connections open with a HELLO
HEADER = struct.Struct("<IHHQIIIIIHHQQ")
MAX_PAYLOAD_BYTES = 1 << 30
_PAIR_BYTES = 4 + 4 + 4  # int32 row, int32 expert, float32 weight


def host_id() -> str:
    """Same on every process of one running Linux host (its boot id): shared memory needs it."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


class Kind(enum.IntEnum):
    FORWARD = 1
    PARTIAL = 2
    ERROR = 3
    ECHO = 4
    HELLO = 5


_KINDS = {k.value: k for k in Kind}


class FrameError(ValueError):
    """A header that is not a valid frame of this version, or whose sizes disagree."""


class Header(NamedTuple):
    """A frame's fixed part (a tuple: built and read for every frame on the hot path)."""

    kind: Kind
    request: int
    layer: int = 0
    slot: int = 0  # the sender's buffer for this frame and its reply (shared memory: its segment)
    rows: int = 0
    hidden: int = 0
    pairs: int = 0
    dtype: int = 0  # wire dtype (protos.expert.proto DType) of the FORWARD rows
    status: int = 0
    payload: int = 0
    compute_ns: int = 0

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, FRAME_VERSION, *self)

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> Header:
        if len(data) != HEADER.size:
            raise FrameError(f"a frame header is {HEADER.size} bytes, got {len(data)}")
        magic, version, kind, *fields = HEADER.unpack(data)
        if magic != MAGIC:
            raise FrameError(f"not a hetero-moe frame (magic {magic:#010x})")
        if version != FRAME_VERSION:
            raise FrameError(f"frame version {version}, this side speaks {FRAME_VERSION}")
        if kind not in _KINDS:
            raise FrameError(f"unknown frame kind {kind}")
        header = cls(_KINDS[kind], *fields)
        if header.payload > MAX_PAYLOAD_BYTES:
            raise FrameError(f"payload of {header.payload} bytes exceeds {MAX_PAYLOAD_BYTES}")
        return header

    def expected_payload(self) -> int | None:
        """Payload bytes the shapes imply (None: free-size kinds, ERROR, ECHO and HELLO)."""
        if self.kind == Kind.FORWARD:
            return forward_payload(self.rows, self.hidden, codec.torch_dtype(self.dtype).itemsize, self.pairs)
        if self.kind == Kind.PARTIAL:
            return partial_payload(self.rows, self.hidden)
        return None

    def check_payload(self) -> None:
        expected = self.expected_payload()
        if expected is not None and expected != self.payload:
            raise FrameError(
                f"{self.kind.name} frame of {self.rows} x {self.hidden} rows and {self.pairs} pairs needs "
                f"{expected} payload bytes, header says {self.payload}"
            )


@dataclass(frozen=True, slots=True)
class ForwardTensors:
    """A FORWARD frame's tensors, views into the payload buffer.

    hidden [T, H] any wire dtype; pair_rows, pair_experts [P] int32; pair_weights [P] float32
    """

    hidden: torch.Tensor
    pair_rows: torch.Tensor
    pair_experts: torch.Tensor
    pair_weights: torch.Tensor


def forward_payload(rows: int, width: int, itemsize: int, pairs: int) -> int:
    """FORWARD payload bytes: `rows` rows of the layer input, then the pair block."""
    return rows * width * itemsize + pairs * _PAIR_BYTES


def partial_payload(rows: int, width: int) -> int:
    """PARTIAL payload bytes: the float32 [rows, width] partial."""
    return rows * width * 4


def forward_header(request: int, layer: int, slot: int, rows: int, width: int, dtype: torch.dtype,
                   pairs: int) -> Header:  # fmt: skip
    payload = forward_payload(rows, width, dtype.itemsize, pairs)
    return Header(Kind.FORWARD, request, layer, slot, rows, width, pairs, codec.wire_dtype(dtype), payload=payload)


def forward_parts(x: torch.Tensor, rows: torch.Tensor, pairs: torch.Tensor) -> list[memoryview]:
    """The FORWARD payload of x[rows] and the pairs, as buffers to send back to back.

    x: [T, H] contiguous CPU tensor; rows: [T_w] int64; pairs: [3, P] int32, row index, expert id
    and router weight (float32 bits) per pair. The gather runs in numpy, on the rows' bytes: one
    single-threaded copy, whatever the dtype and however many threads torch keeps.
    """
    assert pairs.dtype == torch.int32 and pairs.shape[0] == 3
    return [memoryview(np.take(_row_bytes(x), rows.numpy(), axis=0)).cast("B"), tensor_bytes(pairs)]


def reply_offset(request_payload: int) -> int:
    """Where a reply's payload starts in a shared-memory slot: after the request's, 64-byte aligned."""
    return -(-request_payload // 64) * 64


def reply_size(header: Header) -> int:
    """Payload bytes of the reply to a request frame."""
    if header.kind == Kind.FORWARD:
        return partial_payload(header.rows, header.hidden)
    return header.payload if header.kind == Kind.ECHO else 0


def write_forward(buffer: memoryview, x: torch.Tensor, rows: torch.Tensor, pairs: torch.Tensor) -> int:
    """forward_parts written straight into `buffer` (e.g. shared memory); returns the bytes written."""
    src = _row_bytes(x)  # [T, H * itemsize]
    hidden_bytes = len(rows) * src.shape[1]
    dst = np.frombuffer(buffer, dtype=np.uint8, count=hidden_bytes + pairs.numel() * 4)
    np.take(src, rows.numpy(), axis=0, out=dst[:hidden_bytes].reshape(len(rows), src.shape[1]))
    dst[hidden_bytes:] = pairs.numpy().reshape(-1).view(np.uint8)
    return len(dst)


def _row_bytes(x: torch.Tensor) -> np.ndarray:
    """[T, H] contiguous CPU tensor of any dtype as a [T, H * itemsize] uint8 array (a view)."""
    return x.view(torch.uint8).numpy()


def read_forward(header: Header, payload: memoryview | bytearray) -> ForwardTensors:
    """Views of a FORWARD payload; `header.check_payload()` must have passed."""
    dtype = codec.torch_dtype(header.dtype)
    t, h, p = header.rows, header.hidden, header.pairs
    hidden = _view(payload, dtype, t * h, 0).view(t, h)
    offset = t * h * dtype.itemsize
    rows = _view(payload, torch.int32, p, offset)
    experts = _view(payload, torch.int32, p, offset + 4 * p)
    weights = _view(payload, torch.float32, p, offset + 8 * p)
    return ForwardTensors(hidden, rows, experts, weights)


def read_partial(header: Header, payload: memoryview | bytearray) -> torch.Tensor:
    """[rows, hidden] float32 view of a PARTIAL payload."""
    return _view(payload, torch.float32, header.rows * header.hidden, 0).view(header.rows, header.hidden)


def read_bytes(payload: memoryview | bytearray) -> torch.Tensor:
    """An ECHO payload as a uint8 tensor (a view)."""
    return _view(payload, torch.uint8, len(payload), 0)


def partial_header(request: int, rows: int, width: int, compute_ns: int) -> Header:
    """The header of a [rows, width] float32 partial."""
    return Header(Kind.PARTIAL, request, rows=rows, hidden=width, dtype=codec.wire_dtype(torch.float32),
                  payload=partial_payload(rows, width), compute_ns=compute_ns)  # fmt: skip


_STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def status_name(status: int) -> str:
    """The gRPC status code name an ERROR frame carries."""
    return _STATUS_NAMES.get(status, f"status {status}")


def error_frame(request: int, status: int, reason: str) -> tuple[Header, bytes]:
    message = reason.encode()[:65536]
    return Header(Kind.ERROR, request, status=status, payload=len(message)), message


def hello_frame(token: bytes) -> tuple[Header, bytes]:
    return Header(Kind.HELLO, 0, payload=len(token)), token


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, row-major (a view when it is contiguous)."""
    t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _view(buffer, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset)


# ---- frames over a stream socket (TCP) ---------------------------------------------------------


def send_frame(sock: socket.socket, header: Header, parts: Sequence[bytes | memoryview] = ()) -> None:
    send_parts(sock, [header.pack(), *parts])


class ReceiveBuffer:
    """Where payloads are received. Grows by replacement, never in place: tensors that still view
    an earlier payload keep its (old) bytes alive and unchanged."""

    def __init__(self, size: int = 0):
        self.data = bytearray(size)

    def view(self, size: int) -> memoryview:
        if len(self.data) < size:
            self.data = bytearray(1 << (size - 1).bit_length())
        return memoryview(self.data)[:size]


def recv_header(sock: socket.socket) -> Header | None:
    """The next frame's header, checked against its shapes; None at end of stream.

    Raises FrameError (or codec.CodecError) on a header that is not a valid frame: after that the
    stream cannot be trusted and the caller closes it.
    """
    head = bytearray(HEADER.size)
    if not recv_into_exactly(sock, memoryview(head)):
        return None
    header = Header.unpack(head)
    header.check_payload()
    return header


def recv_frame(sock: socket.socket, buffer: ReceiveBuffer) -> tuple[Header, memoryview] | None:
    """The next frame, its payload read into `buffer`; None at end of stream (see recv_header)."""
    header = recv_header(sock)
    if header is None:
        return None
    payload = buffer.view(header.payload)
    if header.payload and not recv_into_exactly(sock, payload):
        raise ConnectionResetError("stream ended before the frame's payload")
    return header, payload
