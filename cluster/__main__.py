"""python -m cluster up|down|certs — a whole cluster on this machine, and the certificates of one.

  up    start W expert workers and the attention server on the default model
        (made locally on first use) or --model DIR; print the endpoint; Ctrl-C
        stops everything. --detach returns once it serves; `down` stops it.
  down  stop the cluster recorded in the run directory: one started with --detach, or one
        that `up` runs in another terminal.
  certs DIR  make a CA, the workers' and the attention node's certificates and a token in DIR
        (cluster/certs.py says which file goes to which host); `up` makes its own in its run
        directory unless --plaintext or --tls-dir.

Arguments after `--` go to vLLM (e.g. -- --enforce-eager).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path

from attention_server.config import DATA_PLANES, bytes_flag, microbatches_flag
from cluster.certs import has_certs, make_certs, reuse_or_make
from cluster.launcher import RECORD, Cluster, ClusterSpec, PortClashError, stop_recorded
from protos import security
from protos.checkpoint import read_checkpoint
from protos.placement import available_host_memory, choose_replicas, replicas_flag

logger = logging.getLogger("cluster")

# CPU defaults so the embedded model starts on a laptop beside eight workers: vLLM's
# own default reserves 92% of memory. Flags after `--` come later and win.
CPU_VLLM_ARGS = ("--dtype", "bfloat16", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(1 << 30))


def default_run_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hetero-moe" / "run"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cluster", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a cluster")
    up.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the embedded tiny Qwen3-MoE)")
    up.add_argument("--workers", type=int, default=8)
    up.add_argument("--worker-base-port", type=int, default=50100, help="worker i listens on base + i")
    up.add_argument("--worker-metrics-base-port", type=int, default=9401,
                    help="worker i serves Prometheus /metrics on base + i")
    up.add_argument("--worker-data-base-port", type=int, default=51100,
                    help="worker i's TCP data plane listens on base + i (0: each picks a free port)")
    up.add_argument("--port", type=int, default=8000, help="OpenAI HTTP port (also vLLM's and the plugin's /metrics)")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--worker-threads", type=int, default=1, help="torch threads per worker")
    up.add_argument("--weight-format", choices=("checkpoint", "w4a16"), default="checkpoint",
                    help="w4a16: workers quantize 16-bit experts on load and run the W4A16 kernels")
    up.add_argument("--group-size", type=int, default=None, help="quantize-on-load group (32, 64, 128)")
    up.add_argument("--kernel-backend", default=None, help="force a worker kernel backend")
    up.add_argument("--data-plane", choices=DATA_PLANES, default="auto",
                    help="how rows travel to the workers: auto (shared memory here), shm, tcp or grpc")
    up.add_argument("--expert-replicas", type=replicas_flag, default=None, metavar="R|auto",
                    help="workers holding each expert, so that a lost worker's experts are served by another; "
                         "auto (default): 2 where two shards per worker fit in memory, else 1")
    up.add_argument("--worker-loss-timeout", type=float, default=None, metavar="S",
                    help="when every worker holding some experts is lost, steps wait this long for one to come back "
                         "(attention_server's default: 60), then the attention server stops and so does `up`")
    up.add_argument("--expert-load-window", type=float, default=None, metavar="S",
                    help="tokens per (MoE layer, expert) over the last S seconds, on /metrics and through "
                         "python -m attention_server.load (attention_server's default: 60); 0: not counted")
    up.add_argument("--hot-expert-bytes", type=bytes_flag, default=0, metavar="BYTES",
                    help="the busiest routed experts that fit in BYTES (e.g. 512MiB) are computed on the attention "
                         "server, chosen and re-chosen from the load window; 0 (default): all on the workers")
    up.add_argument("--spare-expert-bytes", type=bytes_flag, default=0, metavar="BYTES",
                    help="per worker, memory for shares of other workers' busy experts, moved there while serving "
                         "when a layer's load is uneven (--rebalance-above); 0 (default): the static placement")
    up.add_argument("--rebalance-above", type=float, default=None, metavar="RATIO",
                    help="re-place when a layer's busiest worker takes more than RATIO times the mean "
                         "(attention_server's default: 1.2)")
    up.add_argument("--pingpong-microbatches", type=microbatches_flag, default=None, metavar="M|auto",
                    help="steps of at least M requests run as M micro-batches in ping-pong (1 to 4); 1: off; "
                         "auto (default): M chosen per step from measured times")
    tls = up.add_mutually_exclusive_group()
    tls.add_argument("--tls-dir", type=Path, default=None, metavar="DIR",
                     help="certificates and token from DIR (python -m cluster certs DIR); default: made once in "
                          "RUN_DIR/tls and reused")
    tls.add_argument("--plaintext", action="store_true", help="no TLS and no token between the pools")
    up.add_argument("--ready-timeout", type=float, default=900.0)
    up.add_argument("--detach", action="store_true", help="return once serving; stop with `down`")
    up.add_argument("--run-dir", type=Path, default=default_run_dir(), help="logs and the detached cluster's state")
    up.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after --: flags for vLLM")
    down = sub.add_parser("down", help="stop the cluster recorded in --run-dir (detached or not)")
    down.add_argument("--run-dir", type=Path, default=default_run_dir())
    certs = sub.add_parser("certs", help="make a CA, node certificates and a token for --tls-dir")
    certs.add_argument("dir", type=Path, help="a new directory (or one without these files)")
    certs.add_argument("--worker-host", action="append", default=[], metavar="NAME",
                       help="another name or IP the workers are reached by (repeat); expert-0..7, localhost and "
                            "127.0.0.1 are always in")
    certs.add_argument("--attention-host", action="append", default=[], metavar="NAME",
                       help="another name or IP of the attention node (repeat)")
    certs.add_argument("--keep", action="store_true",
                       help="DIR already holding every file the nodes read: keep them and exit 0 (a compose one-shot "
                            "service started again); a partial set is still an error")
    return p.parse_args(argv)


def worker_args(a: argparse.Namespace) -> tuple[str, ...]:
    args = ["--weight-format", a.weight_format]
    if a.group_size is not None:
        args += ["--group-size", str(a.group_size)]
    if a.kernel_backend is not None:
        args += ["--kernel-backend", a.kernel_backend]
    return tuple(args)


def tls_dir(a: argparse.Namespace) -> Path | None:
    """Where the nodes' certificates are: --tls-dir, else RUN_DIR/tls (made on first use); None: --plaintext."""
    if a.plaintext:
        return None
    if a.tls_dir is not None:
        return a.tls_dir.resolve()
    directory = reuse_or_make((a.run_dir / "tls").resolve())
    print(f"mutual TLS between the pools, certificates and token in {directory}", flush=True)
    return directory


