/* Kernel bodies for one dtype: T (storage), LOAD / STORE (to and from float),
 * ROUND (float rounded through T), SUFFIX (name suffix). Included by kernels.c. */

#define NAME(name) CAT(name, SUFFIX)

/* out = weight * norm(x), or, with residual: residual = x + residual, out = weight * norm(residual).
 * Rows of x are `stride` elements apart; residual and out are contiguous. */
void NAME(rms_norm)(const T *x, int64_t stride, T *residual, const T *weight, T *out,
                    int64_t rows, int64_t hidden, float eps) {
    float *row = malloc(sizeof(float) * hidden);
    for (int64_t r = 0; r < rows; r++) {
        const T *xr = x + r * stride;
        float lanes[16] = {0};
        if (residual) {
            T *rr = residual + r * hidden;
            for (int64_t i = 0; i < hidden; i++) {
                float v = ROUND(LOAD(xr[i]) + LOAD(rr[i]));
                rr[i] = STORE(v);
                row[i] = v;
            }
        } else {
            for (int64_t i = 0; i < hidden; i++) row[i] = LOAD(xr[i]);
        }
        int64_t i = 0;
        for (; i + 16 <= hidden; i += 16)
            for (int l = 0; l < 16; l++) lanes[l] += row[i + l] * row[i + l];
        for (; i < hidden; i++) lanes[i % 16] += row[i] * row[i];
        float scale = 1.0f / sqrtf(sum16(lanes) / (float)hidden + eps);
        T *orow = out + r * hidden;
        for (int64_t j = 0; j < hidden; j++) orow[j] = STORE(LOAD(weight[j]) * ROUND(row[j] * scale));
    }
    free(row);
}

/* Rotate-half RoPE applied in place to q [n, heads, dim] and k [n, kv_heads, dim]
 * (rows `q_stride` / `k_stride` elements apart), then k and v stored into the paged
 * caches [slots, kv_heads, dim] at slots[i]. cos/sin: float tables [positions, dim]. */
void NAME(rope_store)(T *q, int64_t q_stride, T *k, int64_t k_stride, const T *v, int64_t v_stride,
                      const int64_t *positions, const float *cos_table, const float *sin_table,
                      const int64_t *slots, T *k_cache, T *v_cache, int64_t n, int64_t heads,
                      int64_t kv_heads, int64_t dim) {
    int64_t half = dim / 2;
    float *c = malloc(sizeof(float) * dim * 3);
    float *s = c + dim, *x = c + 2 * dim;
    for (int64_t t = 0; t < n; t++) {
        const float *ct = cos_table + positions[t] * dim, *st = sin_table + positions[t] * dim;
        for (int64_t d = 0; d < dim; d++) {
            c[d] = ROUND(ct[d]);
            s[d] = ROUND(st[d]);
        }
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            T *head = h < heads ? q + t * q_stride + h * dim : k + t * k_stride + (h - heads) * dim;
            for (int64_t d = 0; d < dim; d++) x[d] = LOAD(head[d]);
            for (int64_t d = 0; d < half; d++)
                head[d] = STORE(ROUND(x[d] * c[d]) + ROUND(-x[d + half] * s[d]));
            for (int64_t d = half; d < dim; d++)
                head[d] = STORE(ROUND(x[d] * c[d]) + ROUND(x[d - half] * s[d]));
        }
        size_t row = sizeof(T) * kv_heads * dim;
        memcpy(k_cache + slots[t] * kv_heads * dim, k + t * k_stride, row);
        memcpy(v_cache + slots[t] * kv_heads * dim, v + t * v_stride, row);
    }
    free(c);
}

/* Attention of one sequence's `group` query heads (sharing kv head kh) over its `len`
 * cached tokens. Inlined per head size so that `chunks` is a constant there. */
