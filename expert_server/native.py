"""The worker's side of the shared-memory plane's serving loop in C (kernels/csrc/shm_serve.c).

The loop answers the common FORWARD frame without Python: it reads LocalExperts' tables through
`FrameTables`, a connection's segments through `Connection`, and counts what it serves in `COUNTS`,
which expert_server/metrics.py adds to the Python side's figures. The structures below are the C
file's, field for field.
"""
from __future__ import annotations

import ctypes
import os
import weakref
from collections.abc import Mapping, Sequence

import numpy as np

from kernels import native_build
from kernels.backends.base import FrameKernel, PreparedExperts
from protos.frames import HEADER

MAX_SLOTS = 64  # slots whose segments the loop knows; frames of other slots are Python's
MAX_BUCKETS = 32


class _Set(ctypes.Structure):
    _fields_ = [("kernel", ctypes.c_void_p), ("w13t", ctypes.c_void_p), ("w2t", ctypes.c_void_p),
                ("intermediate", ctypes.c_int64), ("num_experts", ctypes.c_int64), ("act", ctypes.c_int64)]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [("set_of", ctypes.c_void_p), ("offset", ctypes.c_void_p), ("sets", ctypes.c_void_p)]


class Counts(ctypes.Structure):
    """Requests the loop answered (all OK: anything else went to Python); `buckets` per bound, not cumulative."""

    _fields_ = [("ok", ctypes.c_uint64), ("received_bytes", ctypes.c_uint64), ("sent_bytes", ctypes.c_uint64),
                ("rows", ctypes.c_uint64), ("pairs", ctypes.c_uint64), ("seconds_ns", ctypes.c_uint64),
                ("buckets", ctypes.c_uint64 * MAX_BUCKETS), ("bounds", ctypes.c_double * MAX_BUCKETS),
                ("num_bounds", ctypes.c_int64)]  # fmt: skip


class _Connection(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p * MAX_SLOTS), ("size", ctypes.c_uint64 * MAX_SLOTS),
                ("message", ctypes.c_ubyte * HEADER.size), ("length", ctypes.c_int64), ("fd", ctypes.c_int64)]  # fmt: skip


def new_counts(bounds: Sequence[float]) -> Counts:
    """Counters for a histogram with these finite upper bounds."""
    assert len(bounds) < MAX_BUCKETS, bounds
    counts = Counts(num_bounds=len(bounds))
    counts.bounds[: len(bounds)] = bounds
    return counts


class FrameTables:
    """LocalExperts' per-layer tables as the loop reads them. `set` swaps them in under the loop's
    lock, so a computation in C always sees one whole table; what it replaces is freed after."""

    def __init__(self, hidden: int, num_experts: int):
        lib = native_build.host_library()
        self.handle = lib.hm_tables_new(hidden, num_experts)
        if not self.handle:
            raise MemoryError("no memory for the shared-memory loop's tables")
        weakref.finalize(self, lib.hm_tables_free, self.handle)
        self._held: tuple = ()  # what the C side points into

    def set(self, tables: Mapping[int, tuple[Sequence[PreparedExperts], np.ndarray, np.ndarray]]) -> None:
        """{layer: (sets, set_of [E] int64, offset [sets] int64)}."""
        layers = (_Layer * (max(tables, default=-1) + 1))()
        held = [layers]
        for layer, (sets, set_of, offset) in tables.items():
            entries = (_Set * len(sets))(*(_entry(s.frame_kernel()) for s in sets))
            set_of, offset = np.ascontiguousarray(set_of, np.int64), np.ascontiguousarray(offset, np.int64)
            layers[layer] = _Layer(set_of.ctypes.data, offset.ctypes.data, ctypes.addressof(entries))
            held += [entries, set_of, offset]
        native_build.host_library().hm_tables_set(self.handle, ctypes.addressof(layers), len(layers))
        self._held = tuple(held)


def _entry(kernel: FrameKernel | None) -> _Set:
    if kernel is None:
        return _Set()  # a NULL kernel: this set's requests go to Python
    return _Set(ctypes.cast(kernel.function, ctypes.c_void_p).value, kernel.w13t, kernel.w2t, kernel.intermediate,
                kernel.num_experts, kernel.activation)  # fmt: skip


class Connection:
    """One shared-memory connection as the loop serves it: the segments it may write replies into."""

    def __init__(self, fd: int, tables: FrameTables, counts: Counts, hand_back: bool = False):
        self.fd, self.tables, self.counts, self.hand_back = fd, tables, counts, hand_back
        self.state = _Connection(fd=-1)
        self._anchors: dict[int, ctypes.Array] = {}  # per slot: the segment's bytes, as the C side sees them

    def map(self, slot: int, segment) -> None:
        """`segment` (a writable mmap) now holds `slot`'s frames."""
        if slot >= MAX_SLOTS:
            return
        self._anchors.pop(slot, None)
        anchor = self._anchors[slot] = (ctypes.c_char * len(segment)).from_buffer(segment)
        self.state.base[slot] = ctypes.addressof(anchor)
        self.state.size[slot] = len(segment)

    def release(self) -> None:
        """Let the segments go (their mmaps close once nothing else exports them)."""
        for slot in self._anchors:
            self.state.base[slot] = None
        self._anchors.clear()

    def serve(self) -> tuple[bytes, list[int], bool] | None:
        """Serves common frames until a message is Python's: (its bytes, a descriptor that came with
        it, False); with hand_back, until a reply is ready: (its header, [], True), for the caller
        to send. None when the peer closed the connection; OSError when the socket fails."""
        status = native_build.host_library().hm_shm_serve(self.fd, self.tables.handle, ctypes.byref(self.counts),
                                        ctypes.byref(self.state), self.hand_back)  # fmt: skip
        if status < 0:
            raise OSError(-status, os.strerror(-status))
        if status == 0:
            return None
        state = self.state
        return bytes(state.message[: state.length]), ([state.fd] if state.fd >= 0 else []), status == 2
