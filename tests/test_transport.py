"""The transport seam against real worker processes: every data plane computes what the unary
protobuf Forward computes, refuses bad frames by name, and turns a dead or stopped worker into
ExpertWorkerError instead of a hang; shared memory leaves nothing behind after a kill -9."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from attention_server.combine import combine
from attention_server.handshake import fetch_info
from attention_server.partition import partition
from attention_server.transport.base import Cause, ExpertTransport, ExpertWorkerError
from attention_server.transport.factory import PlaneUnavailable, open_channel
from protos import PROTOCOL_VERSION, codec, frames
from protos import expert_pb2 as pb
from protos import expert_pb2_grpc as pb_grpc
from protos.checkpoint import read_checkpoint
from protos.placement import Placement
from expert_server.config import BENCHMARK_ENV
from tests.support import HOST, Processes, python_module, scrape, start_workers, total
from tests.test_expert_server import request_for

NUM_WORKERS = 2
PLANES = ("shm", "tcp", "grpc")


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir("qwen3_moe")


@pytest.fixture(scope="module")
def workers(model, processes):
    return start_workers(processes, model, NUM_WORKERS, tag="transport")


@pytest.fixture(scope="module")
def infos(workers):
    return [fetch_info(w, e, 10, workers.security) for w, e in enumerate(workers.endpoints)]


def transport_for(workers, infos, plane: str, timeout_s: float = 30) -> ExpertTransport:
    """One replica per shard, and a lost worker fails the layer at once (failover: test_failover.py)."""
    return ExpertTransport([open_channel(w, e, info, plane, timeout_s, workers.security)
                            for w, (e, info) in enumerate(zip(workers.endpoints, infos))],
                           Placement(infos[0].num_experts, len(infos)), loss_timeout_s=0)  # fmt: skip


def routing(ckpt, num_tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, ckpt.hidden_size, generator=g).to(torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(num_tokens, ckpt.num_experts, generator=g), -1).topk(ckpt.top_k, dim=-1)
    return x, partition(ids.to(torch.int32), weights, Placement(ckpt.num_experts, NUM_WORKERS).shard_table())


def unary_partials(workers, layer, x, plan) -> list[torch.Tensor]:
    """The same work through the unary protobuf Forward: the reference every plane must equal."""
    partials = []
    for part in plan.slices:
        with workers.security.channel(workers.endpoints[part.shard]) as channel:
            request = request_for(layer, x[part.rows], part.pair_rows, part.pair_experts, part.pair_weights)
            partials.append(codec.decode(pb_grpc.ExpertServiceStub(channel).Forward(request, timeout=30).partial))
    return partials


def test_workers_advertise_their_planes(infos):
    for info in infos:
        assert {p.kind for p in info.data_planes} == {"tcp", "shm"}
        assert info.protocol_version == PROTOCOL_VERSION


@pytest.mark.parametrize("plane", PLANES)
def test_every_plane_computes_what_unary_forward_computes(model, workers, infos, plane):
    """Bitwise, with three micro-batches in flight at once and collected out of order."""
    ckpt = read_checkpoint(model)
    layer = ckpt.moe_layers[2]
    batches = [routing(ckpt, num_tokens, seed) for seed, num_tokens in enumerate((1, 37, 300))]
    transport = transport_for(workers, infos, plane)
    try:
        assert {c.plane for c in transport.channels} == {plane}
        for micro_batch, (x, plan) in enumerate(batches):
            transport.send(layer, micro_batch, x, plan)
        for micro_batch in (2, 0, 1):
            x, plan = batches[micro_batch]
            got = transport.take(layer, micro_batch).wait()
            want = unary_partials(workers, layer, x, plan)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), f"{plane}, micro-batch {micro_batch}"
            assert torch.equal(combine(plan, got, ckpt.hidden_size, torch.float32),
                               combine(plan, want, ckpt.hidden_size, torch.float32))  # fmt: skip
    finally:
        transport.close()


@pytest.mark.parametrize("plane", PLANES)
def test_payloads_grow_while_earlier_partials_are_held(model, workers, infos, plane):
    """Decode, then prefill-sized micro-batches on the same slot while the caller still holds the
    earlier partials (views into the plane's buffers, valid until that slot's next send): the
    buffers grow by replacement and every answer is right."""
    ckpt = read_checkpoint(model)
    layer = ckpt.moe_layers[0]
    transport = transport_for(workers, infos, plane)
    try:
        held = []
        for num_tokens in (1, 64, 2048):
            x, plan = routing(ckpt, num_tokens, seed=num_tokens)
            transport.send(layer, 0, x, plan)
            held.append(transport.take(layer, 0).wait())
            want = unary_partials(workers, layer, x, plan)
            assert all(torch.equal(g, w) for g, w in zip(held[-1], want)), num_tokens
    finally:
        transport.close()


@pytest.mark.parametrize("plane", PLANES)
def test_a_bad_request_is_refused_by_name_and_the_plane_keeps_serving(model, workers, infos, plane):
    ckpt = read_checkpoint(model)
    x, plan = routing(ckpt, 5, seed=3)
    transport = transport_for(workers, infos, plane)
    try:
        transport.send(ckpt.num_hidden_layers + 7, 0, x, plan)  # no such MoE layer
        with pytest.raises(ExpertWorkerError, match="INVALID_ARGUMENT: RequestError: layer .* is not a MoE layer") as err:
            transport.take(ckpt.num_hidden_layers + 7, 0).wait()
        assert err.value.cause == Cause.REFUSED
        transport.send(ckpt.moe_layers[0], 0, x, plan)
        assert len(transport.take(ckpt.moe_layers[0], 0).wait()) == len(plan.slices), "still serving"
    finally:
        transport.close()


def test_shared_memory_answers_the_common_frame_in_c_with_the_same_bits(model, workers, infos):
    """A slot's first frame brings its segment and is answered in Python; the next ones are
    answered by the worker's C loop (kernels/csrc/shm_serve.c). Both give unary Forward's bits,
    the request metrics count every request once, and a frame the loop does not take is still
    refused by name, after which the loop serves again."""
    ckpt = read_checkpoint(model)
    layer = ckpt.moe_layers[1]
    batches = [routing(ckpt, num_tokens, seed) for seed, num_tokens in enumerate((1, 37), start=10)]
    wants = [unary_partials(workers, layer, x, plan) for x, plan in batches]
    requests = sum(len(plan.slices) for _, plan in batches)

    def counted() -> tuple[float, float]:
        scrapes = [scrape(url) for url in workers.metrics_urls]
        return (sum(total(s, "hetero_moe_worker_requests_total", status="OK") for s in scrapes),
                sum(total(s, "hetero_moe_worker_native_requests_total") for s in scrapes))  # fmt: skip

    transport = transport_for(workers, infos, "shm")
    try:
        ok_before, native_before = counted()
        for round in range(3):
            for micro_batch, ((x, plan), want) in enumerate(zip(batches, wants)):
                transport.send(layer, micro_batch, x, plan)
                got = transport.take(layer, micro_batch).wait()
                assert all(torch.equal(g, w) for g, w in zip(got, want)), f"round {round}, micro-batch {micro_batch}"
        ok_after, native_after = counted()
        assert ok_after - ok_before == 3 * requests
        assert native_after - native_before == 2 * requests, "the rounds after the first are answered in C"

        x, plan = batches[1]
        transport.send(ckpt.num_hidden_layers + 7, 1, x, plan)  # no such MoE layer: the loop hands it to Python
        with pytest.raises(ExpertWorkerError, match="INVALID_ARGUMENT: RequestError: layer .* is not a MoE layer"):
            transport.take(ckpt.num_hidden_layers + 7, 1).wait()
        transport.send(layer, 1, x, plan)
        assert all(torch.equal(g, w) for g, w in zip(transport.take(layer, 1).wait(), wants[1]))
        assert counted()[1] - native_after == len(plan.slices)
    finally:
        transport.close()


def test_a_frame_that_is_not_one_is_refused_with_a_reason(workers, infos):
    """Garbage on the TCP plane and over the gRPC frame stream: INVALID_ARGUMENT naming the problem."""
    tcp_port = next(p.port for p in infos[0].data_planes if p.kind == "tcp")
    with workers.security.wrap_client(socket.create_connection((HOST, tcp_port), timeout=10), HOST) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n" + bytes(frames.HEADER.size))
        header, payload = frames.recv_frame(sock, frames.ReceiveBuffer())
    assert header.kind == frames.Kind.ERROR and frames.status_name(header.status) == "INVALID_ARGUMENT"
    assert "not a hetero-moe frame" in bytes(payload).decode()

    with workers.security.channel(workers.endpoints[0]) as channel:
        call = channel.stream_stream(frames.GRPC_METHOD)
        (reply,) = list(call(iter([frames.Header(frames.Kind.FORWARD, 1, rows=1, hidden=4, dtype=99, payload=8).pack()
                                   + bytes(8)]), timeout=10))  # fmt: skip
        header = frames.Header.unpack(reply[: frames.HEADER.size])
    assert header.kind == frames.Kind.ERROR and "unknown wire dtype 99" in reply[frames.HEADER.size :].decode()


def test_unary_forward_that_does_not_parse_is_invalid_argument(workers):
    with workers.security.channel(workers.endpoints[0]) as channel:
        forward = channel.unary_unary("/hetero_moe.expert.v2.ExpertService/Forward")  # raw bytes
        with pytest.raises(grpc.RpcError) as err:
            forward(b"\xff\xff\xff not protobuf", timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ForwardRequest does not parse" in err.value.details()


def test_auto_picks_shared_memory_here_and_falls_back_without_it(workers, infos):
    tcp_only = pb.InfoResponse()
    tcp_only.CopyFrom(infos[0])
    del tcp_only.data_planes[:]
    tcp_only.data_planes.append(next(p for p in infos[0].data_planes if p.kind == "tcp"))
    other_host = pb.InfoResponse()
    other_host.CopyFrom(infos[0])
    for p in other_host.data_planes:
        p.host_id = "another-host"
    assert open_channel(0, workers.endpoints[0], infos[0], "auto", 10, workers.security).plane == "shm"
    assert open_channel(0, workers.endpoints[0], other_host, "auto", 10, workers.security).plane == "tcp"
    assert open_channel(0, workers.endpoints[0], tcp_only, "auto", 10, workers.security).plane == "tcp"
    assert open_channel(0, workers.endpoints[0], pb.InfoResponse(), "auto", 10, workers.security).plane == "grpc"
    with pytest.raises(PlaneUnavailable, match="offers no shared memory"):
        open_channel(0, workers.endpoints[0], other_host, "shm", 10, workers.security)
    with pytest.raises(PlaneUnavailable, match="offers no TCP data plane"):
        open_channel(0, workers.endpoints[0], pb.InfoResponse(), "tcp", 10, workers.security)


def stop(pid: int, timeout_s: float = 10) -> None:
    """SIGSTOP, and wait until every thread has stopped. A process stops thread by thread: until
    the thread the kernel picked runs, the others keep going, and a SCHED_BATCH worker's may
    answer a frame sent meanwhile."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rpartition(")")[2].split()[0])
            except FileNotFoundError:  # a thread that ended meanwhile
                pass
        if states and all(state in "tT" for state in states):
            return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} did not stop within {timeout_s} s")


