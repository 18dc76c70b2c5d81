"""Prometheus metrics of the attention node (names: hetero_moe_<stage>_<what>_<unit>).

The plugin runs in vLLM's engine process, not in the API server process that
serves /metrics. `python -m attention_server` therefore turns on
prometheus_client's multiprocess mode before vLLM starts (as vLLM does itself
when it runs several API servers), and these series appear on vLLM's own
/metrics beside its `vllm:` ones. Labels are bounded: worker index, MoE layer.
"""
from __future__ import annotations

from prometheus_client import Counter

DISPATCH_MESSAGES = Counter("hetero_moe_dispatch_messages", "Forward messages sent to each expert worker", ["worker"])
DISPATCH_ROWS = Counter("hetero_moe_dispatch_rows", "Token rows sent to each expert worker", ["worker"])
DISPATCH_PAIRS = Counter("hetero_moe_dispatch_pairs", "(token, expert) pairs sent to each expert worker", ["worker"])
ROUTED_TOKENS = Counter("hetero_moe_route_tokens", "Tokens routed to remote experts, per MoE layer", ["layer"])
