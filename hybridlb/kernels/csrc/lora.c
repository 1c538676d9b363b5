/* LoRA for a batch that mixes adapters (punica's "bgmv", written for the CPU): each row adds
 * its own adapter's scaling * B @ (A @ x) to a projection's output, in place. No row pays for
 * another adapter's slot, and parts an adapter does not adapt (rank 0) cost nothing.
 *
 * Layout (hybridlb/model/lora.py, LoRALinear): a projection has `parts` fused outputs (q, k,
 * v; gate, up; or one), part p owning output columns [columns[2p], columns[2p + 1]). Slot s
 * stores, for part p, rows (s * parts + p) * stride + r of A [.., in] and of B [.., b_cols]
 * (B transposed and scaled, non-zero only in the part's columns); ranks[s * parts + p] of
 * them are used (rows past that are zero; `stride` is max_rank rounded up to RANKS). Arithmetic in float32, one rounding per output element. Compiled with FMAs. */

#include "common.h"

#define MAX_RANK 512
#define GROUP 4 /* rows of one adapter computed together: each weight vector loaded once for them */
#define RANKS 4 /* ranks the shrink computes together (a part's rows are padded to a multiple) */
#define COLS 4  /* 16-column vectors of output the expand computes together */
_Static_assert(GROUP == 4, "lora_add's switch inlines groups of 1 to 4 rows");

/* The rows that use an adapter, grouped by slot (rows of one slot in order, GROUP at most per
 * group): `order` lists them group after group, group g starting at order[starts[g]], and
 * starts[groups] is the number of rows listed. Returns the number of groups. */
static int64_t lora_groups(const int64_t *slots, int64_t rows, int64_t *order, int64_t *starts) {
    int64_t listed = 0, groups = 0, top = -1;
    for (int64_t t = 0; t < rows; t++) top = slots[t] > top ? slots[t] : top;
    for (int64_t slot = 0; slot <= top; slot++) {
        int64_t in_group = 0;
        for (int64_t t = 0; t < rows; t++) {
            if (slots[t] != slot) continue;
            if (in_group == 0) starts[groups++] = listed;
            order[listed++] = t;
            in_group = (in_group + 1) % GROUP;
        }
    }
    starts[groups] = listed;
    return groups;
}

#define T float
#define SUFFIX f32
#define LOAD(x) (x)
#define STORE(x) (x)
#define LOAD16 load16_f32
#define STORE16 store16_f32
#include "lora_body.h"
#undef T
#undef SUFFIX
#undef LOAD
#undef STORE
#undef LOAD16
#undef STORE16

#define T uint16_t
#define SUFFIX bf16
#define LOAD(x) bf16_to_float(x)
#define STORE(x) float_to_bf16(x)
#define LOAD16 load16_bf16
#define STORE16 store16_bf16
#include "lora_body.h"
