/* AMX tiles for the bfloat16 matmuls (bf16.c, int4.c). bf16.c's panel layout, packed[panel]
 * [pair][column][2], is what tdpbf16ps reads: 16 pairs of one panel (1 KB, contiguous) are a B
 * tile of 16 rows x 16 columns x 2. A step of 32 inputs loads one A tile per block of 16 rows of
 * x and one B tile per panel, and multiplies 2 blocks x 2 panels into 4 float32 accumulator
 * tiles: the same exact products as vdpbf16ps, summed in float32 in another order, at ~8x its
 * rate. Header-only; AMX_TILES where the compiler targets AMX-BF16 (-march=native on such a CPU),
 * in use from hybridlb_amx_min_rows rows up once Linux granted the tile state (bf16.c's
 * bf16_amx_enable). */

#ifndef HYBRIDLB_KERNELS_AMX_H
#define HYBRIDLB_KERNELS_AMX_H

#include "common.h"

extern int64_t hybridlb_amx_min_rows; /* 0: tiles off (bf16.c) */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define AMX_TILES 1
#include <immintrin.h>

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Tiles 0-3: float32 sums [row block][panel] of `rows` rows; 4-5: x's row blocks (`rows` x 32
 * inputs); 6-7: the panels' next 16 pairs. */
static inline void amx_configure(int rows) {
    struct tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.colsb[t] = 64;
        config.rows[t] = t < 6 ? rows : 16;
    }
    _tile_loadconfig(&config);
}

/* out rows [r0, r0 + RB * 16) (RB 1: the configured rows) and columns [col, col + 16 PB) =
 * x's rows times PB panel streams (b, then b + b_next bytes) over k inputs, + bias (at col). */
static inline __attribute__((always_inline)) void amx_block(const uint16_t *x, int64_t x_stride, const char *b,
                                                            int64_t b_next, const uint16_t *bias, void *out,
                                                            int64_t out_float, int64_t n, int64_t k, int64_t r0,
                                                            int64_t rows, int64_t col, const int RB, const int PB) {
    const char *a = (const char *)(x + r0 * x_stride);
    int64_t a_stride = x_stride * 2, a_next = 16 * a_stride;
    _tile_zero(0);
    if (PB > 1) _tile_zero(1);
    if (RB > 1) _tile_zero(2);
    if (RB > 1 && PB > 1) _tile_zero(3);
    for (int64_t kk = 0; kk < k; kk += 32) {
        _tile_loadd(4, a + kk * 2, a_stride);
        _tile_loadd(6, b + kk * 32, 64);
        if (PB > 1) _tile_loadd(7, b + b_next + kk * 32, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (PB > 1) _tile_dpbf16ps(1, 4, 7);
        if (RB > 1) {
            _tile_loadd(5, a + a_next + kk * 2, a_stride);
            _tile_dpbf16ps(2, 5, 6);
            if (PB > 1) _tile_dpbf16ps(3, 5, 7);
        }
    }
    float sums[4][16][16];
    _tile_stored(0, sums[0], 64);
    if (PB > 1) _tile_stored(1, sums[1], 64);
    if (RB > 1) _tile_stored(2, sums[2], 64);
    if (RB > 1 && PB > 1) _tile_stored(3, sums[3], 64);
    for (int c = 0; c < PB; c++) {
        __m512 add = bias ? (__m512)load16_bf16(bias + c * 16) : _mm512_setzero_ps();
        for (int rb = 0; rb < RB; rb++)
            for (int64_t r = 0; r < rows; r++) {
                __m512 value = _mm512_add_ps(_mm512_loadu_ps(sums[rb * 2 + c][r]), add);
                int64_t at = (r0 + rb * 16 + r) * n + col + c * 16;
                if (out_float)
                    _mm512_storeu_ps((float *)out + at, value);
                else
                    _mm256_storeu_si256((void *)((uint16_t *)out + at), (__m256i)_mm512_cvtneps_pbh(value));
            }
    }
}

#define AMX_BLOCK(RB, PB) amx_block(x, x_stride, b, b_next, bias, out, out_float, n, k, r0, rows, col, RB, PB)

/* All m rows against one or two panel streams (b, b + b_next bytes) for output columns
 * [col, col + 16 * panels): blocks of 16 rows two at a time with tiles configured for 16 rows,
 * then the rest with tiles configured for it (tiles end up configured for the last part). */
static inline void amx_rows(const uint16_t *x, int64_t x_stride, const char *b, int64_t b_next,
                            const uint16_t *bias, void *out, int64_t out_float, int64_t m, int64_t n, int64_t k,
                            int64_t col, int panels, int *configured) {
    int64_t full = m / 16 * 16, rows = 16;
    if (full && *configured != 16) amx_configure(*configured = 16);
    for (int64_t r0 = 0; r0 < full; r0 += 32) {
        int two_blocks = full - r0 >= 32;
        if (two_blocks && panels == 2) AMX_BLOCK(2, 2);
        else if (two_blocks) AMX_BLOCK(2, 1);
        else if (panels == 2) AMX_BLOCK(1, 2);
        else AMX_BLOCK(1, 1);
    }
    if (m > full) {
        int64_t r0 = full;
        rows = m - full;
        if (*configured != rows) amx_configure(*configured = (int)rows);
        if (panels == 2) AMX_BLOCK(1, 2);
        else AMX_BLOCK(1, 1);
    }
}
#undef AMX_BLOCK
#endif
#endif
