/* The multi-token product kernel alone, without ONNX Runtime: 64 weight rows of K values (int4 or int8, the
 * interleaved layout, float16 scales) against 16 tokens, 4 at a time, either row by row (dot_row, as the operators
 * compute rows up to TILE_MIN_K values) or in tiles (tile_rows), repeated; prints multiply-adds per second of this
 * thread's CPU time (so less moved by other jobs than wall time). It includes the operators' source, so it measures
 * exactly their code; compile it with the flags of one instruction set, e.g.
 *
 *   cc -O3 -std=gnu11 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx2 -mfma -mf16c -DTILE_MIN_K=0 \
 *      -I mla_deploy/ort/csrc -o kernel benchmarks/tile_probe/kernel.c -lm
 *   ./kernel K BITS MODE [REPEAT]        MODE 0: row by row, 1: tiles; e.g. ./kernel 7168 4 1
 *
 * With -mavx2 -mfma -mf16c instead it runs under valgrind (which runs no AVX-512), for instruction counts and its
 * cache simulation: valgrind --tool=callgrind --cache-sim=yes ./kernel 7168 4 1 20 */
#include "cpu_ops.c"
#include <stdio.h>
#include <time.h>

static double cpu_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s K BITS MODE [REPEAT]\n", argv[0]);
        return 2;
    }
    const int K = atoi(argv[1]), bits = atoi(argv[2]), mode = atoi(argv[3]), repeat = argc > 4 ? atoi(argv[4]) : 2000;
    const int rows = 64, tokens = 16, lane = 1;
    const size_t row_bytes = (size_t)K * bits / 8;
    if (K < BLOCK || K % BLOCK || (bits != 4 && bits != 8)) return 2;
    uint8_t *w = aligned_alloc(64, aligned(rows * row_bytes));
    uint16_t *s = aligned_alloc(64, aligned((size_t)rows * (K / BLOCK) * 2));
    float *x = malloc(sizeof(float) * tokens * K), *out = malloc(sizeof(float) * tokens * rows);
    srand(1);
    for (size_t i = 0; i < rows * row_bytes; i++) w[i] = (uint8_t)rand();
    for (int i = 0; i < rows * (K / BLOCK); i++) s[i] = (uint16_t)(0x2000 + (rand() & 0xff)); /* float16 ~0.008 */
    for (int i = 0; i < tokens * K; i++) x[i] = rand() / (float)RAND_MAX - 0.5f;
    Rows a = {x, K, bits, aligned_alloc(64, aligned((size_t)tokens * K)), malloc(sizeof(float) * tokens * (K / BLOCK)),
              malloc(sizeof(float) * tokens * (K / BLOCK)), lane};
    for (int t = 0; t < tokens; t++) run_quantize(&a, t);
    const double start = cpu_seconds();
    for (int r = 0; r < repeat; r++)
        for (int p = 0; p < tokens; p += 4) {
            const int8_t *q[4];
            const float *d[4], *c[4];
            for (int j = 0; j < 4; j++) row_of(&a, (size_t)(p + j), &q[j], &d[j], &c[j]);
            if (mode == 1)
                tile_rows(w, row_bytes, s, K / BLOCK, 1, K, bits, rows, 4, q, d, c, out + p * rows, 1, rows, 0, lane);
            else
                for (int i = 0; i < rows; i++)
                    dot_row(w + i * row_bytes, scale_row(s, 1, (size_t)i * (K / BLOCK)), 1, K, bits, 4, q, d, c,
                            out + p * rows + i, rows, 0, lane);
        }
    const double seconds = cpu_seconds() - start;
    printf("K %d, int%d, %s: %.1f G multiply-adds/s (%.3f s of CPU time; out[5] %g)\n", K, bits,
           mode == 1 ? "tiles" : "row by row", (double)repeat * tokens * rows * K / seconds * 1e-9, seconds, out[5]);
    return 0;
}
