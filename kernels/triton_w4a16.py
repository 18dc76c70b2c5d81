"""Triton kernels of the grouped W4A16 MoE: routing, gate_up + activation, then down + router weight.

Layout (made by kernels.backends.triton_moe from the canonical one), per projection [E, N, K]:
  w: [E, Np/BN, Kp/BK, BN, BK/4] int16: tiles of BN output rows x BK inputs, each tile one
     contiguous block (a program's loads stream whole tiles). Np, Kp: N, K rounded up to BN, BK;
     gate_up holds the gate rows then the up rows, each padded to Ip. Q = BK/4; element (n, c) of
     tile (nb, b) holds the four nibbles of k = b*BK + i*Q + c, i = 0..3, nibble i in bits 4i..4i+3.
     Two adjacent elements form one 32-bit register, so one lop3 turns nibble i of both into a
     bf16x2/f16x2 pair: four registers per word, three shifts, no byte shuffles. Quarter i is its
     own tl.dot with the matching Q columns of x (16-bit operands on both sides, ldmatrix-friendly).
  s: [E, Kp/G, Np] float32 signed scales (zero in the padding), N contiguous; the scale multiplies
     each group's fp32 partial dot, not the weights.
Routing: route_kernel (one program) groups the pairs by expert: bounds [E+1], and per sorted
position the row, pair index and router weight, so gate_up reads x rows with one indirection and
down reads act rows contiguously; it also sorts the pairs by row for the combine. One program
owns (expert e, BN output columns) and walks that expert's pairs in BLOCK_M chunks. down writes
each pair's router-weighted row to its own row of a [P, H] fp32 buffer; combine_kernel sums a
row's pairs in pair order. No float atomics: the output is bitwise the same run to run. gate_up
also zeroes a slice of `out` (rows without pairs stay zero).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _nibbles_to_float(q, IS_BF16: tl.constexpr):
    """int32 nibbles in 0..15 -> (q - 8) exactly, in fp16 or bf16, with the exponent-bias trick.

    OR-ing q into the mantissa of 1024.0 (fp16 0x6400) or 128.0 (bf16 0x4300) gives 1024 + q or
    128 + q exactly; one subtraction removes the bias and the zero point.
    """
    q16 = q.to(tl.uint16)
    if IS_BF16:
        f = ((q16 | 0x4300).to(tl.bfloat16, bitcast=True) - 136.0).to(tl.bfloat16)
    else:
        f = ((q16 | 0x6400).to(tl.float16, bitcast=True) - 1032.0).to(tl.float16)
    return f


def _ptx_quarters(bias: str, fix: str) -> str:
    """PTX: $4 = two int16 elements (bits 0-15, 16-31) -> $i = nibble i of both, as a 16-bit pair.

    lop3 keeps one nibble per half and ORs in the exponent bias (1024 fp16 / 128 bf16); one paired
    op removes bias + 8.
    """
    body = [f"lop3.b32 u, $4, 0x000F000F, {bias}, 0xEA;", fix.format(out="$0", x="u")]
    for i in (1, 2, 3):
        body += [f"shr.b32 t, $4, {4 * i};", f"lop3.b32 u, t, 0x000F000F, {bias}, 0xEA;", fix.format(out=f"${i}", x="u")]
    return "{\n.reg .b32 t, u, k0, k1;\n" + "\n".join(body) + "\n}"


# fp16: 1024 + q - 1032; bf16: 1.0 * (128 + q) - 136 (fma: bf16x2 sub needs sm_90)
_PTX_F16 = tl.constexpr(_ptx_quarters("0x64006400", "mov.b32 k0, 0x64086408; sub.f16x2 {out}, {x}, k0;"))
_PTX_BF16 = tl.constexpr(
    _ptx_quarters("0x43004300", "mov.b32 k0, 0x3F803F80; mov.b32 k1, 0xC308C308; fma.rn.bf16x2 {out}, {x}, k0, k1;")
)


@triton.jit
def _split_quarters(w, IS_BF16: tl.constexpr, USE_PTX: tl.constexpr):
    """w [..] int16, four nibbles each -> four tensors of (nibble i - 8) in the activation dtype."""
    if USE_PTX:
        if IS_BF16:
            q0, q1, q2, q3 = tl.inline_asm_elementwise(
                _PTX_BF16, "=r,=r,=r,=r,r", [w], dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
                is_pure=True, pack=2,
            )
        else:
            q0, q1, q2, q3 = tl.inline_asm_elementwise(
                _PTX_F16, "=r,=r,=r,=r,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                is_pure=True, pack=2,
            )
    else:
        v = w.to(tl.int32)
        q0 = _nibbles_to_float(v & 0xF, IS_BF16)
        q1 = _nibbles_to_float((v >> 4) & 0xF, IS_BF16)
        q2 = _nibbles_to_float((v >> 8) & 0xF, IS_BF16)
        q3 = _nibbles_to_float((v >> 12) & 0xF, IS_BF16)
    return q0, q1, q2, q3


@triton.jit
def _load_x(ptrs, row_mask, cols, K, EVEN_K: tl.constexpr):
    """[BM, Q] activations; rows past the expert's pairs and columns past K read as 0."""
    if EVEN_K:
        return tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    return tl.load(ptrs, mask=row_mask[:, None] & (cols[None, :] < K), other=0.0)


