"""Deterministic tiny random MoE checkpoints (Qwen3-MoE, Qwen2-MoE, Mixtral), made locally.

Each checkpoint is a real HF-format model directory (config.json, generation_config.json, bf16
model.safetensors with per-expert tensor names, a byte-level BPE tokenizer with a ChatML template)
that stock vLLM and transformers both load. The bytes depend only on (arch, preset, seed).

    python -m tiny_models --arch qwen3_moe --preset tiny --out DIR [--seed 0]
    python -m tiny_models --default          # the model `make up` serves
"""

from .build import default_model_dir, make
from .prompts import PROMPTS
from .spec import ARCHS, PRESETS, ModelSpec, spec_for
from .weights import ParamSplit, param_split, read_shapes, tensor_specs

__all__ = [
    "ARCHS",
    "PRESETS",
    "PROMPTS",
    "ModelSpec",
    "ParamSplit",
    "default_model_dir",
    "make",
    "param_split",
    "read_shapes",
    "spec_for",
    "tensor_specs",
]
