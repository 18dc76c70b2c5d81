"""The attention server's configuration; the one module that reads environment variables.

`python -m attention_server` publishes its flags as environment variables so
that every vLLM process (API server, engine core, workers) sees the same
configuration when vLLM runs this project's plugin in it. With
HETERO_MOE_EXPERT_ENDPOINTS unset the plugin is off and vLLM runs as stock.
"""
from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protos.security import Security

ENDPOINTS_ENV = "HETERO_MOE_EXPERT_ENDPOINTS"
TIMEOUT_ENV = "HETERO_MOE_REQUEST_TIMEOUT_S"
DATA_PLANE_ENV = "HETERO_MOE_DATA_PLANE"
PINGPONG_ENV = "HETERO_MOE_PINGPONG_MICROBATCHES"
REPLICAS_ENV = "HETERO_MOE_EXPERT_REPLICAS"
WORKER_LOSS_ENV = "HETERO_MOE_WORKER_LOSS_TIMEOUT_S"
TLS_DIR_ENV = "HETERO_MOE_TLS_DIR"  # --tls-dir
PLAINTEXT_ENV = "HETERO_MOE_PLAINTEXT"  # "1": --plaintext
LOAD_WINDOW_ENV = "HETERO_MOE_EXPERT_LOAD_WINDOW_S"
HOT_BYTES_ENV = "HETERO_MOE_HOT_EXPERT_BYTES"
SPARE_BYTES_ENV = "HETERO_MOE_SPARE_EXPERT_BYTES"
REBALANCE_ENV = "HETERO_MOE_REBALANCE_ABOVE"
MAX_MICROBATCHES = 4
DATA_PLANES = ("auto", "shm", "tcp", "grpc")
DEFAULT_REQUEST_TIMEOUT_S = 60.0
DEFAULT_WORKER_LOSS_TIMEOUT_S = 60.0
DEFAULT_EXPERT_LOAD_WINDOW_S = 60.0
DEFAULT_REBALANCE_ABOVE = 1.2
PROMETHEUS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def microbatches_flag(text: str) -> int | None:
    """The --pingpong-microbatches flag: a count m, or auto (None: m chosen per step, pingpong.py)."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of micro-batches or auto, got {text!r}") from None


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def bytes_flag(text: str) -> int:
    """A byte count: 1048576, 512MiB, 2GiB, 1.5G (B optional, case ignored)."""
    number = text.strip().rstrip("Bb").rstrip()
    unit = number.lstrip("0123456789.").strip().lower()
    try:
        return int(float(number[: len(number) - len(unit)].strip()) * _UNITS[unit])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a byte count such as 536870912 or 512MiB, got {text!r}") from None


def parse_endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expert endpoint {text!r} is not HOST:PORT")
    return host, int(port)


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """expert_endpoints[i] serves worker i of the placement (protos/placement.py)."""

    expert_endpoints: tuple[str, ...]
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    data_plane: str = "auto"  # auto: shared memory on this host, TCP across hosts, else the gRPC stream
    pingpong_microbatches: int | None = None  # m: steps of at least m requests run as m micro-batches; None: auto
    expert_replicas: int | None = None  # R: workers holding each shard; None: what the workers hold
    worker_loss_timeout_s: float = DEFAULT_WORKER_LOSS_TIMEOUT_S  # a shard with no live replica waits this long
    expert_load_window_s: float = DEFAULT_EXPERT_LOAD_WINDOW_S  # tokens per (layer, expert) over this; 0: not counted
    hot_expert_bytes: int = 0  # the busiest routed experts that fit are computed on this node (hot.py); 0: none
    spare_expert_bytes: int = 0  # per worker, for shares of busy experts re-placed onto it (replace.py); 0: static
    rebalance_above: float = DEFAULT_REBALANCE_ABOVE  # re-place when a layer's busiest worker is this over the mean
    tls_dir: Path | None = field(kw_only=True)  # mutual TLS and token from here (protos/security.py); None: plaintext

    def __post_init__(self) -> None:
        if not self.expert_endpoints:
            raise ValueError("at least one expert endpoint is needed")
        for endpoint in self.expert_endpoints:
            parse_endpoint(endpoint)
        if len(set(self.expert_endpoints)) != len(self.expert_endpoints):
            raise ValueError(f"expert endpoints repeat: {list(self.expert_endpoints)}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request timeout must be > 0 s, got {self.request_timeout_s}")
        if self.data_plane not in DATA_PLANES:
            raise ValueError(f"data plane {self.data_plane!r} is not one of {DATA_PLANES}")
        if self.pingpong_microbatches is not None and not 1 <= self.pingpong_microbatches <= MAX_MICROBATCHES:
            raise ValueError(f"ping-pong micro-batches must be 1 to {MAX_MICROBATCHES}, got {self.pingpong_microbatches}")
        workers = len(self.expert_endpoints)
        if self.expert_replicas is not None and not 1 <= self.expert_replicas <= workers:
            raise ValueError(f"expert replicas must be 1 to {workers} (the number of workers), got {self.expert_replicas}")
        if not self.worker_loss_timeout_s >= 0:
            raise ValueError(f"worker loss timeout must be >= 0 s, got {self.worker_loss_timeout_s}")
        if not self.expert_load_window_s >= 0:
            raise ValueError(f"expert load window must be >= 0 s (0: off), got {self.expert_load_window_s}")
        if self.hot_expert_bytes < 0:
            raise ValueError(f"hot expert bytes must be >= 0 (0: none), got {self.hot_expert_bytes}")
        if self.hot_expert_bytes and not self.expert_load_window_s:
            raise ValueError("hot experts are chosen from the expert load window: --hot-expert-bytes needs "
                             "--expert-load-window above 0")  # fmt: skip
        if self.spare_expert_bytes < 0:
            raise ValueError(f"spare expert bytes must be >= 0 (0: static placement), got {self.spare_expert_bytes}")
        if self.spare_expert_bytes and not self.expert_load_window_s:
            raise ValueError("re-placement follows the expert load window: --spare-expert-bytes needs "
                             "--expert-load-window above 0")  # fmt: skip
        if not self.rebalance_above >= 1.0:
            raise ValueError(f"--rebalance-above is a ratio of the busiest worker's load to the mean, >= 1; "
                             f"got {self.rebalance_above}")  # fmt: skip
        if self.tls_dir is not None and not self.tls_dir.is_dir():
            raise ValueError(f"--tls-dir {self.tls_dir} is not a directory")

    def security(self) -> Security:
        """This node's credentials towards the workers (reads the TLS directory)."""
        from protos.security import Security  # grpc: not in every vLLM process the plugin registers in

        return Security.load(self.tls_dir, "attention")

    @classmethod
    def from_flags(cls, endpoints: str, request_timeout_s: float, data_plane: str = "auto",
                   pingpong_microbatches: int | None = None, expert_replicas: int | None = None,
                   worker_loss_timeout_s: float = DEFAULT_WORKER_LOSS_TIMEOUT_S,
                   expert_load_window_s: float = DEFAULT_EXPERT_LOAD_WINDOW_S, hot_expert_bytes: int = 0,
                   spare_expert_bytes: int = 0, rebalance_above: float = DEFAULT_REBALANCE_ABOVE, *,
                   tls_dir: Path | None, plaintext: bool) -> AttentionConfig:  # fmt: skip
        from protos.security import tls_dir_flag

        return cls(tuple(e.strip() for e in endpoints.split(",") if e.strip()), request_timeout_s, data_plane,
                   pingpong_microbatches, expert_replicas, worker_loss_timeout_s, expert_load_window_s,
                   hot_expert_bytes, spare_expert_bytes, rebalance_above,
                   tls_dir=tls_dir_flag(tls_dir, plaintext))  # fmt: skip

    @classmethod
    def from_env(cls) -> AttentionConfig | None:
        """The configuration published by the launcher, or None when the plugin is off."""
        endpoints = os.environ.get(ENDPOINTS_ENV, "")
        if not endpoints:
            return None
        replicas = os.environ.get(REPLICAS_ENV)
        return cls.from_flags(
            endpoints, float(os.environ.get(TIMEOUT_ENV, DEFAULT_REQUEST_TIMEOUT_S)), os.environ.get(DATA_PLANE_ENV, "auto"),
            microbatches_flag(os.environ.get(PINGPONG_ENV, "auto")), int(replicas) if replicas else None,
            float(os.environ.get(WORKER_LOSS_ENV, DEFAULT_WORKER_LOSS_TIMEOUT_S)),
            float(os.environ.get(LOAD_WINDOW_ENV, DEFAULT_EXPERT_LOAD_WINDOW_S)), int(os.environ.get(HOT_BYTES_ENV, "0")),
            int(os.environ.get(SPARE_BYTES_ENV, "0")), float(os.environ.get(REBALANCE_ENV, DEFAULT_REBALANCE_ABOVE)),
            tls_dir=Path(tls) if (tls := os.environ.get(TLS_DIR_ENV)) else None,
            plaintext=os.environ.get(PLAINTEXT_ENV) == "1",
        )  # fmt: skip

    def publish(self) -> None:
        """Export to the environment inherited by vLLM's processes."""
        os.environ[ENDPOINTS_ENV] = ",".join(self.expert_endpoints)
        os.environ[TIMEOUT_ENV] = repr(self.request_timeout_s)
        os.environ[DATA_PLANE_ENV] = self.data_plane
        os.environ[PINGPONG_ENV] = "auto" if self.pingpong_microbatches is None else str(self.pingpong_microbatches)
        os.environ[WORKER_LOSS_ENV] = repr(self.worker_loss_timeout_s)
        os.environ[LOAD_WINDOW_ENV] = repr(self.expert_load_window_s)
        os.environ[HOT_BYTES_ENV] = str(self.hot_expert_bytes)
        os.environ[SPARE_BYTES_ENV] = str(self.spare_expert_bytes)
        os.environ[REBALANCE_ENV] = repr(self.rebalance_above)
        if self.tls_dir is None:
            os.environ.pop(TLS_DIR_ENV, None)
            os.environ[PLAINTEXT_ENV] = "1"
        else:
            os.environ[TLS_DIR_ENV] = str(self.tls_dir.resolve())
            os.environ.pop(PLAINTEXT_ENV, None)
        if self.expert_replicas is None:
            os.environ.pop(REPLICAS_ENV, None)
        else:
            os.environ[REPLICAS_ENV] = str(self.expert_replicas)


def share_metrics_across_processes() -> tempfile.TemporaryDirectory | None:
    """Turn on prometheus_client's multiprocess mode for this process and vLLM's children.

    Must run before anything imports prometheus_client. Returns the directory,
    removed when it is garbage-collected at exit, or None when the operator
    already set PROMETHEUS_MULTIPROC_DIR (then wiping it is theirs to do).
    """
    if os.environ.get(PROMETHEUS_DIR_ENV):
        return None
    directory = tempfile.TemporaryDirectory(prefix="hetero-moe-metrics-")
    os.environ[PROMETHEUS_DIR_ENV] = directory.name
    return directory
