"""Partition and combine, in-process: every pair goes to exactly one worker; the sum is ordered."""
from __future__ import annotations

import torch

from attention_server.combine import combine
from attention_server.partition import partition
from kernels.reference import DenseExpertWeights, moe_experts_reference
from protos.placement import Placement

T, H, I, E, K, W = 37, 32, 16, 16, 4, 8


def routing(seed: int, num_tokens: int = T) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, E, generator=g)
    weights, ids = torch.softmax(logits, -1).topk(K, dim=-1)
    return ids.to(torch.int32), weights


def test_partition_sends_each_pair_to_its_owner_once():
    ids, weights = routing(0)
    placement = Placement(E, W)
    plan = partition(ids, weights, placement.owner_table())
    seen = set()
    for part in plan.slices:
        start, end = placement.expert_range(part.worker)
        tokens = part.rows[part.pair_rows.long()]
        for t, e, w in zip(tokens.tolist(), part.pair_experts.tolist(), part.pair_weights.tolist()):
            assert start <= e < end
            k = ids[t].tolist().index(e)
            assert w == weights[t, k].item()
            seen.add((t, e))
        assert torch.equal(part.rows, torch.unique(tokens)), "rows are exactly the tokens with pairs here"
    assert seen == {(t, e) for t in range(T) for e in ids[t].tolist()}
    assert [s.worker for s in plan.slices] == sorted(s.worker for s in plan.slices)


def test_idle_workers_get_no_slice():
    ids = torch.tensor([[0, 1], [1, 0], [2, 3]], dtype=torch.int32)  # experts 0..3 live on workers 0 and 1
    plan = partition(ids, torch.full((3, 2), 0.5), Placement(E, W).owner_table())
    assert [s.worker for s in plan.slices] == [0, 1]


def test_combine_is_the_float64_sum_in_worker_order_whatever_the_arrival_order():
    ids, weights = routing(1)
    plan = partition(ids, weights, Placement(E, W).owner_table())
    g = torch.Generator().manual_seed(2)
    partials = [torch.randn(len(s.rows), H, generator=g) * 1e3 for s in plan.slices]

    expected = torch.zeros(T, H, dtype=torch.float64)
    for part, partial in zip(plan.slices, partials):  # the ordered reference
        for i, t in enumerate(part.rows.tolist()):
            expected[t] += partial[i].double()
    out = combine(plan, partials, H, torch.bfloat16)
    assert torch.equal(out, expected.to(torch.bfloat16))
    # Answers that arrive in another order are still added by worker index.
    assert torch.equal(combine(plan, list(partials), H, torch.bfloat16), out)


def test_split_over_workers_equals_one_process_moe():
    """partition -> per-worker reference experts -> combine == all experts in one place."""
    ids, weights = routing(3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    experts = DenseExpertWeights(torch.randn(E, 2 * I, H, generator=g) / 8, torch.randn(E, H, I, generator=g) / 8)
    placement = Placement(E, W)
    plan = partition(ids, weights, placement.owner_table())
    partials = []
    for part in plan.slices:
        start, end = placement.expert_range(part.worker)
        shard = DenseExpertWeights(experts.w13[start:end], experts.w2[start:end])
        partials.append(moe_experts_reference(
            x[part.rows], part.pair_rows.long(), part.pair_experts.long() - start, part.pair_weights, shard))  # fmt: skip
    distributed = combine(plan, partials, H, torch.float32)

    rows = torch.arange(T).repeat_interleave(K)
    whole = moe_experts_reference(x, rows, ids.reshape(-1).long(), weights.reshape(-1), experts)
    torch.testing.assert_close(distributed, whole, rtol=1e-5, atol=1e-5)
