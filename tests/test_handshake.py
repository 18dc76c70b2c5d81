"""An attention server pointed at the wrong workers refuses to start, naming the difference,
before vLLM starts (vLLM itself logs nothing: neither its banner nor its import-time lines)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from protos import PROTOCOL_VERSION
from tests.support import HOST, Processes, free_ports, python_module, start_workers, wait_serving

NUM_WORKERS = 4


@pytest.fixture(scope="module")
def qwen3_workers(model_dir, processes):
    return start_workers(processes, model_dir("qwen3_moe"), NUM_WORKERS, tag="hs-qwen3")


def attention_server(model, endpoints: list[str], tls_dir: Path) -> subprocess.CompletedProcess:
    cmd = python_module("attention_server", "--model", str(model), "--expert-endpoints", ",".join(endpoints),
                        "--tls-dir", str(tls_dir), "--worker-ready-timeout", "10", "--port", "1")  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def assert_refused(result: subprocess.CompletedProcess, *reasons: str) -> None:
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "refusing to start" in result.stderr
    for reason in reasons:
        assert reason in result.stderr, result.stderr
    assert "vllm" not in (result.stdout + result.stderr).lower(), "refused before vLLM was imported or started"


def edited_copy(model: Path, out: Path, **config) -> Path:
    """The checkpoint with its config.json changed (tensors linked, not copied)."""
    out.mkdir()
    for f in model.iterdir():
        (out / f.name).symlink_to(f)
    (out / "config.json").unlink()
    (out / "config.json").write_text(json.dumps(json.loads((model / "config.json").read_text()) | config))
    return out


def test_refuses_workers_of_another_checkpoint(model_dir, qwen3_workers):
    other = model_dir("qwen3_moe", seed=1)  # same architecture and shapes, other weights
    assert_refused(attention_server(other, qwen3_workers.endpoints, qwen3_workers.tls_dir), "model fingerprint: worker has")


def test_refuses_workers_of_another_architecture(model_dir, qwen3_workers):
    assert_refused(
        attention_server(model_dir("mixtral"), qwen3_workers.endpoints, qwen3_workers.tls_dir),
        "model type: worker has qwen3_moe, expected mixtral",
        "number of experts: worker has 16, expected 8",
    )


def test_refuses_another_hidden_size(model_dir, qwen3_workers, tmp_path):
    wider = edited_copy(model_dir("qwen3_moe"), tmp_path / "wider", hidden_size=256)
    assert_refused(attention_server(wider, qwen3_workers.endpoints, qwen3_workers.tls_dir), "hidden size: worker has 128, expected 256")


def test_refuses_another_activation_dtype(model_dir, qwen3_workers, tmp_path):
    fp16 = edited_copy(model_dir("qwen3_moe"), tmp_path / "fp16", dtype="float16", torch_dtype="float16")
    assert_refused(
        attention_server(fp16, qwen3_workers.endpoints, qwen3_workers.tls_dir), "activation dtype: worker has BFLOAT16, expected torch.float16"
    )


def test_refuses_a_worker_of_another_protocol_version(model_dir, qwen3_workers, tmp_path):
    """A real worker process of a future wire version (its PROTOCOL_VERSION raised before it starts)."""
    model = model_dir("qwen3_moe")
    (port,) = free_ports(1)
    future = ("import runpy, sys, protos; protos.PROTOCOL_VERSION += 1; sys.argv[0] = 'expert_server'; "
              "runpy.run_module('expert_server', run_name='__main__')")  # fmt: skip
    procs = Processes(tmp_path)
    try:
        proc = procs.start("future", [sys.executable, "-c", future, "--model", str(model), "--worker-index", "3",
                                      "--num-workers", str(NUM_WORKERS), "--host", HOST, "--port", str(port),
                                      *qwen3_workers.tls_flags])  # fmt: skip
        wait_serving(f"{HOST}:{port}", proc, qwen3_workers.security)
        result = attention_server(model, [*qwen3_workers.endpoints[:3], f"{HOST}:{port}"], qwen3_workers.tls_dir)
    finally:
        procs.stop()
    assert_refused(result, f"worker 3 at {HOST}:{port}: protocol version: worker has {PROTOCOL_VERSION + 1}, expected {PROTOCOL_VERSION}")


def test_refuses_swapped_shards(model_dir, qwen3_workers):
    e = qwen3_workers.endpoints
    assert_refused(
        attention_server(model_dir("qwen3_moe"), [e[1], e[0], *e[2:]], qwen3_workers.tls_dir),
        f"worker 0 at {e[1]}: worker index: worker has 1, expected 0",
        f"worker 0 at {e[1]}: expert ranges: worker has [(4, 8)], expected [(0, 4)]",
    )


def test_refuses_a_different_worker_count(model_dir, qwen3_workers):
    assert_refused(
        attention_server(model_dir("qwen3_moe"), qwen3_workers.endpoints[:2], qwen3_workers.tls_dir), "number of workers: worker has 4, expected 2"
    )


def test_refuses_an_unreachable_worker(model_dir, qwen3_workers):
    (dead,) = free_ports(1)
    assert_refused(
        attention_server(model_dir("qwen3_moe"), [*qwen3_workers.endpoints[:3], f"127.0.0.1:{dead}"], qwen3_workers.tls_dir),
        f"worker 3 at 127.0.0.1:{dead}: not reachable within 10 s",
    )
