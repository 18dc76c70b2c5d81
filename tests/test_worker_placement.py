"""Re-placement on real worker processes: a Place loads experts beside a worker's shards, and requests
mixing both compute what HF transformers' experts compute, on the unary Forward and the frame stream;
the previous epoch's extras stay served and the one before goes; a bad Place is refused with the
status and reason expert.proto gives, and changes nothing."""
from __future__ import annotations

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from expert_server.weights import loaded_expert_bytes
from protos import expert_pb2 as pb
from protos import expert_pb2_grpc as pb_grpc
from protos import codec, frames
from protos.checkpoint import read_checkpoint
from protos.placement import Placement
from tests.support import scrape, start_workers, total
from tests.test_expert_server import request_for

NUM_WORKERS = 2


@pytest.fixture(scope="module")
def placed(model_dir, processes):
    """(checkpoint, workers, stubs): two real workers of the 16-expert qwen3_moe, 8 experts each."""
    model = model_dir("qwen3_moe")
    workers = start_workers(processes, model, NUM_WORKERS, tag="placement")
    channels = [workers.security.channel(e) for e in workers.endpoints]
    yield read_checkpoint(model), workers, [pb_grpc.ExpertServiceStub(c) for c in channels]
    for c in channels:
        c.close()


def place(stub, epoch: int, extras: dict[int, list[int]]) -> pb.PlaceResponse:
    layers = [pb.LayerExperts(layer=layer, experts=ids) for layer, ids in extras.items()]
    return stub.Place(pb.PlaceRequest(epoch=epoch, layers=layers), timeout=60)


def shards_only(stub) -> int:
    """Two empty Places, so that the worker holds its shards only whatever an earlier test placed;
    returns the next epoch."""
    epoch = stub.Info(pb.InfoRequest(), timeout=10).placement_epoch
    for e in (epoch + 1, epoch + 2):
        assert place(stub, e, {}) == pb.PlaceResponse(epoch=e)
    return epoch + 3


def unary(stub, layer: int, x: torch.Tensor, rows, experts, weights) -> torch.Tensor:
    return codec.decode(stub.Forward(request_for(layer, x, rows, experts, weights), timeout=30).partial)


class Refused(Exception):
    """An ERROR frame: the status name and the reason."""


def framed(workers, worker: int, layer: int, x: torch.Tensor, rows, experts, weights) -> torch.Tensor:
    """The same request as one FORWARD frame on the gRPC frame stream (protos/frames.py)."""
    rows, experts = torch.as_tensor(rows, dtype=torch.int32), torch.as_tensor(experts, dtype=torch.int32)
    weights = torch.as_tensor(weights, dtype=torch.float32)
    pairs = torch.stack([rows, experts, weights.view(torch.int32)])  # [3, P]
    header = frames.forward_header(1, layer, 0, x.shape[0], x.shape[1], x.dtype, pairs.shape[1])
    message = header.pack() + b"".join(frames.forward_parts(x, torch.arange(x.shape[0]), pairs))
    with workers.security.channel(workers.endpoints[worker]) as channel:
        (reply,) = list(channel.stream_stream(frames.GRPC_METHOD)(iter([message]), timeout=30))
    header, payload = frames.Header.unpack(reply[: frames.HEADER.size]), bytearray(reply[frames.HEADER.size :])
    if header.kind == frames.Kind.ERROR:
        raise Refused(f"{frames.status_name(header.status)}: {payload.decode()}")
    return frames.read_partial(header, payload).clone()


