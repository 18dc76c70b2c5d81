"""Authenticated traffic between the pools (protos/security.py), against real worker processes on
loopback: a worker with --tls-dir refuses, with a clear status, a client without a certificate,
one whose certificate another CA signed, and one with a missing or wrong token, on gRPC and on
the data planes; the attention server refuses to start against such workers; and a cluster with
TLS on serves the same greedy tokens as one with it off."""
from __future__ import annotations

import dataclasses
import shutil
import signal
import socket
import ssl
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from attention_server.transport.base import Cause, ExpertWorkerError
from attention_server.transport.shm import ShmChannel
from attention_server.transport.tcp import TcpChannel
from cluster.certs import make_certs
from cluster.launcher import wait_http_ready
from expert_server.__main__ import is_loopback
from protos import expert_pb2 as pb
from protos import expert_pb2_grpc as pb_grpc
from protos import frames, security
from protos.security import Security
from tests.support import (
    HOST, VLLM_CPU_ARGS, free_ports, free_worker_ports, generate, port_flags, python_module, scrape, start_workers,
    total,
)  # fmt: skip

NUM_WORKERS = 2
REFUSED = "hetero_moe_worker_requests_total"


@pytest.fixture(scope="module")
def workers(model_dir, processes):
    return start_workers(processes, model_dir("qwen3_moe"), NUM_WORKERS, tag="sec")


@pytest.fixture(scope="module")
def info(workers) -> pb.InfoResponse:
    with workers.security.channel(workers.endpoints[0]) as channel:
        return pb_grpc.ExpertServiceStub(channel).Info(pb.InfoRequest(), timeout=10)


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory):
    """A complete set of certificates and a token from another CA."""
    return Security.load(make_certs(tmp_path_factory.mktemp("other-ca")), "attention")


def info_call(channel: grpc.Channel) -> grpc.RpcError | None:
    try:
        pb_grpc.ExpertServiceStub(channel).Info(pb.InfoRequest(), timeout=5)
    except grpc.RpcError as err:
        return err
    return None


def refused(workers) -> float:
    return total(scrape(workers.metrics_urls[0]), REFUSED, status="UNAUTHENTICATED")


def test_grpc_takes_only_certificates_of_the_cluster_ca(workers, other_ca):
    """The same Info call succeeds with the attention node's certificate and fails without it, or
    with another CA's: only the client certificate differs (each client trusts the worker's CA)."""
    endpoint, mine = workers.endpoints[0], workers.security
    assert info_call(mine.channel(endpoint)) is None
    clients = {
        "plaintext": grpc.insecure_channel(endpoint),
        "no client certificate": grpc.secure_channel(endpoint, grpc.ssl_channel_credentials(root_certificates=mine.ca)),
        "another CA's certificate": grpc.secure_channel(endpoint, grpc.composite_channel_credentials(
            grpc.ssl_channel_credentials(root_certificates=mine.ca, private_key=other_ca.key,
                                         certificate_chain=other_ca.cert),
            grpc.access_token_call_credentials(mine.token))),
    }  # fmt: skip
    for what, channel in clients.items():
        with channel:
            err = info_call(channel)
        # gRPC does not tell a refused client why (the worker logs it): its connection is closed.
        assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE, (what, err)
    with other_ca.channel(endpoint) as channel:  # its own CA does not know the worker either
        err = info_call(channel)
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "CERTIFICATE_VERIFY_FAILED" in err.details()


