/* The attention node's host stages of every MoE layer, one call each: the partition of the pairs
 * by shard (attention_server/partition.py), a FORWARD frame written into a shared-memory slot and
 * announced (attention_server/transport/shm.py), and the combine (combine.py). At decode a
 * layer's few dozen pairs cost a few microseconds here, where numpy's or torch's dispatches cost
 * tens each, and a step runs these once per MoE layer and shard.
 */
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>

#include "frames.h"

/* Groups a layer's P pairs (token-major, k per token) by shard, keeping token order within a
 * shard. ids: [P] expert ids in [0, E); weight_bits: [P] router weights' float32 bits; the shard
 * of pair p is pair_shards[p] when given, else shards[ids[p]], and lies in [0, S). Writes:
 *   rows   [<= P]      shard after shard, its tokens with pairs, ascending
 *   blocks [3 * P]     shard after shard, its [3, P_s] pair block: row index into its rows, expert id,
 *                      weight bits
 *   bounds [S + 1]     shard s's pairs are blocks[3 * bounds[s] : 3 * bounds[s + 1]]
 *   row_bounds [S + 1] and its rows are rows[row_bounds[s] : row_bounds[s + 1]]
 *   expert_pairs [E]   pairs per expert
 * Returns 0; -1 when an expert or a shard is out of range (nothing is then meaningful). */
int hm_partition(const int32_t *ids, const int32_t *weight_bits, int64_t P, int64_t k, const int64_t *shards,
                 int64_t E, const int64_t *pair_shards, int64_t S, int64_t *rows, int32_t *blocks, int64_t *bounds,
                 int64_t *row_bounds, int64_t *expert_pairs) {
    if (S <= 0 || k <= 0) return -1;
    int64_t last_token[S], placed[S], rows_placed[S]; /* per shard: its latest row's token, pairs and rows so far */
    memset(bounds, 0, (size_t)(S + 1) * sizeof *bounds);
    memset(row_bounds, 0, (size_t)(S + 1) * sizeof *row_bounds);
    memset(expert_pairs, 0, (size_t)E * sizeof *expert_pairs);
    for (int64_t s = 0; s < S; ++s) last_token[s] = -1;
    for (int64_t p = 0; p < P; ++p) { /* count; tokens come in order, so a token is new to s when s's last differs */
        if (ids[p] < 0 || ids[p] >= E) return -1;
        int64_t s = pair_shards ? pair_shards[p] : shards[ids[p]];
        if (s < 0 || s >= S) return -1;
        expert_pairs[ids[p]]++;
        bounds[s + 1]++;
        if (last_token[s] != p / k) {
            last_token[s] = p / k;
            row_bounds[s + 1]++;
        }
    }
    for (int64_t s = 0; s < S; ++s) {
        bounds[s + 1] += bounds[s];
        row_bounds[s + 1] += row_bounds[s];
        last_token[s] = -1;
        placed[s] = rows_placed[s] = 0;
    }
    for (int64_t p = 0; p < P; ++p) { /* place, in token order within each shard */
        int64_t s = pair_shards ? pair_shards[p] : shards[ids[p]], n = bounds[s + 1] - bounds[s];
        if (last_token[s] != p / k) {
            last_token[s] = p / k;
            rows[row_bounds[s] + rows_placed[s]++] = p / k;
        }
        int32_t *block = blocks + 3 * bounds[s];
        block[placed[s]] = (int32_t)(rows_placed[s] - 1);
        block[n + placed[s]] = ids[p];
        block[2 * n + placed[s]] = weight_bits[p];
        placed[s]++;
    }
    return 0;
}

/* A FORWARD frame (protos/frames.py) into `segment`: rows rows[0..n) of x [T, hidden] (row_bytes
 * each, wire dtype `dtype`), then the [3, P] pair block; its header then goes out on the
 * shared-memory socket `fd`. Returns 0; nothing sent, -EINVAL for a row outside [0, T) or
 * -EMSGSIZE when the segment cannot hold the frame and its reply; or -errno of the send. */
