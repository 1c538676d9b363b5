/* Weight-only int8 matmul (hybridlb/model/quantized.py, Int8Linear):
 * out[m, n] = scale[n] * sum_k x[m, k] * codes[n, k] (+ bias[n]), one scale per output row.
 *
 * The codes are laid out as bf16.c lays out bfloat16 weights, for the instruction that
 * multiplies them: AVX-512 VNNI's vpdpbusd multiplies 64 unsigned bytes by 64 signed bytes and
 * adds each group of 4 products to one of 16 int32 sums. So the codes go in panels of 16
 * output columns, k / 4 quads deep:
 *   packed[panel][quad][column][4] = codes[16 * panel + column][4 * quad + {0..3}]
 * (one 64-byte line per quad and panel; a panel is one contiguous stream, read once, in order,
 * prefetched ahead). The inputs are never rounded to 8 bits: each input row is quantized to 16
 * bits (one scale per row; error at most max|x| / 65,534 per input, far under the int8 weights'
 * own step) and split into a high and a low byte, and each quad of bytes is broadcast against a
 * line of codes:
 *   x = 256 * high + low, high = high' - 128 (high' and low unsigned, as vpdpbusd takes them), so
 *   x . w = 256 * (high' . w - 128 * sum(w)) + low . w, exact in integers,
 * with each output column's sum(w) precomputed (code_sums). Two instructions per row and line
 * of 64 codes: the work per weight of bf16.c's one vdpbf16ps per 32, on half the bytes. Up to 4
 * panels go against up to ROWS input rows at once (2 x ROWS x PANELS sums in registers); more
 * rows go round again over the same panels (then in L2); the panels are split over torch's
 * OpenMP pool. One rounding per output element.
 *
 * With AMX tiles in use, from hybridlb_amx_min_rows rows up, the same sums run on tiles (below).
 *
 * Without AVX-512 VNNI int8_matmul_supported() is 0 and quantized.py keeps torch's int8 kernel
 * on row-major codes. n and k must be multiples of PANEL (layouts.py's int8_fits checks). */

#include "amx.h"
#include "panels.h"
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define INT8_VNNI 1
#endif
#if defined(INT8_VNNI) && defined(AMX_TILES) && defined(__AMX_INT8__)
#define INT8_TILES 1
#endif

#define PANELS 4   /* panels multiplied at once */
#define ROWS 3     /* input rows at once (2 x ROWS x PANELS sums and the panels' lines: 28 registers) */
#define PREFETCH 2048

int64_t int8_matmul_supported(void) {
#ifdef INT8_VNNI
    return 1;
#else
    return 0;
#endif
}

#ifdef INT8_VNNI
/* Quad ``quad`` of split rows [0, R) against the panels' lines w[0, C): each row's high' and low bytes
 * broadcast and multiplied into its sums (R and C constants after inlining). */
static inline __attribute__((always_inline)) void int8_quad(const uint8_t *bytes, int64_t k, int64_t quad, const int R,
                                                            const int C, const __m512i w[PANELS],
                                                            __m512i high[ROWS][PANELS], __m512i low[ROWS][PANELS]) {
    for (int r = 0; r < R; r++) {
        int32_t h4, l4;
        memcpy(&h4, bytes + 2 * r * k + 4 * quad, sizeof h4);
        memcpy(&l4, bytes + (2 * r + 1) * k + 4 * quad, sizeof l4);
        __m512i h = _mm512_set1_epi32(h4), l = _mm512_set1_epi32(l4);
        for (int c = 0; c < C; c++) {
            high[r][c] = _mm512_dpbusd_epi32(high[r][c], h, w[c]);
            low[r][c] = _mm512_dpbusd_epi32(low[r][c], l, w[c]);
        }
    }
}

/* One row's 16 sums in x's units from its high' and low byte sums: 256 (high' - 128 sum(w)) + low,
 * times the row's step (sum_w128: 128 sum(w) per column). */
static inline __m512 int8_value(__m512i high, __m512i low, __m512i sum_w128, float row_scale) {
    __m512 value = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(high, sum_w128)), _mm512_set1_ps(256.0f),
                                   _mm512_cvtepi32_ps(low));
    return _mm512_mul_ps(value, _mm512_set1_ps(row_scale));
}

/* Where split_rows (int8_body.h) leaves the rows' steps: after their 2 m k bytes. */
static inline float *row_scales(uint8_t *bytes, int64_t m, int64_t k) { return (float *)(bytes + 2 * m * k); }

