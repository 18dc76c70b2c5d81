"""Run vLLM in this process on a checkpoint and print, as JSON, what its model holds.

python tests/vllm_probe.py MODEL_DIR   (plugin on when HETERO_MOE_EXPERT_ENDPOINTS is set)

Used by test_plugin.py in a subprocess, so that each probe gets a fresh vLLM.
"""
from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine and model in this process

import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402


def inspect(model: torch.nn.Module) -> dict:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    routed = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    return {
        "routed_classes": sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in routed}),
        "num_routed_layers": len(routed),
        "routed_expert_params": sum(p.numel() for m in routed for p in m.parameters()),
        "total_params": sum(p.numel() for p in model.parameters()),
        "plugin_modules": sorted(k for k in sys.modules if k == "attention_server" or k.startswith("attention_server.")),
    }


def main() -> None:
    llm = LLM(
        model=sys.argv[1], dtype="bfloat16", max_model_len=512, enforce_eager=True,
        kv_cache_memory_bytes=1 << 30, distributed_executor_backend="uni",
    )  # fmt: skip
    (facts,) = llm.apply_model(inspect)
    out = llm.generate(["The weather today is"], SamplingParams(max_tokens=8, temperature=0))
    facts["tokens"] = list(out[0].outputs[0].token_ids)
    print("PROBE " + json.dumps(facts), flush=True)


if __name__ == "__main__":
    main()
