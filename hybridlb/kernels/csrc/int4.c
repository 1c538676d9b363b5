/* 4-bit weight-only matmul with bfloat16 activations (hybridlb/model/quantized.py, Int4Linear):
 * out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), w[n, k] = scale[n, g] * code[n, k] + low[n, g]
 * for the group g = k / 32 of 32 inputs, code 0..15: GGUF's Q4_0 and Q4_1 blocks exactly (their
 * scale and low are float16 in the file, and float16 here).
 *
 * At batch 1 a step streams every weight once, so 4-bit codes read a quarter of bfloat16's bytes
 * (plus 4 bytes of scale and low per 32). They are multiplied as bytes, as llama.cpp multiplies its
 * 4-bit blocks, but with more of the inputs' precision: each row's inputs are first rounded per
 * group of 32 to two int8 digits, x = a (hi + lo / 254) with a = max |x| / 127 (within a / 508, about
 * float16's precision; llama.cpp's Q8_0 is the hi digit alone), and AVX-512 VNNI's vpdpbusd
 * multiplies 64 codes (unsigned bytes, masked out of their nibbles in place) by 64 digits at once.
 * Per group,
 *   sum_k x w = scale * a * (sum_k hi c + sum_k lo c / 254) + low * sum_k x,
 * with each row's exact group sums of x computed alongside. The first version made each code a
 * bfloat16 value 1 + c / 16 (one shift and one ternary-logic instruction per 32) for vdpbf16ps:
 * more instructions per weight, and a batch-1 step is bound by them, not by memory (the Xeon's
 * 480 MiB L3 holds SmolLM2's 66 MB of 4-bit projections). SmolLM2's 120 projections at batch 1, two
 * threads: 2.3 ms that way, 2.0 ms with two digits, 1.6 ms with the hi digit alone, which moved the
 * greedy tokens (bfloat16: 3 of 8 prompts kept their 16 tokens against the dequantizing engine;
 * with two digits 8 of 8, as before). The codes go in panels of 16 output columns
 * (bf16.c's layout, four bit planes to a word): per panel and group one 320-byte block,
 *   words[line][column][2]: line 0..3 covers inputs 8 line .. 8 line + 7, the word of (column,
 *   e) holding the codes of inputs 8 line + 2 j + e in its bits 4 j .. 4 j + 3, j = 0..3;
 *   then scale[16] and low[16] as float16;
 * a panel is one contiguous stream, read once, in order, prefetched ahead. Four panels go against
 * one input row at once (more of the stream in flight: 8 % faster than two), two against up to
 * ROWS rows; more rows go round again over the same panels (then in L2); the panels are split over torch's OpenMP pool. One rounding per output element.
 *
 * With AMX tiles (amx.h) in use, from int4_amx_min_rows() rows up (hybridlb/kernels: 10; below, the
 * vpdpbusd path is faster than the conversion every call makes) each thread turns a pair of
 * panels at a time (a code as the bfloat16 value 1 + c / 16, see plane()) into bfloat16 weights
 * scale * code + low (one rounding, as a dequantizing
 * engine's weights) in bf16.c's layout, in a buffer that stays in L2, and multiplies all the
 * rows with them on tiles: the codes are still read once, and the multiplies run at tile rate.
 *
 * Without AVX-512 BF16 and VNNI int4_matmul_supported() is 0 and quantized.py keeps torch's 4-bit kernel.
 * n must be a multiple of PANEL and k of INT4_GROUP (quantized.py checks). */

#include "amx.h"
#include "panels.h"
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#include <immintrin.h>
#define INT4_DOT 1
#endif

#define PANELS 4  /* panels multiplied at once: 4 for one row, else 2 */
#define ROWS 4    /* input rows at once against two panels (hi and lo sums, totals: 24 registers; 4 code vectors) */
#define BLOCK_BYTES (INT4_GROUP * PANEL / 2 + 2 * PANEL * 2) /* 256 bytes of codes, 64 of scale and low */
#define PREFETCH 1280

static int64_t int4_tile_rows = 0; /* tiles from this many rows up, where amx.h's are in use; 0: never */

void int4_amx_min_rows(int64_t rows) { int4_tile_rows = rows; }

