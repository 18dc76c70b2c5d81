"""Partition and combine, in-process: every pair goes to exactly one worker; the sum is ordered."""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch

from attention_server.combine import combine
from attention_server.transport.base import ExpertTransport
from attention_server.transport.grpc_stream import GrpcStreamChannel
from attention_server.partition import DispatchPlan, Split, partition
from kernels.reference import DenseExpertWeights, moe_experts_reference
from protos import frames
from protos.placement import Placement
from protos.security import Security
from tests.support import HOST

T, H, I, E, K, W = 37, 32, 16, 16, 4, 8


def routing(seed: int, num_tokens: int = T) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, E, generator=g)
    weights, ids = torch.softmax(logits, -1).topk(K, dim=-1)
    return ids.to(torch.int32), weights


def test_partition_sends_each_pair_to_its_owner_once():
    ids, weights = routing(0)
    placement = Placement(E, W)
    plan = partition(ids, weights, placement.shard_table())
    seen = []
    for part in plan.slices:
        start, end = placement.shard_range(part.shard)
        tokens = part.rows[part.pair_rows.long()]
        for t, e, w in zip(tokens.tolist(), part.pair_experts.tolist(), part.pair_weights.tolist()):
            assert start <= e < end
            k = ids[t].tolist().index(e)
            assert w == weights[t, k].item()
            seen.append((t, e))
        assert torch.equal(part.rows, torch.unique(tokens)), "rows are exactly the tokens with pairs here"
    assert len(seen) == T * K, "every pair exactly once: none lost, none sent twice"
    assert sorted(seen) == sorted((t, e) for t in range(T) for e in ids[t].tolist())
    shards = [s.shard for s in plan.slices]
    assert all(a < b for a, b in zip(shards, shards[1:])), f"one slice per shard, ascending: {shards}"
    # The per-expert load the metrics publish: what torch counts in the routing itself.
    assert plan.expert_pairs.tolist() == torch.bincount(ids.flatten().long(), minlength=E).tolist()


def plain_partition(ids: torch.Tensor, weights: torch.Tensor, pair_shards: list[int]) -> dict:
    """The plan, pair by pair in plain Python: {shard: (rows, [3, P_s] pair block)}."""
    k = ids.shape[1]
    bits = weights.float().reshape(-1).view(torch.int32).tolist()
    plan: dict[int, tuple[list, list]] = {}
    for p, expert in enumerate(ids.reshape(-1).tolist()):
        rows, block = plan.setdefault(pair_shards[p], ([], [[], [], []]))
        if not rows or rows[-1] != p // k:
            rows.append(p // k)
        for column, value in zip(block, (len(rows) - 1, expert, bits[p])):
            column.append(value)
    return dict(sorted(plan.items()))


def test_partition_is_the_plain_pair_by_pair_grouping_bit_for_bit():
    """The C grouping (hm_partition) builds, for decode and prefill sizes, with and without a split
    expert, the plan a loop over the pairs builds: the same slices, rows, pair blocks (the weights'
    bits included) and per-expert counts."""
    g = torch.Generator().manual_seed(5)
    for num_tokens, k, num_shards in [(1, 4, 8), (1, 8, 8), (2, 4, 3), (5, 2, 16), (16, 4, 8), (8, 8, 1), (300, 4, 8)]:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(num_tokens)]).to(torch.int32)
        weights = torch.rand(num_tokens, k, generator=g, dtype=torch.float32)
        shards = Placement(E, num_shards).shard_table()
        splits = [None]
        if num_shards > 1:  # expert 0 dealt over shards 0 and 1 in turn
            slots = np.repeat(shards[:, None], 2, axis=1)
            slots[0] = [0, 1]
            splits.append(Split(slots, np.arange(E) == 0, np.zeros(E, dtype=np.int64)))
        for split in splits:
            plan = partition(ids, weights, shards, split)
            turn, pair_shards = 0, []
            for expert in ids.reshape(-1).tolist():
                if split is not None and expert == 0:
                    pair_shards.append(turn % 2)
                    turn += 1
                else:
                    pair_shards.append(int(shards[expert]))
            want = plain_partition(ids, weights, pair_shards)
            assert plan.num_tokens == num_tokens and [s.shard for s in plan.slices] == list(want)
            for part, (rows, block) in zip(plan.slices, want.values()):
                assert part.rows.dtype == torch.int64 and part.rows.tolist() == rows
                assert part.pairs.dtype == torch.int32 and part.pairs.is_contiguous() and part.pairs.tolist() == block
            assert plan.expert_pairs.tolist() == torch.bincount(ids.reshape(-1).long(), minlength=E).tolist()
    # bf16 routing weights (as a bf16 model's router gives them) reach the wire as the same float32 bits
    ids, weights = routing(6, num_tokens=3)
    shards = Placement(E, W).shard_table()
    for a, b in zip(partition(ids, weights.to(torch.bfloat16), shards).slices,
                    partition(ids, weights.to(torch.bfloat16).float(), shards).slices):  # fmt: skip
        assert torch.equal(a.pairs, b.pairs)