/* Rows [0, R) of the split inputs times panels [first, first + C), R and C constants after
 * inlining; sums[c] (16 floats) in x's units, before the column scales. */
static inline __attribute__((always_inline)) void int8_block(const uint8_t *bytes, int64_t k, const int8_t *packed,
                                                             const int32_t *code_sums, const float *row_scale,
                                                             int64_t first, const int R, const int C,
                                                             __m512 out[ROWS][PANELS]) {
    int64_t quads = k / 4;
    __m512i high[ROWS][PANELS], low[ROWS][PANELS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) high[r][c] = low[r][c] = _mm512_setzero_si512();
    const char *stream[PANELS];
    open_streams(stream, packed, first, C, k * PANEL);
    for (int64_t quad = 0; quad < quads; quad++) {
        __m512i w[PANELS];
        next_lines(stream, C, PREFETCH, w);
        int8_quad(bytes, k, quad, R, C, w, high, low);
    }
    for (int c = 0; c < C; c++) {
        __m512i sums = _mm512_slli_epi32(_mm512_loadu_si512(code_sums + (first + c) * PANEL), 7); /* 128 sum(w) */
        for (int r = 0; r < R; r++) out[r][c] = int8_value(high[r][c], low[r][c], sums, row_scale[r]);
    }
}
#endif

#ifdef INT8_TILES
/* AMX's tdpbusd multiplies unsigned by signed bytes in quads as vpdpbusd does, and its B tile (16
 * rows of 64 bytes: 16 quads of 16 columns) is 16 quads of one panel in the layout above, 1 KB
 * contiguous. So with tiles in use (amx.h) a block of up to 16 split input rows goes against two
 * panels 64 inputs at a time: the rows' high' and low bytes in tiles 4 and 5, the panels in 6 and
 * 7, the four int32 sums in 0-3 (tiles configured for the block's rows). The integer sums are
 * the vpdpbusd path's exactly, and so is everything after them. */
static inline void int8_tile_block(const uint8_t *bytes, int64_t k, const int8_t *b, int64_t b_next, int panels,
                                   int32_t sums[4][16][16]) {
    _tile_zero(0);
    _tile_zero(1);
    if (panels > 1) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t kk = 0; kk < k; kk += 64) {
        _tile_loadd(4, bytes + kk, 2 * k);
        _tile_loadd(5, bytes + k + kk, 2 * k);
        _tile_loadd(6, b + kk * PANEL, 64);
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(1, 5, 6);
        if (panels > 1) {
            _tile_loadd(7, b + b_next + kk * PANEL, 64);
            _tile_dpbusd(2, 4, 7);
            _tile_dpbusd(3, 5, 7);
        }
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    if (panels > 1) {
        _tile_stored(2, sums[2], 64);
        _tile_stored(3, sums[3], 64);
    }
}
#endif

#define T float
#define SUFFIX f32
#define STORE(x) (x)
#define LOAD16(p) ((__m512)load16_f32(p))
#include "int8_body.h"
#undef T
#undef SUFFIX
#undef STORE
#undef LOAD16

#define T uint16_t
#define SUFFIX bf16
#define STORE(x) float_to_bf16(x)
#define LOAD16(p) ((__m512)load16_bf16(p))
#include "int8_body.h"
#undef T
#undef SUFFIX
#undef STORE
#undef LOAD16

/* int8 codes with a scale per group of 32 inputs of each output row, GGUF's Q8_0 (the output layer of
 * most GGUF files; hybridlb.model.quantized.Int8GroupLinear): float32 in and out,
 *   out[m, n] = sum_g gscale[n][g] * sum_{k in group g} x[m, k] * codes[n, k].
 * Same panels and 16-bit split inputs as int8_matmul; the integer sums restart every group (8 quads)
 * and are scaled into float sums there. The code sums the split needs are taken per group on the fly
 * (a vpdpbusd of ones against the line, shared by the rows), so only the codes and the group scales
 * ([n / 16][k / 32][16] float16, 1 / 16 of the codes' bytes) are streamed. Inside a group everything is
 * exact in int32 (|sum| <= 32 * 128 * 127 * 256 + 32 * 255 * 127). No AMX path: a tile sums 64 inputs
 * deep, two groups. k must be a multiple of 32, n of 16. */
#define GROUP_QUADS 8
#define GROUP_ROWS 2
#define GROUP_PANELS 2

