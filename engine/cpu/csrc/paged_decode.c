/* Paged decode attention for CPU, float32: one query token per sequence.
 *
 * Keys and values are read once, straight from the paged cache through the block table (no
 * gather copy). A task is one sequence and a range of its kv heads; with enough sequences a
 * task takes all heads, so each token's K (and V) row is read as one contiguous run.
 * Work is split over tasks with OpenMP. head_dim 64 and 128 get specialized copies (the
 * compiler unrolls and vectorizes a loop of known length far better).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* One block of a sequence's context, at head h0: its first row, how many of its tokens are
 * in the context, and the same for the next block. Loops walk the block table block by
 * block, so no token costs an integer division. */
struct block_span {
    const float *block, *next;
    int64_t n, n_next;
};

static inline __attribute__((always_inline)) struct block_span span_at(
    const float *cache, const int64_t *bt, int64_t t0, int64_t L, int block_size,
    int64_t token_stride, int h0, int D)
{
    struct block_span s = {NULL, NULL, 0, 0};
    const int64_t b = t0 / block_size;
    s.block = cache + bt[b] * block_size * token_stride + (int64_t)h0 * D;
    s.n = L - t0 < block_size ? L - t0 : block_size;
    const int64_t rest = L - t0 - s.n;
    if (rest > 0) {
        s.next = cache + bt[b + 1] * block_size * token_stride + (int64_t)h0 * D;
        s.n_next = rest < block_size ? rest : block_size;
    }
    return s;
}

/* Token j's row of the block; the row of token j of the next block is fetched meanwhile:
 * the next block may sit anywhere in memory, where the hardware prefetcher cannot follow. */
static inline __attribute__((always_inline)) const float *span_row(
    const struct block_span *s, int64_t j, int64_t token_stride, int row_bytes)
{
    if (j < s->n_next) {
        const char *p = (const char *)(s->next + j * token_stride);
        for (int off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
    }
    return s->block + j * token_stride;
}

static inline __attribute__((always_inline)) void decode_task(
    const float *restrict qb, const float *restrict k_cache, const float *restrict v_cache,
    const int64_t *restrict bt, int64_t L, float *restrict ob, int h0, int nh, int G,
    int64_t token_stride, int block_size, float scale, float *restrict scores,
    float *restrict acc, const int D)
{
    const int nh_kv = nh / G;
    const int row_bytes = nh_kv * D * (int)sizeof(float);
    for (int64_t t0 = 0; t0 < L; t0 += block_size) {
        const struct block_span span =
            span_at(k_cache, bt, t0, L, block_size, token_stride, h0, D);
        for (int64_t j = 0; j < span.n; ++j) {
            const float *row = span_row(&span, j, token_stride, row_bytes);
            for (int i = 0; i < nh; ++i) {
                const float *kp = row + (int64_t)(i / G) * D;
                const float *qi = qb + (int64_t)i * D;
                float s = 0.f;
                for (int d = 0; d < D; ++d) s += qi[d] * kp[d];
                scores[(int64_t)i * L + t0 + j] = s * scale;
            }
        }
    }
    for (int i = 0; i < nh; ++i) {
        float *si = scores + (int64_t)i * L;
        float m = -INFINITY;
        for (int64_t t = 0; t < L; ++t) m = si[t] > m ? si[t] : m;
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
            si[t] = expf(si[t] - m);
            sum += si[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) si[t] *= inv;
        for (int d = 0; d < D; ++d) acc[(int64_t)i * D + d] = 0.f;
    }
    for (int64_t t0 = 0; t0 < L; t0 += block_size) {
        const struct block_span span =
            span_at(v_cache, bt, t0, L, block_size, token_stride, h0, D);
        for (int64_t j = 0; j < span.n; ++j) {
            const float *row = span_row(&span, j, token_stride, row_bytes);
            for (int i = 0; i < nh; ++i) {
                const float *vp = row + (int64_t)(i / G) * D;
                const float p = scores[(int64_t)i * L + t0 + j];
                float *ai = acc + (int64_t)i * D;
                for (int d = 0; d < D; ++d) ai[d] += p * vp[d];
            }
        }
    }
    for (int i = 0; i < nh; ++i)
        for (int d = 0; d < D; ++d) ob[(int64_t)i * D + d] = acc[(int64_t)i * D + d];
}

void paged_decode_attention(
    const float *q,             /* [B, H, D], token rows q_stride floats apart */
    int64_t q_stride,
    const float *k_cache,       /* [num_blocks, block_size, Hkv, D] */
    const float *v_cache,       /* same */
    const int64_t *block_table, /* [B, max_blocks] */
    const int64_t *seq_lens,    /* [B] */
    float *out,                 /* [B, H, D] */
    int B, int H, int Hkv, int D, int block_size, int max_blocks, float scale,
    int heads_per_task, int num_threads)
{
    const int G = H / Hkv;
    const int splits = Hkv / heads_per_task;
    const int64_t token_stride = (int64_t)Hkv * D;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int task = 0; task < B * splits; ++task) {
        const int b = task / splits;
        const int h0 = (task % splits) * heads_per_task;
        const int nh = heads_per_task * G; /* query heads of this task */
        const int64_t L = seq_lens[b];
        const int64_t *bt = block_table + (int64_t)b * max_blocks;
        const int64_t head_offset = (int64_t)h0 * G * D;
        const float *qb = q + (int64_t)b * q_stride + head_offset;
        float *ob = out + (int64_t)b * H * D + head_offset;
        float *scores = (float *)malloc(sizeof(float) * (size_t)nh * (size_t)L);
        float *acc = (float *)malloc(sizeof(float) * (size_t)nh * (size_t)D);
        if (D == 64)
            decode_task(qb, k_cache, v_cache, bt, L, ob, h0, nh, G,
                        token_stride, block_size, scale, scores, acc, 64);
        else if (D == 128)
            decode_task(qb, k_cache, v_cache, bt, L, ob, h0, nh, G,
                        token_stride, block_size, scale, scores, acc, 128);
        else
            decode_task(qb, k_cache, v_cache, bt, L, ob, h0, nh, G,
                        token_stride, block_size, scale, scores, acc, D);
        free(scores);
        free(acc);
    }
}
