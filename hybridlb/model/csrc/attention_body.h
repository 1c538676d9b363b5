/* Decode attention for one dtype: T, LOAD, STORE, LOAD16, SUFFIX. Included by attention.c. */

#define NAME(name) CAT(name, SUFFIX)

/* Attention of one sequence's `group` query heads (sharing kv head kh) over its `len`
 * cached tokens, 16 tokens at a time: scores of 16 tokens come from `dim` vector FMAs
 * against the transposed key block (no horizontal sums), then each value row is
 * accumulated into every query head's output. Inlined per head size so that `chunks`
 * (dim / 16) is a constant there. `scores` holds group * table_width * block_size floats. */
static inline __attribute__((always_inline)) void NAME(attend_group)(
        const T *q, const T *k_cache, const T *v_cache, const int32_t *table, int64_t len, T *out,
        int64_t kh, int64_t group, int64_t kv_heads, int64_t block_size, float scale, const int64_t chunks,
        float *scores, float *query, f32x16 *acc) {
    int64_t dim = chunks * 16, blocks = (len + block_size - 1) / block_size, padded = blocks * block_size;
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < dim; d++) query[g * dim + d] = LOAD(q[(kh * group + g) * dim + d]) * scale;
    int64_t block_elems = dim * block_size, lines = block_elems * (int64_t)sizeof(T) / 64;
    for (int64_t j = 0; j < blocks; j++) {
        const T *keys = k_cache + ((int64_t)table[j] * kv_heads + kh) * block_elems;
        /* Blocks sit anywhere in the cache, so the hardware prefetcher cannot guess the next
         * one: request it (keys, then this block's values) while this one is computed. In a
         * served step, where the KV is cold, this took a batch-32 x 280-token call from
         * ~1.5 ms to ~1.2 ms. */
        const T *next = j + 1 < blocks ? k_cache + ((int64_t)table[j + 1] * kv_heads + kh) * block_elems : NULL;
        const T *values = v_cache + ((int64_t)table[j] * kv_heads + kh) * block_elems;
        for (int64_t line = 0; line < lines; line++) {
            if (next) __builtin_prefetch((const char *)next + 64 * line);
            __builtin_prefetch((const char *)values + 64 * line);
        }
        for (int64_t sub = 0; sub < block_size; sub += 16) {
            f32x16 dot[MAX_GROUP];
            for (int64_t g = 0; g < group; g++) dot[g] = (f32x16){0};
            for (int64_t d = 0; d < dim; d++) {
                f32x16 column = LOAD16(keys + d * block_size + sub);
                for (int64_t g = 0; g < group; g++) dot[g] += query[g * dim + d] * column;
            }
            for (int64_t g = 0; g < group; g++) memcpy(scores + g * padded + j * block_size + sub, &dot[g], sizeof(f32x16));
        }
    }
    for (int64_t g = 0; g < group; g++) softmax(scores + g * padded, len);
    for (int64_t i = 0; i < group * chunks; i++) acc[i] = (f32x16){0};
    for (int64_t j = 0; j < blocks; j++) {
        const T *values = v_cache + ((int64_t)table[j] * kv_heads + kh) * block_elems;
        int64_t count = len - j * block_size < block_size ? len - j * block_size : block_size;
        for (int64_t i = 0; i < count; i++) {
            f32x16 row[16];
            for (int64_t c = 0; c < chunks; c++) row[c] = LOAD16(values + i * dim + c * 16);
            for (int64_t g = 0; g < group; g++) {
                float p = scores[g * padded + j * block_size + i];
                for (int64_t c = 0; c < chunks; c++) acc[g * chunks + c] += p * row[c];
            }
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < dim; d++) out[(kh * group + g) * dim + d] = STORE(acc[g * chunks + d / 16][d % 16]);
}

