"""What the expert load accounting costs a decode step: the same steps with it on and off, one run.

    python -m benchmarks.bench_load [--out FILE] [--steps N] [--tokens T] [--plane shm]

Eight workers serve the embedded tiny model on loopback. A client drives decode steps through the
attention node's own ExpertPool (attention_server/routed_experts.py): per MoE layer partition,
send, wait, the pool's record (counters and load window) and combine, then the pool's end_step,
as the plugin runs them, T tokens of random routing. Short rounds alternate between the window on
and off (the pool's ExpertLoad and None, as --expert-load-window 60 and 0 build it), which one goes
first alternating too, so that drift and order fall on both; prometheus_client runs in
multiprocess mode, as on the attention node.

The accounting's own cost is a few microseconds against steps of milliseconds, below this
machine's step-to-step noise; so the bench also times the accounting alone (every layer's add,
the ring's advance, and the gauges it sets when a bucket starts, amortised) at the tiny model's
shape and at Qwen3-30B-A3B's (48 MoE layers, 128 experts). Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import tiny_models
from attention_server.config import DEFAULT_EXPERT_LOAD_WINDOW_S, AttentionConfig, share_metrics_across_processes
from cluster.launcher import Cluster, ClusterSpec, free_worker_ports
from protos.checkpoint import read_checkpoint
from benchmarks import machine

logger = logging.getLogger("bench_load")

HOST = "127.0.0.1"
NUM_WORKERS = 8
MODES = ("on", "off")
ROUNDS = 100  # alternating rounds; each mode gets steps / ROUNDS steps per round
A3B = {"layers": 48, "experts": 128, "top_k": 8, "workers": 8}  # Qwen3-30B-A3B's MoE shape


def decode_steps(pool, ckpt, tokens: int, steps: int, g: torch.Generator) -> list[float]:
    """Seconds of each decode step's expert path, as RemoteRoutedExperts runs it."""
    from attention_server.combine import combine
    from attention_server.partition import partition

    x = torch.randn(tokens, ckpt.hidden_size, generator=g).to(ckpt.dtype)
    times = []
    for _ in range(steps):
        routings = [torch.softmax(torch.randn(tokens, ckpt.num_experts, generator=g), -1).topk(ckpt.top_k, -1)
                    for _ in ckpt.moe_layers]  # fmt: skip
        start = time.perf_counter()
        for layer, (weights, ids) in zip(ckpt.moe_layers, routings):
            pool.transport.send(layer, 0, x, partition(ids.to(torch.int32), weights, pool.shards))
            pending = pool.transport.take(layer, 0)
            partials = pending.wait()
            pool.record(layer, pending, x.shape[1], x.element_size())
            combine(pending.plan, partials, x.shape[1], x.dtype)
        pool.end_step()
        times.append(time.perf_counter() - start)
    return times


