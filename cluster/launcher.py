"""Start, watch and stop the processes of a one-machine cluster.

Every child runs in its own session so that stopping it (SIGTERM, then
SIGKILL after a grace period) reaches everything it started, e.g. vLLM's
engine-core and worker processes, and a Ctrl-C in the terminal reaches only
the launcher, which stops the children in order.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

STOP_GRACE_S = 20.0


class PortClashError(ValueError):
    """Two of a cluster's listeners were given the same port."""


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    model: Path
    num_workers: int
    worker_base_port: int
    http_port: int
    host: str
    run_dir: Path
    worker_threads: int
    worker_metrics_base_port: int
    tls_dir: Path | None = field(kw_only=True)  # --tls-dir of every node (cluster/certs.py made it); None: --plaintext
    worker_data_base_port: int = 0  # worker i's TCP data plane listens on base + i; 0: each picks a free port
    data_plane: str = "auto"  # how rows travel to the workers (attention_server --data-plane)
    pingpong_microbatches: int | None = None  # attention_server --pingpong-microbatches; None: auto
    expert_replicas: int | None = None  # --expert-replicas of the workers and the attention server; None: auto
    worker_loss_timeout_s: float | None = None  # attention_server --worker-loss-timeout; None: its default
    expert_load_window_s: float | None = None  # attention_server --expert-load-window; None: its default
    hot_expert_bytes: int = 0  # attention_server --hot-expert-bytes
    spare_expert_bytes: int = 0  # attention_server --spare-expert-bytes
    rebalance_above: float | None = None  # attention_server --rebalance-above; None: its default
    vllm_args: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = ()  # e.g. --weight-format w4a16 --kernel-backend cpu

    def __post_init__(self):
        """Every port the cluster listens on is distinct: a clash found only when a process binds
        could leave another process answering on the attention server's port."""
        listeners = {"--port": [self.http_port],
                     "--worker-base-port": range(self.worker_base_port, self.worker_base_port + self.num_workers),
                     "--worker-metrics-base-port": range(self.worker_metrics_base_port,
                                                         self.worker_metrics_base_port + self.num_workers)}  # fmt: skip
        if self.worker_data_base_port:
            listeners["--worker-data-base-port"] = range(self.worker_data_base_port,
                                                         self.worker_data_base_port + self.num_workers)  # fmt: skip
        seen: dict[int, str] = {}
        for flag, ports in listeners.items():
            for port in ports:
                if port in seen:
                    raise PortClashError(f"port {port} is both {seen[port]}'s and {flag}'s: with {self.num_workers} "
                                     f"workers each base port takes {self.num_workers} ports from the base on")
                seen[port] = flag

    @property
    def endpoints(self) -> list[str]:
        return [f"{self.host}:{self.worker_base_port + i}" for i in range(self.num_workers)]

    @property
    def metrics_urls(self) -> list[str]:
        """Prometheus targets: the attention server's (vLLM's own /metrics), then worker 0, 1, ..."""
        return [f"{self.base_url}/metrics"] + [
            f"http://{self.host}:{self.worker_metrics_base_port + i}/metrics" for i in range(self.num_workers)
        ]

    @property
    def served_model_name(self) -> str:
        args = list(self.vllm_args)
        if "--served-model-name" in args:
            return args[args.index("--served-model-name") + 1]
        return self.model.name

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    def worker_command(self, index: int) -> list[str]:
        return [
            sys.executable, "-m", "expert_server",
            "--model", str(self.model),
            "--worker-index", str(index),
            "--num-workers", str(self.num_workers),
            "--host", self.host,
            "--port", str(self.worker_base_port + index),
            "--num-threads", str(self.worker_threads),
            "--metrics-port", str(self.worker_metrics_base_port + index),
            "--data-port", str(self.worker_data_base_port and self.worker_data_base_port + index),
            *self.security_args(),
            *self._replicas_args(),
            *self.worker_args,
        ]  # fmt: skip

    def security_args(self) -> tuple[str, ...]:
        """--tls-dir DIR or --plaintext, as every node of this cluster gets it."""
        return ("--tls-dir", str(self.tls_dir)) if self.tls_dir is not None else ("--plaintext",)

    def _replicas_args(self) -> tuple[str, ...]:
        return ("--expert-replicas", str(self.expert_replicas)) if self.expert_replicas is not None else ()

    def attention_command(self) -> list[str]:
        return [
            sys.executable, "-m", "attention_server",
            "--model", str(self.model),
            "--expert-endpoints", ",".join(self.endpoints),
            *self.security_args(),
            "--data-plane", self.data_plane,
            "--pingpong-microbatches", "auto" if self.pingpong_microbatches is None else str(self.pingpong_microbatches),
            *self._replicas_args(),
            *(("--worker-loss-timeout", str(self.worker_loss_timeout_s)) if self.worker_loss_timeout_s is not None else ()),
            *(("--expert-load-window", str(self.expert_load_window_s)) if self.expert_load_window_s is not None else ()),
            "--hot-expert-bytes", str(self.hot_expert_bytes),
            "--spare-expert-bytes", str(self.spare_expert_bytes),
            *(("--rebalance-above", str(self.rebalance_above)) if self.rebalance_above is not None else ()),
            "--host", self.host,
            "--port", str(self.http_port),
            "--served-model-name", self.served_model_name,
            *self.vllm_args,
        ]  # fmt: skip


