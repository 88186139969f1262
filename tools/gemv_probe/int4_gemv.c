/* An int4 matrix-vector product in ONNX Runtime's MatMulNBits layout (4 bits, blocks of 32, zero point 8, fp32
 * scales), computed as MatMulNBits computes it at accuracy_level 4: the vector quantized to int8 per block of 32,
 * integer dot products, one scale product per block. It measures how fast this machine streams such a product
 * with a kernel written for it (AVX-512 VNNI), beside MatMulNBits itself (tools/gemv_probe/__main__.py).
 *
 *   int4_gemv N K REPEATS HUGE_PAGES DIR
 *
 * Reads DIR/weights.bin (W [N, K/32, 16] bytes: byte j of a block holds element 2j in its low nibble and 2j+1 in
 * its high one), DIR/scales.bin (S [N, K/32] float32) and DIR/x.bin (the vector, K float32); writes DIR/y.bin
 * (N float32). The weights are copied into memory advised (HUGE_PAGES 1) or not (0) to huge pages. Prints one
 * JSON line: the best of REPEATS timed calls (quantizing the vector included), the bytes read, whether the VNNI
 * kernel ran and how many bytes of the process were on huge pages. */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define VNNI 1
#else
#define VNNI 0
#endif

#define BLOCK 32

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* the vector quantized per block: xe/xo the even/odd elements of each block (16 each), dx the block's scale,
 * corr = -8 * sum(int8 values) * dx (the zero point's share) */
static void quantize(const float *x, int K, int8_t *xe, int8_t *xo, float *dx, float *corr) {
    for (int b = 0; b < K / BLOCK; b++) {
        float amax = 0.f;
        for (int i = 0; i < BLOCK; i++) amax = fmaxf(amax, fabsf(x[b * BLOCK + i]));
        float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        int sum = 0;
        for (int j = 0; j < BLOCK / 2; j++) {
            int e = (int)lrintf(x[b * BLOCK + 2 * j] * inv), o = (int)lrintf(x[b * BLOCK + 2 * j + 1] * inv);
            xe[b * 16 + j] = (int8_t)e;
            xo[b * 16 + j] = (int8_t)o;
            sum += e + o;
        }
        dx[b] = d;
        corr[b] = -8.f * (float)sum * d;
    }
}

static void gemv(const uint8_t *W, const float *S, const int8_t *xe, const int8_t *xo, const float *dx,
                 const float *corr, float *y, int N, int K) {
    const int blocks = K / BLOCK;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t *w = W + (size_t)n * blocks * 16;
        const float *s = S + (size_t)n * blocks;
        float total = 0.f;
        int b = 0;
#if VNNI
        const __m512i low = _mm512_set1_epi8(0x0F);
        const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
        __m512 acc = _mm512_setzero_ps();
        __m128 zero_point = _mm_setzero_ps();
        for (; b + 4 <= blocks; b += 4) { /* 4 blocks: 64 bytes of weights */
            __m512i packed = _mm512_loadu_si512(w + 16 * b);
            __m512i even = _mm512_and_si512(packed, low);
            __m512i odd = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
            __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), even, _mm512_loadu_si512(xe + 16 * b));
            dot = _mm512_dpbusd_epi32(dot, odd, _mm512_loadu_si512(xo + 16 * b));
            __m128 sw = _mm_loadu_ps(s + b);
            zero_point = _mm_fmadd_ps(sw, _mm_loadu_ps(corr + b), zero_point);
            __m512 scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(sw, _mm_loadu_ps(dx + b))));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
        }
        float zp[4];
        _mm_storeu_ps(zp, zero_point);
        total = _mm512_reduce_add_ps(acc) + zp[0] + zp[1] + zp[2] + zp[3];
#endif
        for (; b < blocks; b++) { /* the blocks left over (and the whole row without VNNI) */
            int dot = 0;
            for (int j = 0; j < 16; j++)
                dot += (w[16 * b + j] & 15) * xe[16 * b + j] + (w[16 * b + j] >> 4) * xo[16 * b + j];
            total += s[b] * ((float)dot * dx[b] + corr[b]);
        }
        y[n] = total;
    }
}

static int read_file(const char *dir, const char *name, void *into, size_t bytes) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    size_t got = f ? fread(into, 1, bytes, f) : 0;
    if (f) fclose(f);
    if (got != bytes) fprintf(stderr, "int4_gemv: %s: expected %zu bytes\n", path, bytes);
    return got == bytes;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: int4_gemv N K REPEATS HUGE_PAGES DIR\n");
        return 2;
    }
    const int N = atoi(argv[1]), K = atoi(argv[2]), repeats = atoi(argv[3]), huge = atoi(argv[4]);
    const char *dir = argv[5];
    if (N < 1 || K < BLOCK || K % BLOCK || repeats < 1) {
        fprintf(stderr, "int4_gemv: N >= 1, K a multiple of %d, REPEATS >= 1\n", BLOCK);
        return 2;
    }
    const size_t wbytes = (size_t)N * K / 2, sbytes = (size_t)N * (K / BLOCK) * sizeof(float);
    const size_t page = 2u << 20, mapped = (wbytes + page - 1) / page * page;
    uint8_t *W = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (W == MAP_FAILED) { perror("mmap"); return 1; }
    madvise(W, mapped, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    float *S = malloc(sbytes), *x = malloc(K * sizeof(float)), *y = malloc(N * sizeof(float));
    int8_t *xe = malloc(K / 2), *xo = malloc(K / 2);
    float *dx = malloc(K / BLOCK * sizeof(float)), *corr = malloc(K / BLOCK * sizeof(float));
    if (!read_file(dir, "weights.bin", W, wbytes) || !read_file(dir, "scales.bin", S, sbytes) ||
        !read_file(dir, "x.bin", x, K * sizeof(float)))
        return 1;

    double best = 1e30;
    for (int r = 0; r <= repeats; r++) { /* the first call is untimed */
        double t = now();
        quantize(x, K, xe, xo, dx, corr);
        gemv(W, S, xe, xo, dx, corr, y, N, K);
        t = now() - t;
        if (r > 0 && t < best) best = t;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/y.bin", dir);
    FILE *out = fopen(path, "wb");
    if (!out || fwrite(y, sizeof(float), N, out) != (size_t)N) { perror(path); return 1; }
    fclose(out);
    long huge_kb = 0;
    FILE *smaps = fopen("/proc/self/smaps_rollup", "r");
    char line[256];
    while (smaps && fgets(line, sizeof line, smaps))
        if (!strncmp(line, "AnonHugePages:", 14)) huge_kb = atol(line + 14);
    if (smaps) fclose(smaps);
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    printf("{\"n\": %d, \"k\": %d, \"threads\": %d, \"vnni\": %s, \"seconds\": %.9f, \"bytes\": %zu, "
           "\"huge_page_bytes\": %ld}\n", N, K, threads, VNNI ? "true" : "false", best, wbytes + sbytes,
           huge_kb * 1024);
    return 0;
}
