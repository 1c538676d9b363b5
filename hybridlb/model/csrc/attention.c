/* Paged attention (see attention_body.h). Compiled apart from kernels.c because
 * it may contract multiply-adds into FMAs (-ffp-contract=fast): its summation order
 * differs from torch's anyway, and the FMAs make it ~15% faster; kernels.c must round
 * exactly as torch does and is built without. */

#include "common.h"

/* One tile of the work: `rows` query rows from `row` on, of sequence `sequence`, for one kv head. */
struct attention_unit {
    int64_t sequence, kv_head, row, rows;
};

/* The attention's arguments, shared by the threads that split its tiles. */
struct attention_job {
    const void *q;
    int64_t q_stride;
    const void *k_cache, *v_cache;
    const int32_t *block_table;
    int64_t table_width;
    const int64_t *query_start, *lengths;
    void *out;
    int64_t heads, kv_heads, dim, block_size;
    float scale;
    const struct attention_unit *units;
};

/* Each of `vectors` rows of scores (`stride` apart) softmaxed over its first counts[g] entries
 * and zeroed from there up to `len`, so that later loops can run every row to `len`. */
static void normalise(float *scores, int64_t stride, const int64_t *counts, int64_t len, int64_t vectors) {
    for (int64_t g = 0; g < vectors; g++) {
        softmax(scores + g * stride, counts[g]);
        for (int64_t i = counts[g]; i < len; i++) scores[g * stride + i] = 0.0f;
    }
}

/* Where a thread's prefetches stand: the key and value block of each block it will read, in
 * order, and the index of the block it reads now. */
struct prefetch_cursor {
    const char **keys, **values;
    int64_t count, next;
};

#define MAX_THREADS 64
#define MAX_VECTORS 16 /* query vectors per tile, so at most 16 query heads per kv head */
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 8
#define PF_LEVEL 1 /* how many blocks ahead the keys are requested */
#endif

#define T float
#define SUFFIX f32
#define LOAD(x) (x)
#define STORE(x) (x)
#define LOAD16 load16_f32
#include "attention_body.h"
#undef T
#undef SUFFIX
#undef LOAD
#undef STORE
#undef LOAD16

#define T uint16_t
#define SUFFIX bf16
#define LOAD(x) bf16_to_float(x)
#define STORE(x) float_to_bf16(x)
#define LOAD16 load16_bf16
#include "attention_body.h"
