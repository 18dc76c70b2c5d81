"""Expert load (attention_server/load): the ring on a fake clock, then the real cluster on the
skewed tiny model, whose per-expert counts are checked against transformers' own routers.

The cluster serves float32 (where vLLM and transformers differ by float32 rounding only; the
skewed model's smallest gap between a token's 4th and 5th router logit on these prompts is
4.7e-3) with prefix caching off, so every prompt token and every generated token but the last
passes each MoE layer once, as in one transformers forward over the same ids.
"""
from __future__ import annotations

import json
import signal
import subprocess
import urllib.request

import numpy as np
import pytest
import torch

from attention_server.load.window import BUCKETS, ExpertLoad
from cluster.launcher import wait_http_ready
from protos.checkpoint import read_checkpoint
from tests.support import (
    HOST, PROMPTS, VLLM_CPU_ARGS, ClusterCounters, assert_workers_did_the_work, free_ports, free_worker_ports, openai_client,
    port_flags, python_module, scrape, token_id,
)  # fmt: skip

NUM_WORKERS = 8
NEW_TOKENS = 16
TOP_N = 3  # README: 2 x L x (3 + 1) series for L MoE layers
LOAD_SERIES = ("hetero_moe_expert_load_balance", "hetero_moe_expert_load_top_expert",
               "hetero_moe_expert_load_top_token_ratio")  # fmt: skip


# --- the ring ----------------------------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_window_forgets_what_left_it_and_total_keeps_everything():
    clock, shards = Clock(), np.repeat(np.arange(8), 2)
    load = ExpertLoad([1, 3], shards, top_k=2, window_s=12.0, clock=clock)  # buckets of 1 s
    first = np.bincount([0, 5, 5, 7], minlength=16)
    load.add(load.slots[3], first, [(0, 1), (2, 2), (3, 1)])
    clock.now += BUCKETS - 0.5  # the first bucket is still in the window
    assert load.advance()
    later = np.bincount([2, 2, 2, 9], minlength=16)
    load.add(load.slots[1], later, [(1, 3), (4, 1)])
    view = load.view()
    assert view.window.tolist() == [later.tolist(), first.tolist()] == view.total.tolist()
    assert view.shard_window.tolist() == [[0, 3, 0, 0, 1, 0, 0, 0, 0], [1, 0, 2, 1, 0, 0, 0, 0, 0]]
    assert view.covered_s == pytest.approx(BUCKETS - 0.5)
    clock.now += 1.0  # now it has left
    assert load.advance() and not load.advance()
    view = load.view()
    assert view.window.tolist() == [later.tolist(), [0] * 16]
    assert view.total.tolist() == [later.tolist(), first.tolist()]
    assert view.shard_window[1].sum() == 0 and view.shard_total[1].sum() == 4
    assert view.covered_s == pytest.approx(BUCKETS - 0.5)  # 11 whole buckets and half of the current one
    clock.now += 10 * BUCKETS  # a long idle: everything left, once
    load.advance()
    assert not load.view().window.any() and load.view().total.sum() == first.sum() + later.sum()


def test_balance_and_top_of_a_view():
    clock, shards = Clock(), np.repeat(np.arange(8), 2)
    load = ExpertLoad([0, 1], shards, top_k=2, window_s=60.0, clock=clock)
    load.add(0, np.bincount([4, 4, 4, 4, 5, 5, 1, 1], minlength=16), [(0, 2), (2, 3), (5, 1), (8, 2)])  # 4 tokens x top-2
    view = load.view()
    np.testing.assert_allclose(view.balance("expert"), [4 / (8 / 16), np.nan])
    # As the shards computed them (three of expert 4's pairs went elsewhere); the node's 2 hot ones left out.
    np.testing.assert_allclose(view.balance("shard"), [3 / (6 / 8), np.nan])
    np.testing.assert_allclose(view.balance("shard", total=True), [3 / (6 / 8), np.nan])
    ids, shares = view.top(view.window, 3)
    assert ids[0].tolist() == [4, 1, 5]  # 1 and 5 tie: the lower id first
    np.testing.assert_allclose(shares[0], [1.0, 0.5, 0.5])
    assert np.isnan(shares[1]).all()


# --- the cluster -------------------------------------------------------------------------------------

