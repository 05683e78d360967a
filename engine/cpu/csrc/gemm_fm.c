/* out[N, B] = W[N, K] @ X[K, B] for CPU float32: the feature-major decoder's GEMMs (weights W
 * row-major as the checkpoint stores them, activations X row-major [features, tokens], B =
 * tokens, from 1 to a few thousand).
 *
 * MKL runs these skinny products well below the machine's GEMM peak, and on AMD hosts with
 * AVX-512 it keeps to its AVX2 kernels (docs/cpu-kernels.md). Here X is packed once per call into panels of NR columns, [B/NR][K][NR],
 * zero-padded, and each thread runs an MR x NR register tile: each W element is broadcast
 * once per panel and each X panel row is one or two aligned vector loads. Threads split W's
 * rows; X is
 * walked in chunks of panels and slices of k sized to stay in L2 while W's rows stream
 * past. Every output is the same sequential sum over k whatever B is, so a request's
 * numbers do not depend on what else is in the batch (and the AVX2 and AVX-512 builds give
 * the same numbers: one FMA per k in each lane).
 *
 * AVX2 + FMA: the shared 6 x 16 tile (tile_6x16.h), and up to 8 tokens a GEMV that
 * transposes 8 x 8 pieces of W in registers. AVX-512: an 8 x 32 tile
 * from 17 tokens (16 zmm accumulators: two FMA pipes of four cycles' latency need 8 chains),
 * a 16 x 16 tile from 9 to 16, and up to 8 a GEMV that transposes 16 x 16 pieces of W in
 * registers; masked loads and stores for a panel's last columns, weight rows prefetched.
 * `gemm_fm_isa()` says which was built (0: none).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <omp.h>

/* Threads take grains of the work (W's rows x X's chunks, see gemm_run) from a shared
 * counter: many grains per thread where one call runs for milliseconds, so a thread slowed
 * by a noisy neighbour takes fewer; few below that. */
#ifndef GRAINS_PER_THREAD_LARGE
#define GRAINS_PER_THREAD_LARGE 16
#endif
#define GRAINS_PER_THREAD_SMALL 4
#define GRAINS_LARGE_FROM_TOKENS 256

typedef void (*tile_fn)(const float *restrict w, int64_t ldw, int64_t kc,
                        const float *restrict xp, float *restrict out, int64_t ldo, int64_t n,
                        int add);

/* A register tile: mr rows of W by nr columns of X; `full` takes mr rows, `row` one. */
struct gemm_variant {
    int64_t mr, nr;
    tile_fn full, row;
};

#if defined(__AVX512F__)
#include <immintrin.h>

#define GEMM_ISA 512
/* L2 is 1 MiB per core on the AVX-512 hosts we run on (Zen 4/5); half of it for X. */
#define X_SLICE_BYTES (512 * 1024)
/* At most this many tokens take the transposing GEMV below. */
#define GEMV_MAX_TOKENS 8
/* X's panels per chunk, in columns (the best of the sizes tried, docs/cpu-kernels.md). */
#define MAX_CHUNK_COLUMNS 128
/* Each weight row is fetched this many floats (two cache lines) ahead: a tile streams 8-16
 * rows at once, more than the hardware prefetcher follows. */
#define W_PREFETCH 32
#ifndef W16_PF
#define W16_PF 128
#endif
#ifndef GEMV_W16_PF
#define GEMV_W16_PF 128
#endif
#ifndef GEMV_W16_PF_FROM
#define GEMV_W16_PF_FROM 2
#endif

static inline __mmask16 lane_mask(int64_t n)
{
    return n >= 16 ? 0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
}

/* W's element (r, k) for a tile at w: row-major (row stride ldw), or in the W16 layout
 * (`gemm_fm_w16`: blocks of 16 rows stored [K][16], w at the tile's first row). */
#define W_AT(W16, w, ldw, r, k) ((W16) ? (w)[(k) * 16 + (r)] : (w)[(r) * (ldw) + (k)])

/* Rows 0..R-1 of w over kc values of k against one packed panel slice of V * 16 columns; n
 * valid columns; add: accumulate onto out (a later slice of k). PF: row-major weights are
 * prefetched PF floats ahead in each row (0: not); W16 weights, one stream, W16_PF cache
 * lines ahead when PF is nonzero. */
