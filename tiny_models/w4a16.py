"""W4A16 copies of a checkpoint, written by other projects' packers, and their dequantized twins.

    python -m tiny_models.w4a16 --src DIR --out DIR --dequantized-out DIR [--format gptq] [--group-size 32]

Only the routed experts are quantized (symmetric int4, per-group scales); the config's
quantization targets match nothing else, so attention and routers stay 16-bit as vLLM on an AVX2
CPU needs. Formats: `compressed-tensors` (`pack-quantized`, packed by the compressed-tensors
library) and `gptq` (v1, packed by vLLM's GPTQ utilities, with half of the output rows' scales
negative as auto-round writes them). The twin holds the same experts dequantized back to the
checkpoint dtype: stock vLLM serves it as the reference for the quantized cluster.
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


FORMATS = ("compressed-tensors", "gptq")


def _expert_modules(ckpt) -> list[str]:
    naming = ckpt.naming
    return [
        naming.module(layer, e, proj)
        for layer in ckpt.moe_layers
        for e in range(ckpt.num_experts)
        for proj in (naming.gate, naming.up, naming.down)
    ]


def quantize_experts(
    src: Path, out: Path, dequantized_out: Path, group_size: int = 32, fmt: str = "compressed-tensors"
) -> tuple[Path, Path]:
    """(W4A16 checkpoint, dequantized twin) of the 16-bit checkpoint `src`."""
    if fmt == "gptq":
        return _gptq_experts(src, out, dequantized_out, group_size)
    assert fmt == "compressed-tensors", fmt
    return _compressed_tensors_experts(src, out, dequantized_out, group_size)


def _compressed_tensors_experts(src: Path, out: Path, dequantized_out: Path, group_size: int) -> tuple[Path, Path]:
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
    modules = _expert_modules(ckpt)
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


def _gptq_experts(src: Path, out: Path, dequantized_out: Path, group_size: int) -> tuple[Path, Path]:
    from vllm.model_executor.layers.quantization.utils.quant_utils import gptq_pack, gptq_quantize_weights, pack_cols
    from vllm.scalar_type import scalar_types

    ckpt = read_checkpoint(src)
    (file,) = ckpt.files
    tensors = load_file(file)
    rest = {k: v for k, v in tensors.items() if not any(k == f"{m}.weight" for m in _expert_modules(ckpt))}
    quantized, dequantized = dict(rest), dict(rest)
    for i, module in enumerate(_expert_modules(ckpt)):
        weight = tensors[f"{module}.weight"]  # [N, K]
        n, k = weight.shape
        _, w_q, w_s = gptq_quantize_weights(weight.t().float(), scalar_types.uint4b8, group_size)  # [K, N], [K/G, N]
        sign = torch.where(torch.arange(n) % 2 == i % 2, -1.0, 1.0)  # auto-round writes negative scales
        scales = (w_s * sign).to(torch.float16)
        quantized |= {
            f"{module}.qweight": gptq_pack(w_q, 4, k, n),  # [K/8, N]
            f"{module}.qzeros": pack_cols(torch.full((k // group_size, n), 7, dtype=torch.int32), 4, k // group_size, n),
            f"{module}.scales": scales,
            f"{module}.g_idx": torch.arange(k, dtype=torch.int32) // group_size,
        }
        # v1 zero point: stored 7 means 8
        dense = (w_q.float() - 8) * scales.float().repeat_interleave(group_size, dim=0)  # [K, N]
        dequantized[f"{module}.weight"] = dense.t().to(weight.dtype).contiguous()
    _write(src, out, quantized)
    hf_config = json.loads((out / "config.json").read_text())
    # vLLM's GPTQ `dynamic` rule: every module outside the routed experts stays 16-bit.
    hf_config["quantization_config"] = {
        "quant_method": "gptq", "bits": 4, "group_size": group_size, "sym": True, "desc_act": False,
        "checkpoint_format": "gptq", "dynamic": {r"-:^(?!.*\.experts\.).*$": {}},
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    _write(src, dequantized_out, dequantized)
    logger.info("wrote GPTQ experts (group %d) to %s and their dequantized twin to %s", group_size, out, dequantized_out)
    return out, dequantized_out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tiny_models.w4a16", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--src", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dequantized-out", type=Path, required=True)
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--format", choices=FORMATS, default="compressed-tensors")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    quantize_experts(a.src, a.out, a.dequantized_out, a.group_size, a.format)


if __name__ == "__main__":
    main()
