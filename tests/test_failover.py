"""Replicas and failover through the attention node's real transport (factory.connect_workers, as
vLLM's process builds it) and real worker processes, without vLLM: a lost, hung or replaced worker
changes no bit of any layer's output, and a restarted one comes back. The same with vLLM and
streaming clients: test_cluster_failover.py."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
import torch
from prometheus_client import REGISTRY

from attention_server.combine import combine
from attention_server.config import AttentionConfig
from attention_server.partition import partition
from attention_server.transport import factory
from attention_server.transport.base import ExpertTransport, ExpertWorkerError
from protos.checkpoint import read_checkpoint
from tests.support import Processes, scrape, start_workers, total

NUM_WORKERS = 4  # 16 experts: shard s = experts [4s, 4s + 4), held by workers s and s + 1 (mod 4) with R = 2


@pytest.fixture
def model(model_dir):
    return model_dir("qwen3_moe")


@pytest.fixture
def procs(tmp_path):
    procs = Processes(tmp_path)
    yield procs
    procs.stop()


def layer_outputs(transport: ExpertTransport, ckpt, steps: int = 3) -> list[torch.Tensor]:
    """Each MoE layer's combined output for a few routings of 16 tokens, in two micro-batches."""
    g = torch.Generator().manual_seed(0)
    outs = []
    for _ in range(steps):
        for layer in ckpt.moe_layers:
            plans = []
            for micro_batch in (0, 1):
                x = torch.randn(16, ckpt.hidden_size, generator=g).to(ckpt.dtype)
                weights, ids = torch.softmax(torch.randn(16, ckpt.num_experts, generator=g), -1).topk(ckpt.top_k, dim=-1)
                plans.append(partition(ids.to(torch.int32), weights, transport.placement.shard_table()))
                transport.send(layer, micro_batch, x, plans[-1])
            for micro_batch, plan in enumerate(plans):
                partials = transport.take(layer, micro_batch).wait()
                outs.append(combine(plan, partials, ckpt.hidden_size, torch.float32))
    return outs


def connect(workers, ckpt, plane: str = "auto", replicas: int = 2, timeout_s: float = 30,
            loss_timeout_s: float = 30) -> ExpertTransport:  # fmt: skip
    cfg = AttentionConfig(tuple(workers.endpoints), timeout_s, plane, expert_replicas=replicas,
                          worker_loss_timeout_s=loss_timeout_s, tls_dir=workers.tls_dir)  # fmt: skip
    return factory.connect_workers(cfg, ckpt)[0]


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"output {i} differs by up to {(a - b).abs().max().item():g}"


def wait_until(condition, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what} within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - start


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def failovers_to(*workers: int) -> float:
    return sum(metric("hetero_moe_transport_failovers_total", worker=str(w)) for w in workers)


def computed(workers, i: int) -> float:
    return total(scrape(workers.metrics_urls[i]), "hetero_moe_worker_requests_total", status="OK")


@pytest.mark.parametrize("plane", ["shm", "tcp", "grpc"])
def test_killed_workers_fail_over_to_replicas_and_rejoin_when_restarted(model, procs, plane):
    ckpt = read_checkpoint(model)
    workers = start_workers(procs, model, NUM_WORKERS, tag=f"fo-{plane}", replicas=2)
    transport = connect(workers, ckpt, plane)
    try:
        want = layer_outputs(transport, ckpt)
        assert all(computed(workers, w) > 0 for w in range(NUM_WORKERS)), "every replica got work"
        failovers = failovers_to(0, 2)
        workers.kill(1)  # holds shards 0 and 1
        assert_same(layer_outputs(transport, ckpt), want)
        assert sorted(transport.down) == [1]
        assert metric("hetero_moe_transport_worker_up", worker="1") == 0
        assert failovers_to(0, 2) > failovers, "workers 0 and 2, the other replicas of shards 0 and 1, took them"
        workers.kill(3)  # holds shards 2 and 3: every shard still has one replica, on worker 0 or 2
        assert_same(layer_outputs(transport, ckpt), want)
        assert sorted(transport.down) == [1, 3]
        for w in (1, 3):
            workers.restart(w)
        waited = wait_until(lambda: not transport.down, 30, "the restarted workers rejoin")
        assert_same(layer_outputs(transport, ckpt), want)
        assert computed(workers, 1) > 0 and computed(workers, 3) > 0, "the restarted workers get work again"
        assert metric("hetero_moe_transport_rejoins_total", worker="3") >= 1
        assert metric("hetero_moe_transport_worker_up", worker="1") == 1
        print(f"\n{plane}: two workers killed, outputs unchanged; rejoined {waited:.1f} s after the restarts")
    finally:
        transport.close()


