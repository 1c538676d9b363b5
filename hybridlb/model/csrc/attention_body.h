/* Paged attention for one dtype: T and SUFFIX, with NAME(attend_tile) already defined (attention.c
 * includes attention_f32.h or attention_bf16.h first). Included by attention.c. */

#define NAME(name) CAT(name, SUFFIX)

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