int hm_shm_send_forward(int fd, unsigned char *segment, uint64_t size, uint64_t request, uint32_t layer,
                        uint32_t slot, const unsigned char *x, int64_t T, int64_t row_bytes, uint32_t hidden,
                        uint16_t dtype, const int64_t *rows, int64_t n, const int32_t *block, int64_t P) {
    for (int64_t i = 0; i < n; ++i)
        if (rows[i] < 0 || rows[i] >= T) return -EINVAL;
    uint64_t payload = (uint64_t)(n * row_bytes + P * PAIR_BYTES);
    uint64_t reply_at = (payload + 63) / 64 * 64; /* frames.reply_offset */
    if (reply_at + (uint64_t)n * hidden * 4 > size) return -EMSGSIZE;
    for (int64_t i = 0; i < n; ++i) memcpy(segment + i * row_bytes, x + rows[i] * row_bytes, (size_t)row_bytes);
    memcpy(segment + n * row_bytes, block, (size_t)(P * PAIR_BYTES));
    header h = {MAGIC, FRAME_VERSION, KIND_FORWARD, request, layer, slot, (uint32_t)n, hidden, (uint32_t)P, dtype, 0,
                payload, 0};
    while (send(fd, &h, sizeof h, MSG_NOSIGNAL) < 0)
        if (errno != EINTR) return -errno;
    return 0;
}

/* c10::BFloat16(float): round to nearest even, NaN as 0x7FC0. */
static inline uint16_t bf16_bits(float value) {
    if (value != value) return 0x7FC0;
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

/* out [T, H] in `out_dtype` (the wire's DType: 1 float32, 2 float16, 3 bfloat16, 4 float64) = the
 * float64 sum of n partials, slice after slice in the order given: partial i [counts[i], H] float32
 * holds rows rows[i][...] (ascending) of out. Each row is summed in one float64 accumulator, from
 * 0, slice by slice, and rounded once to the output as torch's cast of float64 would round it
 * (through float32, as c10's 16-bit types are built from a float); a row no slice holds is zero.
 * The order is fixed, so the bits are too (combine.py). Returns 0; -1 for rows outside [0, T) or
 * not ascending, -2 for another out_dtype. */
int hm_combine(void *out, int out_dtype, int64_t T, int64_t H, int64_t n, const int64_t *const *rows,
               const int64_t *counts, const float *const *partials) {
    if (out_dtype < 1 || out_dtype > 4) return -2;
    int64_t next[n > 0 ? n : 1]; /* per slice: its next row to add */
    double sum[H > 0 ? H : 1];
    for (int64_t i = 0; i < n; ++i) next[i] = 0;
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t c = 0; c < H; ++c) sum[c] = 0.0;
        for (int64_t i = 0; i < n; ++i) {
            if (next[i] == counts[i] || rows[i][next[i]] != t) continue;
            const float *x = partials[i] + next[i]++ * H;
            for (int64_t c = 0; c < H; ++c) sum[c] += (double)x[c];
            if (next[i] < counts[i] && rows[i][next[i]] <= t) return -1;
        }
        switch (out_dtype) {
        case 1: for (int64_t c = 0; c < H; ++c) ((float *)out)[t * H + c] = (float)sum[c]; break;
        case 2: for (int64_t c = 0; c < H; ++c) ((_Float16 *)out)[t * H + c] = (_Float16)(float)sum[c]; break;
        case 3: for (int64_t c = 0; c < H; ++c) ((uint16_t *)out)[t * H + c] = bf16_bits((float)sum[c]); break;
        default: memcpy((double *)out + t * H, sum, (size_t)H * sizeof *sum);
        }
    }
    for (int64_t i = 0; i < n; ++i)
        if (next[i] != counts[i]) return -1; /* a row outside [0, T), or out of order */
    return 0;
}
