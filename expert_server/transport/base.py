"""What every data plane of the worker offers: start, advertise in Info, close."""
from __future__ import annotations

import logging
import socket
import threading
from abc import ABC, abstractmethod

from expert_server.transport.handler import ExpertHandler
from protos import expert_pb2 as pb

logger = logging.getLogger(__name__)


class Plane(ABC):
    """A listening socket; one thread per connection runs frames through the handler."""

    kind: str

    def __init__(self, handler: ExpertHandler, listener: socket.socket):
        self.handler = handler
        self.listener = listener
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=f"{self.kind}-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self.listener.close()

    @abstractmethod
    def advertise(self) -> pb.DataPlane: ...

    @abstractmethod
    def serve(self, conn: socket.socket) -> None:
        """Answer frames on one connection until the peer closes it."""

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve_logged, args=(conn,), name=f"{self.kind}-conn", daemon=True).start()

    def _serve_logged(self, conn: socket.socket) -> None:
        with conn:
            try:
                self.serve(conn)
            except (ConnectionError, OSError) as err:
                if not self._closed.is_set():
                    logger.info("%s connection closed: %s", self.kind, err)