def assert_refused(stub, request: pb.PlaceRequest, code: grpc.StatusCode, match: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.Place(request, timeout=60)
    assert err.value.code() == code, err.value.details()
    assert match in err.value.details(), err.value.details()


def test_requests_mixing_shard_and_extra_experts_match_hf_transformers(placed):
    """Worker 1 holds experts [8, 16); a Place gives it some of worker 0's in three layers (and one of
    its own, which it holds anyway). Per layer, every pair of a token batch whose expert it now holds
    goes in one request: the partial is HF's experts module with zero router weight elsewhere."""
    ckpt, workers, stubs = placed
    stub, (start, end) = stubs[1], Placement(ckpt.num_experts, NUM_WORKERS).shard_range(1)
    layers = ckpt.moe_layers
    extras = {layers[0]: [3, 0], layers[1]: [2, start + 1], layers[3]: [1, 5, 7]}
    epoch = shards_only(stub)
    reply = place(stub, epoch, extras)
    assert (reply.epoch, reply.extra_experts) == (epoch, 6), "its own expert is not an extra"
    assert reply.extra_bytes == 6 * loaded_expert_bytes(ckpt, "checkpoint", 0) > 0
    assert stub.Info(pb.InfoRequest(), timeout=10).placement_epoch == epoch

    hf = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    num_tokens = 16
    x = torch.randn(num_tokens, ckpt.hidden_size, generator=g).to(torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(num_tokens, ckpt.num_experts, generator=g), -1).topk(ckpt.top_k, dim=-1)
    for layer in layers:
        extra = torch.tensor(extras.get(layer, []), dtype=ids.dtype)
        held = ((ids >= start) & (ids < end)) | torch.isin(ids, extra)
        rows, ks = held.nonzero(as_tuple=True)
        named = ids[rows, ks]
        if layer in extras:
            assert ((named < start) & torch.isin(named, extra)).any() and (named >= start).any(), "a mixed request"
        with torch.no_grad():
            expected = hf.model.layers[layer].mlp.experts(x.float(), ids, torch.where(held, weights, 0.0))
        got = unary(stub, layer, x, rows, named, weights[rows, ks])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(framed(workers, 1, layer, x, rows, named, weights[rows, ks]), got), "frame stream"

    # An extra computes the bits its home worker computes: loaded with the same flags, as its own set.
    only = (ids[:, 0] == 0).nonzero(as_tuple=True)[0]
    assert len(only), "expert 0 is some token's first choice"
    request = (layers[0], x, only, ids[only, 0], weights[only, 0])
    assert torch.equal(unary(stubs[1], *request), unary(stubs[0], *request))


def test_the_previous_epoch_stays_served_and_the_one_before_goes(placed):
    ckpt, workers, stubs = placed
    stub, layer, h = stubs[0], ckpt.moe_layers[2], ckpt.hidden_size  # worker 0 holds experts [0, 8)
    x = torch.randn(3, h, dtype=torch.bfloat16)
    with_12 = (layer, x, [0, 1, 2, 2], [1, 12, 12, 7], [0.5, 0.25, 1.0, 0.75])
    with_13 = (layer, x, [0, 2], [13, 13], [1.0, 0.5])
    epoch = shards_only(stub)

    def refuses_12(when: str) -> None:
        with pytest.raises(grpc.RpcError) as err:
            unary(stub, *with_12)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, when
        assert f"layer {layer}: experts [12] are not held by this worker" in err.value.details(), err.value.details()
        with pytest.raises(Refused, match=r"INVALID_ARGUMENT: .*experts \[12\] are not held"):
            framed(workers, 0, *with_12)

    def gauges() -> tuple[float, float, float]:
        samples = scrape(workers.metrics_urls[0])
        return tuple(total(samples, f"hetero_moe_worker_{name}")
                     for name in ("placement_epoch", "extra_experts", "extra_expert_bytes"))  # fmt: skip

    refuses_12("shards only")
    assert gauges() == (epoch - 1, 0, 0)
    one = loaded_expert_bytes(ckpt, "checkpoint", 0)

    assert place(stub, epoch, {layer: [12, 13]}).extra_experts == 2
    first = unary(stub, *with_12)
    assert torch.equal(framed(workers, 0, *with_12), first)
    assert place(stub, epoch + 1, {layer: [13, 14]}).extra_experts == 2
    assert torch.equal(unary(stub, *with_12), first), "12 stays, from the previous epoch, with the same bits"
    assert torch.equal(framed(workers, 0, *with_12), first)
    assert gauges() == (epoch + 1, 3, 3 * one), "12 (previous), 13 (both), 14 (current)"
    log = workers.procs.log(workers.names[0])
    assert f"placement epoch {epoch + 1}: 2 extra experts (1 loaded, 1 kept)" in log, "13 was not read again"

    assert place(stub, epoch + 2, {layer: [14]}).extra_experts == 1
    refuses_12("two epochs later")
    assert unary(stub, *with_13).shape == (3, h), "13 stays, from the previous epoch"
    assert gauges() == (epoch + 2, 2, 2 * one)
    assert stub.Info(pb.InfoRequest(), timeout=10).placement_epoch == epoch + 2


def test_bad_places_are_refused_and_change_nothing(placed):
    ckpt, workers, stubs = placed
    stub, layer, num_experts = stubs[1], ckpt.moe_layers[1], ckpt.num_experts
    epoch = shards_only(stub)
    assert place(stub, epoch, {layer: [4]}).extra_experts == 1
    before = scrape(workers.metrics_urls[1])

    def request(e: int, extras: dict[int, list[int]]) -> pb.PlaceRequest:
        return pb.PlaceRequest(epoch=e, layers=[pb.LayerExperts(layer=l, experts=ids) for l, ids in extras.items()])

    invalid, stale = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
    assert_refused(stub, request(epoch + 1, {ckpt.num_hidden_layers + 5: [1]}), invalid, "is not a MoE layer")
    assert_refused(stub, request(epoch + 1, {layer: [1, num_experts]}), invalid,
                   f"expert ids [{num_experts}] are outside [0, {num_experts})")  # fmt: skip
    assert_refused(stub, request(epoch + 1, {layer: [1, 2, 1]}), invalid, "expert ids [1] are listed more than once")
    assert_refused(stub, request(epoch - 1, {layer: [4]}), stale,
                   f"epoch {epoch - 1} is older than this worker's current epoch {epoch}")  # fmt: skip
    assert_refused(stub, request(epoch, {layer: [5]}), stale,
                   f"epoch {epoch} is this worker's current epoch {epoch} with another set")  # fmt: skip
    one = loaded_expert_bytes(ckpt, "checkpoint", 0)
    retry = place(stub, epoch, {layer: [4]})  # the current epoch and set again
    assert retry == pb.PlaceResponse(epoch=epoch, extra_experts=1, extra_bytes=one)
    log = workers.procs.log(workers.names[1])
    assert f"placement epoch {epoch} again: already held" in log, "a retry loads nothing"

    assert stub.Info(pb.InfoRequest(), timeout=10).placement_epoch == epoch
    x = torch.randn(2, ckpt.hidden_size, dtype=torch.bfloat16)
    assert unary(stub, layer, x, [0, 1], [4, 9], [1.0, 1.0]).shape == (2, ckpt.hidden_size), "4 is still held"
    after = scrape(workers.metrics_urls[1])

    def moved(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert moved("hetero_moe_worker_places_total", status="INVALID_ARGUMENT") == 3
    assert moved("hetero_moe_worker_places_total", status="FAILED_PRECONDITION") == 2
    assert moved("hetero_moe_worker_places_total", status="OK") == 1
    # Forward's counters count Forward requests only: the attention node compares them with what it sent.
    assert moved("hetero_moe_worker_requests_total", status="INVALID_ARGUMENT") == 0
    assert moved("hetero_moe_worker_requests_total", status="OK") == 1


def test_epoch_zero_is_no_placement(placed):
    _, _, stubs = placed
    epoch = stubs[0].Info(pb.InfoRequest(), timeout=10).placement_epoch
    assert_refused(stubs[0], pb.PlaceRequest(epoch=0), grpc.StatusCode.INVALID_ARGUMENT, "epochs start at 1")
    assert stubs[0].Info(pb.InfoRequest(), timeout=10).placement_epoch == epoch
