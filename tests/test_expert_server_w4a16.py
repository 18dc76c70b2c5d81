"""Workers that quantize a 16-bit checkpoint on load and run it through the kernel oracle."""
from __future__ import annotations

import subprocess

import pytest
import torch

from tests.support import python_module, start_workers
from expert_server.weights import load_shard, loaded_expert_bytes
from kernels.formats import SafetensorsFiles
from kernels.reference import DenseExpertWeights, moe_experts_reference
from protos import codec
from protos import expert_pb2 as pb
from protos import expert_pb2_grpc as pb_grpc
from protos.checkpoint import read_checkpoint
from protos.placement import Placement
from tests.kernels.quantizers import compressed_tensors_int4
from tests.test_expert_server import request_for

GROUP = 32

NUM_WORKERS = 2


@pytest.fixture(scope="module")
def quantized(model_dir, processes):
    model = model_dir("qwen3_moe")
    workers = start_workers(processes, model, NUM_WORKERS, tag="w4a16", extra_args=("--weight-format", "w4a16", "--group-size", str(GROUP)))
    channels = [workers.security.channel(e) for e in workers.endpoints]
    yield read_checkpoint(model), [pb_grpc.ExpertServiceStub(c) for c in channels]
    for c in channels:
        c.close()


def test_oracle_picks_the_cpu_kernel_and_info_says_so(quantized):
    _, stubs = quantized
    info = stubs[0].Info(pb.InfoRequest(), timeout=10)
    assert info.kernel_backend == "cpu"
    assert info.weight_format == "w4a16 int4 sym group 32"


def test_w4a16_partials_match_experts_quantized_by_compressed_tensors(quantized):
    """Each worker quantized its shard on load; the reference is the same shard quantized by the
    compressed-tensors library, dequantized, through the float32 reference experts."""
    ckpt, stubs = quantized
    source = SafetensorsFiles(ckpt.tensor_files())
    placement = Placement(ckpt.num_experts, NUM_WORKERS)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, ckpt.hidden_size, generator=g).to(torch.bfloat16)
    layer, naming = ckpt.moe_layers[1], ckpt.naming

    def dequantized(expert: int, proj: str) -> torch.Tensor:
        values, scales = compressed_tensors_int4(source[naming.name(layer, expert, proj)].float(), GROUP)
        return values.float() * scales.repeat_interleave(GROUP, dim=-1)  # [N, K]

    for worker, stub in enumerate(stubs):
        start, end = placement.shard_range(worker)
        rows = torch.tensor([0, 1, 1, 2, 3, 4, 4])
        experts = torch.tensor([start, start, end - 1, start + 1, end - 1, start, start + 1])
        weights = torch.rand(7, generator=g)
        got = codec.decode(stub.Forward(request_for(layer, x, rows, experts, weights), timeout=30).partial)
        shard = DenseExpertWeights(
            torch.stack([torch.cat([dequantized(e, naming.gate), dequantized(e, naming.up)]) for e in range(start, end)]),
            torch.stack([dequantized(e, naming.down) for e in range(start, end)]),
        )
        want = moe_experts_reference(x, rows, experts - start, weights, shard)
        assert (got - want).norm() / want.norm() < 1e-2, "bf16 activations in the CPU int4 kernel"


def test_an_extra_expert_is_quantized_and_computed_as_on_its_home_worker(quantized):
    """Worker 0 places an expert of worker 1's shard beside its own: it quantizes it with the same
    flags on the same kernel, so a request naming it gives worker 1's bits, and a request mixing it
    with worker 0's experts gives its shard's partial plus the extra's, added in float32 in that order."""
    ckpt, stubs = quantized
    (start0, _), (start1, _) = (Placement(ckpt.num_experts, NUM_WORKERS).shard_range(w) for w in range(NUM_WORKERS))
    layer, x = ckpt.moe_layers[2], torch.randn(4, ckpt.hidden_size, generator=torch.Generator().manual_seed(1))
    x = x.to(torch.bfloat16)
    epoch = stubs[0].Info(pb.InfoRequest(), timeout=10).placement_epoch + 1
    request = pb.PlaceRequest(epoch=epoch, layers=[pb.LayerExperts(layer=layer, experts=[start1])])
    reply = stubs[0].Place(request, timeout=60)
    assert reply.extra_experts == 1 and reply.extra_bytes == loaded_expert_bytes(ckpt, "w4a16", GROUP)

    def forward(worker: int, rows, experts, weights) -> torch.Tensor:
        return codec.decode(stubs[worker].Forward(request_for(layer, x, rows, experts, weights), timeout=30).partial)

    extra = ([0, 1, 3], [start1] * 3, [0.5, 0.25, 1.0])
    assert torch.equal(forward(0, *extra), forward(1, *extra))
    own = ([0, 2, 3], [start0, start0 + 1, start0], [0.75, 1.0, 0.125])
    mixed = forward(0, *(a + b for a, b in zip(own, extra)))
    assert torch.equal(mixed, forward(0, *own) + forward(1, *extra))


def test_forcing_a_backend_that_cannot_run_stops_the_worker_with_the_reason(model_dir):
    cmd = python_module("expert_server", "--model", str(model_dir("qwen3_moe")), "--worker-index", "0",
                        "--num-workers", "2", "--port", "0", "--plaintext", "--weight-format", "w4a16", "--group-size", "32",
                        "--kernel-backend", "triton")  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "forced kernel backend 'triton' cannot run" in result.stderr


def test_a_16bit_checkpoint_served_as_stored_refuses_a_w4a16_backend(model_dir):
    with pytest.raises(Exception, match="pass --weight-format w4a16"):
        ckpt = read_checkpoint(model_dir("qwen3_moe"))
        load_shard(ckpt, 0, 2, torch.device("cpu"), "checkpoint", kernel_backend="cpu")