static inline __attribute__((always_inline)) void NAME(attend_group)(
        const T *q, const T *k_cache, const T *v_cache, const int32_t *table, int64_t len, T *out,
        int64_t kh, int64_t group, int64_t kv_heads, int64_t block_size, float scale, const int64_t chunks,
        float *scores, f32x16 *query, f32x16 *acc) {
    int64_t dim = chunks * 16;
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < chunks; c++) query[g * chunks + c] = LOAD16(q + (kh * group + g) * dim + c * 16) * scale;
    for (int64_t t = 0; t < len; t++) {
        const T *key = k_cache + ((table[t / block_size] * block_size + t % block_size) * kv_heads + kh) * dim;
        f32x16 row[16];
        for (int64_t c = 0; c < chunks; c++) row[c] = LOAD16(key + c * 16);
        for (int64_t g = 0; g < group; g++) {
            f32x16 dot = query[g * chunks] * row[0];
            for (int64_t c = 1; c < chunks; c++) dot += query[g * chunks + c] * row[c];
            scores[g * len + t] = hsum16(dot);
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * len, top = -INFINITY, total = 0.0f;
        for (int64_t t = 0; t < len; t++) top = sg[t] > top ? sg[t] : top;
        for (int64_t t = 0; t < len; t++) {
            sg[t] = fast_exp(sg[t] - top);
            total += sg[t];
        }
        for (int64_t t = 0; t < len; t++) sg[t] /= total;
    }
    for (int64_t i = 0; i < group * chunks; i++) acc[i] = (f32x16){0};
    for (int64_t t = 0; t < len; t++) {
        const T *value = v_cache + ((table[t / block_size] * block_size + t % block_size) * kv_heads + kh) * dim;
        f32x16 row[16];
        for (int64_t c = 0; c < chunks; c++) row[c] = LOAD16(value + c * 16);
        for (int64_t g = 0; g < group; g++) {
            float p = scores[g * len + t];
            for (int64_t c = 0; c < chunks; c++) acc[g * chunks + c] += p * row[c];
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < dim; d++) out[(kh * group + g) * dim + d] = STORE(acc[g * chunks + d / 16][d % 16]);
}

/* One query token per sequence attending to its whole paged context.
 * q: [batch, heads, dim] (rows q_stride apart); caches: [blocks, block_size, kv_heads, dim];
 * block_table: [batch, table_width]; lengths: context tokens per sequence (the new
 * token included); out: [batch, heads, dim] contiguous. dim is a multiple of 16 and at
 * most 256. Query heads are grouped over the kv heads (GQA): each cached row is loaded
 * once for its whole group. */
void NAME(decode_attention)(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,
                            const int32_t *block_table, int64_t table_width, const int64_t *lengths,
                            T *out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                            int64_t block_size, float scale) {
    int64_t group = heads / kv_heads, chunks = dim / 16, longest = 0;
    for (int64_t b = 0; b < batch; b++) longest = lengths[b] > longest ? lengths[b] : longest;
    float *scores = malloc(sizeof(float) * group * longest);
    f32x16 *query = aligned_alloc(sizeof(f32x16), sizeof(f32x16) * 2 * group * chunks), *acc = query + group * chunks;
    for (int64_t b = 0; b < batch; b++) {
        const T *qb = q + b * q_stride;
        const int32_t *table = block_table + b * table_width;
        T *ob = out + b * heads * dim;
        for (int64_t kh = 0; kh < kv_heads; kh++) {
            if (chunks == 4)
                NAME(attend_group)(qb, k_cache, v_cache, table, lengths[b], ob, kh, group, kv_heads, block_size, scale, 4, scores, query, acc);
            else if (chunks == 8)
                NAME(attend_group)(qb, k_cache, v_cache, table, lengths[b], ob, kh, group, kv_heads, block_size, scale, 8, scores, query, acc);
            else
                NAME(attend_group)(qb, k_cache, v_cache, table, lengths[b], ob, kh, group, kv_heads, block_size, scale, chunks, scores, query, acc);
        }
    }
    free(query);
    free(scores);
}

/* out [n, inter] = silu(gate) * up, where x [n, 2 * inter] holds gate then up per row. */
void NAME(silu_mul)(const T *restrict x, T *restrict out, int64_t n, int64_t inter) {
    for (int64_t r = 0; r < n; r++) {
        const T *restrict gate = x + r * 2 * inter, *restrict up = gate + inter;
        T *restrict o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) o[i] = STORE(ROUND(silu(LOAD(gate[i]))) * LOAD(up[i]));
    }
}

#undef NAME
