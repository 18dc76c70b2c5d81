"""Triton kernels of the grouped W4A16 MoE: routing, gate_up + activation, then down + router weight.

Layout (made by kernels.backends.triton_moe from the canonical one), per projection [E, N, K]:
  w: [E, Np/TN, Kp/BK, TN, BK/4] int16: tiles of TN output rows x BK inputs, each tile one
     contiguous block. Np, Kp: N, K rounded up to TN, BK; gate_up holds the gate rows then the up
     rows, each padded to Ip. Q = BK/4; element (n, c) of tile (nb, b) holds the four nibbles of
     k = b*BK + i*Q + c, i = 0..3, nibble i in bits 4i..4i+3. Two adjacent elements form one
     32-bit register, so one lop3 turns nibble i of both into a bf16x2/f16x2 pair: four registers
     per word, three shifts, no byte shuffles. Decode: quarter i is its own tl.dot with the
     matching Q columns of x (16-bit operands on both sides). Prefill (SCALE_W): the four scaled
     quarters join into one [BLOCK_N, BK] operand in k order, one dot per k-block. A program's
     BLOCK_N rows are BLOCK_N / TN tiles.
  s: [E, Kp/G, Np] float32 signed scales (zero in the padding), N contiguous; the scale multiplies
     each group's fp32 partial dot (decode) or, SCALE_W, the 16-bit weights.
Routing groups the pairs by expert -- bounds [E+1], and per sorted position the row, pair index
and router weight -- and by row for the combine, both stable: up to ROUTE_SCAN_MAX_WORK
(kernels.backends.triton_moe) one launch ranks them, each program owning a few experts or rows and
scanning all pairs (scan_route_kernel, O((E + T) * P) work, no atomics); above, a counting sort over
many programs, O(P) work: route_count_kernel, a cumsum and route_scatter_kernel place the pairs
by expert and by the row's low digit at once, then digit_count_kernel, a cumsum and
digit_scatter_kernel once per further row digit. Rows given in ascending order (ROWS_ASCENDING: pair
order is then row order) are not sorted: only the experts are ranked, or, above
ROUTE_SCAN_MAX_PAIRS_ASCENDING pairs, counted by chunks of pairs in two launches (chunk_count_kernel,
chunk_place_kernel: each chunk's pairs sorted by expert in registers). Positions depend only on the inputs; the
only atomics count integers.
The combine finds a row's pairs through rbounds [T+1] (row t: positions [rbounds[t], rbounds[t+1])
of the (row, pair) order): from the ranking's row counts, from the first pass's counts when
one pass sorts the rows, else a binary search (row_bounds_kernel). Ascending rows give their bounds
themselves: in the ranking launch, or chunk_count_kernel, each pair stores the starts of the rows
that begin at it (_row_starts_scattered).
GEMMs: each expert's pairs split into BLOCK_M-row blocks; one program owns (row block, BLOCK_N
output columns), so a dequantized weight tile serves BLOCK_M rows (8-32 for decode, 64-128 for
prefill; 8 only with SWAP_AB, x then being the 8-wide operand of an m16n8k16 MMA), or, EXPERT_GRID
(main's decode grid, no row-block lookup), (expert, BLOCK_N columns) and walks the expert's row
blocks; SWAP_AB computes the transpose, the weights being the MMA's left operand. gate_up's TILES > 1:
a program owns TILES adjacent column blocks of its row block, in one loop over (column block, k-block).
down writes each pair's router-weighted row to its own row of a [P, H] buffer, bf16 by default (fp32: the
buffer's dtype; SPLIT_K > 1: one such slice per run of k-blocks, each run its own programs); combine_kernel (one
program per row and column block) sums a row's pairs in fp32 in (slice, pair) order. No float atomics: the output
is bitwise the same run to run; rows without pairs get zeros from it.
Dependent launches (USE_GDC: CUDA, sm_90+, launched with launch_pdl): gate_up, down and the combine may
start while the launch before them still runs, so their programs are resident and set up when the previous
launch ends. gate_up waits for the routing (gdc_wait) before touching memory -- what it writes, and any
buffer the caching allocator may have handed over from a tensor freed behind it -- and only then lets down
start. down waits finer (WAIT_EXPERT), on integer counters the routing zeroes (ready [E]): gate_up adds 1
at [e] per act tile of expert e it has stored; a down program waits for its expert's act tiles alone
(release / acquire at GPU scope), so it starts on the experts that are ready while gate_up's last programs still
run (their tail). The combine waits for down (gdc_wait) and writes every row of the output. No deadlock: a
dependent grid starts only once every program of the grid before it has started. Without WAIT_EXPERT, down waits
for the whole of gate_up (gdc_wait).
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


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
    """Activations; rows past the block's pairs and columns past K read as 0 (masks broadcast)."""
    if EVEN_K:
        return tl.load(ptrs, mask=row_mask, other=0.0)
    return tl.load(ptrs, mask=row_mask & (cols < K), other=0.0)


@triton.jit
def _mm(x, w, SWAP_AB: tl.constexpr):
    """x @ w, or with SWAP_AB its transpose w @ x (x [Q, BM], w [BN, Q]).

    Swapped, the dequantized weights are the left operand, which Hopper's wgmma takes from registers.
    """
    if SWAP_AB:
        p = tl.dot(w, x)
    else:
        p = tl.dot(x, w)
    return p


@triton.jit
def _mma(x, w, acc, SWAP_AB: tl.constexpr):
    """acc + _mm(x, w)."""
    if SWAP_AB:
        p = tl.dot(w, x, acc)
    else:
        p = tl.dot(x, w, acc)
    return p


@triton.jit
def _per_column(s, SWAP_AB: tl.constexpr):
    """[BN] scales broadcast along a tile's N axis (the accumulator's or a weight tile's): its rows
    under SWAP_AB, its columns otherwise."""
    if SWAP_AB:
        cols = s[:, None]
    else:
        cols = s[None, :]
    return cols