int64_t int4_matmul_supported(void) {
#ifdef INT4_DOT
    return 1;
#else
    return 0;
#endif
}

#ifdef INT4_DOT
/* Bit plane j of 32 words of codes as the bfloat16 values 1 + code / 16. */
static inline __m512bh plane(__m512i words, int j) {
    __m512i shifted = j == 0 ? _mm512_slli_epi16(words, 3) : _mm512_srli_epi16(words, 4 * j - 3);
    /* (shifted & 0x0078) | 0x3F80 */
    return (__m512bh)_mm512_ternarylogic_epi32(shifted, _mm512_set1_epi16(0x0078), _mm512_set1_epi16(0x3F80), 0xEA);
}

/* Each row's inputs per group of 32 as two int8 digits: t = x / a with a = max |x| / 127, then
 * hi = round(t) and lo = round((t - hi) * 254), so x = a (hi + lo / 254) within a / 508 (about
 * float16's precision, finer than the bfloat16 the inputs come in); per line of 8 inputs 16 bytes,
 * hi then lo, each in the order its codes come out of their dwords (int4_block): 0, 4, 1, 5, 2, 6,
 * 3, 7. Also each group's a (xscale[g]) and exact sum (xsum[g]). */
static void int4_quantize_row(const uint16_t *x, int8_t *xq, float *xscale, float *xsum, int64_t groups) {
    const __m128i order = _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    for (int64_t g = 0; g < groups; g++) {
        __m512 a = (__m512)load16_bf16(x + g * INT4_GROUP), b = (__m512)load16_bf16(x + g * INT4_GROUP + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        xsum[g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
        xscale[g] = amax / 127.0f;
        __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        for (int half = 0; half < 2; half++) { /* inputs 0-15 (lines 0, 1), then 16-31 (lines 2, 3) */
            __m512 t = _mm512_mul_ps(half ? b : a, inverse);
            __m512 hi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m512 lo = _mm512_mul_ps(_mm512_sub_ps(t, hi), _mm512_set1_ps(254.0f));
            __m128i hi8 = _mm_shuffle_epi8(_mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(hi)), order);
            __m128i lo8 = _mm_shuffle_epi8(_mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(lo)), order);
            int8_t *to = xq + 2 * (g * INT4_GROUP + 16 * half);
            _mm_storeu_si128((__m128i *)to, _mm_unpacklo_epi64(hi8, lo8));
            _mm_storeu_si128((__m128i *)(to + 16), _mm_unpackhi_epi64(hi8, lo8));
        }
    }
}

/* Rows [0, R) times panels [first, first + C), R and C constants after inlining. A line's 64 bytes
 * are one dword per column holding its 8 codes; masking the nibbles in place and after a shift of 4
 * gives two vectors of one byte per code, inputs (0, 4, 1, 5) and (2, 6, 3, 7) of the line in each
 * column's dword, and vpdpbusd multiplies them, unsigned, by each digit of the row's inputs in that
 * order (broadcast), summing each column's four into its lane. Per group the integer sums become
 * scale * a * (hi_sum + lo_sum / 254) + low * xsum. */
