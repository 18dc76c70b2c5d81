"""Re-placement on the workers (attention_server/replace.py): the plan, the deal of a split
expert's pairs over its shards, then real workers and vLLM on the skewed tiny model, whose routers
send most tokens to experts 2, 9 and 13 of every layer. The attention node moves shares of those
experts onto other workers while 16 clients stream, and every client gets the tokens of a run on
the static placement (float32, the parity tests' tie rule); no request fails."""
from __future__ import annotations

import json
import time
import urllib.request

import numpy as np
import pytest
import torch

from attention_server.handshake import fetch_info
from attention_server.partition import partition
from attention_server.replace import SLOTS, STATIC, Layout, Replacer, even_slots, plan, worst_balance
from protos.checkpoint import read_checkpoint
from protos.placement import Placement
from tests.support import GreedyStreams, compare, generate, scrape, start_attention, start_workers, total

E, W, K = 16, 8, 4
NUM_WORKERS = 8
STREAM_TOKENS = 64
SPARE_PER_LAYER = 4  # spare experts per worker and layer


def test_even_slots_spread_each_shard_over_the_turns():
    turns = np.zeros(W, dtype=np.int64)
    turns[[2, 5, 7]] = [8, 4, 4]
    slots = even_slots(turns)
    assert np.bincount(slots, minlength=W).tolist() == turns.tolist()
    # Any 4 consecutive turns (a few pairs of one call) are already in proportion: 2, 1, 1.
    for start in range(SLOTS):
        window = np.roll(slots, -start)[:4]
        assert sorted(np.bincount(window, minlength=W)[[2, 5, 7]].tolist()) == [1, 1, 2], slots


def test_a_split_expert_deals_its_pairs_over_calls_in_proportion():
    placement = Placement(E, W)
    turns = np.zeros((E, W), dtype=np.int64)
    turns[np.arange(E), placement.shard_table()] = SLOTS
    turns[2] = 0
    turns[2, [1, 4, 6]] = [8, 4, 4]  # expert 2 (home shard 1): half stays, a quarter each to 4 and 6
    layout = Layout.make(1, {3: turns}, placement)
    shards, split = layout.route(3, placement.shard_table())
    assert shards is not placement.shard_table() and split is not None and split.split.tolist() == [e == 2 for e in range(E)]
    assert layout.extras[4] == {3: (2,)} and layout.extras[6] == {3: (2,)} and layout.extras[1] == {}
    assert layout.route(5, placement.shard_table())[1] is None  # a layer not re-placed is static

    dealt = np.zeros(W, dtype=np.int64)
    for call in range(12):  # one pair of expert 2 per call: the turns carry over
        ids = torch.tensor([[2, 0, 5, 15], [3, 4, 8, 9]], dtype=torch.int32)
        plan = partition(ids, torch.full((2, K), 0.25), shards, split)
        for part in plan.slices:
            experts = part.pair_experts.tolist()
            if 2 in experts:
                dealt[part.shard] += experts.count(2)
            assert all(e == 2 or placement.shard_table()[e] == part.shard for e in experts)
        assert sum(part.num_pairs for part in plan.slices) == 2 * K
    assert dealt[[1, 4, 6]].tolist() == [6, 3, 3]


def test_the_static_route_partitions_as_before():
    g = torch.Generator().manual_seed(0)
    weights, ids = torch.softmax(torch.randn(37, E, generator=g), -1).topk(K, dim=-1)
    table = Placement(E, W).shard_table()
    shards, split = STATIC.route(1, table)
    a, b = partition(ids.to(torch.int32), weights, table), partition(ids.to(torch.int32), weights, shards, split)
    assert [(p.shard, p.rows.tolist(), p.pairs.tolist()) for p in a.slices] == [
        (p.shard, p.rows.tolist(), p.pairs.tolist()) for p in b.slices]  # fmt: skip


def skewed_counts() -> np.ndarray:
    """[2, E] pairs: experts 2, 9 and 13 take three of each token's four pairs (the skewed model's routers)."""
    counts = np.full((2, E), 40, dtype=np.int64)
    counts[:, [2, 9, 13]] = 1200
    counts[1, 6] = 300
    return counts


