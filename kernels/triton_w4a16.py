"""Triton kernels of the grouped W4A16 MoE: gate_up + activation, then down + router weight.

Layout (made by kernels.backends.triton_moe from the canonical one), per projection [E, N, K]:
  w: [E, N, K/2] uint8. Within each group block of G input columns starting at k0,
     byte j (0 <= j < G/2) = q[k0 + j] | q[k0 + G/2 + j] << 4, so the low nibbles of a block
     multiply x[k0 : k0+G/2] and the high nibbles x[k0+G/2 : k0+G]: two tl.dot calls, no shuffles.
  s: [E, K/G, N] float32 signed scales, N contiguous.
One program owns (expert e, BLOCK_N output columns) and walks that expert's pairs in BLOCK_M
chunks (pairs are grouped by expert: order[bounds[e]:bounds[e+1]]). The group scale is applied
to each group's partial dot in fp32, not to the weights.
"""
from __future__ import annotations

import triton
import triton.language as tl

ACTIVATION_CODES = {"silu": 0, "gelu": 1}


@triton.jit
def _nibbles_to_float(q, IS_BF16: tl.constexpr):
    """uint8 nibbles in 0..15 -> (q - 8) exactly, in fp16 or bf16, with the exponent-bias trick.

    OR-ing q into the mantissa of 1024.0 (fp16 0x6400) or 128.0 (bf16 0x4300) gives 1024 + q or
    128 + q exactly; one subtraction removes the bias and the zero point.
    """
    q16 = q.to(tl.uint16)
    if IS_BF16:
        f = ((q16 | 0x4300).to(tl.bfloat16, bitcast=True) - 136.0).to(tl.bfloat16)
    else:
        f = ((q16 | 0x6400).to(tl.float16, bitcast=True) - 1032.0).to(tl.float16)
    return f


def _ptx_split(bias: str, fix: str) -> str:
    """PTX for 4 packed bytes ($4) -> low nibbles ($0, $1) and high nibbles ($2, $3), two per register.

    prmt spreads bytes b0, b1 (b2, b3) into the two 16-bit halves; lop3 masks one nibble per half
    and ORs in the exponent bias (1024 fp16 / 128 bf16), one paired op removes bias + 8.
    """
    return f"""{{
    .reg .b32 t0, t1, u0, u1, mask, bias, k0, k1;
    mov.b32 mask, 0x000F000F;
    mov.b32 bias, {bias};
    prmt.b32 t0, $4, 0, 0x4140;
    prmt.b32 t1, $4, 0, 0x4342;
    lop3.b32 u0, t0, mask, bias, 0xEA;
    lop3.b32 u1, t1, mask, bias, 0xEA;
    {fix.format(out="$0", x="u0")}
    {fix.format(out="$1", x="u1")}
    shr.b32 t0, t0, 4;
    shr.b32 t1, t1, 4;
    lop3.b32 u0, t0, mask, bias, 0xEA;
    lop3.b32 u1, t1, mask, bias, 0xEA;
    {fix.format(out="$2", x="u0")}
    {fix.format(out="$3", x="u1")}
}}"""


# fp16: 1024 + q - 1032; bf16: 1.0 * (128 + q) - 136 (fma: bf16x2 sub needs sm_90)
_PTX_F16 = tl.constexpr(_ptx_split("0x64006400", "mov.b32 k0, 0x64086408; sub.f16x2 {out}, {x}, k0;"))
_PTX_BF16 = tl.constexpr(
    _ptx_split("0x43004300", "mov.b32 k0, 0x3F803F80; mov.b32 k1, 0xC308C308; fma.rn.bf16x2 {out}, {x}, k0, k1;")
)


@triton.jit
def _split_nibbles(w, IS_BF16: tl.constexpr, USE_PTX: tl.constexpr):
    """w [G/2, BN] packed bytes -> (low nibbles - 8, high nibbles - 8) in the activation dtype."""
    if USE_PTX:
        if IS_BF16:
            lo, hi = tl.inline_asm_elementwise(
                _PTX_BF16, "=r,=r,=r,=r,r", [w], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
            )
        else:
            lo, hi = tl.inline_asm_elementwise(
                _PTX_F16, "=r,=r,=r,=r,r", [w], dtype=(tl.float16, tl.float16), is_pure=True, pack=4
            )
    else:
        lo = _nibbles_to_float(w & 0xF, IS_BF16)
        hi = _nibbles_to_float(w >> 4, IS_BF16)
    return lo, hi


@triton.jit
def _group_dot(a_lo, a_hi, w, IS_BF16: tl.constexpr, USE_PTX: tl.constexpr):
    """a_lo, a_hi [BM, G/2] activations; w [G/2, BN] packed bytes -> [BM, BN] fp32 partial dot."""
    lo, hi = _split_nibbles(w, IS_BF16, USE_PTX)
    acc = tl.dot(a_lo, lo)
    return tl.dot(a_hi, hi, acc)


