"""Checkpoint formats: files written by other people's packers load and compute like the reference.

compressed-tensors: the `compressed-tensors` library quantizes and packs a tiny MoE itself
(ModelCompressor, pack-quantized) and decompresses it for the expected weights. GPTQ: vLLM's
GPTQ test utilities (gptq_quantize_weights, gptq_pack, pack_cols) write the tensors.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from kernels.backends.cpu import CpuBackend
from kernels.formats import (
    ExpertKeys,
    FormatMismatch,
    SafetensorsFiles,
    UnsupportedQuantization,
    load_expert_weights,
    parse_quant_config,
)
from kernels.oracle import choose_backend
from kernels.reference import DenseExpertWeights, moe_experts_reference, moe_experts_w4a16_reference
from protos.checkpoint import read_header
from tests.kernels.quantizers import compressed_tensors_int4

E, H, I = 3, 192, 64
PREFIX = "model.layers.0.mlp.experts"
KEYS = [ExpertKeys(f"{PREFIX}.{e}.gate_proj", f"{PREFIX}.{e}.up_proj", f"{PREFIX}.{e}.down_proj") for e in range(E)]


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> SafetensorsFiles:
    """A checkpoint directory holding `tensors`, and the loaders' source over it."""
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    header = read_header(path / "model.safetensors")
    return SafetensorsFiles({name: entry.file for name, entry in header.tensors.items()})


def _dense(weights: dict[str, torch.Tensor]) -> DenseExpertWeights:
    """Per-expert [N, K] float weights by prefix -> DenseExpertWeights."""
    w13 = torch.stack([torch.cat([weights[k.gate], weights[k.up]]) for k in KEYS])
    w2 = torch.stack([weights[k.down] for k in KEYS])
    return DenseExpertWeights(w13.float(), w2.float())


