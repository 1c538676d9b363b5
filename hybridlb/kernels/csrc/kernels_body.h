/* Kernel bodies for one dtype: T (storage), LOAD / STORE (to and from float),
 * ROUND (float rounded through T), their 16-lane forms LOAD16 / STORE16 / ROUND16, SUFFIX
 * (name suffix). Included by kernels.c. */

#define NAME(name) CAT(name, SUFFIX)

/* out = weight * norm(x), or, with residual: residual = x + residual, out = weight * norm(residual).
 * Rows of x are `stride` elements apart; residual and out are contiguous. */
void NAME(rms_norm)(const T *x, int64_t stride, T *residual, const T *weight, T *out,
                    int64_t rows, int64_t hidden, float eps, int64_t threads) {
    int64_t whole = hidden / 16 * 16;
#pragma omp parallel num_threads(threads) if (threads > 1 && rows * hidden >= PARALLEL_MIN_ELEMENTS)
    {
    float *row = malloc(sizeof(float) * hidden);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const T *xr = x + r * stride;
        T *rr = residual ? residual + r * hidden : NULL;
        f32x16 squares = {0};
        for (int64_t i = 0; i < whole; i += 16) {
            f32x16 v = LOAD16(xr + i);
            if (rr) {
                v = ROUND16(v + LOAD16(rr + i));
                STORE16(rr + i, v);
            }
            store16_f32(row + i, v);
            squares += v * v;
        }
        float lanes[16];
        memcpy(lanes, &squares, sizeof lanes);
        for (int64_t i = whole; i < hidden; i++) {
            float v = LOAD(xr[i]);
            if (rr) {
                v = ROUND(v + LOAD(rr[i]));
                rr[i] = STORE(v);
            }
            row[i] = v;
            lanes[i % 16] += v * v;
        }
        float scale = 1.0f / sqrtf(sum16(lanes) / (float)hidden + eps);
        T *orow = out + r * hidden;
        for (int64_t j = 0; j < whole; j += 16)
            STORE16(orow + j, LOAD16(weight + j) * ROUND16(load16_f32(row + j) * scale));
        for (int64_t j = whole; j < hidden; j++) orow[j] = STORE(LOAD(weight[j]) * ROUND(row[j] * scale));
    }
    free(row);
    }
}

/* Rotate-half RoPE applied in place to q [n, heads, dim] and k [n, kv_heads, dim]
 * (rows `q_stride` / `k_stride` elements apart), then k and v stored at slots[i] of
 * the paged caches, [blocks, kv_heads, dim * block_size] each, in the attention's layout
 * (KEY_AT, VALUE_AT): float32 keys [dim][block_size] (each head's block transposed, so 16
 * tokens of one dimension are one vector) and values [block_size][dim]; bfloat16 keys
 * [dim / 2][block_size][2] and values [block_size / 2][dim][2] (pairs side by side for
 * vdpbf16ps, see attention_bf16.h). cos/sin: float tables [positions, dim]. */
void NAME(rope_store)(T *q, int64_t q_stride, T *k, int64_t k_stride, const T *v, int64_t v_stride,
                      const int64_t *positions, const float *cos_table, const float *sin_table,
                      const int64_t *slots, T *k_cache, T *v_cache, int64_t n, int64_t heads,
                      int64_t kv_heads, int64_t dim, int64_t block_size, int64_t threads) {
    int64_t half = dim / 2;
#pragma omp parallel num_threads(threads) if (threads > 1 && n * (heads + kv_heads) * dim >= PARALLEL_MIN_ELEMENTS)
    {
    float *c = malloc(sizeof(float) * dim * 3);
    float *s = c + dim, *x = c + 2 * dim;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n; t++) {
        const float *ct = cos_table + positions[t] * dim, *st = sin_table + positions[t] * dim;
        for (int64_t d = 0; d < dim; d++) {
            c[d] = ROUND(ct[d]);
            s[d] = ROUND(st[d]);
        }
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            T *head = h < heads ? q + t * q_stride + h * dim : k + t * k_stride + (h - heads) * dim;
            if (half % 16 == 0) {
                for (int64_t d = 0; d < half; d += 16) {
                    f32x16 first = LOAD16(head + d), second = LOAD16(head + d + half);
                    f32x16 c1 = load16_f32(c + d), s1 = load16_f32(s + d);
                    f32x16 c2 = load16_f32(c + d + half), s2 = load16_f32(s + d + half);
                    STORE16(head + d, ROUND16(first * c1) + ROUND16(-second * s1));
                    STORE16(head + d + half, ROUND16(second * c2) + ROUND16(first * s2));
                }
                continue;
            }
            for (int64_t d = 0; d < dim; d++) x[d] = LOAD(head[d]);
            for (int64_t d = 0; d < half; d++)
                head[d] = STORE(ROUND(x[d] * c[d]) + ROUND(-x[d + half] * s[d]));
            for (int64_t d = half; d < dim; d++)
                head[d] = STORE(ROUND(x[d] * c[d]) + ROUND(x[d - half] * s[d]));
        }
        int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
        for (int64_t h = 0; h < kv_heads; h++) {
            const T *key = k + t * k_stride + h * dim, *value = v + t * v_stride + h * dim;
            T *keys = k_cache + (block * kv_heads + h) * dim * block_size;
            T *values = v_cache + (block * kv_heads + h) * dim * block_size;
            for (int64_t d = 0; d < dim; d++) {
                keys[KEY_AT(d, offset, dim, block_size)] = key[d];
                values[VALUE_AT(offset, d, dim, block_size)] = value[d];
            }
        }
    }
    free(c);
    }
}

/* out [n, inter] = silu(gate) * up, where x [n, 2 * inter] holds gate then up per row. */
void NAME(silu_mul)(const T *restrict x, T *restrict out, int64_t n, int64_t inter, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n * inter >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < n; r++) {
        const T *restrict gate = x + r * 2 * inter, *restrict up = gate + inter;
        T *restrict o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) o[i] = STORE(ROUND(silu(LOAD(gate[i]))) * LOAD(up[i]));
    }
}

#undef NAME
