/* The int8 matmul for one activation dtype: T, STORE, LOAD16 (16 T as floats), SUFFIX.
 * Included by int8.c. */

#define NAME(name) CAT(name, SUFFIX)

#ifdef INT8_VNNI
/* Each input row quantized to 16 bits and split (int8.c), into a buffer the caller frees:
 * bytes[2 * i * k ..] its high' bytes, then its low bytes; after the m rows, row_scales(), each
 * row's step. */
static uint8_t *NAME(split_rows)(const T *x, int64_t x_stride, int64_t m, int64_t k, int64_t threads) {
    uint8_t *bytes = malloc(2 * m * k + sizeof(float) * m);
    float *row_scale = row_scales(bytes, m, k);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && m * k >= 4 * PARALLEL_MIN_ELEMENTS)
    for (int64_t i = 0; i < m; i++) {
        const T *row = x + i * x_stride;
        __m512 top = _mm512_setzero_ps();
        for (int64_t c = 0; c < k; c += 16) top = _mm512_max_ps(top, _mm512_abs_ps(LOAD16(row + c)));
        float largest = _mm512_reduce_max_ps(top), scale = largest > 0.0f ? largest / 32767.0f : 1.0f;
        __m512 inverse = _mm512_set1_ps(1.0f / scale);
        uint8_t *high = bytes + 2 * i * k, *low = high + k;
        for (int64_t c = 0; c < k; c += 16) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(LOAD16(row + c), inverse)); /* nearest, ties to even */
            _mm_storeu_si128((__m128i *)(high + c), _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_srai_epi32(q, 8),
                                                                                          _mm512_set1_epi32(128))));
            _mm_storeu_si128((__m128i *)(low + c), _mm512_cvtepi32_epi8(_mm512_and_si512(q, _mm512_set1_epi32(255))));
        }
        row_scale[i] = scale;
    }
    return bytes;
}

/* One row's 16 outputs of a panel: value * column scale + bias, stored as T. */
static inline void NAME(store_row)(T *to, __m512 value, __m512 column_scale, __m512 add) {
    float lanes[PANEL];
    _mm512_storeu_ps(lanes, _mm512_fmadd_ps(value, column_scale, add));
    for (int j = 0; j < PANEL; j++) to[j] = STORE(lanes[j]);
}

#define BLOCK(R, C) int8_block(b, k, packed, code_sums, row_scale + r0, first, R, C, sums)
#define BY_ROWS(C) switch (rows) { case 1: BLOCK(1, C); break; case 2: BLOCK(2, C); break; default: BLOCK(3, C); }

/* Panels [begin, end) for all m rows, in groups of up to PANELS panels and ROWS rows. */
static void NAME(int8_panels)(const uint8_t *bytes, const float *row_scale, const int8_t *packed,
                              const int32_t *code_sums, const T *scale, const T *bias, T *out, int64_t m, int64_t n,
                              int64_t k, int64_t begin, int64_t end) {
    __m512 sums[ROWS][PANELS];
    FOR_BLOCKS(begin, end, PANELS, m, ROWS) {
        const uint8_t *b = bytes + 2 * r0 * k;
        switch (count) {
        case 1: BY_ROWS(1) break;
        case 2: BY_ROWS(2) break;
        case 3: BY_ROWS(3) break;
        default: BY_ROWS(4) break;
        }
        for (int64_t c = 0; c < count; c++) {
            int64_t col = (first + c) * PANEL;
            __m512 column_scale = LOAD16(scale + col);
            __m512 add = bias ? LOAD16(bias + col) : _mm512_setzero_ps();
            for (int64_t r = 0; r < rows; r++) NAME(store_row)(out + (r0 + r) * n + col, sums[r][c], column_scale, add);
        }
    }
}
#undef BY_ROWS
#undef BLOCK

#ifdef INT8_TILES
/* int8_panels on AMX tiles (int8.c): two panels at a time against blocks of up to 16 rows. */
static void NAME(int8_tiles)(const uint8_t *bytes, const float *row_scale, const int8_t *packed,
                             const int32_t *code_sums, const T *scale, const T *bias, T *out, int64_t m, int64_t n,
                             int64_t k, int64_t begin, int64_t end) {
    int64_t panel_bytes = k * PANEL;
    int configured = 0;
    int32_t sums[4][16][16];
    FOR_BLOCKS(begin, end, 2, m, 16) {
        if (configured != rows) amx_configure(configured = (int)rows);
        int8_tile_block(bytes + 2 * r0 * k, k, packed + first * panel_bytes, panel_bytes, (int)count, sums);
        for (int c = 0; c < count; c++) {
            int64_t col = (first + c) * PANEL;
            __m512i sum_w = _mm512_slli_epi32(_mm512_loadu_si512(code_sums + col), 7); /* 128 sum(w) */
            __m512 column_scale = LOAD16(scale + col);
            __m512 add = bias ? LOAD16(bias + col) : _mm512_setzero_ps();
            for (int r = 0; r < rows; r++) {
                __m512 value = int8_value(_mm512_loadu_si512(sums[2 * c][r]), _mm512_loadu_si512(sums[2 * c + 1][r]),
                                          sum_w, row_scale[r0 + r]);
                NAME(store_row)(out + (r0 + r) * n + col, value, column_scale, add);
            }
        }
    }
    _tile_release();
}
#endif
#endif

/* out [m, n] (contiguous) = x [m, k] (rows x_stride apart) @ (codes [n, k] * scale [n])^T + bias [n]
 * (bias may be NULL), the codes packed in panels (int8.c); scale and bias in T; code_sums [n]: each
 * output column's sum of codes. Does nothing where int8_matmul_supported() is 0. */
void NAME(int8_matmul)(const T *x, int64_t x_stride, const int8_t *packed, const int32_t *code_sums, const T *scale,
                       const T *bias, T *out, int64_t m, int64_t n, int64_t k, int64_t threads) {
#ifdef INT8_VNNI
    int64_t panels = n / PANEL;
    if (m <= 0) return;
    uint8_t *bytes = NAME(split_rows)(x, x_stride, m, k, threads);
    const float *row_scale = row_scales(bytes, m, k);
    void (*run)(const uint8_t *, const float *, const int8_t *, const int32_t *, const T *, const T *, T *, int64_t,
                int64_t, int64_t, int64_t, int64_t) = NAME(int8_panels);
#ifdef INT8_TILES
    if (hybridlb_amx_min_rows && m >= hybridlb_amx_min_rows && k % 64 == 0) run = NAME(int8_tiles);
#endif
#define RUN(begin, end) run(bytes, row_scale, packed, code_sums, scale, bias, out, m, n, k, begin, end)
    SPLIT_PANELS(RUN, panels, threads, m, n, k);
#undef RUN
    free(bytes);
#else
    (void)x, (void)x_stride, (void)packed, (void)code_sums, (void)scale, (void)bias, (void)out, (void)m, (void)n,
        (void)k, (void)threads;
#endif
}

#undef NAME
