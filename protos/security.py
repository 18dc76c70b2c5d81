"""Authenticated traffic between the pools: the one module that builds credentials.

    --tls-dir DIR  mutual TLS: a worker's gRPC port and TCP data plane require a client
                   certificate signed by DIR/ca.crt, and every call carries DIR/token
                   (gRPC: `authorization: Bearer <token>`; data planes: the HELLO frame)
    --plaintext    none of that, asked for explicitly; never a default

cluster/certs.py writes DIR. Which files each host needs:

    pool A (attention node): ca.crt, attention.crt, attention.key, token
    pool B (expert workers): ca.crt, worker.crt, worker.key, token
    ca.key: no host (it only signs new certificates)

The standard health service (grpc.health.v1) answers without the token, so that a prober that
holds a cluster certificate (the worker host's own, worker.crt) sees it; everything else,
reflection included, needs the token. The shared-memory plane never leaves the host, so it
carries no TLS, but its HELLO is checked all the same.
"""
from __future__ import annotations

import argparse
import hmac
import logging
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from protos import GRPC_OPTIONS

logger = logging.getLogger(__name__)

CA_CERT, CA_KEY = "ca.crt", "ca.key"
WORKER_CERT, WORKER_KEY = "worker.crt", "worker.key"
ATTENTION_CERT, ATTENTION_KEY = "attention.crt", "attention.key"
TOKEN = "token"
FILES = (CA_CERT, WORKER_CERT, WORKER_KEY, ATTENTION_CERT, ATTENTION_KEY, TOKEN)  # what nodes read (not ca.key)
ROLES = {"worker": (WORKER_CERT, WORKER_KEY), "attention": (ATTENTION_CERT, ATTENTION_KEY)}


def role_files(role: str) -> tuple[str, ...]:
    """What a node of `role` reads from its TLS directory: the CA, its certificate and key, the token."""
    return (CA_CERT, *ROLES[role], TOKEN)


TOKEN_METADATA = "authorization"  # what grpc.access_token_call_credentials sends
TOKEN_EXEMPT = ("/grpc.health.v1.Health/",)
MAX_TOKEN_BYTES = 1024


class SecurityError(ValueError):
    """A TLS directory that lacks a file this node needs, or no choice between TLS and plaintext."""


class Unauthenticated(Exception):
    """A data-plane peer without this cluster's token (a worker answers it UNAUTHENTICATED)."""


def add_flags(parser: argparse.ArgumentParser) -> None:
    """--tls-dir DIR | --plaintext, one of them required."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--tls-dir", type=Path, default=None, metavar="DIR",
                       help="mutual TLS and a shared token between the pools, from DIR (python -m cluster certs DIR)")
    group.add_argument("--plaintext", action="store_true",
                       help="no TLS and no token between the pools (trusted networks only)")  # fmt: skip


def tls_dir_flag(tls_dir: Path | None, plaintext: bool) -> Path | None:
    """The flags' choice: the TLS directory, or None for plaintext; neither is an error."""
    if tls_dir is None and not plaintext:
        raise SecurityError("choose --tls-dir DIR (mutual TLS; python -m cluster certs DIR makes it) or --plaintext")
    return tls_dir


