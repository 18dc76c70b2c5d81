"""make bench-placement: decode step time and the workers' load balance on the skewed tiny model,
with every routed expert on its home worker (the static placement), with hot experts on the
attention node (--hot-expert-bytes), re-placed over the workers (--spare-expert-bytes) and both,
in one run.

    python -m benchmarks.bench_placement [--out FILE] [--batch 64] [--hot-per-layer 3] [--spare-per-layer 4]
                                         [--us-per-row 200]

The skewed Qwen3-MoE (tiny_models --preset skewed: its routers send 95–100% of each layer's
tokens to experts 2, 9 and 13) on 8 workers, loopback, compiled, m = 1 (no ping-pong, so that
only the placement differs). On this CPU machine the experts cost next to nothing, so the workers
take their benchmark-only per-row service time (--bench-reply-delay-us-per-row, printed with the
figures): a worker's reply leaves later by that much per token row it computed, so that the
worker holding the busiest experts sets each layer's pace as it would on pool B's GPUs. 200 µs by
default: at 40 µs, the CPU that the eight workers and the attention node share on a 2-core
machine outweighed it (re-placed: 0.99x the static step at batch 64, 2026-12-02), so the
imbalance did not show as time.

For each placement the same batch of B requests decodes (bench_pingpong's measurement: decode
step = vLLM's mean time between two tokens over steps where the whole batch decodes, median of
rounds), request i asking tiny_models'
prompt i mod 8 numbered i, so that their tokens and the experts past the favourites differ as in
real traffic (one prompt for all would route every row alike), and the attention node's
load view (GET /hetero_moe/expert_load) gives the (layer, expert) counts of those requests, the
pairs each shard computed as they were dealt, and the hot set: per MoE layer the balance over the
8 workers is max / mean of the pairs each worker computed (hot experts are the node's). A run
with hot experts or re-placement first decodes warm-up batches until its placement is taken.
Prints a table, writes JSON and a PNG next to it.
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

import tiny_models
from benchmarks.bench_pingpong import (
    BATCH_TOKENS, DECODE_TOKENS, LEAD_TOKENS, VLLM_ARGS, Cluster, Server, batch_size, measure_interleaved, prompt_tokens,
)  # fmt: skip
from protos.checkpoint import read_checkpoint
from benchmarks import machine

logger = logging.getLogger("bench_placement")
WARM_ROUNDS = 20  # warm-up batches at most, before a placement must have been taken


@dataclass
class Placement:
    name: str
    hot_expert_bytes: int
    spare_expert_bytes: int
    step_ms: float
    tokens_per_s: float
    expert_wait_ms: float
    streams_tokens_per_s: float
    streams_failed: int
    balance: list[float]  # per MoE layer: max / mean of the pairs each worker computed
    hot: dict[str, list[int]]  # MoE layer -> experts on the attention node
    hot_share: float  # of the measured pairs, those the attention node computed
    replaced_experts: int  # expert shares dealt to a worker other than their home
    prompt_tokens: int
    pairs: list[list[int]]  # [L][E] the measured pairs per (MoE layer, expert)
    shard_pairs: list[list[int]]  # [L][W + 1] the measured pairs per (MoE layer, worker), then the node's


def load_view(base_url: str) -> dict:
    with urllib.request.urlopen(f"{base_url}/hetero_moe/expert_load", timeout=60) as r:
        return json.loads(r.read())


def worker_balance(shard_pairs: np.ndarray) -> list[float]:
    """[L, W + 1] pairs each worker computed (the last column: the attention node) -> per layer,
    the busiest worker's over the mean."""
    workers = shard_pairs[:, :-1]
    return (workers.max(axis=1) / workers.mean(axis=1)).tolist()


def gauge(base_url: str, name: str) -> float:
    metrics = urllib.request.urlopen(f"{base_url}/metrics", timeout=30).read().decode()
    return max((float(line.split()[-1]) for line in metrics.splitlines()
                if line and line.split()[0].split("{")[0] == name), default=0.0)  # fmt: skip


def prompts(batch: int) -> list[str]:
    return [f"{i}. {tiny_models.PROMPTS[i % len(tiny_models.PROMPTS)]}" for i in range(batch)]


def warm_until_placed(client, model: str, base_url: str, batch: int, hot: bool, replaced: bool) -> None:
    """Decode warm-up batches (the load window's traffic) until the hot set and the workers' layout
    asked for are taken."""
    for _ in range(WARM_ROUNDS):
        client.completions.create(model=model, prompt=prompts(batch), max_tokens=DECODE_TOKENS, temperature=0)
        if (not hot or gauge(base_url, "hetero_moe_hot_experts") > 0) and (
                not replaced or gauge(base_url, "hetero_moe_replaced_experts") > 0):  # fmt: skip
            return
    raise TimeoutError(f"placement not taken after {WARM_ROUNDS} warm-up batches")