def test_a_routed_expert_out_of_range_is_a_named_error():
    ids = torch.tensor([[0, E]], dtype=torch.int32)
    with pytest.raises(ValueError, match=f"routed expert id outside \\[0, {E}\\)"):
        partition(ids, torch.full((1, 2), 0.5), Placement(E, W).shard_table())


def test_idle_workers_get_no_slice():
    ids = torch.tensor([[0, 1], [1, 0], [2, 3]], dtype=torch.int32)  # experts 0..3 live on workers 0 and 1
    plan = partition(ids, torch.full((3, 2), 0.5), Placement(E, W).shard_table())
    assert [s.shard for s in plan.slices] == [0, 1]


@pytest.mark.parametrize("num_tokens", [T, 1])  # 1: every slice holds every token (decode's usual case)
def test_combine_is_the_float64_sum_in_worker_order(num_tokens):
    ids, weights = routing(1, num_tokens)
    plan = partition(ids, weights, Placement(E, W).shard_table())
    g = torch.Generator().manual_seed(2)
    # magnitudes 1e-8 .. 1e16: a float64 sum of these in another order differs in its last bits
    partials = [torch.randn(len(s.rows), H, generator=g) * 10.0 ** torch.randint(-8, 17, (len(s.rows), H), generator=g)
                for s in plan.slices]  # fmt: skip
    assert len(plan.slices) > 1

    expected = torch.zeros(num_tokens, H, dtype=torch.float64)
    for part, partial in zip(plan.slices, partials):  # the ordered reference
        for i, t in enumerate(part.rows.tolist()):
            expected[t] += partial[i].double()
    assert torch.equal(combine(plan, partials, H, torch.float64), expected)
    assert torch.equal(combine(plan, partials, H, torch.bfloat16), expected.to(torch.bfloat16))
    reversed_sum = torch.zeros(num_tokens, H, dtype=torch.float64)
    for part, partial in reversed(list(zip(plan.slices, partials))):
        reversed_sum[part.rows] += partial.double()
    assert not torch.equal(reversed_sum, expected), "values whose sum depends on the order"



def test_combine_rounds_each_row_as_torch_casts_the_float64_sum():
    """hm_combine writes float32, float16 and bfloat16 itself: its bits are torch's cast of the float64
    sum, for ordinary values, rounding ties, subnormals, overflow, infinities and NaN."""
    ids, weights = routing(7, num_tokens=16)
    plan = partition(ids, weights, Placement(E, W).shard_table())
    g = torch.Generator().manual_seed(8)
    ties = torch.tensor([1.0, 1 + 2**-8, 1 + 2**-7 + 2**-8, 1 + 3 * 2**-9, 1 + 2**-11, 1 + 2**-10 + 2**-11, 65520.0,
                         2**-24, 2**-25 * 3, -0.0,
                         float("inf"), float("nan"), 3.4e38])  # fmt: skip
    for scale in (1.0, 1e-42, 1e-20, 6e4, 1e5, 3e38):
        partials = [torch.randn(len(s.rows), H, generator=g) * scale for s in plan.slices]
        for partial in partials:  # the ties alone in their columns, so that the sums are the ties
            partial[:, : len(ties)] = partial[:, -2:] = 0.0
        partials[0][0, : len(ties)] = ties
        # Ties once rounded to float32 but not in float64 (1 + 2^-11 + 2^-40): torch rounds through float32.
        token = plan.slices[0].rows[0]
        other, row = next((i, r) for i, s in enumerate(plan.slices[1:], 1) for r, t in enumerate(s.rows) if t == token)
        partials[0][0, -2:] = torch.tensor([1 + 2**-11, 1 + 2**-8])
        partials[other][row, -2:] = 2**-40
        exact = combine(plan, partials, H, torch.float64)
        for dtype, bits in ((torch.float32, torch.int32), (torch.float16, torch.int16), (torch.bfloat16, torch.int16)):
            got, want = combine(plan, partials, H, dtype), exact.to(dtype)
            assert got.dtype == dtype
            assert torch.equal(got.isnan(), want.isnan()), (scale, dtype)
            assert torch.equal(got.view(bits)[~want.isnan()], want.view(bits)[~want.isnan()]), (scale, dtype)


def test_combine_refuses_rows_out_of_range_or_order():
    ids, weights = routing(9, num_tokens=4)
    plan = partition(ids, weights, Placement(E, W).shard_table())
    partials = [torch.zeros(len(s.rows), H) for s in plan.slices]
    first = plan.slices[0]
    for rows in (first.rows.flip(0), first.rows + 4):
        bad = DispatchPlan(4, (dataclasses.replace(first, rows=rows), *plan.slices[1:]), plan.expert_pairs)
        with pytest.raises(ValueError, match="outside \\[0, 4\\) or are not ascending"):
            combine(bad, partials, H, torch.bfloat16)


