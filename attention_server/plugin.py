"""vLLM general plugin entry point (`vllm.general_plugins`).

register() runs in every vLLM process. With HETERO_MOE_EXPERT_ENDPOINTS unset
it returns without importing anything, and vLLM runs exactly as stock.
"""
from __future__ import annotations

from attention_server.config import AttentionConfig


def register() -> None:
    if AttentionConfig.from_env() is None:
        return
    from attention_server import routed_experts

    routed_experts.install()
