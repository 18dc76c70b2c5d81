"""Real expert_server processes: Info, numerics against HF transformers, refusals, health, reflection."""
from __future__ import annotations

import os

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from transformers import AutoModelForCausalLM

from expert_server.experts import HeldShard, LocalExperts
from expert_server.transport.handler import ExpertHandler
from expert_server.weights import load_shard
from tests.support import scrape, start_workers, total
from protos import PROTOCOL_VERSION, codec, frames
from protos import expert_pb2 as pb
from protos import expert_pb2_grpc as pb_grpc
from protos.checkpoint import read_checkpoint
from protos.frames import Kind
from protos.placement import Placement

ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral"]
NUM_WORKERS = 2


@pytest.fixture(scope="module", params=ARCHS)
def served(request, model_dir, processes):
    """(arch, checkpoint, endpoints, stubs) with two real workers."""
    arch = request.param
    model = model_dir(arch)
    workers = start_workers(processes, model, NUM_WORKERS, tag=f"es-{arch}")
    channels = [workers.security.channel(e) for e in workers.endpoints]
    yield arch, read_checkpoint(model), workers, [pb_grpc.ExpertServiceStub(c) for c in channels]
    for c in channels:
        c.close()


def request_for(layer: int, hidden: torch.Tensor, rows, experts, weights) -> pb.ForwardRequest:
    return pb.ForwardRequest(
        layer=layer,
        hidden=codec.encode(hidden),
        pair_rows=codec.encode(torch.as_tensor(rows, dtype=torch.int32)),
        pair_experts=codec.encode(torch.as_tensor(experts, dtype=torch.int32)),
        pair_weights=codec.encode(torch.as_tensor(weights, dtype=torch.float32)),
    )


def test_info_describes_the_shard(served):
    arch, ckpt, _, stubs = served
    for worker, stub in enumerate(stubs):
        info = stub.Info(pb.InfoRequest(), timeout=10)
        start, end = Placement(ckpt.num_experts, NUM_WORKERS).shard_range(worker)
        assert info.protocol_version == PROTOCOL_VERSION
        assert info.model_fingerprint == ckpt.fingerprint and info.model_type == arch
        assert list(info.moe_layers) == list(ckpt.moe_layers)
        assert (info.worker_index, info.num_workers) == (worker, NUM_WORKERS)
        assert [(r.start, r.end) for r in info.expert_ranges] == [(start, end)]
        assert info.kernel_backend == "reference" and info.activation == "silu"
        assert info.placement_epoch == 0, "no Place yet: its shards only"


def test_workers_run_as_batch_processes(served):
    """SCHED_BATCH by default (a request never preempts the process that sent it), every thread."""
    arch, _, workers, _ = served
    mine = [proc for name, proc in workers.procs.procs.items() if name.startswith(f"es-{arch}-worker-")]
    assert len(mine) == NUM_WORKERS
    for proc in mine:
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            assert os.sched_getscheduler(int(tid)) == os.SCHED_BATCH, f"thread {tid} of worker {proc.pid}"


def test_partials_match_hf_transformers_experts(served):
    """Each worker's partial equals HF's experts module restricted to that worker's experts."""
    _, ckpt, _, stubs = served
    hf = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    num_tokens = 9
    x = torch.randn(num_tokens, ckpt.hidden_size, generator=g).to(torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(num_tokens, ckpt.num_experts, generator=g), -1).topk(ckpt.top_k, dim=-1)
    placement = Placement(ckpt.num_experts, NUM_WORKERS)
    for layer in ckpt.moe_layers:
        hf_experts = hf.model.layers[layer].mlp.experts
        for worker, stub in enumerate(stubs):
            start, end = placement.shard_range(worker)
            mine = (ids >= start) & (ids < end)
            rows, ks = mine.nonzero(as_tuple=True)
            response = stub.Forward(request_for(layer, x, rows, ids[rows, ks], weights[rows, ks]), timeout=30)
            partial = codec.decode(response.partial)
            # Zero router weight on other workers' experts: HF then sums exactly this worker's share.
            with torch.no_grad():
                expected = hf_experts(x.float(), ids, torch.where(mine, weights, 0.0))
            torch.testing.assert_close(partial, expected, rtol=1e-5, atol=1e-5)


