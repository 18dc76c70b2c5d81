"""`make up ARGS=--detach` / `make down`: a detached cluster serves, and `down` stops all of it."""
from __future__ import annotations

import json
import subprocess
import urllib.request

import psutil
import pytest

from tests.support import HOST, VLLM_CPU_ARGS, free_ports, python_module

pytestmark = pytest.mark.vllm


def test_detached_cluster_serves_until_down(model_dir, tmp_path):
    http, worker_base = free_ports(2)
    run_dir = tmp_path / "run"
    up = subprocess.run(
        python_module("cluster", "up", "--detach", "--model", str(model_dir("qwen3_moe")), "--host", HOST,
                      "--port", str(http), "--worker-base-port", str(worker_base), "--run-dir", str(run_dir),
                      "--", *VLLM_CPU_ARGS, "--enforce-eager"),
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    pids = json.loads((run_dir / "cluster.json").read_text()) if (run_dir / "cluster.json").exists() else {}
    try:
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-3000:]
        assert f"at http://{HOST}:{http}/v1 as model 'qwen3_moe-tiny-0'" in up.stdout
        assert sorted(pids) == ["attention", *(f"worker-{i}" for i in range(8))]
        with urllib.request.urlopen(f"http://{HOST}:{http}/health", timeout=5) as r:
            assert r.status == 200, "still serving after `up --detach` returned"
        family = [psutil.Process(pid) for pid in pids.values()]
        family += [c for p in family for c in p.children(recursive=True)]
    finally:
        down = subprocess.run(python_module("cluster", "down", "--run-dir", str(run_dir)),
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    assert down.returncode == 0
    assert not [p.pid for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], "survived `down`"
    assert not (run_dir / "cluster.json").exists()
    again = subprocess.run(python_module("cluster", "down", "--run-dir", str(run_dir)), capture_output=True, text=True)
    assert "no detached cluster recorded" in again.stdout
