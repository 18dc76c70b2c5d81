"""python -m attention_server --model DIR --expert-endpoints h:p,h:p,... (--tls-dir DIR | --plaintext)
       [vLLM serve flags]

Checks every expert worker against the model, then runs vLLM's OpenAI server
in this process with the hetero-moe plugin on. Without --expert-endpoints the
plugin stays off and this is stock vLLM.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from attention_server.config import (
    DATA_PLANES, DEFAULT_EXPERT_LOAD_WINDOW_S, DEFAULT_REBALANCE_ABOVE, DEFAULT_REQUEST_TIMEOUT_S,
    DEFAULT_WORKER_LOSS_TIMEOUT_S, MAX_MICROBATCHES, AttentionConfig, bytes_flag, microbatches_flag,
    share_metrics_across_processes,
)  # fmt: skip
from attention_server.handshake import WorkerMismatchError, check_workers
from protos.checkpoint import CheckpointError, read_checkpoint
from protos import security
from protos.placement import replicas_flag

logger = logging.getLogger("attention_server")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m attention_server", description=__doc__, add_help=False)
    p.add_argument("--model", required=True, help="HF-format MoE checkpoint directory")
    p.add_argument("--expert-endpoints", default="", help="HOST:PORT of worker 0, worker 1, ... (comma-separated)")
    security.add_flags(p)
    p.add_argument("--expert-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S, help="seconds per Forward RPC")
    p.add_argument("--worker-ready-timeout", type=float, default=120.0, help="seconds to wait for each worker at start")
    p.add_argument("--data-plane", choices=DATA_PLANES, default="auto",
                   help="how routed rows travel: auto (shared memory on this host, TCP across hosts), shm, tcp, grpc")
    p.add_argument("--expert-replicas", type=replicas_flag, default=None, metavar="R|auto",
                   help="workers holding each expert (as the workers were started with); auto (default): what they hold")
    p.add_argument("--worker-loss-timeout", type=float, default=DEFAULT_WORKER_LOSS_TIMEOUT_S, metavar="S",
                   help="when every worker holding some experts is lost, steps wait this long for one to come back, "
                        "then fail naming it and /health turns unhealthy")
    p.add_argument("--pingpong-microbatches", type=microbatches_flag, default=None, metavar="M|auto",
                   help=f"run steps of at least M requests as M micro-batches (1 to {MAX_MICROBATCHES}) whose attention "
                        "overlaps the others' experts; 1: off; auto (default): M chosen per step from measured times")
    p.add_argument("--expert-load-window", type=float, default=DEFAULT_EXPERT_LOAD_WINDOW_S, metavar="S",
                   help="count the tokens routed to each (MoE layer, expert) over the last S seconds, for "
                        "/metrics and /hetero_moe/expert_load (python -m attention_server.load); 0: off")
    p.add_argument("--hot-expert-bytes", type=bytes_flag, default=0, metavar="BYTES",
                   help="compute the busiest routed experts of the load window that fit in BYTES (e.g. 2GiB) on this "
                        "node, with the workers' kernels, while the workers compute the rest; re-chosen as the load "
                        "moves; 0 (default): every routed expert on the workers")
    p.add_argument("--spare-expert-bytes", type=bytes_flag, default=0, metavar="BYTES",
                   help="per worker, memory for copies of other workers' busy experts: when a layer's busiest worker "
                        "is over --rebalance-above times the mean, shares of its busiest experts' tokens are moved "
                        "onto the least busy workers, while serving; 0 (default): the static placement")
    p.add_argument("--rebalance-above", type=float, default=DEFAULT_REBALANCE_ABOVE, metavar="RATIO",
                   help="re-place when a layer's busiest worker takes more than RATIO times the mean of the load "
                        f"window's tokens (default {DEFAULT_REBALANCE_ABOVE}); needs --spare-expert-bytes")
    ours, vllm_args = p.parse_known_args(argv)
    if (ours.pingpong_microbatches or 1) > 1 and not ours.expert_endpoints:
        p.error("--pingpong-microbatches needs --expert-endpoints (without them this is stock vLLM)")
    return ours, ["--model", ours.model, *vllm_args]


def pingpong_worker_args(microbatches: int | None, vllm_argv: list[str]) -> list[str]:
    """vLLM flags that give its engine the plugin's CPU worker (pingpong.py: ping-pong for m > 1
    or auto, step timings for any m)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        if microbatches is None:
            logger.warning("ping-pong runs on vLLM's CPU platform only (for now): --pingpong-microbatches auto "
                           "runs every step whole (m = 1) on %s", current_platform.device_name)  # fmt: skip
        elif microbatches > 1:
            raise ValueError("--pingpong-microbatches above 1 runs on vLLM's CPU platform only (for now)")
        return []
    if any(a == "--worker-cls" or a.startswith("--worker-cls=") for a in vllm_argv):
        raise ValueError("the plugin brings its own --worker-cls (attention_server.pingpong); drop yours")
    return ["--worker-cls", "attention_server.pingpong.PingPongCPUWorker"]


def serve_vllm(vllm_argv: list[str]) -> None:
    """vLLM's own `serve` entry, in this process."""
    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(prog="python -m attention_server"))
    args = parser.parse_args(vllm_argv)
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    uvloop.run(run_server(args))


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ours, vllm_argv = parse_args(sys.argv[1:] if argv is None else argv)
    if ours.expert_endpoints:
        # The plugin's counters live in vLLM's engine process; this joins them to vLLM's /metrics.
        # First: nothing may import prometheus_client before it (the transport's metrics do).
        metrics_dir = share_metrics_across_processes()  # noqa: F841 (kept alive until exit)
        from attention_server.load import route as load_route
        from attention_server.transport import factory
        from attention_server.transport.base import ExpertWorkerError
        from attention_server.transport.factory import PlaneUnavailable

        try:
            cfg = AttentionConfig.from_flags(ours.expert_endpoints, ours.expert_timeout, ours.data_plane,
                                             ours.pingpong_microbatches, ours.expert_replicas,
                                             ours.worker_loss_timeout, ours.expert_load_window,
                                             ours.hot_expert_bytes, ours.spare_expert_bytes, ours.rebalance_above,
                                             tls_dir=ours.tls_dir, plaintext=ours.plaintext)  # fmt: skip
            credentials = cfg.security()
            vllm_argv += pingpong_worker_args(cfg.pingpong_microbatches, vllm_argv)
            vllm_argv += ["--middleware", load_route.MIDDLEWARE]  # GET /hetero_moe/expert_load
            ckpt = read_checkpoint(ours.model)
            infos, placement = check_workers(cfg.expert_endpoints, ckpt, ours.worker_ready_timeout, credentials,
                                             cfg.expert_replicas)  # fmt: skip
            cfg = dataclasses.replace(cfg, expert_replicas=placement.replicas)
            # Refuse now, not in vLLM's engine, when a worker lacks the plane asked for or refuses
            # this node's certificate or token on it; logs each choice.
            factory.connect(cfg.expert_endpoints, infos, cfg.data_plane, cfg.request_timeout_s, placement,
                            credentials).close()  # fmt: skip
        except (ValueError, CheckpointError, WorkerMismatchError, PlaneUnavailable, ExpertWorkerError) as err:
            logger.error("refusing to start: %s", err)
            raise SystemExit(2) from None
        cfg.publish()
        logger.info("%d expert workers match %s, every expert on %d of them, over %s; starting vLLM",
                    len(cfg.expert_endpoints), ours.model, cfg.expert_replicas, credentials.describe())  # fmt: skip
    serve_vllm(vllm_argv)


if __name__ == "__main__":
    main()