#define DEFINE_TILE(NAME, R, V, PF, W16)                                                       \
    static void NAME(const float *restrict w, int64_t ldw, int64_t kc,                         \
                     const float *restrict xp, float *restrict out, int64_t ldo, int64_t n,    \
                     int add)                                                                  \
    {                                                                                          \
        const __mmask16 m0 = lane_mask(n), m1 = lane_mask(n - 16);                             \
        __m512 c0[R], c1[R];                                                                   \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)                                  \
        {                                                                                      \
            c0[r] = add ? _mm512_maskz_loadu_ps(m0, out + r * ldo) : _mm512_setzero_ps();      \
            if (V == 2)                                                                        \
                c1[r] = add ? _mm512_maskz_loadu_ps(m1, out + r * ldo + 16)                    \
                            : _mm512_setzero_ps();                                             \
        }                                                                                      \
        for (int64_t k = 0; k < kc; ++k) {                                                     \
            if (PF && !(W16) && (k & 15) == 0)                                                 \
                _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)                          \
                    _mm_prefetch((const char *)(w + r * ldw + k + PF), _MM_HINT_T0);           \
            if (PF && (W16) && (k & 3) == 0)                                                   \
                _Pragma("GCC unroll 4") for (int q = 0; q < 4; ++q)                           \
                    _mm_prefetch((const char *)(w + (k + q + W16_PF) * 16), _MM_HINT_T0);      \
            const __m512 x0 = _mm512_load_ps(xp + k * V * 16);                                 \
            const __m512 x1 = V == 2 ? _mm512_load_ps(xp + k * V * 16 + 16) : x0;              \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)                              \
            {                                                                                  \
                const __m512 a = _mm512_set1_ps(W_AT(W16, w, ldw, r, k));                      \
                c0[r] = _mm512_fmadd_ps(a, x0, c0[r]);                                         \
                if (V == 2) c1[r] = _mm512_fmadd_ps(a, x1, c1[r]);                             \
            }                                                                                  \
        }                                                                                      \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)                                  \
        {                                                                                      \
            _mm512_mask_storeu_ps(out + r * ldo, m0, c0[r]);                                   \
            if (V == 2) _mm512_mask_storeu_ps(out + r * ldo + 16, m1, c1[r]);                  \
        }                                                                                      \
    }

/* Wide panels (32 columns, 8 x 32 tile, 16 accumulators: two FMA pipes of four cycles'
 * latency need 8 chains) from 17 tokens; narrow ones (16 columns, 16 x 16 tile) below, where
 * a wide panel would be mostly padding. */
DEFINE_TILE(tile_8x32, 8, 2, W_PREFETCH, 0)
DEFINE_TILE(tile_1x32, 1, 2, 0, 0)
DEFINE_TILE(tile_16x16, 16, 1, W_PREFETCH, 0)
DEFINE_TILE(tile_1x16_512, 1, 1, 0, 0)
DEFINE_TILE(tile_8x32_w16, 8, 2, 1, 1)
DEFINE_TILE(tile_1x32_w16, 1, 2, 0, 1)
DEFINE_TILE(tile_16x16_w16, 16, 1, 1, 1)
DEFINE_TILE(tile_1x16_w16, 1, 1, 0, 1)

/* r[i] (row i of a 16 x 16 block) -> r[j] (column j): four rounds of in-register
 * shuffles, 64 in all. */
