"""What mutual TLS and the token cost a decode step: the same cluster with them on and off, one run.

    python -m benchmarks.bench_tls [--out FILE] [--steps N] [--tokens T] [--planes tcp,grpc,shm] [--e2e]

Eight workers with --tls-dir and eight with --plaintext serve the embedded tiny model on loopback.
For each data plane, a client drives decode steps through the attention node's real transport
(factory.connect: partition, send, wait, combine for every MoE layer, T tokens of random routing),
alternating between the TLS and the plaintext workers round by round so that drift falls on both;
it reports p50/p99 step time and the TLS/plaintext ratio. TLS wraps the TCP and gRPC planes;
shared memory stays on the host, so only its HELLO differs (a control).

--e2e adds the whole path: `python -m cluster up` with TLS (its default) and with --plaintext on
the TCP plane, one after the other, and the decode inter-token latency of one request on each
(bench_transport's method: a 64-token minus a 1-token completion). Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import tiny_models
from attention_server.combine import combine
from attention_server.handshake import fetch_info
from attention_server.partition import partition
from attention_server.transport import factory
from benchmarks.bench_transport import DECODE_TOKENS, VLLM_ARGS, itl_seconds
from cluster.certs import reuse_or_make
from cluster.launcher import ClusterSpec, free_ports, free_worker_ports, stop_pids, wait_http_ready
from protos.checkpoint import read_checkpoint
from protos.placement import Placement
from protos.security import Security
from benchmarks import machine

logger = logging.getLogger("bench_tls")

HOST = "127.0.0.1"
NUM_WORKERS = 8
MODES = ("tls", "plaintext")
ROUNDS = 6  # alternating rounds per plane; each mode gets steps / ROUNDS steps per round


def start_workers(spec: ClusterSpec, logs: Path, tag: str) -> dict[str, subprocess.Popen]:
    procs = {}
    for i in range(spec.num_workers):
        with (logs / f"{tag}-worker-{i}.log").open("wb") as f:
            procs[f"{tag}-worker-{i}"] = subprocess.Popen(spec.worker_command(i), stdout=f, stderr=subprocess.STDOUT,
                                                          start_new_session=True)  # fmt: skip
    return procs


def decode_steps(transport, ckpt, tokens: int, steps: int, g: torch.Generator) -> list[float]:
    """Seconds of each decode step's expert path: every MoE layer's partition, send, wait and combine."""
    shards = transport.placement.shard_table()
    x = torch.randn(tokens, ckpt.hidden_size, generator=g).to(ckpt.dtype)
    times = []
    for _ in range(steps):
        routings = [torch.softmax(torch.randn(tokens, ckpt.num_experts, generator=g), -1).topk(ckpt.top_k, -1)
                    for _ in ckpt.moe_layers]  # fmt: skip
        start = time.perf_counter()
        for layer, (weights, ids) in zip(ckpt.moe_layers, routings):
            plan = partition(ids.to(torch.int32), weights, shards)
            transport.send(layer, 0, x, plan)
            combine(plan, transport.take(layer, 0).wait(), ckpt.hidden_size, ckpt.dtype)
        times.append(time.perf_counter() - start)
    return times


def transport_steps(specs: dict[str, ClusterSpec], ckpt, planes: list[str], tokens: int, steps: int) -> dict:
    result = {}
    g = torch.Generator().manual_seed(0)
    for plane in planes:
        transports = {}
        for mode, spec in specs.items():
            security = Security.load(spec.tls_dir, "attention")
            infos = [fetch_info(w, e, 900, security) for w, e in enumerate(spec.endpoints)]
            placement = Placement(ckpt.num_experts, NUM_WORKERS, infos[0].expert_replicas)
            transports[mode] = factory.connect(tuple(spec.endpoints), infos, plane, 60, placement, security)
        try:
            times = {mode: [] for mode in specs}
            for mode, transport in transports.items():  # warm: connections, buffers, the workers' first layers
                decode_steps(transport, ckpt, tokens, 20, g)
            for _ in range(ROUNDS):
                for mode, transport in transports.items():
                    times[mode] += decode_steps(transport, ckpt, tokens, max(1, steps // ROUNDS), g)
        finally:
            for transport in transports.values():
                transport.close()
        row = {mode: {"p50_ms": statistics.median(t) * 1e3, "p99_ms": sorted(t)[int(0.99 * (len(t) - 1))] * 1e3,
                      "steps": len(t)} for mode, t in times.items()}  # fmt: skip
        row["tls_over_plaintext_p50"] = row["tls"]["p50_ms"] / row["plaintext"]["p50_ms"]
        row["tls_cost_per_step_ms"] = row["tls"]["p50_ms"] - row["plaintext"]["p50_ms"]
        logger.info("%s: %s", plane, row)
        result[plane] = row
    return result


def end_to_end(model: Path, logs: Path) -> dict:
    """Decode inter-token latency of `cluster up` on the TCP plane, TLS on and off, one after the other."""
    from openai import OpenAI

    result = {}
    for mode in MODES:
        (http,) = free_ports(1)
        ports = free_worker_ports(NUM_WORKERS)
        cmd = [sys.executable, "-m", "cluster", "up", "--model", str(model), "--host", HOST, "--port", str(http),
               "--worker-base-port", str(ports["worker_base_port"]),
               "--worker-metrics-base-port", str(ports["worker_metrics_base_port"]),
               "--worker-data-base-port", str(ports["worker_data_base_port"]),
               "--run-dir", str(logs / f"e2e-{mode}"), "--data-plane", "tcp", "--pingpong-microbatches", "1",
               *(["--plaintext"] if mode == "plaintext" else []), "--", *VLLM_ARGS]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_MOE_")}
        with (logs / f"e2e-{mode}.log").open("wb") as out:
            up = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            wait_http_ready(f"http://{HOST}:{http}", [up], timeout_s=900)
            client = OpenAI(base_url=f"http://{HOST}:{http}/v1", api_key="unused", max_retries=0, timeout=600)
            model_id = client.models.list().data[0].id
            itl_seconds(client, model_id)  # warm
            samples = [itl_seconds(client, model_id) for _ in range(5)]
        finally:
            stop_pids({"up": up.pid})
        one, many = statistics.median(t for t, _ in samples), statistics.median(t for _, t in samples)
        result[mode] = {"itl_ms": (many - one) / (DECODE_TOKENS - 1) * 1e3, "first_token_ms": one * 1e3}
        logger.info("end to end, %s: %s", mode, result[mode])
    result["tls_over_plaintext_itl"] = result["tls"]["itl_ms"] / result["plaintext"]["itl_ms"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_tls", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("results/bench_tls.json"))
    p.add_argument("--steps", type=int, default=600, help="measured decode steps per mode and plane")
    p.add_argument("--tokens", type=int, default=8, help="tokens per decode step (requests in the batch)")
    p.add_argument("--planes", default="tcp,grpc,shm")
    p.add_argument("--e2e", action="store_true", help="also the decode ITL of `cluster up`, TLS on and off (vLLM)")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    logs = a.out.parent / "bench-tls-logs"
    logs.mkdir(exist_ok=True)
    torch.set_num_threads(1)
    model = tiny_models.make("qwen3_moe", tiny_models.default_model_dir())
    ckpt = read_checkpoint(model)
    specs = {mode: ClusterSpec(model=model, num_workers=NUM_WORKERS, http_port=0, host=HOST, run_dir=logs,
                               worker_threads=1, **free_worker_ports(NUM_WORKERS),
                               tls_dir=reuse_or_make(logs / "tls") if mode == "tls" else None)
             for mode in MODES}  # fmt: skip
    procs: dict[str, subprocess.Popen] = {}
    try:
        for mode, spec in specs.items():
            procs |= start_workers(spec, logs, mode)
        steps = transport_steps(specs, ckpt, [x for x in a.planes.split(",") if x], a.tokens, a.steps)
    finally:
        stop_pids({n: p.pid for n, p in procs.items()}, reap=lambda: [p.poll() for p in procs.values()])
    e2e = end_to_end(model, logs) if a.e2e else None
    print(f"\ndecode step, {len(ckpt.moe_layers)} MoE layers x {a.tokens} tokens, {NUM_WORKERS} workers "
          f"(expert path only: partition, send, wait, combine)")  # fmt: skip
    print(f"{'plane':6} {'TLS p50 ms':>11} {'plain p50 ms':>13} {'TLS p99 ms':>11} {'plain p99 ms':>13} {'ratio':>6}")
    for plane, r in steps.items():
        print(f"{plane:6} {r['tls']['p50_ms']:11.3f} {r['plaintext']['p50_ms']:13.3f} {r['tls']['p99_ms']:11.3f} "
              f"{r['plaintext']['p99_ms']:13.3f} {r['tls_over_plaintext_p50']:6.2f}")  # fmt: skip
    if e2e:
        print(f"end to end (tcp): ITL {e2e['tls']['itl_ms']:.2f} ms with TLS, {e2e['plaintext']['itl_ms']:.2f} ms "
              f"without ({e2e['tls_over_plaintext_itl']:.2f}x)")  # fmt: skip
    result = {
        "machine": machine.describe(),
        "date": time.strftime("%Y-%m-%d"),
        "model": f"embedded tiny qwen3_moe: {len(ckpt.moe_layers)} MoE layers, hidden {ckpt.hidden_size}, "
                 f"top-{ckpt.top_k} of {ckpt.num_experts}",
        "tokens_per_step": a.tokens,
        "decode_step": steps,
        "end_to_end": e2e,
    }
    a.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
