"""The dashboard against live data: a real Prometheus (Debian's) scrapes `make up`'s cluster
through deploy/prometheus/prometheus.yml's jobs while 16 clients stream and a worker is killed and
restarted, and every panel's query is evaluated through Prometheus's HTTP API, as Grafana would:
each returns data, in the unit its panel shows. Grafana itself does not run here."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import openai
import pytest
import yaml
from openai import OpenAI

from cluster.launcher import wait_http_ready
from tests.support import (
    HOST, PROMPTS, VLLM_CPU_ARGS, free_ports, free_worker_ports, openai_client, port_flags, python_module,
)  # fmt: skip

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary: `apt-get install prometheus` (make test does)"),
]

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
NUM_WORKERS = 8
SERVING = "hetero-moe serves "  # what `up` prints once the attention server answers /health
VICTIM = 3  # killed mid-stream; with two replicas its experts fail over, and `make up` restarts it
STREAM_TOKENS = 64
SCRAPE_INTERVAL = "1s"
RATE_INTERVAL = "5s"  # what Grafana's $__rate_interval becomes at this scrape interval (4 x scrape, and some)


# --- what a panel's query is in -------------------------------------------------------------------

# Grafana unit ids: the unit of a metric follows Prometheus's naming rules (base units as suffixes).
PER_SECOND = ("reqps", "ops", "cps")


def metric_unit(name: str) -> str:
    if name.endswith("_seconds"):
        return "s"
    if name.endswith("_bytes"):
        return "bytes"
    if name.endswith(("_ratio", "_perc")):
        return "percentunit"
    return "short"  # counts, and 0/1 states such as `up`


def rate_unit(unit: str) -> str:
    return {"s": "percentunit", "bytes": "Bps", "percentunit": "percentunit"}.get(unit, "per second")


def query_units(expr: str) -> set[str]:
    """The units of the series an expression reads, after what it does to them (rate, quantile,
    mean of a histogram); more than one means the query mixes units."""
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\bby \([^)]*\)", "", expr)  # matchers, windows, grouping
    units = set()
    for m in re.finditer(r"(rate\(\s*)?\b([a-z_:][a-z0-9_:]*)\b(?!\s*\()", bare):
        rated, name = bool(m.group(1)), m.group(2)
        base = re.sub(r"_(bucket|sum|count|total)$", "", name)
        if name.endswith("_bucket"):
            assert rated and "histogram_quantile" in expr, f"{name} outside histogram_quantile(rate(...)): {expr}"
            units.add(metric_unit(base))
        elif name.endswith(("_sum", "_count")) and f"{base}_sum" in bare and f"{base}_count" in bare:
            units.add(metric_unit(base))  # sum / count: the mean of the histogram's unit
        elif rated:
            assert name.endswith(("_total", "_count", "_sum")), f"rate() of {name}, which is not a counter: {expr}"
            units.add(rate_unit(metric_unit(base)))
        else:
            units.add(metric_unit(name))
    return units


def unit_matches(panel_unit: str, units: set[str]) -> bool:
    return len(units) == 1 and (panel_unit in PER_SECOND if units == {"per second"} else units == {panel_unit})


@pytest.mark.parametrize(
    ("expr", "unit", "matches"),
    [
        ("histogram_quantile(0.95, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket[$__rate_interval])))", "s", True),
        ("histogram_quantile(0.95, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket[$__rate_interval])))", "ms", False),
        ("sum(rate(x_seconds_sum[1m])) / sum(rate(x_seconds_count[1m]))", "s", True),
        ("sum by (worker) (rate(hetero_moe_dispatch_sent_bytes_total[1m]))", "Bps", True),
        ("sum by (worker) (rate(hetero_moe_dispatch_sent_bytes_total[1m]))", "bytes", False),
        ("sum(rate(vllm:generation_tokens_total[1m]))", "cps", True),
        ("sum(rate(vllm:generation_tokens_total[1m]))", "short", False),
        ("max(vllm:kv_cache_usage_perc)", "percentunit", True),
        ('up{job="expert-workers"}', "short", True),
        ("sum(rate(a_seconds_sum[1m])) / sum(rate(b_bytes_total[1m]))", "s", False),
    ],
)
def test_unit_rules(expr, unit, matches):
    assert unit_matches(unit, query_units(expr)) is matches


# --- a live cluster, a real Prometheus, load --------------------------------------------------------

class Prometheus:
    def __init__(self, url: str):
        self.url = url

    def get(self, path: str, **params) -> dict:
        with urllib.request.urlopen(f"{self.url}{path}?{urllib.parse.urlencode(params)}", timeout=30) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.get("/api/v1/query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float) -> list[dict]:
        return self.get("/api/v1/query_range", query=expr, start=start, end=end, step=1)["result"]


def scrape_config(http_port: int, metrics_base: int) -> dict:
    """deploy/prometheus/prometheus.yml as shipped, its targets on this machine's ports. The names
    (attention, expert-i) stay, so that its relabelling is what labels the series; a last rule
    points each at loopback, which is what DNS does for the containers."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = SCRAPE_INTERVAL
    for job in config["scrape_configs"]:
        (static,) = job["static_configs"]
        if job["job_name"] == "attention":
            static["targets"] = [f"attention:{http_port}"]
        else:
            assert job["job_name"] == "expert-workers", job
            static["targets"] = [f"expert-{i}:{metrics_base + i}" for i in range(NUM_WORKERS)]
        job.setdefault("relabel_configs", []).append(
            {"source_labels": ["__address__"], "regex": "[^:]+:([0-9]+)", "target_label": "__address__",
             "replacement": f"{HOST}:$1"})  # fmt: skip
    return config


