/* Fused elementwise ops of the decoder for CPU, float32, rows split over OpenMP threads.
 *
 * Each replaces several torch passes over the same activations with one (a prefill chunk's
 * activations are tens of MB, so every pass costs memory bandwidth). The arithmetic follows
 * the HF formulas in the same order; this file is built with -ffp-contract=off so that no
 * multiply-add is fused into a differently rounded FMA.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* h += delta (when delta is not NULL), then out = w * (h * rsqrt(mean(h^2) + eps)). */
void add_rms_norm(float *h, const float *delta, const float *w, float *out, int64_t T,
                  int64_t H, float eps, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * H > 16384)
    for (int64_t t = 0; t < T; ++t) {
        float *restrict hr = h + t * H;
        float *restrict orow = out + t * H;
        float ss = 0.f;
        if (delta != NULL) {
            const float *restrict dr = delta + t * H;
            for (int64_t i = 0; i < H; ++i) {
                const float x = hr[i] + dr[i];
                hr[i] = x;
                ss += x * x;
            }
        } else {
            for (int64_t i = 0; i < H; ++i) ss += hr[i] * hr[i];
        }
        const float r = 1.f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; ++i) orow[i] = w[i] * (hr[i] * r);
    }
}

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i]; out is [T, I], gate_up [T, 2I]. */
void silu_mul(const float *gate_up, float *out, int64_t T, int64_t I, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * I > 16384)
    for (int64_t t = 0; t < T; ++t) {
        const float *restrict g = gate_up + t * 2 * I;
        const float *restrict u = g + I;
        float *restrict o = out + t * I;
        for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* Rotate-half RoPE in place on x [T, heads, D] (rows `row_stride` floats apart):
 * x * cos + rotate_half(x) * sin, with rotate_half's sign folded into `signed_sin`. */
void rope_inplace(float *x, int64_t row_stride, const int64_t *positions, const float *cos_table,
                  const float *signed_sin, int64_t T, int heads, int D, int num_threads)
{
    const int half = D / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * heads * D > 16384)
    for (int64_t t = 0; t < T; ++t) {
        const float *restrict c = cos_table + positions[t] * D;
        const float *restrict s = signed_sin + positions[t] * D;
        for (int hd = 0; hd < heads; ++hd) {
            float *restrict v = x + t * row_stride + (int64_t)hd * D;
            float lo[256], hi[256]; /* D <= 512: checked by the caller */
            memcpy(lo, v, sizeof(float) * half);
            memcpy(hi, v + half, sizeof(float) * half);
            for (int i = 0; i < half; ++i) {
                v[i] = lo[i] * c[i] + hi[i] * s[i];
                v[half + i] = hi[i] * c[half + i] + lo[i] * s[half + i];
            }
        }
    }
}

/* Feature-major twins of the two ops above, for activations stored [features, T] (one column
 * per token; see Decoder._forward_feature_major). */

/* add_rms_norm over the columns of h, delta and out, all [H, T]. Columns go in blocks of 64:
 * a block's H rows (192 KB at H = 768) stay in L2 between the two passes. */
#define FM_COLS 64
void add_rms_norm_fm(float *h, const float *delta, const float *w, float *out, int64_t T,
                     int64_t H, float eps, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * H > 16384)
    for (int64_t j0 = 0; j0 < T; j0 += FM_COLS) {
        const int64_t n = T - j0 < FM_COLS ? T - j0 : FM_COLS;
        float ss[FM_COLS] = {0.f};
        for (int64_t i = 0; i < H; ++i) {
            float *restrict hr = h + i * T + j0;
            if (delta != NULL) {
                const float *restrict dr = delta + i * T + j0;
                for (int64_t j = 0; j < n; ++j) {
                    const float x = hr[j] + dr[j];
                    hr[j] = x;
                    ss[j] += x * x;
                }
            } else {
                for (int64_t j = 0; j < n; ++j) ss[j] += hr[j] * hr[j];
            }
        }
        float r[FM_COLS];
        for (int64_t j = 0; j < n; ++j) r[j] = 1.f / sqrtf(ss[j] / (float)H + eps);
        for (int64_t i = 0; i < H; ++i) {
            const float *restrict hr = h + i * T + j0;
            float *restrict orow = out + i * T + j0;
            for (int64_t j = 0; j < n; ++j) orow[j] = w[i] * (hr[j] * r[j]);
        }
    }
}

/* out[i, t] = silu(gate_up[i, t]) * gate_up[I + i, t]; out is [I, T], gate_up [2I, T]. */
void silu_mul_fm(const float *gate_up, float *out, int64_t I, int64_t T, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * I > 16384)
    for (int64_t i = 0; i < I; ++i) {
        const float *restrict g = gate_up + i * T;
        const float *restrict u = gate_up + (I + i) * T;
        float *restrict o = out + i * T;
        for (int64_t t = 0; t < T; ++t) o[t] = g[t] / (1.f + expf(-g[t])) * u[t];
    }
}

/* out[j] = the row of the largest entry of column j of x [V, n], the first on ties (as
 * torch.argmax). Greedy sampling from the feature-major vocab projection, whose logits come
 * one column per token: torch reduces across columns on one thread; here each thread scans
 * a band of rows for every column at once, and the bands merge in order. */
void argmax_columns(const float *x, int64_t V, int64_t n, int64_t *out, int num_threads)
{
    if (V <= 0 || n <= 0) return;
    if (num_threads < 1) num_threads = 1;
    float *best = (float *)malloc(sizeof(float) * (size_t)(num_threads * n));
    int32_t *where = (int32_t *)malloc(sizeof(int32_t) * (size_t)(num_threads * n));
    int bands = num_threads;
    if (V * n < 65536) bands = 1;
#pragma omp parallel for schedule(static, 1) num_threads(bands)
    for (int b = 0; b < bands; ++b) {
        const int64_t v0 = V * b / bands, v1 = V * (b + 1) / bands;
        float *restrict bb = best + (int64_t)b * n;
        int32_t *restrict wb = where + (int64_t)b * n;
        for (int64_t j = 0; j < n; ++j) {
            bb[j] = x[v0 * n + j];
            wb[j] = (int32_t)v0;
        }
        for (int64_t v = v0 + 1; v < v1; ++v) {
            const float *restrict row = x + v * n;
            for (int64_t j = 0; j < n; ++j) {
                const int up = row[j] > bb[j];
                bb[j] = up ? row[j] : bb[j];
                wb[j] = up ? (int32_t)v : wb[j];
            }
        }
    }
    for (int64_t j = 0; j < n; ++j) {
        float m = best[j];
        int32_t w = where[j];
        for (int b = 1; b < bands; ++b)
            if (V * b / bands < V * (b + 1) / bands && best[(int64_t)b * n + j] > m) {
                m = best[(int64_t)b * n + j];
                w = where[(int64_t)b * n + j];
            }
        out[j] = w;
    }
    free(best);
    free(where);
}