def assert_invalid(stub, request: pb.ForwardRequest, match: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.Forward(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert match in err.value.details(), err.value.details()


def test_bad_requests_are_refused_and_the_worker_keeps_serving(served):
    _, ckpt, _, stubs = served
    stub, layer, h = stubs[1], ckpt.moe_layers[0], ckpt.hidden_size
    start, end = Placement(ckpt.num_experts, NUM_WORKERS).shard_range(1)
    x = torch.randn(3, h, dtype=torch.bfloat16)
    good = request_for(layer, x, [0, 1, 2], [start, start, end - 1], [0.5, 0.5, 1.0])
    before = scrape(served[2].metrics_urls[1])

    assert_invalid(stub, request_for(layer, torch.randn(3, h + 1, dtype=torch.bfloat16), [0], [start], [1.0]), f"[T, {h}]")
    assert_invalid(stub, request_for(layer, x.to(torch.int64), [0], [start], [1.0]), "hidden dtype")
    assert_invalid(stub, request_for(ckpt.num_hidden_layers + 5, x, [0], [start], [1.0]), "not a MoE layer")
    assert_invalid(stub, request_for(layer, x, [0], [0 if start else end], [1.0]), "are not held by this worker")
    assert_invalid(stub, request_for(layer, x, [0], [ckpt.num_experts], [1.0]), "pair_experts must lie in")
    assert_invalid(stub, request_for(layer, x, [0, 3], [start, start], [1.0, 1.0]), "pair_rows must lie in")
    assert_invalid(stub, request_for(layer, x, [0, 0], [start, start], [1.0, 1.0]), "more than once")
    assert_invalid(stub, request_for(layer, x, [0, 1], [start], [1.0, 1.0]), "differ in length")
    bad_weights = request_for(layer, x, [0], [start], [1.0])
    bad_weights.pair_weights.CopyFrom(codec.encode(torch.ones(1, dtype=torch.float64)))
    assert_invalid(stub, bad_weights, "pair_weights must be a 1-D torch.float32")
    truncated = request_for(layer, x, [0], [start], [1.0])
    truncated.hidden.data = truncated.hidden.data[:-2]
    assert_invalid(stub, truncated, "needs")
    garbage = pb.ForwardRequest(layer=layer)  # every tensor missing
    assert_invalid(stub, garbage, "unknown wire dtype")

    first = codec.decode(stub.Forward(good, timeout=10).partial)
    again = codec.decode(stub.Forward(good, timeout=10).partial)
    assert first.shape == (3, h) and torch.isfinite(first).all() and torch.equal(first, again)

    after = scrape(served[2].metrics_urls[1])

    def moved(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert moved("hetero_moe_worker_requests_total", status="INVALID_ARGUMENT") == 11
    assert moved("hetero_moe_worker_requests_total", status="OK") == 2
    assert moved("hetero_moe_worker_rows_total") == 6 and moved("hetero_moe_worker_pairs_total") == 6
    assert after[("hetero_moe_worker_up", ())] == 1


def test_garbage_activations_like_vllm_profiling_are_accepted(served):
    _, ckpt, _, stubs = served
    start, _ = Placement(ckpt.num_experts, NUM_WORKERS).shard_range(0)
    x = torch.full((2048, ckpt.hidden_size), float("nan"), dtype=torch.bfloat16)
    rows = torch.arange(2048)
    response = stubs[0].Forward(request_for(ckpt.moe_layers[-1], x, rows, [start] * 2048, [1.0] * 2048), timeout=60)
    assert codec.decode(response.partial).shape == (2048, ckpt.hidden_size)


def test_health_and_reflection(served):
    _, _, workers, _ = served
    with workers.security.channel(workers.endpoints[0]) as channel:
        for service in ("", "hetero_moe.expert.v2.ExpertService"):
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        (answer,) = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for s in answer.list_services_response.service}
        assert {"hetero_moe.expert.v2.ExpertService", "grpc.health.v1.Health"} <= names


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_request_computed_from_its_frame_has_the_decoded_requests_bits(model_dir, dtype):
    """The shared-memory and TCP planes give the worker room for the reply: the common request
    (every pair in one held set) is computed from the frame's bytes into it. Same bits as the
    request decoded into tensors, and every request it does not take is decoded after all:
    refused by name, as before."""
    ckpt, cpu = read_checkpoint(model_dir("qwen3_moe")), torch.device("cpu")
    placement = Placement(ckpt.num_experts, NUM_WORKERS)
    start, end = placement.shard_range(1)
    shards = [HeldShard(s, e, load_shard(ckpt, s, e, cpu, "checkpoint", None, 128)) for s, e in placement.worker_ranges(1)]
    handler = ExpertHandler(LocalExperts(ckpt, shards, cpu))
    x = torch.randn(3, ckpt.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)

    def both_ways(rows: list[int], experts: list[int]):
        """(decoded reply, reply computed in place, the in-place reply's partial)."""
        weights = torch.linspace(0.1, 0.9, len(rows))
        pairs = torch.stack([torch.tensor(rows, dtype=torch.int32), torch.tensor(experts, dtype=torch.int32),
                             weights.view(torch.int32)])  # fmt: skip
        header = frames.forward_header(7, ckpt.moe_layers[1], 0, len(x), ckpt.hidden_size, dtype, len(rows))
        payload = bytearray(header.payload)
        frames.write_forward(memoryview(payload), x, torch.arange(len(x)), pairs)
        decoded = handler.handle(header, bytearray(payload))
        out = bytearray(frames.reply_size(header))
        in_place = handler.handle(header, memoryview(payload), memoryview(out))
        return decoded, in_place, torch.frombuffer(out, dtype=torch.float32).view(len(x), -1)

    every = [(r, e) for r in range(3) for e in range(start, end)]  # 3 rows x 8 experts
    for pairs in ([(0, start)], [(2, end - 1), (0, start + 1), (2, start)], every):
        decoded, in_place, partial = both_ways(*map(list, zip(*pairs)))
        assert in_place.partial is None and in_place.header == decoded.header._replace(compute_ns=in_place.header.compute_ns)
        assert partial.abs().max() > 0 and torch.equal(partial, decoded.partial), len(pairs)
    for rows, experts, match in (([0], [0 if start else end], "are not held by this worker"),
                                 ([0, 1], [start, ckpt.num_experts], "pair_experts must lie in"),
                                 ([0, 3], [start, start], "pair_rows must lie in"),
                                 ([1, 1], [start, start], "more than once")):  # fmt: skip
        decoded, in_place, _ = both_ways(rows, experts)
        assert in_place.header.kind == decoded.header.kind == Kind.ERROR
        assert bytes(in_place.payload) == bytes(decoded.payload) and match in bytes(in_place.payload).decode()


def test_a_request_says_whether_its_rows_ascend(model_dir):
    """The attention node sends pairs in token order; the worker checks it on the host and tells the kernels
    (PreparedExperts' rows_ascending), so a GPU backend need not sort the pairs by row again. Pairs out of
    order are served all the same, without the promise."""
    ckpt, cpu = read_checkpoint(model_dir("qwen3_moe")), torch.device("cpu")
    placement = Placement(ckpt.num_experts, NUM_WORKERS)
    start, end = placement.shard_range(1)
    shards = [HeldShard(s, e, load_shard(ckpt, s, e, cpu, "checkpoint", None, 128)) for s, e in placement.worker_ranges(1)]
    experts = LocalExperts(ckpt, shards, cpu)
    x = torch.randn(3, ckpt.hidden_size)
    for rows, ascending in (([0], True), ([0, 0, 2], True), ([2, 0, 1], False), ([0, 2, 1], False)):
        pair_experts = torch.arange(start, start + len(rows), dtype=torch.int32) % (end - start) + start
        batch = experts.make_batch(ckpt.moe_layers[0], x, torch.tensor(rows, dtype=torch.int32), pair_experts,
                                   torch.full((len(rows),), 0.5))
        assert [g.rows_ascending for g in batch.groups] == [ascending], rows
        assert experts.forward(batch).abs().max() > 0
