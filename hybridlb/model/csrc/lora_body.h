/* lora.c's kernel for one dtype (T, LOAD, STORE, LOAD16, STORE16 and SUFFIX defined by the includer). */

#define NAME(name) CAT(name, SUFFIX)

/* xa[j][r] = x[j] . a[r] for the group's rows j < n (x in float32) and r < rank: each 16 floats
 * of a row of A are loaded once for all the rows. */
static inline void NAME(lora_shrink)(float xa[][MAX_RANK], const float *restrict x, int64_t n,
                                     const T *restrict a, int64_t in, int64_t rank) {
    int64_t whole = in / 16 * 16;
    for (int64_t r = 0; r < rank; r++) {
        const T *w = a + r * in;
        f32x16 s[GROUP] = {{0}};
        for (int64_t i = 0; i < whole; i += 16) {
            f32x16 v = LOAD16(w + i);
            for (int64_t j = 0; j < n; j++) s[j] += load16_f32(x + j * in + i) * v;
        }
        for (int64_t j = 0; j < n; j++) {
            float lanes[16];
            memcpy(lanes, &s[j], sizeof lanes);
            xa[j][r] = sum16(lanes);
            for (int64_t i = whole; i < in; i++) xa[j][r] += x[j * in + i] * LOAD(w[i]);
        }
    }
}

/* out[row j][first..last) += sum_r xa[j][r] * b[r][first..last) for the group's rows; each 16
 * values of a row of B are loaded once for all the rows. */
static inline void NAME(lora_expand)(T *restrict out, int64_t out_stride, const int64_t *rows, int64_t n,
                                     float xa[][MAX_RANK], const T *restrict b, int64_t b_cols, int64_t rank,
                                     int64_t first, int64_t last) {
    int64_t c = first;
    for (; c + 16 <= last; c += 16) {
        f32x16 acc[GROUP];
        for (int64_t j = 0; j < n; j++) acc[j] = LOAD16(out + rows[j] * out_stride + c);
        for (int64_t r = 0; r < rank; r++) {
            f32x16 w = LOAD16(b + r * b_cols + c);
            for (int64_t j = 0; j < n; j++) acc[j] += xa[j][r] * w;
        }
        for (int64_t j = 0; j < n; j++) STORE16(out + rows[j] * out_stride + c, acc[j]);
    }
    for (; c < last; c++)
        for (int64_t j = 0; j < n; j++) {
            T *o = out + rows[j] * out_stride + c;
            float sum = LOAD(*o);
            for (int64_t r = 0; r < rank; r++) sum += xa[j][r] * LOAD(b[r * b_cols + c]);
            *o = STORE(sum);
        }
}

void NAME(lora_add)(const T *restrict x, int64_t x_stride, T *restrict out, int64_t out_stride, int64_t rows,
                    int64_t in, const int64_t *restrict slots, const T *restrict a, const T *restrict b,
                    int64_t b_cols, const int64_t *restrict ranks, const int64_t *restrict columns, int64_t parts,
                    int64_t max_rank, int64_t threads) {
    int64_t *order = malloc((2 * rows + 1) * sizeof(int64_t)), *starts = order + rows;
    int64_t groups = lora_groups(slots, rows, order, starts);
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1 && groups > 1)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t *members = order + starts[g];
        int64_t n = (g + 1 < groups ? starts[g + 1] : starts[groups]) - starts[g];
        int64_t slot = slots[members[0]];
        float xa[GROUP][MAX_RANK];
        float *xf = malloc(n * in * sizeof(float));
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = 0; i < in; i++) xf[j * in + i] = LOAD(x[members[j] * x_stride + i]);
        for (int64_t p = 0; p < parts; p++) {
            int64_t rank = ranks[slot * parts + p];
            if (rank == 0) continue;
            int64_t first_row = (slot * parts + p) * max_rank;
            NAME(lora_shrink)(xa, xf, n, a + first_row * in, in, rank);
            NAME(lora_expand)(out, out_stride, members, n, xa, b + first_row * b_cols, b_cols, rank, columns[2 * p],
                              columns[2 * p + 1]);
        }
        free(xf);
    }
    free(order);
}

#undef NAME
