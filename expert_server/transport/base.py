"""What every data plane of the worker offers: start, advertise in Info, close."""
from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from expert_server.transport.handler import ExpertHandler, Reply
from protos import expert_pb2 as pb
from protos.frames import Header, Kind
from protos.security import Security, Unauthenticated

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReplyDelayConfig:
    """Benchmarks only (--bench-reply-delay-ms, --bench-reply-delay-us-per-row)."""

    fixed_s: float
    per_row_s: float

    def __bool__(self) -> bool:
        return bool(self.fixed_s or self.per_row_s)

    def seconds(self, rows: int) -> float:
        return self.fixed_s + self.per_row_s * rows


class ReplyDelay:
    """Benchmarks only: a connection's replies leave a ReplyDelayConfig's time after they are
    ready, in order, from a thread of their own, while the connection already takes its next
    request; a pool-B GPU's compute and link latency, emulated without using this CPU."""

    def __init__(self, config: ReplyDelayConfig | None):
        self.config = config if config else None
        self._due: queue.SimpleQueue[tuple[float, Callable[[], object]] | None] = queue.SimpleQueue()
        if self.config:
            threading.Thread(target=self._send_when_due, name="bench-reply-delay", daemon=True).start()

    def send(self, send: Callable[[], object], rows: int) -> None:
        """`send` sends a reply of `rows` token rows."""
        if self.config is None:
            send()
        else:  # a later reply may be due sooner (fewer rows); it still waits its turn, as on a link
            self._due.put((time.monotonic() + self.config.seconds(rows), send))

    def close(self) -> None:
        self._due.put(None)

    def _send_when_due(self) -> None:
        while (item := self._due.get()) is not None:
            due, reply = item
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                reply()
            except OSError:
                return  # the connection is gone; its serving thread says so


HANDSHAKE_TIMEOUT_S = 10.0  # a connection that has not said HELLO (and finished TLS) by then is dropped


class Plane(ABC):
    """A listening socket; one thread per connection runs frames through the handler.

    A connection opens with a HELLO frame carrying the cluster token (protos/security.py); one
    without it is answered UNAUTHENTICATED and closed before any other frame is read."""

    kind: str

    def __init__(self, handler: ExpertHandler, listener: socket.socket, security: Security):
        self.handler = handler
        self.listener = listener
        self.security = security
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=f"{self.kind}-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self.listener.close()

    @abstractmethod
    def advertise(self) -> pb.DataPlane: ...

    def secure(self, conn: socket.socket) -> socket.socket:
        """The accepted connection as this plane serves it (TCP: after the TLS handshake)."""
        return conn

    def hello_reply(self, header: Header, token: bytes | bytearray | memoryview) -> Reply:
        """The answer to a connection's first frame: an empty HELLO when it is a HELLO carrying
        this cluster's token, else an UNAUTHENTICATED error (counted) after which the plane closes."""
        if header.kind != Kind.HELLO:
            refused = Unauthenticated(f"a connection opens with a HELLO frame, not {header.kind.name}")
        elif not self.security.token_matches(token):
            refused = Unauthenticated("no cluster token" if not len(token) else "a wrong cluster token")
        else:
            return Reply(Header(Kind.HELLO, 0))
        logger.warning("%s plane: refused a connection: %s", self.kind, refused)
        return self.handler.error(0, self.handler.refusal(refused))

    @abstractmethod
    def serve(self, conn: socket.socket, delay: ReplyDelay) -> None:
        """Check the connection's HELLO (hello_reply), then answer frames until the peer closes it,
        sending replies through `delay`."""

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve_logged, args=(conn,), name=f"{self.kind}-conn", daemon=True).start()

    def _serve_logged(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            conn = self.secure(conn)
        except OSError as err:  # ssl.SSLError too: no certificate, or one the cluster's CA did not sign
            conn.close()
            logger.warning("%s plane: refused a connection: %s", self.kind, err)
            return
        self.handler.enter_thread()
        delay = ReplyDelay(self.handler.reply_delay)
        with conn:
            try:
                self.serve(conn, delay)
            except (ConnectionError, OSError) as err:
                if not self._closed.is_set():
                    logger.info("%s connection closed: %s", self.kind, err)
            finally:
                delay.close()
