/* Weight-only int8 matmul for the few rows of a decode step (hybridlb/model/quantized.py,
 * Int8Linear): out[m, n] = scale[n] * sum_k x[m, k] * codes[n, k] (+ bias[n]), codes int8
 * [n, k] row-major with one scale per output row.
 *
 * At batch 1-8 a decode step streams every weight once and does little with each, so the
 * bytes read are what counts, and the work per byte must stay below what the memory delivers.
 * Widening each code to float costs three vector instructions per 16 codes, which on this
 * machine's cores (~8 bytes a cycle) is slower than streaming bfloat16 weights. With AVX-512
 * VNNI the codes are never widened: each input row is quantized to 16 bits (one scale per row,
 * error under 1 / 65,534 of its largest value) and split into a high and a low byte, and
 * vpdpbusd multiplies 64 codes by 64 bytes into integer sums in one instruction:
 *   x = 256 * high + low, high = high' - 128 (high' and low unsigned, as vpdpbusd takes them), so
 *   x . w = 256 * (high' . w - 128 * sum(w)) + low . w, exact in integers;
 * sum(w) per row comes precomputed (code_sums). Without VNNI, codes are widened to float.
 *
 * Weight rows go in tiles of NTILE; each tile is multiplied into up to MTILE input rows at
 * once, and more input rows go round again over the same tile (then in L1). Output tiles are
 * split over torch's OpenMP pool. One rounding per output element. k must be a multiple of
 * 64 and n of NTILE (kernels.py checks). */

#include "common.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define NTILE 4 /* weight rows per tile */
#define MTILE 2 /* input rows per pass over a tile */
/* Tiles ahead whose codes are requested while one is computed: a tile's rows are short streams
 * (k bytes each) that the hardware prefetcher does not pick up in time. */
#ifndef PREFETCH_TILES
#define PREFETCH_TILES 8
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INT8_VNNI 1

/* Each input row quantized and split: bytes[(2 * i) * k ..] its high' bytes, then its low bytes. */
static void quantize_rows(const float *xf, int64_t m, int64_t k, uint8_t *bytes, float *row_scale) {
    for (int64_t i = 0; i < m; i++) {
        const float *row = xf + i * k;
        float top = 0.0f;
        for (int64_t c = 0; c < k; c++) top = fabsf(row[c]) > top ? fabsf(row[c]) : top;
        float scale = top > 0.0f ? top / 32767.0f : 1.0f, inverse = 1.0f / scale;
        uint8_t *high = bytes + 2 * i * k, *low = high + k;
        for (int64_t c = 0; c < k; c++) {
            int32_t q = (int32_t)lrintf(row[c] * inverse); /* -32767..32767 */
            high[c] = (uint8_t)((q >> 8) + 128);
            low[c] = (uint8_t)(q & 0xff);
        }
        row_scale[i] = scale;
    }
}

static inline int64_t reduce16_i32(__m512i v) { return (int64_t)_mm512_reduce_add_epi32(v); }

/* dots[i * NTILE + j] = x row i . codes row j (the quantized x's integer units). */
static inline __attribute__((always_inline)) void int8_tile(const uint8_t *bytes, const int8_t *codes,
                                                            const int32_t *sums, int64_t k, const int64_t rows,
                                                            int64_t *dots) {
    __m512i high[MTILE][NTILE], low[MTILE][NTILE];
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < NTILE; j++) high[i][j] = low[i][j] = _mm512_setzero_si512();
    for (int64_t c = 0; c < k; c += 64) {
        __m512i w[NTILE];
        for (int64_t j = 0; j < NTILE; j++) {
            w[j] = _mm512_loadu_si512((const void *)(codes + j * k + c));
            __builtin_prefetch(codes + (PREFETCH_TILES * NTILE + j) * k + c); /* never faults, even past the end */
        }
        for (int64_t i = 0; i < rows; i++) {
            __m512i h = _mm512_loadu_si512((const void *)(bytes + 2 * i * k + c));
            __m512i l = _mm512_loadu_si512((const void *)(bytes + (2 * i + 1) * k + c));
            for (int64_t j = 0; j < NTILE; j++) {
                high[i][j] = _mm512_dpbusd_epi32(high[i][j], h, w[j]);
                low[i][j] = _mm512_dpbusd_epi32(low[i][j], l, w[j]);
            }
        }
    }
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < NTILE; j++)
            dots[i * NTILE + j] = 256 * (reduce16_i32(high[i][j]) - 128 * (int64_t)sums[j]) + reduce16_i32(low[i][j]);
}

#else

typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

/* 16 codes widened to floats. GCC turns the generic conversion into byte-by-byte scalar code,
 * so AVX-512 gets its sign-extend and convert instructions by name. */
static inline f32x16 load16_i8(const int8_t *p) {
#if defined(__AVX512F__)
    __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    f32x16 out;
    memcpy(&out, &v, sizeof out);
    return out;
#else
    i8x16 codes;
    memcpy(&codes, p, sizeof codes);
    return __builtin_convertvector(__builtin_convertvector(codes, i32x16), f32x16);
#endif
}

/* sums[i * NTILE + j] = x row i . codes row j, in float. */
static inline __attribute__((always_inline)) void int8_tile_float(const float *x, const int8_t *codes, int64_t k,
                                                                  const int64_t rows, float *sums) {
    f32x16 acc[MTILE][NTILE];
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < NTILE; j++) acc[i][j] = (f32x16){0};
    for (int64_t c = 0; c < k; c += 16) {
        f32x16 w[NTILE];
        for (int64_t j = 0; j < NTILE; j++) w[j] = load16_i8(codes + j * k + c);
        for (int64_t i = 0; i < rows; i++) {
            f32x16 xi = load16_f32(x + i * k + c);
            for (int64_t j = 0; j < NTILE; j++) acc[i][j] += xi * w[j];
        }
    }
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < NTILE; j++) sums[i * NTILE + j] = hsum16(acc[i][j]);
}
#endif

/* The products of `rows` (at most MTILE) input rows from row i0 with the tile of weight rows
 * from n0: products[i * NTILE + j], in x's units (the row scales applied). */
static void int8_products(const float *xf, const uint8_t *bytes, const float *row_scale, const int8_t *codes,
                          const int32_t *code_sums, int64_t k, int64_t i0, int64_t rows, int64_t n0,
                          float *products) {
#ifdef INT8_VNNI
    int64_t dots[MTILE * NTILE];
    const uint8_t *b = bytes + 2 * i0 * k;
    if (rows == 1) int8_tile(b, codes + n0 * k, code_sums + n0, k, 1, dots);
    else int8_tile(b, codes + n0 * k, code_sums + n0, k, 2, dots);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < NTILE; j++) products[i * NTILE + j] = (float)dots[i * NTILE + j] * row_scale[i0 + i];
    (void)xf;
#else
    if (rows == 1) int8_tile_float(xf + i0 * k, codes + n0 * k, k, 1, products);
    else int8_tile_float(xf + i0 * k, codes + n0 * k, k, 2, products);
    (void)bytes, (void)row_scale, (void)code_sums;
#endif
}

#define T float
#define SUFFIX f32
#define LOAD(x) (x)
#define STORE(x) (x)
#include "int8_body.h"
#undef T
#undef SUFFIX
#undef LOAD
#undef STORE

#define T uint16_t
#define SUFFIX bf16
#define LOAD(x) bf16_to_float(x)
#define STORE(x) float_to_bf16(x)
#include "int8_body.h"
