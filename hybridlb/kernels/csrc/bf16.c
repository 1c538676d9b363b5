/* The bfloat16 matmul of the linear layers (hybridlb/model/layers.py, PackedLinear):
 * out[m, n] = x[m, :] . w[n, :] (+ bias[n]), x, w, bias and out bfloat16, sums in float32.
 *
 * A decode step at batch 1-16 reads every weight once and does little with each, so what
 * counts is how fast the weights stream in. oneDNN's matmul streamed them at ~15 GB/s at
 * batch 1 on this machine's 2 cores, half of what the memory delivers to a plain read
 * (~30 GB/s). Here each weight is read once, in order, from a layout made for the
 * instruction that multiplies it: with AVX-512 BF16, vdpbf16ps multiplies 16 pairs of
 * bfloat16 weights by one broadcast pair of inputs and adds them to 16 float32 sums, so
 * the weights go in panels of 16 output columns, k / 2 pairs deep:
 *   packed[panel][pair][column][2] = w[16 * panel + column][2 * pair + {0, 1}]
 * (one 64-byte line per pair and panel; a panel is one contiguous stream). Up to 4 panels
 * (64 columns) are multiplied into up to ROWS input rows at once, the sums in registers;
 * more rows go round again over the same panels (then in L2). The panels are split over
 * torch's OpenMP pool, one panel the unit, and every stream is prefetched PREFETCH bytes
 * ahead. Measured here against oneDNN on SmolLM2-135M's 121 projections in turn: 1.4x
 * faster at batch 1 (~29 GB/s), 1.2x at 16, 1.1x at 32, the same at 512 and 2,048 rows.
 *
 * The products are vdpbf16ps's: exact, summed in float32 with denormal inputs read as
 * zero, then rounded once to bfloat16 (round to nearest even), as oneDNN's are. Without
 * AVX-512 BF16 the functions exist but bf16_matmul_supported() is 0 and layers.py keeps
 * oneDNN. n must be a multiple of PANEL and k even (layouts.py's bf16_fits checks).
 *
 * With AMX (Intel Sapphire Rapids and later) the same layout is what tdpbf16ps reads (amx.h):
 * from hybridlb_amx_min_rows rows up (bf16_amx_enable), and where k is a multiple of 32, the
 * matmul runs on tiles instead, ~8x vdpbf16ps's multiply rate. */

#include "panels.h"
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define BF16_DOT 1
#endif
#include "amx.h"
#ifdef AMX_TILES
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define PANELS 4    /* panels multiplied at once */
#define ROWS 6      /* input rows at once (ROWS x PANELS sums, the panels' vectors: 29 registers) */
#define PREFETCH 2048

int64_t bf16_matmul_supported(void) {
#ifdef BF16_DOT
    return 1;
#else
    return 0;
#endif
}

/* w [n, k] row-major into the panel layout above (packed holds n * k elements). */
void bf16_pack(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k, int64_t threads) {
    int64_t pairs = k / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n * k >= PARALLEL_MIN_ELEMENTS)
    for (int64_t panel = 0; panel < n / PANEL; panel++)
        for (int64_t pair = 0; pair < pairs; pair++)
            for (int64_t c = 0; c < PANEL; c++) {
                uint16_t *to = packed + ((panel * pairs + pair) * PANEL + c) * 2;
                const uint16_t *from = w + (panel * PANEL + c) * k + 2 * pair;
                to[0] = from[0];
                to[1] = from[1];
            }
}

#ifdef BF16_DOT
/* Rows [0, R) of x times panels [first, first + C): R and C constants after inlining, so the
 * R x C sums stay in registers. */
static inline __attribute__((always_inline)) void bf16_block(const uint16_t *x, int64_t x_stride,
                                                             const uint16_t *packed, const uint16_t *bias,
                                                             void *out, int64_t out_float, int64_t n, int64_t k,
                                                             int64_t first, const int R, const int C) {
    int64_t pairs = k / 2;
    __m512 sums[ROWS][PANELS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) sums[r][c] = _mm512_setzero_ps();
    const char *stream[PANELS];
    open_streams(stream, packed, first, C, k * PANEL * 2);
    for (int64_t pair = 0; pair < pairs; pair++) {
        __m512i w[PANELS];
        next_lines(stream, C, PREFETCH, w);
        for (int r = 0; r < R; r++) {
            int32_t two;
            memcpy(&two, x + r * x_stride + 2 * pair, sizeof two);
            __m512bh input = (__m512bh)_mm512_set1_epi32(two);
            for (int c = 0; c < C; c++) sums[r][c] = _mm512_dpbf16_ps(sums[r][c], input, (__m512bh)w[c]);
        }
    }
    for (int c = 0; c < C; c++) {
        __m512 add = _mm512_setzero_ps();
        if (bias) {
            __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(bias + (first + c) * PANEL)));
            add = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
        }
        for (int r = 0; r < R; r++) {
            __m512 value = bias ? _mm512_add_ps(sums[r][c], add) : sums[r][c];
            int64_t at = r * n + (first + c) * PANEL;
            if (out_float)
                _mm512_storeu_ps((float *)out + at, value);
            else
                _mm256_storeu_si256((void *)((uint16_t *)out + at), (__m256i)_mm512_cvtneps_pbh(value));
        }
    }
}