@triton.jit
def _activate(x, ACTIVATION: tl.constexpr):
    """ACTIVATION is an ACTIVATION_CODES value."""
    if ACTIVATION == 0:
        return x / (1.0 + tl.exp(-x))
    return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))


@triton.jit
def gate_up_kernel(
    x_ptr, stride_xt,  # [T, H] fp16/bf16 hidden rows
    rows_ptr, order_ptr, bounds_ptr,  # [P] pair rows, [P] int32 pairs by expert, [E+1] int32
    w_ptr, stride_we, stride_wn,  # [E, 2I, H/2] uint8
    s_ptr, stride_se, stride_sg,  # [E, H/G, 2I] fp32
    act_ptr, stride_at,  # [P, I] out: act(gate) * up, at each pair's sorted position
    I, H,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ACTIVATION: tl.constexpr, IS_BF16: tl.constexpr, USE_PTX: tl.constexpr,
):
    e = tl.program_id(0)
    start = tl.load(bounds_ptr + e)
    end = tl.load(bounds_ptr + e + 1)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] gate rows; up rows are + I
    n_mask = offs_n < I
    offs_j = tl.arange(0, GROUP // 2)  # [G/2]
    w_gate = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_j[:, None]  # [G/2, BN]
    w_up = w_gate + I * stride_wn
    s_gate = s_ptr + e * stride_se + offs_n  # [BN]
    s_up = s_gate + I
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)  # [BM] sorted positions
        m_mask = offs_m < end
        pairs = tl.load(order_ptr + offs_m, mask=m_mask, other=0)
        rows = tl.load(rows_ptr + pairs, mask=m_mask, other=0)
        x_lo = x_ptr + rows[:, None] * stride_xt + offs_j[None, :]  # [BM, G/2]
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for g in range(0, H // GROUP):
            a_lo = tl.load(x_lo + g * GROUP, mask=m_mask[:, None], other=0.0)
            a_hi = tl.load(x_lo + g * GROUP + GROUP // 2, mask=m_mask[:, None], other=0.0)
            wg = tl.load(w_gate + g * (GROUP // 2), mask=n_mask[None, :], other=0)
            wu = tl.load(w_up + g * (GROUP // 2), mask=n_mask[None, :], other=0)
            sg = tl.load(s_gate + g * stride_sg, mask=n_mask, other=0.0)
            su = tl.load(s_up + g * stride_sg, mask=n_mask, other=0.0)
            acc_gate += _group_dot(a_lo, a_hi, wg, IS_BF16, USE_PTX) * sg[None, :]
            acc_up += _group_dot(a_lo, a_hi, wu, IS_BF16, USE_PTX) * su[None, :]
        y = _activate(acc_gate, ACTIVATION) * acc_up  # [BM, BN] fp32
        out = act_ptr + offs_m[:, None] * stride_at + offs_n[None, :]
        tl.store(out, y.to(act_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def down_kernel(
    act_ptr, stride_at,  # [P, I] fp16/bf16, sorted positions
    rows_ptr, weights_ptr, order_ptr, bounds_ptr,  # [P] pair rows, [P] fp32 router weights, [P], [E+1]
    w_ptr, stride_we, stride_wn,  # [E, H, I/2] uint8
    s_ptr, stride_se, stride_sg,  # [E, I/G, H] fp32
    out_ptr, stride_ot,  # [T, H] fp32, accumulated with atomics (a row's pairs live in other programs)
    H, I,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_BF16: tl.constexpr, USE_PTX: tl.constexpr,
):
    e = tl.program_id(0)
    start = tl.load(bounds_ptr + e)
    end = tl.load(bounds_ptr + e + 1)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = offs_n < H
    offs_j = tl.arange(0, GROUP // 2)
    w_base = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_j[:, None]  # [G/2, BN]
    s_base = s_ptr + e * stride_se + offs_n
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        pairs = tl.load(order_ptr + offs_m, mask=m_mask, other=0)
        rows = tl.load(rows_ptr + pairs, mask=m_mask, other=0)
        router = tl.load(weights_ptr + pairs, mask=m_mask, other=0.0)  # [BM]
        a_base = act_ptr + offs_m[:, None] * stride_at + offs_j[None, :]  # [BM, G/2]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for g in range(0, I // GROUP):
            a_lo = tl.load(a_base + g * GROUP, mask=m_mask[:, None], other=0.0)
            a_hi = tl.load(a_base + g * GROUP + GROUP // 2, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_base + g * (GROUP // 2), mask=n_mask[None, :], other=0)
            s = tl.load(s_base + g * stride_sg, mask=n_mask, other=0.0)
            acc += _group_dot(a_lo, a_hi, w, IS_BF16, USE_PTX) * s[None, :]
        acc = acc * router[:, None]
        out = out_ptr + rows[:, None] * stride_ot + offs_n[None, :]
        tl.atomic_add(out, acc, mask=m_mask[:, None] & n_mask[None, :])
