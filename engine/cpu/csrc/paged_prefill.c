/* Causal prefill attention for CPU float32 on AVX2 and AVX-512 hosts, over the paged KV
 * cache.
 *
 * A prefill chunk's queries sit at positions done .. done + n - 1 of their request; its keys
 * and values (the cached prefix and the chunk itself, already written) are read through the
 * block table. Query row r attends to keys 0 .. done + r. The same kernel serves a fresh
 * prompt (done = 0) and a chunk that resumes after a cached prefix.
 *
 * Flash-attention style: a task is one request, one kv head and a tile of query positions,
 * with the kv head's query heads (GQA) stacked as rows. Each chunk's keys are packed once
 * per kv head, transposed as [key block][D][KB], before the tasks run; a task packs its
 * queries (scaled), S = Q K^T runs a register tile over the packed keys, then an online
 * softmax per row over steps of 32 keys and O += P V with the same tile shape (O rescaled
 * to a row's new max as it is loaded for that product). AVX2: the native GEMM's 6 x 16 tile
 * (tile_6x16.h), KB 16. AVX-512: an 8 x 32 tile (16 zmm accumulators), KB 32. Both do the
 * same operations in the same order for every output (built without reassociation,
 * engine/cpu/attention_kernels.py),
 * so they give the same numbers (tested). Tasks are spread over threads with OpenMP.
 * `paged_prefill_available()` says whether this build has the kernel (AVX2 + FMA; the
 * caller also needs head_dim a multiple of 16).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#if defined(__AVX512F__)
#include <immintrin.h>
#define MR 8  /* query rows per register tile: 8 x 32 scores in 16 zmm accumulators */
#define KB 32 /* keys per packed block: one tile's columns */
#else
#include "tile_6x16.h" /* MR = 6 query rows per register tile */
#define KB NR          /* keys per packed block: the tile's 16 columns */
#endif

#define KW 32 /* keys per online-softmax step (16 and 64 were slower on AVX2) */
/* "No score yet" and masked scores: finite, since -ffast-math assumes no infinities. */
#define NEG_BIG (-1e30f)

int paged_prefill_available(void) { return 1; }

