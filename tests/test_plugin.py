"""The plugin inside vLLM: default-off is stock vLLM; on, pool A neither holds nor reads a routed
expert and every routed token goes through the workers."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.launcher import wait_http_ready
from protos.checkpoint import read_checkpoint
from tests.support import HOST, VLLM_CPU_ARGS, Workers, free_ports, generate, python_module, scrape, start_workers, total

pytestmark = pytest.mark.vllm

PROBE = Path(__file__).with_name("vllm_probe.py")
NUM_WORKERS = 8


def probe(model: Path, workers: Workers | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_MOE_")}
    if workers:
        env["HETERO_MOE_EXPERT_ENDPOINTS"] = ",".join(workers.endpoints)
        env["HETERO_MOE_TLS_DIR"] = str(workers.tls_dir)
    result = subprocess.run([sys.executable, str(PROBE), str(model)], capture_output=True, text=True, env=env, timeout=900)
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("PROBE ")), None)
    assert result.returncode == 0 and line, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(line.removeprefix("PROBE "))


def counter(samples: list, name: str, **labels: str) -> float:
    """Sum of the probe's counter samples called `name` whose labels include `labels`."""
    return sum(v for n, ls, v in samples if n == name and labels.items() <= ls.items())


@pytest.fixture(scope="module")
def qwen2(model_dir):
    return model_dir("qwen2_moe")  # routed and shared experts


@pytest.fixture(scope="module")
def routed_tensor_names(qwen2) -> set[str]:
    ckpt = read_checkpoint(qwen2)
    n = ckpt.naming
    return {n.name(layer, e, proj) for layer in ckpt.moe_layers for e in range(ckpt.num_experts)
            for proj in (n.gate, n.up, n.down)}  # fmt: skip


@pytest.fixture(scope="module")
def stock(qwen2):
    return probe(qwen2, None)


def test_plugin_off_is_stock_vllm(stock, routed_tensor_names):
    assert stock["routed_classes"] == ["vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts"]
    assert stock["routed_expert_params"] > 0
    # register() ran (the entry point is installed) and imported nothing else.
    assert stock["plugin_modules"] == ["attention_server", "attention_server.config", "attention_server.plugin"]
    assert routed_tensor_names <= set(stock["tensors_read"]), "the probe sees vLLM read routed experts"
    assert stock["counters_after"] == []


def test_plugin_on_holds_and_reads_no_routed_expert(qwen2, stock, routed_tensor_names, processes):
    workers = start_workers(processes, qwen2, NUM_WORKERS, tag="plugin-qwen2")
    before = [scrape(url) for url in workers.metrics_urls]
    on = probe(qwen2, workers)
    after = [scrape(url) for url in workers.metrics_urls]

    assert on["routed_classes"] == ["attention_server.routed_experts.RemoteRoutedExperts"]
    assert on["num_routed_layers"] == stock["num_routed_layers"] > 0
    assert on["routed_expert_params"] == 0
    assert on["total_params"] == stock["total_params"] - stock["routed_expert_params"]
    read = set(on["tensors_read"])
    assert not read & routed_tensor_names, f"pool A read routed experts: {sorted(read & routed_tensor_names)[:4]}"
    assert read == set(stock["tensors_read"]) - routed_tensor_names, "every other tensor is read as stock reads it"

    # The generation's tokens went through the MoE layers once each (the last generated one never does).
    ckpt = read_checkpoint(qwen2)
    counters_before, counters_after = on["counters_before"], on["counters_after"]
    for layer in ckpt.moe_layers:
        routed = (counter(counters_after, "hetero_moe_route_tokens_total", layer=str(layer))
                  - counter(counters_before, "hetero_moe_route_tokens_total", layer=str(layer)))  # fmt: skip
        assert routed == on["prompt_tokens"] + len(on["tokens"]) - 1, f"layer {layer} routed {routed} tokens"
    # Since vLLM started (its profiling run included), each worker computed what the plugin sent it.
    for w in range(NUM_WORKERS):
        sent = {what: counter(counters_after, f"hetero_moe_dispatch_{what}_total", worker=str(w))
                for what in ("messages", "rows", "pairs")}  # fmt: skip
        done = {
            "messages": total(after[w], "hetero_moe_worker_requests_total", status="OK")
            - total(before[w], "hetero_moe_worker_requests_total", status="OK"),
            "rows": total(after[w], "hetero_moe_worker_rows_total") - total(before[w], "hetero_moe_worker_rows_total"),
            "pairs": total(after[w], "hetero_moe_worker_pairs_total") - total(before[w], "hetero_moe_worker_pairs_total"),
        }
        assert sent == done and done["messages"] > 0, f"worker {w} computed {done}; the plugin sent {sent}"
    pairs = counter(counters_after, "hetero_moe_dispatch_pairs_total")
    assert pairs == ckpt.top_k * counter(counters_after, "hetero_moe_route_tokens_total")


def test_attention_server_without_endpoints_serves_stock_vllms_tokens(qwen2, tmp_path):
    """`python -m attention_server` with no --expert-endpoints answers exactly as vLLM's own server.
    Both start side by side, then answer one request at a time each, the other idle."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_MOE_")}
    servers = {}
    for name, module in (("stock", "vllm.entrypoints.openai.api_server"), ("attention_server", "attention_server")):
        (port,) = free_ports(1)
        with open(tmp_path / f"{name}.log", "wb") as log:
            servers[name] = f"http://{HOST}:{port}", subprocess.Popen(
                python_module(module, "--model", str(qwen2), "--host", HOST, "--port", str(port), *VLLM_CPU_ARGS,
                              "--enforce-eager"),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
            )  # fmt: skip
    try:
        for url, proc in servers.values():
            wait_http_ready(url, [proc], timeout_s=600)
        served = {name: (generate(url, alone=True), scrape(f"{url}/metrics")) for name, (url, _) in servers.items()}
    finally:
        for _, proc in servers.values():
            os.killpg(proc.pid, signal.SIGTERM)
        for _, proc in servers.values():
            proc.wait(timeout=60)
    (stock, stock_metrics), (ours, our_metrics) = served["stock"], served["attention_server"]
    assert [g.tokens for g in ours] == [g.tokens for g in stock]
    assert [g.margins for g in ours] == [g.margins for g in stock], "the same logprobs, to the bit"
    assert not [n for n, _ in our_metrics if n.startswith("hetero_moe_")], "the plugin stayed off"
    assert total(our_metrics, "vllm:generation_tokens_total") == total(stock_metrics, "vllm:generation_tokens_total") > 0