RECORD = "cluster.json"  # in the run directory: the pid of each process of a running cluster, for `down`
STOPPING = "cluster.stopping.json"  # where `down` moves a cluster's record before it stops the cluster
WORKER_RESTART_INTERVAL_S = 5.0  # a worker that keeps exiting is restarted at most this often


@dataclass(slots=True)
class Cluster:
    spec: ClusterSpec
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    started: dict[str, float] = field(default_factory=dict)  # when each child was last started

    @property
    def state_file(self) -> Path:
        return self.spec.run_dir / RECORD

    def _spawn(self, name: str, cmd: list[str], log_to_terminal: bool, append: bool = False) -> None:
        log = None if log_to_terminal else open(self.spec.run_dir / f"{name}.log", "ab" if append else "wb")  # noqa: SIM115
        self.procs[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT if log else None, stdin=subprocess.DEVNULL, start_new_session=True
        )
        if log:
            log.close()  # the child holds its own descriptor
        self.started[name] = time.monotonic()

    def start_workers(self) -> None:
        """Every worker, each logging to run_dir/worker-i.log (benchmarks drive them without vLLM)."""
        self.spec.run_dir.mkdir(parents=True, exist_ok=True)
        for i in range(self.spec.num_workers):
            self._spawn(f"worker-{i}", self.spec.worker_command(i), log_to_terminal=False)

    def start(self, attention_to_terminal: bool) -> None:
        self.start_workers()
        self._spawn("attention", self.spec.attention_command(), log_to_terminal=attention_to_terminal)
        self.state_file.write_text(json.dumps({n: p.pid for n, p in self.procs.items()}))

    def exited(self) -> dict[str, int]:
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

    def restart_workers(self) -> list[str]:
        """Start again every worker that exited (as compose's `restart:` does), at most once per
        WORKER_RESTART_INTERVAL_S each; its log goes on in the same file. The attention server
        takes it back once it serves (attention_server/transport/rejoin.py)."""
        restarted = []
        for name, code in self.exited().items():
            if name.startswith("worker-") and time.monotonic() - self.started[name] >= WORKER_RESTART_INTERVAL_S:
                self._spawn(name, self.spec.worker_command(int(name.removeprefix("worker-"))), False, append=True)
                restarted.append(f"{name} (exit {code})")
        if restarted:
            self.state_file.write_text(json.dumps({n: p.pid for n, p in self.procs.items()}))
        return restarted

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the attention server's /health answers; raise if a child exits first."""
        try:
            wait_http_ready(self.spec.base_url, self.procs.values(), timeout_s)
        except (RuntimeError, TimeoutError) as err:
            raise type(err)(f"{err}; logs in {self.spec.run_dir}") from None

    def stop(self) -> None:
        stop_in_order({n: p.pid for n, p in self.procs.items()}, reap=self.exited)
        for p in self.procs.values():
            p.wait()
        self.state_file.unlink(missing_ok=True)


