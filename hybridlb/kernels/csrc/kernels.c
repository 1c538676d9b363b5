/* CPU kernels for the decoder's small per-token work, so that one layer is a few
 * calls instead of ~60 torch ops: fused residual-add + RMSNorm, RoPE + KV-cache
 * store and SiLU-and-mul here; paged decode attention (reads the blocks in place, no
 * gather) in attention.c.
 *
 * Each kernel exists for float32 (suffix _f32) and bfloat16 (_bf16): kernels_body.h
 * is included once per dtype. Rounding follows the torch ops they replace: wherever
 * torch rounds an intermediate to the tensor's dtype, ROUND does the same, so the
 * bfloat16 path tracks the reference implementations step by step. Arithmetic is in
 * float32. Declared in abi.h, built by hybridlb/kernels/build.py, called through ctypes.
 */

#include "common.h"

#define T float
#define SUFFIX f32
#define LOAD(x) (x)
#define STORE(x) (x)
#define ROUND(x) (x)
#define LOAD16(p) load16_f32(p)
#define STORE16(p, v) store16_f32(p, v)
#define ROUND16(v) (v)
#define KEY_AT(d, t, dim, block_size) ((d) * (block_size) + (t))
#define VALUE_AT(t, d, dim, block_size) ((t) * (dim) + (d))
#include "kernels_body.h"
#undef T
#undef SUFFIX
#undef LOAD
#undef STORE
#undef ROUND
#undef LOAD16
#undef STORE16
#undef ROUND16
#undef KEY_AT
#undef VALUE_AT

#define T uint16_t
#define SUFFIX bf16
#define LOAD(x) bf16_to_float(x)
#define STORE(x) float_to_bf16(x)
#define ROUND(x) bf16_to_float(float_to_bf16(x))
#define LOAD16(p) load16_bf16(p)
#define STORE16(p, v) store16_bf16(p, v)
#define ROUND16(v) round16_bf16(v)
#define KEY_AT(d, t, dim, block_size) ((((d) / 2) * (block_size) + (t)) * 2 + (d) % 2)
#define VALUE_AT(t, d, dim, block_size) ((((t) / 2) * (dim) + (d)) * 2 + (t) % 2)
#include "kernels_body.h"
