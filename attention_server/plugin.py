"""vLLM general plugin entry point (`vllm.general_plugins`).

register() runs in every vLLM process. With HETERO_MOE_EXPERT_ENDPOINTS unset
it returns without importing anything, and vLLM runs exactly as stock.
"""
from __future__ import annotations

import logging

from attention_server.config import AttentionConfig


def register() -> None:
    if AttentionConfig.from_env() is None:
        return
    from attention_server import routed_experts

    log_like_vllm()
    allow_amx_tiles()
    routed_experts.install()


def log_like_vllm() -> None:
    """This package's INFO lines (placement epochs, workers going down and coming back) in vLLM's
    processes, through vLLM's own handler and format: vLLM configures only its `vllm` logger, so
    they would otherwise reach Python's last-resort handler, WARNING and above only."""
    ours, vllm = logging.getLogger("attention_server"), logging.getLogger("vllm")
    if ours.handlers or not vllm.handlers:
        return
    for handler in vllm.handlers:
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False


def allow_amx_tiles() -> None:
    """Ask Linux for this process's AMX tile state where the CPU has AMX.

    vLLM 0.32's CPU attention picks its AMX kernels for bf16 on such CPUs but never asks for the
    tile state (arch_prctl ARCH_REQ_XCOMP_PERM), which the kernel requires before the first tile
    instruction; oneDNN asks when it first uses AMX itself. So an engine whose first AMX
    instruction is vLLM's (eager mode, a first prompt of one or two tokens) dies of SIGILL: seen on
    a 2-core Xeon with AMX, stock vLLM included. torch's own request is idempotent.
    """
    import torch

    if torch.cpu._is_amx_tile_supported() and not torch._C._cpu._init_amx():
        raise RuntimeError("this CPU has AMX but Linux refused this process its tile state")