static inline float max_lanes(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float sum_lanes(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp for x <= 0: Cephes' polynomial after x = n ln2 + r (about 1 ulp); clamped at -87. */
static inline __m256 exp_nonpositive(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Key t's row of kv head g in the paged cache. */
static inline const float *cache_row(const float *cache, const int64_t *bt, int64_t t,
                                     int block_size, int64_t token_stride, int g, int D)
{
    return cache + (bt[t / block_size] * block_size + t % block_size) * token_stride +
           (int64_t)g * D;
}

/* Keys 0 .. L-1 of kv head g, transposed into [L / KB][D][KB] (zeros past L). */
static void pack_keys(const float *k_cache, const int64_t *bt, int64_t L, int block_size,
                      int64_t token_stride, int g, int D, float *restrict packed)
{
    const int64_t blocks = (L + KB - 1) / KB;
    for (int64_t b = 0; b < blocks; ++b) {
        float *dst = packed + b * D * KB;
        for (int j = 0; j < KB; ++j) {
            const int64_t t = b * KB + j;
            if (t < L) {
                const float *row = cache_row(k_cache, bt, t, block_size, token_stride, g, D);
                for (int d = 0; d < D; ++d) dst[d * KB + j] = row[d];
            } else {
                for (int d = 0; d < D; ++d) dst[d * KB + j] = 0.f;
            }
        }
    }
}

/* The MR query rows of one register tile (a task's rows are position-major: row m is query
 * head g * G + m % G at chunk position r0 + m / G). */
typedef struct {
    int64_t pos[MR]; /* each row's position in the request (its last visible key) */
    int live;        /* rows of this tile that are real (the rest repeat the last) */
} tile_rows;

/* The end of a softmax step, the same in both builds: alpha = exp(m_old - m_new) for the
 * tile's rows (m_old and m_new hold 8: MR <= 8), then each live row's sum l and max m
 * updated. alpha (1 for padding rows) rescales O to the new max as accumulate_values loads
 * it: one pass over O per step instead of two, and the same product as a separate pass. */
static inline void rescale_rows(const tile_rows *tr, const float *m_old, const float *m_new,
                                const float *sums, float *restrict m_run,
                                float *restrict l_run, float *restrict alpha)
{
    float a[8];
    /* 0 (about 1e-38) after NEG_BIG: the first step, when O is still zero. */
    _mm256_storeu_ps(a, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(m_old),
                                                      _mm256_loadu_ps(m_new))));
    for (int r = 0; r < MR; ++r) alpha[r] = r < tr->live ? a[r] : 1.f;
    for (int r = 0; r < tr->live; ++r) {
        l_run[r] = l_run[r] * a[r] + sums[r];
        m_run[r] = m_new[r];
    }
}

#if defined(__AVX512F__)
/* exp_nonpositive on 16 lanes: the same operations lane by lane, so the same numbers. */
static inline __m512 exp_nonpositive_512(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e =
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* S[8][32] = Q[8 rows, D] K^T for one packed block ([D][32]): one FMA per d in d's order,
 * as the AVX2 build's 6 x 16 tile does, so both builds give the same scores. */
static inline void score_tile(const float *restrict q, int D, const float *restrict kt,
                              float *restrict s)
{
    __m512 c0[MR], c1[MR];
    for (int r = 0; r < MR; ++r) c0[r] = c1[r] = _mm512_setzero_ps();
    for (int d = 0; d < D; ++d) {
        const __m512 x0 = _mm512_load_ps(kt + d * KB), x1 = _mm512_load_ps(kt + d * KB + 16);
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
        {
            const __m512 a = _mm512_set1_ps(q[r * D + d]);
            c0[r] = _mm512_fmadd_ps(a, x0, c0[r]);
            c1[r] = _mm512_fmadd_ps(a, x1, c1[r]);
        }
    }
    for (int r = 0; r < MR; ++r) {
        _mm512_storeu_ps(s + r * KW, c0[r]);
        _mm512_storeu_ps(s + r * KW + 16, c1[r]);
    }
}

/* Keys key0 + 16 c + lane that a row at `pos` sees. */
static inline __mmask16 visible_512(int64_t pos, int64_t key0, int c)
{
    const __m512i idx = _mm512_add_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(16 * c));
    return _mm512_cmple_epi32_mask(idx, _mm512_set1_epi32((int)(pos - key0)));
}

/* The AVX2 build's softmax step on 16 lanes; the row sums add the four 8-key pieces in the
 * AVX2 build's order, so l (and with it every output) is the same in both builds. */
static inline void softmax_step(const tile_rows *tr, int64_t key0, float *restrict s,
                                float *restrict m_run, float *restrict l_run,
                                float *restrict alpha)
{
    const __m512 neg = _mm512_set1_ps(NEG_BIG);
    float m_old[8], m_new[8], sums[MR];
    for (int r = 0; r < MR; ++r) m_old[r] = r < tr->live ? m_run[r] : NEG_BIG;
    for (int r = 0; r < MR; ++r) {
        const __m512 x0 = _mm512_mask_loadu_ps(neg, visible_512(tr->pos[r], key0, 0), s + r * KW);
        const __m512 x1 =
            _mm512_mask_loadu_ps(neg, visible_512(tr->pos[r], key0, 1), s + r * KW + 16);
        const float block_max = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));
        m_new[r] = block_max > m_old[r] ? block_max : m_old[r];
    }
    for (int r = 0; r < MR; ++r) {
        const __m512 mv = _mm512_set1_ps(m_new[r]);
        float *sc = s + r * KW;
        const __m512 e0 = _mm512_maskz_mov_ps(visible_512(tr->pos[r], key0, 0),
                                              exp_nonpositive_512(_mm512_sub_ps(_mm512_loadu_ps(sc), mv)));
        const __m512 e1 = _mm512_maskz_mov_ps(
            visible_512(tr->pos[r], key0, 1),
            exp_nonpositive_512(_mm512_sub_ps(_mm512_loadu_ps(sc + 16), mv)));
        _mm512_storeu_ps(sc, e0);
        _mm512_storeu_ps(sc + 16, e1);
        __m256 sum = _mm256_add_ps(_mm512_castps512_ps256(e0), _mm512_extractf32x8_ps(e0, 1));
        sum = _mm256_add_ps(sum, _mm512_castps512_ps256(e1));
        sum = _mm256_add_ps(sum, _mm512_extractf32x8_ps(e1, 1));
        sums[r] = sum_lanes(sum);
    }
    rescale_rows(tr, m_old, m_new, sums, m_run, l_run, alpha);
}