static inline void transpose_16x16(__m512 r[16])
{
    __m512 t[16];
    for (int m = 0; m < 8; ++m) {
        t[2 * m] = _mm512_unpacklo_ps(r[2 * m], r[2 * m + 1]);
        t[2 * m + 1] = _mm512_unpackhi_ps(r[2 * m], r[2 * m + 1]);
    }
    /* u[4m + c], 128-bit lane L: rows 4m..4m+3 of column 4L + c. */
    __m512 u[16];
    for (int m = 0; m < 4; ++m) {
        const __m512d a = _mm512_castps_pd(t[4 * m]), b = _mm512_castps_pd(t[4 * m + 2]);
        const __m512d c = _mm512_castps_pd(t[4 * m + 1]), d = _mm512_castps_pd(t[4 * m + 3]);
        u[4 * m] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        u[4 * m + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        u[4 * m + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        u[4 * m + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    for (int c = 0; c < 4; ++c) {
        const __m512 e0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);
        const __m512 e1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
        const __m512 e2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
        const __m512 e3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
        r[c] = _mm512_shuffle_f32x4(e0, e2, 0x88);
        r[8 + c] = _mm512_shuffle_f32x4(e0, e2, 0xDD);
        r[4 + c] = _mm512_shuffle_f32x4(e1, e3, 0x88);
        r[12 + c] = _mm512_shuffle_f32x4(e1, e3, 0xDD);
    }
}

/* The GEMVs keep a 16-row block's outputs column by column, lane i = row i (out's rows
 * ldo floats apart): acc[j] <- column j (add) or zeros, and back for the n real columns. */
static inline __attribute__((always_inline)) __m512i row_offsets(int64_t ldo)
{
    return _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32((int)ldo));
}

static inline __attribute__((always_inline)) void load_columns(__m512 *acc, int nt, int64_t n,
                                                                int add, const float *out,
                                                                int64_t ldo)
{
    const __m512i rows = row_offsets(ldo);
    for (int j = 0; j < nt; ++j)
        acc[j] = add && j < n ? _mm512_i32gather_ps(rows, out + j, 4) : _mm512_setzero_ps();
}

static inline __attribute__((always_inline)) void store_columns(const __m512 *acc, int nt,
                                                                 int64_t n, float *out,
                                                                 int64_t ldo)
{
    if (ldo == 1) { /* one column: the 16 outputs are contiguous */
        _mm512_storeu_ps(out, acc[0]);
        return;
    }
    const __m512i rows = row_offsets(ldo);
    for (int j = 0; j < nt && j < n; ++j) _mm512_i32scatter_ps(out + j, rows, acc[j], 4);
}

/* A 16-row block of W against at most NT (<= 8) columns: W's 16 x 16 pieces are transposed
 * in registers so that one FMA serves 16 rows of one column, where the 16 x 16 tile's FMA
 * serves one row of 16 mostly padded columns. Each output is still one FMA per k in k's
 * order: the same numbers as the tiles. Columns past n are padding (packed zeros), never
 * stored. */
#define DEFINE_GEMV(NAME, NT)                                                                  \
    static void NAME(const float *restrict w, int64_t ldw, int64_t kc,                         \
                     const float *restrict xp, float *restrict out, int64_t ldo, int64_t n,    \
                     int add)                                                                  \
    {                                                                                          \
        __m512 acc[NT];                                                                        \
        load_columns(acc, NT, n, add, out, ldo);                                               \
        for (int64_t k = 0; k < kc; k += 16) {                                                 \
            const int64_t kr = kc - k < 16 ? kc - k : 16;                                      \
            const __mmask16 m = lane_mask(kr);                                                 \
            __m512 r[16];                                                                      \
            for (int i = 0; i < 16; ++i) {                                                     \
                _mm_prefetch((const char *)(w + i * ldw + k + W_PREFETCH), _MM_HINT_T0);       \
                r[i] = _mm512_maskz_loadu_ps(m, w + i * ldw + k);                              \
            }                                                                                  \
            transpose_16x16(r);                                                                \
            if (kr == 16) { /* unrolled: r stays in registers */                               \
                _Pragma("GCC unroll 16") for (int kk = 0; kk < 16; ++kk)                      \
                    _Pragma("GCC unroll 8") for (int j = 0; j < NT; ++j)                      \
                        acc[j] = _mm512_fmadd_ps(r[kk], _mm512_set1_ps(xp[(k + kk) * 16 + j]), \
                                                 acc[j]);                                      \
            } else {                                                                           \
                for (int64_t kk = 0; kk < kr; ++kk)                                            \
                    for (int j = 0; j < NT; ++j)                                               \
                        acc[j] = _mm512_fmadd_ps(r[kk], _mm512_set1_ps(xp[(k + kk) * 16 + j]), \
                                                 acc[j]);                                      \
            }                                                                                  \
        }                                                                                      \
        store_columns(acc, NT, n, out, ldo);                                                   \
    }

DEFINE_GEMV(gemv_16x1, 1)
DEFINE_GEMV(gemv_16x2, 2)
DEFINE_GEMV(gemv_16x4, 4)
DEFINE_GEMV(gemv_16x8, 8)

static void gemv_16(const float *restrict w, int64_t ldw, int64_t kc, const float *restrict xp,
                    float *restrict out, int64_t ldo, int64_t n, int add)
{
    if (n <= 1) gemv_16x1(w, ldw, kc, xp, out, ldo, n, add);
    else if (n <= 2) gemv_16x2(w, ldw, kc, xp, out, ldo, n, add);
    else if (n <= 4) gemv_16x4(w, ldw, kc, xp, out, ldo, n, add);
    else gemv_16x8(w, ldw, kc, xp, out, ldo, n, add);
}

/* The GEMV on W16 weights, for NT (1, 2, 4 or 8) columns packed NT wide: a block's 16
 * rows at one k are one vector, so no register transposes (those bound the row-major GEMV
 * under what DRAM delivers), and X's panel is only as wide as the
 * batch (a 16-wide one cost a cache line of X per k). The same FMAs in the same order as
 * gemv_16 and the tiles. `_row` does one row (a tail of W's rows), columns as lanes. */
#define DEFINE_GEMV_W16(NAME, NT)                                                              \
    static void NAME(const float *restrict w, int64_t ldw, int64_t kc,                         \
                     const float *restrict xp, float *restrict out, int64_t ldo, int64_t n,    \
                     int add)                                                                  \
    {                                                                                          \
        (void)ldw;                                                                             \
        __m512 acc[NT];                                                                        \
        load_columns(acc, NT, n, add, out, ldo);                                               \
        _Pragma("GCC unroll 4") for (int64_t k = 0; k < kc; ++k)                              \
        {                                                                                      \
            if (GEMV_W16_PF && NT >= GEMV_W16_PF_FROM && (k & 3) == 0)                         \
                _Pragma("GCC unroll 4") for (int q = 0; q < 4; ++q)                           \
                    _mm_prefetch((const char *)(w + (k + q + GEMV_W16_PF) * 16), _MM_HINT_T0); \
            const __m512 a = _mm512_loadu_ps(w + k * 16);                                      \
            _Pragma("GCC unroll 8") for (int j = 0; j < NT; ++j)                              \
                acc[j] = _mm512_fmadd_ps(a, _mm512_set1_ps(xp[k * NT + j]), acc[j]);           \
        }                                                                                      \
        store_columns(acc, NT, n, out, ldo);                                                   \
    }                                                                                          \
    static void NAME##_row(const float *restrict w, int64_t ldw, int64_t kc,                   \
                           const float *restrict xp, float *restrict out, int64_t ldo,         \
                           int64_t n, int add)                                                 \
    {                                                                                          \
        (void)ldw, (void)ldo;                                                                  \
        const __mmask16 m = lane_mask(n), panel = lane_mask(NT);                               \
        __m512 c = add ? _mm512_maskz_loadu_ps(m, out) : _mm512_setzero_ps();                 \
        for (int64_t k = 0; k < kc; ++k)                                                       \
            c = _mm512_fmadd_ps(_mm512_set1_ps(w[k * 16]),                                     \
                                _mm512_maskz_loadu_ps(panel, xp + k * NT), c);                 \
        _mm512_mask_storeu_ps(out, m, c);                                                      \
    }

DEFINE_GEMV_W16(gemv_w16x1, 1)
DEFINE_GEMV_W16(gemv_w16x2, 2)
DEFINE_GEMV_W16(gemv_w16x4, 4)
DEFINE_GEMV_W16(gemv_w16x8, 8)

static const struct gemm_variant WIDE = {8, 32, tile_8x32, tile_1x32};
static const struct gemm_variant NARROW = {16, 16, tile_16x16, tile_1x16_512};
static const struct gemm_variant GEMV = {16, 16, gemv_16, tile_1x16_512};
static const struct gemm_variant WIDE_W16 = {8, 32, tile_8x32_w16, tile_1x32_w16};
static const struct gemm_variant NARROW_W16 = {16, 16, tile_16x16_w16, tile_1x16_w16};
static const struct gemm_variant GEMV_W16[4] = {{16, 1, gemv_w16x1, gemv_w16x1_row},
                                                 {16, 2, gemv_w16x2, gemv_w16x2_row},
                                                 {16, 4, gemv_w16x4, gemv_w16x4_row},
                                                 {16, 8, gemv_w16x8, gemv_w16x8_row}};

static struct gemm_variant pick_variant(int64_t B, int w16)
{
    if (w16)
        return B > 16              ? WIDE_W16
               : B > GEMV_MAX_TOKENS ? NARROW_W16
                                     : GEMV_W16[B <= 1 ? 0 : B <= 2 ? 1 : B <= 4 ? 2 : 3];
    return B > 16 ? WIDE : B > GEMV_MAX_TOKENS ? NARROW : GEMV;
}

/* The columns past the last full wide panel, r = B % 32 of them (all B from 17 to 31), go
 * to narrower tail panels when r <= 24: the GEMV's for r <= 8 (packed as wide as r rounded
 * up to a power of two), the narrow tile's for 9-16, both for 17-24 (16 + the rest); a wide
 * panel costs what 32 columns cost, padding included. Writes the
 * tails' variants and widths; returns how many (0: the wide panels take every column). */
static int pick_tails(int64_t B, int w16, struct gemm_variant tail[2], int64_t cols[2])
{
    const int64_t r = B % 32;
    if (B <= 16 || r == 0 || r > 24) return 0;
    if (r > 16) {
        tail[0] = pick_variant(16, w16), cols[0] = 16;
        tail[1] = pick_variant(r - 16, w16), cols[1] = r - 16;
        return 2;
    }
    tail[0] = pick_variant(r, w16), cols[0] = r;
    return 1;
}

/* Rows per row block of the grains: a multiple of every variant's mr. */
#define SUPER_ROWS 16
#define HAVE_W16 1

/* dst [C, R] = src [R, C] transposed, 16 x 16 pieces through registers: every load and store
 * is a run of 16 floats (torch's copy of a transposed view is strided on one side). Threads
 * split src's 16-row strips. */
static void transpose_strips(const float *restrict src, int64_t R, int64_t C,
                             float *restrict dst, int num_threads)
{
    const int64_t strips = (R + 15) / 16;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (R * C > 32768)
    for (int64_t s = 0; s < strips; ++s) {
        const int64_t r0 = s * 16, nr = R - r0 < 16 ? R - r0 : 16;
        const __mmask16 row_mask = lane_mask(nr);
        for (int64_t c0 = 0; c0 < C; c0 += 16) {
            const int64_t nc = C - c0 < 16 ? C - c0 : 16;
            const __mmask16 col_mask = lane_mask(nc);
            __m512 v[16];
            for (int i = 0; i < 16; ++i)
                v[i] = i < nr ? _mm512_maskz_loadu_ps(col_mask, src + (r0 + i) * C + c0)
                              : _mm512_setzero_ps();
            transpose_16x16(v);
            for (int j = 0; j < nc; ++j)
                _mm512_mask_storeu_ps(dst + (c0 + j) * R + r0, row_mask, v[j]);
        }
    }
}

int transpose_fm(const float *src, int64_t R, int64_t C, float *dst, int num_threads)
{
    if (R <= 0 || C <= 0) return -1;
    transpose_strips(src, R, C, dst, num_threads);
    return 0;
}

#else /* AVX2 + FMA */
#include "tile_6x16.h"

#define GEMM_ISA 2
/* Zen 3's L2 is 512 KiB per core. */
#define X_SLICE_BYTES (192 * 1024)
#define MAX_CHUNK_COLUMNS 192
#define HAVE_W16 0

static void tile_6x16_fm(const float *restrict w, int64_t ldw, int64_t kc,
                         const float *restrict xp, float *restrict out, int64_t ldo, int64_t n,
                         int add)
{
    tile_6x16(w, ldw, kc, xp, out, ldo, n, add);
}

static void tile_1x16_fm(const float *restrict w, int64_t ldw, int64_t kc,
                         const float *restrict xp, float *restrict out, int64_t ldo, int64_t n,
                         int add)
{
    (void)ldw, (void)ldo;
    tile_1x16(w, kc, xp, out, n, add);
}

/* r[i] = W's row i at 8 values of k -> r[kk] = W's 8 rows at k + kk (lane i = row i). */
static inline __attribute__((always_inline)) void transpose_8x8(__m256 r[8])
{
    __m256 t[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    __m256 u[8];
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* An 8-row block of W against at most NT (<= 8) columns of a 16-wide packed panel: W's 8 x 8
 * pieces transposed in registers, so one FMA serves 8 rows of one column where the 6 x 16
 * tile's serves one row of 16 mostly padded columns. Each output is still one FMA per k in
 * k's order from out (add) or zero: the tile's numbers. Only the n real columns are read
 * from and written to out. */
#define DEFINE_GEMV8(NAME, NT)                                                                 \
    static void NAME(const float *restrict w, int64_t ldw, int64_t kc,                         \
                     const float *restrict xp, float *restrict out, int64_t ldo, int64_t n,    \
                     int add)                                                                  \
    {                                                                                          \
        __m256 acc[NT];                                                                        \
        for (int j = 0; j < NT; ++j) {                                                         \
            float col[8] = {0};                                                                \
            if (add && j < n)                                                                  \
                for (int i = 0; i < 8; ++i) col[i] = out[i * ldo + j];                         \
            acc[j] = _mm256_loadu_ps(col);                                                     \
        }                                                                                      \
        for (int64_t k = 0; k < kc; k += 8) {                                                  \
            const int64_t kr = kc - k < 8 ? kc - k : 8;                                        \
            __m256 r[8];                                                                       \
            if (kr == 8) {                                                                     \
                for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(w + i * ldw + k);           \
            } else { /* W's last values of k: the lanes past them are not loaded */            \
                const __m256i m = _mm256_cmpgt_epi32(                                          \
                    _mm256_set1_epi32((int)kr), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));    \
                for (int i = 0; i < 8; ++i) r[i] = _mm256_maskload_ps(w + i * ldw + k, m);     \
            }                                                                                  \
            transpose_8x8(r);                                                                  \
            for (int64_t kk = 0; kk < kr; ++kk)                                                \
                for (int j = 0; j < NT; ++j)                                                   \
                    acc[j] = _mm256_fmadd_ps(r[kk], _mm256_broadcast_ss(xp + (k + kk) * NR + j), \
                                             acc[j]);                                          \
        }                                                                                      \
        for (int j = 0; j < NT && j < n; ++j) {                                                \
            float col[8];                                                                      \
            _mm256_storeu_ps(col, acc[j]);                                                     \
            for (int i = 0; i < 8; ++i) out[i * ldo + j] = col[i];                             \
        }                                                                                      \
    }

DEFINE_GEMV8(gemv_8x1, 1)
DEFINE_GEMV8(gemv_8x2, 2)
DEFINE_GEMV8(gemv_8x4, 4)
DEFINE_GEMV8(gemv_8x8, 8)

static void gemv_8(const float *restrict w, int64_t ldw, int64_t kc, const float *restrict xp,
                   float *restrict out, int64_t ldo, int64_t n, int add)
{
    if (n <= 1) gemv_8x1(w, ldw, kc, xp, out, ldo, n, add);
    else if (n <= 2) gemv_8x2(w, ldw, kc, xp, out, ldo, n, add);
    else if (n <= 4) gemv_8x4(w, ldw, kc, xp, out, ldo, n, add);
    else gemv_8x8(w, ldw, kc, xp, out, ldo, n, add);
}

/* At most this many tokens take the transposing GEMV. */
#ifndef GEMV_MAX_TOKENS
#define GEMV_MAX_TOKENS 8
#endif

static struct gemm_variant pick_variant(int64_t B, int w16)
{
    (void)w16; /* no W16 kernels in this build: gemm_fm_w16 says so */
    const struct gemm_variant tile = {MR, NR, tile_6x16_fm, tile_1x16_fm};
    const struct gemm_variant gemv = {8, NR, gemv_8, tile_1x16_fm};
    return B <= GEMV_MAX_TOKENS ? gemv : tile;
}

static int pick_tails(int64_t B, int w16, struct gemm_variant tail[2], int64_t cols[2])
{
    (void)B, (void)w16, (void)tail, (void)cols; /* one variant: 16-column panels */
    return 0;
}

/* Rows per row block of the grains: a multiple of every variant's mr (6 and 8). */
#define SUPER_ROWS 24

int transpose_fm(const float *src, int64_t R, int64_t C, float *dst, int num_threads)
{
    (void)src, (void)R, (void)C, (void)dst, (void)num_threads;
    return -1; /* AVX-512 builds only: the caller copies with torch */
}
#endif

int gemm_fm_isa(void) { return GEMM_ISA; }

/* Panels of nr columns, [ceil(B / nr)][K][nr], zero beyond column B. x is X itself
 * (feature-major: column j of row k at x[k * ldx + j]) or, with x_transposed, X's transpose
 * (token-major: x[j * K + k]): the packing copy transposes it for free instead of a separate
 * copy before the call. */
static void pack_x(const float *x, int64_t ldx, int64_t K, int64_t B, int64_t nr,
                   int x_transposed, float *packed, int num_threads)
{
    const int64_t panels = (B + nr - 1) / nr;
    if (x_transposed) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (K * B > 32768)
        for (int64_t p = 0; p < panels; ++p) {
            float *dst = packed + p * K * nr;
            const int64_t j0 = p * nr, n = B - j0 < nr ? B - j0 : nr;
            for (int64_t j = 0; j < nr; ++j) {
                if (j < n) {
                    const float *src = x + (j0 + j) * K;
                    for (int64_t k = 0; k < K; ++k) dst[k * nr + j] = src[k];
                } else {
                    for (int64_t k = 0; k < K; ++k) dst[k * nr + j] = 0.f;
                }
            }
        }
        return;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads) if (K * B > 32768)
    for (int64_t k = 0; k < K; ++k) {
        const float *src = x + k * ldx;
        for (int64_t p = 0; p < panels; ++p) {
            float *dst = packed + (p * K + k) * nr;
            const int64_t j0 = p * nr, n = B - j0 < nr ? B - j0 : nr;
            memcpy(dst, src + j0, (size_t)n * sizeof(float));
            if (n < nr) memset(dst + n, 0, (size_t)(nr - n) * sizeof(float));
        }
    }
}

/* Where row `row`'s values from k0 on start: row-major W, or W16 (rows in blocks of 16,
 * each block [K][16]). */
static inline const float *w_row(const float *w, int w16, int64_t K, int64_t row, int64_t k0)
{
    return w16 ? w + (row / 16) * K * 16 + k0 * 16 + row % 16 : w + row * K + k0;
}

/* How a call splits X's columns: `panels` panels of main.nr columns (the last one partial
 * when there are no tails), then `tails` tail panels (panel indices panels, panels + 1):
 * tail t holds tail_cols[t] columns from tail_col[t] on, packed tail[t].nr wide at
 * tail_x[t] floats into the packing buffer. */
struct gemm_plan {
    struct gemm_variant main, tail[2];
    int64_t panels, tail_col[2], tail_cols[2], tail_x[2];
    int tails;
};

/* Rows i .. i + v->mr - 1 (fewer at W's end) of one panel slice: out[., j0 ..]. */
static inline void run_tile(const struct gemm_variant *v, const float *w, int w16, int64_t N,
                            int64_t K, int64_t B, int64_t i, int64_t k0, int64_t kc,
                            const float *xp, float *out, int64_t j0, int64_t n, int add)
{
    if (i + v->mr <= N) {
        v->full(w_row(w, w16, K, i, k0), K, kc, xp, out + i * B + j0, B, n, add);
    } else {
        for (int64_t r = i; r < N; ++r)
            v->row(w_row(w, w16, K, r, k0), K, kc, xp, out + r * B + j0, B, n, add);
    }
}

/* W's rows in super-blocks s0 .. s1-1 (SUPER_ROWS rows each) against panels pa .. pb-1: X
 * in chunks of panels and slices of k sized to stay in L2 while the weight rows stream
 * past; a super-block's rows run the tail panels right after the chunk's main panels. */
static void run_grain(const struct gemm_plan *plan, const float *w, int w16,
                      const float *packed, float *out, int64_t N, int64_t K, int64_t B,
                      int64_t chunk, int64_t kc_max, int64_t s0, int64_t s1, int64_t pa,
                      int64_t pb)
{
    const struct gemm_variant *v = &plan->main;
    const int64_t nr = v->nr, panels = plan->panels;
    for (int64_t p0 = pa; p0 < pb; p0 += chunk) {
        const int64_t p1 = p0 + chunk < pb ? p0 + chunk : pb;
        const int64_t q1 = p1 < panels ? p1 : panels;
        for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
            const int64_t kc = K - k0 < kc_max ? K - k0 : kc_max;
            const int add = k0 > 0;
            for (int64_t sb = s0; sb < s1; ++sb) {
                const int64_t top = sb * SUPER_ROWS;
                const int64_t bottom = top + SUPER_ROWS < N ? top + SUPER_ROWS : N;
                for (int64_t i = top; i < bottom; i += v->mr)
                    for (int64_t p = p0; p < q1; ++p) {
                        const int64_t j0 = p * nr, n = B - j0 < nr ? B - j0 : nr;
                        run_tile(v, w, w16, N, K, B, i, k0, kc, packed + (p * K + k0) * nr,
                                 out, j0, n, add);
                    }
                for (int64_t p = q1 > p0 ? q1 : p0; p < p1; ++p) {
                    const struct gemm_variant *t = &plan->tail[p - panels];
                    const float *xp = packed + plan->tail_x[p - panels] + k0 * t->nr;
                    for (int64_t i = top; i < bottom; i += t->mr)
                        run_tile(t, w, w16, N, K, B, i, k0, kc, xp, out,
                                 plan->tail_col[p - panels], plan->tail_cols[p - panels], add);
                }
            }
        }
    }
}

