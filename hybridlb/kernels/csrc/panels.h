/* What the panel matmuls (bf16.c, int8.c, int4.c) share. Their weights are packed in panels of
 * PANEL output columns (abi.h), each panel one contiguous stream read once, in order; a block of
 * panels is multiplied into a block of rows with the sums in registers, more rows go round again
 * over the same panels (then in L2), and the panels are split over torch's OpenMP pool.
 * Header-only. */

#ifndef HYBRIDLB_KERNELS_PANELS_H
#define HYBRIDLB_KERNELS_PANELS_H

#include "common.h"
#include <omp.h>

static inline int64_t at_most(int64_t a, int64_t b) { return a < b ? a : b; }

/* The loop header of that walk: blocks of up to P panels [first, first + count) of [begin, end),
 * panels outermost, each against blocks of up to R rows [r0, r0 + rows) of m. */
#define FOR_BLOCKS(begin, end, P, m, R)                                                                      \
    for (int64_t first = (begin), count; first < (end) && (count = at_most((end) - first, P)); first += (P)) \
        for (int64_t r0 = 0, rows; r0 < (m) && (rows = at_most((m) - r0, R)); r0 += (R))

/* RUN(begin, end), a function-like macro, over panels [0, panels): on this thread for a small
 * matmul (MATMUL_SERIAL), else in equal parts over up to `threads` threads of the pool (a panel
 * the unit). */
#define SPLIT_PANELS(RUN, panels, threads, m, n, k)                                 \
    do {                                                                            \
        int64_t parts_ = at_most(threads, panels);                                  \
        if (parts_ <= 1 || MATMUL_SERIAL(m, n, k)) {                                \
            RUN(0, (panels));                                                       \
        } else {                                                                    \
            _Pragma("omp parallel num_threads(parts_)")                             \
            {                                                                       \
                int64_t part_ = omp_get_thread_num(), all_ = omp_get_num_threads(); \
                RUN((panels) * part_ / all_, (panels) * (part_ + 1) / all_);        \
            }                                                                       \
        }                                                                           \
    } while (0)

#ifdef __AVX512F__
/* Streams of C panels from `first` on, `panel_bytes` apart (C a constant after inlining). */
static inline __attribute__((always_inline)) void open_streams(const char *stream[], const void *packed,
                                                               int64_t first, const int C, int64_t panel_bytes) {
    for (int c = 0; c < C; c++) stream[c] = (const char *)packed + (first + c) * panel_bytes;
}

/* The next 64-byte line of each of C streams into w, each stream prefetched `ahead` bytes further
 * on (the panels sit one after another, so the hardware prefetcher falls behind). */
static inline __attribute__((always_inline)) void next_lines(const char *stream[], const int C, const int ahead,
                                                             __m512i w[]) {
    for (int c = 0; c < C; c++) {
        _mm_prefetch(stream[c] + ahead, _MM_HINT_T0);
        w[c] = _mm512_loadu_si512(stream[c]);
        stream[c] += 64;
    }
}
#endif

#endif
