/* Paged attention for one dtype: T, LOAD, STORE, LOAD16, SUFFIX. Included by attention.c. */

#define NAME(name) CAT(name, SUFFIX)

/* The tile's query vectors, scaled, into query[d * MAX_VECTORS + g]: dimension-major, so the
 * score loop finds a dimension's queries side by side (one base register, no spills). */
static void NAME(load_queries)(const struct attention_job *job, const T *q, int64_t kh, int64_t vectors,
                               float *query) {
    int64_t group = job->heads / job->kv_heads, dim = job->dim;
    for (int64_t g = 0; g < vectors; g++) {
        const T *row = q + (g / group) * job->q_stride + (kh * group + g % group) * dim;
        for (int64_t d = 0; d < dim; d++) query[d * MAX_VECTORS + g] = LOAD(row[d]) * job->scale;
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
 * block_size floats, `query` dim * MAX_VECTORS. */
static inline __attribute__((always_inline)) void NAME(attend_tile)(
        const struct attention_job *job, const int32_t *table, const int64_t *counts, int64_t len,
        const T *q, T *out, int64_t kh, const int64_t vectors, const int64_t chunks, float *scores,
        float *query, struct prefetch_cursor *ahead) {
    const T *k_cache = job->k_cache, *v_cache = job->v_cache;
    int64_t group = job->heads / job->kv_heads, dim = job->dim, block_size = job->block_size;
    int64_t blocks = (len + block_size - 1) / block_size, padded = blocks * block_size;
    NAME(load_queries)(job, q, kh, vectors, query);
    int64_t block_elems = dim * block_size, lines = block_elems * (int64_t)sizeof(T) / 64;
    const int64_t split = vectors <= 8 ? 2 : 1; /* chains per query vector */
    for (int64_t j = 0; j < blocks; j++) {
        const T *keys = k_cache + ((int64_t)table[j] * job->kv_heads + kh) * block_elems;
        /* Blocks sit anywhere in the cache, so the hardware prefetcher cannot guess the next
         * ones: the keys and values of the block PREFETCH_BLOCKS ahead in this thread's work
         * (the next tile's first blocks at a tile's end) are requested while this one is
         * computed, a line or two per dimension so that the requests never queue up. */
        const char *far_keys = NULL, *far_values = NULL;
        if (ahead->next + PREFETCH_BLOCKS < ahead->count) {
            far_keys = ahead->keys[ahead->next + PREFETCH_BLOCKS];
            far_values = ahead->values[ahead->next + PREFETCH_BLOCKS];
        }
        ahead->next++;
        for (int64_t sub = 0; sub < block_size && j * block_size + sub < len; sub += 16) {
            f32x16 dot[2][MAX_VECTORS];
            for (int64_t h = 0; h < split; h++)
                for (int64_t g = 0; g < vectors; g++) dot[h][g] = (f32x16){0};
            for (int64_t d = 0; d < dim; d += split)
                for (int64_t h = 0; h < split; h++) {
                    if (far_keys && sub == 0 && d + h < lines) {
                        __builtin_prefetch(far_keys + 64 * (d + h), 0, PF_LEVEL);
                        __builtin_prefetch(far_values + 64 * (d + h), 0, PF_LEVEL);
                    }
                    f32x16 column = LOAD16(keys + (d + h) * block_size + sub);
                    for (int64_t g = 0; g < vectors; g++) dot[h][g] += query[(d + h) * MAX_VECTORS + g] * column;
                }
            for (int64_t line = dim; far_keys && sub == 0 && line < lines; line++) {
                __builtin_prefetch(far_keys + 64 * line);
                __builtin_prefetch(far_values + 64 * line);
            }
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
            const T *values = v_cache + ((int64_t)table[j] * job->kv_heads + kh) * block_elems + c;
            const float *weights = scores + j * block_size;
            int64_t count = len - j * block_size < block_size ? len - j * block_size : block_size;
            for (int64_t i = 0; i < count; i++) {
                f32x16 value[4];
                for (int64_t k = 0; k < chunks; k++) value[k] = LOAD16(values + i * dim + 16 * k);
                for (int64_t g = 0; g < vectors; g++) {
                    float weight = weights[g * padded + i];
                    for (int64_t k = 0; k < chunks; k++) acc[g][k] += weight * value[k];
                }
            }
        }
        for (int64_t g = 0; g < vectors; g++) {
            T *o = out + (g / group) * job->heads * dim + (kh * group + g % group) * dim + c;
            for (int64_t k = 0; k < chunks; k++)
                for (int64_t l = 0; l < 16; l++) o[16 * k + l] = STORE(acc[g][k][l]);
        }
    }
}

/* Context tokens the unit's last query row sees: the most any of its vectors reads. */
static inline int64_t NAME(unit_length)(const struct attention_job *job, const struct attention_unit *unit) {
    return job->lengths[unit->sequence] - (job->query_start[unit->sequence + 1] - unit->row - unit->rows);
}

/* Units [first, last) of the job, with this thread's own scratch. */
static void NAME(attend_units)(const struct attention_job *job, int64_t first, int64_t last) {
    int64_t group = job->heads / job->kv_heads, dim = job->dim;
    float *scores = malloc(sizeof(float) * MAX_VECTORS * (job->table_width * job->block_size + dim));
    float *query = scores + MAX_VECTORS * job->table_width * job->block_size;
    /* Every block this thread will read, in the order it reads them, for the prefetches. */
    int64_t block_elems = dim * job->block_size, total = 0;
    for (int64_t u = first; u < last; u++)
        total += (NAME(unit_length)(job, &job->units[u]) + job->block_size - 1) / job->block_size;
    struct prefetch_cursor ahead = {malloc(sizeof(char *) * 2 * (total ? total : 1)), NULL, total, 0};
    ahead.values = ahead.keys + total;
    for (int64_t u = first, b = 0; u < last; u++) {
        const struct attention_unit *unit = &job->units[u];
        const int32_t *table = job->block_table + unit->sequence * job->table_width;
        int64_t blocks = (NAME(unit_length)(job, unit) + job->block_size - 1) / job->block_size;
        for (int64_t j = 0; j < blocks; j++, b++) {
            int64_t offset = ((int64_t)table[j] * job->kv_heads + unit->kv_head) * block_elems;
            ahead.keys[b] = (const char *)((const T *)job->k_cache + offset);
            ahead.values[b] = (const char *)((const T *)job->v_cache + offset);
        }
    }
    for (int64_t u = first; u < last; u++) {
        const struct attention_unit *unit = &job->units[u];
        int64_t s = unit->sequence, rows = unit->rows, vectors = rows * group;
        /* Row r of the sequence's queries is token lengths[s] - (queries - r), so it sees that many. */
        int64_t end = job->query_start[s + 1], counts[MAX_VECTORS];
        for (int64_t g = 0; g < vectors; g++) counts[g] = job->lengths[s] - (end - 1 - unit->row - g / group);
        int64_t len = counts[vectors - 1];
        const int32_t *table = job->block_table + s * job->table_width;
        const T *q = (const T *)job->q + unit->row * job->q_stride;
        T *out = (T *)job->out + unit->row * job->heads * dim;
        /* Constant tile and head sizes keep the accumulators in registers. */
        /* Output chunks of 16 dimensions built at once: up to 4, at most 24 accumulators. */
#define TILE(V, C) NAME(attend_tile)(job, table, counts, len, q, out, unit->kv_head, V, C, scores, query, &ahead)
#define ATTEND(V) case V: \
            if (V <= 6 && dim % 64 == 0) TILE(V, 4); else if (V <= 12 && dim % 32 == 0) TILE(V, 2); else TILE(V, 1); \
            break;
        switch (vectors) {
            ATTEND(1) ATTEND(2) ATTEND(3) ATTEND(4) ATTEND(5) ATTEND(6) ATTEND(7) ATTEND(8)
            ATTEND(9) ATTEND(10) ATTEND(11) ATTEND(12) ATTEND(13) ATTEND(14) ATTEND(15) ATTEND(16)
        }
#undef ATTEND
#undef TILE
    }
    free(ahead.keys);
    free(scores);
}

/* Causal attention of every query row of a step over its sequence's paged context: decodes
 * (one query each) and prompt chunks (several, continuing any cached context) in one call.
 * Sequence s owns query rows [query_start[s], query_start[s + 1]), the last new tokens of its
 * lengths[s]-token context, whose keys and values rope_store has already cached.
 * q: [rows, heads, dim] (rows q_stride apart); caches in rope_store's layout (block_size a
 * multiple of 16); block_table: [seqs, table_width]; out: [rows, heads, dim] contiguous.
 * dim is a multiple of 16 up to 256 and heads / kv_heads at most MAX_VECTORS.
 * The work is cut into tiles of up to MAX_VECTORS query vectors that share a kv head (GQA:
 * each cached vector is loaded once for the tile), and, with threads > 1 and enough work,
 * the tiles are split into parts of about equal cost, one per thread of torch's OpenMP pool. */
void NAME(paged_attention)(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,
                           const int32_t *block_table, int64_t table_width, const int64_t *query_start,
                           const int64_t *lengths, T *out, int64_t seqs, int64_t heads, int64_t kv_heads,
                           int64_t dim, int64_t block_size, float scale, int64_t threads) {
    int64_t group = heads / kv_heads, tile_rows = MAX_VECTORS / group, count = 0;
    for (int64_t s = 0; s < seqs; s++)
        count += (query_start[s + 1] - query_start[s] + tile_rows - 1) / tile_rows * kv_heads;
    struct attention_unit *units = malloc(sizeof(struct attention_unit) * (count ? count : 1));
    int64_t *costs = malloc(sizeof(int64_t) * (count ? count : 1)), total = 0, u = 0;
    for (int64_t s = 0; s < seqs; s++) /* a sequence's tiles of one kv head in a row: its KV stays cached */
        for (int64_t kh = 0; kh < kv_heads; kh++)
            for (int64_t row = query_start[s]; row < query_start[s + 1]; row += tile_rows, u++) {
                int64_t rows = query_start[s + 1] - row < tile_rows ? query_start[s + 1] - row : tile_rows;
                units[u] = (struct attention_unit){s, kh, row, rows};
                costs[u] = (lengths[s] - (query_start[s + 1] - row - rows)) * rows * group;
                total += costs[u];
            }
    struct attention_job job = {q, q_stride, k_cache, v_cache, block_table, table_width, query_start, lengths,
                                out, heads, kv_heads, dim, block_size, scale, units};
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > count) threads = count;
    if (threads <= 1 || total < PARALLEL_MIN_WORK) {
        NAME(attend_units)(&job, 0, count);
    } else {
        /* Part p covers units [first[p], first[p + 1]): about total / threads of the cost each. */
        int64_t first[MAX_THREADS + 1] = {0}, next = 0, done = 0;
        for (int64_t p = 0; p < threads; p++) {
            int64_t target = total * (p + 1) / threads;
            while (next < count && (p == threads - 1 || done < target)) done += costs[next++];
            first[p + 1] = next;
        }
#pragma omp parallel for schedule(static, 1) num_threads(threads)
        for (int64_t p = 0; p < threads; p++) NAME(attend_units)(&job, first[p], first[p + 1]);
    }
    free(costs);
    free(units);
}

#undef NAME
