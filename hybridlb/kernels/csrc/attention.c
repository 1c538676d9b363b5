/* Paged attention, one body for both element types (attention_body.h). Compiled apart from kernels.c because
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

/* The bfloat16 cache layout keeps pairs side by side, the operand vdpbf16ps multiplies (16 lanes,
 * each the dot product of two bfloat16 pairs, added to a float32 sum):
 *   keys   [dim / 2][block_size][2]: one 64-byte line = dimensions 2i, 2i + 1 of 16 tokens
 *   values [block_size / 2][dim][2]: one line = 16 dimensions of tokens 2t, 2t + 1
 * per block and kv head (rope_store writes it). A score is then dim / 2 instructions against the
 * query's pairs (bfloat16 as given, the scale applied to the sum), and an output chunk
 * block_size / 2 against the probabilities rounded to bfloat16 pairs (as torch's bfloat16 flash
 * attention rounds them). Without AVX-512 BF16 the same products (exact in float32) are formed
 * with shifts, masks and two FMAs per pair. float32 keeps keys [dim][block_size] and values
 * [block_size][dim], one element a lane. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
static inline f32x16 dot_pairs(f32x16 acc, uint32_t pair, u32x16 lanes) {
    __m512i broadcast = _mm512_set1_epi32((int)pair), operand;
    memcpy(&operand, &lanes, sizeof operand);
    return (f32x16)_mm512_dpbf16_ps((__m512)acc, (__m512bh)broadcast, (__m512bh)operand);
}
#else
/* The broadcast pair is split in vector registers too: through scalars (bf16_to_float) GCC moved
 * each word through the stack, and the bfloat16 tiles ran at about half this speed on AVX2. */
static inline f32x16 dot_pairs(f32x16 acc, uint32_t pair, u32x16 lanes) {
    u32x16 broadcast = (u32x16){0} + pair;
    u32x16 low = lanes << 16, high = lanes & 0xffff0000u;
    u32x16 low_pair = broadcast << 16, high_pair = broadcast & 0xffff0000u;
    f32x16 first, second, first_pair, second_pair;
    memcpy(&first, &low, sizeof first);
    memcpy(&second, &high, sizeof second);
    memcpy(&first_pair, &low_pair, sizeof first_pair);
    memcpy(&second_pair, &high_pair, sizeof second_pair);
    return acc + first_pair * first + second_pair * second;
}
#endif

static inline u32x16 load_pairs(const uint16_t *p) {
    u32x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* out[0..n) = x[0..n) rounded to bfloat16 (to nearest even; the scores are finite). */
static inline void to_bf16(const float *x, uint16_t *out, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
#endif
    for (; i < n; i++) out[i] = float_to_bf16(x[i]);
}

/* The probabilities the values are weighted with, as words (see attention_body.h): float32 takes
 * the scores as they are; bfloat16 rounds them into `pairs`, pair t of a row being tokens 2t and
 * 2t + 1 (a zero past an odd `len` makes the last token's partner weigh nothing). */
static inline const float *probabilities_f32(float *scores, uint32_t *pairs, int64_t padded, int64_t len,
                                             int64_t vectors) {
    (void)pairs, (void)padded, (void)len, (void)vectors;
    return scores;
}

static inline const uint32_t *probabilities_bf16(float *scores, uint32_t *pairs, int64_t padded, int64_t len,
                                                 int64_t vectors) {
    int64_t half = padded / 2, even = (len + 1) / 2 * 2;
    for (int64_t g = 0; g < vectors; g++) {
        float *row = scores + g * padded;
        if (even > len) row[len] = 0.0f;
        to_bf16(row, (uint16_t *)(pairs + g * half), even);
    }
    return pairs;
}

/* float32: a word is one element; the query is scaled as it is loaded. */
#define T float
#define SUFFIX f32
#define WORD float
#define PACK 1
#define LANES f32x16
#define LOAD_WORDS(p) load16_f32(p)
#define DOT(acc, word, lanes) ((acc) + (word) * (lanes))
#define QUERY_WORD(row, i, scale) ((row)[i] * (scale))
#define SCORE(sum, scale) (sum)
#define STORE_SUMS(p, sums) memcpy(p, sums, sizeof(f32x16))
#include "attention_body.h"
#undef T
#undef SUFFIX
#undef WORD
#undef PACK
#undef LANES
#undef LOAD_WORDS
#undef DOT
#undef QUERY_WORD
#undef SCORE
#undef STORE_SUMS

/* bfloat16: a word is a pair of elements side by side; the scale applies to the summed score. */
#define T uint16_t
#define SUFFIX bf16
#define WORD uint32_t
#define PACK 2
#define LANES u32x16
#define LOAD_WORDS(p) load_pairs(p)
#define DOT(acc, word, lanes) dot_pairs(acc, word, lanes)
#define QUERY_WORD(row, i, scale) ((uint32_t)(row)[2 * (i)] | (uint32_t)(row)[2 * (i) + 1] << 16)
#define SCORE(sum, scale) ((sum) * (scale))
#define STORE_SUMS(p, sums) \
    for (int l = 0; l < 16; l++) (p)[l] = float_to_bf16((*(sums))[l])
#include "attention_body.h"
