/* The float32 tile of the paged attention (attention.c): keys [dim][block_size] and values
 * [block_size][dim] per block and kv head, multiplied with vector FMAs. */

/* The tile's query vectors, scaled, into query[d * MAX_VECTORS + g]: dimension-major, so the
 * score loop finds a dimension's queries side by side (one base register, no spills). */
static void load_queries_f32(const struct attention_job *job, const float *q, int64_t kh, int64_t vectors,
                             float *query) {
    int64_t group = job->heads / job->kv_heads, dim = job->dim;
    for (int64_t g = 0; g < vectors; g++) {
        const float *row = q + (g / group) * job->q_stride + (kh * group + g % group) * dim;
        for (int64_t d = 0; d < dim; d++) query[d * MAX_VECTORS + g] = row[d] * job->scale;
    }
}

/* Attention of one tile: `vectors` query vectors that share kv head `kh` of one sequence
 * (`group` heads of each of vectors / group consecutive query rows), vector v seeing the
 * first counts[v] cached tokens (the causal limit of its row); `len` is the largest count.
 * Scores of 16 tokens come from `dim` vector FMAs against the transposed key block (no
 * horizontal sums), in two chains (even and odd dimensions) so that a small tile's few
 * accumulators do not wait on each other's latency. The output is then built `chunks` x 16
 * dimensions at a time, token by token: each value row is loaded once for all the tile's
 * query vectors and every accumulator is its own chain. Inlined per tile size and chunk
 * count so that the accumulators stay in registers. `scores` holds vectors * table_width *
 * block_size floats, `query` dim * MAX_VECTORS; `pairs` is the bfloat16 tile's. */
static inline __attribute__((always_inline)) void attend_tile_f32(
        const struct attention_job *job, const int32_t *table, const int64_t *counts, int64_t len,
        const float *q, float *out, int64_t kh, const int64_t vectors, const int64_t chunks, float *scores,
        void *query_scratch, uint32_t *pairs, struct prefetch_cursor *ahead) {
    (void)pairs;
    const float *k_cache = job->k_cache, *v_cache = job->v_cache;
    float *query = query_scratch;
    int64_t dim = job->dim, block_size = job->block_size;
    int64_t blocks = (len + block_size - 1) / block_size, padded = blocks * block_size;
    load_queries_f32(job, q, kh, vectors, query);
    int64_t block_elems = dim * block_size, lines = block_elems * (int64_t)sizeof(float) / 64;
    const int64_t split = vectors <= 8 ? 2 : 1; /* chains per query vector */
    for (int64_t j = 0; j < blocks; j++) {
        const float *keys = k_cache + ((int64_t)table[j] * job->kv_heads + kh) * block_elems;
        struct prefetch_target far = prefetch_next(ahead);
        for (int64_t sub = 0; sub < block_size && j * block_size + sub < len; sub += 16) {
            f32x16 dot[2][MAX_VECTORS];
            for (int64_t h = 0; h < split; h++)
                for (int64_t g = 0; g < vectors; g++) dot[h][g] = (f32x16){0};
            for (int64_t d = 0; d < dim; d += split)
                for (int64_t h = 0; h < split; h++) {
                    if (sub == 0) prefetch_line(far, d + h, lines);
                    f32x16 column = load16_f32(keys + (d + h) * block_size + sub);
                    for (int64_t g = 0; g < vectors; g++) dot[h][g] += query[(d + h) * MAX_VECTORS + g] * column;
                }
            for (int64_t line = dim; sub == 0 && line < lines; line++) prefetch_line(far, line, lines);
            for (int64_t g = 0; g < vectors; g++) {
                f32x16 sum = split == 2 ? dot[0][g] + dot[1][g] : dot[0][g];
                memcpy(scores + g * padded + j * block_size + sub, &sum, sizeof(f32x16));
            }
        }
    }
    normalise(scores, padded, counts, len, vectors);
    for (int64_t c = 0; c < dim; c += 16 * chunks) {
        f32x16 acc[MAX_VECTORS][4];
        for (int64_t g = 0; g < vectors; g++)
            for (int64_t k = 0; k < chunks; k++) acc[g][k] = (f32x16){0};
        for (int64_t j = 0; j < blocks; j++) {
            const float *values = v_cache + ((int64_t)table[j] * job->kv_heads + kh) * block_elems + c;
            const float *weights = scores + j * block_size;
            int64_t count = len - j * block_size < block_size ? len - j * block_size : block_size;
            for (int64_t i = 0; i < count; i++) {
                f32x16 value[4];
                for (int64_t k = 0; k < chunks; k++) value[k] = load16_f32(values + i * dim + 16 * k);
                for (int64_t g = 0; g < vectors; g++) {
                    float weight = weights[g * padded + i];
                    for (int64_t k = 0; k < chunks; k++) acc[g][k] += weight * value[k];
                }
            }
        }
        for (int64_t g = 0; g < vectors; g++)
            for (int64_t k = 0; k < chunks; k++)
                memcpy(tile_output(job, out, kh, g) + c + 16 * k, &acc[g][k], sizeof(f32x16));
    }
}
