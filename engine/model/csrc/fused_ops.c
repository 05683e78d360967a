/* Fused elementwise ops of the decoder for CPU, float32, rows split over OpenMP threads.
 *
 * Each replaces several torch passes over the same activations with one (a prefill chunk's
 * activations are tens of MB, so every pass costs memory bandwidth). The arithmetic follows
 * the HF formulas in the same order; this file is built with -ffp-contract=off so that no
 * multiply-add is fused into a differently rounded FMA.
 */
#include <math.h>
#include <stdint.h>
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
