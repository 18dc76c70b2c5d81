"""`make up` (python -m cluster up) as users run it: detached until `down`, or in the foreground until a `down` from
elsewhere; W4A16 quantized on load;
a dead worker restarted; and one that cannot come back stops the whole cluster, naming it."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import openai
import psutil
import pytest

from cluster.launcher import ClusterSpec, free_port_run
from protos.checkpoint import read_checkpoint
from tests.support import (
    HOST, VLLM_CPU_ARGS, ClusterCounters, assert_workers_did_the_work, free_ports, free_worker_ports, openai_client, port_flags,
    python_module, scrape, total,
)  # fmt: skip

pytestmark = pytest.mark.vllm

NUM_WORKERS = 8


def cluster_up(model, run_dir, *args: str) -> tuple[list[str], str, list[str]]:
    """(command, base url, metrics urls: the attention server's, then each worker's)."""
    (http,) = free_ports(1)
    ports = free_worker_ports(NUM_WORKERS)
    cmd = python_module("cluster", "up", "--model", str(model), "--host", HOST, "--port", str(http),
                        *port_flags(ports), "--run-dir", str(run_dir), *args)  # fmt: skip
    metrics_base = ports["worker_metrics_base_port"]
    base_url = f"http://{HOST}:{http}"
    return cmd, base_url, [f"{base_url}/metrics"] + [f"http://{HOST}:{metrics_base + i}/metrics" for i in range(NUM_WORKERS)]


def complete(base_url: str) -> str:
    with openai_client(base_url, timeout=300) as client:
        model = client.models.list().data[0].id
        return client.completions.create(model=model, prompt="The weather today is", max_tokens=8, temperature=0).choices[0].text


def wait_serving(log: Path, launcher: subprocess.Popen, timeout_s: float = 900) -> None:
    """Until `up`, run in the foreground with its output in `log`, says it serves: its own probe of the attention
    server passed and it now restarts dead workers. The attention server answers a little before that (up to a
    probe's timeout and interval), and a worker lost in between fails the start, as it should."""
    deadline = time.monotonic() + timeout_s
    while b"Ctrl-C to stop." not in log.read_bytes():
        assert launcher.poll() is None, f"`up` exited ({launcher.returncode}): {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"`up` not serving after {timeout_s:.0f} s"
        time.sleep(0.5)


def family_of(pids) -> list[psutil.Process]:
    family = [psutil.Process(pid) for pid in pids]
    return family + [c for p in family for c in p.children(recursive=True)]


def running(family: list[psutil.Process]) -> list[int]:
    return [p.pid for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_ports_picked_before_any_is_bound_never_overlap():
    """A cluster's HTTP port and its workers' runs are picked before anything binds them: the
    same port handed out twice let a worker's metrics page answer as the attention server."""
    handed = free_ports(64)
    for _ in range(64):
        base = free_port_run(3 * NUM_WORKERS)
        handed += range(base, base + 3 * NUM_WORKERS)
    assert len(set(handed)) == len(handed)


def test_ports_that_clash_are_refused_naming_both_flags(tmp_path):
    spec = dict(model=tmp_path, num_workers=8, host=HOST, run_dir=tmp_path, worker_threads=1, tls_dir=None)
    ClusterSpec(**spec, http_port=50100, worker_base_port=50000, worker_metrics_base_port=50008)
    with pytest.raises(ValueError, match="port 50007 is both --port's and --worker-base-port's"):
        ClusterSpec(**spec, http_port=50007, worker_base_port=50000, worker_metrics_base_port=50008)
    with pytest.raises(ValueError, match="port 50010 is both --worker-metrics-base-port's and --worker-data-base-port's"):
        ClusterSpec(**spec, http_port=50100, worker_base_port=50000, worker_metrics_base_port=50008,
                    worker_data_base_port=50010)


def test_down_stops_a_cluster_that_up_runs_in_the_foreground(model_dir, tmp_path):
    """`make down` in one terminal against the `make up` of another: `down` takes the record, stops the attention
    server, then the workers, which that `up` stops as well, racing it. Both exit 0, `up` saying that `down` stopped
    it, and nothing is left running or recorded."""
    model, run_dir = model_dir("qwen3_moe"), tmp_path / "run"
    cmd, _, _ = cluster_up(model, run_dir, "--", *VLLM_CPU_ARGS, "--enforce-eager")
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        launcher = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_serving(log, launcher)
        family = family_of([launcher.pid])
        down = subprocess.run(python_module("cluster", "down", "--run-dir", str(run_dir)), capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert down.returncode == 0 and "Traceback" not in down.stderr, down.stderr
        assert launcher.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGINT)
            launcher.wait(timeout=120)
    assert "stopped by `down`" in log.read_text()
    deadline = time.monotonic() + 10
    while running(family) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not running(family), "a process outlived `down`"
    assert not list(run_dir.glob("cluster*.json")), "a record outlived `down`"


def test_detached_cluster_serves_until_down(model_dir, tmp_path):
    model, run_dir = model_dir("qwen3_moe"), tmp_path / "run"
    cmd, base_url, metrics = cluster_up(model, run_dir, "--detach", "--", *VLLM_CPU_ARGS, "--enforce-eager")
    up = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    pids = json.loads((run_dir / "cluster.json").read_text()) if (run_dir / "cluster.json").exists() else {}
    family = []
    try:
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-3000:]
        assert f"at {base_url}/v1 as model 'qwen3_moe-tiny-0'" in up.stdout
        assert f"metrics: {metrics[0]} (vLLM and hetero_moe_*), workers {metrics[1]} ... {metrics[-1]}" in up.stdout
        assert sorted(pids) == ["attention", *(f"worker-{i}" for i in range(NUM_WORKERS))]
        family = family_of(pids.values())
        ckpt = read_checkpoint(model)
        before = ClusterCounters.read(metrics[0], metrics[1:])
        assert complete(base_url), "still serving after `up --detach` returned"
        assert_workers_did_the_work(before, ClusterCounters.read(metrics[0], metrics[1:]), ckpt.top_k, ckpt.moe_layers,
                                    "reference")  # fmt: skip
    finally:
        down = subprocess.run(python_module("cluster", "down", "--run-dir", str(run_dir)),
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    assert down.returncode == 0
    assert not running(family), "survived `down`"
    assert not (run_dir / "cluster.json").exists()
    again = subprocess.run(python_module("cluster", "down", "--run-dir", str(run_dir)), capture_output=True, text=True)
    assert "no cluster recorded" in again.stdout


def test_w4a16_on_load_serves_restarts_dead_workers_and_stops_naming_one_that_cannot_return(model_dir, tmp_path):
    """`make up ARGS="--weight-format w4a16 --group-size 32 --expert-replicas 1"`: the workers quantize
    on load and run the int4 kernel. A killed worker is restarted by `up` and a request sent while it
    is gone stalls until it is back, then completes. A worker that cannot come back (its port taken)
    fails the step after --worker-loss-timeout naming it; the attention server exits and so does
    `up`, non-zero, leaving nothing."""
    model, run_dir = model_dir("qwen3_moe"), tmp_path / "run"
    cmd, base_url, metrics = cluster_up(model, run_dir, "--weight-format", "w4a16", "--group-size", "32",
                                        "--expert-replicas", "1", "--worker-loss-timeout", "20",
                                        "--", *VLLM_CPU_ARGS, "--enforce-eager")  # fmt: skip
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        launcher = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    port_taken = socket.socket()
    try:
        wait_serving(log, launcher)
        ckpt = read_checkpoint(model)
        before = ClusterCounters.read(metrics[0], metrics[1:])
        expected = complete(base_url)
        assert_workers_did_the_work(before, ClusterCounters.read(metrics[0], metrics[1:]), ckpt.top_k, ckpt.moe_layers, "cpu")
        for url in metrics[1:]:
            (shard,) = [dict(ls) for (n, ls) in scrape(url) if n == "hetero_moe_worker_shard_info"]
            assert shard["weight_format"] == "w4a16 int4 sym group 32", shard
        family = family_of([launcher.pid])

        os.killpg(json.loads((run_dir / "cluster.json").read_text())["worker-5"], signal.SIGKILL)
        start = time.monotonic()
        assert complete(base_url) == expected, "stalled until worker 5 was back, then the same tokens"
        stalled = time.monotonic() - start
        assert "restarting worker-5 (exit -9)" in log.read_text()
        assert total(scrape(metrics[0]), "hetero_moe_transport_rejoins_total", worker="5") == 1
        family += family_of([json.loads((run_dir / "cluster.json").read_text())["worker-5"]])

        grpc_port = int(cmd[cmd.index("--worker-base-port") + 1]) + 5
        victim = psutil.Process(json.loads((run_dir / "cluster.json").read_text())["worker-5"])
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(timeout=10)  # its port is free once it is gone; `up` restarts it, which loads for seconds
        port_taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the old connections' TIME_WAIT
        port_taken.bind((HOST, grpc_port))  # the restarted worker cannot bind it (no SO_REUSEPORT here) and exits
        port_taken.listen()
        with pytest.raises(openai.InternalServerError):
            complete(base_url)
        assert launcher.wait(timeout=120) == 1
    finally:
        port_taken.close()
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGINT)
            launcher.wait(timeout=120)
    text = log.read_text()
    assert "stopping: the attention server exited" in text
    assert f"expert worker 5 at {HOST}:{grpc_port}: UNAVAILABLE: lost" in text and "came back within 20 s" in text
    deadline = time.monotonic() + 10
    while running(family) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not running(family), "a process outlived the cluster"
    print(f"\nmake up, R = 1: a request stalled {stalled:.1f} s while worker 5 was restarted, then completed unchanged; "
          "a worker that could not return stopped the cluster, named")