def test_a_hung_worker_costs_one_adaptive_deadline_then_its_replica_answers(model, procs):
    """The request timeout is 30 s; once the workers have answered for a while, their deadlines
    follow their latency (10 x p99, at least 1 s), and a SIGSTOPped worker stalls the layers
    about a second in all."""
    ckpt = read_checkpoint(model)
    workers = start_workers(procs, model, NUM_WORKERS, tag="fo-hung", replicas=2)
    transport = connect(workers, ckpt, timeout_s=30)
    try:
        want = layer_outputs(transport, ckpt, steps=10)[:8]  # 80 round trips per worker: deadlines set
        assert [metric("hetero_moe_transport_deadline_seconds", worker=str(w)) for w in range(NUM_WORKERS)] == [1.0] * 4
        hung = workers.process(2).pid
        os.kill(hung, signal.SIGSTOP)
        start = time.monotonic()
        got = layer_outputs(transport, ckpt, steps=1)
        stalled = time.monotonic() - start
        assert_same(got, want)
        assert sorted(transport.down) == [2] and "DEADLINE: no answer within 1 s" in str(transport.down[2])
        assert stalled < 3.0, f"one 1 s deadline, not the 30 s timeout nor one per request: stalled {stalled:.1f} s"
        assert metric("hetero_moe_transport_errors_total", worker="2", cause="deadline") == 1
        os.kill(hung, signal.SIGCONT)
        wait_until(lambda: not transport.down, 30, "the resumed worker rejoins")
        assert metric("hetero_moe_transport_deadline_seconds", worker="2") == 30, "a rejoined worker starts afresh"
        print(f"\nSIGSTOP of worker 2: the layers stalled {stalled:.2f} s in all (adaptive deadline 1 s, timeout 30 s)")
    finally:
        transport.close()


def test_with_one_replica_a_lost_worker_stalls_the_layer_until_it_is_back(model, procs):
    ckpt = read_checkpoint(model)
    workers = start_workers(procs, model, NUM_WORKERS, tag="fo-r1", replicas=1)
    transport = connect(workers, ckpt, replicas=1, loss_timeout_s=60)
    try:
        want = layer_outputs(transport, ckpt, steps=1)
        workers.kill(2)
        restart = threading.Timer(1.0, workers.restart, args=(2,))
        restart.start()
        start = time.monotonic()
        got = layer_outputs(transport, ckpt, steps=1)
        stalled = time.monotonic() - start
        restart.join()
        assert_same(got, want)
        assert not transport.down
        print(f"\nR = 1, worker 2 killed and restarted: the layer stalled {stalled:.1f} s, then the same outputs")
    finally:
        transport.close()


def test_with_one_replica_a_worker_that_stays_lost_fails_the_layer_naming_it(model, procs):
    ckpt = read_checkpoint(model)
    workers = start_workers(procs, model, NUM_WORKERS, tag="fo-lost", replicas=1)
    transport = connect(workers, ckpt, replicas=1, loss_timeout_s=2)
    try:
        layer_outputs(transport, ckpt, steps=1)
        workers.kill(2)
        start = time.monotonic()
        with pytest.raises(ExpertWorkerError, match=rf"expert worker 2 at {workers.endpoints[2]}: UNAVAILABLE: lost, and "
                                                    r"no worker holding experts \[8, 12\) came back within 2 s"):
            layer_outputs(transport, ckpt, steps=1)
        assert 2 <= time.monotonic() - start < 10
    finally:
        transport.close()


def test_a_worker_back_with_another_checkpoint_stays_out_and_the_log_says_why(model, model_dir, procs, caplog):
    ckpt = read_checkpoint(model)
    workers = start_workers(procs, model, NUM_WORKERS, tag="fo-other", replicas=2)
    transport = connect(workers, ckpt)
    try:
        want = layer_outputs(transport, ckpt, steps=1)
        workers.kill(1)
        with caplog.at_level(logging.ERROR, logger="attention_server.transport.rejoin"):
            workers.restart(1, model=model_dir("qwen3_moe", seed=1))
            assert_same(layer_outputs(transport, ckpt, steps=1), want)  # finds worker 1's connection lost
            wait_until(lambda: "stays out" in caplog.text, 30, "the refusal is logged")
            time.sleep(2)  # the watcher keeps asking it, every 0.5 s
            assert_same(layer_outputs(transport, ckpt, steps=1), want)
        assert sorted(transport.down) == [1]
        assert f"expert worker 1 at {workers.endpoints[1]} is serving again but stays out: model fingerprint" in caplog.text
        assert caplog.text.count("stays out") == 1, "said once, not every half second"
        assert computed(workers, 1) == 0, "the stranger got no work"
    finally:
        transport.close()