def memfd_mappings(pid: int) -> list[str]:
    return [ln for ln in Path(f"/proc/{pid}/maps").read_text().splitlines() if "memfd:hetero-moe" in ln]


@pytest.mark.parametrize("plane", PLANES)
def test_a_killed_worker_is_a_named_error_not_a_hang(model, plane, tmp_path):
    """kill -9 a worker while it holds a request (stopped first, so that it cannot answer before it
    dies): the wait ends in ExpertWorkerError UNAVAILABLE; with shared memory, nothing of it is left
    on either side or in /dev/shm."""
    ckpt = read_checkpoint(model)
    procs = Processes(tmp_path)
    try:
        workers = start_workers(procs, model, NUM_WORKERS, tag=f"kill-{plane}")
        infos = [fetch_info(w, e, 10, workers.security) for w, e in enumerate(workers.endpoints)]
        transport = transport_for(workers, infos, plane)
        x, plan = routing(ckpt, 64, seed=5)
        transport.send(ckpt.moe_layers[0], 0, x, plan)  # connects and maps the segments
        transport.take(ckpt.moe_layers[0], 0).wait()
        survivor, victim = (procs.procs[f"kill-{plane}-worker-{i}"].pid for i in range(2))
        assert bool(memfd_mappings(os.getpid())) == bool(memfd_mappings(survivor)) == (plane == "shm")
        stop(victim)
        transport.send(ckpt.moe_layers[0], 0, x, plan)
        time.sleep(0.2)
        os.kill(victim, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(ExpertWorkerError, match=f"expert worker 1 at {workers.endpoints[1]}: UNAVAILABLE") as err:
            transport.take(ckpt.moe_layers[0], 0).wait()
        assert err.value.cause == Cause.UNAVAILABLE and time.monotonic() - start < 10
        transport.close()
        del err  # its traceback holds worker 0's partial, a view into the segment
        deadline = time.monotonic() + 10
        while (memfd_mappings(os.getpid()) or memfd_mappings(survivor)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not memfd_mappings(os.getpid()), "the client unmapped its segments"
        assert not memfd_mappings(survivor), "the surviving worker let go of the closed client's segments"
    finally:
        procs.stop()
    assert not [name for name in os.listdir("/dev/shm") if "hetero" in name], "nothing named in /dev/shm"


def test_a_killed_client_leaves_no_segment_in_the_worker(model, workers, tmp_path):
    client = """
import sys, time, numpy, torch
from attention_server.handshake import fetch_info
from attention_server.partition import partition
from attention_server.transport.factory import open_channel
from pathlib import Path
from protos.security import Security
security = Security.load(Path(sys.argv[2]), "attention")
info = fetch_info(0, sys.argv[1], 10, security)
channel = open_channel(0, sys.argv[1], info, "shm", 10, security)
x = torch.zeros(3, info.hidden_size, dtype=torch.bfloat16)
plan = partition(torch.zeros(3, 1, dtype=torch.int32), torch.ones(3, 1), numpy.zeros(info.num_experts, dtype=numpy.int64))
channel.receive(channel.send(info.moe_layers[0], 0, x, plan.slices[0]))
print("sent", flush=True)
time.sleep(600)
"""
    worker_pid = workers.procs.procs["transport-worker-0"].pid
    before = len(memfd_mappings(worker_pid))
    proc = subprocess.Popen([sys.executable, "-c", client, workers.endpoints[0], str(workers.tls_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "sent"
        assert len(memfd_mappings(worker_pid)) == before + 1, "the worker mapped the client's segment"
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while len(memfd_mappings(worker_pid)) > before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(memfd_mappings(worker_pid)) == before, "the worker let go of the dead client's segment"
    finally:
        proc.kill()


@pytest.mark.parametrize("plane", PLANES)
def test_a_stopped_worker_costs_one_deadline(model, workers, infos, plane, tmp_path):
    ckpt = read_checkpoint(model)
    procs = Processes(tmp_path)
    try:
        stopped = start_workers(procs, model, NUM_WORKERS, tag=f"stop-{plane}")
        stopped_infos = [fetch_info(w, e, 10, stopped.security) for w, e in enumerate(stopped.endpoints)]
        transport = transport_for(stopped, stopped_infos, plane, timeout_s=1.0)
        x, plan = routing(ckpt, 8, seed=6)
        stop(procs.procs[f"stop-{plane}-worker-0"].pid)
        transport.send(ckpt.moe_layers[0], 0, x, plan)
        start = time.monotonic()
        with pytest.raises(ExpertWorkerError, match="expert worker 0 .*: DEADLINE: no answer within 1 s"):
            transport.take(ckpt.moe_layers[0], 0).wait()
        assert 0.9 < time.monotonic() - start < 5
        os.kill(procs.procs[f"stop-{plane}-worker-0"].pid, signal.SIGCONT)
        transport.close()
    finally:
        procs.stop()


def test_probe_measures_every_plane_it_can_reach(workers):
    result = subprocess.run([sys.executable, "-m", "attention_server.probe", ",".join(workers.endpoints), *workers.tls_flags, "--json",
                             "--iterations", "20"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert [r["endpoint"] for r in report] == workers.endpoints
    for r in report:
        assert set(r["planes"]) == set(PLANES)
        for plane, m in r["planes"].items():
            assert m["latency_p50_ms"] > 0 and m["bandwidth_gb_per_s"] > 0, (plane, m)
            assert m["round_trips"]["latency"] == 20


def test_probe_names_an_unreachable_worker():
    result = subprocess.run([sys.executable, "-m", "attention_server.probe", "127.0.0.1:1", "--plaintext", "--timeout", "2"],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 2 and "worker 0 at 127.0.0.1:1: not reachable within 2 s" in result.stderr
    assert "nothing accepts connections there: is the worker running, and is that its --port?" in result.stderr


def test_the_benchmark_reply_delay_is_for_benchmarks_only_and_changes_no_answer(model, workers, infos, processes,
                                                                              monkeypatch):  # fmt: skip
    """make bench-pingpong's emulation of pool B (--bench-reply-delay-*): refused unless the
    benchmark switch is set, reported on /metrics, and the answers that come late are the same."""
    env = {k: v for k, v in os.environ.items() if k != BENCHMARK_ENV}
    refused = subprocess.run(python_module("expert_server", "--model", str(model), "--worker-index", "0",
                                           "--num-workers", str(NUM_WORKERS), "--port", "0", "--plaintext", "--bench-reply-delay-ms", "5"),
                             env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert refused.returncode != 0 and f"benchmarks only ({BENCHMARK_ENV}=1)" in refused.stderr
    monkeypatch.setenv(BENCHMARK_ENV, "1")
    delay = ("--bench-reply-delay-ms", "20", "--bench-reply-delay-us-per-row", "10")
    delayed = start_workers(processes, model, NUM_WORKERS, tag="delayed", extra_args=delay)
    reported = scrape(delayed.metrics_urls[0])
    assert total(reported, "hetero_moe_worker_bench_reply_delay_seconds", part="fixed") == 0.02
    assert total(reported, "hetero_moe_worker_bench_reply_delay_seconds", part="per_row") == 1e-5
    ckpt = read_checkpoint(model)
    layer = ckpt.moe_layers[0]
    delayed_infos = [fetch_info(w, e, 10, delayed.security) for w, e in enumerate(delayed.endpoints)]
    batches = [routing(ckpt, 8 * (micro_batch + 1), seed=micro_batch) for micro_batch in range(2)]
    wants = [unary_partials(workers, layer, x, plan) for x, plan in batches]
    native_before = sum(total(scrape(url), "hetero_moe_worker_native_requests_total") for url in delayed.metrics_urls)
    for plane in ("shm", "tcp"):
        transport = transport_for(delayed, delayed_infos, plane)
        try:
            for round in range(2):  # shm: the second round is computed by the C loop, its replies delayed alike
                start = time.perf_counter()
                for micro_batch, (x, plan) in enumerate(batches):  # both in flight at once
                    transport.send(layer, micro_batch, x, plan)
                for micro_batch, want in enumerate(wants):
                    got = transport.take(layer, micro_batch).wait()
                    assert all(torch.equal(g, w) for g, w in zip(got, want)), (plane, round, micro_batch)
                assert time.perf_counter() - start >= 0.02, "every reply waits out the fixed delay"
        finally:
            transport.close()
    native = sum(total(scrape(url), "hetero_moe_worker_native_requests_total") for url in delayed.metrics_urls)
    assert native - native_before == sum(len(plan.slices) for _, plan in batches)
