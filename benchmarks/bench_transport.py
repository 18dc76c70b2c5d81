"""make bench-transport: what moving a micro-batch to the workers and back costs, per data plane.

    python -m benchmarks.bench_transport [--out FILE] [--plaintext] [--e2e-planes shm,tcp,grpc] [--skip-e2e]

One run, loopback only, every process started and stopped by the bench:

1. Round trips of payloads the size of decode and prefill micro-batches (16 KiB ... 8 MiB of bf16
   rows, 2048 wide), to 1 worker and fanned out to 8 at once, over: the raw-TCP floor (a bare
   length-prefixed echo, benchmarks/tcp_echo.py), each data plane (shm, tcp, grpc: ECHO frames
   through the real worker processes) and the first slice's path (unary gRPC, a protobuf `bytes`
   field, the synchronous stub's futures) as the baseline. p50/p99, GB/s (both directions), CPU
   per round trip of the client and of the servers, ratio to the floor.
2. End to end on the embedded tiny model (4 MoE layers): decode inter-token latency of one
   request at a time and output tokens/s of 16 concurrent streaming requests, stock vLLM against
   the cluster on the shared-memory plane (--e2e-planes shm,tcp,grpc: on each plane, a minute
   more per plane), same flags (compiled), and the cluster's cost per MoE layer. All
   servers start at once, with the workers, and are measured in alternating rounds, each round
   starting with the next server (latency: medians of eight rounds; throughput: the fastest of
   eight, and their median beside it), then stopped before part 1 runs. With the throughput, the CPU
   each round took per output token, by role: vLLM's API server, engine core and model process, the
   expert workers, the streaming client (all on the same cores here).

Workers and attention servers run with mutual TLS and the token, as `make up` runs them
(benchmarks/bench_tls.py measures what that costs); --plaintext runs them without, as the floor
runs, so that the ratios to the floor are the planes' own. Prints a table, writes JSON and a PNG next
to it. Absolute times are this machine's; compare
ratios from the same run.

    python -m benchmarks.bench_transport --gpu [--out FILE]      (a CUDA machine, no vLLM needed)

GPU mode: eight workers on `cuda` run the Triton W4A16 kernel on Qwen3-30B-A3B's expert shapes
(tiny_models preset `a3b`: 4 of its 48 layers, quantized on load), driven over the default plane
by a client that sends decode micro-batches the way the attention node does (64 tokens, top-8
of 128 experts, random routing); it reports each layer's round trip beside the slowest worker's
time in its experts (kernel and copy back, from the reply frames).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

import tiny_models
from attention_server.combine import combine
from attention_server.handshake import fetch_info
from attention_server.partition import partition
from attention_server.transport import factory
from attention_server.transport.factory import open_channel
from benchmarks.tcp_echo import LENGTH
from cluster.certs import reuse_or_make
from cluster.launcher import ClusterSpec, free_port_run, free_ports, free_worker_ports, stop_pids, wait_http_ready
from protos import codec
from protos import expert_pb2_grpc as pb_grpc
from protos.checkpoint import read_checkpoint
from protos.placement import Placement
from protos.streams import recv_into_exactly, send_parts
from protos.security import Security
from benchmarks import machine

logger = logging.getLogger("bench_transport")

HOST = "127.0.0.1"
WIDTH = 2048  # a Qwen3-30B-A3B hidden row
SIZES = (16 << 10, 256 << 10, 1792 << 10, 8 << 20)  # 4, 64, 448 and 2048 bf16 rows
FANOUTS = (1, 8)
PATHS = ("tcp floor", "shm", "tcp", "grpc", "unary protobuf (first slice)")
NUM_WORKERS = 8
VLLM_ARGS = ("--dtype", "bfloat16", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(1 << 30))
E2E_PLANES = ("shm", "tcp", "grpc")
# End to end, by default stock vLLM and the cluster on the plane `auto` picks on one host: each
# more vLLM server adds about a minute of start-up on two cores (four took 233 s to serve).
DEFAULT_E2E_PLANES = ("shm",)
DECODE_TOKENS = 64


def cpu_seconds(procs: list[psutil.Process]) -> float:
    """User and system CPU of the server processes (none has children). Read between every two
    blocks of round trips: psutil's children() there scanned every process on the machine, 22 ms
    a call, about a minute of each run."""
    return sum(t.user + t.system for t in (p.cpu_times() for p in procs))


# ---- round-trip clients, one per path: round_trip(payload, peers) sends to each peer, then collects ----


class Floor:
    def __init__(self, ports: list[int]):
        self.socks = [socket.create_connection((HOST, p)) for p in ports]
        for s in self.socks:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.head, self.buffer = bytearray(LENGTH.size), bytearray(SIZES[-1])

    def round_trip(self, payload: memoryview, peers: list[int]) -> None:
        socks = [self.socks[i] for i in peers]
        for s in socks:
            send_parts(s, [LENGTH.pack(len(payload)), payload])
        for s in socks:
            recv_into_exactly(s, memoryview(self.head))
            (n,) = LENGTH.unpack(self.head)
            recv_into_exactly(s, memoryview(self.buffer)[:n])

    def close(self) -> None:
        for s in self.socks:
            s.close()


class Plane:
    def __init__(self, plane: str, endpoints: list[str], infos, security: Security):
        self.channels = [open_channel(w, e, info, plane, 60, security) for w, (e, info) in enumerate(zip(endpoints, infos))]
        assert {c.plane for c in self.channels} == {plane}

    def round_trip(self, payload: memoryview, peers: list[int]) -> None:
        requests = [(self.channels[i], self.channels[i].send_echo(payload)) for i in peers]
        for channel, request in requests:
            channel.receive(request)

    def close(self) -> None:
        for c in self.channels:
            c.close()


class UnaryProtobuf:
    """The first slice's dispatch: a protobuf `bytes` field, unary calls, the sync stub's futures."""

    def __init__(self, endpoints: list[str], security: Security):
        self.channels = [security.channel(e) for e in endpoints]
        self.stubs = [pb_grpc.ExpertServiceStub(c) for c in self.channels]

    def round_trip(self, tensor: torch.Tensor, peers: list[int]) -> None:
        calls = [self.stubs[i].Echo.future(codec.encode(tensor), timeout=60) for i in peers]
        for call in calls:
            codec.decode(call.result())

    def close(self) -> None:
        for c in self.channels:
            c.close()


ROUNDS = 32  # each path's round trips come in short blocks that alternate with the other paths'
BLOCK_S = 0.015  # a block lasts this long, and holds at least one round trip
# The rounds stop early once a (payload, fan-out) has taken ROUNDS_BUDGET_S, after MIN_ROUNDS (each peer has led
# a round): at 8 MiB fanned out to 8 a round of the five paths took about 1 s on the 2-core EPYC host (the first
# slice's path 0.45 s of it), so 32 of them were a third of the round trips' minute and a half (2026-12-07).
MIN_ROUNDS = NUM_WORKERS
ROUNDS_BUDGET_S = 3.0


def peers(first: int, fanout: int) -> list[int]:
    """The `fanout` peers a round trip goes to, from peer `first` on."""
    return [(first + i) % NUM_WORKERS for i in range(fanout)]


def measure_interleaved(clients: dict, data: dict, fanout: int, servers: dict) -> dict[str, dict]:
    """Round trips of every path for one (payload, fan-out), in short blocks that alternate
    between the paths, in a new order every round: the machine's drift over time (and whatever
    else it runs) falls on all of them alike, and no path always follows the same one (whose
    servers may still be winding down), so that their ratios hold within a run even where the
    absolute times move from run to run. A fan-out below NUM_WORKERS goes to other peers each
    round (round r starts at peer r), every path alike: one server process alone was seen to run
    its round trips up to 2x slower or faster than its twin for its whole life on this 2-vCPU VM,
    the raw-TCP echo as much as the workers, so a figure from one peer measured that peer's luck."""
    times = {path: [] for path in clients}
    cpu = {path: [0.0, 0.0] for path in clients}
    for path, client in clients.items():
        for first in range(NUM_WORKERS):
            client.round_trip(data[path], peers(first, fanout))
    order = random.Random(0)  # the same orders every run
    began, rounds = time.perf_counter(), 0
    for r in range(ROUNDS):
        if r >= MIN_ROUNDS and time.perf_counter() - began > ROUNDS_BUDGET_S:
            break
        rounds += 1
        for path in order.sample(list(clients), len(clients)):
            client, chosen = clients[path], peers(r, fanout)
            server0 = cpu_seconds(servers[path])
            cpu0, start, n = time.process_time(), time.perf_counter(), 0
            while n < 1 or time.perf_counter() - start < BLOCK_S:
                t = time.perf_counter()
                client.round_trip(data[path], chosen)
                times[path].append(time.perf_counter() - t)
                n += 1
            cpu[path][0] += time.process_time() - cpu0
            cpu[path][1] += cpu_seconds(servers[path]) - server0
    rows = {}
    for path, ts in times.items():
        ts.sort()
        size = len(data[path]) if isinstance(data[path], memoryview) else data[path].numel() * data[path].element_size()
        rows[path] = {
            "rounds": rounds,
            "iterations": len(ts),
            "p50_ms": statistics.median(ts) * 1e3,
            "p99_ms": ts[min(len(ts) - 1, int(len(ts) * 0.99))] * 1e3,
            "gb_per_s": 2 * size * fanout / statistics.median(ts) / 1e9,
            "client_cpu_ms_per_round_trip": cpu[path][0] / len(ts) * 1e3,
            "server_cpu_ms_per_round_trip": cpu[path][1] / len(ts) * 1e3,
        }
    return rows