@triton.jit
def _scaled_block(acc, x0, x1, x2, x3, w0, w1, w2, w3, s_ptrs, b, stride_sg,
                  BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """acc [BM, BN] += sum over quarters i of (x_i @ w_i) * scale of the quarter's group, in fp32.

    Quarter i of block b covers k in [b*BLOCK_K + i*Q, +Q), Q = BLOCK_K/4 <= GROUP.
    """
    if GROUP >= BLOCK_K:  # the whole block lies in one group
        s = tl.load(s_ptrs + ((b * BLOCK_K) // GROUP) * stride_sg)
        p = tl.dot(x3, w3, tl.dot(x2, w2, tl.dot(x1, w1, tl.dot(x0, w0))))
        acc += p * s[None, :]
    elif GROUP * 2 == BLOCK_K:  # quarters 0-1 and 2-3
        s0 = tl.load(s_ptrs + (2 * b) * stride_sg)
        s1 = tl.load(s_ptrs + (2 * b + 1) * stride_sg)
        acc += tl.dot(x1, w1, tl.dot(x0, w0)) * s0[None, :]
        acc += tl.dot(x3, w3, tl.dot(x2, w2)) * s1[None, :]
    else:  # GROUP * 4 == BLOCK_K: one group per quarter
        s0 = tl.load(s_ptrs + (4 * b) * stride_sg)
        s1 = tl.load(s_ptrs + (4 * b + 1) * stride_sg)
        s2 = tl.load(s_ptrs + (4 * b + 2) * stride_sg)
        s3 = tl.load(s_ptrs + (4 * b + 3) * stride_sg)
        acc += tl.dot(x0, w0) * s0[None, :]
        acc += tl.dot(x1, w1) * s1[None, :]
        acc += tl.dot(x2, w2) * s2[None, :]
        acc += tl.dot(x3, w3) * s3[None, :]
    return acc


@triton.jit
def _activate(x, ACTIVATION: tl.constexpr):
    """ACTIVATION is an ACTIVATION_CODES value."""
    if ACTIVATION == 0:
        return x / (1.0 + tl.exp(-x))
    return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))


@triton.jit
def route_kernel(
    experts_ptr, rows_ptr, weights_ptr, P,  # [P] local expert, row, router weight of each pair
    bounds_ptr, srows_ptr, sweights_ptr, spairs_ptr,  # out: [E+1] int32; [P] row, fp32 weight, pair by expert
    crows_ptr, cpairs_ptr,  # out: [P] int32 row and pair, sorted by (row, pair): the combine's order
    E, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """One program: pairs grouped by expert, and by row, both stable (ties in pair order).

    Both orders are sorts of key * BLOCK_P + pair index, so they depend only on the inputs. bounds
    is first the per-expert counter (integer atomics: the counts are exact in any order), an
    exclusive cumsum of the counts gives the starts. Callers keep rows * BLOCK_P below 2^31.
    """
    offs = tl.arange(0, BLOCK_P)
    valid = offs < P
    ex = tl.load(experts_ptr + offs, mask=valid, other=0).to(tl.int32)
    rows = tl.load(rows_ptr + offs, mask=valid, other=0).to(tl.int32)
    offs_e = tl.arange(0, BLOCK_E)
    tl.store(bounds_ptr + offs_e, tl.zeros([BLOCK_E], dtype=tl.int32), mask=offs_e <= E)
    tl.debug_barrier()
    tl.atomic_add(bounds_ptr + ex, 1, mask=valid, sem="relaxed")  # the barrier orders them
    tl.debug_barrier()
    counts = tl.load(bounds_ptr + offs_e, mask=offs_e < E, other=0, volatile=True)
    starts = tl.cumsum(counts, 0) - counts  # starts[E] = P
    tl.debug_barrier()
    tl.store(bounds_ptr + offs_e, starts, mask=offs_e <= E)

    last = 2147483647  # padding lanes sort after every pair
    by_expert = tl.sort(tl.where(valid, ex * BLOCK_P + offs, last))  # [BLOCK_P]
    pair = by_expert % BLOCK_P
    tl.store(spairs_ptr + offs, pair, mask=valid)
    tl.store(srows_ptr + offs, tl.load(rows_ptr + pair, mask=valid, other=0).to(tl.int32), mask=valid)
    tl.store(sweights_ptr + offs, tl.load(weights_ptr + pair, mask=valid, other=0.0).to(tl.float32), mask=valid)
    by_row = tl.sort(tl.where(valid, rows * BLOCK_P + offs, last))  # [BLOCK_P]
    tl.store(crows_ptr + offs, by_row // BLOCK_P, mask=valid)
    tl.store(cpairs_ptr + offs, by_row % BLOCK_P, mask=valid)


@triton.jit
def gate_up_kernel(
    x_ptr, stride_xt,  # [T, H] fp16/bf16 hidden rows
    srows_ptr, bounds_ptr,  # [P] int32 row of each sorted position, [E+1] int32
    w_ptr, stride_we, stride_wt,  # [E, 2*Ip/BN, Hp/BK, BN, BK/4] int16: expert, row-tile strides
    s_ptr, stride_se, stride_sg,  # [E, Hp/G, 2*Ip] fp32
    act_ptr, stride_at,  # [P, I] out: act(gate) * up, at each pair's sorted position
    zero_ptr, zero_numel, zero_chunk,  # fp32 buffer this kernel zeroes (the down kernel's output)
    I, Ip, H,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ACTIVATION: tl.constexpr, IS_BF16: tl.constexpr, USE_PTX: tl.constexpr,
    EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr, ZERO_BLOCK: tl.constexpr,
):
    e = tl.program_id(0)
    nb = tl.program_id(1)
    # this program's slice of the output buffer
    pid = e * tl.num_programs(1) + nb
    z_end = tl.minimum(pid * zero_chunk + zero_chunk, zero_numel)
    for z in range(pid * zero_chunk, z_end, ZERO_BLOCK):
        offs_z = z + tl.arange(0, ZERO_BLOCK)
        tl.store(zero_ptr + offs_z, tl.zeros([ZERO_BLOCK], dtype=tl.float32), mask=offs_z < z_end)

    start = tl.load(bounds_ptr + e)
    end = tl.load(bounds_ptr + e + 1)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] gate rows; up rows are + Ip
    offs_c = tl.arange(0, BLOCK_K // 4)
    in_tile = tl.arange(0, BLOCK_N)[None, :] * (BLOCK_K // 4) + offs_c[:, None]  # [Q, BN] within a tile
    w_gate = w_ptr + e * stride_we + nb * stride_wt + in_tile
    w_up = w_gate + (Ip // BLOCK_N) * stride_wt
    s_gate = s_ptr + e * stride_se + offs_n  # [BN]
    s_up = s_gate + Ip
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)  # [BM] sorted positions
        m_mask = offs_m < end
        rows = tl.load(srows_ptr + offs_m, mask=m_mask, other=0)
        x_base = x_ptr + rows[:, None] * stride_xt + offs_c[None, :]  # [BM, Q]
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for b in tl.range(0, tl.cdiv(H, BLOCK_K), num_stages=NUM_STAGES):
            wg = tl.load(w_gate + b * (BLOCK_N * BLOCK_K // 4))
            wu = tl.load(w_up + b * (BLOCK_N * BLOCK_K // 4))
            k0 = b * BLOCK_K + offs_c
            x0 = _load_x(x_base + b * BLOCK_K, m_mask, k0, H, EVEN_K)
            x1 = _load_x(x_base + b * BLOCK_K + BLOCK_K // 4, m_mask, k0 + BLOCK_K // 4, H, EVEN_K)
            x2 = _load_x(x_base + b * BLOCK_K + 2 * (BLOCK_K // 4), m_mask, k0 + 2 * (BLOCK_K // 4), H, EVEN_K)
            x3 = _load_x(x_base + b * BLOCK_K + 3 * (BLOCK_K // 4), m_mask, k0 + 3 * (BLOCK_K // 4), H, EVEN_K)
            g0, g1, g2, g3 = _split_quarters(wg, IS_BF16, USE_PTX)
            u0, u1, u2, u3 = _split_quarters(wu, IS_BF16, USE_PTX)
            acc_gate = _scaled_block(acc_gate, x0, x1, x2, x3, g0, g1, g2, g3, s_gate, b, stride_sg, BLOCK_K, GROUP)
            acc_up = _scaled_block(acc_up, x0, x1, x2, x3, u0, u1, u2, u3, s_up, b, stride_sg, BLOCK_K, GROUP)
        y = _activate(acc_gate, ACTIVATION) * acc_up  # [BM, BN] fp32
        out = act_ptr + offs_m[:, None] * stride_at + offs_n[None, :]
        tl.store(out, y.to(act_ptr.dtype.element_ty), mask=m_mask[:, None] & (offs_n[None, :] < I))


@triton.jit
def down_kernel(
    act_ptr, stride_at,  # [P, I] fp16/bf16, sorted positions
    spairs_ptr, sweights_ptr, bounds_ptr,  # [P] int32 pair index, [P] fp32 router weights (sorted), [E+1]
    w_ptr, stride_we, stride_wt,  # [E, Hp/BN, Ip/BK, BN, BK/4] int16
    s_ptr, stride_se, stride_sg,  # [E, Ip/G, Hp] fp32
    part_ptr, stride_pp,  # [P, H] fp32 out: each pair's router-weighted row, at its pair index
    H, I,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_BF16: tl.constexpr, USE_PTX: tl.constexpr, EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    e = tl.program_id(0)
    nb = tl.program_id(1)
    start = tl.load(bounds_ptr + e)
    end = tl.load(bounds_ptr + e + 1)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_c = tl.arange(0, BLOCK_K // 4)
    in_tile = tl.arange(0, BLOCK_N)[None, :] * (BLOCK_K // 4) + offs_c[:, None]  # [Q, BN]
    w_base = w_ptr + e * stride_we + nb * stride_wt + in_tile
    s_base = s_ptr + e * stride_se + offs_n
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        acc = down_rows(act_ptr, stride_at, offs_m, m_mask, offs_c, w_base, s_base, stride_sg, I,
                        GROUP, BLOCK_K, BLOCK_M, BLOCK_N, IS_BF16, USE_PTX, EVEN_K, NUM_STAGES)
        pairs = tl.load(spairs_ptr + offs_m, mask=m_mask, other=0)
        router = tl.load(sweights_ptr + offs_m, mask=m_mask, other=0.0)  # [BM]
        out = part_ptr + pairs[:, None] * stride_pp + offs_n[None, :]
        tl.store(out, acc * router[:, None], mask=m_mask[:, None] & (offs_n[None, :] < H))


@triton.jit
def down_rows(
    act_ptr, stride_at, offs_m, m_mask, offs_c, w_base, s_base, stride_sg, I,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_BF16: tl.constexpr, USE_PTX: tl.constexpr, EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """[BM, BN] fp32: act rows offs_m (sorted positions) @ one expert's BN-row weight tile."""
    a_base = act_ptr + offs_m[:, None] * stride_at + offs_c[None, :]  # [BM, Q]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for b in tl.range(0, tl.cdiv(I, BLOCK_K), num_stages=NUM_STAGES):
        w = tl.load(w_base + b * (BLOCK_N * BLOCK_K // 4))
        k0 = b * BLOCK_K + offs_c
        x0 = _load_x(a_base + b * BLOCK_K, m_mask, k0, I, EVEN_K)
        x1 = _load_x(a_base + b * BLOCK_K + BLOCK_K // 4, m_mask, k0 + BLOCK_K // 4, I, EVEN_K)
        x2 = _load_x(a_base + b * BLOCK_K + 2 * (BLOCK_K // 4), m_mask, k0 + 2 * (BLOCK_K // 4), I, EVEN_K)
        x3 = _load_x(a_base + b * BLOCK_K + 3 * (BLOCK_K // 4), m_mask, k0 + 3 * (BLOCK_K // 4), I, EVEN_K)
        w0, w1, w2, w3 = _split_quarters(w, IS_BF16, USE_PTX)
        acc = _scaled_block(acc, x0, x1, x2, x3, w0, w1, w2, w3, s_base, b, stride_sg, BLOCK_K, GROUP)
    return acc


@triton.jit
def combine_kernel(
    part_ptr, stride_pp,  # [P, H] fp32 router-weighted pair rows (down_kernel)
    crows_ptr, cpairs_ptr, P,  # [P] int32 row and pair index, sorted by (row, pair)
    out_ptr, stride_ot,  # [T, H] fp32; rows without pairs keep the zeros gate_up wrote
    H, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out[row] = its pairs' rows summed in pair order, BLOCK_R at a time: a fixed order, no atomics.

    Program (j, nb) works only if sorted position j starts its row's run; the run is contiguous.
    """
    j = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = offs_n < H
    row = tl.load(crows_ptr + j)
    prev = tl.where(j > 0, tl.load(crows_ptr + tl.maximum(j - 1, 0)), -1)  # rows are >= 0
    first = prev != row  # only the program at the start of a row's run writes the row
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    k = j
    more = first
    while more:
        offs_k = k + tl.arange(0, BLOCK_R)  # [BR]
        mine = tl.load(crows_ptr + offs_k, mask=offs_k < P, other=-1) == row
        pairs = tl.load(cpairs_ptr + offs_k, mask=mine, other=0)
        part = tl.load(part_ptr + pairs[:, None] * stride_pp + offs_n[None, :], mask=mine[:, None] & n_mask[None, :],
                       other=0.0)  # [BR, BN]
        acc += tl.sum(part, axis=0)
        k += BLOCK_R
        more = tl.sum(mine.to(tl.int32), axis=0) == BLOCK_R  # a full window: the run may go on
    tl.store(out_ptr + row * stride_ot + offs_n, acc, mask=tl.where(first, n_mask, False))