def up(a: argparse.Namespace) -> int:
    if a.model is None:
        import tiny_models

        a.model = tiny_models.make("qwen3_moe", tiny_models.default_model_dir())
    vllm_args = [*CPU_VLLM_ARGS, *(x for x in a.vllm_args if x != "--")]
    replicas = a.expert_replicas
    if replicas is None:  # decided once here, so that every worker and the attention server agree
        replicas, reason = choose_replicas(read_checkpoint(a.model).expert_bytes, a.workers,
                                           available_host_memory() // a.workers)  # fmt: skip
        print(f"expert replicas: {replicas} (auto: {reason})", flush=True)
    try:
        spec = ClusterSpec(
            model=a.model.resolve(),
            num_workers=a.workers,
            worker_base_port=a.worker_base_port,
            http_port=a.port,
            host=a.host,
            run_dir=a.run_dir,
            worker_threads=a.worker_threads,
            worker_metrics_base_port=a.worker_metrics_base_port,
            tls_dir=tls_dir(a),
            worker_data_base_port=a.worker_data_base_port,
            data_plane=a.data_plane,
            pingpong_microbatches=a.pingpong_microbatches,
            expert_replicas=replicas,
            worker_loss_timeout_s=a.worker_loss_timeout,
            expert_load_window_s=a.expert_load_window,
            hot_expert_bytes=a.hot_expert_bytes,
            spare_expert_bytes=a.spare_expert_bytes,
            rebalance_above=a.rebalance_above,
            vllm_args=tuple(vllm_args),
            worker_args=worker_args(a),
        )
    except PortClashError as e:
        print(f"cluster up: {e}", file=sys.stderr)
        return 2
    if (spec.run_dir / RECORD).exists():
        print(f"a detached cluster is recorded in {spec.run_dir}; run `python -m cluster down` first", file=sys.stderr)
        return 1
    cluster = Cluster(spec)
    # Ctrl-C and SIGTERM both end in the finally below (also when started
    # from a shell that ignores SIGINT for background jobs).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        cluster.start(attention_to_terminal=not a.detach)
        print(f"starting {spec.num_workers} workers and the attention server; logs in {spec.run_dir}", flush=True)
        cluster.wait_ready(a.ready_timeout)
        print(f"\nhetero-moe serves {spec.model} at {spec.base_url}/v1 as model {spec.served_model_name!r}", flush=True)
        attention_metrics, *worker_metrics = spec.metrics_urls
        print(f"metrics: {attention_metrics} (vLLM and hetero_moe_*), workers {worker_metrics[0]} ... "
              f"{worker_metrics[-1]}", flush=True)  # fmt: skip
        if a.detach:
            print("stop it with: make down   (python -m cluster down)", flush=True)
            cluster.procs.clear()  # leave them running
            return 0
        print("Ctrl-C to stop.", flush=True)
        while "attention" not in (dead := cluster.exited()):
            if restarted := cluster.restart_workers():
                print(f"restarting {', '.join(restarted)}; logs in {spec.run_dir}", file=sys.stderr, flush=True)
            time.sleep(1.0)
        if not cluster.state_file.exists():  # `down` took the record before it stopped the attention server
            print(f"stopped by `down`; logs in {spec.run_dir}", flush=True)
            return 0
        print(f"stopping: the attention server exited (code {dead['attention']}); logs in {spec.run_dir}",
              file=sys.stderr)  # fmt: skip
        return 1
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as err:
        print(f"cluster failed to start: {err}", file=sys.stderr)
        return 1
    finally:
        if cluster.procs:
            cluster.stop()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if a.command == "up":
        return up(a)
    if a.command == "certs":
        if a.keep and has_certs(a.dir):
            print(f"kept {a.dir}: it already holds {', '.join(security.FILES)}", flush=True)
            return 0
        try:
            make_certs(a.dir, a.worker_host, a.attention_host)
        except FileExistsError as err:
            print(f"certs: {err}", file=sys.stderr)
            return 1
        print(f"wrote {a.dir}: pool A needs {', '.join(security.role_files('attention'))}; pool B needs "
              f"{', '.join(security.role_files('worker'))}; keep {security.CA_KEY} off both", flush=True)  # fmt: skip
        return 0
    if not stop_recorded(a.run_dir):
        print(f"no cluster recorded in {a.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