def round_trips(endpoints: list[str], worker_pids: list[int], echo_ports: list[int], echo_pids: list[int],
                security: Security) -> list[dict]:  # fmt: skip
    infos = [fetch_info(w, e, 120, security) for w, e in enumerate(endpoints)]
    worker_procs, echo_procs = [psutil.Process(p) for p in worker_pids], [psutil.Process(p) for p in echo_pids]
    rows = []
    for size in SIZES:
        tensor = torch.randn(size // (2 * WIDTH), WIDTH).to(torch.bfloat16)
        payload = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        clients = {"tcp floor": Floor(echo_ports), **{p: Plane(p, endpoints, infos, security) for p in PATHS[1:4]},
                   PATHS[4]: UnaryProtobuf(endpoints, security)}  # fmt: skip
        data = {p: tensor if p == PATHS[4] else payload for p in PATHS}
        servers = {p: echo_procs if p == "tcp floor" else worker_procs for p in PATHS}
        try:
            for fanout in FANOUTS:
                for path, row in measure_interleaved(clients, data, fanout, servers).items():
                    rows.append({"path": path, "bytes": size, "fanout": fanout, **row})
                    logger.info("%-30s %8d B x%d  p50 %.3f ms", path, size, fanout, row["p50_ms"])
        finally:
            for client in clients.values():
                client.close()
    floor = {(r["bytes"], r["fanout"]): r["p50_ms"] for r in rows if r["path"] == "tcp floor"}
    for r in rows:
        r["x_floor"] = r["p50_ms"] / floor[(r["bytes"], r["fanout"])]
    order = {p: i for i, p in enumerate(PATHS)}
    return sorted(rows, key=lambda r: (r["bytes"], order[r["path"]], r["fanout"]))


# ---- end to end ------------------------------------------------------------------------------


def completion_seconds(client, model: str, prompt: str, max_tokens: int) -> float:
    start = time.perf_counter()
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert out.usage.completion_tokens == max_tokens
    return time.perf_counter() - start


async def _streams(url: str, model: str, max_tokens: int, streams: int) -> None:
    import aiohttp  # the end-to-end part only, as the openai client below (vLLM brings both)
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput, async_request_openai_completions

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        outs = await asyncio.gather(*(
            async_request_openai_completions(RequestFuncInput(
                prompt=f"Stream {i} tells a story about", api_url=f"{url}/v1/completions", prompt_len=0,
                output_len=max_tokens, model=model, ignore_eos=True, extra_body={"temperature": 0}), session)
            for i in range(streams)))  # fmt: skip
    for out in outs:
        if not out.success or out.output_tokens != max_tokens:
            raise RuntimeError(f"a stream from {url} failed: {out.error or f'{out.output_tokens} tokens'}")


def concurrent_streams(url: str, model: str, max_tokens: int, streams: int = 16) -> None:
    """`streams` clients streaming at once, as users' chat clients do, read by the request function of
    vLLM's own `vllm bench serve` (aiohttp, one event loop). On this 2-core host the client shares the CPU
    with the servers: the openai client on 16 threads took 380-530 ms of it per round of 16 x 64 tokens
    against stock vLLM, this one 110-180 (2026-12-07, eight alternating rounds)."""
    asyncio.run(_streams(url, model, max_tokens, streams))


def itl_seconds(client, model: str) -> tuple[float, float]:
    """(time of a 1-token completion, of a DECODE_TOKENS one): decode inter-token latency without
    trusting when streamed chunks arrive (they bunch) is their difference over DECODE_TOKENS - 1."""
    prompt = "The weather today is"
    return completion_seconds(client, model, prompt, 1), completion_seconds(client, model, prompt, DECODE_TOKENS)


STREAMS_TOKENS = 16 * DECODE_TOKENS  # output tokens of one round of streams_rate


def streams_rate(url: str, model: str) -> float:
    start = time.perf_counter()
    concurrent_streams(url, model, DECODE_TOKENS)
    return STREAMS_TOKENS / (time.perf_counter() - start)


E2E_ROUNDS = 8
# Where each 16-stream round's CPU goes, by role: a vLLM server's API server (the process it starts as), engine core
# and model process (vLLM names the last two by their role), the eight expert workers (the cluster's rounds only) and
# the streaming client (this process), all on the same cores. The engine core and the model process poll vLLM's
# shared-memory queues between messages (sched_yield), so theirs include time that no other process wanted.
CPU_ROLES = ("api_server", "engine_core", "model", "expert_workers", "client")
# And, for the cluster, what its steps' model forward spent in the MoE layers' host stages (the attention server's
# hetero_moe_step_* histograms): the forward, the dispatch, the wait for the workers and the combine.
STEP_PARTS = ("forward", "dispatch", "expert_wait", "combine")
# vLLM's engine and model worker poll their shared-memory queues (sched_yield) for a second after
# the last message before they block: the server measured before must be idle before the next.
ENGINE_IDLE_S = 1.5


class EndToEnd:
    """Stock vLLM and the cluster on each plane. All start at once, with the bench (their minutes
    of start-up overlap the workers' own), and are measured in alternating rounds, so that the
    machine's drift falls on all of them alike; stopped before the round trips, which then have
    the CPU to themselves."""

    def __init__(self, model: Path, spec: ClusterSpec, logs: Path, planes: list[str]):
        # vLLM 0.32's AOT compile cache never loads on CPU ("'function' object has no attribute
        # 'finalize_loading'"), so each start compiles again; its older cache loads (stock alone:
        # 40 s to serve with a warm cache, against 33 s without AOT).
        env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_MOE_")} | {"VLLM_USE_AOT_COMPILE": "0"}
        self.planes, self.names = planes, ["stock", *planes]
        self.ports = dict(zip(self.names, free_ports(len(self.names))))
        self.procs: dict[str, subprocess.Popen] = {}
        self.started = time.perf_counter()
        for name in self.names:
            serve = ["--model", str(model), "--host", HOST, "--port", str(self.ports[name]), *VLLM_ARGS]
            if name == "stock":
                cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *serve]
            else:
                cmd = [sys.executable, "-m", "attention_server", "--expert-endpoints", ",".join(spec.endpoints),
                       *spec.security_args(), "--data-plane", name, *serve]  # fmt: skip
            with (logs / f"{'stock' if name == 'stock' else 'attention-' + name}.log").open("wb") as out:
                self.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                                    env=env)  # fmt: skip

    def _roles(self, name: str, worker_pids: list[int]) -> dict[str, list[psutil.Process]]:
        """The processes whose CPU a round of `name` is charged, by role (CPU_ROLES)."""
        server = psutil.Process(self.procs[name].pid)
        roles = {role: [] for role in CPU_ROLES}
        roles["api_server"].append(server)
        for child in server.children(recursive=True):
            role = {"VLLM::EngineCore": "engine_core", "VLLM::Worker": "model"}.get(child.name().split("_")[0])
            if role is not None:
                roles[role].append(child)
        if name != "stock":
            roles["expert_workers"] = [psutil.Process(pid) for pid in worker_pids]
        roles["client"].append(psutil.Process())
        return roles

    def measure(self, num_moe_layers: int, worker_pids: list[int]) -> dict:
        from openai import OpenAI  # the end-to-end part only (the GPU mode runs where no vLLM client is)

        clients = {}
        for name in self.names:
            url = f"http://{HOST}:{self.ports[name]}"
            wait_http_ready(url, self.procs.values(), timeout_s=900)
            client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
            clients[name] = (client, client.models.list().data[0].id, url)
        logger.info("%d servers up %.0f s after they started", len(self.names), time.perf_counter() - self.started)
        for client, model_id, url in clients.values():  # warm: compile, caches, the shapes of a batch of 16
            itl_seconds(client, model_id)
            concurrent_streams(url, model_id, 8)
            time.sleep(ENGINE_IDLE_S)
        itl = {name: [] for name in self.names}
        rates = {name: [] for name in self.names}
        roles = {name: self._roles(name, worker_pids) for name in self.names}
        cpu = {name: {role: [] for role in CPU_ROLES} for name in self.names}  # per round, ms per output token
        steps = {plane: dict.fromkeys((*STEP_PARTS, "steps"), 0.0) for plane in self.planes}  # summed over rounds
        for r in range(E2E_ROUNDS):  # each round starts with the next server: none is always measured first
            for name in self.names[r % len(self.names):] + self.names[:r % len(self.names)]:
                client, model_id, url = clients[name]
                itl[name].append(itl_seconds(client, model_id))
                steps_before = _step_seconds(url) if name in steps else None
                before = {role: cpu_seconds(procs) for role, procs in roles[name].items()}
                rates[name].append(streams_rate(url, model_id))
                for role, procs in roles[name].items():
                    cpu[name][role].append((cpu_seconds(procs) - before[role]) / STREAMS_TOKENS * 1e3)
                if steps_before is not None:
                    for part, value in _step_seconds(url).items():
                        steps[name][part] += value - steps_before[part]
                time.sleep(ENGINE_IDLE_S)
        result = {}
        for name in self.names:
            one = statistics.median(t for t, _ in itl[name])
            many = statistics.median(t for _, t in itl[name])
            result[name] = {"first_token_ms": one * 1e3, "itl_ms": (many - one) / (DECODE_TOKENS - 1) * 1e3,
                            # the fastest round: on 2 cores stock vLLM's 16 streams alternate between a fast
                            # and a 3-5x slower mode from round to round, where a median picks either
                            "streams_16_tokens_per_s": max(rates[name]),
                            "streams_16_median_tokens_per_s": statistics.median(rates[name]),
                            "streams_16_each_round": rates[name],
                            # the medians over the rounds, by role (CPU_ROLES)
                            "streams_16_cpu_ms_per_token": {role: statistics.median(v)
                                                            for role, v in cpu[name].items()}}  # fmt: skip
        stock = result["stock"]
        for plane in self.planes:
            r = result[plane]
            n = steps[plane]["steps"]  # the mean over the 16-stream rounds' steps, ms
            r["streams_16_step_ms"] = {part: steps[plane][part] / n * 1e3 for part in STEP_PARTS} | {"steps": n}
            r["moe_layer_overhead_ms"] = (r["itl_ms"] - stock["itl_ms"]) / num_moe_layers
            r["throughput_vs_stock"] = r["streams_16_tokens_per_s"] / stock["streams_16_tokens_per_s"]
            r["median_throughput_vs_stock"] = r["streams_16_median_tokens_per_s"] / stock["streams_16_median_tokens_per_s"]
            logger.info("cluster on %s: %s", plane, r)
        return result

    def stop(self) -> None:
        procs, self.procs = self.procs, {}
        stop_pids({name: p.pid for name, p in procs.items()}, reap=lambda: [p.poll() for p in procs.values()])
        for p in procs.values():
            p.wait()