def transformers_routing(model_path, sequences: list[list[int]]) -> np.ndarray:
    """[L, E] tokens transformers' own routers send to each expert over one forward per sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    layers = model.model.layers
    counts = np.zeros((len(layers), model.config.num_experts), dtype=np.int64)

    def count(layer: int):
        def hook(_module, _inputs, output):
            _logits, _weights, indices = output  # Qwen3MoeTopKRouter: indices [T, k]
            counts[layer] += np.bincount(indices.flatten().numpy(), minlength=counts.shape[1])
        return hook

    hooks = [layer.mlp.gate.register_forward_hook(count(i)) for i, layer in enumerate(layers)]
    with torch.no_grad():
        for ids in sequences:
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return counts


def get_json(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/hetero_moe/expert_load", timeout=60) as r:
        return json.loads(r.read())


@pytest.mark.vllm
def test_cluster_counts_what_transformers_routes(model_dir, tmp_path):
    from transformers import AutoTokenizer

    model = model_dir("qwen3_moe", "skewed")
    ckpt = read_checkpoint(model)
    (http,) = free_ports(1)
    ports = free_worker_ports(NUM_WORKERS)
    base_url = f"http://{HOST}:{http}"
    with open(tmp_path / "cluster.log", "wb") as log:
        launcher = subprocess.Popen(
            python_module("cluster", "up", "--model", str(model), "--host", HOST, "--port", str(http), *port_flags(ports),
                          "--run-dir", str(tmp_path / "run"), "--expert-load-window", "3600",
                          "--", *VLLM_CPU_ARGS, "--dtype", "float32", "--no-enable-prefix-caching",
                          "--enforce-eager"),  # it counts routes: the compiled graph is not what it tests
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        wait_http_ready(base_url, [launcher], timeout_s=900)
        metrics_urls = [f"http://{HOST}:{ports['worker_metrics_base_port'] + i}/metrics" for i in range(NUM_WORKERS)]
        counters = ClusterCounters.read(f"{base_url}/metrics", metrics_urls)
        before = get_json(base_url)

        tokenizer = AutoTokenizer.from_pretrained(model)
        prompts = [tokenizer(p).input_ids for p in PROMPTS]
        with openai_client(base_url) as client:
            response = client.completions.create(
                model=client.models.list().data[0].id, prompt=prompts, max_tokens=NEW_TOKENS, temperature=0, logprobs=0,
                extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
            )  # fmt: skip
        generated = {c.index: [token_id(t) for t in c.logprobs.tokens] for c in response.choices}

        after = get_json(base_url)
        work = assert_workers_did_the_work(counters, ClusterCounters.read(f"{base_url}/metrics", metrics_urls),
                                           ckpt.top_k, ckpt.moe_layers, "reference")  # fmt: skip
        cli = subprocess.run(python_module("attention_server.load", base_url, "--json"), capture_output=True, text=True,
                             check=True).stdout  # fmt: skip
        table = subprocess.run(python_module("attention_server.load", base_url, "--total"), capture_output=True, text=True,
                               check=True).stdout  # fmt: skip
        png = tmp_path / "load.png"
        subprocess.run(python_module("attention_server.load", base_url, "--png", str(png)), check=True, capture_output=True)
        metrics = scrape(f"{base_url}/metrics")  # set by the CLI's last read, with no step since
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGINT)
            launcher.wait(timeout=120)

    expected = transformers_routing(model, [prompts[i] + generated[i][:-1] for i in range(len(prompts))])
    assert after["layers"] == list(ckpt.moe_layers)
    counted = np.asarray(after["total"]) - np.asarray(before["total"])
    assert counted.tolist() == expected.tolist(), f"the cluster counted\n{counted}\ntransformers routed\n{expected}"
    # The skew is the model's, not the accounting's: its hot experts lead every layer.
    assert all(set(np.argsort(-row, kind="stable")[:3].tolist()) == {2, 9, 13} for row in expected), expected
    print(f"\n  {work}\n  per-expert counts equal transformers' routing:\n{counted}\n{table}")

    # A window longer than the server's life holds everything, as the CLI's JSON shows it.
    view = json.loads(cli)
    assert view["window"] == view["total"] == after["total"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The gauges: the count README states, and the values of the view they were set from.
    layers, experts = len(ckpt.moe_layers), ckpt.num_experts
    series = {(name, labels) for (name, labels) in metrics if name in LOAD_SERIES}
    assert len(series) == 2 * layers * (TOP_N + 1), sorted(series)
    window = np.asarray(view["window"])
    shards = np.asarray(view["shards"])
    for row, shard_row, layer in zip(window, np.asarray(view["shard_window"]), ckpt.moe_layers):
        gauge = {(name, tuple(v for _, v in labels)): value for (name, labels), value in metrics.items()
                 if name in LOAD_SERIES and dict(labels)["layer"] == str(layer)}  # fmt: skip
        per_shard = np.array([row[shards == s].sum() for s in range(shards.max() + 1)])
        assert shard_row.tolist() == [*per_shard.tolist(), 0]  # the static placement, no hot experts
        assert gauge[LOAD_SERIES[0], (str(layer), "expert")] == pytest.approx(row.max() / (row.sum() / experts))
        assert gauge[LOAD_SERIES[0], (str(layer), "shard")] == pytest.approx(per_shard.max() / per_shard.mean())
        busiest = sorted(range(experts), key=lambda e: (-row[e], e))[:TOP_N]
        tokens = row.sum() / ckpt.top_k
        for rank, expert in enumerate(busiest, start=1):
            assert gauge[LOAD_SERIES[1], (str(layer), str(rank))] == expert
            assert gauge[LOAD_SERIES[2], (str(layer), str(rank))] == pytest.approx(row[expert] / tokens)
