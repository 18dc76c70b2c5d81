"""What a dead expert worker does today, as the README states it: the next request gets HTTP 500,
the log names the worker and the cause, and vLLM's engine stays dead."""
from __future__ import annotations

import os
import signal

import openai
import pytest
from openai import OpenAI

from cluster.launcher import wait_http_ready
from tests.support import HOST, VLLM_CPU_ARGS, free_ports, python_module, start_workers

pytestmark = pytest.mark.vllm

NUM_WORKERS = 8


def test_a_killed_worker_fails_the_next_request_naming_it(model_dir, tmp_path, processes):
    model = model_dir("qwen3_moe")
    workers = start_workers(processes, model, NUM_WORKERS, tag="dead")
    (http,) = free_ports(1)
    attention = processes.start("dead-attention", python_module(
        "attention_server", "--model", str(model), "--expert-endpoints", ",".join(workers.endpoints),
        "--host", HOST, "--port", str(http), *VLLM_CPU_ARGS, "--enforce-eager"))  # fmt: skip
    base_url = f"http://{HOST}:{http}"
    wait_http_ready(base_url, [attention], timeout_s=900)
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    model_id = client.models.list().data[0].id
    assert client.completions.create(model=model_id, prompt="Hello", max_tokens=4, temperature=0).choices[0].text

    os.killpg(processes.procs["dead-worker-3"].pid, signal.SIGKILL)
    processes.procs["dead-worker-3"].wait()
    # Routing spreads 8 tokens x top-4 over all 8 workers: some pair lands on worker 3.
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model=model_id, prompt="The weather today is a fine", max_tokens=8, temperature=0)
    log = processes.log("dead-attention")
    assert f"ExpertWorkerError: expert worker 3 at {workers.endpoints[3]}: UNAVAILABLE" in log
    with pytest.raises((openai.InternalServerError, openai.APIConnectionError)):
        client.completions.create(model=model_id, prompt="Hello", max_tokens=4, temperature=0)
