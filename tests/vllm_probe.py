"""Run vLLM in this process on a checkpoint and print, as JSON, what its model holds and read.

python tests/vllm_probe.py MODEL_DIR   (plugin on when HETERO_MOE_EXPERT_ENDPOINTS is set)

Used by test_plugin.py in a subprocess, so that each probe gets a fresh vLLM. It records the
name of every tensor vLLM's loader reads through safetensors (the only way its default loader
reads a checkpoint), and, with the plugin on, the plugin's counters before and after one greedy
generation.
"""
from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine and model in this process

import torch  # noqa: E402
from prometheus_client import REGISTRY  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.model_executor.model_loader import weight_utils  # noqa: E402

PROMPT = "The weather today is"
MAX_TOKENS = 8


def record_safetensors_reads() -> list[str]:
    """Wrap safetensors' safe_open as vLLM's loader uses it; returns the list it appends names to."""
    names: list[str] = []
    real_safe_open = weight_utils.safe_open

    class RecordingSafeOpen:
        def __init__(self, *args, **kwargs):
            self._file = real_safe_open(*args, **kwargs)

        def __enter__(self):
            self._file.__enter__()
            return self

        def __exit__(self, *exc):
            return self._file.__exit__(*exc)

        def get_tensor(self, name):
            names.append(name)
            return self._file.get_tensor(name)

        def get_slice(self, name):
            names.append(name)
            return self._file.get_slice(name)

        def __getattr__(self, attr):
            return getattr(self._file, attr)

    weight_utils.safe_open = RecordingSafeOpen
    return names


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


def plugin_counters() -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, s.labels, s.value)
        for family in REGISTRY.collect()
        for s in family.samples
        if s.name.startswith("hetero_moe_") and s.name.endswith("_total")
    ]


def main() -> None:
    tensors_read = record_safetensors_reads()
    llm = LLM(
        model=sys.argv[1], dtype="bfloat16", max_model_len=512, enforce_eager=True,
        kv_cache_memory_bytes=1 << 30, distributed_executor_backend="uni",
    )  # fmt: skip
    (facts,) = llm.apply_model(inspect)
    counters_before = plugin_counters()
    (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    facts |= {
        "tokens": list(out.outputs[0].token_ids),
        "prompt_tokens": len(out.prompt_token_ids),
        "tensors_read": tensors_read,
        "counters_before": counters_before,
        "counters_after": plugin_counters(),
    }
    print("PROBE " + json.dumps(facts), flush=True)


if __name__ == "__main__":
    main()
