"""make bench-pingpong: decode step time and throughput with m = 1, 2, 3, 4 and auto micro-batches in ping-pong.

    python -m benchmarks.bench_pingpong [--out FILE] [--batch 128] [--workers 8] [--microbatches 1,2,3,4,auto]
                                        [--cpus split|shared] [--context 3876] [--preset tiny|deep]

The cluster on the embedded tiny model (4 MoE layers, compiled; --preset deep: its 16-layer twin),
loopback only; a batch of B requests with one long prompt (--context tokens, by default 3876, the
most the tiny model allows; deep allows 16384: attention is then a real part of the attention
node's time) decodes together. On this CPU machine the experts cost next to nothing, so the
workers emulate pool B with their benchmark-only reply delay (--bench-reply-delay-ms/-us-per-row:
each Forward reply leaves that much later while the worker takes the next request; printed with
every figure). A first run without delays measures the attention node's busy time per MoE layer
(a) and the remote time this machine adds by itself (own: transport and the workers' CPU). Two
regimes:

- expert ≈ attention: a per-row delay that brings the busiest worker's remote time to a (a
  micro-batch's experts then cost what its attention costs: m = 2 can hide one behind the
  other). The batch's requests share one prompt, so they decode the same greedy tokens and
  route alike: the workers of a layer's top-k experts each get every row of the micro-batch;
- transport-heavy: that, plus a fixed delay per Forward of twice a (a slow link), where more
  micro-batches keep paying off.

vLLM's model worker (pool A's device) and the expert workers (pool B's) run on separate CPUs of
this machine (--cpus split), as they would on separate machines: sharing cores, the workers' CPU
work during the overlap takes the attention node's time, which ping-pong exists to keep busy.
--cpus shared leaves the placement to vLLM and Linux, for comparison.

Per regime one attention server starts (with auto), and every point (m = 1, 2, 3, 4 and auto)
sets its m on it before each use, through vLLM's dev-mode collective_rpc and a benchmark-only
worker method (HETERO_MOE_BENCHMARK=1): on this VM one process keeps its own speed for its whole
life (twins up to 2x apart), so one server per m measured the processes along with the m. auto
(attention_server/pingpong_auto.py) learns only from its own steps and resumes with what it
learned each time it is chosen again, as in a long-running server. The points are measured in
rounds that alternate between them, the order rotating from round to round, so that the
machine's drift falls on every m alike (measured one after another, points moved by 10-20% with
their place in the sequence); auto is reported beside the best fixed m with the steps it ran at
each m.
A point's decode step is vLLM's own time between two tokens of a request (its engine's
timestamps: vllm:inter_token_latency_seconds), over the steps where the whole batch decodes: a
streamed probe request, sent once the engine has the others, times the readings, and vLLM's tokens
per step check that every step in between computed one token for each request and none of a
prompt. The prefill (its length, the m that ran it) is in the batch's tokens/s and not in the step:
auto's m for the prefill's batch sizes moved from round to round while it learned them, and the
step measured before ((time of 48 tokens - time of 1) / 47) counted that as decode.
Every point also runs 16 clients streaming at once (requests that come and go, as users' do):
output tokens/s and how many requests failed.

Beside each measured step, the ideal from DESIGN.md §4 for this emulation, the pipeline's fill
and drain included: in steady state a layer takes max(a, a/m + r(m)), with r(m) = own + d + e/m a
micro-batch's remote time (d the fixed delay, e what the per-row delay added to the wait at m = 1);
the last layer takes a, all of its micro-batches' attention, and then its last micro-batch's r(m),
which nothing overlaps; the step adds the time outside the model forward (sampling, scheduling).
a, e and that outside time come from the regime's m = 1 point, own from the run without delays,
all from the attention node's metrics (hetero_moe_step_*).

Prints a table, writes JSON and a PNG (step time against m, both regimes) next to it.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import tiny_models
from attention_server.config import MAX_MICROBATCHES
from cluster.certs import reuse_or_make
from cluster.launcher import ClusterSpec, free_ports, free_worker_ports, stop_pids, wait_http_ready
from expert_server.config import BENCHMARK_ENV
from protos.checkpoint import read_checkpoint, read_model_config
from benchmarks import machine

logger = logging.getLogger("bench_pingpong")

HOST = "127.0.0.1"
# Pool A's device and pool B's are different machines: the workers' CPU work must not take the
# attention node's CPU, or ping-pong's overlap (workers computing while attention runs) only
# moves work onto the same core. With --cpus split (the default) vLLM's model worker runs on the
# first half of this machine's CPUs, the workers on the rest (vLLM's engine, its API server and
# this client float); --cpus shared leaves the placement to vLLM (its model worker) and Linux.
_CPUS = sorted(os.sched_getaffinity(0))
POOL_A_CPUS = _CPUS[: max(1, len(_CPUS) // 2)]
POOL_B_CPUS = _CPUS[max(1, len(_CPUS) // 2) :] or _CPUS
VLLM_ARGS = ("--dtype", "bfloat16", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(1 << 30))
DECODE_TOKENS = 48
# A batch's requests other than its probe (decode_batch) decode this many tokens more: the probe starts after
# them, and its WINDOW must end before they do. Without a lead, --batch 32 failed: the probe began about 11 tokens
# behind the others, and they had ended by its token 40 (at the window's end 1 request running, the probe).
LEAD_TOKENS = 24
BATCH_TOKENS = DECODE_TOKENS + LEAD_TOKENS  # what a batch's requests other than its probe decode
# A long prompt, so that attention is a real part of the attention node's time per layer.
SENTENCE = "In the beginning of the long winter the village gathered its wood, its grain and its stories."
PROMPT = " ".join([SENTENCE] * 50)  # 1551 tokens (benchmarks/bench_placement.py's streams)
CONTEXT = 3876  # the bench's prompt tokens by default: SENTENCE 125 times, the most the tiny model's 4096 allows


def long_prompt(model: Path, tokens: int) -> str:
    """SENTENCE repeated to at most `tokens` tokens of the model's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    one, two = (len(tokenizer(" ".join([SENTENCE] * n)).input_ids) for n in (1, 2))
    return " ".join([SENTENCE] * max(1, 1 + (tokens - one) // (two - one)))


def vllm_args(model: Path, context: int, batch: int) -> tuple[str, ...]:
    """VLLM_ARGS with room for `batch` requests of `context` + BATCH_TOKENS tokens (their KV cache
    whole, the prefix cache aside)."""
    max_len = max(2048, -(-(context + BATCH_TOKENS) // 256) * 256)
    config = read_model_config(model)
    kv_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 2  # K and V, bf16
    return ("--dtype", "bfloat16", "--max-model-len", str(max_len), "--kv-cache-memory-bytes",
            str(max(1 << 30, batch * max_len * kv_per_token)), "--max-num-seqs", str(max(128, batch)))  # fmt: skip


# The rounds of one point were seen to spread by +-20% (45.8-65.8 ms), about the differences between
# m this bench is for: a median of 3 moved by more than line 4's 5%. Each point prints its spread.
ROUNDS = 5


@dataclass
class Point:
    regime: str
    microbatches: int | None  # None: auto
    step_ms: float  # decode step: one token for every request of the batch
    tokens_per_s: float  # the batch's output tokens over its whole time, prefill included
    forward_ms: float  # the model forward within a step (attention node's metrics)
    expert_wait_ms: float  # of which blocked waiting for the workers
    ideal_step_ms: float | None = None
    steps_by_microbatches: dict[str, float] | None = None  # the batches' steps (prefill included), by m
    streams_tokens_per_s: float = 0.0  # 16 clients streaming at once
    streams_failed: int = 0
    step_ms_rounds: list[float] | None = None  # each round's decode step, in the order measured

    @property
    def label(self) -> str:
        return label(self.microbatches)


STEPS_BY_M = "hetero_moe_pingpong_steps_total"


def scrape_sums(url: str) -> dict[str, float]:
    """The step histograms' sums and counts, the steps by m (keyed `STEPS_BY_M m`), and the vLLM
    figures that time a decode step and check it (VLLM_FIGURES, summed over their labels)."""
    import urllib.request

    out: dict[str, float] = {}
    for line in urllib.request.urlopen(url, timeout=30).read().decode().splitlines():
        name, _, value = line.rpartition(" ")
        if line.startswith("hetero_moe_step_") and ("_sum" in line or "_count" in line):
            out[name] = out.get(name, 0.0) + float(value)
        elif line.startswith(STEPS_BY_M + "{"):
            m = name.split('microbatches="')[1].split('"')[0]
            out[f"{STEPS_BY_M} {m}"] = out.get(f"{STEPS_BY_M} {m}", 0.0) + float(value)
        elif (bare := name.split("{")[0]) in VLLM_FIGURES:
            out[bare] = out.get(bare, 0.0) + float(value)
    return out


# vLLM's own figures of its engine steps: the time between two tokens of a request, the tokens
# each step computed (prompt and generated; a step of the batch's decode computes one token for
# each of its requests and none of a prompt), and its requests.
ITL = "vllm:inter_token_latency_seconds"
STEP_TOKENS = "vllm:iteration_tokens_total"
REQUESTS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
VLLM_FIGURES = (f"{ITL}_sum", f"{ITL}_count", f"{STEP_TOKENS}_sum", f"{STEP_TOKENS}_count", *REQUESTS)
# The probe request's tokens between which a batch's decode is read: by its 8th token every
# request of the batch has its prompt in (the prefill takes a few steps), and by its 40th none
# has ended (they decode BATCH_TOKENS: the probe may start up to 32 tokens after them).
WINDOW = (8, 40)
ADMITTED_S = 60.0  # how long the batch may take to reach the engine


def decode_batch(client, model: str, prompts: list, url: str) -> tuple[float, list[dict[str, float]]]:
    """One batch of len(prompts) requests: prompts[:-1] in one request, decoding BATCH_TOKENS tokens each, and,
    once the engine has them, prompts[-1] streamed, decoding DECODE_TOKENS (the probe: its tokens time the
    readings). Returns the batch's seconds and the attention server's figures (scrape_sums) before it, at the
    probe's WINDOW tokens and after it."""
    import threading

    failed: list[BaseException] = []

    def rest() -> None:
        try:
            client.completions.create(model=model, prompt=prompts[:-1], max_tokens=BATCH_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
        except BaseException as err:  # raised below, in the caller's thread
            failed.append(err)

    sums = [scrape_sums(url)]
    start = time.perf_counter()
    batch = threading.Thread(target=rest)
    batch.start()
    # The probe after the rest: a long request is parsed later than a short one sent with it. 20
    # readings a second: the API server that renders /metrics is the one parsing the batch (a
    # scrape every 10 ms kept it from admitting requests, tests/test_cluster.py), and the probe
    # may start a few steps after the batch (WINDOW).
    while sum(scrape_sums(url).get(name, 0.0) for name in REQUESTS) < len(prompts) - 1:
        if failed or time.perf_counter() - start > ADMITTED_S:
            batch.join()
            raise failed[0] if failed else TimeoutError(f"the batch did not reach the engine in {ADMITTED_S} s")
        time.sleep(0.05)
    probe = client.completions.create(model=model, prompt=prompts[-1], max_tokens=DECODE_TOKENS, temperature=0,
                                      stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
                                      extra_body={"ignore_eos": True})  # fmt: skip
    for chunk in probe:
        if len(sums) <= len(WINDOW) and chunk.usage and chunk.usage.completion_tokens >= WINDOW[len(sums) - 1]:
            sums.append(scrape_sums(url))
    batch.join()
    seconds = time.perf_counter() - start
    if failed:
        raise failed[0]
    if len(sums) <= len(WINDOW):
        raise RuntimeError(f"the probe request ended before its token {WINDOW[len(sums) - 1]}")
    return seconds, sums + [scrape_sums(url)]


def batch_size(text: str) -> int:
    """--batch: a decode_batch streams one of its requests to time the others."""
    if (batch := int(text)) < 2:
        raise argparse.ArgumentTypeError(f"{batch}: at least 2 requests (one is streamed to time the others)")
    return batch


def batch_output_tokens(batch: int) -> int:
    """The tokens a decode_batch of `batch` requests decodes."""
    return (batch - 1) * BATCH_TOKENS + DECODE_TOKENS


def warm_batch(client, model: str, prompts: list) -> None:
    client.completions.create(model=model, prompt=prompts, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})


STREAMS = 16


def streams(client, model: str, tag: str, prompt: str) -> tuple[float, int]:
    """(output tokens/s, failed requests) of STREAMS clients streaming DECODE_TOKENS tokens each at once.
    Their prompts start with `tag`, one per point: the points share a server, whose prefix cache
    would otherwise spare every point but the first its prefills."""
    import threading

    tokens, failed = [0] * STREAMS, [0]

    def one(i: int) -> None:
        try:
            chunks = client.completions.create(model=model, prompt=f"{tag} {i} {prompt}", max_tokens=DECODE_TOKENS,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
            tokens[i] = sum(1 for c in chunks if c.choices and c.choices[0].text is not None)
        except Exception:  # counted: the bench reports failures instead of dying on them
            logger.exception("stream %d failed", i)
            failed[0] += 1

    threads = [threading.Thread(target=one, args=(i,)) for i in range(STREAMS)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens) / (time.perf_counter() - start), failed[0]


def prompt_tokens(base_url: str, prompts: list[str] | None = None) -> int:
    """What the served model's tokenizer makes of PROMPT (of `prompts`: their mean)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    prompts = prompts or [PROMPT]
    return client.completions.create(model=model, prompt=prompts, max_tokens=1).usage.prompt_tokens // len(prompts)


class Server:
    """One attention server under measurement: its samples, taken in rounds that alternate with
    the other servers' (measure_interleaved)."""

    def __init__(self, base_url: str, batch: int, regime: str, m: int | None, prompts: list[str] | None = None,
                 prompt: str = PROMPT):  # fmt: skip
        """The batch asks `prompts`, or `prompt` `batch` times; the 16 streams ask `prompt`."""
        from openai import OpenAI

        self.url, self.batch, self.regime, self.m = f"{base_url}/metrics", batch, regime, m
        self.prompts, self.prompt = prompts or [prompt] * batch, prompt
        self.control = f"{base_url}/collective_rpc"
        self.client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)
        self.model = self.client.models.list().data[0].id
        self.steps, self.rates, self.forwards, self.waits, self.by_m = [], [], [], [], {}
        self.streams: tuple[float, int] = (0.0, 0)

    def select(self) -> None:
        """This point's m for the server's next steps: one server process runs every m of a regime
        (Cluster.start_attention), through a benchmark-only worker method."""
        import urllib.request

        body = json.dumps({"method": "hetero_moe_bench_microbatches", "args": [label(self.m)]}).encode()
        request = urllib.request.Request(self.control, body, {"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=60).read()

    def warm(self) -> None:
        """The batch shape compiled, caches filled."""
        self.select()
        warm_batch(self.client, self.model, self.prompts)

    def sample(self) -> None:
        """One batch (decode_batch). Its decode step is vLLM's mean time between two tokens of a
        request, and the attention node's forward and expert wait per step its metrics' means, all
        over the probe's WINDOW, where every step is the whole batch's decode: its prefill and its
        end (which m ran them, how long they took) are in the batch's tokens/s, not in its step."""
        self.select()
        seconds, (before, start, end, after) = decode_batch(self.client, self.model, self.prompts, self.url)

        def window(name: str) -> float:
            return end.get(name, 0.0) - start.get(name, 0.0)

        steps, tokens = window(f"{STEP_TOKENS}_count"), window(f"{STEP_TOKENS}_sum")
        if not steps or tokens != self.batch * steps:
            running = [f"{s.get(REQUESTS[0], 0):.0f} running, {s.get(REQUESTS[1], 0):.0f} waiting" for s in (start, end)]
            raise RuntimeError(f"the decode window's {steps:.0f} steps computed {tokens:.0f} tokens, not "
                               f"{self.batch} each: the batch was not decoding whole (WINDOW {WINDOW}; at its start "
                               f"{running[0]}, at its end {running[1]})")  # fmt: skip
        count = window("hetero_moe_step_forward_seconds_count")
        self.steps.append(window(f"{ITL}_sum") / window(f"{ITL}_count"))
        self.rates.append(batch_output_tokens(self.batch) / seconds)
        self.forwards.append(window("hetero_moe_step_forward_seconds_sum") / count)
        self.waits.append(window("hetero_moe_step_expert_wait_seconds_sum") / count)
        for key in after:  # steps by m: the whole batch's, its prefill included
            if key.startswith(STEPS_BY_M + " "):
                m = key.split()[1]
                self.by_m[m] = self.by_m.get(m, 0.0) + after[key] - before.get(key, 0.0)

    def sample_streams(self) -> None:
        self.select()
        self.streams = streams(self.client, self.model, f"{self.regime} m={label(self.m)}", self.prompt)

    def point(self) -> Point:
        """Medians over the rounds."""
        import statistics

        return Point(self.regime, self.m, 1e3 * statistics.median(self.steps), statistics.median(self.rates),
                     1e3 * statistics.median(self.forwards), 1e3 * statistics.median(self.waits),
                     steps_by_microbatches={k: v for k, v in sorted(self.by_m.items()) if v},
                     streams_tokens_per_s=self.streams[0], streams_failed=self.streams[1],
                     step_ms_rounds=[1e3 * s for s in self.steps])  # fmt: skip


# vLLM's engine and model worker poll their shared-memory queues (sched_yield) for a second after
# the last message before they block: the server measured before must be idle before the next.
ENGINE_IDLE_S = 1.5


def measure_interleaved(servers: list[Server]) -> list[Point]:
    """Every server's ROUNDS samples (and then its 16 streams) in rounds that alternate between
    the servers, their order rotating from round to round, so that the machine's drift over time
    falls on all of them alike: sequential points were seen to move by 10-20% with their place in
    the sequence, more than the differences between m this bench is for."""
    for server in servers:
        server.warm()
        time.sleep(ENGINE_IDLE_S)
    for r in range(ROUNDS + 1):  # the last round: the streams
        for server in servers[r % len(servers):] + servers[: r % len(servers)]:
            if r < ROUNDS:
                server.sample()
            else:
                server.sample_streams()
            time.sleep(ENGINE_IDLE_S)
    return [server.point() for server in servers]


class Cluster:
    """Eight workers (restarted per regime, with its delays) and one attention server at a time."""

    def __init__(self, model: Path, logs: Path, workers: int, split_cpus: bool = False,
                 vllm_args: tuple[str, ...] = VLLM_ARGS):  # fmt: skip
        self.model, self.logs, self.split_cpus, self.vllm_args = model, logs, split_cpus, vllm_args
        self.spec = ClusterSpec(model=model, num_workers=workers, http_port=0, host=HOST, run_dir=logs, worker_threads=1,
                                **free_worker_ports(workers), tls_dir=reuse_or_make(logs / "tls"))  # fmt: skip
        self.procs: dict[str, subprocess.Popen] = {}

    def start_workers(self, delay_ms: float, delay_us_per_row: float) -> None:
        self.stop("worker")
        env = {**os.environ, BENCHMARK_ENV: "1"}
        extra = ["--bench-reply-delay-ms", str(delay_ms), "--bench-reply-delay-us-per-row", str(delay_us_per_row)]
        for i in range(self.spec.num_workers):
            with (self.logs / f"worker-{i}.log").open("wb") as f:
                self.procs[f"worker-{i}"] = subprocess.Popen(self.spec.worker_command(i) + extra, stdout=f,
                                                             stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                                             preexec_fn=self._worker_cpus)  # fmt: skip

    @property
    def cpus(self) -> dict:
        """Where the two pools run, for the report."""
        if self.split_cpus:
            return {"layout": "split", "vllm_model_worker": POOL_A_CPUS, "expert_workers": POOL_B_CPUS}
        return {"layout": "shared", "vllm_model_worker": "vLLM's choice", "expert_workers": _CPUS}

    def _worker_cpus(self) -> None:
        """In the worker's process before it starts."""
        if self.split_cpus:
            os.sched_setaffinity(0, POOL_B_CPUS)

    def start_attention(self, name: str, *flags: str) -> str:
        """An attention server with `flags` beyond the cluster's (log: attention-`name`), up on
        return: its base URL. It starts with auto, and each point sets its own m on it before each
        use (Server.select: vLLM's dev-mode collective_rpc and a benchmark-only worker method)."""
        self.stop("attention")
        env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_MOE_")}
        env |= {BENCHMARK_ENV: "1", "VLLM_SERVER_DEV_MODE": "1"}
        if self.split_cpus:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, POOL_A_CPUS))  # vLLM binds its model worker there
        (port,) = free_ports(1)
        cmd = [sys.executable, "-m", "attention_server", "--model", str(self.model), "--expert-endpoints",
               ",".join(self.spec.endpoints), *self.spec.security_args(), "--host", HOST, "--port", str(port),
               "--pingpong-microbatches", "auto", *flags, *self.vllm_args]  # fmt: skip
        with (self.logs / f"attention-{name}.log").open("wb") as f:
            proc = self.procs["attention"] = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                                              start_new_session=True, env=env)  # fmt: skip
        url = f"http://{HOST}:{port}"
        wait_http_ready(url, [proc], timeout_s=1200)
        return url

    def stop(self, prefix: str = "") -> None:
        chosen = {n: p for n, p in self.procs.items() if n.startswith(prefix)}
        if chosen:
            stop_pids({n: p.pid for n, p in chosen.items()}, reap=lambda: [p.poll() for p in chosen.values()])
            for n, p in chosen.items():
                p.wait()
                del self.procs[n]


def label(m: int | None) -> str:
    return "auto" if m is None else str(m)


def ideal_step_ms(base: Point, layers: int, m: int, own_ms: float, d_ms: float) -> float:
    """DESIGN.md §4 for a micro-batch's remote time r(m) = own + d + e/m per layer, from the regime's
    m = 1 point `base`: a = attention busy time per layer, e = what the per-row delay added to the
    wait at m = 1, outside = step time outside the model forward. Layers but the last take the
    steady state's max(a, a/m + r(m)); the last takes a and then r(m), its drain (= base.step_ms at m = 1)."""
    a = (base.forward_ms - base.expert_wait_ms) / layers
    e = max(0.0, base.expert_wait_ms / layers - own_ms - d_ms)
    outside = base.step_ms - base.forward_ms
    r = own_ms + d_ms + e / m
    return outside + (layers - 1) * max(a, a / m + r) + a + r


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_pingpong", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("results/bench_pingpong.json"))
    p.add_argument("--batch", type=batch_size, default=128, help="requests decoding together (enough for attention to be a real part of a step)")
    p.add_argument("--microbatches", default="1,2,3,4,auto")
    p.add_argument("--context", type=int, default=CONTEXT,
                   help="prompt tokens of the batch's requests (with the decoded ones, the tiny model allows 4096, "
                   "deep 16384)")
    p.add_argument("--preset", choices=("tiny", "deep"), default="tiny",
                   help="tiny: the embedded model (4 layers); deep: its 16-layer twin (tiny_models)")  # fmt: skip
    p.add_argument("--workers", type=int, default=8, help="expert workers (each costs this machine CPU per request)")
    p.add_argument("--cpus", choices=("split", "shared"), default="split",
                   help="split: vLLM's model worker and the expert workers on separate CPUs, as on separate machines")  # fmt: skip
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ms = [None if x == "auto" else int(x) for x in a.microbatches.split(",")]
    assert ms[0] == 1, "m = 1 first: it calibrates the regimes and the ideal"
    a.out.parent.mkdir(parents=True, exist_ok=True)
    logs = a.out.parent / "bench-pingpong-logs"
    logs.mkdir(exist_ok=True)
    embedded = tiny_models.default_model_dir()
    model_dir = embedded if a.preset == "tiny" else embedded.parent / f"qwen3_moe-{a.preset}"
    model = tiny_models.make("qwen3_moe", model_dir, preset=a.preset)
    ckpt = read_checkpoint(model)
    layers = len(ckpt.moe_layers)
    if a.context + BATCH_TOKENS > (limit := read_model_config(model).max_position_embeddings):
        p.error(f"--context {a.context} + {BATCH_TOKENS} decoded tokens is more than the {a.preset} "
                f"model's {limit} positions")
    prompt = long_prompt(model, a.context)
    serve_args = vllm_args(model, a.context, a.batch)
    cluster = Cluster(model, logs, a.workers, split_cpus=a.cpus == "split", vllm_args=serve_args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    points: list[Point] = []
    regimes: dict[str, dict] = {}
    try:
        # Calibration: the attention node's busy time per MoE layer, and the remote time this machine
        # adds by itself (transport, the workers' CPU), with instant workers.
        cluster.start_workers(0.0, 0.0)
        url = cluster.start_attention("calibration")
        (calib,) = measure_interleaved([Server(url, a.batch, "no delay", 1, prompt=prompt)])
        context = prompt_tokens(url, [prompt])
        points.append(calib)
        attention_ms = (calib.forward_ms - calib.expert_wait_ms) / layers
        own_remote_ms = calib.expert_wait_ms / layers
        # Expert time = attention time: the per-row part makes up what the machine's own remote time
        # leaves, over the rows the busiest worker gets (all of them: the requests route alike).
        per_row_us = 1e3 * max(0.0, attention_ms - own_remote_ms) / a.batch
        if not per_row_us:
            logger.warning("the remote time of this machine (%.2f ms per layer) already exceeds attention's (%.2f)",
                           own_remote_ms, attention_ms)  # fmt: skip
        regimes = {
            "expert ≈ attention": {"delay_ms": 0.0, "delay_us_per_row": per_row_us},
            "transport-heavy": {"delay_ms": 2 * attention_ms, "delay_us_per_row": per_row_us},
        }
        for regime, delays in regimes.items():
            cluster.start_workers(delays["delay_ms"], delays["delay_us_per_row"])
            url = cluster.start_attention(regime.split()[0])
            measured = measure_interleaved([Server(url, a.batch, regime, m, prompt=prompt) for m in ms])
            base = measured[0]
            for m, point in zip(ms, measured):
                # auto's ideal: the best m's
                point.ideal_step_ms = min(ideal_step_ms(base, layers, i, own_remote_ms, delays["delay_ms"])
                                          for i in ([m] if m else range(1, MAX_MICROBATCHES + 1)))  # fmt: skip
                points.append(point)
                logger.info("%s", point)
    finally:
        cluster.stop()
    header = (f"{'regime':22} {'m':>4} {'step ms':>8} {'rounds ms':>11} {'ideal ms':>9} {'x m=1':>6} {'x best m':>8} "
              f"{'tok/s':>7} {'wait ms':>8} {'16 streams tok/s':>16} {'failed':>6}  steps by m (prefill too)")  # fmt: skip
    lines = [header]
    for pt in points:
        base = next(q for q in points if q.regime == pt.regime and q.microbatches == 1)
        fixed = min(q.step_ms for q in points if q.regime == pt.regime and q.microbatches is not None)
        ideal = "" if pt.ideal_step_ms is None else f"{pt.ideal_step_ms:.2f}"
        by_m = " ".join(f"{k}:{v:.0f}" for k, v in (pt.steps_by_microbatches or {}).items())
        spread = f"{min(pt.step_ms_rounds):.1f}-{max(pt.step_ms_rounds):.1f}"
        lines.append(f"{pt.regime:22} {pt.label:>4} {pt.step_ms:8.2f} {spread:>11} {ideal:>9} "
                     f"{pt.step_ms / base.step_ms:6.2f} {pt.step_ms / fixed:8.2f} {pt.tokens_per_s:7.0f} {pt.expert_wait_ms:8.2f} "
                     f"{pt.streams_tokens_per_s:16.0f} {pt.streams_failed:6d}  {by_m}")  # fmt: skip
    for regime, delays in regimes.items():
        lines.append(f"{regime}: workers hold each reply {delays['delay_ms']:.2f} ms + "
                     f"{delays['delay_us_per_row']:.1f} µs per row (benchmark-only emulation of pool B)")
    lines.append(f"batch {a.batch} requests, prompt {context} tokens, {BATCH_TOKENS} tokens decoded each "
                 f"({DECODE_TOKENS} by the probe); "
                 f"{layers} MoE layers, {a.workers} workers; without delays the attention node is busy {attention_ms:.2f} ms and waits "
                 f"{own_remote_ms:.2f} ms for the workers per MoE layer")
    cpus = cluster.cpus
    lines.append(f"CPUs {cpus['layout']}: vLLM's model worker on {cpus['vllm_model_worker']}, the expert workers on "
                 f"{cpus['expert_workers']}; {machine.describe()}")  # fmt: skip
    report = "\n".join(lines)
    print(report)
    result = {
        "machine": machine.describe(),
        "date": time.strftime("%Y-%m-%d"),
        "batch": a.batch,
        "workers": a.workers,
        "decode_tokens": DECODE_TOKENS,
        "lead_tokens": LEAD_TOKENS,
        "prompt_tokens": context,
        "preset": a.preset,
        "moe_layers": layers,
        "attention_ms_per_layer": attention_ms,
        "own_remote_ms_per_layer": own_remote_ms,
        "regimes": regimes,
        "points": [asdict(pt) for pt in points],
        "vllm_args": list(serve_args),
        "cpus": cpus,
    }
    a.out.write_text(json.dumps(result, indent=2))
    plot(points, a.out.with_suffix(".png"), f"ping-pong, {a.preset} model, {layers} MoE layers, {context}-token prompt")
    print(f"\nwrote {a.out} and {a.out.with_suffix('.png')}")


def plot(points: list[Point], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for regime in dict.fromkeys(pt.regime for pt in points if pt.ideal_step_ms is not None):
        mine = [pt for pt in points if pt.regime == regime and pt.microbatches is not None]
        (line,) = ax.plot([pt.microbatches for pt in mine], [pt.step_ms for pt in mine], "o-", label=f"{regime}")
        ax.vlines([pt.microbatches for pt in mine], [min(pt.step_ms_rounds) for pt in mine],
                  [max(pt.step_ms_rounds) for pt in mine], color=line.get_color(), alpha=0.4)  # the rounds' spread
        ax.plot([pt.microbatches for pt in mine], [pt.ideal_step_ms for pt in mine], "--", color=line.get_color(),
                label=f"{regime}, ideal (DESIGN §4)")  # fmt: skip
        for pt in points:
            if pt.regime == regime and pt.microbatches is None:
                ax.axhline(pt.step_ms, linestyle=":", color=line.get_color(), label=f"{regime}, auto")
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("decode step, ms")
    ax.set_xticks(sorted({pt.microbatches for pt in points if pt.microbatches is not None}))
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title(f"{title}\n(CPU, emulated pool B)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
