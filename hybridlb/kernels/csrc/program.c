/* A decode step as one call: the kernel calls of every layer, recorded once as a list of
 * operations (hybridlb/model/decode_program.py) and replayed here for each step. The eager
 * forward makes ~8 calls per layer from Python, each through ctypes with its output allocated
 * by torch: on SmolLM2-135M at batch 1 that fixed cost is ~4 ms of a ~10 ms step, about as
 * long as streaming its 4-bit weights. Replayed from C, the step is the kernels' time.
 *
 * Each operation is PROGRAM_OP_WORDS int64 words: its kind, then its arguments (pointers, sizes; a
 * float as its bits). Its buffers are the program's own (fixed addresses, each as wide as the
 * most rows a step may have); what changes per step comes with the call: the number of rows
 * (tokens) and `step`: their positions and KV slots, and the attention's sequences (each one's
 * rows, context length and blocks). The operation kinds, the step and the word count are abi.h's.
 * The kernels are the ones the eager forward calls, with the same arguments and threads, so a
 * replayed step computes exactly the eager one's values. bfloat16 only. */

#include "abi.h"
#include "common.h"

#define PTR(type, i) ((type *)(intptr_t)op[i])

static float float_at(int64_t word) { return (bits32){.u = (uint32_t)word}.f; }

/* Runs `count` operations on `rows` rows; returns the index of the first operation of an unknown
 * kind (nothing after it runs), or -1. */
int64_t program_run(const int64_t *ops, int64_t count, int64_t rows, const struct program_step *step,
                    int64_t threads) {
    for (int64_t i = 0; i < count; i++) {
        const int64_t *op = ops + i * PROGRAM_OP_WORDS;
        switch (op[0]) {
        case OP_NORM: /* x, x_stride, residual, weight, out, hidden, eps */
            rms_norm_bf16(PTR(const uint16_t, 1), op[2], PTR(uint16_t, 3), PTR(const uint16_t, 4), PTR(uint16_t, 5),
                          rows, op[6], float_at(op[7]), threads);
            break;
        case OP_BF16: /* x, x_stride, packed, bias, out, n, k */
            bf16_matmul(PTR(const uint16_t, 1), op[2], PTR(const uint16_t, 3), PTR(const uint16_t, 4),
                        PTR(void, 5), 0, rows, op[6], op[7], threads);
            break;
        case OP_INT4: /* x, x_stride, blocks, bias, out, n, k */
            int4_matmul(PTR(const uint16_t, 1), op[2], PTR(const uint8_t, 3), PTR(const uint16_t, 4),
                        PTR(uint16_t, 5), rows, op[6], op[7], threads);
            break;
        case OP_INT8: /* x, x_stride, packed, bias, out, n, k, code_sums, scale */
            int8_matmul_bf16(PTR(const uint16_t, 1), op[2], PTR(const int8_t, 3), PTR(const int32_t, 8),
                             PTR(const uint16_t, 9), PTR(const uint16_t, 4), PTR(uint16_t, 5), rows, op[6], op[7],
                             threads);
            break;
        case OP_ROPE: /* q, q_stride, k, k_stride, v, v_stride, cos, sin, k_cache, v_cache, heads, kv_heads, dim,
                         block_size */
            rope_store_bf16(PTR(uint16_t, 1), op[2], PTR(uint16_t, 3), op[4], PTR(const uint16_t, 5), op[6],
                            step->positions, PTR(const float, 7), PTR(const float, 8), step->slots,
                            PTR(uint16_t, 9), PTR(uint16_t, 10), rows, op[11], op[12], op[13], op[14], threads);
            break;
        case OP_ATTENTION: /* q, q_stride, k_cache, v_cache, out, heads, kv_heads, dim, block_size, scale */
            paged_attention_bf16(PTR(const uint16_t, 1), op[2], PTR(const uint16_t, 3), PTR(const uint16_t, 4),
                                 step->block_table, step->table_width, step->query_start, step->lengths,
                                 PTR(uint16_t, 5), step->seqs, op[6], op[7], op[8], op[9], float_at(op[10]),
                                 threads);
            break;
        case OP_SILU: /* x, out, inter */
            silu_mul_bf16(PTR(const uint16_t, 1), PTR(uint16_t, 2), rows, op[3], threads);
            break;
        default:
            return i;
        }
    }
    return -1;
}
