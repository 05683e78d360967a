/* The AVX2 + FMA register tile shared by the native GEMM (engine/model/csrc/gemm_fm.c)
 * and the prefill attention's Q K^T (engine/attention/csrc/paged_prefill.c): out[6][16]
 * (+)= W[6 rows][kc] @ X[kc][16], X packed as rows of 16 floats (32-byte aligned). 12
 * accumulators stay in registers, each W element is broadcast once and each X row is two
 * aligned loads: 12 FMAs against 8 loads per k. The rows are written out by hand: twelve
 * named accumulators are what keeps them in registers.
 *
 * Included by each kernel's C file (engine.cpu.build hashes included headers too).
 */
#ifndef DYNABATCH_TILE_6X16_H
#define DYNABATCH_TILE_6X16_H

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define MR 6
#define NR 16

static inline void store_row(float *out, __m256 lo, __m256 hi, int64_t n)
{
    if (n == NR) {
        _mm256_storeu_ps(out, lo);
        _mm256_storeu_ps(out + 8, hi);
        return;
    }
    float tmp[NR];
    _mm256_storeu_ps(tmp, lo);
    _mm256_storeu_ps(tmp + 8, hi);
    memcpy(out, tmp, (size_t)n * sizeof(float));
}

static inline void load_row(const float *out, __m256 *lo, __m256 *hi, int64_t n, int add)
{
    if (!add) {
        *lo = _mm256_setzero_ps();
        *hi = _mm256_setzero_ps();
    } else if (n == NR) {
        *lo = _mm256_loadu_ps(out);
        *hi = _mm256_loadu_ps(out + 8);
    } else {
        float tmp[NR] = {0};
        memcpy(tmp, out, (size_t)n * sizeof(float));
        *lo = _mm256_loadu_ps(tmp);
        *hi = _mm256_loadu_ps(tmp + 8);
    }
}

/* Rows 0..5 of w (row stride ldw) over kc values of k against one packed panel slice;
 * n valid columns; add: accumulate onto out (a later slice of k). */
static inline void tile_6x16(const float *restrict w, int64_t ldw, int64_t kc,
                             const float *restrict xp, float *restrict out, int64_t ldo,
                             int64_t n, int add)
{
    __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
    load_row(out, &c00, &c01, n, add);
    load_row(out + ldo, &c10, &c11, n, add);
    load_row(out + 2 * ldo, &c20, &c21, n, add);
    load_row(out + 3 * ldo, &c30, &c31, n, add);
    load_row(out + 4 * ldo, &c40, &c41, n, add);
    load_row(out + 5 * ldo, &c50, &c51, n, add);
    const float *w0 = w, *w1 = w + ldw, *w2 = w + 2 * ldw, *w3 = w + 3 * ldw,
                *w4 = w + 4 * ldw, *w5 = w + 5 * ldw;
    for (int64_t k = 0; k < kc; ++k) {
        const __m256 x0 = _mm256_load_ps(xp + k * NR);
        const __m256 x1 = _mm256_load_ps(xp + k * NR + 8);
        __m256 a = _mm256_broadcast_ss(w0 + k);
        c00 = _mm256_fmadd_ps(a, x0, c00);
        c01 = _mm256_fmadd_ps(a, x1, c01);
        a = _mm256_broadcast_ss(w1 + k);
        c10 = _mm256_fmadd_ps(a, x0, c10);
        c11 = _mm256_fmadd_ps(a, x1, c11);
        a = _mm256_broadcast_ss(w2 + k);
        c20 = _mm256_fmadd_ps(a, x0, c20);
        c21 = _mm256_fmadd_ps(a, x1, c21);
        a = _mm256_broadcast_ss(w3 + k);
        c30 = _mm256_fmadd_ps(a, x0, c30);
        c31 = _mm256_fmadd_ps(a, x1, c31);
        a = _mm256_broadcast_ss(w4 + k);
        c40 = _mm256_fmadd_ps(a, x0, c40);
        c41 = _mm256_fmadd_ps(a, x1, c41);
        a = _mm256_broadcast_ss(w5 + k);
        c50 = _mm256_fmadd_ps(a, x0, c50);
        c51 = _mm256_fmadd_ps(a, x1, c51);
    }
    store_row(out, c00, c01, n);
    store_row(out + ldo, c10, c11, n);
    store_row(out + 2 * ldo, c20, c21, n);
    store_row(out + 3 * ldo, c30, c31, n);
    store_row(out + 4 * ldo, c40, c41, n);
    store_row(out + 5 * ldo, c50, c51, n);
}

/* The last N % 6 rows, one at a time. */
static inline void tile_1x16(const float *restrict w, int64_t kc, const float *restrict xp,
                             float *restrict out, int64_t n, int add)
{
    __m256 c0, c1;
    load_row(out, &c0, &c1, n, add);
    for (int64_t k = 0; k < kc; ++k) {
        const __m256 a = _mm256_broadcast_ss(w + k);
        c0 = _mm256_fmadd_ps(a, _mm256_load_ps(xp + k * NR), c0);
        c1 = _mm256_fmadd_ps(a, _mm256_load_ps(xp + k * NR + 8), c1);
    }
    store_row(out, c0, c1, n);
}

#endif
#endif
