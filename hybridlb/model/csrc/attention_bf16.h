/* The bfloat16 tile of the paged attention (attention.c). Its cache layout keeps pairs side
 * by side, the operand vdpbf16ps multiplies (16 lanes, each the dot product of two bfloat16
 * pairs, added to a float32 sum):
 *   keys   [dim / 2][block_size][2]: one 64-byte line = dimensions 2i, 2i + 1 of 16 tokens
 *   values [block_size / 2][dim][2]: one line = 16 dimensions of tokens 2t, 2t + 1
 * per block and kv head (rope_store writes it). A score is then dim / 2 instructions against
 * the query's pairs (bfloat16 as given, the scale applied to the sum), and an output chunk
 * block_size / 2 against the probabilities rounded to bfloat16 pairs (as torch's bfloat16
 * flash attention rounds them). Without AVX-512 BF16 the same products (exact in float32) are
 * formed with two shifts and two FMAs per pair. */

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
static inline f32x16 dot_pairs(f32x16 acc, uint32_t pair, u32x16 lanes) {
    __m512i broadcast = _mm512_set1_epi32((int)pair), operand;
    memcpy(&operand, &lanes, sizeof operand);
    return (f32x16)_mm512_dpbf16_ps((__m512)acc, (__m512bh)broadcast, (__m512bh)operand);
}
#else
static inline f32x16 dot_pairs(f32x16 acc, uint32_t pair, u32x16 lanes) {
    u32x16 low = lanes << 16, high = lanes & 0xffff0000u;
    f32x16 first, second;
    memcpy(&first, &low, sizeof first);
    memcpy(&second, &high, sizeof second);
    return acc + bf16_to_float((uint16_t)pair) * first + bf16_to_float((uint16_t)(pair >> 16)) * second;
}
#endif

static inline u32x16 load_pairs(const uint16_t *p) {
    u32x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* out[0..n) = x[0..n) rounded to bfloat16 (to nearest even; the scores are finite). */
static inline void to_bf16(const float *x, uint16_t *out, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    for (; i + 16 <= n; i += 16) _mm256_storeu_si256((__m256i *)(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
#endif
    for (; i < n; i++) out[i] = float_to_bf16(x[i]);
}

/* The tile's query vectors as pairs, query[i * MAX_VECTORS + g] = dimensions 2i, 2i + 1. */
static void load_queries_bf16(const struct attention_job *job, const uint16_t *q, int64_t kh, int64_t vectors,
                              uint32_t *query) {
    int64_t group = job->heads / job->kv_heads, dim = job->dim;
    for (int64_t g = 0; g < vectors; g++) {
        const uint16_t *row = q + (g / group) * job->q_stride + (kh * group + g % group) * dim;
        for (int64_t i = 0; i < dim / 2; i++)
            query[i * MAX_VECTORS + g] = (uint32_t)row[2 * i] | (uint32_t)row[2 * i + 1] << 16;
    }
}

/* As attend_tile_f32 (same tiles, chains, prefetches and chunks), on the paired layout.
 * `pairs` holds vectors * table_width * block_size / 2 words. */
static inline __attribute__((always_inline)) void attend_tile_bf16(
        const struct attention_job *job, const int32_t *table, const int64_t *counts, int64_t len,
        const uint16_t *q, uint16_t *out, int64_t kh, const int64_t vectors, const int64_t chunks, float *scores,
        void *query_scratch, uint32_t *pairs, struct prefetch_cursor *ahead) {
    const uint16_t *k_cache = job->k_cache, *v_cache = job->v_cache;
    uint32_t *query = query_scratch;
    int64_t dim = job->dim, block_size = job->block_size;
    int64_t blocks = (len + block_size - 1) / block_size, padded = blocks * block_size;
    load_queries_bf16(job, q, kh, vectors, query);
    int64_t block_elems = dim * block_size, lines = block_elems * 2 / 64;
    const int64_t split = vectors <= 8 ? 2 : 1;
    for (int64_t j = 0; j < blocks; j++) {
        const uint16_t *keys = k_cache + ((int64_t)table[j] * job->kv_heads + kh) * block_elems;
        struct prefetch_target far = prefetch_next(ahead);
        for (int64_t sub = 0; sub < block_size && j * block_size + sub < len; sub += 16) {
            f32x16 dot[2][MAX_VECTORS];
            for (int64_t h = 0; h < split; h++)
                for (int64_t g = 0; g < vectors; g++) dot[h][g] = (f32x16){0};
            for (int64_t i = 0; i < dim / 2; i += split)
                for (int64_t h = 0; h < split; h++) {
                    if (sub == 0) prefetch_line(far, i + h, lines);
                    u32x16 column = load_pairs(keys + 2 * ((i + h) * block_size + sub));
                    for (int64_t g = 0; g < vectors; g++)
                        dot[h][g] = dot_pairs(dot[h][g], query[(i + h) * MAX_VECTORS + g], column);
                }
            for (int64_t line = dim / 2; sub == 0 && line < lines; line++) prefetch_line(far, line, lines);
            for (int64_t g = 0; g < vectors; g++) {
                f32x16 sum = (split == 2 ? dot[0][g] + dot[1][g] : dot[0][g]) * job->scale;
                memcpy(scores + g * padded + j * block_size + sub, &sum, sizeof(f32x16));
            }
        }
    }
    normalise(scores, padded, counts, len, vectors);
    /* The probabilities in bfloat16, side by side: pair t is tokens 2t, 2t + 1. A zero past an
     * odd `len` makes the last token's partner weigh nothing. */
    int64_t half = padded / 2, even = (len + 1) / 2 * 2;
    for (int64_t g = 0; g < vectors; g++) {
        float *row = scores + g * padded;
        if (even > len) row[len] = 0.0f;
        to_bf16(row, (uint16_t *)(pairs + g * half), even);
    }
    for (int64_t c = 0; c < dim; c += 16 * chunks) {
        f32x16 acc[MAX_VECTORS][4];
        for (int64_t g = 0; g < vectors; g++)
            for (int64_t k = 0; k < chunks; k++) acc[g][k] = (f32x16){0};
        for (int64_t j = 0; j < blocks; j++) {
            const uint16_t *values = v_cache + ((int64_t)table[j] * job->kv_heads + kh) * block_elems + 2 * c;
            const uint32_t *weights = pairs + j * block_size / 2;
            int64_t count = len - j * block_size < block_size ? len - j * block_size : block_size;
            for (int64_t t = 0; t < (count + 1) / 2; t++) {
                u32x16 value[4];
                for (int64_t k = 0; k < chunks; k++) value[k] = load_pairs(values + 2 * (t * dim + 16 * k));
                for (int64_t g = 0; g < vectors; g++) {
                    uint32_t weight = weights[g * half + t];
                    for (int64_t k = 0; k < chunks; k++) acc[g][k] = dot_pairs(acc[g][k], weight, value[k]);
                }
            }
        }
        for (int64_t g = 0; g < vectors; g++) {
            uint16_t *o = tile_output(job, out, kh, g) + c;
            for (int64_t k = 0; k < chunks; k++)
                for (int64_t l = 0; l < 16; l++) o[16 * k + l] = float_to_bf16(acc[g][k][l]);
        }
    }
}