def run(cluster: Cluster, name: str, hot_bytes: int, spare_bytes: int, batch: int) -> Placement:
    url = cluster.start_attention(name, "--hot-expert-bytes", str(hot_bytes), "--spare-expert-bytes", str(spare_bytes),
                                  "--expert-load-window", "6")  # fmt: skip
    server = Server(url, batch, name, 1, prompts(batch))
    server.select()  # m = 1 from the warm-up on
    if hot_bytes or spare_bytes:
        warm_until_placed(server.client, server.model, url, batch, bool(hot_bytes), bool(spare_bytes))
    before = load_view(url)
    (point,) = measure_interleaved([server])
    after = load_view(url)
    counts = np.asarray(after["total"]) - np.asarray(before["total"])
    dealt = np.asarray(after["shard_total"]) - np.asarray(before["shard_total"])
    return Placement(name, hot_bytes, spare_bytes, point.step_ms, point.tokens_per_s, point.expert_wait_ms,
                     point.streams_tokens_per_s, point.streams_failed, worker_balance(dealt), after["hot"],
                     float(dealt[:, -1].sum() / dealt.sum()), int(gauge(url, "hetero_moe_replaced_experts")),
                     prompt_tokens(url, prompts(batch)), counts.tolist(), dealt.tolist())  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_placement", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("results/bench_placement.json"))
    p.add_argument("--batch", type=batch_size, default=64, help="requests decoding together")
    p.add_argument("--hot-per-layer", type=int, default=3, help="the hot budget, in experts per MoE layer")
    p.add_argument("--spare-per-layer", type=int, default=4,
                   help="each worker's spare memory for re-placed experts, in experts per MoE layer")
    p.add_argument("--us-per-row", type=float, default=200.0, help="the workers' service time per token row (µs)")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    logs = a.out.parent / "bench-placement-logs"
    logs.mkdir(exist_ok=True)
    model = tiny_models.make("qwen3_moe", tiny_models.default_model_dir().with_name("tiny-qwen3-moe-skewed"),
                             preset="skewed")  # fmt: skip
    ckpt = read_checkpoint(model)
    expert_bytes = ckpt.expert_bytes // (len(ckpt.moe_layers) * ckpt.num_experts)
    hot_bytes = a.hot_per_layer * len(ckpt.moe_layers) * expert_bytes
    spare_bytes = a.spare_per_layer * len(ckpt.moe_layers) * expert_bytes
    cluster = Cluster(model, logs, 8)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    try:
        cluster.start_workers(0.0, a.us_per_row)
        points = [run(cluster, "static", 0, 0, a.batch), run(cluster, "hot experts", hot_bytes, 0, a.batch),
                  run(cluster, "re-placed", 0, spare_bytes, a.batch),
                  run(cluster, "hot+re-placed", hot_bytes, spare_bytes, a.batch)]  # fmt: skip
    finally:
        cluster.stop()
    static = points[0]
    lines = [f"{'placement':13} {'step ms':>8} {'x static':>8} {'tok/s':>7} {'wait ms':>8} {'16 streams tok/s':>16} "
             f"{'failed':>6} {'hot pairs':>9} {'moved':>5}  workers' max/mean per MoE layer"]  # fmt: skip
    for pt in points:
        lines.append(f"{pt.name:13} {pt.step_ms:8.2f} {pt.step_ms / static.step_ms:8.2f} {pt.tokens_per_s:7.0f} "
                     f"{pt.expert_wait_ms:8.2f} {pt.streams_tokens_per_s:16.0f} {pt.streams_failed:6d} "
                     f"{pt.hot_share:9.0%} {pt.replaced_experts:5d}  {' '.join(f'{b:.2f}' for b in pt.balance)}")  # fmt: skip
    lines.append(f"hot set: {points[1].hot} ({hot_bytes} bytes, {a.hot_per_layer} experts per layer); spare per "
                 f"worker for re-placement: {spare_bytes} bytes ({a.spare_per_layer} experts per layer); moved: expert "
                 "shares dealt away from their home worker")  # fmt: skip
    lines.append(f"workers hold each reply {a.us_per_row:.1f} µs per token row (benchmark-only emulation of pool B); "
                 f"batch {a.batch} requests, distinct prompts of {static.prompt_tokens} tokens on average, "
                 f"{BATCH_TOKENS} tokens decoded each ({DECODE_TOKENS} by the probe); "
                 f"{len(ckpt.moe_layers)} MoE layers, 8 workers, m = 1")  # fmt: skip
    report = "\n".join(lines)
    print(report)
    result = {
        "machine": machine.describe(),
        "date": time.strftime("%Y-%m-%d"),
        "model": "tiny qwen3_moe, preset skewed",
        "batch": a.batch,
        "decode_tokens": DECODE_TOKENS,
        "lead_tokens": LEAD_TOKENS,
        "prompt_tokens": static.prompt_tokens,
        "bench_reply_delay_us_per_row": a.us_per_row,
        "hot_expert_bytes": hot_bytes,
        "spare_expert_bytes": spare_bytes,
        "points": [asdict(pt) for pt in points],
        "vllm_args": list(VLLM_ARGS),
    }
    a.out.write_text(json.dumps(result, indent=2))
    plot(points, a.out.with_suffix(".png"), ckpt.moe_layers)
    print(f"\nwrote {a.out} and {a.out.with_suffix('.png')}")


def plot(points: list[Placement], path: Path, layers) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    colors = ["tab:gray", "tab:orange", "tab:blue", "tab:green"][: len(points)]
    left.bar([pt.name for pt in points], [pt.step_ms for pt in points], color=colors)
    left.set_ylabel("decode step, ms")
    left.set_title("decode step")
    width = 0.8 / len(points)
    for i, pt in enumerate(points):
        right.bar(np.arange(len(layers)) + (i - (len(points) - 1) / 2) * width, pt.balance, width, label=pt.name,
                  color=colors[i])  # fmt: skip
    right.axhline(1.2, color="black", linestyle=":", label="1.2")
    right.set_xticks(np.arange(len(layers)), [str(layer) for layer in layers])
    right.set_xlabel("MoE layer")
    right.set_ylabel("workers' max / mean pairs")
    right.set_title("load balance over the 8 workers")
    right.set_ylim(0, 1.4 * max(max(pt.balance) for pt in points))  # room for the legend above the bars
    right.legend(ncol=3, loc="upper center", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