/* Decode attention over rows [first, last) of the batch, with its own scratch. */
static void NAME(attend_rows)(const struct decode_job *job, int64_t first, int64_t last) {
    const T *q = job->q, *k_cache = job->k_cache, *v_cache = job->v_cache;
    int64_t heads = job->heads, kv_heads = job->kv_heads, dim = job->dim, group = heads / kv_heads, chunks = dim / 16;
    float *scores = malloc(sizeof(float) * group * job->table_width * job->block_size + sizeof(float) * group * dim);
    float *query = scores + group * job->table_width * job->block_size;
    f32x16 *acc = aligned_alloc(sizeof(f32x16), sizeof(f32x16) * group * chunks);
    for (int64_t b = first; b < last; b++) {
        const T *qb = q + b * job->q_stride;
        const int32_t *table = job->block_table + b * job->table_width;
        T *ob = (T *)job->out + b * heads * dim;
        int64_t len = job->lengths[b];
        for (int64_t kh = 0; kh < kv_heads; kh++) {
            /* Constant group and head sizes for the common shapes keep the accumulators in registers. */
#define ATTEND(G, C) NAME(attend_group)(qb, k_cache, v_cache, table, len, ob, kh, G, kv_heads, job->block_size, \
                                        job->scale, C, scores, query, acc)
#define ATTEND_IF(G, C) if (group == G && chunks == C) { ATTEND(G, C); continue; }
            ATTEND_IF(1, 4) ATTEND_IF(2, 4) ATTEND_IF(3, 4) ATTEND_IF(4, 4) ATTEND_IF(6, 4) ATTEND_IF(8, 4)
            ATTEND_IF(1, 8) ATTEND_IF(2, 8) ATTEND_IF(3, 8) ATTEND_IF(4, 8) ATTEND_IF(5, 8) ATTEND_IF(6, 8)
            ATTEND_IF(7, 8) ATTEND_IF(8, 8)
            ATTEND(group, chunks);
#undef ATTEND_IF
#undef ATTEND
        }
    }
    free(acc);
    free(scores);
}

static void *NAME(attend_part)(void *arg) {
    struct decode_part *part = arg;
    NAME(attend_rows)(part->job, part->first, part->last);
    return NULL;
}

/* One query token per sequence attending to its whole paged context.
 * q: [batch, heads, dim] (rows q_stride apart); caches in rope_store's layout (block_size
 * a multiple of 16, heads / kv_heads at most MAX_GROUP);
 * block_table: [batch, table_width]; lengths: context tokens per sequence (the new
 * token included); out: [batch, heads, dim] contiguous. dim is a multiple of 16 and at
 * most 256. Query heads are grouped over the kv heads (GQA): each cached vector is
 * loaded once for its whole group. With threads > 1 and enough work, the rows are split into
 * parts of about equal context, one per thread. */
void NAME(decode_attention)(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,
                            const int32_t *block_table, int64_t table_width, const int64_t *lengths,
                            T *out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                            int64_t block_size, float scale, int64_t threads) {
    struct decode_job job = {q, q_stride, k_cache, v_cache, block_table, table_width, lengths, out,
                             heads, kv_heads, dim, block_size, scale};
    int64_t total = 0;
    for (int64_t b = 0; b < batch; b++) total += lengths[b];
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > batch) threads = batch;
    if (threads <= 1 || total * heads < PARALLEL_MIN_WORK) {
        NAME(attend_rows)(&job, 0, batch);
        return;
    }
    struct decode_part parts[MAX_THREADS];
    pthread_t workers[MAX_THREADS];
    int64_t row = 0, done = 0;
    for (int64_t p = 0; p < threads; p++) {
        parts[p] = (struct decode_part){&job, row, row};
        int64_t target = total * (p + 1) / threads;
        while (parts[p].last < batch && (p == threads - 1 || done < target)) done += lengths[parts[p].last++];
        row = parts[p].last;
    }
    int started[MAX_THREADS] = {0};
    for (int64_t p = 1; p < threads; p++)
        started[p] = pthread_create(&workers[p], NULL, NAME(attend_part), &parts[p]) == 0;
    NAME(attend_rows)(&job, parts[0].first, parts[0].last);
    for (int64_t p = 1; p < threads; p++) {
        if (started[p])
            pthread_join(workers[p], NULL);
        else
            NAME(attend_rows)(&job, parts[p].first, parts[p].last); /* no thread: do it here */
    }
}

#undef NAME