def test_the_plan_brings_every_layer_near_the_mean_within_the_spare_budget():
    placement, counts, layers = Placement(E, W), skewed_counts(), (1, 3)
    home = placement.shard_table()
    static = worst_balance(STATIC.loads(counts, layers, home, W))
    layout = Layout.make(1, plan(counts, layers, placement, spare_experts=8), placement)
    balanced = worst_balance(layout.loads(counts, layers, home, W))
    assert static > 2.3 and balanced <= 1.2, (static, balanced)
    assert all(sum(map(len, extras.values())) <= 8 for extras in layout.extras)
    for turns in layout.shares.values():  # every expert's turns are all dealt
        assert (turns.sum(axis=1) == SLOTS).all() and (turns >= 0).all()
    # No spare memory: nothing can move.
    assert plan(counts, layers, placement, spare_experts=0) == {}
    # One spare expert per worker: better than static, short of the target.
    tight = worst_balance(Layout.make(1, plan(counts, layers, placement, 1), placement).loads(counts, layers, home, W))
    assert balanced <= tight < static


def test_spare_memory_goes_to_the_worst_layer_first():
    placement, layers = Placement(E, 2), (0, 1, 2, 3)
    counts = np.full((4, E), 10, dtype=np.int64)
    counts[:, 0] = [400, 1000, 700, 1000]  # expert 0, on worker 0, takes most of each layer's tokens
    shares = plan(counts, layers, placement, spare_experts=3)  # not enough for every layer's share of expert 0
    assert sorted(shares) == [1, 2, 3]  # layer 0, the least uneven, gets none
    before = STATIC.loads(counts, layers, placement.shard_table(), 2)
    after = Layout.make(1, shares, placement).loads(counts, layers, placement.shard_table(), 2)
    assert all(after[i].max() < before[i].max() for i in (1, 2, 3))


def test_with_replicas_every_worker_holding_the_shard_holds_its_extras():
    placement = Placement(E, W, replicas=2)
    layout = Layout.make(1, plan(skewed_counts(), (1, 3), placement, spare_experts=8), placement)
    for layer, turns in layout.shares.items():
        for expert, shard in zip(*np.nonzero(turns)):
            for worker in placement.replica_workers(int(shard)):
                held = any(start <= expert < end for start, end in placement.worker_ranges(worker))
                assert held or expert in layout.extras[worker].get(layer, ()), (layer, expert, shard, worker)


# --- the cluster -------------------------------------------------------------------------------------


def load_view(base_url: str) -> dict:
    with urllib.request.urlopen(f"{base_url}/hetero_moe/expert_load", timeout=60) as r:
        return json.loads(r.read())


def worker_balance(shard_pairs: np.ndarray) -> np.ndarray:
    """[L, W + 1] pairs per shard (the last: the attention node) -> [L] workers' max / mean."""
    workers = shard_pairs[:, :-1]
    return workers.max(axis=1) / workers.mean(axis=1)