static int gemm_run(const float *w, int w16, const float *x, float *out, int64_t N, int64_t K,
                    int64_t B, int x_transposed, int num_threads)
{
    if (N <= 0 || K <= 0 || B <= 0) return -1;
    struct gemm_plan plan = {.main = pick_variant(B, w16)};
    const int64_t nr = plan.main.nr;
    plan.tails = pick_tails(B, w16, plan.tail, plan.tail_cols);
    int64_t main_cols = B;
    for (int t = 0; t < plan.tails; ++t) main_cols -= plan.tail_cols[t];
    plan.panels = (main_cols + nr - 1) / nr;
    const int64_t all_panels = plan.panels + plan.tails;
    int64_t packed_floats = plan.panels * K * nr, col = main_cols;
    for (int t = 0; t < plan.tails; ++t) {
        plan.tail_col[t] = col, plan.tail_x[t] = packed_floats;
        col += plan.tail_cols[t], packed_floats += K * plan.tail[t].nr;
    }
    /* One panel exactly as wide as X is X itself (or, for one column, its transpose), if
     * aligned as the tiles' panel loads need. */
    const int as_is = all_panels == 1 && nr == B && (!x_transposed || B == 1) &&
                      ((uintptr_t)x & 63) == 0;
    float *packed =
        as_is ? (float *)x : aligned_alloc(64, (size_t)packed_floats * sizeof(float));
    if (packed == NULL) return -1;
    if (!as_is) {
        pack_x(x, B, K, main_cols, nr, x_transposed, packed, num_threads);
        for (int t = 0; t < plan.tails; ++t) {
            const int64_t j0 = plan.tail_col[t];
            pack_x(x_transposed ? x + j0 * K : x + j0, B, K, plan.tail_cols[t], plan.tail[t].nr,
                   x_transposed, packed + plan.tail_x[t], num_threads);
        }
    }
    /* A chunk of panels and a slice of k: X's part of the work that stays in L2. */
    const int64_t max_chunk = MAX_CHUNK_COLUMNS / nr;
    const int64_t chunk = all_panels < max_chunk ? all_panels : max_chunk;
    int64_t kc_max = X_SLICE_BYTES / (chunk * nr * (int64_t)sizeof(float));
    kc_max = kc_max < 64 ? 64 : kc_max;
    const int64_t blocks = (N + SUPER_ROWS - 1) / SUPER_ROWS;
    const int64_t chunks = (all_panels + chunk - 1) / chunk;
    int64_t next_grain = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* Threads take grains from a shared counter: no barrier, and a thread slowed by a
         * noisy neighbour takes fewer grains instead of holding the others at the end. A
         * grain is a range of W's rows times a range of X's chunks; each grain reads its
         * part of X once and its rows of W once per chunk, so grains split X's chunks first
         * (every row part reads all of X once more) and W's rows only as far as needed. */
        const int64_t nt = omp_get_num_threads();
        int64_t grains = nt * (B >= GRAINS_LARGE_FROM_TOKENS ? GRAINS_PER_THREAD_LARGE
                                                             : GRAINS_PER_THREAD_SMALL);
        const int64_t col_parts = chunks < grains ? chunks : grains;
        int64_t row_parts = (grains + col_parts - 1) / col_parts;
        row_parts = row_parts < blocks ? row_parts : blocks;
        grains = row_parts * col_parts;
        for (int64_t g; (g = __atomic_fetch_add(&next_grain, 1, __ATOMIC_RELAXED)) < grains;) {
            /* Consecutive grains share a chunk of X: the threads read it from L3 together. */
            const int64_t r = g % row_parts, c = g / row_parts;
            const int64_t pa = chunk * (chunks * c / col_parts);
            const int64_t pb = chunk * (chunks * (c + 1) / col_parts);
            run_grain(&plan, w, w16, packed, out, N, K, B, chunk, kc_max,
                      blocks * r / row_parts, blocks * (r + 1) / row_parts, pa,
                      pb < all_panels ? pb : all_panels);
        }
    }
    if (!as_is) free(packed);
    return 0;
}