def test_grpc_refuses_a_missing_or_wrong_token_on_every_service_but_health(workers):
    endpoint, mine = workers.endpoints[0], workers.security
    before = refused(workers)
    no_token = grpc.ssl_channel_credentials(root_certificates=mine.ca, private_key=mine.key, certificate_chain=mine.cert)
    wrong = dataclasses.replace(mine, token="not-the-token")
    with grpc.secure_channel(endpoint, no_token) as channel, wrong.channel(endpoint) as wrong_channel:
        for channel_, reason in ((channel, "no cluster token"), (wrong_channel, "a wrong cluster token")):
            err = info_call(channel_)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED and reason in err.details(), err
            stream = channel_.stream_stream(frames.GRPC_METHOD)
            with pytest.raises(grpc.RpcError) as raised:
                list(stream(iter([frames.Header(frames.Kind.ECHO, 1, payload=0).pack()]), timeout=5))
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED and reason in raised.value.details()
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            list(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Health probes need a certificate of the cluster, not the token.
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    assert refused(workers) - before == 5, "each refused call is counted on /metrics"


def _tcp_port(info: pb.InfoResponse) -> int:
    return next(p.port for p in info.data_planes if p.kind == "tcp")


def _shm_address(info: pb.InfoResponse) -> str:
    return next(p.address for p in info.data_planes if p.kind == "shm")


def _closed_by_worker(sock: socket.socket) -> bool:
    """The worker ended the connection: end of stream, a reset, or a TLS alert."""
    try:
        return sock.recv(1) == b""
    except (ConnectionError, ssl.SSLError):
        return True


def test_tcp_plane_takes_only_certificates_of_the_cluster_ca(workers, info, other_ca):
    port, mine = _tcp_port(info), workers.security
    with socket.create_connection((HOST, port), timeout=10) as sock:  # plaintext HELLO on a TLS port
        sock.sendall(b"".join([frames.hello_frame(mine.hello_token())[0].pack(), mine.hello_token()]))
        assert _closed_by_worker(sock)
    no_cert = ssl.create_default_context(cadata=mine.ca.decode())
    other = ssl.create_default_context(cadata=mine.ca.decode())
    other.load_cert_chain(other_ca.tls_dir / security.ATTENTION_CERT, other_ca.tls_dir / security.ATTENTION_KEY)
    for context in (no_cert, other):
        with socket.create_connection((HOST, port), timeout=10) as raw:
            try:
                sock = context.wrap_socket(raw, server_hostname=HOST)
            except (ssl.SSLError, ConnectionError):
                continue  # TLS 1.2: the refusal ends the handshake itself
            with sock:  # TLS 1.3: the client's handshake ends first; the refusal follows
                assert _closed_by_worker(sock)
    # Through the attention node's own channel: a named error, never a fallback.
    channel = TcpChannel(0, workers.endpoints[0], 10, port, dataclasses.replace(mine, client_context=other))
    with pytest.raises(ExpertWorkerError) as err:
        channel.connected()
    assert err.value.cause is Cause.UNAUTHENTICATED


def _hello(workers, info, plane: str, token: bytes) -> tuple[frames.Header, str]:
    """The worker's answer to a HELLO carrying `token`, over a connection with the right certificate."""
    hello, _ = frames.hello_frame(token)
    if plane == "tcp":
        with workers.security.wrap_client(socket.create_connection((HOST, _tcp_port(info)), timeout=10), HOST) as sock:
            frames.send_frame(sock, hello, [token])
            header, payload = frames.recv_frame(sock, frames.ReceiveBuffer())
            if header.kind == frames.Kind.ERROR:
                assert _closed_by_worker(sock)
            return header, bytes(payload).decode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(10)
        sock.connect("\0" + _shm_address(info))
        sock.send(hello.pack() + token)
        answer = sock.recv(frames.HEADER.size + 65536)
        return frames.Header.unpack(answer[: frames.HEADER.size]), answer[frames.HEADER.size :].decode()


@pytest.mark.parametrize("plane", ["tcp", "shm"])
def test_data_planes_refuse_a_missing_or_wrong_token(workers, info, plane):
    before = refused(workers)
    for token, reason in ((b"", "no cluster token"), (b"not-the-token", "a wrong cluster token")):
        header, text = _hello(workers, info, plane, token)
        assert header.kind == frames.Kind.ERROR and frames.status_name(header.status) == "UNAUTHENTICATED"
        assert reason in text
    assert _hello(workers, info, plane, workers.security.hello_token())[0].kind == frames.Kind.HELLO
    # Through the attention node's own channel: a named error, never a fallback to another plane.
    wrong = dataclasses.replace(workers.security, token="not-the-token")
    channel = (TcpChannel(0, workers.endpoints[0], 10, _tcp_port(info), wrong) if plane == "tcp"
               else ShmChannel(0, workers.endpoints[0], 10, _shm_address(info), wrong))  # fmt: skip
    with pytest.raises(ExpertWorkerError) as err:
        channel.connected()
    assert err.value.cause is Cause.UNAUTHENTICATED and err.value.status == "UNAUTHENTICATED", err.value
    assert "a wrong cluster token" in err.value.details
    assert refused(workers) - before == 3, "each refused connection is counted on /metrics"


def test_tcp_plane_refuses_a_first_frame_that_is_not_a_hello(workers, info):
    with workers.security.wrap_client(socket.create_connection((HOST, _tcp_port(info)), timeout=10), HOST) as sock:
        frames.send_frame(sock, frames.Header(frames.Kind.ECHO, 1, payload=3), [b"abc"])
        header, payload = frames.recv_frame(sock, frames.ReceiveBuffer())
        assert frames.status_name(header.status) == "UNAUTHENTICATED"
        assert "opens with a HELLO frame, not ECHO" in bytes(payload).decode()
        assert _closed_by_worker(sock)


def test_attention_server_refuses_to_start_on_a_refused_certificate_or_token(model_dir, workers, other_ca, tmp_path):
    wrong_token = tmp_path / "wrong-token"
    shutil.copytree(workers.tls_dir, wrong_token)
    (wrong_token / security.TOKEN).write_text("not-the-token\n")
    cases = {
        ("--tls-dir", str(other_ca.tls_dir)): "not reachable within 3 s",
        ("--tls-dir", str(wrong_token)): "UNAUTHENTICATED: ",
        ("--plaintext",): "closes plaintext connections: give this node the cluster's --tls-dir",
    }
    for flags, reason in cases.items():
        result = subprocess.run(python_module(
            "attention_server", "--model", str(model_dir("qwen3_moe")), "--expert-endpoints", ",".join(workers.endpoints),
            *flags, "--worker-ready-timeout", "3", "--port", "1"),
            capture_output=True, text=True, timeout=120)  # fmt: skip
        assert result.returncode == 2 and "refusing to start" in result.stderr, result.stderr[-3000:]
        assert f"worker 0 at {workers.endpoints[0]}: " in result.stderr and reason in result.stderr, result.stderr


def test_plaintext_is_never_a_default(model_dir):
    for module, args in (("expert_server", ["--model", str(model_dir("qwen3_moe")), "--worker-index", "0",
                                            "--num-workers", "2", "--port", "0"]),
                         ("attention_server", ["--model", "unused", "--expert-endpoints", f"{HOST}:1"])):  # fmt: skip
        result = subprocess.run(python_module(module, *args), capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and "choose --tls-dir DIR" in result.stderr, (module, result.stderr[-2000:])
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and not is_loopback("0.0.0.0")


def test_certs_are_private_and_never_overwritten(tmp_path):
    out = subprocess.run(python_module("cluster", "certs", str(tmp_path / "c"), "--worker-host", "10.1.2.3"),
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "c").iterdir()}
    assert modes == {"ca.crt": 0o644, "ca.key": 0o600, "worker.crt": 0o644, "worker.key": 0o600,
                     "attention.crt": 0o644, "attention.key": 0o600, "token": 0o600}  # fmt: skip
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((tmp_path / "c" / "worker.crt").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"expert-0", "expert-7", "localhost"} <= set(names.get_values_for_type(x509.DNSName))
    assert {str(a) for a in names.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "10.1.2.3"}
    again = subprocess.run(python_module("cluster", "certs", str(tmp_path / "c")), capture_output=True, text=True,
                           timeout=60)  # fmt: skip
    assert again.returncode == 1 and "already holds" in again.stderr


def _start_cluster(model, logs, *flags: str) -> tuple[subprocess.Popen, str]:
    """`python -m cluster up` (TCP data plane, eager: what TLS changes is the wire, not the graph) with `flags`, and
    its URL."""
    (http,) = free_ports(1)
    with open(logs / "cluster.log", "wb") as log:
        up = subprocess.Popen(python_module(
            "cluster", "up", "--model", str(model), "--host", HOST, "--port", str(http),
            *port_flags(free_worker_ports(8)), "--data-plane", "tcp", "--pingpong-microbatches", "1",
            "--run-dir", str(logs / "run"), *flags, "--", *VLLM_CPU_ARGS, "--dtype", "float32", "--enforce-eager"),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    return up, f"http://{HOST}:{http}"


@pytest.mark.vllm
def test_a_cluster_with_tls_serves_the_same_tokens_as_without(model_dir, tmp_path):
    """Both start side by side, then answer one request at a time each, the other idle."""
    model = model_dir("qwen3_moe")
    flags = {"tls": (), "plain": ("--plaintext",)}  # TLS is `up`'s default
    for name in flags:
        (tmp_path / name).mkdir()
    clusters = {name: _start_cluster(model, tmp_path / name, *f) for name, f in flags.items()}
    try:
        for up, url in clusters.values():
            wait_http_ready(url, [up], timeout_s=900)
        with_tls, without = (generate(url, alone=True) for _, url in clusters.values())
    finally:
        for up, _ in clusters.values():
            up.send_signal(signal.SIGINT)
        for up, _ in clusters.values():
            up.wait(timeout=120)
    tls_log, plain_log = ((tmp_path / name / "run" / "worker-0.log").read_text() for name in flags)
    assert "mutual TLS and token from" in tls_log and "PLAINTEXT" in plain_log
    assert [g.tokens for g in with_tls] == [g.tokens for g in without]
    assert [g.margins for g in with_tls] == [g.margins for g in without], "the same numbers, bit for bit"

