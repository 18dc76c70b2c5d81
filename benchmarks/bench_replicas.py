"""make bench-replicas: what replicas cost when nothing fails, and what a failover costs.

    python -m benchmarks.bench_replicas [--rounds 2] [--out results/bench_replicas.json]

`make up` on the embedded tiny model (8 workers, eager mode to start quickly), alternately with
one and two replicas of every expert (R = 1, R = 2, R = 1, R = 2, ...), loopback only. Per
cluster: the p50 gap between streamed tokens of one request (128 tokens) and the decode step of
16 requests together ((time of 48 tokens - time of 1) / 47), medians over 3 repetitions. Then,
on the last R = 2 cluster, one stream while worker 3 is killed: the longest gap between two of
its tokens (the failover) against its p50. Prints a table, writes JSON and a PNG next to it.
"""
from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
from openai import OpenAI

import tiny_models
from cluster.launcher import free_port_run, free_ports, stop_pids, wait_http_ready
from benchmarks import machine

HOST = "127.0.0.1"
WORKERS = 8
VLLM_ARGS = ("--dtype", "bfloat16", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(1 << 30), "--enforce-eager")
PROMPT = "The weather today is"
REPEATS = 3


def stream_gaps(client: OpenAI, model: str, tokens: int, on_token=None) -> list[float]:
    """Seconds between consecutive streamed tokens of one greedy request."""
    times = []
    for chunk in client.completions.create(model=model, prompt=PROMPT, max_tokens=tokens, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):  # fmt: skip
        if chunk.choices and chunk.choices[0].text is not None:
            times.append(time.perf_counter())
            if on_token is not None:
                on_token(len(times))
    return [b - a for a, b in zip(times[1:], times[2:])]  # from the second token: decode only


def batch_step(client: OpenAI, model: str) -> float:
    def run(tokens: int) -> float:
        start = time.perf_counter()
        client.completions.create(model=model, prompt=[PROMPT] * 16, max_tokens=tokens, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
        return time.perf_counter() - start

    return (run(48) - run(1)) / 47


class Up:
    """`python -m cluster up` in the foreground, stopped like Ctrl-C."""

    def __init__(self, model: Path, replicas: int, logs: Path):
        (self.http,) = free_ports(1)
        base = free_port_run(3 * WORKERS)
        self.run_dir = logs / f"run-r{replicas}"
        cmd = [sys.executable, "-m", "cluster", "up", "--model", str(model), "--host", HOST, "--port", str(self.http),
               "--expert-replicas", str(replicas), "--worker-base-port", str(base),
               "--worker-metrics-base-port", str(base + WORKERS), "--worker-data-base-port", str(base + 2 * WORKERS),
               "--run-dir", str(self.run_dir), "--", *VLLM_ARGS]  # fmt: skip
        with (logs / f"up-r{replicas}.log").open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.base_url = f"http://{HOST}:{self.http}"
        wait_http_ready(self.base_url, [self.proc], timeout_s=900)
        self.client = OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=600)
        self.model = self.client.models.list().data[0].id

    def worker_pid(self, i: int) -> int:
        return json.loads((self.run_dir / "cluster.json").read_text())[f"worker-{i}"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                stop_pids({"up": self.proc.pid})


def measure(up: Up) -> dict:
    stream_gaps(up.client, up.model, 16)  # warm
    batch_step(up.client, up.model)
    itl = [statistics.median(stream_gaps(up.client, up.model, 128)) for _ in range(REPEATS)]
    steps = [batch_step(up.client, up.model) for _ in range(REPEATS)]
    return {"itl_p50_ms": 1e3 * statistics.median(itl), "batch16_step_ms": 1e3 * statistics.median(steps)}


def failover(up: Up) -> dict:
    """One stream of 256 tokens; worker 3 gets kill -9 at its 64th token."""
    victim = psutil.Process(up.worker_pid(3))

    def kill_at(n: int) -> None:
        if n == 64:
            victim.kill()

    gaps = stream_gaps(up.client, up.model, 256, kill_at)
    return {"tokens": len(gaps) + 2, "itl_p50_ms": 1e3 * statistics.median(gaps), "longest_gap_ms": 1e3 * max(gaps),
            "killed_at_token": 64}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_replicas", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--rounds", type=int, default=2, help="R = 1 / R = 2 pairs")
    p.add_argument("--out", type=Path, default=Path("results/bench_replicas.json"))
    a = p.parse_args()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    logs = a.out.parent / "bench-replicas-logs"
    logs.mkdir(exist_ok=True)
    model = tiny_models.make("qwen3_moe", tiny_models.default_model_dir())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    rows, fail = [], None
    for r in range(a.rounds):
        for replicas in (1, 2):
            up = Up(model, replicas, logs)
            try:
                rows.append({"round": r, "replicas": replicas, **measure(up)})
                print(f"round {r}, R = {replicas}: {rows[-1]}", flush=True)
                if replicas == 2 and r == a.rounds - 1:
                    fail = failover(up)
                    print(f"failover: {fail}", flush=True)
            finally:
                up.stop()

    def median_of(replicas: int, key: str) -> float:
        return statistics.median(x[key] for x in rows if x["replicas"] == replicas)

    summary = {key: {"r1": median_of(1, key), "r2": median_of(2, key), "r2_over_r1": median_of(2, key) / median_of(1, key)}
               for key in ("itl_p50_ms", "batch16_step_ms")}  # fmt: skip
    result = {"machine": machine.describe(),
              "date": time.strftime("%Y-%m-%d"), "vllm_args": VLLM_ARGS, "rows": rows, "summary": summary,
              "failover": fail}  # fmt: skip
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, a.out.with_suffix(".png"))
    print("\n| measure | R = 1 | R = 2 | R = 2 / R = 1 |\n|---|---|---|---|")
    for key, s in summary.items():
        print(f"| {key} | {s['r1']:.2f} | {s['r2']:.2f} | {s['r2_over_r1']:.3f} |")
    print(f"failover (R = 2, worker 3 killed at token 64 of 256): longest gap {fail['longest_gap_ms']:.1f} ms, "
          f"p50 gap {fail['itl_p50_ms']:.2f} ms")
    print(f"wrote {a.out} and {a.out.with_suffix('.png')}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key, label in zip(axes, ("itl_p50_ms", "batch16_step_ms"), ("1 stream: p50 ms between tokens",
                                                                        "16 requests: ms per decode step")):
        for replicas, color in ((1, "tab:blue"), (2, "tab:orange")):
            xs = [x["round"] for x in result["rows"] if x["replicas"] == replicas]
            ax.plot(xs, [x[key] for x in result["rows"] if x["replicas"] == replicas], "o-", color=color,
                    label=f"R = {replicas}")  # fmt: skip
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle("make bench-replicas: replicas without a fault (tiny model, 8 workers, eager)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