/* O[r] += sum_j P[r][j] V[key0 + j] over the step's n keys, in j's order (as the AVX2
 * build), 32 columns at a time (16 for a last odd piece). */
static inline void accumulate_values(float *restrict *o_rows, const float *restrict alpha,
                                     const float *restrict p, const float *restrict *v_rows,
                                     int n, int D)
{
    int c = 0;
    for (; c + 32 <= D; c += 32) {
        __m512 a0[MR], a1[MR];
        for (int r = 0; r < MR; ++r) {
            const __m512 s = _mm512_set1_ps(alpha[r]);
            a0[r] = _mm512_mul_ps(_mm512_loadu_ps(o_rows[r] + c), s);
            a1[r] = _mm512_mul_ps(_mm512_loadu_ps(o_rows[r] + c + 16), s);
        }
        for (int j = 0; j < n; ++j) {
            const __m512 v0 = _mm512_loadu_ps(v_rows[j] + c);
            const __m512 v1 = _mm512_loadu_ps(v_rows[j] + c + 16);
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
            {
                const __m512 w = _mm512_set1_ps(p[r * KW + j]);
                a0[r] = _mm512_fmadd_ps(w, v0, a0[r]);
                a1[r] = _mm512_fmadd_ps(w, v1, a1[r]);
            }
        }
        for (int r = 0; r < MR; ++r) {
            _mm512_storeu_ps(o_rows[r] + c, a0[r]);
            _mm512_storeu_ps(o_rows[r] + c + 16, a1[r]);
        }
    }
    if (c < D) { /* D % 32 == 16 */
        __m512 a[MR];
        for (int r = 0; r < MR; ++r)
            a[r] = _mm512_mul_ps(_mm512_loadu_ps(o_rows[r] + c), _mm512_set1_ps(alpha[r]));
        for (int j = 0; j < n; ++j) {
            const __m512 v = _mm512_loadu_ps(v_rows[j] + c);
            for (int r = 0; r < MR; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * KW + j]), v, a[r]);
        }
        for (int r = 0; r < MR; ++r) _mm512_storeu_ps(o_rows[r] + c, a[r]);
    }
}

/* S for one softmax step: one packed block. */
static inline void step_scores(const float *restrict q, int D, const float *restrict kt,
                               int n, float *restrict s)
{
    (void)n;
    score_tile(q, D, kt, s);
}

#else
/* Key key0 + 8 c + lane is visible to a row at `pos` when it is not past it. */
static inline __m256 visible(int64_t pos, int64_t key0, int c)
{
    const __m256 idx = _mm256_add_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7),
                                     _mm256_set1_ps((float)(8 * c)));
    return _mm256_cmp_ps(idx, _mm256_set1_ps((float)(pos - key0)), _CMP_LE_OQ);
}

/* The online-softmax update of one step of KW keys from key0 on: scores past a row's
 * position masked, P (unnormalized) in place of S, each row's O rescaled to the new max.
 * Each phase runs over all MR rows, so the rows' dependency chains overlap; padding rows
 * (past `live`) compute too but write only to S (their P lands in a sink). */
