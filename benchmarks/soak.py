"""make soak: N minutes of streaming load on `make up`, a worker killed on a schedule.

    python -m benchmarks.soak [--minutes 10] [--kill-every 120] [--clients 16] [--out results/soak.json]

Runs `python -m cluster up` on the embedded tiny model (float32, so that a token can only differ
at a real tie; two replicas of every expert, make up's default here) and keeps --clients
streaming greedy completions of 8 prompts for --minutes. Every --kill-every seconds one worker
gets kill -9 (a different one each time); `make up` restarts it and the attention server takes
it back. Every completion is compared with a fault-free one made before the load starts: a
token may differ only where the fault-free run's top-2 margin is at most 1e-3 (the parity
tests' float32 rule). Reports requests sent / succeeded / failed, the comparison, tokens/s per
10 s with the kills marked, and the RSS of every process after a warm-up and at the end.
Prints a summary, writes JSON and a PNG next to it. Loopback only; not part of the tests.
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
from openai import OpenAI

import tiny_models
from tiny_models import PROMPTS
from cluster.launcher import free_ports, free_port_run, stop_pids, wait_http_ready
from benchmarks import machine

logger = logging.getLogger("soak")

HOST = "127.0.0.1"
WORKERS = 8
VLLM_ARGS = ("--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(1 << 30))
TOKENS = 64
TIE_MARGIN = 1e-3
WARMUP_S = 60.0
WINDOW_S = 10.0
KILL_ORDER = (3, 6, 1, 4, 7, 2, 5, 0)  # consecutive victims hold no shard in common


class Soak:
    def __init__(self, base_url: str, reference: list[tuple[list[int], list[float]]], clients: int):
        self.client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)
        self.model = self.client.models.list().data[0].id
        self.reference, self.clients = reference, clients
        self.counts: Counter = Counter()
        self.tokens_at: list[float] = []  # when each streamed token arrived
        self.failures: list[str] = []
        self.ties: list[str] = []
        self.lock = threading.Lock()

    def stream(self, i: int) -> list[int]:
        tokens = []
        for chunk in self.client.completions.create(
            model=self.model, prompt=PROMPTS[i], max_tokens=TOKENS, temperature=0, stream=True, logprobs=1,
            extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
        ):  # fmt: skip
            if chunk.choices and chunk.choices[0].logprobs:
                new = [int(t.removeprefix("token_id:")) for t in chunk.choices[0].logprobs.tokens]
                tokens += new
                now = time.monotonic()
                with self.lock:
                    self.tokens_at += [now] * len(new)
        return tokens

    def client_loop(self, c: int, until: float) -> None:
        n = c
        while time.monotonic() < until:
            i = n % len(PROMPTS)
            n += self.clients
            with self.lock:
                self.counts["sent"] += 1
            try:
                tokens = self.stream(i)
            except Exception as err:  # noqa: BLE001 (every failure is counted and reported)
                with self.lock:
                    self.counts["failed"] += 1
                    self.failures.append(f"{time.strftime('%H:%M:%S')} client {c}: {err!r}"[:300])
                continue
            verdict = self.compare(i, tokens)
            with self.lock:
                self.counts["succeeded"] += 1
                self.counts[verdict] += 1

    def compare(self, i: int, tokens: list[int]) -> str:
        want, margins = self.reference[i]
        if len(tokens) != len(want):
            return "wrong_length"
        diverged = next((j for j, (a, b) in enumerate(zip(want, tokens)) if a != b), None)
        if diverged is None:
            return "identical"
        if margins[diverged] <= TIE_MARGIN:
            with self.lock:
                self.ties.append(f"prompt {i} at token {diverged}, margin {margins[diverged]:.1e}")
            return "tie"
        return "mismatched"


def fault_free(base_url: str) -> list[tuple[list[int], list[float]]]:
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    response = client.completions.create(model=model, prompt=PROMPTS, max_tokens=TOKENS, temperature=0, logprobs=2,
                                         extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})  # fmt: skip
    out = [None] * len(PROMPTS)
    for choice in response.choices:
        tops = [sorted(top.values(), reverse=True) for top in choice.logprobs.top_logprobs]
        out[choice.index] = ([int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens], [a - b for a, b, *_ in tops])
    return out


def rss_by_role(run_dir: Path, launcher: psutil.Process) -> dict[str, tuple[int, float]]:
    """(pid, MiB resident) per process: the launcher, each worker, the attention server and its children."""
    pids = json.loads((run_dir / "cluster.json").read_text())
    roles = {"launcher": launcher}
    for name, pid in pids.items():
        try:
            proc = roles[name] = psutil.Process(pid)
            if name == "attention":
                for child in proc.children(recursive=True):
                    roles[f"attention/{child.name()}"] = child
        except psutil.NoSuchProcess:
            pass
    out = {}
    for role, proc in roles.items():
        try:
            out[role] = (proc.pid, proc.memory_info().rss / 2**20)
        except psutil.NoSuchProcess:
            pass
    return out


def rss_change(start: tuple[int, float] | None, end: tuple[int, float] | None) -> dict:
    same = start is not None and end is not None and start[0] == end[0]
    return {"after_warmup": start and start[1], "end": end and end[1], "growth": end[1] / start[1] - 1 if same else None}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    times = [w["t_s"] for w in result["tokens_per_s"]]
    ax.plot(times, [w["tokens_per_s"] for w in result["tokens_per_s"]], marker=".", label="output tokens/s")
    for k, kill in enumerate(result["kills"]):
        ax.axvline(kill["t_s"], color="red", linestyle="--", alpha=0.6, label="kill -9 of a worker" if k == 0 else None)
    ax.set_xlabel("seconds into the soak")
    ax.set_ylabel(f"tokens/s ({WINDOW_S:.0f} s windows)")
    c = result["counts"]
    ax.set_title(f"soak, {result['clients']} streaming clients, R = 2: {c.get('succeeded', 0)} of {c.get('sent', 0)} "
                 f"requests succeeded, {c.get('failed', 0)} failed, {c.get('mismatched', 0)} mismatched", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--kill-every", type=float, default=120.0, metavar="S", help="seconds between kills")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--out", type=Path, default=Path("results/soak.json"))
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)  # the kills; not the HTTP client's line per request
    a.out.parent.mkdir(parents=True, exist_ok=True)
    run_dir = a.out.parent / "soak-run"
    model = tiny_models.make("qwen3_moe", tiny_models.default_model_dir())
    (http,) = free_ports(1)
    base = free_port_run(3 * WORKERS)
    cmd = [sys.executable, "-m", "cluster", "up", "--model", str(model), "--host", HOST, "--port", str(http),
           "--worker-base-port", str(base), "--worker-metrics-base-port", str(base + WORKERS),
           "--worker-data-base-port", str(base + 2 * WORKERS), "--run-dir", str(run_dir), "--", *VLLM_ARGS]  # fmt: skip
    base_url = f"http://{HOST}:{http}"
    with (a.out.parent / "soak-up.log").open("wb") as log:
        up = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    try:
        wait_http_ready(base_url, [up], timeout_s=900)
        launcher = psutil.Process(up.pid)
        reference = fault_free(base_url)
        soak = Soak(base_url, reference, a.clients)
        start = time.monotonic()
        until = start + 60 * a.minutes
        threads = [threading.Thread(target=soak.client_loop, args=(c, until)) for c in range(a.clients)]
        for t in threads:
            t.start()
        kills, rss_start, next_kill = [], {}, start + a.kill_every
        while time.monotonic() < until:
            time.sleep(1.0)
            now = time.monotonic()
            if not rss_start and now - start >= WARMUP_S:
                rss_start = rss_by_role(run_dir, launcher)
            if now >= next_kill and now < until - 30:
                victim = KILL_ORDER[len(kills) % len(KILL_ORDER)]
                pid = json.loads((run_dir / "cluster.json").read_text())[f"worker-{victim}"]
                psutil.Process(pid).kill()
                kills.append({"t_s": now - start, "worker": victim})
                logger.info("killed worker %d (pid %d) at %.0f s", victim, pid, now - start)
                next_kill += a.kill_every
        for t in threads:
            t.join(timeout=600)
        rss_end = rss_by_role(run_dir, launcher)
        assert up.poll() is None, f"make up exited with {up.returncode}"
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(timeout=120)
            except subprocess.TimeoutExpired:
                stop_pids({"up": up.pid})

    windows = Counter(int((t - start) // WINDOW_S) for t in soak.tokens_at)
    result = {
        "machine": machine.describe(),
        "date": time.strftime("%Y-%m-%d"),
        "minutes": a.minutes, "clients": a.clients, "kill_every_s": a.kill_every,
        "model": "embedded tiny qwen3_moe, float32, make up defaults (8 workers, 2 replicas)",
        "tokens_per_request": TOKENS,
        "counts": dict(soak.counts),
        "kills": kills,
        "failures": soak.failures[:20],
        "ties": soak.ties[:20],
        "tokens_per_s": [{"t_s": (w + 0.5) * WINDOW_S, "tokens_per_s": n / WINDOW_S} for w, n in sorted(windows.items())
                         if (w + 1) * WINDOW_S <= 60 * a.minutes],
        "rss_mib": {role: rss_change(rss_start.get(role), rss_end.get(role)) for role in sorted(set(rss_start) | set(rss_end))},
    }
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, a.out.with_suffix(".png"))
    c = result["counts"]
    print(f"\nsoak: {a.minutes:g} min, {a.clients} streaming clients x {TOKENS} tokens, a worker killed every "
          f"{a.kill_every:g} s ({len(kills)} kills: workers {[k['worker'] for k in kills]})")
    print(f"requests: {c.get('sent', 0)} sent, {c.get('succeeded', 0)} succeeded, {c.get('failed', 0)} failed; "
          f"completions: {c.get('identical', 0)} identical to the fault-free run, {c.get('tie', 0)} differing at a "
          f"tie, {c.get('mismatched', 0)} mismatched, {c.get('wrong_length', 0)} of the wrong length")
    print("RSS MiB after warm-up -> end (growth of the same process; a killed worker's restart is another):")
    for role, r in result["rss_mib"].items():
        growth = f"{100 * r['growth']:+.1f}%" if r["growth"] is not None else "restarted"
        print(f"  {role:32s} {r['after_warmup'] or float('nan'):8.1f} -> {r['end'] or float('nan'):8.1f}  {growth}")
    print(f"wrote {a.out} and {a.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