def _routing(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.arange(5).repeat_interleave(2)
    experts = torch.tensor([0, 1, 2, 0, 1, 2, 0, 2, 1, 0])
    return torch.randn(5, H, generator=gen), rows, experts, torch.rand(10, generator=gen)


def _assert_same_layer(loaded, dense: DenseExpertWeights):
    for e in range(E):
        torch.testing.assert_close(loaded.w13.dequantize(e), dense.w13[e], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(loaded.w2.dequantize(e), dense.w2[e], rtol=1e-6, atol=1e-6)
    x, rows, experts, wts = _routing()
    expected = moe_experts_reference(x, rows, experts, wts, dense)
    torch.testing.assert_close(moe_experts_w4a16_reference(x, rows, experts, wts, loaded), expected, rtol=1e-4, atol=1e-4)
    return x, rows, experts, wts, expected


# ---- compressed-tensors, packed by the library -------------------------------------------------


@pytest.fixture(scope="module")
def compressed_tensors_checkpoint(tmp_path_factory):
    """(source, quantization_config, expected dense weights by prefix) for a 3-expert layer packed by
    compressed-tensors."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization import apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    group = 64
    model = nn.Module()
    for e in range(E):
        expert = nn.Module()
        expert.gate_proj, expert.up_proj = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        expert.down_proj = nn.Linear(I, H, bias=False)
        model.add_module(f"{PREFIX}.{e}".replace(".", "_"), expert)  # flat names, renamed below
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)})
    apply_quantization_config(model, config)
    for module in model.modules():
        if isinstance(module, nn.Linear):  # what an observer does: per-group min/max -> scale
            w = module.weight.data.unflatten(-1, (-1, group))
            scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
            module.weight_scale.data.copy_(scale)
            module.weight_zero_point.data.copy_(zero)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    flat = PREFIX.replace(".", "_") + "_"

    def rename(name: str) -> str:
        return name.replace(flat, PREFIX + ".", 1)

    packed = {rename(k): v for k, v in model.state_dict().items()}
    path = tmp_path_factory.mktemp("ct")
    source = _write(path, packed)
    compressor.update_config(str(path))  # writes quantization_config into config.json
    compressor.decompress_model(model)
    dense = {rename(k)[: -len(".weight")]: v for k, v in model.state_dict().items() if k.endswith(".weight")}
    return source, json.loads((path / "config.json").read_text())["quantization_config"], dense


def test_compressed_tensors_checkpoint_computes_like_library_decompression(compressed_tensors_checkpoint, rel_error):
    source, quantization_config, dense = compressed_tensors_checkpoint
    quant = parse_quant_config(quantization_config)
    assert quant.method == "compressed-tensors" and quant.group_size == 64
    assert f"{KEYS[0].gate}.weight_packed" in source
    loaded = load_expert_weights(source, KEYS, quant)
    assert loaded.scheme.symmetric and not loaded.scheme.act_order
    x, rows, experts, wts, expected = _assert_same_layer(loaded, _dense(dense))
    out = choose_backend(torch.device("cpu"), loaded.scheme, "silu").backend.prepare(loaded, "silu", torch.device("cpu"))(
        x, rows, experts, wts
    )
    assert rel_error(out, expected) < 3e-2


def test_compressed_tensors_tensors_with_gptq_config_are_refused_by_name(compressed_tensors_checkpoint):
    source, _, _ = compressed_tensors_checkpoint
    with pytest.raises(FormatMismatch, match=r"expected GPTQ tensors .*found compressed-tensors pack-quantized"):
        load_expert_weights(source, KEYS, parse_quant_config({"quant_method": "gptq", "bits": 4, "group_size": 64}))


# ---- GPTQ, written with vLLM's GPTQ test utilities ---------------------------------------------


def _gptq_projection(weight: torch.Tensor, group: int, sign: torch.Tensor):
    """weight [N, K] -> (GPTQ tensors, expected dense [N, K]); scales multiplied by `sign` [N]."""
    quant_utils = pytest.importorskip("vllm.model_executor.layers.quantization.utils.quant_utils")
    from vllm.scalar_type import scalar_types

    n, k = weight.shape
    w_ref, w_q, w_s = quant_utils.gptq_quantize_weights(weight.t().float(), scalar_types.uint4b8, group)
    scales = (w_s * sign).to(torch.float16)  # [K/G, N], signed like auto-round's
    tensors = {
        "qweight": quant_utils.gptq_pack(w_q, 4, k, n),  # [K/8, N]
        "qzeros": quant_utils.pack_cols(torch.full((k // group, n), 7, dtype=torch.int32), 4, k // group, n),
        "scales": scales,
        "g_idx": torch.arange(k, dtype=torch.int32) // group,
    }
    # expected from vLLM's integer values and the stored fp16 scales (zero point 8 = stored 7 + 1)
    expected = (w_q.float() - 8) * scales.float().repeat_interleave(group, dim=0)  # [K, N]
    torch.testing.assert_close(expected, w_ref * sign, rtol=2e-3, atol=2e-3)
    return tensors, expected.t()


@pytest.fixture(scope="module")
def gptq_checkpoint(tmp_path_factory):
    """(source, quantization_config, expected dense weights by prefix, tensors) for a symmetric GPTQ v1
    layer, group 32."""
    gen = torch.Generator().manual_seed(1)
    group = 32
    tensors, dense = {}, {}
    for keys in KEYS:
        for prefix, (n, k) in ((keys.gate, (I, H)), (keys.up, (I, H)), (keys.down, (H, I))):
            sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
            parts, dense[prefix] = _gptq_projection(torch.randn(n, k, generator=gen), group, sign)
            tensors.update({f"{prefix}.{name}": t for name, t in parts.items()})
    config = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True, "desc_act": False}
    return _write(tmp_path_factory.mktemp("gptq"), tensors), config, dense, tensors


def test_gptq_checkpoint_computes_like_its_dequantization(gptq_checkpoint, rel_error):
    source, config, dense, _ = gptq_checkpoint
    loaded = load_expert_weights(source, KEYS, parse_quant_config(config))
    assert loaded.scheme.symmetric, "qzeros of 7 are zero 8 (v1 '+1'): symmetric"
    assert (loaded.w13.scales < 0).any(), "negative scales must survive loading"
    x, rows, experts, wts, expected = _assert_same_layer(loaded, _dense(dense))
    out = CpuBackend().prepare(loaded, "silu", torch.device("cpu"))(x, rows, experts, wts)
    assert rel_error(out, expected) < 3e-2


def test_gptq_tensors_with_compressed_tensors_config_are_refused_by_name(gptq_checkpoint):
    source, _, _, _ = gptq_checkpoint
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                                    "strategy": "group", "group_size": 32}}},
    }
    with pytest.raises(FormatMismatch, match=r"expected compressed-tensors pack-quantized tensors .*found GPTQ"):
        load_expert_weights(source, KEYS, parse_quant_config(config))


def test_awq_layout_under_gptq_config_is_refused(gptq_checkpoint):
    _, _, _, tensors = gptq_checkpoint
    awq = dict(tensors)
    key = f"{KEYS[0].gate}.qweight"
    awq[key] = torch.zeros(H, I // 8, dtype=torch.int32)  # AWQ packs along N: [K, N/8]
    with pytest.raises(FormatMismatch, match="AWQ packs along N"):
        load_expert_weights(awq, KEYS, parse_quant_config({"quant_method": "gptq", "bits": 4, "group_size": 32}))


def test_gptq_asymmetric_and_act_order_run_on_the_reference(gptq_checkpoint):
    """Zeros other than 8 and a permuted g_idx load; fast backends refuse them, the reference computes them."""
    quant_utils = pytest.importorskip("vllm.model_executor.layers.quantization.utils.quant_utils")
    gen = torch.Generator().manual_seed(2)
    group, tensors, dense = 32, {}, {}
    for keys in KEYS:
        for prefix, (n, k) in ((keys.gate, (I, H)), (keys.up, (I, H)), (keys.down, (H, I))):
            q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
            zeros = torch.randint(0, 16, (k // group, n), generator=gen, dtype=torch.int32)
            scales = torch.randn(k // group, n, generator=gen).half()
            # act order: the same column permutation for every projection with this K
            g_idx = (torch.randperm(k, generator=torch.Generator().manual_seed(k)) // group).to(torch.int32)
            tensors[f"{prefix}.qweight"] = quant_utils.pack_rows(q, 4, k, n)
            tensors[f"{prefix}.qzeros"] = quant_utils.pack_cols((zeros - 1) & 0xF, 4, k // group, n)  # v1: zero - 1
            tensors[f"{prefix}.scales"] = scales
            tensors[f"{prefix}.g_idx"] = g_idx
            dense[prefix] = ((q.float() - zeros[g_idx.long()].float()) * scales.float()[g_idx.long()]).t()
    loaded = load_expert_weights(tensors, KEYS, parse_quant_config({"quant_method": "gptq", "bits": 4, "group_size": group}))
    assert not loaded.scheme.symmetric and loaded.scheme.act_order
    _assert_same_layer(loaded, _dense(dense))
    choice = choose_backend(torch.device("cpu"), loaded.scheme, "silu")
    assert choice.backend.name == "reference" and "cpu" in choice.refusals


# ---- 16-bit checkpoints quantized on load, refusals --------------------------------------------


def test_bf16_checkpoint_is_quantized_on_load(tmp_path, rel_error):
    gen = torch.Generator().manual_seed(3)
    weights = {}
    for keys in KEYS:
        weights[keys.gate] = torch.randn(I, H, generator=gen).bfloat16()
        weights[keys.up] = torch.randn(I, H, generator=gen).bfloat16()
        weights[keys.down] = torch.randn(H, I, generator=gen).bfloat16()
    source = _write(tmp_path, {f"{k}.weight": v for k, v in weights.items()})
    loaded = load_expert_weights(source, KEYS, parse_quant_config(None, quantize_group=64))
    assert loaded.scheme.group_size == 64 and loaded.scheme.symmetric
    dense = _dense(weights)
    for e in range(E):
        for int4, w in ((loaded.w13, dense.w13[e]), (loaded.w2, dense.w2[e])):
            values, scales = compressed_tensors_int4(w, 64)
            assert torch.equal(int4.scales[e], scales) and torch.equal(int4.unpacked(e).long(), values + 8)
    x, rows, experts, wts = _routing()
    assert rel_error(
        moe_experts_w4a16_reference(x, rows, experts, wts, loaded), moe_experts_reference(x, rows, experts, wts, dense)
    ) < 0.2  # int4 rounding error of random weights, not a kernel tolerance


def test_expert_bias_is_refused():
    tensors = {f"{k}.{s}": torch.randn(8, 64) for k in (KEYS[0].gate, KEYS[0].up, KEYS[0].down) for s in ("weight",)}
    tensors[f"{KEYS[0].gate}.bias"] = torch.zeros(8)
    with pytest.raises(UnsupportedQuantization, match="expert bias"):
        load_expert_weights(tensors, KEYS[:1], parse_quant_config(None, quantize_group=32))


@pytest.mark.parametrize(
    "config,why",
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "8 bits"),
        (
            {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {"weights": {}}}},
            "format 'float-quantized'",
        ),
        (
            {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
                "weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}}}},
            "strategy 'tensor'",
        ),
        (
            {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
                "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32},
                "input_activations": {"num_bits": 8}}}},
            "quantized activations",
        ),
        (
            {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
                "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 16}}}},
            "only int4",
        ),
    ],
)
def test_unsupported_quantization_configs_are_refused(config, why):
    with pytest.raises(UnsupportedQuantization, match=why):
        parse_quant_config(config)