# ---- report ----------------------------------------------------------------------------------


def table(rows: list[dict], e2e: dict | None) -> str:
    lines = [f"{'path':30} {'payload':>9} {'fan':>4} {'p50 ms':>8} {'p99 ms':>8} {'x floor':>8} {'GB/s':>6} "
             f"{'cpu ms client':>13} {'servers':>8}"]  # fmt: skip
    for r in rows:
        lines.append(f"{r['path']:30} {_size(r['bytes']):>9} {r['fanout']:>4} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} "
                     f"{r['x_floor']:8.2f} {r['gb_per_s']:6.2f} {r['client_cpu_ms_per_round_trip']:13.3f} "
                     f"{r['server_cpu_ms_per_round_trip']:8.3f}")  # fmt: skip
    if e2e:
        lines += ["", f"{'end to end (tiny Qwen3-MoE, 4 MoE layers)':44} {'ITL ms':>10} {'per MoE layer':>13} "
                      f"{'16 streams tok/s':>16} {'x stock':>7} {'median tok/s':>12} {'x stock':>7}"]  # fmt: skip
        for name, r in e2e.items():
            lines.append(f"{name:44} {r['itl_ms']:10.2f} {r.get('moe_layer_overhead_ms', 0):13.2f} "
                         f"{r['streams_16_tokens_per_s']:16.0f} {r.get('throughput_vs_stock', 1):7.2f} "
                         f"{r['streams_16_median_tokens_per_s']:12.0f} {r.get('median_throughput_vs_stock', 1):7.2f}")  # fmt: skip
        lines += ["", f"{'16 streams: CPU ms per output token':44} " + " ".join(f"{role:>14}" for role in CPU_ROLES)
                  + f" {'all':>6}"]  # fmt: skip
        for name, r in e2e.items():
            split = r["streams_16_cpu_ms_per_token"]
            lines.append(f"{name:44} " + " ".join(f"{split[role]:14.3f}" for role in CPU_ROLES)
                         + f" {sum(split.values()):6.3f}")  # fmt: skip
        planes = [name for name, r in e2e.items() if "streams_16_step_ms" in r]
        if planes:
            lines += ["", f"{'16 streams: a step of the cluster, mean ms':44} "
                          + " ".join(f"{part:>14}" for part in STEP_PARTS) + f" {'steps':>6}"]  # fmt: skip
            for name in planes:
                step = e2e[name]["streams_16_step_ms"]
                lines.append(f"{name:44} " + " ".join(f"{step[part]:14.3f}" for part in STEP_PARTS)
                             + f" {step['steps']:6.0f}")  # fmt: skip
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n >> 10} KiB"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(FANOUTS), figsize=(12, 4.5), sharey=True)
    for ax, fanout in zip(axes, FANOUTS):
        for p in PATHS:
            pts = [(r["bytes"], r["p50_ms"]) for r in rows if r["path"] == p and r["fanout"] == fanout]
            ax.plot([b / 2**10 for b, _ in pts], [t for _, t in pts], marker="o", label=p)
        ax.set(xscale="log", yscale="log", xlabel="payload per worker (KiB, each way)",
               title=f"round trip p50, {fanout} worker{'s' if fanout > 1 else ''} at once")  # fmt: skip
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("ms")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


