/* What the kernels library exports: every function Python calls (through ctypes), the decode
 * program's operation kinds and step, and the layout constants the packers share. The one
 * declaration of that interface: each .c file that defines one of these functions includes this
 * header, so the compiler holds the definitions to it (and -Werror=missing-prototypes keeps any
 * exported function out of the library until it is declared here), and hybridlb/kernels/abi.py
 * parses it when the library is loaded and checks bindings.py's table against it.
 *
 * abi.py reads a restricted C: #define NAME <integer>; enum and struct definitions whose members
 * are written out; and prototypes whose arguments are pointers, int64_t or float (a return value:
 * void, int64_t or float), each argument named. Kernels that exist once per element type carry
 * its suffix: _f32 (float) and _bf16 (bfloat16 as uint16_t). */

#ifndef HYBRIDLB_KERNELS_ABI_H
#define HYBRIDLB_KERNELS_ABI_H

#include <stdint.h>

#define PANEL 16      /* bf16.c, int8.c, int4.c: output columns per panel of a packed weight */
#define INT4_GROUP 32 /* int4.c: inputs per scale and low */

/* kernels.c: fused residual add + RMSNorm, RoPE + KV-cache store, SiLU-and-mul. */
void rms_norm_f32(const float *x, int64_t stride, float *residual, const float *weight, float *out, int64_t rows,
                  int64_t hidden, float eps, int64_t threads);
void rms_norm_bf16(const uint16_t *x, int64_t stride, uint16_t *residual, const uint16_t *weight, uint16_t *out,
                   int64_t rows, int64_t hidden, float eps, int64_t threads);
void rope_store_f32(float *q, int64_t q_stride, float *k, int64_t k_stride, const float *v, int64_t v_stride,
                    const int64_t *positions, const float *cos_table, const float *sin_table, const int64_t *slots,
                    float *k_cache, float *v_cache, int64_t n, int64_t heads, int64_t kv_heads, int64_t dim,
                    int64_t block_size, int64_t threads);
void rope_store_bf16(uint16_t *q, int64_t q_stride, uint16_t *k, int64_t k_stride, const uint16_t *v,
                     int64_t v_stride, const int64_t *positions, const float *cos_table, const float *sin_table,
                     const int64_t *slots, uint16_t *k_cache, uint16_t *v_cache, int64_t n, int64_t heads,
                     int64_t kv_heads, int64_t dim, int64_t block_size, int64_t threads);
void silu_mul_f32(const float *x, float *out, int64_t n, int64_t inter, int64_t threads);
void silu_mul_bf16(const uint16_t *x, uint16_t *out, int64_t n, int64_t inter, int64_t threads);

/* attention.c: paged attention over rope_store's cache layout. */
void paged_attention_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                         const int32_t *block_table, int64_t table_width, const int64_t *query_start,
                         const int64_t *lengths, float *out, int64_t seqs, int64_t heads, int64_t kv_heads,
                         int64_t dim, int64_t block_size, float scale, int64_t threads);
void paged_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                          const int32_t *block_table, int64_t table_width, const int64_t *query_start,
                          const int64_t *lengths, uint16_t *out, int64_t seqs, int64_t heads, int64_t kv_heads,
                          int64_t dim, int64_t block_size, float scale, int64_t threads);

/* lora.c: each row's own adapter added to a projection's output. */
void lora_add_f32(const float *x, int64_t x_stride, float *out, int64_t out_stride, int64_t rows, int64_t in,
                  const int64_t *slots, const float *a, const float *b, int64_t b_cols, const int64_t *ranks,
                  const int64_t *columns, int64_t parts, int64_t stride, int64_t threads);
void lora_add_bf16(const uint16_t *x, int64_t x_stride, uint16_t *out, int64_t out_stride, int64_t rows, int64_t in,
                   const int64_t *slots, const uint16_t *a, const uint16_t *b, int64_t b_cols, const int64_t *ranks,
                   const int64_t *columns, int64_t parts, int64_t stride, int64_t threads);

/* bf16.c: the bfloat16 matmul on panels (AVX-512 BF16, AMX tiles where granted). */
int64_t bf16_matmul_supported(void);
int64_t bf16_amx_enable(int64_t min_rows);
void bf16_pack(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k, int64_t threads);
void bf16_matmul(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, void *out,
                 int64_t out_float, int64_t m, int64_t n, int64_t k, int64_t threads);

/* int8.c: weight-only int8 matmuls (AVX-512 VNNI). */
int64_t int8_matmul_supported(void);
void int8_matmul_f32(const float *x, int64_t x_stride, const int8_t *packed, const int32_t *code_sums,
                     const float *scale, const float *bias, float *out, int64_t m, int64_t n, int64_t k,
                     int64_t threads);
void int8_matmul_bf16(const uint16_t *x, int64_t x_stride, const int8_t *packed, const int32_t *code_sums,
                      const uint16_t *scale, const uint16_t *bias, uint16_t *out, int64_t m, int64_t n, int64_t k,
                      int64_t threads);
void int8_group_matmul(const float *x, int64_t x_stride, const int8_t *packed, const uint16_t *gscale, float *out,
                       int64_t m, int64_t n, int64_t k, int64_t threads);

/* int4.c: 4-bit weight-only matmul with bfloat16 activations (AVX-512 BF16 and VNNI). */
int64_t int4_matmul_supported(void);
void int4_amx_min_rows(int64_t rows);
void int4_matmul(const uint16_t *x, int64_t x_stride, const uint8_t *packed, const uint16_t *bias, uint16_t *out,
                 int64_t m, int64_t n, int64_t k, int64_t threads);

/* program.c: a recorded decode step replayed (hybridlb/model/decode_program.py). Each operation is
 * PROGRAM_OP_WORDS int64 words: its kind, then its arguments. */
#define PROGRAM_OP_WORDS 20

enum program_op {
    OP_NORM = 1,
    OP_BF16 = 2,
    OP_INT4 = 3,
    OP_INT8 = 4,
    OP_ROPE = 5,
    OP_ATTENTION = 6,
    OP_SILU = 7,
};

/* What a step brings: per row its position and KV slot; per sequence its rows [query_start[s],
 * query_start[s + 1]), context length and blocks (paged_attention's arguments). */
struct program_step {
    const int64_t *positions;
    const int64_t *slots;
    const int32_t *block_table;
    int64_t table_width;
    const int64_t *query_start;
    const int64_t *lengths;
    int64_t seqs;
};

int64_t program_run(const int64_t *ops, int64_t count, int64_t rows, const struct program_step *step,
                    int64_t threads);

#endif
