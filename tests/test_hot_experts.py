"""Hot experts on the attention node (attention_server/hot.py): the choice within a byte budget,
then real workers and vLLM on the skewed tiny model, whose routers send most tokens to experts 2,
9 and 13 of every layer. The attention node takes those over from the load window while 16
clients stream, and every client gets the tokens of a run with every expert on the workers
(float32, the parity tests' tie rule); no request fails."""
from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from attention_server.config import bytes_flag
from attention_server.hot import choose
from protos.checkpoint import read_checkpoint
from tests.support import GreedyStreams, compare, generate, scrape, start_attention, start_workers, total

NUM_WORKERS = 8
STREAM_TOKENS = 64
HOT_PER_LAYER = 3


def test_choose_takes_the_busiest_that_fit_the_budget():
    window = np.array([[0, 5, 9, 1], [3, 0, 9, 2]])  # [L, E] pairs over the window
    assert choose(window, (1, 3), 3 * 10, 10) == {1: (1, 2), 3: (2,)}  # 9, 9, then 5
    assert choose(window, (1, 3), 3 * 10 + 9, 10) == {1: (1, 2), 3: (2,)}  # a part of an expert holds none
    assert choose(window, (1, 3), 100 * 10, 10) == {1: (1, 2, 3), 3: (0, 2, 3)}  # never an idle expert
    assert choose(window, (1, 3), 9, 10) == {}
    assert choose(np.array([[4, 4], [4, 4]]), (0, 1), 3 * 10, 10) == {0: (0, 1), 1: (0,)}  # ties: lower layer, expert


def test_byte_budget_flag():
    assert [bytes_flag(t) for t in ("1048576", "512MiB", "2GiB", "1.5G", "64 MiB")] == [
        2**20, 512 * 2**20, 2 * 2**30, 1_500_000_000, 64 * 2**20]  # fmt: skip
    with pytest.raises(Exception, match="byte count"):
        bytes_flag("lots")


@pytest.mark.vllm
def test_hot_experts_taken_mid_stream_keep_the_tokens(model_dir, processes):
    model = model_dir("qwen3_moe", "skewed")
    ckpt = read_checkpoint(model)
    expert_bytes = ckpt.expert_bytes // (len(ckpt.moe_layers) * ckpt.num_experts)
    budget = HOT_PER_LAYER * len(ckpt.moe_layers) * expert_bytes
    workers = start_workers(processes, model, NUM_WORKERS, tag="hot")
    cold_url, _, _ = start_attention(processes, "all-remote", model, workers, "--dtype", "float32")
    reference = generate(cold_url, STREAM_TOKENS)

    base_url, client, model_id = start_attention(
        processes, "hot", model, workers, "--dtype", "float32", "--hot-expert-bytes", str(budget),
        "--expert-load-window", "1.2",  # a new bucket every 0.1 s: the set follows the load at once
    )  # fmt: skip
    before = scrape(f"{base_url}/metrics")
    answers = GreedyStreams(client, model_id, STREAM_TOKENS).join()
    report = compare(reference, answers, STREAM_TOKENS)
    after = scrape(f"{base_url}/metrics")
    with urllib.request.urlopen(f"{base_url}/hetero_moe/expert_load", timeout=60) as r:
        hot = json.loads(r.read())["hot"]

    # Only the streams moved the load, so every epoch taken between the scrapes was taken mid-stream.
    epochs = total(after, "hetero_moe_placement_epoch") - total(before, "hetero_moe_placement_epoch")
    hot_pairs = total(after, "hetero_moe_hot_pairs_total") - total(before, "hetero_moe_hot_pairs_total")
    routed = total(after, "hetero_moe_route_pairs_total") - total(before, "hetero_moe_route_pairs_total")
    assert epochs >= 1, "no hot set was taken while the clients streamed"
    assert total(after, "hetero_moe_hot_experts") == HOT_PER_LAYER * len(ckpt.moe_layers)
    assert total(after, "hetero_moe_hot_expert_bytes") == budget
    # Experts 2, 9 and 13 take 3 of a token's 4 pairs: the node took the skewed routers' favourites.
    assert hot == {str(layer): [2, 9, 13] for layer in ckpt.moe_layers}, hot
    assert 0.5 * routed < hot_pairs < routed
    processes.stop("all-remote", "hot", *workers.names)
    print(f"\n  16 clients x {STREAM_TOKENS} tokens: {epochs:.0f} hot set(s) taken mid-stream, "
          f"{hot_pairs:.0f} of {routed:.0f} routed pairs computed on the attention node; "
          f"tokens as with every expert remote{', ties: ' + '; '.join(report) if report else ''}")  # fmt: skip