GPU_TOKENS, GPU_STEPS = 64, 200


def _samples(url: str) -> dict[str, float]:
    """A /metrics page's unlabelled samples, by name."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        return {s.name: s.value for f in text_string_to_metric_families(r.read().decode()) for s in f.samples}


def _forward_seconds(url: str) -> tuple[float, float]:
    """(sum, count) of a worker's Forward time: decode, validation, experts, encode."""
    samples = _samples(url)
    return samples["hetero_moe_worker_forward_seconds_sum"], samples["hetero_moe_worker_forward_seconds_count"]


def _step_seconds(url: str) -> dict[str, float]:
    """The attention server's step histograms so far (attention_server/metrics.py): each one's sum, and the steps."""
    samples = _samples(f"{url}/metrics")
    totals = {part: samples[f"hetero_moe_step_{part}_seconds_sum"] for part in STEP_PARTS}
    return totals | {"steps": samples["hetero_moe_step_forward_seconds_count"]}


def gpu_layers(logs: Path) -> dict:
    # The client's host work is small single-threaded numpy; torch's idle OpenMP threads would
    # otherwise spin beside the eight workers after each routing draw.
    torch.set_num_threads(1)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hetero-moe" / "models"
    model = tiny_models.make("qwen3_moe", cache / "qwen3_moe-a3b", preset="a3b")
    ckpt = read_checkpoint(model)
    spec = ClusterSpec(model=model, num_workers=NUM_WORKERS, http_port=0, host=HOST, run_dir=logs, worker_threads=1,
                       **free_worker_ports(NUM_WORKERS), tls_dir=reuse_or_make(logs / "tls"),
                       worker_args=("--device", "cuda", "--weight-format", "w4a16", "--kernel-backend", "triton"))  # fmt: skip
    procs = {}
    try:
        for i in range(NUM_WORKERS):
            with (logs / f"gpu-worker-{i}.log").open("wb") as f:
                procs[i] = subprocess.Popen(spec.worker_command(i), stdout=f, stderr=subprocess.STDOUT,
                                            start_new_session=True)  # fmt: skip
        security = Security.load(spec.tls_dir, "attention")
        infos = [fetch_info(w, e, 900, security) for w, e in enumerate(spec.endpoints)]
        placement = Placement(ckpt.num_experts, NUM_WORKERS, infos[0].expert_replicas)
        transport = factory.connect(tuple(spec.endpoints), infos, "auto", 120, placement, security)
        shards = placement.shard_table()
        g = torch.Generator().manual_seed(0)
        x = torch.randn(GPU_TOKENS, ckpt.hidden_size, generator=g).to(torch.bfloat16)
        phases = {"partition": [], "send": [], "wait": [], "combine": [], "round_trip": [], "compute": []}
        worker_urls = [f"http://{HOST}:{spec.worker_metrics_base_port + i}/metrics" for i in range(NUM_WORKERS)]
        for step in range(GPU_STEPS + 10):
            if step == 10:  # the first steps compile and warm the kernels
                handled_before = [_forward_seconds(u) for u in worker_urls]
            for layer in ckpt.moe_layers:
                weights, ids = torch.softmax(torch.randn(GPU_TOKENS, ckpt.num_experts, generator=g), -1).topk(ckpt.top_k, -1)
                t0 = time.perf_counter()
                plan = partition(ids.to(torch.int32), weights, shards)
                t1 = time.perf_counter()
                transport.send(layer, 0, x, plan)
                t2 = time.perf_counter()
                pending = transport.take(layer, 0)
                partials = pending.wait()
                t3 = time.perf_counter()
                combine(plan, partials, ckpt.hidden_size, torch.bfloat16)
                t4 = time.perf_counter()
                if step >= 10:
                    for name, t in (("partition", t1 - t0), ("send", t2 - t1), ("wait", t3 - t2), ("combine", t4 - t3),
                                    ("round_trip", t4 - t1), ("compute", max(pending.compute_ns) / 1e9)):  # fmt: skip
                        phases[name].append(t)
        handled = [(s1 - s0, n1 - n0) for (s0, n0), (s1, n1) in zip(handled_before, map(_forward_seconds, worker_urls))]
        transport.close()
    finally:
        stop_pids({f"gpu-worker-{i}": p.pid for i, p in procs.items()}, reap=lambda: [p.poll() for p in procs.values()])
    rt, kc = sorted(phases["round_trip"]), sorted(phases["compute"])
    result = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device seen by the client",
        "model": "qwen3_moe a3b preset: hidden 2048, 128 experts of width 768, top-8, 4 MoE layers, W4A16 group 128",
        "workers": f"{NUM_WORKERS} processes, all on cuda:0 of this machine, kernel backend {infos[0].kernel_backend}",
        "plane": transport.channels[0].plane,
        "tokens_per_micro_batch": GPU_TOKENS,
        "layers_measured": len(rt),
        "round_trip_p50_ms": statistics.median(rt) * 1e3,
        "round_trip_p99_ms": rt[int(len(rt) * 0.99)] * 1e3,
        "slowest_worker_compute_p50_ms": statistics.median(kc) * 1e3,
        "round_trip_over_compute": statistics.median(rt) / statistics.median(kc),
        "client_p50_ms": {name: statistics.median(v) * 1e3 for name, v in phases.items()},
        "worker_handle_mean_ms": [s / n * 1e3 for s, n in handled],
    }
    print("\n".join(f"{k:32} {v:.3f}" if isinstance(v, float) else f"{k:32} {v}" for k, v in result.items()))
    return result


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_transport", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("results/bench_transport.json"))
    p.add_argument("--skip-e2e", action="store_true", help="only the round trips (no vLLM)")
    p.add_argument("--e2e-planes", default=",".join(DEFAULT_E2E_PLANES),
                   help=f"planes the end-to-end part runs the cluster on, of {','.join(E2E_PLANES)}")
    p.add_argument("--skip-round-trips", action="store_true", help="only the end-to-end part")
    p.add_argument("--gpu", action="store_true", help="the W4A16 workers on cuda, Qwen3-30B-A3B shapes (see above)")
    p.add_argument("--plaintext", action="store_true", help="workers and attention servers without TLS, as the floor")
    a = p.parse_args()
    planes = [x for x in a.e2e_planes.split(",") if x]
    if unknown := set(planes) - set(E2E_PLANES):
        p.error(f"--e2e-planes: unknown {sorted(unknown)}; choose from {','.join(E2E_PLANES)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    logs = a.out.parent / "bench-transport-logs"
    logs.mkdir(exist_ok=True)
    if a.gpu:
        result = {"date": time.strftime("%Y-%m-%d"), "gpu_layers": gpu_layers(logs)}
        a.out.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {a.out}")
        return
    model = tiny_models.make("qwen3_moe", tiny_models.default_model_dir())
    tls_dir = None if a.plaintext else reuse_or_make(logs / "tls")
    spec = ClusterSpec(model=model, num_workers=NUM_WORKERS, http_port=0, host=HOST, run_dir=logs, worker_threads=1,
                       **free_worker_ports(NUM_WORKERS), tls_dir=tls_dir)  # fmt: skip
    procs: dict[str, subprocess.Popen] = {}
    e2e_servers = None
    try:
        for i in range(NUM_WORKERS):
            with (logs / f"worker-{i}.log").open("wb") as f:
                procs[f"worker-{i}"] = subprocess.Popen(spec.worker_command(i), stdout=f, stderr=subprocess.STDOUT,
                                                        start_new_session=True)  # fmt: skip
        echo_base = free_port_run(NUM_WORKERS)
        echo_ports = list(range(echo_base, echo_base + NUM_WORKERS))
        if not a.skip_e2e:
            e2e_servers = EndToEnd(model, spec, logs, planes)
        for i, port in enumerate(echo_ports):
            procs[f"echo-{i}"] = subprocess.Popen([sys.executable, "-m", "benchmarks.tcp_echo", "--port", str(port)],
                                                  start_new_session=True)  # fmt: skip
        for port in echo_ports:
            _wait_port(port)
        workers = [procs[f"worker-{i}"].pid for i in range(NUM_WORKERS)]
        echoes = [procs[f"echo-{i}"].pid for i in range(NUM_WORKERS)]
        security = Security.load(spec.tls_dir, "attention")
        e2e = None
        if e2e_servers is not None:
            e2e = e2e_servers.measure(len(read_checkpoint(model).moe_layers), workers)
            e2e_servers.stop()
        rows = [] if a.skip_round_trips else round_trips(spec.endpoints, workers, echo_ports, echoes, security)
    finally:
        if e2e_servers is not None:
            e2e_servers.stop()
        stop_pids({n: p.pid for n, p in procs.items()}, reap=lambda: [p.poll() for p in procs.values()])
    report = table(rows, e2e)
    print(report)
    result = {
        "machine": machine.describe(),
        "date": time.strftime("%Y-%m-%d"),
        "row_width": WIDTH,
        "security": Security.load(spec.tls_dir, "attention").describe(),
        "round_trips": rows,
        "end_to_end": e2e,
        "vllm_args": list(VLLM_ARGS),
    }
    a.out.write_text(json.dumps(result, indent=2))
    if rows:
        plot(rows, a.out.with_suffix(".png"))
    print(f"\nwrote {a.out}" + (f" and {a.out.with_suffix('.png')}" if rows else ""))


def _wait_port(port: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((HOST, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"echo server on {port} did not start")


if __name__ == "__main__":
    main()