/* Returns 0, or -1 (nothing written) for an empty shape or when the packing buffer cannot
 * be allocated: the caller then computes the product another way. */
int gemm_fm(const float *w, const float *x, float *out, int64_t N, int64_t K, int64_t B,
            int x_transposed, int num_threads)
{
    return gemm_run(w, 0, x, out, N, K, B, x_transposed, num_threads);
}

/* gemm_fm with W in the W16 layout: [ceil(N / 16)][K][16], W[16 b + r][k] at
 * (b * K + k) * 16 + r, zero rows past N, 64-byte aligned. Each 16-row block of W is one
 * sequential stream, and the GEMV loads 16 rows' values at one k as one vector. The same
 * numbers as gemm_fm on the row-major W. -1 as gemm_fm, and always on builds without it. */
int gemm_fm_w16(const float *w, const float *x, float *out, int64_t N, int64_t K, int64_t B,
                int x_transposed, int num_threads)
{
    if (!HAVE_W16) return -1;
    return gemm_run(w, 1, x, out, N, K, B, x_transposed, num_threads);
}

#else

int gemm_fm_isa(void) { return 0; }

int transpose_fm(const float *src, int64_t R, int64_t C, float *dst, int num_threads)
{
    (void)src, (void)R, (void)C, (void)dst, (void)num_threads;
    return -1;
}

int gemm_fm(const float *w, const float *x, float *out, int64_t N, int64_t K, int64_t B,
            int x_transposed, int num_threads)
{
    (void)w, (void)x, (void)out, (void)N, (void)K, (void)B, (void)x_transposed;
    (void)num_threads;
    return -1; /* not built for this CPU: callers check gemm_fm_isa() first */
}

int gemm_fm_w16(const float *w, const float *x, float *out, int64_t N, int64_t K, int64_t B,
                int x_transposed, int num_threads)
{
    return gemm_fm(w, x, out, N, K, B, x_transposed, num_threads);
}

#endif