def wait_http_ready(base_url: str, procs: Iterable[subprocess.Popen], timeout_s: float, path: str = "/health") -> None:
    """Block until GET {base_url}{path} answers 200; raise if one of `procs` exits or time runs out."""
    procs = list(procs)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if dead := [p for p in procs if p.poll() is not None]:
            raise RuntimeError(f"exited before {base_url} was ready: " + ", ".join(
                f"{' '.join(map(str, p.args[1:4]))} (exit {p.returncode})" for p in dead))  # fmt: skip
        try:
            with urllib.request.urlopen(f"{base_url}{path}", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{base_url} not ready after {timeout_s:.0f} s")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


# Every port this process has handed out: one picked a moment ago may not be bound yet (its
# process is still starting), so a trial bind alone would hand it out again.
_HANDED_OUT: set[int] = set()


def free_port_run(n: int, host: str = "127.0.0.1") -> int:
    """A base port with base .. base + n - 1 all free on `host`, for processes listening on base + i.

    The run lies below the kernel's ephemeral range: a port picked there can
    only be taken by another explicit bind, never by a process that binds port
    0 (a worker's TCP data plane, vLLM's sockets) or connects out between the
    pick here and the listener's own bind. No port is handed out twice by one
    process, so picks made before any of them is bound never overlap.
    """
    low = 10000
    high = _ephemeral_range()[0] - n
    if high <= low:
        raise RuntimeError(f"no room for {n} ports below the ephemeral range on {host}")
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(low, high)
        if not _HANDED_OUT.isdisjoint(range(base, base + n)):
            continue
        socks = []
        try:
            for port in range(base, base + n):
                socks.append(socket.socket())
                socks[-1].bind((host, port))
            _HANDED_OUT.update(range(base, base + n))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {n} consecutive free ports below the ephemeral range on {host}")


def free_worker_ports(num_workers: int, host: str = "127.0.0.1") -> dict[str, int]:
    """ClusterSpec's three port bases (gRPC, metrics, data plane) from one free run, so none overlap."""
    base = free_port_run(3 * num_workers, host)
    return {
        "worker_base_port": base,
        "worker_metrics_base_port": base + num_workers,
        "worker_data_base_port": base + 2 * num_workers,
    }


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n ports free on `host` right now, below the ephemeral range (see free_port_run)."""
    return [free_port_run(1, host) for _ in range(n)]


def _alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_pids(pids: dict[str, int], reap=lambda: None) -> None:
    """SIGTERM each process group, then SIGKILL whatever outlives the grace period.

    `reap` collects exited children of this process: a zombie leader would
    otherwise keep its group looking alive.
    """
    for name, pid in pids.items():
        if _alive(pid):
            logger.info("stopping %s (pid %d)", name, pid)
            _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline:
        reap()
        if not any(_alive(pid) for pid in pids.values()):
            break
        time.sleep(0.2)
    for name, pid in pids.items():
        if _alive(pid):
            logger.warning("%s (pid %d) ignored SIGTERM for %.0f s; killing it", name, pid, STOP_GRACE_S)
            _signal_group(pid, signal.SIGKILL)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """killpg, where a group that is gone by now (another stopper got there first) is not an error."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def stop_in_order(pids: dict[str, int], reap=lambda: None) -> None:
    """The attention server first, so it drains while the workers still answer; then the workers."""
    pids = dict(pids)
    if "attention" in pids:
        stop_pids({"attention": pids.pop("attention")}, reap)
    stop_pids(pids, reap)


def stop_recorded(run_dir: Path) -> bool:
    """Stop the cluster recorded in run_dir: one started with --detach, or one that `up` runs in the foreground
    elsewhere. The record moves to STOPPING first, so that such an `up`, seeing its attention server stop and its
    record gone, knows that `down` stopped it (it then stops its workers as well, racing this). False when no
    cluster is recorded there."""
    taken = run_dir / STOPPING
    try:
        os.replace(run_dir / RECORD, taken)
    except FileNotFoundError:
        return False
    stop_in_order(json.loads(taken.read_text()))
    taken.unlink()
    return True