static inline __attribute__((always_inline)) void int4_block(const int8_t *xq, int64_t k, const float *xscale,
                                                             const float *xsum, const uint8_t *packed,
                                                             const uint16_t *bias, uint16_t *out, int64_t n,
                                                             int64_t first, const int R, const int C) {
    int64_t groups = k / INT4_GROUP;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512 total[ROWS][PANELS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) total[r][c] = _mm512_setzero_ps();
    const uint8_t *stream[PANELS];
    for (int c = 0; c < C; c++) stream[c] = packed + (first + c) * groups * BLOCK_BYTES;
    for (int64_t g = 0; g < groups; g++) {
        __m512i high_sums[ROWS][PANELS], low_sums[ROWS][PANELS];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) high_sums[r][c] = low_sums[r][c] = _mm512_setzero_si512();
        for (int line = 0; line < 4; line++) {
            const int8_t *xs = xq + 2 * (g * INT4_GROUP + 8 * line);
            for (int c = 0; c < C; c++) {
                _mm_prefetch((const char *)stream[c] + PREFETCH + 64 * line, _MM_HINT_T0);
                __m512i words = _mm512_loadu_si512(stream[c] + 64 * line);
                __m512i first4 = _mm512_and_si512(words, nibble);
                __m512i second4 = _mm512_and_si512(_mm512_srli_epi32(words, 4), nibble);
                for (int r = 0; r < R; r++) {
                    int32_t digits[4];
                    memcpy(digits, xs + 2 * r * k, sizeof digits);
                    high_sums[r][c] = _mm512_dpbusd_epi32(high_sums[r][c], first4, _mm512_set1_epi32(digits[0]));
                    high_sums[r][c] = _mm512_dpbusd_epi32(high_sums[r][c], second4, _mm512_set1_epi32(digits[1]));
                    low_sums[r][c] = _mm512_dpbusd_epi32(low_sums[r][c], first4, _mm512_set1_epi32(digits[2]));
                    low_sums[r][c] = _mm512_dpbusd_epi32(low_sums[r][c], second4, _mm512_set1_epi32(digits[3]));
                }
            }
        }
        for (int c = 0; c < C; c++) {
            const uint8_t *meta = stream[c] + INT4_GROUP * PANEL / 2;
            __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)meta));
            __m512 low = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(meta + 2 * PANEL)));
            for (int r = 0; r < R; r++) {
                __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(low_sums[r][c]), _mm512_set1_ps(1.0f / 254.0f),
                                             _mm512_cvtepi32_ps(high_sums[r][c]));
                __m512 step = _mm512_mul_ps(scale, _mm512_set1_ps(xscale[r * groups + g]));
                total[r][c] = _mm512_fmadd_ps(step, sum, total[r][c]);
                total[r][c] = _mm512_fmadd_ps(low, _mm512_set1_ps(xsum[r * groups + g]), total[r][c]);
            }
            stream[c] += BLOCK_BYTES;
        }
    }
    for (int c = 0; c < C; c++) {
        __m512 add = _mm512_setzero_ps();
        if (bias) add = (__m512)load16_bf16(bias + (first + c) * PANEL);
        for (int r = 0; r < R; r++)
            _mm256_storeu_si256((void *)(out + r * n + (first + c) * PANEL),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(total[r][c], add)));
    }
}

#define BLOCK(R, C) int4_block(xq + 2 * r0 * k, k, xscale + r0 * groups, xsum + r0 * groups, packed, bias, out + r0 * n, \
                               n, first, R, C)
#define BY_ROWS(C) switch (rows) { \
    case 1: BLOCK(1, C); break; case 2: BLOCK(2, C); break; case 3: BLOCK(3, C); break; default: BLOCK(4, C); }

static void int4_panels(const int8_t *xq, const float *xscale, const float *xsum, const uint8_t *packed,
                        const uint16_t *bias, uint16_t *out, int64_t m, int64_t n, int64_t k, int64_t begin,
                        int64_t end) {
    int64_t groups = k / INT4_GROUP;
    if (m == 1) { /* one row: four panels at a time, more of the stream in flight */
        int64_t r0 = 0;
        for (int64_t first = begin; first < end; first += 4) {
            switch (end - first < 4 ? end - first : 4) {
            case 1: BLOCK(1, 1); break; case 2: BLOCK(1, 2); break; case 3: BLOCK(1, 3); break; default: BLOCK(1, 4);
            }
        }
        return;
    }
    FOR_BLOCKS(begin, end, 2, m, ROWS) {
        if (count == 1) {
            BY_ROWS(1)
        } else {
            BY_ROWS(2)
        }
    }
}
#undef BY_ROWS
#undef BLOCK
#endif

#if defined(INT4_DOT) && defined(AMX_TILES)
/* One panel's weights scale * code + low, rounded once to bfloat16, in bf16.c's layout
 * to[pair][column][2] over all k inputs. */
