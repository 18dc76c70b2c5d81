"""A W4A16 copy of a checkpoint, packed by the compressed-tensors library, and its dequantized twin.

    python -m tiny_models.w4a16 --src DIR --out DIR --dequantized-out DIR [--group-size 32]

Only the routed experts are quantized (symmetric int4, per-group scales, `pack-quantized`); the
config's quantization targets match nothing else, so attention and routers stay 16-bit as vLLM on
an AVX2 CPU needs. The twin holds the same experts dequantized back to the checkpoint dtype: stock
vLLM serves it as the reference for the quantized cluster.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from protos.checkpoint import read_checkpoint

logger = logging.getLogger(__name__)

_COPIED = ("generation_config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json")


def _experts_model(tensors: dict[str, torch.Tensor], modules: list[str]) -> nn.Module:
    """A flat module of nn.Linear named after the expert projections ('.' -> '__')."""
    model = nn.Module()
    for name in modules:
        weight = tensors[f"{name}.weight"]
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
        linear.weight.data.copy_(weight)
        model.add_module(name.replace(".", "__"), linear)
    return model


def _unflatten(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.replace("__", "."): v.contiguous() for k, v in state.items()}


def _write(src: Path, path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A checkpoint directory: these tensors, src's config and tokenizer files."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", *_COPIED):
        if (src / name).exists():
            shutil.copy(src / name, path / name)
    save_file(tensors, path / "model.safetensors")


def quantize_experts(src: Path, out: Path, dequantized_out: Path, group_size: int = 32) -> tuple[Path, Path]:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    ckpt = read_checkpoint(src)
    (file,) = ckpt.files
    tensors = load_file(file)
    naming = ckpt.naming
    modules = [
        naming.module(layer, e, proj)
        for layer in ckpt.moe_layers
        for e in range(ckpt.num_experts)
        for proj in (naming.gate, naming.up, naming.down)
    ]
    model = _experts_model(tensors, modules)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)})
    apply_quantization_config(model, config)
    for linear in model.modules():
        if isinstance(linear, nn.Linear):  # what an observer does: per-group min/max -> scale
            w = linear.weight.data.float().unflatten(-1, (-1, group_size))
            scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
            linear.weight_scale.data.copy_(scale)
            linear.weight_zero_point.data.copy_(zero)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    expert_weights = {f"{m}.weight" for m in modules}
    rest = {k: v for k, v in tensors.items() if k not in expert_weights}

    compressor.compress_model(model)
    _write(src, out, {**rest, **_unflatten(model.state_dict())})
    compressor.update_config(str(out))  # writes quantization_config into config.json
    hf_config = json.loads((out / "config.json").read_text())
    # Quantize the routed experts only: vLLM must keep every other Linear 16-bit.
    expert_module = re.escape(naming.prefix).replace(r"\{layer\}", r"\d+").replace(r"\{expert\}", r"\d+")
    hf_config["quantization_config"]["config_groups"]["group_0"]["targets"] = [f"re:{expert_module}\\..*"]
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))

    compressor.decompress_model(model)
    dequantized = {k: v.to(tensors[k].dtype) for k, v in _unflatten(model.state_dict()).items() if k in expert_weights}
    _write(src, dequantized_out, {**rest, **dequantized})
    logger.info("wrote W4A16 experts (group %d) to %s and their dequantized twin to %s", group_size, out, dequantized_out)
    return out, dequantized_out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tiny_models.w4a16", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--src", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dequantized-out", type=Path, required=True)
    p.add_argument("--group-size", type=int, default=32)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    quantize_experts(a.src, a.out, a.dequantized_out, a.group_size)


if __name__ == "__main__":
    main()
