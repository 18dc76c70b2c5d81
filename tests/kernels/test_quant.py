"""The canonical int4 container: packing, symmetric quantization, signed scales."""
from __future__ import annotations

import pytest
import torch

from kernels.quant import (
    Int4Weights,
    UnsupportedQuantization,
    W4A16ExpertWeights,
    pack_int4,
    quantize_symmetric,
    unpack_int4,
)
from tests.kernels.quantizers import compressed_tensors_int4


def test_pack_matches_compressed_tensors_order_and_round_trips():
    q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]])
    word = pack_int4(q)
    assert word.dtype == torch.int32
    # nibble i holds element i; element 7 (15) sets the sign bit of the int32
    assert word.item() == int.from_bytes(bytes([0x21, 0x43, 0x65, 0xF7]), "little", signed=True)
    q = torch.randint(0, 16, (3, 5, 64))
    assert torch.equal(unpack_int4(pack_int4(q)), q.to(torch.uint8))


def test_quantize_symmetric_equals_the_compressed_tensors_quantizer():
    w = torch.randn(2, 24, 256)
    int4 = quantize_symmetric(w, 64)
    for e in range(2):
        values, scales = compressed_tensors_int4(w[e], 64)
        assert torch.equal(int4.scales[e], scales), "scale = absmax / 7.5, bit for bit"
        assert torch.equal(int4.unpacked(e).to(torch.int64), values + 8), "round to nearest, stored + 8"
    assert int4.scheme.symmetric and not int4.scheme.act_order and int4.scheme.group_size == 64


def test_negative_scales_are_kept():
    q = torch.full((1, 8, 32), 10)  # value 2
    scales = torch.tensor([-1.0, 1.0, -0.5, 0.5, -2.0, 2.0, -3.0, 3.0]).reshape(1, 8, 1)
    deq = Int4Weights(pack_int4(q), scales, 32).dequantize(0)
    assert torch.equal(deq[:, 0], 2 * scales[0, :, 0])


def test_quantize_refuses_k_not_multiple_of_group():
    with pytest.raises(UnsupportedQuantization, match="not a multiple of group 128"):
        quantize_symmetric(torch.randn(1, 8, 96), 128)


def test_layer_with_two_schemes_is_refused():
    w13 = quantize_symmetric(torch.randn(1, 64, 64), 64)
    w2 = quantize_symmetric(torch.randn(1, 64, 32), 32)
    with pytest.raises(UnsupportedQuantization, match="one scheme per layer"):
        W4A16ExpertWeights(w13, w2)
