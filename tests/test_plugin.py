"""The plugin inside vLLM: default-off is stock vLLM; on, pool A holds no routed expert."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import start_workers

pytestmark = pytest.mark.vllm

PROBE = Path(__file__).with_name("vllm_probe.py")


def probe(model: Path, endpoints: list[str] | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_MOE_")}
    if endpoints:
        env["HETERO_MOE_EXPERT_ENDPOINTS"] = ",".join(endpoints)
    result = subprocess.run([sys.executable, str(PROBE), str(model)], capture_output=True, text=True, env=env, timeout=900)
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("PROBE ")), None)
    assert result.returncode == 0 and line, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(line.removeprefix("PROBE "))


@pytest.fixture(scope="module")
def qwen2(model_dir):
    return model_dir("qwen2_moe")  # routed and shared experts


@pytest.fixture(scope="module")
def stock(qwen2):
    return probe(qwen2, None)


def test_plugin_off_is_stock_vllm(stock):
    assert stock["routed_classes"] == ["vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts"]
    assert stock["routed_expert_params"] > 0
    # register() ran (the entry point is installed) and imported nothing else.
    assert stock["plugin_modules"] == ["attention_server", "attention_server.config", "attention_server.plugin"]


def test_plugin_on_holds_no_routed_expert_parameter(qwen2, stock, processes):
    workers = start_workers(processes, qwen2, 8, tag="plugin-qwen2")
    on = probe(qwen2, workers.endpoints)
    assert on["routed_classes"] == ["attention_server.routed_experts.RemoteRoutedExperts"]
    assert on["num_routed_layers"] == stock["num_routed_layers"] > 0
    assert on["routed_expert_params"] == 0
    assert on["total_params"] == stock["total_params"] - stock["routed_expert_params"]
    assert len(on["tokens"]) == 8, "generated through the workers"
