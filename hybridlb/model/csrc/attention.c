/* Paged decode attention (see attention_body.h). Compiled apart from kernels.c because
 * it may contract multiply-adds into FMAs (-ffp-contract=fast): its summation order
 * differs from torch's anyway, and the FMAs make it ~15% faster; kernels.c must round
 * exactly as torch does and is built without. */

#include <pthread.h>

#include "common.h"

/* The decode attention's arguments, shared by the threads that split its rows. */
struct decode_job {
    const void *q;
    int64_t q_stride;
    const void *k_cache, *v_cache;
    const int32_t *block_table;
    int64_t table_width;
    const int64_t *lengths;
    void *out;
    int64_t heads, kv_heads, dim, block_size;
    float scale;
};

struct decode_part {
    const struct decode_job *job;
    int64_t first, last;
};

#define MAX_THREADS 64
#define MAX_GROUP 16 /* query heads per kv head */

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
