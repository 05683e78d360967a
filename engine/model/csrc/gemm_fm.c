/* out[N, B] = W[N, K] @ X[K, B] for CPU float32 on AVX2 hosts: the feature-major decode
 * step's GEMMs (weights W row-major as the checkpoint stores them, activations X row-major
 * [features, tokens], B = tokens from 1 to a few hundred).
 *
 * MKL runs these skinny products at 15-70% of the machine's GEMM peak on an AVX2 host
 * (README). Here X is packed once per call into panels of 16 columns, [B/16][K][16],
 * zero-padded, and each thread runs a 6 x 16 register tile over the whole K: 12 accumulators
 * stay in registers, each W element is broadcast once per panel and each X panel row is two
 * aligned loads, so the inner loop is 12 FMAs against 8 loads. Threads split W's rows.
 * Every output is the same sequential sum over k whatever B is, so a request's numbers do
 * not depend on what else is in the batch.
 *
 * Only built for AVX2 + FMA without AVX-512 (where MKL's 512-bit kernels are the better
 * choice): `gemm_fm_available()` says which.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <omp.h>

#include "tile_6x16.h"

int gemm_fm_available(void) { return 1; }

/* Panels of NR columns, [ceil(B / NR)][K][NR], zero beyond column B. x is X itself
 * ([K, B], feature-major) or, with x_transposed, X's transpose ([B, K], token-major): the
 * packing copy transposes it for free instead of a separate copy before the call. */
static void pack_x(const float *x, int64_t K, int64_t B, int x_transposed, float *packed,
                   int num_threads)
{
    const int64_t panels = (B + NR - 1) / NR;
    if (x_transposed) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (K * B > 32768)
        for (int64_t p = 0; p < panels; ++p) {
            float *dst = packed + p * K * NR;
            const int64_t j0 = p * NR, n = B - j0 < NR ? B - j0 : NR;
            for (int64_t j = 0; j < NR; ++j) {
                if (j < n) {
                    const float *src = x + (j0 + j) * K;
                    for (int64_t k = 0; k < K; ++k) dst[k * NR + j] = src[k];
                } else {
                    for (int64_t k = 0; k < K; ++k) dst[k * NR + j] = 0.f;
                }
            }
        }
        return;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads) if (K * B > 32768)
    for (int64_t k = 0; k < K; ++k) {
        const float *src = x + k * B;
        for (int64_t p = 0; p < panels; ++p) {
            float *dst = packed + (p * K + k) * NR;
            const int64_t j0 = p * NR, n = B - j0 < NR ? B - j0 : NR;
            memcpy(dst, src + j0, (size_t)n * sizeof(float));
            if (n < NR) memset(dst + n, 0, (size_t)(NR - n) * sizeof(float));
        }
    }
}

/* X's slice of k held in L2 while W's rows stream past it. */
#define X_SLICE_BYTES (192 * 1024)

/* Returns 0, or -1 (nothing written) for an empty shape or when the packing buffer cannot
 * be allocated: the caller then computes the product another way. */
int gemm_fm(const float *w, const float *x, float *out, int64_t N, int64_t K, int64_t B,
            int x_transposed, int num_threads)
{
    if (N <= 0 || K <= 0 || B <= 0) return -1;
    const int64_t panels = (B + NR - 1) / NR;
    float *packed = aligned_alloc(32, (size_t)(panels * K * NR) * sizeof(float));
    if (packed == NULL) return -1;
    pack_x(x, K, B, x_transposed, packed, num_threads);
    int64_t kc_max = X_SLICE_BYTES / (panels * NR * (int64_t)sizeof(float));
    kc_max = kc_max < 64 ? 64 : kc_max;
    const int64_t blocks = (N + MR - 1) / MR;
#pragma omp parallel num_threads(num_threads)
    {
        /* Each thread owns a range of W's rows for every slice of k: no barrier between. */
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
        for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
            const int64_t kc = K - k0 < kc_max ? K - k0 : kc_max;
            const int add = k0 > 0;
            for (int64_t blk = b0; blk < b1; ++blk) {
                const int64_t i = blk * MR;
                for (int64_t p = 0; p < panels; ++p) {
                    const int64_t j0 = p * NR, n = B - j0 < NR ? B - j0 : NR;
                    const float *xp = packed + (p * K + k0) * NR;
                    if (i + MR <= N) {
                        tile_6x16(w + i * K + k0, K, kc, xp, out + i * B + j0, B, n, add);
                    } else {
                        for (int64_t r = i; r < N; ++r)
                            tile_1x16(w + r * K + k0, kc, xp, out + r * B + j0, n, add);
                    }
                }
            }
        }
    }
    free(packed);
    return 0;
}

#else

int gemm_fm_available(void) { return 0; }

int gemm_fm(const float *w, const float *x, float *out, int64_t N, int64_t K, int64_t B,
            int x_transposed, int num_threads)
{
    (void)w, (void)x, (void)out, (void)N, (void)K, (void)B, (void)x_transposed;
    (void)num_threads;
    return -1; /* not built for this CPU: callers check gemm_fm_available() first */
}

#endif