static inline void softmax_step(const tile_rows *tr, int64_t key0, float *restrict s,
                                float *restrict m_run, float *restrict l_run,
                                float *restrict alpha)
{
    const __m256 neg = _mm256_set1_ps(NEG_BIG);
    float m_old[8] = {NEG_BIG, NEG_BIG, NEG_BIG, NEG_BIG, NEG_BIG, NEG_BIG, NEG_BIG, NEG_BIG};
    float m_new[8] = {NEG_BIG, NEG_BIG, NEG_BIG, NEG_BIG, NEG_BIG, NEG_BIG, NEG_BIG, NEG_BIG};
    float sums[MR];
    for (int r = 0; r < tr->live; ++r) m_old[r] = m_run[r];
    for (int r = 0; r < MR; ++r) {
        __m256 mx = neg;
        for (int c = 0; c < KW / 8; ++c) {
            const __m256 x = _mm256_blendv_ps(neg, _mm256_loadu_ps(s + r * KW + 8 * c),
                                              visible(tr->pos[r], key0, c));
            mx = _mm256_max_ps(mx, x);
        }
        const float block_max = max_lanes(mx);
        m_new[r] = block_max > m_old[r] ? block_max : m_old[r];
    }
    for (int r = 0; r < MR; ++r) {
        const __m256 mv = _mm256_set1_ps(m_new[r]);
        __m256 sum = _mm256_setzero_ps();
        for (int c = 0; c < KW / 8; ++c) {
            float *sc = s + r * KW + 8 * c;
            const __m256 e = _mm256_and_ps(exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sc), mv)),
                                           visible(tr->pos[r], key0, c));
            _mm256_storeu_ps(sc, e);
            sum = _mm256_add_ps(sum, e);
        }
        sums[r] = sum_lanes(sum);
    }
    rescale_rows(tr, m_old, m_new, sums, m_run, l_run, alpha);
}