@dataclass(frozen=True, slots=True)
class Security:
    """What this node presents and trusts. `tls_dir` None: plaintext (no TLS, no token)."""

    role: str  # "worker" or "attention": which certificate and key it presents
    tls_dir: Path | None
    token: str = field(default="", repr=False)
    ca: bytes = field(default=b"", repr=False)
    cert: bytes = field(default=b"", repr=False)
    key: bytes = field(default=b"", repr=False)
    server_context: ssl.SSLContext | None = field(default=None, repr=False, compare=False)
    client_context: ssl.SSLContext | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise SecurityError(f"role {self.role!r} is not one of {sorted(ROLES)}")
        if self.tls_dir is not None and not (self.token and self.ca and self.cert and self.key):
            raise SecurityError("TLS needs a token, a CA, a certificate and a key: build it with Security.load")

    @classmethod
    def load(cls, tls_dir: Path | None, role: str) -> Security:
        """Read `role`'s files from `tls_dir`; None gives plaintext."""
        if tls_dir is None:
            return cls(role, None)
        if role not in ROLES:
            raise SecurityError(f"role {role!r} is not one of {sorted(ROLES)}")
        cert_name, key_name = ROLES[role]
        paths = {n: tls_dir / n for n in role_files(role)}
        if missing := [n for n, p in paths.items() if not p.is_file()]:
            raise SecurityError(f"--tls-dir {tls_dir} lacks {missing} (the {role} needs {list(paths)}; "
                                "python -m cluster certs DIR makes them)")  # fmt: skip
        token = paths[TOKEN].read_text().strip()
        if not token or len(token.encode()) > MAX_TOKEN_BYTES or not token.isprintable():
            raise SecurityError(f"{paths[TOKEN]} must hold one printable token of at most {MAX_TOKEN_BYTES} bytes")
        ca = paths[CA_CERT].read_bytes()
        try:
            server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # checks the server's name and chain
            for context in (server, client):
                context.minimum_version = ssl.TLSVersion.TLSv1_2
                context.load_cert_chain(paths[cert_name], paths[key_name])
                context.load_verify_locations(cadata=ca.decode())
            server.verify_mode = ssl.CERT_REQUIRED
        except (ssl.SSLError, ValueError) as err:
            raise SecurityError(f"--tls-dir {tls_dir}: unusable certificate or key: {err}") from None
        return cls(role, tls_dir, token, ca, paths[cert_name].read_bytes(), paths[key_name].read_bytes(), server, client)

    @classmethod
    def from_flags(cls, tls_dir: Path | None, plaintext: bool, role: str) -> Security:
        return cls.load(tls_dir_flag(tls_dir, plaintext), role)

    @property
    def tls(self) -> bool:
        return self.tls_dir is not None

    def describe(self) -> str:
        return f"mutual TLS and token from {self.tls_dir}" if self.tls else "PLAINTEXT (no TLS, no token)"

    # ---- gRPC ----------------------------------------------------------------------------------

    def _channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.composite_channel_credentials(
            grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert),
            grpc.access_token_call_credentials(self.token),  # on every call of the channel
        )

    def channel(self, endpoint: str, options=GRPC_OPTIONS) -> grpc.Channel:
        """A channel to a worker's gRPC port: every gRPC client of the workers opens it here."""
        if not self.tls:
            return grpc.insecure_channel(endpoint, options=options)
        return grpc.secure_channel(endpoint, self._channel_credentials(), options=options)

    def aio_channel(self, endpoint: str, options=GRPC_OPTIONS) -> grpc.aio.Channel:
        if not self.tls:
            return grpc.aio.insecure_channel(endpoint, options=options)
        return grpc.aio.secure_channel(endpoint, self._channel_credentials(), options=options)

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Listen on `address`: with TLS, only clients whose certificate the CA signed get through."""
        if not self.tls:
            return server.add_insecure_port(address)
        credentials = grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                                  require_client_auth=True)  # fmt: skip
        return server.add_secure_port(address, credentials)

    def server_interceptors(self, on_refused: Callable[[], None]) -> list[grpc.aio.ServerInterceptor]:
        """The per-call token check (none in plaintext); `on_refused` runs for every refused call."""
        return [TokenCheck(self.token, on_refused)] if self.tls else []

    # ---- data planes ---------------------------------------------------------------------------

    def hello_token(self) -> bytes:
        """What this node's data-plane HELLO carries."""
        return self.token.encode()

    def token_matches(self, presented: bytes | bytearray | memoryview) -> bool:
        """A HELLO's token against ours, in constant time; in plaintext there is none to match."""
        return not self.tls or hmac.compare_digest(bytes(presented), self.token.encode())

    def wrap_server(self, conn: socket.socket) -> socket.socket:
        """An accepted TCP data-plane connection, after the TLS handshake (ssl.SSLError when the
        client brings no certificate the CA signed); unchanged in plaintext."""
        if not self.tls:
            return conn
        assert self.server_context is not None
        return self.server_context.wrap_socket(conn, server_side=True)

    def wrap_client(self, sock: socket.socket, host: str) -> socket.socket:
        """A connected TCP data-plane socket to `host`, after the TLS handshake; unchanged in plaintext."""
        if not self.tls:
            return sock
        assert self.client_context is not None
        return self.client_context.wrap_socket(sock, server_hostname=host)


class TokenCheck(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call whose `authorization` metadata is not `Bearer <token>`."""

    def __init__(self, token: str, on_refused: Callable[[], None]):
        self._expected = f"Bearer {token}".encode()
        self._on_refused = on_refused

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(TOKEN_EXEMPT):
            return handler
        presented = next((v for k, v in details.invocation_metadata or () if k == TOKEN_METADATA), None)
        if presented is not None and hmac.compare_digest(str(presented).encode(), self._expected):
            return handler
        reason = "no cluster token" if presented is None else "a wrong cluster token"
        logger.warning("refused %s: %s", details.method, reason)
        self._on_refused()
        return _refusal(handler, f"{details.method}: {reason} (authorization: Bearer <the token in --tls-dir>)")


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that answers UNAUTHENTICATED."""

    async def refuse(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kind = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return kind(refuse)
