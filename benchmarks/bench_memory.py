"""Resident memory of the attention node with and without remote experts.

python -m benchmarks.bench_memory [--preset large] [--out results/memory.json]

Starts stock vLLM on a checkpoint whose routed experts dominate, measures the
RSS and USS of its whole process tree once it serves, stops it, then does the
same for the attention server of a cluster (its eight workers are reported
separately). Both run with the same vLLM flags and KV-cache size.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

import tiny_models
from cluster.certs import reuse_or_make
from cluster.launcher import ClusterSpec, stop_pids, wait_http_ready
from protos.checkpoint import read_checkpoint
from benchmarks import machine

HOST = "127.0.0.1"
VLLM_ARGS = ("--dtype", "bfloat16", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(1 << 30), "--enforce-eager")


def tree_memory(pid: int) -> dict[str, float]:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    rss = uss = 0
    for p in procs:
        info = p.memory_full_info()
        rss, uss = rss + info.rss, uss + info.uss
    return {"processes": len(procs), "rss_mib": rss / 2**20, "uss_mib": uss / 2**20}


def settle_and_measure(pid: int) -> dict[str, float]:
    time.sleep(5)  # let start-up garbage be freed
    return tree_memory(pid)


def measure(cmd: list[str], url: str, log: Path, env: dict[str, str]) -> dict[str, float]:
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        wait_http_ready(url, [proc], timeout_s=900)
        return settle_and_measure(proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="qwen3_moe")
    p.add_argument("--preset", default="large")
    p.add_argument("--port", type=int, default=8390)
    p.add_argument("--worker-base-port", type=int, default=50390)
    p.add_argument("--worker-metrics-base-port", type=int, default=9490)
    p.add_argument("--out", type=Path, default=Path("results/memory.json"))
    a = p.parse_args()
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hetero-moe" / "models"
    model = tiny_models.make(a.arch, cache / f"{a.arch}-{a.preset}", preset=a.preset)
    ckpt = read_checkpoint(model)
    logs = a.out.parent / "memory-logs"
    logs.mkdir(parents=True, exist_ok=True)
    url = f"http://{HOST}:{a.port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_MOE_")}
    serve = ["--model", str(model), "--host", HOST, "--port", str(a.port), *VLLM_ARGS]

    stock = measure([sys.executable, "-m", "vllm.entrypoints.openai.api_server", *serve], url, logs / "stock.log", env)

    spec = ClusterSpec(model=model, num_workers=8, worker_base_port=a.worker_base_port, http_port=a.port, host=HOST,
                       run_dir=logs, worker_threads=1, worker_metrics_base_port=a.worker_metrics_base_port,
                       vllm_args=VLLM_ARGS, tls_dir=reuse_or_make(logs / "tls"))  # fmt: skip
    workers = {}
    for i in range(spec.num_workers):
        with (logs / f"worker-{i}.log").open("wb") as f:
            workers[f"worker-{i}"] = subprocess.Popen(spec.worker_command(i), stdout=f, stderr=subprocess.STDOUT,
                                                      start_new_session=True)  # fmt: skip
    try:
        attention = measure(spec.attention_command(), url, logs / "attention.log", env)
        worker_mem = [tree_memory(w.pid) for w in workers.values()]
    finally:
        stop_pids({n: w.pid for n, w in workers.items()}, reap=lambda: [w.poll() for w in workers.values()])

    expert_bytes = sum(
        2 * 3 * ckpt.hidden_size * ckpt.intermediate_size * ckpt.num_experts for _ in ckpt.moe_layers
    )  # bf16 gate, up, down per expert
    result = {
        "model": f"{a.arch}/{a.preset}",
        "routed_expert_weights_mib": expert_bytes / 2**20,
        "stock_vllm": stock,
        "attention_server_with_plugin": attention,
        "saved_rss_mib": stock["rss_mib"] - attention["rss_mib"],
        "workers_rss_mib_each": [w["rss_mib"] for w in worker_mem],
        "vllm_args": list(VLLM_ARGS),
        "machine": machine.describe(False),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2))
    print(f"{'':32}{'RSS MiB':>10}{'USS MiB':>10}{'procs':>7}")
    for name, m in (("stock vLLM", stock), ("attention server (plugin on)", attention)):
        print(f"{name:32}{m['rss_mib']:10.0f}{m['uss_mib']:10.0f}{m['processes']:7d}")
    print(f"routed expert weights (bf16): {result['routed_expert_weights_mib']:.0f} MiB; "
          f"RSS saved on pool A: {result['saved_rss_mib']:.0f} MiB; wrote {a.out}")  # fmt: skip


if __name__ == "__main__":
    main()