#ifdef INT8_VNNI
static inline __attribute__((always_inline)) void int8_group_block(const uint8_t *bytes, int64_t k,
                                                                   const int8_t *packed, const uint16_t *gscale,
                                                                   const float *row_scale, int64_t first, const int R,
                                                                   const int C, __m512 out[GROUP_ROWS][GROUP_PANELS]) {
    int64_t groups = k / 32;
    const __m512i ones = _mm512_set1_epi8(1);
    const char *stream[GROUP_PANELS];
    const uint16_t *scales[GROUP_PANELS];
    open_streams(stream, packed, first, C, k * PANEL);
    for (int c = 0; c < C; c++) {
        scales[c] = gscale + (first + c) * groups * PANEL;
        for (int r = 0; r < R; r++) out[r][c] = _mm512_setzero_ps();
    }
    for (int64_t g = 0; g < groups; g++) {
        __m512i high[ROWS][PANELS], low[ROWS][PANELS], code_sum[GROUP_PANELS];
        for (int c = 0; c < C; c++) {
            code_sum[c] = _mm512_setzero_si512();
            for (int r = 0; r < R; r++) high[r][c] = low[r][c] = _mm512_setzero_si512();
        }
        for (int64_t quad = g * GROUP_QUADS; quad < (g + 1) * GROUP_QUADS; quad++) {
            __m512i w[PANELS];
            next_lines(stream, C, PREFETCH, w);
            for (int c = 0; c < C; c++) code_sum[c] = _mm512_dpbusd_epi32(code_sum[c], ones, w[c]);
            int8_quad(bytes, k, quad, R, C, w, high, low);
        }
        for (int c = 0; c < C; c++) {
            __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales[c] + g * PANEL)));
            __m512i offset = _mm512_slli_epi32(code_sum[c], 7); /* 128 sum(w) over the group */
            for (int r = 0; r < R; r++) {
                __m512i value = _mm512_add_epi32(_mm512_slli_epi32(_mm512_sub_epi32(high[r][c], offset), 8), low[r][c]);
                out[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(value), scale, out[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) out[r][c] = _mm512_mul_ps(out[r][c], _mm512_set1_ps(row_scale[r]));
}

#define GROUP_BLOCK(R, C) int8_group_block(b, k, packed, gscale, row_scale + r0, first, R, C, sums)

static void int8_group_panels(const uint8_t *bytes, const float *row_scale, const int8_t *packed,
                              const uint16_t *gscale, float *out, int64_t m, int64_t n, int64_t k, int64_t begin,
                              int64_t end) {
    __m512 sums[GROUP_ROWS][GROUP_PANELS];
    FOR_BLOCKS(begin, end, GROUP_PANELS, m, GROUP_ROWS) {
        const uint8_t *b = bytes + 2 * r0 * k;
        if (count == 1) {
            if (rows == 1) GROUP_BLOCK(1, 1); else GROUP_BLOCK(2, 1);
        } else {
            if (rows == 1) GROUP_BLOCK(1, 2); else GROUP_BLOCK(2, 2);
        }
        for (int64_t c = 0; c < count; c++)
            for (int64_t r = 0; r < rows; r++) _mm512_storeu_ps(out + (r0 + r) * n + (first + c) * PANEL, sums[r][c]);
    }
}
#undef GROUP_BLOCK
#endif

/* out [m, n] float32 (contiguous) = x [m, k] float32 (rows x_stride apart) @ W^T, W as codes packed by
 * int8_pack with group scales gscale [n / 16][k / 32][16] float16. Does nothing where
 * int8_matmul_supported() is 0. */
void int8_group_matmul(const float *x, int64_t x_stride, const int8_t *packed, const uint16_t *gscale, float *out,
                       int64_t m, int64_t n, int64_t k, int64_t threads) {
#ifdef INT8_VNNI
    int64_t panels = n / PANEL;
    if (m <= 0) return;
    uint8_t *bytes = split_rows_f32(x, x_stride, m, k, threads);
    const float *row_scale = row_scales(bytes, m, k);
#define RUN(begin, end) int8_group_panels(bytes, row_scale, packed, gscale, out, m, n, k, begin, end)
    SPLIT_PANELS(RUN, panels, threads, m, n, k);
#undef RUN
    free(bytes);
#else
    (void)x, (void)x_stride, (void)packed, (void)gscale, (void)out, (void)m, (void)n, (void)k, (void)threads;
#endif
}