@triton.jit
def _scaled_block(acc, x0, x1, x2, x3, w0, w1, w2, w3, s_ptrs, n_ok, b, stride_sg,
                  BLOCK_K: tl.constexpr, GROUP: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc += sum over quarters i of (x_i @ w_i) * scale of the quarter's group, in fp32.

    Quarter i of block b covers k in [b*BLOCK_K + i*Q, +Q), Q = BLOCK_K/4 <= GROUP.
    """
    if GROUP >= BLOCK_K:  # the whole block lies in one group
        s = tl.load(s_ptrs + ((b * BLOCK_K) // GROUP) * stride_sg, mask=n_ok, other=0.0)
        p = _mma(x3, w3, _mma(x2, w2, _mma(x1, w1, _mm(x0, w0, SWAP_AB), SWAP_AB), SWAP_AB), SWAP_AB)
        acc += p * _per_column(s, SWAP_AB)
    elif GROUP * 2 == BLOCK_K:  # quarters 0-1 and 2-3
        s0 = tl.load(s_ptrs + (2 * b) * stride_sg, mask=n_ok, other=0.0)
        s1 = tl.load(s_ptrs + (2 * b + 1) * stride_sg, mask=n_ok, other=0.0)
        acc += _mma(x1, w1, _mm(x0, w0, SWAP_AB), SWAP_AB) * _per_column(s0, SWAP_AB)
        acc += _mma(x3, w3, _mm(x2, w2, SWAP_AB), SWAP_AB) * _per_column(s1, SWAP_AB)
    else:  # GROUP * 4 == BLOCK_K: one group per quarter
        s0 = tl.load(s_ptrs + (4 * b) * stride_sg, mask=n_ok, other=0.0)
        s1 = tl.load(s_ptrs + (4 * b + 1) * stride_sg, mask=n_ok, other=0.0)
        s2 = tl.load(s_ptrs + (4 * b + 2) * stride_sg, mask=n_ok, other=0.0)
        s3 = tl.load(s_ptrs + (4 * b + 3) * stride_sg, mask=n_ok, other=0.0)
        acc += _mm(x0, w0, SWAP_AB) * _per_column(s0, SWAP_AB)
        acc += _mm(x1, w1, SWAP_AB) * _per_column(s1, SWAP_AB)
        acc += _mm(x2, w2, SWAP_AB) * _per_column(s2, SWAP_AB)
        acc += _mm(x3, w3, SWAP_AB) * _per_column(s3, SWAP_AB)
    return acc


@triton.jit
def _weight_scale(s_ptrs, n_ok, group, stride_sg, dtype: tl.constexpr, SWAP_AB: tl.constexpr):
    """One group's [BN] scales in the weights' dtype, shaped to multiply a weight tile."""
    s = tl.load(s_ptrs + group * stride_sg, mask=n_ok, other=0.0).to(dtype)
    return _per_column(s, SWAP_AB)


@triton.jit
def _scaled_weights(w0, w1, w2, w3, s_ptrs, n_ok, b, stride_sg,
                    BLOCK_K: tl.constexpr, GROUP: tl.constexpr, SWAP_AB: tl.constexpr):
    """The four quarters of k-block b times their groups' scales, as one [BN, BLOCK_K] tile in k order
    ([BLOCK_K, BN] unswapped), for one dot per k-block.

    The scale multiplies the 16-bit weights (one more rounding, as vLLM's kernel does), so the MMAs
    accumulate straight into acc and stay asynchronous across k-blocks: the prefill form.
    _scaled_block keeps each group's partial in fp32 instead. The joins and the permute only
    relabel registers (checked in the sm_90 TTGIR: no layout conversion between dequant and wgmma).
    """
    s0 = _weight_scale(s_ptrs, n_ok, (b * BLOCK_K) // GROUP, stride_sg, w0.dtype, SWAP_AB)
    if GROUP >= BLOCK_K:
        s1 = s0
        s2 = s0
        s3 = s0
    elif GROUP * 2 == BLOCK_K:
        s1 = s0
        s2 = _weight_scale(s_ptrs, n_ok, 2 * b + 1, stride_sg, w0.dtype, SWAP_AB)
        s3 = s2
    else:
        s1 = _weight_scale(s_ptrs, n_ok, 4 * b + 1, stride_sg, w0.dtype, SWAP_AB)
        s2 = _weight_scale(s_ptrs, n_ok, 4 * b + 2, stride_sg, w0.dtype, SWAP_AB)
        s3 = _weight_scale(s_ptrs, n_ok, 4 * b + 3, stride_sg, w0.dtype, SWAP_AB)
    quads = tl.join(tl.join(w0 * s0, w2 * s2), tl.join(w1 * s1, w3 * s3))  # [.., .., i0, j]: quarter 2*i0 + j
    if SWAP_AB:  # [BN, Q, 2, 2] -> [BN, i0, j, Q] -> [BN, BLOCK_K]
        tile = tl.reshape(tl.permute(quads, (0, 2, 3, 1)), [w0.shape[0], BLOCK_K])
    else:  # [Q, BN, 2, 2] -> [i0, j, Q, BN] -> [BLOCK_K, BN]
        tile = tl.reshape(tl.permute(quads, (2, 3, 0, 1)), [BLOCK_K, w0.shape[1]])
    return tile


@triton.jit
def _activate(x, ACTIVATION: tl.constexpr):
    """ACTIVATION is an ACTIVATION_CODES value."""
    if ACTIVATION == 0:
        return x / (1.0 + tl.exp(-x))
    return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))


@triton.jit
def _signal(count_ptr, amount=1):
    """Adds amount to *count_ptr once every thread of the program has stored what it publishes (release, GPU
    scope)."""
    tl.debug_barrier()
    tl.atomic_add(count_ptr, amount, sem="release", scope="gpu")


@triton.jit
def _wait_count(count_ptr, need):
    """Waits until *count_ptr >= need (acquire, GPU scope): what the signalling programs stored is then visible to
    every thread of this program."""
    seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    while seen < need:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _zero_ready(ready_ptr, numel, READY_BLOCK: tl.constexpr):
    """Program pid's share of ready[0..numel) = 0 (gate_up's per-expert counts of finished act tiles), READY_BLOCK
    counters per store."""
    chunk = tl.cdiv(numel, tl.num_programs(0))
    start = tl.program_id(0) * chunk
    end = tl.minimum(start + chunk, numel)
    for z in range(start, end, READY_BLOCK):
        offs = z + tl.arange(0, READY_BLOCK)
        tl.store(ready_ptr + offs, tl.zeros([READY_BLOCK], dtype=ready_ptr.dtype.element_ty), mask=offs < end)


# ---- routing ----------------------------------------------------------------------------------------


# ranking by scans: each program owns KEYS consecutive keys (experts, or rows) and scans every pair twice,
# counting first, then placing its keys' pairs. O((E + T) * P) work in one launch: for decode and small prefill.
PAST_KEYS = tl.constexpr(1 << 30)  # the key of padding lanes: above every real key and every program's keys


@triton.jit
def _scan_keys(keys_ptr, k0, K, P, starts_ptr, pair_out, rows_out, rows_ptr, weights_ptr, weights_out,
               BLOCK_P: tl.constexpr, KEYS: tl.constexpr, BY_EXPERT: tl.constexpr):
    """Keys k0..k0+KEYS-1 (< K) of keys [P]: starts[k + 1] = pairs with a key <= k (starts[0] = 0 by the program
    of key 0), and each of their pairs to position starts[key] + its rank among the key's pairs in pair order.
    The position gets the pair index and its row; BY_EXPERT (keys are experts) also its fp32 router weight,
    else the keys are the rows."""
    keys = k0 + tl.arange(0, KEYS)  # [KEYS]
    below = tl.zeros([1], dtype=tl.int32)  # pairs with a key below k0
    count = tl.zeros([KEYS], dtype=tl.int32)
    for p0 in range(0, P, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        key = tl.load(keys_ptr + offs, mask=offs < P, other=PAST_KEYS).to(tl.int32)  # [BP]
        below += tl.sum((key < k0).to(tl.int32), 0)
        count += tl.sum((key[:, None] == keys[None, :]).to(tl.int32), 0)
    starts = below + tl.cumsum(count, 0) - count  # [KEYS] first position of each key
    tl.store(starts_ptr + keys + 1, starts + count, mask=keys < K)
    tl.store(starts_ptr + keys, starts, mask=keys == 0)
    for p0 in range(0, P, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        key = tl.load(keys_ptr + offs, mask=offs < P, other=PAST_KEYS).to(tl.int32)
        hot = (key[:, None] == keys[None, :]).to(tl.int32)  # [BP, KEYS]
        dest = tl.sum(hot * (tl.cumsum(hot, 0) + starts[None, :] - 1), 1)  # [BP] where each of my pairs goes
        mine = (key >= k0) & (key < k0 + KEYS)
        tl.store(pair_out + dest, offs, mask=mine)
        if BY_EXPERT:
            tl.store(rows_out + dest, tl.load(rows_ptr + offs, mask=mine, other=0).to(tl.int32), mask=mine)
            tl.store(weights_out + dest, tl.load(weights_ptr + offs, mask=mine, other=0.0).to(tl.float32), mask=mine)
        else:
            tl.store(rows_out + dest, key, mask=mine)
        starts += tl.sum(hot, 0)


@triton.jit
def scan_route_kernel(
    experts_ptr, rows_ptr, weights_ptr, P, E, T,  # [P] local expert, row (< T), router weight of each pair
    bounds_ptr, srows_ptr, sweights_ptr, spairs_ptr,  # out: [E+1] int32; [P] row, fp32 weight, pair by expert
    crows_ptr, cpairs_ptr, rbounds_ptr,  # out: [P] int32 row and pair sorted by (row, pair); [T+1] int32
    ready_ptr,  # out: [E] int32 zeroed (_zero_ready)
    BLOCK_P: tl.constexpr, KEYS: tl.constexpr, READY_BLOCK: tl.constexpr, ROWS_ASCENDING: tl.constexpr,
    ROW_KEYS: tl.constexpr, USE_GDC: tl.constexpr,
):
    """Both stable orders by ranking, no atomics: programs 0..cdiv(E, KEYS)-1 own KEYS experts each, the rest
    KEYS rows each (_scan_keys). Positions depend only on the inputs.
    ROWS_ASCENDING (the rows never decrease: pair order is row order): the row programs, cdiv(P + 1, ROW_KEYS),
    only store the starts of the rows that begin at their ROW_KEYS pairs (_row_starts_scattered, rows 0..T:
    rbounds [T+1]); crows and cpairs are not written."""
    if USE_GDC:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    _zero_ready(ready_ptr, E, READY_BLOCK)
    expert_programs = tl.cdiv(E, KEYS)
    if pid < expert_programs:
        _scan_keys(experts_ptr, pid * KEYS, E, P, bounds_ptr, spairs_ptr, srows_ptr, rows_ptr, weights_ptr,
                   sweights_ptr, BLOCK_P, KEYS, True)
    elif ROWS_ASCENDING:
        _row_starts_scattered(rows_ptr, P, T, (pid - expert_programs) * ROW_KEYS, rbounds_ptr, ROW_KEYS)
    else:
        _scan_keys(rows_ptr, (pid - expert_programs) * KEYS, T, P, rbounds_ptr, cpairs_ptr, crows_ptr, rows_ptr,
                   weights_ptr, sweights_ptr, BLOCK_P, KEYS, False)


# rows given in ascending order, too many pairs to rank: counting by expert in two launches, O(P) work. Program c of
# each owns the pairs of chunk c, [c*CHUNK, +CHUNK); chunk_count_kernel counts its experts, chunk_place_kernel adds up
# every chunk's counts it needs itself (no cumsum launch between them) and places its pairs, sorted in registers.


@triton.jit
def chunk_count_kernel(
    experts_ptr, rows_ptr, P, T,  # [P] local expert, row (< T, ascending) of each pair
    counts_ptr,  # out: [chunks, EXPERT_DIGITS] int32, chunk c's count of each expert
    rbounds_ptr,  # out: [T+1] int32, the first position of each row (P past the last)
    ready_ptr, E,  # out: [E] int32 zeroed (_zero_ready)
    CHUNK: tl.constexpr, EXPERT_DIGITS: tl.constexpr, READY_BLOCK: tl.constexpr, USE_GDC: tl.constexpr,
):
    """Chunk c's expert counts; its pairs also store the starts of the rows that begin at them (_row_starts_scattered),
    the last chunk's the starts past the last pair's row."""
    if USE_GDC:
        gdc_launch_dependents()
    c = tl.program_id(0)
    _zero_ready(ready_ptr, E, READY_BLOCK)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    valid = offs < P
    expert = tl.load(experts_ptr + offs, mask=valid, other=0).to(tl.int32)
    tl.store(counts_ptr + c * EXPERT_DIGITS + tl.arange(0, EXPERT_DIGITS), tl.histogram(expert, EXPERT_DIGITS, mask=valid))
    _row_starts_scattered(rows_ptr, P, T, c * CHUNK, rbounds_ptr, CHUNK)
    if c == tl.num_programs(0) - 1:  # pair P (rows[P] = T), past the chunk when CHUNK divides P
        _row_starts_scattered(rows_ptr, P, T, P, rbounds_ptr, 16)


@triton.jit
def chunk_place_kernel(
    experts_ptr, rows_ptr, weights_ptr, P, E,  # [P] local expert, row, router weight of each pair
    counts_ptr, num_chunks,  # [num_chunks, EXPERT_DIGITS] int32: chunk_count_kernel's
    bounds_ptr, srows_ptr, sweights_ptr, spairs_ptr,  # out: [E+1] int32; [P] row, fp32 weight, pair by expert
    CHUNK: tl.constexpr, EXPERT_DIGITS: tl.constexpr, COUNT_ROWS: tl.constexpr, USE_GDC: tl.constexpr,
):
    """Chunk c's pairs to their places by expert, stable: a pair of expert e goes to e's start (the pairs of lower
    experts, over all chunks) + e's pairs in chunks before c + its rank among e's pairs in its chunk, which sorting
    the chunk's (expert, pair) keys gives. Program 0 stores the bounds."""
    if USE_GDC:
        gdc_wait()  # chunk_count_kernel's counts
        gdc_launch_dependents()
    c = tl.program_id(0)
    d = tl.arange(0, EXPERT_DIGITS)
    total = tl.zeros([EXPERT_DIGITS], dtype=tl.int32)  # over all chunks
    before = tl.zeros([EXPERT_DIGITS], dtype=tl.int32)  # over chunks before c
    own = tl.zeros([EXPERT_DIGITS], dtype=tl.int32)  # chunk c's
    for c0 in range(0, num_chunks, COUNT_ROWS):
        chunks = c0 + tl.arange(0, COUNT_ROWS)
        counts = tl.load(counts_ptr + chunks[:, None] * EXPERT_DIGITS + d[None, :], mask=(chunks < num_chunks)[:, None],
                         other=0)  # [COUNT_ROWS, ED]
        total += tl.sum(counts, 0)
        before += tl.sum(tl.where((chunks < c)[:, None], counts, 0), 0)
        own += tl.sum(tl.where((chunks == c)[:, None], counts, 0), 0)
    start = tl.cumsum(total, 0) - total  # [ED] each expert's first position
    if c == 0:
        tl.store(bounds_ptr + d, start, mask=d < E)
        tl.store(bounds_ptr + E, P)
    # the chunk's pairs in (expert, pair) order: sorted position i of expert e goes to start[e] + before[e] + i - the
    # chunk's pairs of experts below e
    local = tl.arange(0, CHUNK)
    offs = c * CHUNK + local
    valid = offs < P
    expert = tl.load(experts_ptr + offs, mask=valid, other=0).to(tl.int32)
    key = tl.sort(tl.where(valid, expert, EXPERT_DIGITS) * CHUNK + local)  # padding lanes last
    expert, pair = key // CHUNK, c * CHUNK + key % CHUNK
    mine = expert < EXPERT_DIGITS
    shift = start + before - (tl.cumsum(own, 0) - own)  # [ED]
    dest = tl.gather(shift, tl.where(mine, expert, 0), 0) + local
    tl.store(spairs_ptr + dest, pair, mask=mine)
    tl.store(srows_ptr + dest, tl.load(rows_ptr + pair, mask=mine, other=0).to(tl.int32), mask=mine)
    tl.store(sweights_ptr + dest, tl.load(weights_ptr + pair, mask=mine, other=0.0).to(tl.float32), mask=mine)


# stable counting sort, digit by digit, over many programs: O(P) work in a fixed number of launches.
# The first pass sorts by expert and by the row's low digit at once (both start from pair order);
# rows with more bits take further passes by row alone.


@triton.jit
def _digits(keys_ptr, offs, valid, shift, NUM_DIGITS: tl.constexpr):
    """[BP] digit (key >> shift) % NUM_DIGITS of the keys at positions offs; padding lanes get NUM_DIGITS."""
    key = tl.load(keys_ptr + offs, mask=valid, other=0).to(tl.int32)
    return tl.where(valid, (key >> shift) & (NUM_DIGITS - 1), NUM_DIGITS)


@triton.jit
def _store_counts(keys_ptr, shift, P, counts_ptr, num_blocks, BLOCK_P: tl.constexpr, NUM_DIGITS: tl.constexpr):
    """Program b's count of each digit among positions [b*BLOCK_P, +BLOCK_P) into counts[1 + d*num_blocks + b]
    (digit-major, so one exclusive cumsum gives every (digit, block)'s first output position); [0] = 0."""
    b = tl.program_id(0)
    offs = b * BLOCK_P + tl.arange(0, BLOCK_P)
    digit = _digits(keys_ptr, offs, offs < P, shift, NUM_DIGITS)  # [BP]
    d = tl.arange(0, NUM_DIGITS)
    counts = tl.sum((digit[:, None] == d[None, :]).to(tl.int32), axis=0)  # [ND]
    tl.store(counts_ptr + 1 + d * num_blocks + b, counts)
    tl.store(counts_ptr, 0, mask=b == 0)


@triton.jit
def _destinations(keys_ptr, shift, P, starts_ptr, num_blocks,
                  BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, NUM_DIGITS: tl.constexpr):
    """[BP] new positions of program b's positions: the (digit, block) start + how many earlier positions
    of the block share the digit (compared BLOCK_C at a time, unrolled). Stable, a function of the inputs."""
    b = tl.program_id(0)
    offs = b * BLOCK_P + tl.arange(0, BLOCK_P)
    valid = offs < P
    digit = _digits(keys_ptr, offs, valid, shift, NUM_DIGITS)  # [BP]
    rank = tl.zeros([BLOCK_P], dtype=tl.int32)
    for c0 in tl.static_range(0, BLOCK_P, BLOCK_C):
        offs_c = b * BLOCK_P + c0 + tl.arange(0, BLOCK_C)
        digit_c = _digits(keys_ptr, offs_c, offs_c < P, shift, NUM_DIGITS)  # [BC]
        earlier = (digit_c[None, :] == digit[:, None]) & (offs_c[None, :] < offs[:, None])  # [BP, BC]
        rank += tl.sum(earlier.to(tl.int32), axis=1)
    return tl.load(starts_ptr + digit * num_blocks + b, mask=valid, other=0) + rank


@triton.jit
def route_count_kernel(
    experts_ptr, rows_ptr, P,  # [P] local expert, row of each pair
    counts_ptr, stride_c, num_blocks,  # out: [2, 1 + NUM_DIGITS * num_blocks] int32: by expert (the first
    # 1 + EXPERT_DIGITS * num_blocks), by row digit
    ready_ptr, E,  # out: [E] int32 zeroed (_zero_ready)
    BLOCK_P: tl.constexpr, EXPERT_DIGITS: tl.constexpr, NUM_DIGITS: tl.constexpr, READY_BLOCK: tl.constexpr,
):
    """The first pass's counts: experts (< EXPERT_DIGITS) and the rows' low digit (row % NUM_DIGITS)."""
    _zero_ready(ready_ptr, E, READY_BLOCK)
    _store_counts(experts_ptr, 0, P, counts_ptr, num_blocks, BLOCK_P, EXPERT_DIGITS)
    _store_counts(rows_ptr, 0, P, counts_ptr + stride_c, num_blocks, BLOCK_P, NUM_DIGITS)


@triton.jit
def route_scatter_kernel(
    experts_ptr, rows_ptr, weights_ptr, P,  # [P] local expert, row, router weight of each pair
    starts_ptr, stride_s, num_blocks,  # [2, 1 + NUM_DIGITS * num_blocks] int32: route_count_kernel's, cumsum
    srows_ptr, sweights_ptr, spairs_ptr,  # out: [P] row, fp32 router weight, pair index by expert
    crows_ptr, cpairs_ptr,  # out: [P] row and pair index by the rows' low digit (then pair)
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, EXPERT_DIGITS: tl.constexpr, NUM_DIGITS: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """The first pass: every pair to its place by expert and by row digit, both stable."""
    if USE_GDC:  # the last routing launch when this pass sorts whole rows
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    valid = offs < P
    row = tl.load(rows_ptr + offs, mask=valid, other=0).to(tl.int32)
    by_expert = _destinations(experts_ptr, 0, P, starts_ptr, num_blocks, BLOCK_P, BLOCK_C, EXPERT_DIGITS)
    tl.store(spairs_ptr + by_expert, offs, mask=valid)
    tl.store(srows_ptr + by_expert, row, mask=valid)
    tl.store(sweights_ptr + by_expert, tl.load(weights_ptr + offs, mask=valid, other=0.0).to(tl.float32), mask=valid)
    by_row = _destinations(rows_ptr, 0, P, starts_ptr + stride_s, num_blocks, BLOCK_P, BLOCK_C, NUM_DIGITS)
    tl.store(cpairs_ptr + by_row, offs, mask=valid)
    tl.store(crows_ptr + by_row, row, mask=valid)


@triton.jit
def digit_count_kernel(
    keys_ptr, P, shift,  # [P] int keys, in the current order
    counts_ptr, num_blocks,  # out: [1 + NUM_DIGITS * num_blocks] int32, [0] = 0, then counts digit-major
    BLOCK_P: tl.constexpr, NUM_DIGITS: tl.constexpr,
):
    """A later pass by row: program b counts each digit among positions [b*BLOCK_P, +BLOCK_P)."""
    _store_counts(keys_ptr, shift, P, counts_ptr, num_blocks, BLOCK_P, NUM_DIGITS)


@triton.jit
def digit_scatter_kernel(
    keys_ptr, items_ptr, P, shift,  # [P] row and pair index, in the current order
    starts_ptr, num_blocks,  # [1 + NUM_DIGITS * num_blocks] int32: cumsum of digit_count_kernel's counts
    items_out, keys_out,  # [P] out: pair index and row in the new order
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, NUM_DIGITS: tl.constexpr,
):
    """A later pass by row: each position to its digit's run, keeping the current order within a digit."""
    offs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    valid = offs < P
    dest = _destinations(keys_ptr, shift, P, starts_ptr, num_blocks, BLOCK_P, BLOCK_C, NUM_DIGITS)
    tl.store(items_out + dest, tl.load(items_ptr + offs, mask=valid, other=0), mask=valid)
    tl.store(keys_out + dest, tl.load(keys_ptr + offs, mask=valid, other=0).to(tl.int32), mask=valid)


@triton.jit
def _row_starts(crows_ptr, P, offs_t, steps):
    """[BT] first position j with crows[j] >= t for each t of offs_t (P past the last), crows [P] ascending: a
    binary search per t, steps >= bit_length(P)."""
    lo = tl.zeros(offs_t.shape, dtype=tl.int32)
    hi = tl.zeros(offs_t.shape, dtype=tl.int32) + P
    for _ in range(steps):
        active = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(crows_ptr + mid, mask=active, other=0)
        lo = tl.where(active & (v < offs_t), mid + 1, lo)
        hi = tl.where(active & (v >= offs_t), mid, hi)
    return lo


@triton.jit
def _row_starts_scattered(rows_ptr, P, T, j0, rbounds_ptr, BLOCK: tl.constexpr):
    """rows [P] ascending: rbounds[t] = j for every t in (rows[j - 1], rows[j]], pairs j0..j0+BLOCK-1, where
    rows[-1] = -1 and rows[P] = T (so rbounds[t] = P past the last row). Each pair stores the starts of the rows
    that begin at it: one load per pair instead of a search per row."""
    j = j0 + tl.arange(0, BLOCK)
    ok = j <= P
    row = tl.load(rows_ptr + j, mask=j < P, other=T).to(tl.int32)
    prev = tl.load(rows_ptr + j - 1, mask=ok & (j > 0), other=-1).to(tl.int32)
    gap = tl.where(ok, row - prev, 0)
    for g in range(0, tl.max(gap, 0)):
        tl.store(rbounds_ptr + prev + 1 + g, j, mask=g < gap)


@triton.jit
def row_bounds_kernel(
    crows_ptr, P, T, steps,  # [P] rows in ascending order; steps >= bit_length(P)
    rbounds_ptr,  # out: [T+1] int32, the first position of each row (P past the last)
    BLOCK_T: tl.constexpr, USE_GDC: tl.constexpr,
):
    """rbounds[t] = first j with crows[j] >= t (for rows sorted in several passes, whose last pass's starts are
    digit starts, not row starts)."""
    if USE_GDC:
        gdc_launch_dependents()
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tl.store(rbounds_ptr + offs_t, _row_starts(crows_ptr, P, offs_t, steps), mask=offs_t <= T)


# ---- the grouped GEMMs -------------------------------------------------------------------------------


@triton.jit
def _work_item(pid, num_n, num_m, bounds_ptr, stride_b, E,
               BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr):
    """Program pid -> (expert, first sorted position, end of the expert's positions, column block).

    Each expert's pairs split into BLOCK_M-row blocks, numbered expert by expert; num_m bounds their
    count from above (cdiv(P, BLOCK_M) + experts with pairs), the programs past the last block get
    expert E (no work). GROUP_M row blocks share each column block in turn (L2 reuse of x and w).
    """
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    j = first_m + (pid % in_group) % size_m
    nb = (pid % in_group) // size_m
    offs_e = tl.arange(0, BLOCK_E)
    lo = tl.load(bounds_ptr + offs_e * stride_b, mask=offs_e < E, other=0)
    hi = tl.load(bounds_ptr + (offs_e + 1) * stride_b, mask=offs_e < E, other=0)
    blocks = (hi - lo + BLOCK_M - 1) // BLOCK_M  # [BE] row blocks of each expert
    done = tl.cumsum(blocks, 0)  # [BE] blocks up to and including each expert
    e = tl.sum((done <= j).to(tl.int32), 0)
    before = tl.sum(tl.where(offs_e < e, blocks, 0), 0)
    start = tl.sum(tl.where(offs_e == e, lo, 0), 0)
    end = tl.sum(tl.where(offs_e == e, hi, 0), 0)
    return e, start + (j - before) * BLOCK_M, end, nb


@triton.jit
def _tile_offsets(nb, stride_wt, BLOCK_N: tl.constexpr, TILE_N: tl.constexpr, Q: tl.constexpr,
                  SWAP_AB: tl.constexpr):
    """Element offsets of output rows nb*BLOCK_N.. in k-block 0 ([BN, Q], or [Q, BN] unswapped) and
    the rows' [BN] indices. A program's BLOCK_N rows span BLOCK_N / TILE_N stored tiles."""
    in_block = tl.arange(0, BLOCK_N)
    offs_n = nb * BLOCK_N + in_block
    # BLOCK_N is a multiple of TILE_N: tiles and rows within them from the constant range alone
    tile = (nb * (BLOCK_N // TILE_N) + in_block // TILE_N) * stride_wt + (in_block % TILE_N) * Q  # [BN]
    offs_c = tl.arange(0, Q)
    if SWAP_AB:
        offs = tile[:, None] + offs_c[None, :]
    else:
        offs = tile[None, :] + offs_c[:, None]
    return offs, offs_n


@triton.jit
def _load_w(ptrs, n_ok, SWAP_AB: tl.constexpr, EVEN_N: tl.constexpr):
    """A weight tile; rows past the padded N (n_ok false) read as 0 unless every block is full (EVEN_N)."""
    if EVEN_N:
        w = tl.load(ptrs)
    elif SWAP_AB:
        w = tl.load(ptrs, mask=n_ok[:, None], other=0)
    else:
        w = tl.load(ptrs, mask=n_ok[None, :], other=0)
    return w


@triton.jit
def _x_pointers(x_ptr, rows, stride_xt, m_mask, BLOCK_K: tl.constexpr, WHOLE: tl.constexpr, SWAP_AB: tl.constexpr):
    """Pointers to the first k-block's columns of the given rows ([BM, C], or [C, BM] swapped), the
    broadcastable row mask and column offsets for _load_x. C: BLOCK_K (WHOLE), else a quarter."""
    if WHOLE:
        offs_c = tl.arange(0, BLOCK_K)
    else:
        offs_c = tl.arange(0, BLOCK_K // 4)
    if SWAP_AB:
        ptrs, row_mask, cols = x_ptr + rows[None, :] * stride_xt + offs_c[:, None], m_mask[None, :], offs_c[:, None]
    else:
        ptrs, row_mask, cols = x_ptr + rows[:, None] * stride_xt + offs_c[None, :], m_mask[:, None], offs_c[None, :]
    return ptrs, row_mask, cols


@triton.jit
def _x_quarters(x_base, row_mask, cols, b, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The four BLOCK_K/4-column quarters of k-block b."""
    k0 = b * BLOCK_K
    k1 = k0 + BLOCK_K // 4
    k2 = k0 + 2 * (BLOCK_K // 4)
    k3 = k0 + 3 * (BLOCK_K // 4)
    x0 = _load_x(x_base + k0, row_mask, cols + k0, K, EVEN_K)
    x1 = _load_x(x_base + k1, row_mask, cols + k1, K, EVEN_K)
    x2 = _load_x(x_base + k2, row_mask, cols + k2, K, EVEN_K)
    x3 = _load_x(x_base + k3, row_mask, cols + k3, K, EVEN_K)
    return x0, x1, x2, x3


@triton.jit
def _rows_major(acc, SWAP_AB: tl.constexpr):
    """The accumulator as [BM, BN]."""
    if SWAP_AB:
        rows_major = tl.trans(acc)
    else:
        rows_major = acc
    return rows_major


@triton.jit
def gate_up_kernel(
    x_ptr, stride_xt,  # [T, H] fp16/bf16 hidden rows
    srows_ptr, bounds_ptr, stride_b,  # [P] int32 row of each sorted position, [E+1] int32 (strided)
    w_ptr, stride_we, stride_wt,  # [E, 2*Ip/TN, Hp/BK, TN, BK/4] int16: expert, row-tile strides
    s_ptr, stride_se, stride_sg,  # [E, Hp/G, 2*Ip] fp32
    act_ptr, stride_at,  # [P, I] out: act(gate) * up, at each pair's sorted position
    ready_ptr,  # [E] int32, zeroed by the routing: +1 at [e] per finished act tile of expert e
    num_n, num_m, E, I, Ip, H,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr,
    ACTIVATION: tl.constexpr, IS_BF16: tl.constexpr, USE_PTX: tl.constexpr, SWAP_AB: tl.constexpr,
    SCALE_W: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, NUM_STAGES: tl.constexpr,
    EXPERT_GRID: tl.constexpr, LATE_DEPENDENTS: tl.constexpr, USE_GDC: tl.constexpr, TILES: tl.constexpr,
):
    """One program: BLOCK_N gate columns and their up columns of BLOCK_M sorted positions of one expert
    (program = _work_item's; TILES > 1: TILES adjacent column blocks, num_n a multiple of TILES), or EXPERT_GRID
    of each of the expert's row blocks in turn (program = column block * E + expert). Each act tile it stores
    it counts in ready[e].
    LATE_DEPENDENTS: down may start only once every program has waited for the routing (down, or the combine
    after it, then reads the routing's output without a gdc_wait of its own)."""
    pid = tl.program_id(0)
    if USE_GDC:
        if not LATE_DEPENDENTS:
            gdc_launch_dependents()
        gdc_wait()  # the routing's output, and `act` (its memory may have been a tensor the routing still reads)
        if LATE_DEPENDENTS:
            gdc_launch_dependents()

    if EXPERT_GRID:
        e = pid % E
        nb = pid // E
        end = tl.load(bounds_ptr + (e + 1) * stride_b)
        for m0 in range(tl.load(bounds_ptr + e * stride_b), end, BLOCK_M):
            _gate_up_block(x_ptr, stride_xt, srows_ptr, e, m0, end, nb, w_ptr, stride_we, stride_wt, s_ptr, stride_se,
                           stride_sg, act_ptr, stride_at, I, Ip, H, GROUP, BLOCK_K, BLOCK_M, BLOCK_N, TILE_N,
                           ACTIVATION, IS_BF16, USE_PTX, SWAP_AB, SCALE_W, EVEN_K, EVEN_N, NUM_STAGES)
            _signal(ready_ptr + e)
    else:
        e, m0, end, nb = _work_item(pid, num_n // TILES, num_m, bounds_ptr, stride_b, E, BLOCK_M, BLOCK_E, GROUP_M)
        if e < E:
            if TILES == 1:
                _gate_up_block(x_ptr, stride_xt, srows_ptr, e, m0, end, nb, w_ptr, stride_we, stride_wt, s_ptr,
                               stride_se, stride_sg, act_ptr, stride_at, I, Ip, H, GROUP, BLOCK_K, BLOCK_M, BLOCK_N,
                               TILE_N, ACTIVATION, IS_BF16, USE_PTX, SWAP_AB, SCALE_W, EVEN_K, EVEN_N, NUM_STAGES)
            else:
                _gate_up_tiles(x_ptr, stride_xt, srows_ptr, e, m0, end, nb * TILES, w_ptr, stride_we, stride_wt, s_ptr,
                               stride_se, stride_sg, act_ptr, stride_at, I, Ip, H, GROUP, BLOCK_K, BLOCK_M, BLOCK_N,
                               TILE_N, ACTIVATION, IS_BF16, USE_PTX, SWAP_AB, SCALE_W, EVEN_K, EVEN_N, NUM_STAGES,
                               TILES)
            _signal(ready_ptr + e, TILES)


@triton.jit
def _gate_up_block(
    x_ptr, stride_xt, srows_ptr, e, m0, end, nb, w_ptr, stride_we, stride_wt, s_ptr, stride_se, stride_sg,
    act_ptr, stride_at, I, Ip, H,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr, ACTIVATION: tl.constexpr, IS_BF16: tl.constexpr, USE_PTX: tl.constexpr,
    SWAP_AB: tl.constexpr, SCALE_W: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """act rows m0.. (sorted positions of expert e below end) x gate_up_kernel's column block nb."""
    offs_m = m0 + tl.arange(0, BLOCK_M)  # [BM] sorted positions
    m_mask = offs_m < end
    rows = tl.load(srows_ptr + offs_m, mask=m_mask, other=0)
    x_base, row_mask, cols = _x_pointers(x_ptr, rows, stride_xt, m_mask, BLOCK_K, SCALE_W, SWAP_AB)
    in_tile, offs_n = _tile_offsets(nb, stride_wt, BLOCK_N, TILE_N, BLOCK_K // 4, SWAP_AB)
    n_ok = offs_n < Ip
    w_gate = w_ptr + e.to(tl.int64) * stride_we + in_tile  # gate rows offs_n; up rows are + Ip
    w_up = w_gate + (Ip // TILE_N) * stride_wt
    s_gate = s_ptr + e.to(tl.int64) * stride_se + offs_n  # [BN]
    s_up = s_gate + Ip
    if SWAP_AB:
        acc_gate = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros_like(acc_gate)
    for b in tl.range(0, tl.cdiv(H, BLOCK_K), num_stages=NUM_STAGES):
        acc_gate, acc_up = _gate_up_step(
            acc_gate, acc_up, x_base, row_mask, cols, b, w_gate + b * (TILE_N * BLOCK_K // 4),
            w_up + b * (TILE_N * BLOCK_K // 4), s_gate, s_up, n_ok, stride_sg, H, GROUP, BLOCK_K, IS_BF16, USE_PTX,
            SWAP_AB, SCALE_W, EVEN_K, EVEN_N)
    _store_act(acc_gate, acc_up, act_ptr, stride_at, offs_m, m_mask, offs_n, I, ACTIVATION, SWAP_AB)


@triton.jit
def _gate_up_tiles(
    x_ptr, stride_xt, srows_ptr, e, m0, end, nb0, w_ptr, stride_we, stride_wt, s_ptr, stride_se, stride_sg,
    act_ptr, stride_at, I, Ip, H,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr, ACTIVATION: tl.constexpr, IS_BF16: tl.constexpr, USE_PTX: tl.constexpr,
    SWAP_AB: tl.constexpr, SCALE_W: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    NUM_STAGES: tl.constexpr, TILES: tl.constexpr,
):
    """_gate_up_block for column blocks nb0 .. nb0 + TILES - 1 of the same rows, in one loop over (tile, k-block)
    with each tile's epilogue inside it: the software pipeline runs on across tiles (the next tile's loads are in
    flight while a tile is stored), and the weight pointers are recomputed from one base each step. It compiles to
    fewer registers than _gate_up_block (sm_90a, Triton 3.9: 155 against 213 per thread for 64 x 64 swapped tiles
    on 4 warps; why, not established)."""
    offs_m = m0 + tl.arange(0, BLOCK_M)  # [BM] sorted positions
    m_mask = offs_m < end
    rows = tl.load(srows_ptr + offs_m, mask=m_mask, other=0)
    x_base, row_mask, cols = _x_pointers(x_ptr, rows, stride_xt, m_mask, BLOCK_K, SCALE_W, SWAP_AB)
    in_tile, offs_n0 = _tile_offsets(nb0, stride_wt, BLOCK_N, TILE_N, BLOCK_K // 4, SWAP_AB)
    w_gate0 = w_ptr + e.to(tl.int64) * stride_we + in_tile  # tile 0's gate rows; up rows are + Ip
    s_gate0 = s_ptr + e.to(tl.int64) * stride_se + offs_n0  # [BN]
    if SWAP_AB:
        acc_gate = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros_like(acc_gate)
    num_kb = tl.cdiv(H, BLOCK_K)
    for i in tl.range(0, TILES * num_kb, num_stages=NUM_STAGES):
        t = i // num_kb
        b = i - t * num_kb
        offs_n = offs_n0 + t * BLOCK_N
        w_gate = w_gate0 + t * (BLOCK_N // TILE_N) * stride_wt + b * (TILE_N * BLOCK_K // 4)
        acc_gate, acc_up = _gate_up_step(
            acc_gate, acc_up, x_base, row_mask, cols, b, w_gate, w_gate + (Ip // TILE_N) * stride_wt,
            s_gate0 + t * BLOCK_N, s_gate0 + t * BLOCK_N + Ip, offs_n < Ip, stride_sg, H, GROUP, BLOCK_K, IS_BF16,
            USE_PTX, SWAP_AB, SCALE_W, EVEN_K, EVEN_N)
        if b == num_kb - 1:
            _store_act(acc_gate, acc_up, act_ptr, stride_at, offs_m, m_mask, offs_n, I, ACTIVATION, SWAP_AB)
            acc_gate = tl.zeros_like(acc_gate)
            acc_up = tl.zeros_like(acc_up)


@triton.jit
def _gate_up_step(
    acc_gate, acc_up, x_base, row_mask, cols, b, w_gate, w_up, s_gate, s_up, n_ok, stride_sg, H,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, IS_BF16: tl.constexpr, USE_PTX: tl.constexpr, SWAP_AB: tl.constexpr,
    SCALE_W: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
):
    """(acc_gate, acc_up) + k-block b of x @ the gate and up weight tiles at w_gate, w_up (scales at s_gate, s_up)."""
    wg = _load_w(w_gate, n_ok, SWAP_AB, EVEN_N)
    wu = _load_w(w_up, n_ok, SWAP_AB, EVEN_N)
    g0, g1, g2, g3 = _split_quarters(wg, IS_BF16, USE_PTX)
    u0, u1, u2, u3 = _split_quarters(wu, IS_BF16, USE_PTX)
    if SCALE_W:
        xk = _load_x(x_base + b * BLOCK_K, row_mask, cols + b * BLOCK_K, H, EVEN_K)
        wg = _scaled_weights(g0, g1, g2, g3, s_gate, n_ok, b, stride_sg, BLOCK_K, GROUP, SWAP_AB)
        acc_gate = _mma(xk, wg, acc_gate, SWAP_AB)
        wu = _scaled_weights(u0, u1, u2, u3, s_up, n_ok, b, stride_sg, BLOCK_K, GROUP, SWAP_AB)
        acc_up = _mma(xk, wu, acc_up, SWAP_AB)
    else:
        x0, x1, x2, x3 = _x_quarters(x_base, row_mask, cols, b, H, BLOCK_K, EVEN_K)
        acc_gate = _scaled_block(acc_gate, x0, x1, x2, x3, g0, g1, g2, g3, s_gate, n_ok, b, stride_sg,
                                 BLOCK_K, GROUP, SWAP_AB)
        acc_up = _scaled_block(acc_up, x0, x1, x2, x3, u0, u1, u2, u3, s_up, n_ok, b, stride_sg,
                               BLOCK_K, GROUP, SWAP_AB)
    return acc_gate, acc_up


@triton.jit
def _store_act(acc_gate, acc_up, act_ptr, stride_at, offs_m, m_mask, offs_n, I, ACTIVATION: tl.constexpr,
               SWAP_AB: tl.constexpr):
    """act[offs_m, offs_n] = act(gate) * up in act's dtype (rows past the block's pairs, columns past I: none)."""
    y = _rows_major(_activate(acc_gate, ACTIVATION) * acc_up, SWAP_AB)  # [BM, BN] fp32
    out = act_ptr + offs_m[:, None] * stride_at + offs_n[None, :]
    tl.store(out, y.to(act_ptr.dtype.element_ty), mask=m_mask[:, None] & (offs_n[None, :] < I))


@triton.jit
def down_kernel(
    act_ptr, stride_at,  # [P, I] fp16/bf16, sorted positions
    spairs_ptr, sweights_ptr, bounds_ptr, stride_b,  # [P] int32 pair index, [P] fp32 router weight, [E+1]
    w_ptr, stride_we, stride_wt,  # [E, Hp/TN, Ip/BK, TN, BK/4] int16
    s_ptr, stride_se, stride_sg,  # [E, Ip/G, Hp] fp32
    part_ptr, stride_ps, stride_pp,  # [SPLIT_K, P, H] fp32 or bf16 out: each pair's router-weighted row (its
    # share of the k-blocks), at its pair index
    ready_ptr, gate_up_n,  # [E] int32 (gate_up_kernel's); gate_up's column blocks
    num_n, num_m, E, H, Hp, I,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr,
    IS_BF16: tl.constexpr, USE_PTX: tl.constexpr, SWAP_AB: tl.constexpr, SCALE_W: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, NUM_STAGES: tl.constexpr, EXPERT_GRID: tl.constexpr,
    SPLIT_K: tl.constexpr, GATE_UP_M: tl.constexpr, WAIT_EXPERT: tl.constexpr, USE_GDC: tl.constexpr,
):
    """One program: BLOCK_M sorted positions of one expert x BLOCK_N output columns (program = _work_item's),
    or EXPERT_GRID each of the expert's row blocks in turn (program = column block * E + expert). SPLIT_K > 1:
    the k-blocks split into SPLIT_K equal runs, program + split * (programs of one split) takes run `split`
    and writes slice `split` of part (combine_kernel adds the slices in order).
    WAIT_EXPERT: a program waits for its expert's act tiles alone (_wait_for_act), not for all of gate_up: under a
    dependent launch it starts on experts gate_up has finished while gate_up's last programs still run."""
    pid = tl.program_id(0)
    num_kb = tl.cdiv(I, BLOCK_K)
    if SPLIT_K == 1:
        b_lo = 0
        b_hi = num_kb
    else:
        if EXPERT_GRID:
            per_split = num_n * E
        else:
            per_split = num_n * num_m
        split = pid // per_split
        pid = pid - split * per_split
        b_lo = split * tl.cdiv(num_kb, SPLIT_K)
        b_hi = tl.minimum(b_lo + tl.cdiv(num_kb, SPLIT_K), num_kb)
        part_ptr += split.to(tl.int64) * stride_ps
    if USE_GDC:
        gdc_launch_dependents()
        if not WAIT_EXPERT:  # else none: gate_up launched this grid after its own wait for the routing
            gdc_wait()  # gate_up's act
    if EXPERT_GRID:
        e = pid % E
        nb = pid // E
        end = tl.load(bounds_ptr + (e + 1) * stride_b)
        if WAIT_EXPERT:
            if tl.load(bounds_ptr + e * stride_b) < end:
                _wait_for_act(ready_ptr, bounds_ptr, stride_b, e, gate_up_n, GATE_UP_M)
        for m0 in range(tl.load(bounds_ptr + e * stride_b), end, BLOCK_M):
            _down_block(act_ptr, stride_at, spairs_ptr, sweights_ptr, e, m0, end, nb, w_ptr, stride_we, stride_wt,
                        s_ptr, stride_se, stride_sg, part_ptr, stride_pp, H, Hp, I, b_lo, b_hi, GROUP, BLOCK_K, BLOCK_M, BLOCK_N,
                        TILE_N, IS_BF16, USE_PTX, SWAP_AB, SCALE_W, EVEN_K, EVEN_N, NUM_STAGES)
    else:
        e, m0, end, nb = _work_item(pid, num_n, num_m, bounds_ptr, stride_b, E, BLOCK_M, BLOCK_E, GROUP_M)
        if e < E:
            if WAIT_EXPERT:
                _wait_for_act(ready_ptr, bounds_ptr, stride_b, e, gate_up_n, GATE_UP_M)
            _down_block(act_ptr, stride_at, spairs_ptr, sweights_ptr, e, m0, end, nb, w_ptr, stride_we, stride_wt,
                        s_ptr, stride_se, stride_sg, part_ptr, stride_pp, H, Hp, I, b_lo, b_hi, GROUP, BLOCK_K, BLOCK_M, BLOCK_N,
                        TILE_N, IS_BF16, USE_PTX, SWAP_AB, SCALE_W, EVEN_K, EVEN_N, NUM_STAGES)


@triton.jit
def _wait_for_act(ready_ptr, bounds_ptr, stride_b, e, gate_up_n, GATE_UP_M: tl.constexpr):
    """Waits until gate_up has stored every act tile of expert e (its GATE_UP_M-row blocks x gate_up_n column
    blocks; ready: gate_up_kernel's)."""
    pairs = tl.load(bounds_ptr + (e + 1) * stride_b) - tl.load(bounds_ptr + e * stride_b)
    _wait_count(ready_ptr + e, tl.cdiv(pairs, GATE_UP_M) * gate_up_n)


@triton.jit
def _down_block(
    act_ptr, stride_at, spairs_ptr, sweights_ptr, e, m0, end, nb, w_ptr, stride_we, stride_wt, s_ptr, stride_se,
    stride_sg, part_ptr, stride_pp, H, Hp, I, b_lo, b_hi,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr, IS_BF16: tl.constexpr, USE_PTX: tl.constexpr, SWAP_AB: tl.constexpr,
    SCALE_W: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """The router-weighted rows m0.. (sorted positions of expert e below end) x down_kernel's column block nb."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    in_tile, offs_n = _tile_offsets(nb, stride_wt, BLOCK_N, TILE_N, BLOCK_K // 4, SWAP_AB)
    acc = down_rows(act_ptr, stride_at, offs_m, m_mask, w_ptr + e.to(tl.int64) * stride_we + in_tile,
                    s_ptr + e.to(tl.int64) * stride_se + offs_n, offs_n < Hp, stride_sg, I, b_lo, b_hi,
                    GROUP, BLOCK_K, BLOCK_M, BLOCK_N, TILE_N, IS_BF16, USE_PTX, SWAP_AB, SCALE_W, EVEN_K,
                    EVEN_N, NUM_STAGES)
    pairs = tl.load(spairs_ptr + offs_m, mask=m_mask, other=0)
    router = tl.load(sweights_ptr + offs_m, mask=m_mask, other=0.0)  # [BM]
    out = part_ptr + pairs[:, None] * stride_pp + offs_n[None, :]
    tl.store(out, (acc * router[:, None]).to(part_ptr.dtype.element_ty), mask=m_mask[:, None] & (offs_n[None, :] < H))


@triton.jit
def down_rows(
    act_ptr, stride_at, offs_m, m_mask, w_base, s_base, n_ok, stride_sg, I, b_lo, b_hi,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr, IS_BF16: tl.constexpr, USE_PTX: tl.constexpr, SWAP_AB: tl.constexpr,
    SCALE_W: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """[BM, BN] fp32: act rows offs_m (sorted positions) @ one expert's BN weight rows (w_base: _tile_offsets;
    n_ok: rows below the padded N), over k-blocks [b_lo, b_hi) (all: 0, cdiv(I, BLOCK_K))."""
    a_base, row_mask, cols = _x_pointers(act_ptr, offs_m, stride_at, m_mask, BLOCK_K, SCALE_W, SWAP_AB)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for b in tl.range(b_lo, b_hi, num_stages=NUM_STAGES):
        w = _load_w(w_base + b * (TILE_N * BLOCK_K // 4), n_ok, SWAP_AB, EVEN_N)
        w0, w1, w2, w3 = _split_quarters(w, IS_BF16, USE_PTX)
        if SCALE_W:
            xk = _load_x(a_base + b * BLOCK_K, row_mask, cols + b * BLOCK_K, I, EVEN_K)
            acc = _mma(xk, _scaled_weights(w0, w1, w2, w3, s_base, n_ok, b, stride_sg, BLOCK_K, GROUP, SWAP_AB), acc,
                       SWAP_AB)
        else:
            x0, x1, x2, x3 = _x_quarters(a_base, row_mask, cols, b, I, BLOCK_K, EVEN_K)
            acc = _scaled_block(acc, x0, x1, x2, x3, w0, w1, w2, w3, s_base, n_ok, b, stride_sg, BLOCK_K, GROUP,
                                SWAP_AB)
    return _rows_major(acc, SWAP_AB)


@triton.jit
def combine_kernel(
    part_ptr, stride_ps, stride_pp,  # [SPLITS, P, H] fp32 or bf16 router-weighted pair rows (down's k-splits)
    cpairs_ptr, rbounds_ptr, stride_rb,  # [P] int32 pair index sorted by (row, pair); [T+1] int32 (strided)
    out_ptr, stride_ot,  # [T, H] fp32, every element written (rows without pairs: zeros)
    H, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PAIR_ORDER: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """out[t] = row t's pairs' rows summed in pair order, BLOCK_R at a time, split after split: a fixed
    order, no atomics.

    Program (t, nb): row t's pairs are positions [rbounds[t], rbounds[t+1]) of cpairs. One program per
    row, not per position: no programs that only find they start no run. A row without pairs gets zeros.
    PAIR_ORDER: the pairs are in row order (rows ascending), position j is pair j (cpairs unused).
    """
    if USE_GDC:
        gdc_wait()  # down's pair rows
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = offs_n < H
    lo = tl.load(rbounds_ptr + t * stride_rb)
    hi = tl.load(rbounds_ptr + (t + 1) * stride_rb)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for sp in tl.static_range(SPLITS):
        for k in range(lo, hi, BLOCK_R):
            offs_k = k + tl.arange(0, BLOCK_R)  # [BR]
            mine = offs_k < hi
            if PAIR_ORDER:
                pairs = offs_k.to(tl.int64)
            else:
                pairs = tl.load(cpairs_ptr + offs_k, mask=mine, other=0).to(tl.int64)
            part = tl.load(part_ptr + sp * stride_ps + pairs[:, None] * stride_pp + offs_n[None, :],
                           mask=mine[:, None] & n_mask[None, :], other=0.0).to(tl.float32)  # [BR, BN]
            acc += tl.sum(part, axis=0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_n, acc, mask=n_mask)


@triton.jit
def target_probe_kernel(out_ptr):
    """Stores 1. Compiled, never launched, by kernels.backends.triton_moe to learn whether this Triton compiles
    for a GPU's target at all (Triton 3.9's AMD backend has no RDNA2, for one)."""
    tl.store(out_ptr, 1)