static void int4_dequantize(const uint8_t *stream, uint16_t *to, int64_t k) {
    const __m512i lower = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i upper = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    const __m512 sixteen = _mm512_set1_ps(16.0f);
    for (int64_t g = 0; g < k / INT4_GROUP; g++, stream += BLOCK_BYTES) {
        const uint8_t *meta = stream + INT4_GROUP * PANEL / 2;
        __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)meta));
        __m512 low = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(meta + 2 * PANEL)));
        /* a plane's 32 lanes are (column, e) pairs: float lanes 0-15 are columns 0-7, 16-31 columns 8-15 */
        __m512 scale0 = _mm512_permutexvar_ps(lower, scale), scale1 = _mm512_permutexvar_ps(upper, scale);
        __m512 low0 = _mm512_permutexvar_ps(lower, low), low1 = _mm512_permutexvar_ps(upper, low);
        for (int line = 0; line < 4; line++) {
            __m512i words = _mm512_loadu_si512(stream + 64 * line);
            for (int j = 0; j < 4; j++) {
                __m512i v = (__m512i)plane(words, j); /* 1 + code / 16 */
                __m512 v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
                __m512 v1 = _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
                __m512 w0 = _mm512_fmadd_ps(scale0, _mm512_fmsub_ps(v0, sixteen, sixteen), low0);
                __m512 w1 = _mm512_fmadd_ps(scale1, _mm512_fmsub_ps(v1, sixteen, sixteen), low1);
                _mm512_storeu_si512(to + (g * 16 + 4 * line + j) * PANEL * 2, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
            }
        }
    }
}

/* Panels [begin, end) for all m rows: two panels at a time into bfloat16, then tiles (amx.h). */
static void int4_tiles(const uint16_t *x, int64_t x_stride, const uint8_t *packed, const uint16_t *bias,
                       uint16_t *out, int64_t m, int64_t n, int64_t k, int64_t begin, int64_t end) {
    int64_t groups = k / INT4_GROUP, panel_elements = k * PANEL;
    uint16_t *weights = aligned_alloc(64, sizeof(uint16_t) * 2 * panel_elements);
    int configured = 0;
    for (int64_t p = begin; p < end; p += 2) {
        int panels = end - p >= 2 ? 2 : 1;
        for (int c = 0; c < panels; c++)
            int4_dequantize(packed + (p + c) * groups * BLOCK_BYTES, weights + c * panel_elements, k);
        amx_rows(x, x_stride, (const char *)weights, panel_elements * 2, bias ? bias + p * PANEL : NULL, out, 0, m,
                 n, k, p * PANEL, panels, &configured);
    }
    _tile_release();
    free(weights);
}
#endif

/* out [m, n] bfloat16 (contiguous) = x [m, k] bfloat16 (rows x_stride apart) @ w^T + bias (may be
 * NULL), w packed as above. Does nothing where int4_matmul_supported() is 0. */
void int4_matmul(const uint16_t *x, int64_t x_stride, const uint8_t *packed, const uint16_t *bias, uint16_t *out,
                 int64_t m, int64_t n, int64_t k, int64_t threads) {
#ifdef INT4_DOT
    int64_t panels = n / PANEL, groups = k / INT4_GROUP;
    if (m <= 0) return;
    if (threads > panels) threads = panels;
#ifdef AMX_TILES
    if (hybridlb_amx_min_rows && int4_tile_rows && m >= int4_tile_rows) {
#define RUN(begin, end) int4_tiles(x, x_stride, packed, bias, out, m, n, k, begin, end)
        SPLIT_PANELS(RUN, panels, threads, m, n, k);
#undef RUN
        return;
    }
#endif
    float *xsum = malloc(sizeof(float) * 2 * m * groups), *xscale = xsum + m * groups;
    int8_t *xq = malloc(2 * m * k);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && m * k >= 4 * PARALLEL_MIN_ELEMENTS)
    for (int64_t i = 0; i < m; i++)
        int4_quantize_row(x + i * x_stride, xq + 2 * i * k, xscale + i * groups, xsum + i * groups, groups);
#define RUN(begin, end) int4_panels(xq, xscale, xsum, packed, bias, out, m, n, k, begin, end)
    SPLIT_PANELS(RUN, panels, threads, m, n, k);
#undef RUN
    free(xq);
    free(xsum);
#else
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)out, (void)m, (void)n, (void)k, (void)threads;
#endif
}
