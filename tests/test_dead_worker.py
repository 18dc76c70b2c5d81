"""What a dead expert worker does today, as the README states it: the requests in flight get HTTP
500, the log names the worker and the cause, and vLLM's engine stays dead. Also when the worker
dies under one micro-batch of a ping-pong step: the step fails the same way, without waiting on
the micro-batches that are left."""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import openai
import pytest
from openai import OpenAI

from cluster.launcher import wait_http_ready
from tests.support import HOST, VLLM_CPU_ARGS, free_ports, python_module, scrape, start_workers, total

pytestmark = pytest.mark.vllm

NUM_WORKERS = 8


@pytest.mark.parametrize("pingpong", [1, 2])
def test_a_killed_worker_fails_the_requests_in_flight_naming_it(model_dir, tmp_path, processes, pingpong):
    model = model_dir("qwen3_moe")
    workers = start_workers(processes, model, NUM_WORKERS, tag=f"dead-m{pingpong}")
    (http,) = free_ports(1)
    attention = processes.start(f"dead-m{pingpong}-attention", python_module(
        "attention_server", "--model", str(model), "--expert-endpoints", ",".join(workers.endpoints),
        "--pingpong-microbatches", str(pingpong), "--host", HOST, "--port", str(http), *VLLM_CPU_ARGS,
        "--enforce-eager"))  # fmt: skip
    base_url = f"http://{HOST}:{http}"
    wait_http_ready(base_url, [attention], timeout_s=900)
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    model_id = client.models.list().data[0].id
    assert client.completions.create(model=model_id, prompt="Hello", max_tokens=4, temperature=0).choices[0].text

    # Two requests decoding, so that with ping-pong every step runs as two micro-batches; each
    # step routes 2 tokens x top-4 over the 8 workers, and soon one pair lands on worker 3.
    failures: list[Exception] = []

    def decode() -> None:
        try:
            client.completions.create(model=model_id, prompt=["The weather today is", "Once upon a time"],
                                      max_tokens=900, temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        except openai.APIError as err:
            failures.append(err)

    request = threading.Thread(target=decode)
    request.start()
    deadline = time.monotonic() + 60
    while total(scrape(f"{base_url}/metrics"), "vllm:num_requests_running") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    victim = processes.procs[f"dead-m{pingpong}-worker-3"]
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    request.join(timeout=120)
    assert not request.is_alive(), "the request hung"
    assert [type(f) for f in failures] == [openai.InternalServerError]
    log = processes.log(f"dead-m{pingpong}-attention")
    assert f"ExpertWorkerError: expert worker 3 at {workers.endpoints[3]}: UNAVAILABLE" in log
    if pingpong > 1:  # raised in a micro-batch's thread and reported by the step
        assert re.search(r'pingpong\.py", line \d+, in run\n.*raise failed\[0\]\.error', log)
    with pytest.raises((openai.InternalServerError, openai.APIConnectionError)):
        client.completions.create(model=model_id, prompt="Hello", max_tokens=4, temperature=0)