#define BLOCK(R, C) bf16_block(xr, x_stride, packed, bias, o, out_float, n, k, first, R, C)
#define BY_ROWS(C) switch (rows) { \
    case 1: BLOCK(1, C); break; case 2: BLOCK(2, C); break; case 3: BLOCK(3, C); break; \
    case 4: BLOCK(4, C); break; case 5: BLOCK(5, C); break; default: BLOCK(6, C); break; }

/* Panels [begin, end) for all m rows, in groups of up to PANELS panels and ROWS rows (the rows
 * split into equal groups, so 8 rows go as 4 + 4, not 6 + 2). */
static void bf16_panels(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias,
                        void *out, int64_t out_float, int64_t m, int64_t n, int64_t k, int64_t begin, int64_t end) {
    int64_t groups = (m + ROWS - 1) / ROWS, step = (m + groups - 1) / groups;
    FOR_BLOCKS(begin, end, PANELS, m, step) {
        const uint16_t *xr = x + r0 * x_stride;
        void *o = out_float ? (void *)((float *)out + r0 * n) : (void *)((uint16_t *)out + r0 * n);
        switch (count) {
        case 1: BY_ROWS(1) break;
        case 2: BY_ROWS(2) break;
        case 3: BY_ROWS(3) break;
        default: BY_ROWS(4) break;
        }
    }
}
#undef BY_ROWS
#undef BLOCK
#endif

int64_t hybridlb_amx_min_rows = 0;

/* Use AMX tiles from min_rows rows up (0: never); asks Linux (5.16+) for the tile state once,
 * for the whole process. Returns whether tiles are in use. */
int64_t bf16_amx_enable(int64_t min_rows) {
#ifdef AMX_TILES
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    hybridlb_amx_min_rows = granted ? min_rows : 0;
#else
    (void)min_rows;
#endif
    return hybridlb_amx_min_rows > 0;
}

#ifdef AMX_TILES
/* Panels [begin, end) for all m rows on tiles, two panels at a time (amx.h). */
static void amx_panels(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias,
                       void *out, int64_t out_float, int64_t m, int64_t n, int64_t k, int64_t begin, int64_t end) {
    int configured = 0;
    for (int64_t p = begin; p < end; p += 2)
        amx_rows(x, x_stride, (const char *)(packed + p * k * PANEL), k * PANEL * 2, bias ? bias + p * PANEL : NULL,
                 out, out_float, m, n, k, p * PANEL, end - p >= 2 ? 2 : 1, &configured);
    _tile_release();
}
#endif

/* out [m, n] contiguous = x [m, k] (rows x_stride apart) @ w^T + bias (bias may be NULL), w packed
 * by bf16_pack; out bfloat16, or with out_float the float32 sums unrounded (the logits: rounded to
 * bfloat16 the top tokens often tie). m may be 0. Does nothing where bf16_matmul_supported() is 0. */
void bf16_matmul(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, void *out,
                 int64_t out_float, int64_t m, int64_t n, int64_t k, int64_t threads) {
#ifdef BF16_DOT
    int64_t panels = n / PANEL;
    if (m <= 0) return; /* an expert-parallel dummy step has no rows */
    void (*run)(const uint16_t *, int64_t, const uint16_t *, const uint16_t *, void *, int64_t, int64_t, int64_t,
                int64_t, int64_t, int64_t) = bf16_panels;
#ifdef AMX_TILES
    if (hybridlb_amx_min_rows && m >= hybridlb_amx_min_rows && k % 32 == 0) run = amx_panels;
#endif
#define RUN(begin, end) run(x, x_stride, packed, bias, out, out_float, m, n, k, begin, end)
    SPLIT_PANELS(RUN, panels, threads, m, n, k);
#undef RUN
#else
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)out, (void)out_float, (void)m, (void)n, (void)k,
        (void)threads;
#endif
}
