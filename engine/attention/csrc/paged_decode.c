/* Paged decode attention for CPU, float32: one query token per sequence.
 *
 * Keys and values are read once, straight from the paged cache through the block table (no
 * gather copy). A task is one sequence and a range of its kv heads; with enough sequences a
 * task takes all heads, so each token's K (and V) row is read as one contiguous run.
 * Work is split over tasks with OpenMP.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

void paged_decode_attention(
    const float *q,             /* [B, H, D] */
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
        const float *qb = q + ((int64_t)b * H + (int64_t)h0 * G) * D;
        float *scores = (float *)malloc(sizeof(float) * (size_t)nh * (size_t)L);
        float *acc = (float *)calloc((size_t)nh * (size_t)D, sizeof(float));
        float *maxs = (float *)malloc(sizeof(float) * (size_t)nh);
        for (int i = 0; i < nh; ++i) maxs[i] = -INFINITY;
        for (int64_t t = 0; t < L; ++t) {
            const int64_t row = (bt[t / block_size] * block_size + t % block_size) * token_stride;
            for (int i = 0; i < nh; ++i) {
                const float *kp = k_cache + row + (int64_t)(h0 + i / G) * D;
                const float *qi = qb + (int64_t)i * D;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < D; ++d) s += qi[d] * kp[d];
                s *= scale;
                scores[(int64_t)i * L + t] = s;
                if (s > maxs[i]) maxs[i] = s;
            }
        }
        for (int i = 0; i < nh; ++i) {
            float *si = scores + (int64_t)i * L;
            float sum = 0.f;
            for (int64_t t = 0; t < L; ++t) {
                si[t] = expf(si[t] - maxs[i]);
                sum += si[t];
            }
            maxs[i] = 1.f / sum; /* reuse: now the normalizer */
        }
        for (int64_t t = 0; t < L; ++t) {
            const int64_t row = (bt[t / block_size] * block_size + t % block_size) * token_stride;
            for (int i = 0; i < nh; ++i) {
                const float *vp = v_cache + row + (int64_t)(h0 + i / G) * D;
                const float p = scores[(int64_t)i * L + t];
                float *ai = acc + (int64_t)i * D;
#pragma omp simd
                for (int d = 0; d < D; ++d) ai[d] += p * vp[d];
            }
        }
        for (int i = 0; i < nh; ++i) {
            float *oi = out + ((int64_t)b * H + (int64_t)h0 * G + i) * D;
            for (int d = 0; d < D; ++d) oi[d] = acc[(int64_t)i * D + d] * maxs[i];
        }
        free(scores);
        free(acc);
        free(maxs);
    }
}
