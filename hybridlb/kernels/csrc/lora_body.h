/* lora.c's kernel for one dtype (T, LOAD, STORE, LOAD16, STORE16 and SUFFIX defined by the includer).
 *
 * Both halves are register-blocked for a group's N rows (N <= GROUP, a compile-time constant
 * in each inlined copy, so the accumulators stay in vector registers): the shrink computes
 * N rows x RANKS ranks of x . a at once, loading each 16 floats of x and of A once for all of
 * them; the expand adds N rows x COLS * 16 output columns at once, loading each 16 values of
 * B once for all the rows. Ranks are taken RANKS at a time: a part's rows of A and B past its
 * rank are zero in the layout (LoRALinear pads them to a multiple of RANKS), so they add 0. */

#define NAME(name) CAT(name, SUFFIX)

/* xa[j][r] = x[j] . a[r] for j < N and r < rank (rounded up to RANKS); x in float32. */
static inline __attribute__((always_inline)) void NAME(lora_shrink)(const int N, float xa[][MAX_RANK],
                                                                    const float *restrict x, const T *restrict a,
                                                                    int64_t in, int64_t rank) {
    int64_t whole = in / 16 * 16;
    for (int64_t r = 0; r < rank; r += RANKS) {
        f32x16 s[GROUP][RANKS] = {{{0}}};
        for (int64_t i = 0; i < whole; i += 16) {
            f32x16 w[RANKS];
            for (int k = 0; k < RANKS; k++) w[k] = LOAD16(a + (r + k) * in + i);
            for (int j = 0; j < N; j++) {
                f32x16 v = load16_f32(x + j * in + i);
                for (int k = 0; k < RANKS; k++) s[j][k] += v * w[k];
            }
        }
        for (int j = 0; j < N; j++)
            for (int k = 0; k < RANKS; k++) {
                float sum = hsum16(s[j][k]);
                for (int64_t i = whole; i < in; i++) sum += x[j * in + i] * LOAD(a[(r + k) * in + i]);
                xa[j][r + k] = sum;
            }
    }
}

/* out[row j][c, c + 16 * C) += sum_r xa[j][r] * b[r][same columns], for j < N. */
static inline __attribute__((always_inline)) void NAME(lora_expand_block)(const int N, const int C, T *restrict out,
                                                                          int64_t out_stride, const int64_t *rows,
                                                                          float xa[][MAX_RANK], const T *restrict b,
                                                                          int64_t b_cols, int64_t rank, int64_t c) {
    f32x16 acc[GROUP][COLS];
    for (int j = 0; j < N; j++)
        for (int q = 0; q < C; q++) acc[j][q] = LOAD16(out + rows[j] * out_stride + c + 16 * q);
    for (int64_t r = 0; r < rank; r++) {
        f32x16 w[COLS];
        for (int q = 0; q < C; q++) w[q] = LOAD16(b + r * b_cols + c + 16 * q);
        for (int j = 0; j < N; j++)
            for (int q = 0; q < C; q++) acc[j][q] += xa[j][r] * w[q];
    }
    for (int j = 0; j < N; j++)
        for (int q = 0; q < C; q++) STORE16(out + rows[j] * out_stride + c + 16 * q, acc[j][q]);
}

/* out[row j][first..last) += sum_r xa[j][r] * b[r][first..last) for the group's N rows. */
static inline __attribute__((always_inline)) void NAME(lora_expand)(const int N, T *restrict out, int64_t out_stride,
                                                                    const int64_t *rows, float xa[][MAX_RANK],
                                                                    const T *restrict b, int64_t b_cols, int64_t rank,
                                                                    int64_t first, int64_t last) {
    int64_t c = first;
    for (; c + 16 * COLS <= last; c += 16 * COLS)
        NAME(lora_expand_block)(N, COLS, out, out_stride, rows, xa, b, b_cols, rank, c);
    for (; c + 16 <= last; c += 16) NAME(lora_expand_block)(N, 1, out, out_stride, rows, xa, b, b_cols, rank, c);
    for (; c < last; c++)
        for (int j = 0; j < N; j++) {
            T *o = out + rows[j] * out_stride + c;
            float sum = LOAD(*o);
            for (int64_t r = 0; r < rank; r++) sum += xa[j][r] * LOAD(b[r * b_cols + c]);
            *o = STORE(sum);
        }
}

/* One group: its N rows' LoRA, part after part. */
static inline __attribute__((always_inline)) void NAME(lora_group)(const int N, const float *restrict xf,
                                                                   T *restrict out, int64_t out_stride,
                                                                   const int64_t *members, int64_t in, int64_t slot,
                                                                   const T *restrict a, const T *restrict b,
                                                                   int64_t b_cols, const int64_t *restrict ranks,
                                                                   const int64_t *restrict columns, int64_t parts,
                                                                   int64_t stride) {
    float xa[GROUP][MAX_RANK];
    for (int64_t p = 0; p < parts; p++) {
        int64_t rank = (ranks[slot * parts + p] + RANKS - 1) / RANKS * RANKS;
        if (rank == 0) continue;
        int64_t first_row = (slot * parts + p) * stride;
        NAME(lora_shrink)(N, xa, xf, a + first_row * in, in, rank);
        NAME(lora_expand)(N, out, out_stride, members, xa, b + first_row * b_cols, b_cols, rank, columns[2 * p],
                          columns[2 * p + 1]);
    }
}

void NAME(lora_add)(const T *restrict x, int64_t x_stride, T *restrict out, int64_t out_stride, int64_t rows,
                    int64_t in, const int64_t *restrict slots, const T *restrict a, const T *restrict b,
                    int64_t b_cols, const int64_t *restrict ranks, const int64_t *restrict columns, int64_t parts,
                    int64_t stride, int64_t threads) {
    int64_t *order = malloc((2 * rows + 1) * sizeof(int64_t)), *starts = order + rows;
    int64_t groups = lora_groups(slots, rows, order, starts);
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1 && groups > 1)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t *members = order + starts[g];
        int64_t n = starts[g + 1] - starts[g];
        int64_t slot = slots[members[0]];
        float *xf = malloc(n * in * sizeof(float));
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = 0; i < in; i++) xf[j * in + i] = LOAD(x[members[j] * x_stride + i]);
#define GROUP_OF(N) NAME(lora_group)(N, xf, out, out_stride, members, in, slot, a, b, b_cols, ranks, columns, parts, stride)
        switch (n) {
            case 1: GROUP_OF(1); break;
            case 2: GROUP_OF(2); break;
            case 3: GROUP_OF(3); break;
            default: GROUP_OF(4); break;
        }
#undef GROUP_OF
        free(xf);
    }
    free(order);
}

#undef NAME
