/* The int8 matmul for one activation dtype: T, LOAD, STORE, SUFFIX. Included by int8.c. */

#define NAME(name) CAT(name, SUFFIX)

/* out [m, n] (contiguous) = x [m, k] (rows x_stride apart) @ (codes [n, k] * scale [n])^T + bias [n]
 * (bias may be NULL); scale and bias in T; code_sums [n]: each row's sum of codes. */
void NAME(int8_matmul)(const T *x, int64_t x_stride, const int8_t *codes, const int32_t *code_sums, const T *scale,
                       const T *bias, T *out, int64_t m, int64_t n, int64_t k, int64_t threads) {
    float *xf = malloc(sizeof(float) * m * k + sizeof(float) * m + 2 * m * k);
    float *row_scale = xf + m * k;
    uint8_t *bytes = (uint8_t *)(row_scale + m);
    for (int64_t i = 0; i < m; i++)
        for (int64_t c = 0; c < k; c++) xf[i * k + c] = LOAD(x[i * x_stride + c]);
#ifdef INT8_VNNI
    quantize_rows(xf, m, k, bytes, row_scale);
#endif
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n * k >= PARALLEL_MIN_ELEMENTS)
    for (int64_t tile = 0; tile < n / NTILE; tile++) {
        float products[MTILE * NTILE];
        int64_t n0 = tile * NTILE;
        for (int64_t i0 = 0; i0 < m; i0 += MTILE) {
            int64_t rows = m - i0 < MTILE ? m - i0 : MTILE;
            int8_products(xf, bytes, row_scale, codes, code_sums, k, i0, rows, n0, products);
            for (int64_t i = 0; i < rows; i++)
                for (int64_t j = 0; j < NTILE; j++) {
                    float value = products[i * NTILE + j] * LOAD(scale[n0 + j]);
                    if (bias) value += LOAD(bias[n0 + j]);
                    out[(i0 + i) * n + n0 + j] = STORE(value);
                }
        }
    }
    free(xf);
}

#undef NAME
