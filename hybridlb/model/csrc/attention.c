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
#define PREFETCH_BLOCKS 2 /* how far ahead blocks are requested (2-8 measured alike, 2 a little ahead) */

/* The block PREFETCH_BLOCKS ahead of the one read now, in the thread's order (the next
 * tile's first blocks at a tile's end; NULL near the end); moves the cursor on a block.
 * Blocks sit anywhere in the cache, so the hardware prefetcher cannot guess them. */
struct prefetch_target {
    const char *keys, *values;
};

static inline struct prefetch_target prefetch_next(struct prefetch_cursor *ahead) {
    struct prefetch_target far = {NULL, NULL};
    if (ahead->next + PREFETCH_BLOCKS < ahead->count) {
        far.keys = ahead->keys[ahead->next + PREFETCH_BLOCKS];
        far.values = ahead->values[ahead->next + PREFETCH_BLOCKS];
    }
    ahead->next++;
    return far;
}

/* Line `line` of the target's keys and values, requested into L2 (prefetcht2: into L1 they
 * evicted the lines in use, and the requests stalled the loop). The tiles spread these over
 * their score loop, a line or two per dimension, so that the requests never queue up.
 * Batch-32 x 320-token decode attention (cold KV): 0.50 ms per layer with one block ahead
 * into L1, 0.39 ms like this (both before the paired bfloat16 layout). */
static inline void prefetch_line(struct prefetch_target far, int64_t line, int64_t lines) {
    if (far.keys && line < lines) {
        __builtin_prefetch(far.keys + 64 * line, 0, 1);
        __builtin_prefetch(far.values + 64 * line, 0, 1);
    }
}

/* Where vector g of a tile writes its output row (a macro: `out` is either dtype). */
#define tile_output(job, out, kh, g) \
    ((out) + ((g) / ((job)->heads / (job)->kv_heads)) * (job)->heads * (job)->dim \
     + ((kh) * ((job)->heads / (job)->kv_heads) + (g) % ((job)->heads / (job)->kv_heads)) * (job)->dim)

#include "attention_f32.h"
#define T float
#define SUFFIX f32
#include "attention_body.h"
#undef T
#undef SUFFIX

#include "attention_bf16.h"
#define T uint16_t
#define SUFFIX bf16
#include "attention_body.h"