@pytest.mark.vllm
def test_a_replacement_mid_stream_keeps_the_tokens_and_survives_a_restart(model_dir, processes):
    model = model_dir("qwen3_moe", "skewed")
    ckpt = read_checkpoint(model)
    expert_bytes = ckpt.expert_bytes // (len(ckpt.moe_layers) * ckpt.num_experts)
    workers = start_workers(processes, model, NUM_WORKERS, tag="replace")
    static_url, _, _ = start_attention(processes, "static", model, workers, "--dtype", "float32")
    reference = generate(static_url, STREAM_TOKENS)

    base_url, client, model_id = start_attention(
        processes, "replaced", model, workers, "--dtype", "float32",
        "--spare-expert-bytes", str(SPARE_PER_LAYER * len(ckpt.moe_layers) * expert_bytes),
        "--expert-load-window", "1.2",  # a new bucket every 0.1 s: the layout follows the load at once
    )  # fmt: skip
    before, view0 = scrape(f"{base_url}/metrics"), load_view(base_url)
    answers = GreedyStreams(client, model_id, STREAM_TOKENS).join()
    report = compare(reference, answers, STREAM_TOKENS)
    after, view1 = scrape(f"{base_url}/metrics"), load_view(base_url)

    # Only the streams moved the load, so every layout taken between the scrapes was taken mid-stream.
    epochs = total(after, "hetero_moe_placement_epoch") - total(before, "hetero_moe_placement_epoch")
    assert epochs >= 1, "no layout was taken while the clients streamed"
    assert total(after, "hetero_moe_replaced_experts") > 0
    # What the workers computed, as dealt, against what the static placement would have given them.
    dealt = np.asarray(view1["shard_total"]) - np.asarray(view0["shard_total"])
    routed = np.asarray(view1["total"]) - np.asarray(view0["total"])
    home = np.asarray(view1["shards"])
    static = np.stack([np.bincount(home, weights=row, minlength=NUM_WORKERS + 1) for row in routed])
    assert dealt.sum() == static.sum() == routed.sum()
    assert (worker_balance(dealt) < worker_balance(static)).all(), (worker_balance(dealt), worker_balance(static))
    print(f"\n  16 clients x {STREAM_TOKENS} tokens: {epochs:.0f} layout(s) taken mid-stream; workers' max/mean per "
          f"layer {np.round(worker_balance(static), 2).tolist()} static, {np.round(worker_balance(dealt), 2).tolist()} "
          f"as dealt; tokens as on the static placement{', ties: ' + '; '.join(report) if report else ''}")  # fmt: skip

    # The worker that took the most moved pairs dies and comes back empty: it gets the layout's
    # experts again before it gets work, and the same prompts give the same tokens.
    helper = int(np.argmax((dealt - static)[:, :NUM_WORKERS].sum(axis=0)))
    workers.kill(helper)
    workers.restart(helper)
    again = generate(base_url, STREAM_TOKENS)
    report = compare(reference, {i: g.tokens for i, g in enumerate(again)}, STREAM_TOKENS)
    rejoined = scrape(f"{base_url}/metrics")
    assert total(rejoined, "hetero_moe_transport_rejoins_total", worker=str(helper)) == 1
    assert "placement epoch" in processes.log(workers.names[helper])  # the new process took the layout
    processes.stop("static", "replaced", *workers.names)
    print(f"  worker {helper} (held moved experts) killed and restarted: it took the layout again and rejoined; "
          f"tokens as on the static placement{', ties: ' + '; '.join(report) if report else ''}")


def test_a_new_node_places_over_workers_that_served_another(model_dir, processes):
    """Two attention nodes' Replacers, one after the other, over the same two real workers: the
    second numbers its epochs on from what the workers report, so they take its layout too."""
    model = model_dir("qwen3_moe")
    ckpt = read_checkpoint(model)
    workers = start_workers(processes, model, 2, tag="renode")
    placement = Placement(ckpt.num_experts, 2)
    layers = tuple(ckpt.moe_layers)
    counts = np.full((len(layers), ckpt.num_experts), 10, dtype=np.int64)
    counts[:, 0] = 1000  # expert 0, on worker 0, takes most tokens: a share of it goes to worker 1

    def node() -> Layout:
        infos = [fetch_info(w, e, 30, workers.security) for w, e in enumerate(workers.endpoints)]
        replacer = Replacer(placement, tuple(workers.endpoints), workers.security, 8 * ckpt.expert_bytes, ckpt.expert_bytes,
                            1.2, lambda: False, lambda: None, max(info.placement_epoch for info in infos))  # fmt: skip
        replacer.offer(counts, layers, {})
        deadline = time.monotonic() + 60
        while (layout := replacer.current()).epoch == 0:
            assert time.monotonic() < deadline, "the layout was not placed"
            time.sleep(0.1)
        return layout

    first, second = node(), node()
    assert second.epoch > first.epoch
    assert all(0 in second.extras[1][layer] for layer in layers), second.extras
    for w, endpoint in enumerate(workers.endpoints):
        assert fetch_info(w, endpoint, 30, workers.security).placement_epoch == second.epoch
    processes.stop(*workers.names)
