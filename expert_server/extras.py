"""Re-placement on the worker: experts held beside the static shards, one placement epoch at a time.

The attention node moves shares of busy experts' pairs onto other workers (attention_server/replace.py)
and tells each worker its whole extra set with a Place(epoch, {layer: experts}):

    PlaceRequest ─▶ wanted(): INVALID_ARGUMENT for a layer, id or repeat it cannot hold
        ─▶ the epoch: newer than the current one, or the current one with the same set (a retry: OK,
           nothing loaded), else FAILED_PRECONDITION
        ─▶ load what no shard and no held extra has (load_experts with the worker's own flags, in
           the servicer's Place thread: not on the event loop, and requests keep computing meanwhile)
        ─▶ under the compute lock (ExpertHandler.hold): the new epoch becomes current, the current
           one previous (its requests may still be in flight), the one before is dropped
        ─▶ PlaceResponse

Each extra is loaded as its own PreparedExperts, so that an epoch keeps exactly the extras it or
the previous epoch names, nothing more stays resident, and an expert kept from one epoch to the
next is never read again; the price is one kernel call per extra expert a request names.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from expert_server import metrics
from expert_server.experts import LocalExperts, RequestError
from expert_server.weights import LoadedShard
from kernels.backends.base import PreparedExperts
from protos import expert_pb2 as pb

logger = logging.getLogger(__name__)

Wanted = dict[int, frozenset[int]]  # MoE layer -> global expert ids; a layer without any absent


class EpochConflict(Exception):
    """A Place whose epoch is older than the worker's, or its current one with another set."""


@dataclass(frozen=True, slots=True)
class Epoch:
    """One placement epoch as the worker took it: the set asked for, and those of it that no shard
    holds, loaded ((layer, expert) -> that one expert's PreparedExperts)."""

    number: int
    wanted: Wanted
    extras: dict[tuple[int, int], PreparedExperts]


NO_EPOCH = Epoch(0, {}, {})


def wanted(request: pb.PlaceRequest, experts: LocalExperts) -> Wanted:
    """The request's set, checked against the model; raises RequestError naming what is wrong."""
    if request.epoch == 0:
        raise RequestError("epoch 0 means no placement: Place epochs start at 1")
    num_experts, out = experts.ckpt.num_experts, {}
    for entry in request.layers:
        if entry.layer not in experts.layers:
            raise RequestError(f"layer {entry.layer} is not a MoE layer of this model "
                               f"(MoE layers: {list(experts.layers)})")  # fmt: skip
        if entry.layer in out:
            raise RequestError(f"layer {entry.layer} is listed more than once")
        ids = frozenset(entry.experts)
        if bad := sorted(e for e in ids if e >= num_experts):
            raise RequestError(f"layer {entry.layer}: expert ids {bad} are outside [0, {num_experts})")
        if len(ids) != len(entry.experts):
            repeated = sorted(e for e, n in Counter(entry.experts).items() if n > 1)
            raise RequestError(f"layer {entry.layer}: expert ids {repeated} are listed more than once")
        if ids:
            out[entry.layer] = ids
    return out


class ExtraExperts:
    """The worker's current and previous placement epochs. `place` runs in one thread at a time
    (the servicer's Place executor); `hold` switches what requests may name."""

    def __init__(self, experts: LocalExperts, load: Callable[[dict[int, Sequence[int]]], LoadedShard],
                 hold: Callable[[Mapping[tuple[int, int], PreparedExperts]], None], expert_bytes: int):  # fmt: skip
        self.experts = experts
        self.load = load  # load_experts with the worker's --weight-format, --kernel-backend and --group-size
        self.hold = hold
        self.expert_bytes = expert_bytes  # one expert as loaded (weights.loaded_expert_bytes)
        self.current, self.previous = NO_EPOCH, NO_EPOCH
        metrics.publish_placement(0, 0, 0)

    @property
    def epoch(self) -> int:
        return self.current.number

    def place(self, request: pb.PlaceRequest) -> pb.PlaceResponse:
        """Take a Place (module docstring); raises RequestError or EpochConflict before loading anything."""
        want, current = wanted(request, self.experts), self.current
        if request.epoch == current.number and want == current.wanted:
            logger.info("placement epoch %d again: already held", request.epoch)
            return self.response(current)
        if request.epoch == current.number:
            raise EpochConflict(f"Place epoch {request.epoch} is this worker's current epoch {current.number} with "
                                "another set of experts")  # fmt: skip
        if request.epoch < current.number:
            raise EpochConflict(f"Place epoch {request.epoch} is older than this worker's current epoch "
                                f"{current.number}")  # fmt: skip
        held = {**self.previous.extras, **current.extras}
        needed = [(layer, e) for layer, ids in sorted(want.items()) for e in sorted(ids) if not self.experts.static(e)]
        fresh = [key for key in needed if key not in held]
        epoch = Epoch(request.epoch, want, {**{key: held[key] for key in needed if key in held}, **self._load(fresh)})
        self.hold({**current.extras, **epoch.extras})
        self.current, self.previous = epoch, current
        extras = len(epoch.extras.keys() | current.extras.keys())
        metrics.publish_placement(epoch.number, extras, extras * self.expert_bytes)
        logger.info("placement epoch %d: %d extra experts (%d loaded, %d kept), %d held with the previous epoch's",
                    epoch.number, len(needed), len(fresh), len(needed) - len(fresh), extras)  # fmt: skip
        return self.response(epoch)

    def _load(self, missing: list[tuple[int, int]]) -> dict[tuple[int, int], PreparedExperts]:
        """Each (layer, expert) its own PreparedExperts, read in as few load_experts calls as a layer
        has missing experts (each call takes one expert of every layer that lacks one)."""
        by_layer: dict[int, list[int]] = {}
        for layer, e in missing:
            by_layer.setdefault(layer, []).append(e)
        loaded = {}
        for k in range(max(map(len, by_layer.values()), default=0)):
            part = {layer: [ids[k]] for layer, ids in by_layer.items() if k < len(ids)}
            shard = self.load(part)
            ours = self.experts
            if (shard.kernel_backend, shard.weight_format) != (ours.kernel_backend, ours.weight_format):
                raise RuntimeError(f"extra experts loaded as {shard.weight_format!r} on {shard.kernel_backend!r}, "
                                   f"the shards as {ours.weight_format!r} on {ours.kernel_backend!r}")  # fmt: skip
            loaded.update({(layer, ids[0]): shard.layers[layer] for layer, ids in part.items()})
        return loaded

    def response(self, epoch: Epoch) -> pb.PlaceResponse:
        n = len(epoch.extras)
        return pb.PlaceResponse(epoch=epoch.number, extra_experts=n, extra_bytes=n * self.expert_bytes)