def accounting_alone(layers: int, experts: int, top_k: int, workers: int, tokens: int, steps: int = 20000) -> dict:
    """Microseconds per step of the window's work alone: one add per layer (the expert counts and
    the pairs of each slice sent), the advance, and the gauges set at each bucket start (timed
    apart, spread over the steps of a bucket at 100 steps/s)."""
    from attention_server import metrics
    from attention_server.load.window import BUCKETS, ExpertLoad

    rng = np.random.default_rng(0)
    shards = np.repeat(np.arange(workers), experts // workers)
    pairs = [np.bincount(rng.integers(0, experts, tokens * top_k), minlength=experts) for _ in range(layers)]
    sent = [[(s, int(n)) for s, n in enumerate(np.bincount(shards, weights=p)) if n] for p in pairs]  # per slice
    load = ExpertLoad(range(layers), shards, top_k, DEFAULT_EXPERT_LOAD_WINDOW_S)
    start = time.perf_counter()
    for _ in range(steps):
        for slot in range(layers):
            load.add(slot, pairs[slot], [(shard, n) for shard, n in sent[slot]])  # as ExpertPool.record
        load.advance()
    per_step = (time.perf_counter() - start) / steps
    start = time.perf_counter()
    for _ in range(20):
        metrics.publish_load(load.view())
    publish = (time.perf_counter() - start) / 20
    steps_per_bucket = 100 * DEFAULT_EXPERT_LOAD_WINDOW_S / BUCKETS
    return {"layers": layers, "experts": experts, "tokens_per_step": tokens,
            "add_and_advance_us": per_step * 1e6, "publish_gauges_us": publish * 1e6,
            "per_step_us": (per_step + publish / steps_per_bucket) * 1e6}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("results/bench_load.json"))
    p.add_argument("--steps", type=int, default=1000, help="measured decode steps per mode")
    p.add_argument("--tokens", type=int, default=8, help="tokens per decode step (requests in the batch)")
    p.add_argument("--plane", default="shm", choices=("shm", "tcp", "grpc"))
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    metrics_dir = share_metrics_across_processes()  # noqa: F841 (first: the pool's metrics import prometheus_client)
    from attention_server.routed_experts import ExpertPool

    a.out.parent.mkdir(parents=True, exist_ok=True)
    logs = a.out.parent / "bench-load-logs"
    logs.mkdir(exist_ok=True)
    torch.set_num_threads(1)
    model = tiny_models.make("qwen3_moe", tiny_models.default_model_dir())
    ckpt = read_checkpoint(model)
    spec = ClusterSpec(model=model, num_workers=NUM_WORKERS, http_port=0, host=HOST, run_dir=logs, worker_threads=1,
                       **free_worker_ports(NUM_WORKERS), tls_dir=None)  # fmt: skip
    workers = Cluster(spec)
    try:
        workers.start_workers()
        cfg = AttentionConfig(tuple(spec.endpoints), data_plane=a.plane, tls_dir=None)
        pool = ExpertPool(cfg, ckpt, torch.device("cpu"))  # waits for the workers' Info
        load = pool.load
        g = torch.Generator().manual_seed(0)
        times = {mode: [] for mode in MODES}
        try:
            decode_steps(pool, ckpt, a.tokens, 50, g)  # warm: connections, buffers, the workers' first layers
            for i in range(ROUNDS):
                for mode in MODES[:: 1 if i % 2 else -1]:  # which mode runs first alternates too
                    pool.load = load if mode == "on" else None
                    times[mode] += decode_steps(pool, ckpt, a.tokens, max(1, a.steps // ROUNDS), g)
        finally:
            pool.transport.close()
    finally:
        workers.stop()
    steps = {mode: {"p50_ms": statistics.median(t) * 1e3, "mean_ms": statistics.fmean(t) * 1e3, "steps": len(t)}
             for mode, t in times.items()}  # fmt: skip
    alone = {
        "tiny": accounting_alone(len(ckpt.moe_layers), ckpt.num_experts, ckpt.top_k, NUM_WORKERS, a.tokens),
        "qwen3_30b_a3b_shape": accounting_alone(A3B["layers"], A3B["experts"], A3B["top_k"], A3B["workers"], 64),
    }
    off_ms = steps["off"]["p50_ms"]
    on_over_off = steps["on"]["p50_ms"] / off_ms
    alone_share = alone["tiny"]["per_step_us"] / 1e3 / off_ms
    print(f"\ndecode step, {len(ckpt.moe_layers)} MoE layers x {a.tokens} tokens, {NUM_WORKERS} workers over {a.plane} "
          f"(expert path: partition, send, wait, record, combine; end_step)")  # fmt: skip
    print(f"{'load window':12} {'p50 ms':>8} {'mean ms':>8}")
    for mode, r in steps.items():
        print(f"{mode:12} {r['p50_ms']:8.3f} {r['mean_ms']:8.3f}")
    print(f"on / off (p50): {on_over_off:.4f}")
    for name, r in alone.items():
        print(f"accounting alone, {name} ({r['layers']} layers x {r['experts']} experts): {r['per_step_us']:.1f} us "
              f"per step (adds + advance {r['add_and_advance_us']:.1f} us; gauges {r['publish_gauges_us']:.0f} us "
              f"per bucket)")  # fmt: skip
    print(f"accounting alone / decode step (tiny, off p50): {alone_share:.3%}")
    result = {
        "machine": machine.describe(),
        "date": time.strftime("%Y-%m-%d"),
        "model": f"embedded tiny qwen3_moe: {len(ckpt.moe_layers)} MoE layers, hidden {ckpt.hidden_size}, "
                 f"top-{ckpt.top_k} of {ckpt.num_experts}",
        "plane": a.plane,
        "tokens_per_step": a.tokens,
        "decode_step": steps,
        "on_over_off_p50": on_over_off,
        "accounting_alone": alone,
        "accounting_alone_over_decode_step": alone_share,
    }
    a.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
