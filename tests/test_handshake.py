"""An attention server pointed at the wrong workers refuses to start, naming the difference."""
from __future__ import annotations

import subprocess

import pytest

from tests.support import free_ports, python_module, start_workers

NUM_WORKERS = 4


@pytest.fixture(scope="module")
def qwen3_workers(model_dir, processes):
    return start_workers(processes, model_dir("qwen3_moe"), NUM_WORKERS, tag="hs-qwen3")


def attention_server(model, endpoints: list[str]) -> subprocess.CompletedProcess:
    cmd = python_module("attention_server", "--model", str(model), "--expert-endpoints", ",".join(endpoints),
                        "--worker-ready-timeout", "10", "--port", "1")  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_refuses_workers_of_another_checkpoint(model_dir, qwen3_workers):
    other = model_dir("qwen3_moe", seed=1)  # same architecture and shapes, other weights
    result = attention_server(other, qwen3_workers.endpoints)
    assert result.returncode == 2, result.stderr
    assert "refusing to start" in result.stderr
    assert "model fingerprint: worker has" in result.stderr
    assert "vllm" not in result.stderr.lower().split("refusing to start")[0], "refused before starting vLLM"


def test_refuses_workers_of_another_architecture(model_dir, qwen3_workers):
    result = attention_server(model_dir("mixtral"), qwen3_workers.endpoints)
    assert result.returncode == 2
    assert "model type: worker has qwen3_moe, expected mixtral" in result.stderr
    assert "number of experts: worker has 16, expected 8" in result.stderr


def test_refuses_swapped_shards(model_dir, qwen3_workers):
    e = qwen3_workers.endpoints
    result = attention_server(model_dir("qwen3_moe"), [e[1], e[0], *e[2:]])
    assert result.returncode == 2
    assert f"worker 0 at {e[1]}: worker index: worker has 1, expected 0" in result.stderr
    assert f"worker 0 at {e[1]}: expert ranges: worker has [(4, 8)], expected [(0, 4)]" in result.stderr


def test_refuses_a_different_worker_count(model_dir, qwen3_workers):
    result = attention_server(model_dir("qwen3_moe"), qwen3_workers.endpoints[:2])
    assert result.returncode == 2
    assert "number of workers: worker has 4, expected 2" in result.stderr


def test_refuses_an_unreachable_worker(model_dir, qwen3_workers):
    (dead,) = free_ports(1)
    result = attention_server(model_dir("qwen3_moe"), [*qwen3_workers.endpoints[:3], f"127.0.0.1:{dead}"])
    assert result.returncode == 2
    assert f"worker 3 at 127.0.0.1:{dead}: not reachable within 10 s" in result.stderr
