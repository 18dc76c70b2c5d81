/* Dense routed experts on the CPU in float32: what a worker computes for a 16-bit checkpoint
 * (kernels/backends/reference.py, DenseReference), one call per request.
 *
 *   out[t] = sum over the pairs p of row t, experts ascending:  w_p * down(act(gate x_t) * up x_t)
 *
 * A decode request is a row or two; computed with a tensor library it costs a few dispatches per
 * expert, which on the development machine were most of a worker's time. Here it is one call.
 *
 * Every output element is a sum in a fixed order (k ascending in each projection, then the
 * pairs of its row by ascending expert, in request order within an expert), compiled without
 * floating-point contraction (native_build.HOST_FLAGS): the same bits on every run, whatever the
 * batch, the row blocking or the vector width. Rows go through the weights ROW_BLOCK at a time,
 * so that each weight row read serves them all.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { ACT_SILU = 0, ACT_GELU = 1 }; /* kernels/activations.py ACTIVATION_CODES */
enum { ROW_BLOCK = 8 };

/* torch.nn.functional's float32 formulas: silu x / (1 + e^-x), gelu 0.5 x (1 + erf(x / sqrt 2)). */
static float activate(float g, int act) {
    if (act == ACT_SILU) return g / (1.0f + expf(-g));
    return 0.5f * g * (1.0f + erff(g * 0.70710678118654752440f));
}

/* x [T, H] float32; w13t: E pointers to [H, 2I] (gate columns, then up); w2t: E pointers to
 * [I, H]; pairs: rows in [0, T), local experts in [0, E), router weights; out [T, H] is
 * overwritten. Returns 0, -1 for a pair out of range (nothing computed), -2 out of memory. */
int hm_dense_experts(const float *x, int64_t T, int64_t H, int64_t I, int64_t E, const float *const *w13t,
                     const float *const *w2t, int act, const int64_t *pair_rows, const int64_t *pair_experts,
                     const float *pair_weights, int64_t P, float *out) {
    for (int64_t p = 0; p < P; ++p)
        if (pair_rows[p] < 0 || pair_rows[p] >= T || pair_experts[p] < 0 || pair_experts[p] >= E) return -1;
    memset(out, 0, (size_t)(T * H) * sizeof(float));
    if (P == 0) return 0;

    int64_t *start = calloc((size_t)E + 1, sizeof(int64_t)); /* counting sort: pairs by expert */
    int64_t *order = malloc((size_t)P * sizeof(int64_t));
    float *gu = malloc((size_t)(ROW_BLOCK * 2 * I) * sizeof(float));
    float *y = malloc((size_t)(ROW_BLOCK * H) * sizeof(float));
    int status = (start && order && gu && y) ? 0 : -2;
    if (status == 0) {
        for (int64_t p = 0; p < P; ++p) start[pair_experts[p] + 1]++;
        for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
        for (int64_t p = 0; p < P; ++p) order[start[pair_experts[p]]++] = p; /* start[e] -> end of e */
        for (int64_t e = 0, lo = 0; e < E; lo = start[e++]) {
            const float *w13 = w13t[e], *w2 = w2t[e];
            for (int64_t b = lo; b < start[e]; b += ROW_BLOCK) {
                int64_t n = start[e] - b < ROW_BLOCK ? start[e] - b : ROW_BLOCK;
                memset(gu, 0, (size_t)(n * 2 * I) * sizeof(float));
                for (int64_t k = 0; k < H; ++k) {
                    const float *w = w13 + k * 2 * I;
                    for (int64_t i = 0; i < n; ++i) {
                        float xk = x[pair_rows[order[b + i]] * H + k];
                        float *acc = gu + i * 2 * I;
                        for (int64_t j = 0; j < 2 * I; ++j) acc[j] += xk * w[j];
                    }
                }
                for (int64_t i = 0; i < n; ++i) {
                    float *g = gu + i * 2 * I;
                    for (int64_t j = 0; j < I; ++j) g[j] = activate(g[j], act) * g[I + j];
                }
                memset(y, 0, (size_t)(n * H) * sizeof(float));
                for (int64_t j = 0; j < I; ++j) {
                    const float *w = w2 + j * H;
                    for (int64_t i = 0; i < n; ++i) {
                        float hj = gu[i * 2 * I + j];
                        float *acc = y + i * H;
                        for (int64_t c = 0; c < H; ++c) acc[c] += hj * w[c];
                    }
                }
                for (int64_t i = 0; i < n; ++i) {
                    int64_t p = order[b + i];
                    float weight = pair_weights[p], *row = out + pair_rows[p] * H;
                    for (int64_t c = 0; c < H; ++c) row[c] += weight * y[i * H + c];
                }
            }
        }
    }
    free(start);
    free(order);
    free(gu);
    free(y);
    return status;
}