/* O[r] += sum_j P[r][j] V[key0 + j] over the block's n keys, 16 columns at a time. */
static inline void accumulate_values(float *restrict *o_rows, const float *restrict alpha,
                                     const float *restrict p, const float *restrict *v_rows,
                                     int n, int D)
{
    for (int c = 0; c < D; c += 16) {
        __m256 a[MR][2];
        for (int r = 0; r < MR; ++r) {
            const __m256 s = _mm256_set1_ps(alpha[r]);
            a[r][0] = _mm256_mul_ps(_mm256_loadu_ps(o_rows[r] + c), s);
            a[r][1] = _mm256_mul_ps(_mm256_loadu_ps(o_rows[r] + c + 8), s);
        }
        for (int j = 0; j < n; ++j) {
            const __m256 v0 = _mm256_loadu_ps(v_rows[j] + c);
            const __m256 v1 = _mm256_loadu_ps(v_rows[j] + c + 8);
            for (int r = 0; r < MR; ++r) {
                const __m256 w = _mm256_broadcast_ss(p + r * KW + j);
                a[r][0] = _mm256_fmadd_ps(w, v0, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(w, v1, a[r][1]);
            }
        }
        for (int r = 0; r < MR; ++r) {
            _mm256_storeu_ps(o_rows[r] + c, a[r][0]);
            _mm256_storeu_ps(o_rows[r] + c + 8, a[r][1]);
        }
    }
}

/* S for one softmax step: one 6 x 16 tile per packed block of 16 keys. */
static inline void step_scores(const float *restrict q, int D, const float *restrict kt,
                               int n, float *restrict s)
{
    for (int b = 0; b * KB < n; ++b) tile_6x16(q, D, D, kt + b * D * KB, s + b * KB, KW, KB, 0);
}

#endif

/* `packed`: the chunk's keys of kv head g as pack_keys lays them out (at least the
 * done + r1 this task sees; keys past a row's position are masked, whatever they are). */
static void prefill_task(const float *q, int64_t q_stride, const float *packed,
                         const float *v_cache, const int64_t *bt, int64_t done, int64_t r0,
                         int64_t r1, int g, int G, int D, int block_size, int64_t token_stride,
                         float scale, float *out, int64_t out_stride, float *scratch)
{
    const int rows = (int)(r1 - r0) * G;
    const int64_t L = done + r1; /* keys any row of the task sees */
    float *o = scratch;                  /* rows * D */
    float *m = o + (int64_t)rows * D, *l = m + rows;
    float *p = l + rows;                 /* MR * KW, then MR * D of sink */
    float *qs = p + MR * KW + MR * D;    /* (rows + MR) * D: scaled queries, zero padding */
    int64_t *pos = (int64_t *)(qs + (int64_t)(rows + MR) * D);
    memset(o, 0, sizeof(float) * (size_t)rows * (size_t)D);
    memset(qs + (int64_t)rows * D, 0, sizeof(float) * MR * (size_t)D);
    for (int r = 0; r < rows; ++r) {
        m[r] = NEG_BIG;
        l[r] = 0.f;
        /* Rows are position-major: row r is query head g * G + r % G at r0 + r / G. */
        const float *qr = q + (r0 + r / G) * q_stride + (int64_t)(g * G + r % G) * D;
        for (int d = 0; d < D; ++d) qs[(int64_t)r * D + d] = qr[d] * scale;
        pos[r] = done + r0 + r / G;
    }
    const float *v_rows[KW];
    for (int64_t key0 = 0; key0 < L; key0 += KW) {
        const int n = L - key0 < KW ? (int)(L - key0) : KW;
        for (int j = 0; j < n; ++j)
            v_rows[j] = cache_row(v_cache, bt, key0 + j, block_size, token_stride, g, D);
        for (int t0 = 0; t0 < rows; t0 += MR) {
            /* The tile's last row has its largest position. */
            const int live = rows - t0 < MR ? rows - t0 : MR;
            if (pos[t0 + live - 1] < key0) continue; /* the step is in all rows' future */
            tile_rows tr;
            float *o_rows[MR];
            tr.live = live;
            for (int r = 0; r < MR; ++r) {
                const int row = t0 + (r < live ? r : live - 1);
                tr.pos[r] = pos[row];
                o_rows[r] = o + (int64_t)row * D;
            }
            /* S = (scale Q) K^T, one packed block of 16 keys at a time. */
            step_scores(qs + (int64_t)t0 * D, D, packed + key0 * D, n, p);
            float alpha[MR];
            softmax_step(&tr, key0, p, m + t0, l + t0, alpha);
            if (live < MR) {
                /* Padding rows repeat the last live row: give them a private sink. */
                for (int r = live; r < MR; ++r) o_rows[r] = p + MR * KW + (r - live) * D;
            }
            accumulate_values(o_rows, alpha, p, v_rows, n, D);
        }
    }
    for (int row = 0; row < rows; ++row) {
        float *dst = out + (pos[row] - done) * out_stride + (int64_t)(g * G + row % G) * D;
        const float inv = 1.f / l[row];
        for (int d = 0; d < D; ++d) dst[d] = o[(int64_t)row * D + d] * inv;
    }
}

/* Every prefill chunk of a step in one call. Chunk c has n[c] query rows starting at row
 * q_start[c] of q (and of out), `done[c]` tokens cached before it, and block-table row c.
 * q rows have stride q_stride floats (H * D heads of D); out rows H * D. Returns 0, or -1
 * when scratch memory cannot be had (nothing then is trusted: the caller recomputes). */
int paged_prefill_attention(const float *q, int64_t q_stride, const float *k_cache,
                            const float *v_cache, const int64_t *block_table, int max_blocks,
                            const int64_t *q_start, const int64_t *n, const int64_t *done,
                            int num_chunks, float *out, int H, int Hkv, int D, int block_size,
                            float scale, int rows_per_task, int num_threads)
{
    if (D % 16 != 0 || H % Hkv != 0) return -1;
    const int G = H / Hkv;
    const int64_t token_stride = (int64_t)Hkv * D;
    int64_t tasks = 0;
    /* Each chunk's keys are packed once per kv head, before any task reads them, so tasks
     * of one request do not each repack the prefix they share. */
    int64_t *packed_at = malloc(sizeof(int64_t) * (size_t)(num_chunks + 1));
    if (packed_at == NULL) return -1;
    packed_at[0] = 0;
    for (int c = 0; c < num_chunks; ++c) {
        tasks += Hkv * ((n[c] + rows_per_task - 1) / rows_per_task);
        packed_at[c + 1] = packed_at[c] + Hkv * ((done[c] + n[c] + KB - 1) / KB) * D * KB;
    }
    /* 64-byte aligned: the packed keys are read with aligned vector loads. */
    float *packed = aligned_alloc(64, ((size_t)packed_at[num_chunks] * sizeof(float) + 63) / 64 * 64);
    if (packed == NULL) {
        free(packed_at);
        return -1;
    }
    const int64_t scratch_floats =
        (int64_t)rows_per_task * G * (2 * D + 4) + MR * KW + 2 * MR * D;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t ch = 0; ch < (int64_t)num_chunks * Hkv; ++ch) {
            const int c = (int)(ch / Hkv), g = (int)(ch % Hkv);
            const int64_t per_head = (packed_at[c + 1] - packed_at[c]) / Hkv;
            pack_keys(k_cache, block_table + (int64_t)c * max_blocks, done[c] + n[c],
                      block_size, token_stride, g, D, packed + packed_at[c] + g * per_head);
        }
        float *scratch = aligned_alloc(64, ((size_t)scratch_floats * sizeof(float) + 63) / 64 * 64);
        if (scratch == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) {
            if (scratch == NULL) continue;
            /* Find the task's chunk: tasks of chunk c come in (tile, kv head) order. */
            int64_t t = task;
            int c = 0;
            for (;; ++c) {
                const int64_t here = Hkv * ((n[c] + rows_per_task - 1) / rows_per_task);
                if (t < here) break;
                t -= here;
            }
            const int g = (int)(t % Hkv);
            const int64_t r0 = (t / Hkv) * rows_per_task;
            const int64_t r1 = r0 + rows_per_task < n[c] ? r0 + rows_per_task : n[c];
            const int64_t per_head = (packed_at[c + 1] - packed_at[c]) / Hkv;
            prefill_task(q + q_start[c] * q_stride, q_stride,
                         packed + packed_at[c] + g * per_head, v_cache,
                         block_table + (int64_t)c * max_blocks, done[c], r0, r1, g, G, D,
                         block_size, token_stride, scale, out + q_start[c] * (int64_t)H * D,
                         (int64_t)H * D, scratch);
        }
        free(scratch);
    }
    free(packed);
    free(packed_at);
    return failed ? -1 : 0;
}

#else

int paged_prefill_available(void) { return 0; }

int paged_prefill_attention(const float *q, int64_t q_stride, const float *k_cache,
                            const float *v_cache, const int64_t *block_table, int max_blocks,
                            const int64_t *q_start, const int64_t *n, const int64_t *done,
                            int num_chunks, float *out, int H, int Hkv, int D, int block_size,
                            float scale, int rows_per_task, int num_threads)
{
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)block_table, (void)max_blocks;
    (void)q_start, (void)n, (void)done, (void)num_chunks, (void)out, (void)H, (void)Hkv;
    (void)D, (void)block_size, (void)scale, (void)rows_per_task, (void)num_threads;
    return -1; /* not built for this CPU: callers check paged_prefill_available() first */
}

#endif