def stream_load(base_url: str, clients: int, on_progress=None) -> list[str]:
    """`clients` streaming greedy completions at once; returns the failures."""
    with openai_client(base_url, timeout=300) as client:
        return _stream_load(client, clients, on_progress)


def _stream_load(client: OpenAI, clients: int, on_progress) -> list[str]:
    model = client.models.list().data[0].id
    streamed, failures = [0], []

    def stream(i: int) -> None:
        try:
            for chunk in client.completions.create(model=model, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=STREAM_TOKENS,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True}):  # fmt: skip
                streamed[0] += bool(chunk.choices)
                if on_progress is not None:
                    on_progress(streamed[0] / (clients * STREAM_TOKENS))
        except openai.APIError as err:
            failures.append(f"client {i}: {err!r}")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a client did not finish within 600 s"
    return failures


@pytest.fixture(scope="module")
def live(model_dir, tmp_path_factory):
    """(Prometheus, the load's start and end, the attention server's /metrics) after a loaded run
    of `make up` with a worker killed and back."""
    logs = tmp_path_factory.mktemp("monitoring")
    (http, prometheus_port) = free_ports(2)
    ports = free_worker_ports(NUM_WORKERS)
    base_url = f"http://{HOST}:{http}"
    with open(logs / "cluster.log", "wb") as log:
        launcher = subprocess.Popen(
            python_module("cluster", "up", "--model", str(model_dir("qwen3_moe")), "--host", HOST, "--port", str(http),
                          *port_flags(ports), "--run-dir", str(logs / "run"), "--", *VLLM_CPU_ARGS),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    (logs / "prometheus.yml").write_text(yaml.safe_dump(scrape_config(http, ports["worker_metrics_base_port"])))
    with open(logs / "prometheus.log", "wb") as log:
        prometheus = subprocess.Popen(
            [PROMETHEUS, f"--config.file={logs / 'prometheus.yml'}", f"--storage.tsdb.path={logs / 'tsdb'}",
             f"--web.listen-address={HOST}:{prometheus_port}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        wait_http_ready(base_url, [launcher], timeout_s=900)
        # Only once `up` has seen /health itself does it restart workers: before, a worker that
        # exits fails the start. Its polls can lag the test's on a loaded machine (CI failed so).
        deadline = time.monotonic() + 120
        while SERVING not in (logs / "cluster.log").read_text(errors="replace"):
            assert launcher.poll() is None and time.monotonic() < deadline, "`up` never said it serves"
            time.sleep(0.5)
        prom = Prometheus(f"http://{HOST}:{prometheus_port}")
        killed = []

        def kill_once(progress: float) -> None:
            if progress >= 0.25 and not killed:
                killed.append(json.loads((logs / "run" / "cluster.json").read_text())[f"worker-{VICTIM}"])
                os.killpg(killed[0], signal.SIGKILL)

        start = time.time()
        failures = stream_load(base_url, 16, kill_once)
        # `make up` restarts the worker; the attention node takes it back once it serves.
        deadline = time.monotonic() + 120
        while not prom.query(f'hetero_moe_transport_rejoins_total{{worker="{VICTIM}"}} >= 1'):
            assert time.monotonic() < deadline, f"worker {VICTIM} did not rejoin within 120 s"
            time.sleep(1)
        failures += stream_load(base_url, 16)
        time.sleep(3)  # the last scrapes
        assert killed and not failures, failures
        yield prom, start, time.time()
    finally:
        for proc, sig in ((prometheus, signal.SIGTERM), (launcher, signal.SIGINT)):
            if proc.poll() is None:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=120)


def panels() -> list[dict]:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "hetero-moe.json").read_text())
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_every_prometheus_target_is_up(live):
    prom, _, _ = live
    targets = prom.get("/api/v1/targets")["activeTargets"]
    assert len(targets) == 1 + NUM_WORKERS
    assert all(t["health"] == "up" for t in targets), [(t["scrapeUrl"], t["lastError"]) for t in targets]
    workers = {t["labels"]["worker"] for t in targets if t["labels"]["job"] == "expert-workers"}
    assert workers == {str(i) for i in range(NUM_WORKERS)}


