"""Expert workers dying under vLLM, with real processes and the `openai` client.

With two replicas (make up's default here): 16 clients streaming, one worker killed mid-stream and
later a second one holding other experts; every request completes with the tokens of a fault-free
run, and the restarted workers rejoin and get work again. With one replica: a worker that does not
come back within --worker-loss-timeout fails the steps waiting for it, naming it, and the attention
server turns unhealthy and exits (so that `make up`, compose or an orchestrator restarts it); also
when the worker dies under one micro-batch of a ping-pong step."""
from __future__ import annotations

import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from tests.support import GreedyStreams, compare, generate, scrape, start_attention, start_workers, total

pytestmark = pytest.mark.vllm

NUM_WORKERS = 8
STREAM_TOKENS = 96


def test_killed_workers_fail_over_to_replicas_under_streaming_load(model_dir, processes):
    model = model_dir("qwen3_moe")
    workers = start_workers(processes, model, NUM_WORKERS, tag="failover", replicas=2)
    base_url, client, model_id = start_attention(processes, "failover-attention", model, workers, "--dtype", "float32")
    reference = generate(base_url, STREAM_TOKENS)

    streams = GreedyStreams(client, model_id, STREAM_TOKENS)
    kills = []
    # Worker 3 holds shards 2 and 3, worker 6 shards 5 and 6, worker 1 shards 0 and 1: every
    # shard keeps a replica. Worker 1 hangs (SIGSTOP) once the deadlines follow the latency.
    for victim, after in ((3, 0.25), (6, 0.5), (1, 0.75)):
        deadline = time.monotonic() + 300
        while streams.streamed < after * len(streams.threads) * STREAM_TOKENS and time.monotonic() < deadline:
            time.sleep(0.01)
        if victim == 1:
            os.kill(workers.process(1).pid, signal.SIGSTOP)
            hung_at = time.monotonic()
            kills.append(f"worker 1 stopped at {streams.streamed}")
        else:
            workers.kill(victim)
            kills.append(f"worker {victim} killed at {streams.streamed} streamed tokens")
    answers = streams.join()
    after_hang = [t for t in sorted(streams.arrivals) if t >= hung_at]
    stall = max(b - a for a, b in zip(after_hang, after_hang[1:]))
    assert stall < 5, f"the hung worker cost {stall:.1f} s: more than one adaptive deadline (1 s here, timeout 60 s)"
    os.kill(workers.process(1).pid, signal.SIGCONT)

    report = compare(reference, answers, STREAM_TOKENS)
    samples = scrape(f"{base_url}/metrics")
    assert total(samples, "hetero_moe_transport_worker_up", worker="3") == 0
    assert total(samples, "hetero_moe_transport_failovers_total") > 0
    failed_over = total(samples, "hetero_moe_transport_failovers_total")

    assert total(samples, "hetero_moe_transport_errors_total", worker="1", cause="deadline") == 1

    for victim in (3, 6):
        workers.restart(victim)
    deadline = time.monotonic() + 60
    while any(total(scrape(f"{base_url}/metrics"), "hetero_moe_transport_worker_up", worker=w) != 1 for w in "136"):
        assert time.monotonic() < deadline, "the restarted and the resumed workers rejoin within 60 s"
        time.sleep(0.2)
    before = [total(scrape(workers.metrics_urls[w]), "hetero_moe_worker_requests_total", status="OK") for w in (1, 3, 6)]
    again = compare(reference, {i: g.tokens for i, g in enumerate(generate(base_url, STREAM_TOKENS))}, STREAM_TOKENS)
    after = [total(scrape(workers.metrics_urls[w]), "hetero_moe_worker_requests_total", status="OK") for w in (1, 3, 6)]
    assert all(b > a for a, b in zip(before, after)), f"workers 1, 3, 6 computed {before} -> {after}: not all again"
    samples = scrape(f"{base_url}/metrics")
    assert total(samples, "hetero_moe_transport_rejoins_total") == 3
    print(f"\n16 streaming clients x {STREAM_TOKENS} tokens, R = 2: {'; '.join(kills)}; every request completed, "
          f"{'all identical to the fault-free run' if not report else report}; {failed_over:.0f} slices failed over; "
          f"the stopped worker stalled the stream {stall:.2f} s; all three rejoined and computed again "
          f"({'identical' if not again else again})")


@pytest.mark.parametrize("pingpong", [1, 2])
def test_a_worker_that_stays_lost_fails_the_steps_naming_it_and_the_server_exits(model_dir, processes, pingpong):
    model = model_dir("qwen3_moe")
    workers = start_workers(processes, model, NUM_WORKERS, tag=f"lost-m{pingpong}")
    base_url, client, model_id = start_attention(
        processes, f"lost-m{pingpong}-attention", model, workers, "--worker-loss-timeout", "3",
        "--pingpong-microbatches", str(pingpong))  # fmt: skip
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
    workers.kill(3)
    killed = time.monotonic()
    request.join(timeout=120)
    assert not request.is_alive(), "the request hung"
    assert [type(f) for f in failures] == [openai.InternalServerError]
    assert time.monotonic() - killed >= 3, "the step waited --worker-loss-timeout for the worker to come back"
    attention = processes.procs[f"lost-m{pingpong}-attention"]
    attention.wait(timeout=60)  # vLLM's server stops once its engine is dead: an orchestrator restarts it
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"{base_url}/health", timeout=5)
    log = processes.log(f"lost-m{pingpong}-attention")
    assert (f"ExpertWorkerError: expert worker 3 at {workers.endpoints[3]}: UNAVAILABLE: lost, and no worker holding "
            "experts [6, 8) came back within 3 s") in log  # fmt: skip
    if pingpong > 1:  # raised in a micro-batch's thread and reported by the step
        assert re.search(r'pingpong\.py", line \d+, in run\n.*raise failed\[0\]\.error', log)
