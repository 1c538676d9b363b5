/* Paged attention for one element type, included by attention.c once per type with:
 *   T, SUFFIX      the element type and the functions' name suffix;
 *   WORD, PACK     what a query or probability word holds: PACK elements (float32: one float;
 *                  bfloat16: a pair side by side in a uint32_t);
 *   LANES          16 words of the cache as one vector; LOAD_WORDS(p) loads them from T *p;
 *   DOT(acc, w, l) acc plus word w times the 16 words l, each lane a float32 sum;
 *   QUERY_WORD(row, i, scale), SCORE(sum, scale)  word i of a query row, and a score from its dot
 *                  product (the scale applied in one or the other);
 *   STORE_SUMS(p, s)  the 16 float32 sums at s stored as T;
 * and NAME(probabilities) (attention.c), which turns a tile's scores into words for the values. */

#define NAME(name) CAT(name, SUFFIX)

/* The tile's query vectors as words, query[i * MAX_VECTORS + g] = word i of vector g: word-major, so
 * the score loop finds a word's queries side by side (one base register, no spills). */
static void NAME(load_queries)(const struct attention_job *job, const T *q, int64_t kh, int64_t vectors,
                               WORD *query) {
    int64_t group = job->heads / job->kv_heads, dim = job->dim;
    for (int64_t g = 0; g < vectors; g++) {
        const T *row = q + (g / group) * job->q_stride + (kh * group + g % group) * dim;
        for (int64_t i = 0; i < dim / PACK; i++) query[i * MAX_VECTORS + g] = QUERY_WORD(row, i, job->scale);
    }
}

/* Attention of one tile: `vectors` query vectors that share kv head `kh` of one sequence
 * (`group` heads of each of vectors / group consecutive query rows), vector v seeing the
 * first counts[v] cached tokens (the causal limit of its row); `len` is the largest count.
 * Scores of 16 tokens come from dim / PACK vector multiply-adds against the transposed key block
 * (no horizontal sums), in two chains (even and odd words) so that a small tile's few
 * accumulators do not wait on each other's latency. The output is then built `chunks` x 16
 * dimensions at a time, word by word of tokens: each value line is loaded once for all the tile's
 * query vectors and every accumulator is its own chain. Inlined per tile size and chunk count so
 * that the accumulators stay in registers. `scores` holds vectors * table_width * block_size
 * floats, `query` dim * MAX_VECTORS words, `pairs` vectors * table_width * block_size / 2 words. */
static inline __attribute__((always_inline)) void NAME(attend_tile)(
        const struct attention_job *job, const int32_t *table, const int64_t *counts, int64_t len,
        const T *q, T *out, int64_t kh, const int64_t vectors, const int64_t chunks, float *scores,
        void *query_scratch, uint32_t *pairs, struct prefetch_cursor *ahead) {
    const T *k_cache = job->k_cache, *v_cache = job->v_cache;
    WORD *query = query_scratch;
    int64_t dim = job->dim, block_size = job->block_size;
    int64_t blocks = (len + block_size - 1) / block_size, padded = blocks * block_size;
    NAME(load_queries)(job, q, kh, vectors, query);
    int64_t block_elems = dim * block_size, lines = block_elems * (int64_t)sizeof(T) / 64;
    const int64_t split = vectors <= 8 ? 2 : 1; /* chains per query vector */
    for (int64_t j = 0; j < blocks; j++) {
        const T *keys = k_cache + ((int64_t)table[j] * job->kv_heads + kh) * block_elems;
        struct prefetch_target far = prefetch_next(ahead);
        for (int64_t sub = 0; sub < block_size && j * block_size + sub < len; sub += 16) {
            f32x16 dot[2][MAX_VECTORS];
            for (int64_t h = 0; h < split; h++)
                for (int64_t g = 0; g < vectors; g++) dot[h][g] = (f32x16){0};
            for (int64_t i = 0; i < dim / PACK; i += split)
                for (int64_t h = 0; h < split; h++) {
                    if (sub == 0) prefetch_line(far, i + h, lines);
                    LANES column = LOAD_WORDS(keys + PACK * ((i + h) * block_size + sub));
                    for (int64_t g = 0; g < vectors; g++)
                        dot[h][g] = DOT(dot[h][g], query[(i + h) * MAX_VECTORS + g], column);
                }
            for (int64_t line = dim / PACK; sub == 0 && line < lines; line++) prefetch_line(far, line, lines);
            for (int64_t g = 0; g < vectors; g++) {
                f32x16 sum = SCORE(split == 2 ? dot[0][g] + dot[1][g] : dot[0][g], job->scale);
                memcpy(scores + g * padded + j * block_size + sub, &sum, sizeof(f32x16));
            }
        }
    }
    normalise(scores, padded, counts, len, vectors);
    const WORD *words = NAME(probabilities)(scores, pairs, padded, len, vectors);
    int64_t stride = padded / PACK; /* words per vector */
    for (int64_t c = 0; c < dim; c += 16 * chunks) {
        f32x16 acc[MAX_VECTORS][4];
        for (int64_t g = 0; g < vectors; g++)
            for (int64_t k = 0; k < chunks; k++) acc[g][k] = (f32x16){0};
        for (int64_t j = 0; j < blocks; j++) {
            const T *values = v_cache + ((int64_t)table[j] * job->kv_heads + kh) * block_elems + PACK * c;
            const WORD *weights = words + j * block_size / PACK;
            int64_t count = len - j * block_size < block_size ? len - j * block_size : block_size;
            for (int64_t t = 0; t < (count + PACK - 1) / PACK; t++) {
                LANES value[4];
                for (int64_t k = 0; k < chunks; k++) value[k] = LOAD_WORDS(values + PACK * (t * dim + 16 * k));
                for (int64_t g = 0; g < vectors; g++) {
                    WORD weight = weights[g * stride + t];
                    for (int64_t k = 0; k < chunks; k++) acc[g][k] = DOT(acc[g][k], weight, value[k]);
                }
            }
        }
        for (int64_t g = 0; g < vectors; g++) {
            T *o = tile_output(job, out, kh, g) + c;
            for (int64_t k = 0; k < chunks; k++) STORE_SUMS(o + 16 * k, &acc[g][k]);
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
    /* Scores (float), the query (dim floats or dim / 2 pairs per vector) and, for bfloat16,
     * the probabilities as pairs: MAX_VECTORS x (context + dim + context / 2) words. */
    int64_t context = job->table_width * job->block_size;
    float *scores = malloc(sizeof(float) * MAX_VECTORS * (context + dim + context / 2));
    void *query = scores + MAX_VECTORS * context;
    uint32_t *pairs = (uint32_t *)query + MAX_VECTORS * dim;
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
#define TILE(V, C) NAME(attend_tile)(job, table, counts, len, q, out, unit->kv_head, V, C, scores, query, pairs, &ahead)
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