def test_every_panel_shows_data_in_its_unit(live, capsys):
    prom, start, end = live
    empty, wrong_unit, report = [], [], []
    for panel in panels():
        unit = panel["fieldConfig"]["defaults"]["unit"]
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", RATE_INTERVAL)
            units = query_units(expr)
            if not unit_matches(unit, units):
                wrong_unit.append(f"{panel['title']!r}: shown in {unit}, the query is in {sorted(units)}: {expr}")
            series = prom.query_range(expr, start, end)
            points = sum(1 for s in series for _, v in s["values"] if v not in ("NaN", "+Inf", "-Inf"))
            report.append(f"{panel['title']} [{target.get('legendFormat', '')}]: {len(series)} series, {points} points")
            if not points:
                empty.append(f"{panel['title']!r}: no data from {expr}")
    with capsys.disabled():
        print("\n  " + "\n  ".join(report))
    assert not empty, "panels without data:\n" + "\n".join(empty)
    assert not wrong_unit, "\n".join(wrong_unit)


def test_round_trips_and_errors_move_under_load(live):
    prom, start, end = live
    window = f"{int(end - start) + 1}s"
    moved = {r["metric"]["worker"]: float(r["value"][1]) for r in prom.query(
        f"sum by (worker) (increase(hetero_moe_transport_round_trip_seconds_count[{window}]))")}  # fmt: skip
    assert set(moved) == {str(i) for i in range(NUM_WORKERS)} and min(moved.values()) > 0, moved
    # Counted once per outage: the series appears at 1 when the worker goes down.
    errors = {(r["metric"]["worker"], r["metric"]["cause"]): float(r["value"][1])
              for r in prom.query("hetero_moe_transport_errors_total")}  # fmt: skip
    assert errors and {w for w, _ in errors} == {str(VICTIM)} and sum(errors.values()) >= 1, errors
    assert prom.query("sum(hetero_moe_transport_failovers_total) > 0"), "no slice failed over to a replica"