def test_partition_with_the_shard_count_given_is_the_same():
    """The attention node passes its shard count (one more than its workers, for the hot slice)."""
    ids, weights = routing(10)
    shards = Placement(E, W).shard_table()
    for a, b in zip(partition(ids, weights, shards).slices, partition(ids, weights, shards, num_shards=W + 1).slices,
                    strict=True):  # fmt: skip
        assert a.shard == b.shard and torch.equal(a.rows, b.rows) and torch.equal(a.pairs, b.pairs)
    with pytest.raises(ValueError, match="shard outside"):
        partition(ids, weights, shards, num_shards=W - 1)

def test_split_over_workers_equals_one_process_moe():
    """partition -> per-worker reference experts -> combine == all experts in one place."""
    ids, weights = routing(3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    experts = DenseExpertWeights(torch.randn(E, 2 * I, H, generator=g) / 8, torch.randn(E, H, I, generator=g) / 8)
    placement = Placement(E, W)
    plan = partition(ids, weights, placement.shard_table())
    partials = []
    for part in plan.slices:
        start, end = placement.shard_range(part.shard)
        shard = DenseExpertWeights(experts.w13[start:end], experts.w2[start:end])
        partials.append(moe_experts_reference(
            x[part.rows], part.pair_rows.long(), part.pair_experts.long() - start, part.pair_weights, shard))  # fmt: skip
    distributed = combine(plan, partials, H, torch.float32)

    rows = torch.arange(T).repeat_interleave(K)
    whole = moe_experts_reference(x, rows, ids.reshape(-1).long(), weights.reshape(-1), experts)
    torch.testing.assert_close(distributed, whole, rtol=1e-5, atol=1e-5)


class ScriptedWorker:
    """A real gRPC server of the frame stream that answers every row with `value`, after `delay_s`."""

    def __init__(self, worker: int, value: float, delay_s: float, answered: list[int]):
        self.worker, self.value, self.delay_s, self.answered = worker, value, delay_s, answered

    def forward_frames(self, requests, context):
        for message in requests:
            header = frames.Header.unpack(memoryview(message)[: frames.HEADER.size])
            time.sleep(self.delay_s)
            self.answered.append(self.worker)
            partial = torch.full((header.rows, H), self.value)
            yield frames.partial_header(header.request, *partial.shape, 0).pack() + bytes(frames.tensor_bytes(partial))

    def handler(self) -> grpc.GenericRpcHandler:
        method = grpc.stream_stream_rpc_method_handler(self.forward_frames)
        return grpc.method_handlers_generic_handler(frames.GRPC_SERVICE, {"Forward": method})


def test_answers_arriving_in_reverse_order_are_combined_in_worker_order():
    """Through the transport seam and real gRPC streams: worker 2 answers first, worker 0 last. The
    float32 partials are chosen so that the order of the float64 sum changes the bits: in worker
    order 1 + 1e30 - 1e30 == 0, in arrival order -1e30 + 1e30 + 1 == 1."""
    values, delays, answered = [1.0, 1e30, -1e30], [0.6, 0.3, 0.0], []
    servers, channels = [], []
    for w in range(3):
        server = grpc.server(ThreadPoolExecutor(max_workers=1))
        server.add_generic_rpc_handlers((ScriptedWorker(w, values[w], delays[w], answered).handler(),))
        port = server.add_insecure_port(f"{HOST}:0")
        server.start()
        servers.append(server)
        channels.append(GrpcStreamChannel(w, f"{HOST}:{port}", timeout_s=30, security=Security.load(None, "attention")))
    transport = ExpertTransport(channels, Placement(3, 3))
    try:
        ids = torch.tensor([[0, 1, 2]], dtype=torch.int32)  # one token, one expert on each of workers 0, 1, 2
        plan = partition(ids, torch.ones(1, 3), shards=np.array([0, 1, 2]))
        transport.send(layer=0, micro_batch=0, x=torch.zeros(1, H, dtype=torch.bfloat16), plan=plan)
        partials = transport.take(layer=0, micro_batch=0).wait()
        out = combine(plan, partials, H, torch.float32)
    finally:
        transport.close()
        for s in servers:
            s.stop(None)
    assert answered == [2, 1, 0], "the answers did arrive in reverse"
    arrival_order = combine(DispatchPlan(1, plan.slices[::-1], plan.expert_pairs), partials[::-1], H, torch.float32)
    assert torch.equal(arrival_order, torch.ones(1, H)), "these partials do make the order visible"
    assert torch.equal(out, torch.zeros(1, H))
