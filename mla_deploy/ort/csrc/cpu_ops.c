/* mla-deploy's ONNX Runtime CPU operators (domain mla_deploy): BlockwiseMatMul (below, after RoutedExperts) computes
 * MatMulNBits's product, and RoutedExperts computes QMoE's experts, each from the same weights, the same way;
 * HeadwiseMatMul (last) computes the absorbed attention's per-head products from their signed blockwise integers.
 *
 * mla_deploy.RoutedExperts: an ONNX Runtime CPU custom operator computing a MoE layer's routed experts from
 * blockwise-quantized weights in the layout of ONNX Runtime's own com.microsoft QMoE (int4 or int8, blocks of 32,
 * zero point 2^(bits-1), float scales, or float16 ones where the CPU engine stores them so), as QMoE computes them
 * at accuracy_level 4: each token's vector quantized to int8 per block of 32, integer dot products, one scale product per block.
 *
 * Why: QMoE streams a decode step's chosen experts at 20-25 GB/s on the development machine where a kernel
 * written for the product reaches 39-42 GB/s (tools/gemv_probe); the routed experts are most of a quantized
 * DeepSeek decode step. mla-deploy's CPU engine build (mla_deploy/ort/operators.py) compiles this file for the
 * best instruction set of the CPU it runs on and swaps each eligible QMoE node for this operator, same inputs, same
 * semantics.
 *
 * Inputs (T tokens, D hidden, E experts, I intermediate, B = 32, bits 4 or 8):
 *   0 input           float [T, D]
 *   1 router_probs    float [T, E]   each token runs its top k experts by this score (ties: the lower index)
 *   2 fc1 weights     uint8 [E, 2I, D*bits/8]   gate and up rows interleaved (row 2i gate i, row 2i+1 up i)
 *   3 fc1 scales      float or float16 [E, 2I, D/B] (fc2's of the same type)
 *   4 fc2 weights     uint8 [E, D, I*bits/8]
 *   5 fc2 scales      float or float16 [E, D, I/B]
 *   6 chosen          int64 [T, k]   (optional; only with normalize_routing_weights = 0)
 *   7-12 shared       (optional, all or none) the layer's shared experts as one SwiGLU MLP of intermediate size Is:
 *                     gate uint8 [Is, D/32, 32*bits/8], its scales (Is*D/32), up and its scales (the same), down
 *                     uint8 [D, Is/32, 32*bits/8], its scales (D*Is/32): MatMulNBits's layout, scales of fc1's type
 * Output 0: float [T, D] = sum over the chosen experts j of w_j * fc2_j(silu(gate_j) * up_j), plus, where inputs 7 to
 * 12 are given, down(silu(gate) * up) of every token (the CPU engine's build folds a MoE layer's shared experts in
 * so: their three products and the sum computed in the same call, mla_deploy/quant/own_ops.py). With
 * normalize_routing_weights = 1 (QMoE's setting), the experts are the top k of router_probs and w their softmax over
 * the k chosen. With 0, the routing is given, whatever chose it (greedy, group-limited, noaux_tc): input 1 is
 * then the weights float [T, k], used as they are, and input 6 the experts they weigh (each in [0, E)). The CPU
 * engine's build gives it that way where the export wrote the routing's weights into QMoE's router_probs through
 * ScatterElements/Log and multiplied the output back by their sum (mla_deploy/quant/own_ops.py): a handful of
 * nodes per layer fewer, and no renormalisation to undo.
 * Attributes: k, expert_weight_bits (4, 8), block_size (32), normalize_routing_weights (0, 1).
 *
 * ABI: this file declares the few ONNX Runtime C API entries it uses itself (by their fixed positions in the
 * append-only OrtApi table, ORT >= 1.17), as no package on the index ships ONNX Runtime's C header. Every library
 * compiled from it is run once in a child process before an engine records it (mla_deploy/ort/probe.py), so a wrong
 * position is refused in one line instead of crashing a session; the tests run the operators in real sessions
 * against QMoE and MatMulNBits (tests/ort/test_cpu_ops.py). */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
/* The instruction set the integer products use, chosen by the flags the library is compiled with
 * (mla_deploy/ort/operators.py compiles it for the best one the CPU has): AVX-512 VNNI (16 lanes of 32 bits in one
 * register), AVX-VNNI or AVX2 (the same 16 lanes in two 256-bit registers), else portable C. The three vector paths
 * run the same loops over the same 16 lanes (the V16 operations below): the same integer sums per lane, the same
 * float operations in the same order, so their outputs are equal bit for bit. The portable path sums block by block:
 * the same integers, its float sums in another order. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define VNNI 1
#define WIDE 0
#define ISA "avx512-vnni"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define VNNI 0
#define WIDE 1 /* 16 lanes in two 256-bit registers */
#if defined(__AVXVNNI__)
#define ISA "avx-vnni"
#else
#define ISA "avx2"
#endif
#else
#define VNNI 0
#define WIDE 0
#define ISA "portable"
#endif
#define SIMD (VNNI || WIDE)

#define BLOCK 32
#define TILE 16 /* weight rows per work item */
/* how far ahead of its loads the int8 interleaved loop asks for weight bytes (_mm_prefetch: a hint, it never faults;
 * past a row's end it reaches into the next row, which a product streams next). Without it the int8 rows streamed at
 * 77-81% of a plain read of the same memory, with it 84-92% (a timed copy of the kernel on V2-Lite's lm_head shape,
 * 2 threads, 2 MiB pages, 3 alternating rounds of 15; 256 to 4096 bytes tried, 768 best); a 4-layer V2-Lite int8
 * engine's decode step was 4-11% faster in two runs of 30 alternating pairs in one process. The int4 loop gains
 * nothing from it (the same copy, and -6 to +1% on the 4-layer int4 engine at 1024), so it asks for none. */
#define INT8_AHEAD 768
#define INPUTS 13 /* RoutedExperts' */
#define API_VERSION 17

/* ---- the ONNX Runtime C API, as far as it is used ---------------------------------------------------------- */
typedef struct OrtStatus OrtStatus;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtShapeInfo OrtShapeInfo;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtCustomOp OrtCustomOp;
typedef struct OrtApiBase {
    const void *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

enum { ORT_OK = 0, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };
enum { TYPE_UNDEFINED = 0, TYPE_FLOAT = 1, TYPE_UINT8 = 2, TYPE_INT64 = 7, TYPE_BOOL = 9, TYPE_FLOAT16 = 10 };

/* positions in struct OrtApi (zero-based; the table only ever grows at its end) */
enum {
    API_CreateStatus = 0,
    API_ReleaseStatus = 93,
    API_CreateCustomOpDomain = 26,
    API_CustomOpDomain_Add = 27,
    API_AddCustomOpDomain = 28,
    API_KernelInfoGetAttribute_float = 85,
    API_KernelInfoGetAttribute_int64 = 86,
    API_KernelContext_GetInput = 90,
    API_KernelContext_GetOutput = 91,
    API_GetTensorMutableData = 51,
    API_GetTensorTypeAndShape = 65,
    API_GetDimensionsCount = 61,
    API_GetDimensions = 62,
    API_GetTensorElementType = 60,
    API_ReleaseTensorTypeAndShapeInfo = 99,
    API_KernelContext_ParallelFor = 274,
    API_GetTensorShapeElementCount = 64,
    API_CreateOp = 213,
    API_InvokeOp = 214,
    API_ReleaseOp = 215,
    API_CreateOpAttr = 211,
    API_ReleaseOpAttr = 212,
};

typedef OrtStatus *(*CreateStatus_t)(int code, const char *msg);
typedef void (*ReleaseStatus_t)(OrtStatus *);
typedef OrtStatus *(*CreateCustomOpDomain_t)(const char *domain, OrtCustomOpDomain **out);
typedef OrtStatus *(*CustomOpDomain_Add_t)(OrtCustomOpDomain *domain, const OrtCustomOp *op);
typedef OrtStatus *(*AddCustomOpDomain_t)(OrtSessionOptions *options, OrtCustomOpDomain *domain);
typedef OrtStatus *(*KernelInfoGetAttribute_int64_t)(const OrtKernelInfo *info, const char *name, int64_t *out);
typedef OrtStatus *(*KernelInfoGetAttribute_float_t)(const OrtKernelInfo *info, const char *name, float *out);
typedef OrtStatus *(*KernelContext_GetInput_t)(const OrtKernelContext *ctx, size_t index, const OrtValue **out);
typedef OrtStatus *(*KernelContext_GetOutput_t)(OrtKernelContext *ctx, size_t index, const int64_t *dims,
                                                size_t count, OrtValue **out);
typedef OrtStatus *(*GetTensorMutableData_t)(OrtValue *value, void **out);
typedef OrtStatus *(*GetTensorTypeAndShape_t)(const OrtValue *value, OrtShapeInfo **out);
typedef OrtStatus *(*GetDimensionsCount_t)(const OrtShapeInfo *info, size_t *out);
typedef OrtStatus *(*GetDimensions_t)(const OrtShapeInfo *info, int64_t *dims, size_t count);
typedef OrtStatus *(*GetTensorElementType_t)(const OrtShapeInfo *info, int *out);
typedef void (*ReleaseTensorTypeAndShapeInfo_t)(OrtShapeInfo *);
typedef OrtStatus *(*GetTensorShapeElementCount_t)(const OrtShapeInfo *info, size_t *out);
typedef OrtStatus *(*KernelContext_ParallelFor_t)(const OrtKernelContext *ctx, void (*fn)(void *, size_t),
                                                  size_t total, size_t num_batch, void *data);
typedef struct OrtOp OrtOp;
typedef OrtStatus *(*CreateOp_t)(const OrtKernelInfo *info, const char *op_name, const char *domain, int version,
                                 const char **type_constraint_names, const int *type_constraint_values,
                                 int type_constraint_count, const void *const *attr_values, int attr_count,
                                 int input_count, int output_count, OrtOp **out);
typedef OrtStatus *(*InvokeOp_t)(const OrtKernelContext *ctx, const OrtOp *op, const OrtValue *const *inputs,
                                 int input_count, OrtValue *const *outputs, int output_count);
typedef void (*ReleaseOp_t)(OrtOp *op);
typedef struct OrtOpAttr OrtOpAttr;
/* type 1: ORT_OP_ATTR_INT; ONNX Runtime reads the value as an int (1.31) or an int64 (later): an int64 holds both */
typedef OrtStatus *(*CreateOpAttr_t)(const char *name, const void *data, int len, int type, OrtOpAttr **out);
typedef void (*ReleaseOpAttr_t)(OrtOpAttr *attr);

/* struct OrtCustomOp, up to the fields read at version 16 (the rest zero) */
struct OrtCustomOp {
    uint32_t version;
    void *(*CreateKernel)(const OrtCustomOp *, const void *api, const OrtKernelInfo *);
    const char *(*GetName)(const OrtCustomOp *);
    const char *(*GetExecutionProviderType)(const OrtCustomOp *);
    int (*GetInputType)(const OrtCustomOp *, size_t);
    size_t (*GetInputTypeCount)(const OrtCustomOp *);
    int (*GetOutputType)(const OrtCustomOp *, size_t);
    size_t (*GetOutputTypeCount)(const OrtCustomOp *);
    void (*KernelCompute)(void *, OrtKernelContext *);
    void (*KernelDestroy)(void *);
    int (*GetInputCharacteristic)(const OrtCustomOp *, size_t);
    int (*GetOutputCharacteristic)(const OrtCustomOp *, size_t);
    int (*GetInputMemoryType)(const OrtCustomOp *, size_t);
    int (*GetVariadicInputMinArity)(const OrtCustomOp *);
    int (*GetVariadicInputHomogeneity)(const OrtCustomOp *);
    int (*GetVariadicOutputMinArity)(const OrtCustomOp *);
    int (*GetVariadicOutputHomogeneity)(const OrtCustomOp *);
    OrtStatus *(*CreateKernelV2)(const OrtCustomOp *, const void *api, const OrtKernelInfo *, void **kernel);
    OrtStatus *(*KernelComputeV2)(void *, OrtKernelContext *);
    void *reserved[16]; /* later versions' fields: never read at version 16 */
};

static void *const *api;
#define CALL(name) ((name##_t)api[API_##name])
#define CHECK(expr)                                                                                                \
    do {                                                                                                           \
        OrtStatus *status_ = (expr);                                                                               \
        if (status_) return status_;                                                                               \
    } while (0)

static OrtStatus *fail(const char *message) { return CALL(CreateStatus)(ORT_INVALID_ARGUMENT, message); }

/* ---- the arithmetic ------------------------------------------------------------------------------------------ */

/* The interleaved layout of a quantized row (the weights of a RoutedExperts or BlockwiseMatMul node whose
 * `interleaved` attribute is 1, and the activations they meet): each group of 16 whole blocks keeps its bytes where they are, but byte m of block
 * j of the group (m < 16 for int4 weights, 32 for int8) lies at 64 * (m / 4) + 4 * j + m % 4 of the group, so that
 * 32-bit lane j of every 64-byte load holds block j: the sums then stay per block across the group's loads, and
 * the scales apply once per group. Blocks after the last whole group keep their order. An int4 activation row's
 * even half and odd half (quantize_block) are each laid out as int4 weights. */
static inline size_t lane_byte(int b, int m, int block_bytes, int blocks) {
    if (b >= blocks / 16 * 16) return (size_t)b * block_bytes + m;
    return (size_t)(b / 16) * 16 * block_bytes + 64 * (m / 4) + 4 * (b % 16) + m % 4;
}

#if VNNI
/* the 16 bytes of v as 4 pieces of 4 bytes, 64 bytes apart from dst on (a block's 16 bytes in the interleaved layout) */
static inline void spread16(int8_t *dst, __m128i v) {
    _mm_storeu_si32(dst, v), _mm_storeu_si32(dst + 64, _mm_srli_si128(v, 4));
    _mm_storeu_si32(dst + 128, _mm_srli_si128(v, 8)), _mm_storeu_si32(dst + 192, _mm_srli_si128(v, 12));
}
#endif

/* block b of a vector of K quantized to int8 (v: its 32 values): q holds the row (int4 weights: each block's 16 even
 * elements at [16b, 16b + 16) and its 16 odd ones at K/2 + [16b, 16b + 16); int8 weights: in order), d[b] the
 * block's scale and corr[b] = -zero * sum(q in block b) * d[b] (the zero point's share of a block's product) */
static void quantize_block(const float *v, int K, int b, int bits, int lane, int8_t *q, float *d, float *corr) {
    const int blocks = K / BLOCK, spread = lane && b < blocks / 16 * 16; /* the block's bytes in 4-byte pieces */
#if VNNI
    { /* the same arithmetic on two vectors: cvtps rounds half to even as lrintf does (the default rounding mode); the
       * AVX-VNNI and AVX2 builds take the loop below, the same integers and scales */
        const __m512 lo = _mm512_loadu_ps(v), hi = _mm512_loadu_ps(v + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float scale = amax / 127.f, inv = scale > 0.f ? 1.f / scale : 0.f;
        const __m512 invs = _mm512_set1_ps(inv);
        const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(lo, invs)), c = _mm512_cvtps_epi32(_mm512_mul_ps(hi, invs));
        const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(a, c));
        if (bits == 4) { /* the 16 even elements, then the 16 odd ones */
            const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
            const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
            const __m128i e = _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(a, even, c));
            const __m128i o = _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(a, odd, c));
            if (spread) {
                spread16(q + lane_byte(b, 0, 16, blocks), e);
                spread16(q + K / 2 + lane_byte(b, 0, 16, blocks), o);
            } else {
                _mm_storeu_si128((__m128i *)(q + b * 16), e);
                _mm_storeu_si128((__m128i *)(q + K / 2 + b * 16), o);
            }
        } else if (spread) {
            int8_t *qb = q + lane_byte(b, 0, BLOCK, blocks); /* bytes 0-15, then 16-31: pieces 0-3 and 4-7 */
            spread16(qb, _mm512_cvtepi32_epi8(a)), spread16(qb + 256, _mm512_cvtepi32_epi8(c));
        } else {
            _mm_storeu_si128((__m128i *)(q + b * BLOCK), _mm512_cvtepi32_epi8(a));
            _mm_storeu_si128((__m128i *)(q + b * BLOCK + 16), _mm512_cvtepi32_epi8(c));
        }
        d[b] = scale;
        corr[b] = -(float)(1 << (bits - 1)) * (float)sum * scale;
        return;
    }
#endif
    float amax = 0.f;
    for (int i = 0; i < BLOCK; i++) amax = fmaxf(amax, fabsf(v[i]));
    const float scale = amax / 127.f, inv = scale > 0.f ? 1.f / scale : 0.f;
    int sum = 0;
    for (int i = 0; i < BLOCK; i++) {
        const int r = (int)lrintf(v[i] * inv);
        sum += r;
        if (bits == 4)
            q[(i & 1) * (K / 2) + (spread ? lane_byte(b, i / 2, 16, blocks) : (size_t)b * 16 + i / 2)] = (int8_t)r;
        else
            q[spread ? lane_byte(b, i, BLOCK, blocks) : (size_t)b * BLOCK + i] = (int8_t)r;
    }
    d[b] = scale;
    corr[b] = -(float)(1 << (bits - 1)) * (float)sum * scale;
}

static void quantize_row(const float *x, int K, int bits, int lane, int8_t *q, float *d, float *corr) {
    for (int b = 0; b < K / BLOCK; b++) quantize_block(x + b * BLOCK, K, b, bits, lane, q, d, corr);
}

/* M rows of K values quantized (quantize_row): q [M, K], d and c [M, K/B]; lane: in the interleaved layout */
typedef struct {
    const float *x;
    int K, bits;
    int8_t *q;
    float *d, *c;
    int lane;
} Rows;

/* row i of a Rows: its quantized values, block scales and zero-point shares */
static void row_of(const Rows *rows, size_t i, const int8_t **q, const float **d, const float **c) {
    const int K = rows->K;
    *q = rows->q + i * K, *d = rows->d + i * (K / BLOCK), *c = rows->c + i * (K / BLOCK);
}

static void run_quantize(void *data, size_t i) {
    const Rows *rows = (const Rows *)data;
    const int K = rows->K;
    quantize_row(rows->x + i * K, K, rows->bits, rows->lane, rows->q + i * K, rows->d + i * (K / BLOCK),
                 rows->c + i * (K / BLOCK));
}

/* one bump allocation per call: every buffer of an operator's call, 64-byte aligned */
typedef struct {
    char *base, *at;
} Scratch;

static size_t aligned(size_t bytes) { return (bytes + 63) / 64 * 64; }

static void *take(Scratch *scratch, size_t bytes) {
    void *p = scratch->at;
    scratch->at += aligned(bytes);
    return p;
}

/* an IEEE half's value (the scales' fallback path: every value a float16 holds, subnormals included) */
static inline float half_value(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24, exact in float */
        const float v = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    const uint32_t bits = sign | (exponent == 31 ? 0x7F800000u | (mantissa << 13)
                                                 : ((exponent + 112) << 23) | (mantissa << 13));
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* block scales are float or, where `half`, float16 (the CPU engine stores them so where that is exact) */
static inline size_t scale_bytes(int half) { return half ? 2 : sizeof(float); }
static inline const void *scale_row(const void *s, int half, size_t i) { return (const char *)s + i * scale_bytes(half); }
static inline __attribute__((always_inline)) float scale_at(const void *s, int half, int b) {
    return half ? half_value(((const uint16_t *)s)[b]) : ((const float *)s)[b];
}
/* ---- V16: 16 lanes of 32 bits (64 bytes), the vector paths' one set of operations ------------------------------
 * vi: 16 int32 lanes (or 64 bytes), vf: 16 floats. AVX-512: one register; AVX-VNNI and AVX2: two 256-bit halves
 * (lanes 0-7 and 8-15, the first and last 32 of 64 bytes). Each operation computes per lane what the AVX-512
 * instruction computes, so that the loops written with them give the same lanes on every vector path. */
#define AI static inline __attribute__((always_inline))
#if VNNI
typedef __m512i vi;
typedef __m512 vf;
AI vi vi_load(const void *p) { return _mm512_loadu_si512(p); }
AI vi vi_zero(void) { return _mm512_setzero_si512(); }
AI vi vi_bytes(uint8_t b) { return _mm512_set1_epi8((char)b); }
AI vi vi_words(int32_t v) { return _mm512_set1_epi32(v); }
AI vi vi_xor(vi a, vi b) { return _mm512_xor_si512(a, b); }
AI vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
/* acc + in each lane the sum of its 4 products of an unsigned byte of u and a signed byte of s (any bytes) */
AI vi vi_dot(vi acc, vi u, vi s) { return _mm512_dpbusd_epi32(acc, u, s); }
/* int4: *lo (+) low nibbles . even, *hi (+) high nibbles . odd, to be finished by vi_nibbles_done: the odd weights
 * are taken in place, as 16 times their value (the high nibble, masked): their sums are 16 times the odd products'
 * exactly (at most 4 loads x 4 x 240 x 128 in a lane), and one shift per group divides them back, where shifting
 * every load down cost an instruction per 64 bytes; the sums are the same integers */
AI void vi_nibbles(vi *lo, vi *hi, vi packed, vi even, vi odd) {
    *lo = _mm512_dpbusd_epi32(*lo, _mm512_and_si512(packed, _mm512_set1_epi8(0x0F)), even);
    *hi = _mm512_dpbusd_epi32(*hi, _mm512_and_si512(packed, _mm512_set1_epi8((char)0xF0)), odd);
}
AI vi vi_nibbles_done(vi hi) { return _mm512_srai_epi32(hi, 4); }
/* 64 bytes of int4 weights against a token's 64 even and 64 odd int8 values: per-lane sums of 4 + 4 products */
AI vi vi_nibble_dot(vi packed, vi even, vi odd) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(packed, low), even);
    return _mm512_dpbusd_epi32(dot, _mm512_and_si512(_mm512_srli_epi16(packed, 4), low), odd);
}
AI vf vf_zero(void) { return _mm512_setzero_ps(); }
AI vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
AI vf vf_load4(const float *p) { return _mm512_maskz_loadu_ps(0x000F, p); } /* p[0..3], then 0 */
AI vf vf_load2(const float *p) { return _mm512_maskz_loadu_ps(0x0003, p); } /* p[0..1], then 0 */
AI vf vf_set1(float v) { return _mm512_set1_ps(v); }
AI vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
AI vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
AI vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); } /* a * b + c, rounded once */
AI vf vf_float(vi a) { return _mm512_cvtepi32_ps(a); }
AI void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
AI vf scales16(const void *s, int half, int b) { /* blocks b..b+15 */
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)s + b)))
                : _mm512_loadu_ps((const float *)s + b);
}
AI vf scales4(const void *s, int half, int b) { /* b..b+3, then 0 */
    return half ? _mm512_cvtph_ps(_mm256_zextsi128_si256(_mm_loadl_epi64((const __m128i *)((const uint16_t *)s + b))))
                : _mm512_maskz_loadu_ps(0x000F, (const float *)s + b);
}
AI vf scales2(const void *s, int half, int b) { /* b, b + 1, then 0 */
    return half ? _mm512_cvtph_ps(_mm256_zextsi128_si256(_mm_maskz_loadu_epi16(0x03, (const uint16_t *)s + b)))
                : _mm512_maskz_loadu_ps(0x0003, (const float *)s + b);
}
/* lane i: scale[4g + i / 4] (int4: a group's block 4g + i / 4 in lane i) */
AI vf vf_four(vf scale, int g) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i lanes = _mm512_add_epi32(_mm512_set1_epi32(4 * g), _mm512_srli_epi32(lane, 2));
    return _mm512_permutexvar_ps(lanes, scale);
}
/* lane i: scale[2g + i / 8] (int8) */
AI vf vf_pair(vf scale, int g) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i lanes = _mm512_add_epi32(_mm512_set1_epi32(2 * g), _mm512_srli_epi32(lane, 3));
    return _mm512_permutexvar_ps(lanes, scale);
}
AI vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
AI vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
AI vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
AI vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
AI vf vf_fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); } /* c - a * b, rounded once */
AI vf vf_round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
AI vf vf_scale2(vf y, vf n) { return _mm512_scalef_ps(y, n); } /* y * 2^n for whole n, rounded once */
AI __m256 vf_low(vf v) { return _mm512_castps512_ps256(v); }
AI __m256 vf_high(vf v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
#elif WIDE
typedef struct {
    __m256i l, h;
} vi;
typedef struct {
    __m256 l, h;
} vf;
AI vi vi_load(const void *p) {
    return (vi){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)((const char *)p + 32))};
}
AI vi vi_zero(void) { return (vi){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
AI vi vi_bytes(uint8_t b) { return (vi){_mm256_set1_epi8((char)b), _mm256_set1_epi8((char)b)}; }
AI vi vi_words(int32_t v) { return (vi){_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
AI vi vi_xor(vi a, vi b) { return (vi){_mm256_xor_si256(a.l, b.l), _mm256_xor_si256(a.h, b.h)}; }
AI vi vi_add(vi a, vi b) { return (vi){_mm256_add_epi32(a.l, b.l), _mm256_add_epi32(a.h, b.h)}; }
AI __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
AI __m256i high_nibbles(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
#if defined(__AVXVNNI__)
AI __m256i dot8(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
/* two nibbles' products: the same sums as AVX-512's, in 256 bits */
AI __m256i nibble_dot8(__m256i acc, __m256i packed, __m256i even, __m256i odd) {
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, low_nibbles(packed), even), high_nibbles(packed), odd);
}
#else
/* AVX2 has no 4-way byte product: vpmaddubsw sums 2 products into 16 bits, saturated, vpmaddwd 2 of those into 32.
 * An unsigned weight byte (up to 255) times an int8 value (-127 to 127) twice overflows 16 bits, so the byte is
 * split in its nibbles (up to 15: 2 x 15 x 127 fits) and the high nibble's sums weighted by 16 in vpmaddwd: the
 * same integers as VNNI's vpdpbusd. */
AI __m256i dot8(__m256i acc, __m256i u, __m256i s) {
    const __m256i low = _mm256_madd_epi16(_mm256_maddubs_epi16(low_nibbles(u), s), _mm256_set1_epi16(1));
    const __m256i high = _mm256_madd_epi16(_mm256_maddubs_epi16(high_nibbles(u), s), _mm256_set1_epi16(16));
    return _mm256_add_epi32(acc, _mm256_add_epi32(low, high));
}
/* int4: 2 x 15 x 127 per product pair, twice: the 16-bit sums of both nibbles fit (at most 7620) */
AI __m256i nibble_dot8(__m256i acc, __m256i packed, __m256i even, __m256i odd) {
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low_nibbles(packed), even),
                                           _mm256_maddubs_epi16(high_nibbles(packed), odd));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif
AI vi vi_dot(vi acc, vi u, vi s) { return (vi){dot8(acc.l, u.l, s.l), dot8(acc.h, u.h, s.h)}; }
/* int4, as AVX-512's vi_nibbles: the sums go to *lo alone (only lo + hi is used, the same integers) */
AI void vi_nibbles(vi *lo, vi *hi, vi packed, vi even, vi odd) {
    (void)hi;
    *lo = (vi){nibble_dot8(lo->l, packed.l, even.l, odd.l), nibble_dot8(lo->h, packed.h, even.h, odd.h)};
}
AI vi vi_nibbles_done(vi hi) { return hi; }
AI vi vi_nibble_dot(vi packed, vi even, vi odd) {
    const __m256i zero = _mm256_setzero_si256();
    return (vi){nibble_dot8(zero, packed.l, even.l, odd.l), nibble_dot8(zero, packed.h, even.h, odd.h)};
}
AI vf vf_zero(void) { return (vf){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
AI vf vf_load(const float *p) { return (vf){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
AI vf vf_load4(const float *p) { return (vf){_mm256_zextps128_ps256(_mm_loadu_ps(p)), _mm256_setzero_ps()}; }
AI vf vf_load2(const float *p) {
    return (vf){_mm256_zextps128_ps256(_mm_castpd_ps(_mm_load_sd((const double *)p))), _mm256_setzero_ps()};
}
AI vf vf_set1(float v) { return (vf){_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
AI vf vf_add(vf a, vf b) { return (vf){_mm256_add_ps(a.l, b.l), _mm256_add_ps(a.h, b.h)}; }
AI vf vf_mul(vf a, vf b) { return (vf){_mm256_mul_ps(a.l, b.l), _mm256_mul_ps(a.h, b.h)}; }
AI vf vf_fmadd(vf a, vf b, vf c) { return (vf){_mm256_fmadd_ps(a.l, b.l, c.l), _mm256_fmadd_ps(a.h, b.h, c.h)}; }
AI vf vf_float(vi a) { return (vf){_mm256_cvtepi32_ps(a.l), _mm256_cvtepi32_ps(a.h)}; }
AI void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v.l), _mm256_storeu_ps(p + 8, v.h); }
AI vf scales16(const void *s, int half, int b) {
    const uint16_t *h = (const uint16_t *)s + b;
    return half ? (vf){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)),
                       _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 8)))}
                : vf_load((const float *)s + b);
}
AI vf scales4(const void *s, int half, int b) {
    const __m128i four = half ? _mm_loadl_epi64((const __m128i *)((const uint16_t *)s + b)) : _mm_setzero_si128();
    return half ? (vf){_mm256_zextps128_ps256(_mm_cvtph_ps(four)), _mm256_setzero_ps()}
                : vf_load4((const float *)s + b);
}
AI vf scales2(const void *s, int half, int b) {
    int32_t two;
    if (half) memcpy(&two, (const uint16_t *)s + b, sizeof two);
    return half ? (vf){_mm256_zextps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(two))), _mm256_setzero_ps()}
                : vf_load2((const float *)s + b);
}
AI vf vf_four(vf scale, int g) { /* lanes 0-7: scale[4g], scale[4g + 1]; 8-15: scale[4g + 2], scale[4g + 3] */
    const __m256 from = g < 2 ? scale.l : scale.h;
    const __m256i at = _mm256_add_epi32(_mm256_set1_epi32(4 * (g & 1)), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    const __m256i next = _mm256_add_epi32(at, _mm256_set1_epi32(2));
    return (vf){_mm256_permutevar8x32_ps(from, at), _mm256_permutevar8x32_ps(from, next)};
}
AI vf vf_pair(vf scale, int g) { /* lanes 0-7: scale[2g]; 8-15: scale[2g + 1] */
    const __m256 from = g < 4 ? scale.l : scale.h;
    const int at = 2 * g % 8;
    return (vf){_mm256_permutevar8x32_ps(from, _mm256_set1_epi32(at)),
                _mm256_permutevar8x32_ps(from, _mm256_set1_epi32(at + 1))};
}
AI vf vf_sub(vf a, vf b) { return (vf){_mm256_sub_ps(a.l, b.l), _mm256_sub_ps(a.h, b.h)}; }
AI vf vf_div(vf a, vf b) { return (vf){_mm256_div_ps(a.l, b.l), _mm256_div_ps(a.h, b.h)}; }
AI vf vf_max(vf a, vf b) { return (vf){_mm256_max_ps(a.l, b.l), _mm256_max_ps(a.h, b.h)}; }
AI vf vf_min(vf a, vf b) { return (vf){_mm256_min_ps(a.l, b.l), _mm256_min_ps(a.h, b.h)}; }
AI vf vf_fnmadd(vf a, vf b, vf c) { return (vf){_mm256_fnmadd_ps(a.l, b.l, c.l), _mm256_fnmadd_ps(a.h, b.h, c.h)}; }
AI vf vf_round(vf a) {
    return (vf){_mm256_round_ps(a.l, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                _mm256_round_ps(a.h, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
/* y * 2^n for whole n in [-150, 128] (vf_exp's), rounded once as AVX-512's vscalefps rounds it: 2^n is not a float
 * at both ends, so y is scaled by 2^(n/2 rounded down) first (exact: y is near 1) and by the rest after */
AI __m256 scale2_8(__m256 y, __m256 n) {
    const __m256i whole = _mm256_cvtps_epi32(n), first = _mm256_srai_epi32(whole, 1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(first, bias), 23));
    const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(whole, first), bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(y, a), b);
}
AI vf vf_scale2(vf y, vf n) { return (vf){scale2_8(y.l, n.l), scale2_8(y.h, n.h)}; }
AI __m256 vf_low(vf v) { return v.l; }
AI __m256 vf_high(vf v) { return v.h; }
#endif

#if SIMD
/* the sum of a vf's 16 lanes, in the order GCC's _mm512_reduce_add_ps sums them (halves, quarters, then pairs),
 * written out so that every vector path and compiler sums in that one order */
AI float vf_sum(vf v) {
    const __m256 eight = _mm256_add_ps(vf_high(v), vf_low(v));
    const __m128 four = _mm_add_ps(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight));
    const __m128 two = _mm_add_ps(four, _mm_shuffle_ps(four, four, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(two) + _mm_cvtss_f32(_mm_shuffle_ps(two, two, 1));
}
/* acc += dot * the scales of its lanes' blocks (int4: vf_four's, int8: vf_pair's) */
AI vf scaled4(vf acc, vi dot, int g, vf scale) { return vf_fmadd(vf_float(dot), vf_four(scale, g), acc); }
AI vf scaled2(vf acc, vi dot, int g, vf scale) { return vf_fmadd(vf_float(dot), vf_pair(scale, g), acc); }
#endif

/* out[t * stride] = row . x_t for n (<= 4) tokens: the row's weights w (K * bits / 8 bytes; each byte XORed with
 * flip first: 0 for weights stored with the zero point 2^(bits-1), 0x88 (int4) or 0x80 (int8) for signed ones, which
 * that XOR turns into the same) and block scales s (float, or float16 where `half`), the tokens' quantize_row()
 * outputs q, d, corr */
static inline __attribute__((always_inline)) void dot_rows(const uint8_t *w, const void *s, int half, int K, int bits,
                                                          int n, const int8_t *const *q, const float *const *d,
                                                          const float *const *corr, float *out, size_t stride,
                                                          uint8_t flip, int lane) {
    const int blocks = K / BLOCK;
    float total[4] = {0.f, 0.f, 0.f, 0.f};
    int b = 0;
#if SIMD
    {
        const vi flips = vi_bytes(flip);
        vf acc[4], acc2[4], zp[4]; /* int4: odd groups into acc2, so that two chains of FMAs run at once */
        for (int t = 0; t < n; t++) acc[t] = acc2[t] = zp[t] = vf_zero();
        for (; lane && b + 16 <= blocks; b += 16) { /* the interleaved layout: lane j is block j in every load */
            const vf sw = scales16(s, half, b);
            vi lo[4], hi[4]; /* two chains of integer sums per token */
            for (int t = 0; t < n; t++) lo[t] = hi[t] = vi_zero();
            if (bits == 4) {
                for (int g = 0; g < 4; g++) {
                    const int at = 16 * b + 64 * g;
                    const vi packed = flip ? vi_xor(vi_load(w + at), flips) : vi_load(w + at);
                    for (int t = 0; t < n; t++)
                        vi_nibbles(&lo[t], &hi[t], packed, vi_load(q[t] + at), vi_load(q[t] + K / 2 + at));
                }
                for (int t = 0; t < n; t++) hi[t] = vi_nibbles_done(hi[t]);
            } else {
                for (int g = 0; g < 8; g += 2) {
                    const int at = BLOCK * b + 64 * g;
                    _mm_prefetch((const char *)w + at + INT8_AHEAD, _MM_HINT_T0);
                    _mm_prefetch((const char *)w + at + 64 + INT8_AHEAD, _MM_HINT_T0);
                    const vi p0 = flip ? vi_xor(vi_load(w + at), flips) : vi_load(w + at);
                    const vi p1 = flip ? vi_xor(vi_load(w + at + 64), flips) : vi_load(w + at + 64);
                    for (int t = 0; t < n; t++) {
                        lo[t] = vi_dot(lo[t], p0, vi_load(q[t] + at));
                        hi[t] = vi_dot(hi[t], p1, vi_load(q[t] + at + 64));
                    }
                }
            }
            for (int t = 0; t < n; t++) {
                const vf dot = vf_float(vi_add(lo[t], hi[t]));
                acc[t] = vf_fmadd(dot, vf_mul(sw, vf_load(d[t] + b)), acc[t]);
                zp[t] = vf_fmadd(sw, vf_load(corr[t] + b), zp[t]);
            }
        }
        for (; b + 16 <= blocks; b += 16) { /* 16 blocks: their scale products at once */
            const vf sw = scales16(s, half, b);
            vf scale[4];
            for (int t = 0; t < n; t++) {
                scale[t] = vf_mul(sw, vf_load(d[t] + b));
                zp[t] = vf_fmadd(sw, vf_load(corr[t] + b), zp[t]);
            }
            if (bits == 4) {
                for (int g = 0; g < 4; g++) {
                    const int at = 16 * (b + 4 * g);
                    const vi packed = vi_xor(vi_load(w + at), flips);
                    for (int t = 0; t < n; t++) {
                        const vi dot = vi_nibble_dot(packed, vi_load(q[t] + at), vi_load(q[t] + K / 2 + at));
                        if (g & 1)
                            acc2[t] = scaled4(acc2[t], dot, g, scale[t]);
                        else
                            acc[t] = scaled4(acc[t], dot, g, scale[t]);
                    }
                }
            } else {
                for (int g = 0; g < 8; g++) {
                    const int at = BLOCK * (b + 2 * g);
                    const vi packed = vi_xor(vi_load(w + at), flips);
                    for (int t = 0; t < n; t++)
                        acc[t] = scaled2(acc[t], vi_dot(vi_zero(), packed, vi_load(q[t] + at)), g, scale[t]);
                }
            }
        }
        for (; bits == 4 && b + 4 <= blocks; b += 4) { /* int4: 4 blocks left at a time */
            const vf sw = scales4(s, half, b);
            const vi packed = vi_xor(vi_load(w + 16 * b), flips);
            for (int t = 0; t < n; t++) {
                const vi dot = vi_nibble_dot(packed, vi_load(q[t] + 16 * b), vi_load(q[t] + K / 2 + 16 * b));
                acc[t] = scaled4(acc[t], dot, 0, vf_mul(sw, vf_load4(d[t] + b)));
                zp[t] = vf_fmadd(sw, vf_load4(corr[t] + b), zp[t]);
            }
        }
        for (; bits == 8 && b + 2 <= blocks; b += 2) { /* int8: 2 blocks left at a time (an expert's 1408 = 44 x 32) */
            const vf sw = scales2(s, half, b);
            const vi packed = vi_xor(vi_load(w + BLOCK * b), flips);
            for (int t = 0; t < n; t++) {
                const vi dot = vi_dot(vi_zero(), packed, vi_load(q[t] + BLOCK * b));
                acc[t] = scaled2(acc[t], dot, 0, vf_mul(sw, vf_load2(d[t] + b)));
                zp[t] = vf_fmadd(sw, vf_load2(corr[t] + b), zp[t]);
            }
        }
        for (int t = 0; t < n; t++) total[t] = vf_sum(vf_add(vf_add(acc[t], acc2[t]), zp[t]));
    }
#endif
    for (; b < blocks; b++) { /* the blocks left over (every block in portable C) */
        for (int t = 0; t < n; t++) {
            int dot = 0;
            if (bits == 4) {
                for (int j = 0; j < 16; j++) {
                    const size_t at = lane ? lane_byte(b, j, 16, blocks) : (size_t)16 * b + j;
                    const uint8_t v = w[at] ^ flip;
                    dot += (v & 15) * q[t][at] + (v >> 4) * q[t][K / 2 + at];
                }
            } else {
                for (int j = 0; j < BLOCK; j++) {
                    const size_t at = lane ? lane_byte(b, j, BLOCK, blocks) : (size_t)BLOCK * b + j;
                    dot += (uint8_t)(w[at] ^ flip) * q[t][at];
                }
            }
            total[t] += scale_at(s, half, b) * ((float)dot * d[t][b] + corr[t][b]);
        }
    }
    for (int t = 0; t < n; t++) out[t * stride] = total[t];
}

/* dot_rows' flip for signed weights (the per-head ones): XORed with it they hold the zero point 2^(bits-1) */
static inline uint8_t signed_flip(int bits) { return bits == 4 ? 0x88 : 0x80; }

/* dot_rows with n, bits and the scales' type constant in each call, so that its loops over tokens unroll into
 * registers, and weights that need no flip (every projection's and expert's) read without one */
static void dot_row(const uint8_t *w, const void *s, int half, int K, int bits, int n, const int8_t *const *q,
                    const float *const *d, const float *const *corr, float *out, size_t stride, uint8_t flip,
                    int lane) {
#define CASE(L, H, B, N) \
    case 1000 * L + 100 * H + 10 * B + N:                                                                         \
        if (flip)                                                                                                  \
            dot_rows(w, s, H, K, B, N, q, d, corr, out, stride, flip, L);                                          \
        else                                                                                                       \
            dot_rows(w, s, H, K, B, N, q, d, corr, out, stride, 0, L);                                             \
        break;
#define CASES(L, H) CASE(L, H, 4, 1) CASE(L, H, 4, 2) CASE(L, H, 4, 3) CASE(L, H, 4, 4) \
                    CASE(L, H, 8, 1) CASE(L, H, 8, 2) CASE(L, H, 8, 3) CASE(L, H, 8, 4)
    switch (1000 * (lane != 0) + 100 * (half != 0) + 10 * bits + n) {
        CASES(0, 0) CASES(0, 1) CASES(1, 0) CASES(1, 1)
    }
#undef CASES
#undef CASE
}

/* one token against `count` weight rows: out[i * out_step] = row_i . x, row i at w + i * row_step bytes with its
 * scales i * scale_step values from s; the same arithmetic as dot_row with n = 1, row after row, but with dot_rows
 * inlined into the loop over the rows: a decode step's product is one token against thousands of rows of a few
 * groups each (2048 int4 values: 4 groups), and a call of dot_row per row (its frame, its dispatch, its constants)
 * is a large share of a row's time (a timed copy of the kernel on V2-Lite's lm_head, 2 MiB pages, 2 threads: row by
 * row 40-43 GB/s in runs where a plain read of the same memory streamed 59-62 GB/s, so 50-51 GB/s in runs where it
 * streamed 71-75; in the slower state, timed in turn in one process, the two were level at about 35 GB/s) */
static void dot_rows_of(const uint8_t *w, size_t row_step, const void *s, size_t scale_step, int half, int K, int bits,
                        const int8_t *q, const float *d, const float *corr, float *out, size_t out_step, int count,
                        uint8_t flip, int lane) {
#define EACH(L, H, B, F)                                                                                            \
    for (int i = 0; i < count; i++)                                                                                \
        dot_rows(w + (size_t)i * row_step, scale_row(s, H, (size_t)i * scale_step), H, K, B, 1, &q, &d, &corr,        \
                 out + (size_t)i * out_step, 1, F, L);                                                             \
    break;
#define CASES(L, H) \
    case 100 * L + 10 * H + 4: if (flip) { EACH(L, H, 4, flip) } else { EACH(L, H, 4, 0) } \
    case 100 * L + 10 * H + 8: if (flip) { EACH(L, H, 8, flip) } else { EACH(L, H, 8, 0) }
    switch (100 * (lane != 0) + 10 * (half != 0) + bits) {
        CASES(0, 0) CASES(0, 1) CASES(1, 0) CASES(1, 1)
    }
#undef CASES
#undef EACH
}

/* ---- multi-token tiles: R weight rows x N tokens at once --------------------------------------------------------
 * A product over several tokens (a prefill, a batch's decode step, the tokens a routed expert was chosen for) runs
 * in tiles of R weight rows and N tokens: each 64 bytes of a row are loaded (and split into nibbles) once for the N
 * tokens, each 64 bytes of a token's quantized row once for the R rows, and the R x N integer sums of a group stay in
 * registers. Each output gets the very float operations dot_rows gives it (the same scale products, the same
 * multiply-adds in the same order, the same sum of its 16 lanes, the same leftover blocks): the integer sums are
 * exact whatever their order, so a tile's outputs equal dot_rows' (and so today's row-by-row products) bit for bit. */
#if SIMD
/* int4: 64 bytes of weights as their low and high nibbles (unsigned bytes up to 15) */
typedef struct {
    vi lo, hi;
} vn;
#if VNNI
AI vn vn_of(vi packed) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    return (vn){_mm512_and_si512(packed, low), _mm512_and_si512(_mm512_srli_epi16(packed, 4), low)};
}
/* acc + per lane the sum of the 4 low nibbles' products with even and the 4 high nibbles' with odd */
AI vi vn_dot(vi acc, vn w, vi even, vi odd) {
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, w.lo, even), w.hi, odd);
}
typedef vi vw; /* int8: a weight vector as the byte products take it */
AI vw vw_of(vi packed) { return packed; }
AI vi vw_dot(vi acc, vw w, vi s) { return _mm512_dpbusd_epi32(acc, w, s); }
#else
AI vn vn_of(vi packed) {
    return (vn){(vi){low_nibbles(packed.l), low_nibbles(packed.h)}, (vi){high_nibbles(packed.l), high_nibbles(packed.h)}};
}
#if defined(__AVXVNNI__)
AI __m256i nibbles_dot8(__m256i acc, __m256i lo, __m256i hi, __m256i even, __m256i odd) {
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, lo, even), hi, odd);
}
typedef vi vw;
AI vw vw_of(vi packed) { return packed; }
AI vi vw_dot(vi acc, vw w, vi s) { return vi_dot(acc, w, s); }
#else
/* nibble_dot8's sums from nibbles split once per tile row: at most 2 x 15 x 127 twice in 16 bits */
AI __m256i nibbles_dot8(__m256i acc, __m256i lo, __m256i hi, __m256i even, __m256i odd) {
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, even), _mm256_maddubs_epi16(hi, odd));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
typedef vn vw; /* int8 on AVX2: the bytes' nibbles, split once per tile row (dot8's split) */
AI vw vw_of(vi packed) { return vn_of(packed); }
AI __m256i split_dot8(__m256i acc, __m256i lo, __m256i hi, __m256i s) { /* dot8's sums */
    const __m256i low = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, s), _mm256_set1_epi16(1));
    const __m256i high = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, s), _mm256_set1_epi16(16));
    return _mm256_add_epi32(acc, _mm256_add_epi32(low, high));
}
AI vi vw_dot(vi acc, vw w, vi s) { return (vi){split_dot8(acc.l, w.lo.l, w.hi.l, s.l), split_dot8(acc.h, w.lo.h, w.hi.h, s.h)}; }
#endif
AI vi vn_dot(vi acc, vn w, vi even, vi odd) {
    return (vi){nibbles_dot8(acc.l, w.lo.l, w.hi.l, even.l, odd.l), nibbles_dot8(acc.h, w.lo.h, w.hi.h, even.h, odd.h)};
}
#endif

/* weight rows and tokens per tile: 2 x 4 was the fastest on AVX-512 VNNI over V2-Lite's shapes (K 1408, 2048 and
 * 10944, int4 and int8; a timed copy of the kernel, one thread, CPU time, on a busy machine): 4 x 4 spilled its float
 * sums (0.7-0.9x of 2 x 4 at K 2048), 1 x 4 (the row-by-row products' shape) and 2 x 2 were level at K 2048 and
 * slower at K 10944. On AVX2 every shape tried (1, 2 x 2, 4) was within the noise of the others. */
#ifndef TILE_ROWS
#define TILE_ROWS 2
#endif
/* rows up to this many values go row by row (dot_row, 4 tokens a row): there 4 tokens' quantized rows (16 KiB) stay
 * in the L1 cache while each weight row meets them, and the tiles were level with dot_row (K 2048 to 4096: 0.9-1.05x,
 * the same timed copy); over it each row read the tokens from L2 again and the tiles were 1.4-1.5x as fast (K 7168,
 * DeepSeek-V3's hidden size, int4 and int8) */
#ifndef TILE_MIN_K
#define TILE_MIN_K 4096
#endif
#ifndef TILE_TOKENS
#define TILE_TOKENS 4
#endif

/* R rows (row r at w + r * row_step bytes, its scales r * scale_step values from s) x N tokens (quantize_row's q, d,
 * corr): out[t * out_tok + r * out_row] = row_r . x_t, computed as dot_rows computes it */
AI void tile(const uint8_t *w, size_t row_step, const void *s, size_t scale_step, int half, int K, const int bits,
             const int R, const int N, const int8_t *const *q, const float *const *d, const float *const *corr,
             float *out, size_t out_row, size_t out_tok, uint8_t flip, int lane) {
    const int blocks = K / BLOCK;
    const vi flips = vi_bytes(flip);
    const uint8_t *wr[TILE_ROWS];
    const void *sr[TILE_ROWS];
    vf acc[TILE_ROWS][TILE_TOKENS], acc2[TILE_ROWS][TILE_TOKENS], zp[TILE_ROWS][TILE_TOKENS];
    for (int r = 0; r < R; r++) {
        wr[r] = w + (size_t)r * row_step, sr[r] = scale_row(s, half, (size_t)r * scale_step);
        for (int t = 0; t < N; t++) acc[r][t] = acc2[r][t] = zp[r][t] = vf_zero();
    }
    int b = 0;
    for (; lane && b + 16 <= blocks; b += 16) { /* the interleaved layout: lane j is block j in every load */
        vi sum[TILE_ROWS][TILE_TOKENS];
        for (int r = 0; r < R; r++)
            for (int t = 0; t < N; t++) sum[r][t] = vi_zero();
        if (bits == 4) {
            for (int g = 0; g < 4; g++) {
                const int at = 16 * b + 64 * g;
                vn wn[TILE_ROWS];
                for (int r = 0; r < R; r++) wn[r] = vn_of(vi_xor(vi_load(wr[r] + at), flips));
                for (int t = 0; t < N; t++) {
                    const vi even = vi_load(q[t] + at), odd = vi_load(q[t] + K / 2 + at);
                    for (int r = 0; r < R; r++) sum[r][t] = vn_dot(sum[r][t], wn[r], even, odd);
                }
            }
        } else {
            for (int g = 0; g < 8; g++) {
                const int at = BLOCK * b + 64 * g;
                vw ww[TILE_ROWS];
                for (int r = 0; r < R; r++) {
                    _mm_prefetch((const char *)wr[r] + at + INT8_AHEAD, _MM_HINT_T0);
                    ww[r] = vw_of(vi_xor(vi_load(wr[r] + at), flips));
                }
                for (int t = 0; t < N; t++) {
                    const vi x = vi_load(q[t] + at);
                    for (int r = 0; r < R; r++) sum[r][t] = vw_dot(sum[r][t], ww[r], x);
                }
            }
        }
        for (int r = 0; r < R; r++) {
            const vf sw = scales16(sr[r], half, b);
            for (int t = 0; t < N; t++) {
                acc[r][t] = vf_fmadd(vf_float(sum[r][t]), vf_mul(sw, vf_load(d[t] + b)), acc[r][t]);
                zp[r][t] = vf_fmadd(sw, vf_load(corr[t] + b), zp[r][t]);
            }
        }
    }
    for (; b + 16 <= blocks; b += 16) { /* 16 blocks in order: dot_rows' scale product per block pair or quad */
        vf scale[TILE_ROWS][TILE_TOKENS];
        for (int r = 0; r < R; r++) {
            const vf sw = scales16(sr[r], half, b);
            for (int t = 0; t < N; t++) {
                scale[r][t] = vf_mul(sw, vf_load(d[t] + b));
                zp[r][t] = vf_fmadd(sw, vf_load(corr[t] + b), zp[r][t]);
            }
        }
        if (bits == 4) {
            for (int g = 0; g < 4; g++) {
                const int at = 16 * (b + 4 * g);
                vn wn[TILE_ROWS];
                for (int r = 0; r < R; r++) wn[r] = vn_of(vi_xor(vi_load(wr[r] + at), flips));
                for (int t = 0; t < N; t++) {
                    const vi even = vi_load(q[t] + at), odd = vi_load(q[t] + K / 2 + at);
                    for (int r = 0; r < R; r++) {
                        const vi dot = vn_dot(vi_zero(), wn[r], even, odd);
                        if (g & 1)
                            acc2[r][t] = scaled4(acc2[r][t], dot, g, scale[r][t]);
                        else
                            acc[r][t] = scaled4(acc[r][t], dot, g, scale[r][t]);
                    }
                }
            }
        } else {
            for (int g = 0; g < 8; g++) {
                const int at = BLOCK * (b + 2 * g);
                vw ww[TILE_ROWS];
                for (int r = 0; r < R; r++) ww[r] = vw_of(vi_xor(vi_load(wr[r] + at), flips));
                for (int t = 0; t < N; t++) {
                    const vi x = vi_load(q[t] + at);
                    for (int r = 0; r < R; r++) acc[r][t] = scaled2(acc[r][t], vw_dot(vi_zero(), ww[r], x), g, scale[r][t]);
                }
            }
        }
    }
    for (; bits == 4 && b + 4 <= blocks; b += 4) { /* int4: 4 blocks left at a time */
        vf sw[TILE_ROWS];
        vn wn[TILE_ROWS];
        for (int r = 0; r < R; r++)
            sw[r] = scales4(sr[r], half, b), wn[r] = vn_of(vi_xor(vi_load(wr[r] + 16 * b), flips));
        for (int t = 0; t < N; t++) {
            const vi even = vi_load(q[t] + 16 * b), odd = vi_load(q[t] + K / 2 + 16 * b);
            const vf dx = vf_load4(d[t] + b), cx = vf_load4(corr[t] + b);
            for (int r = 0; r < R; r++) {
                acc[r][t] = scaled4(acc[r][t], vn_dot(vi_zero(), wn[r], even, odd), 0, vf_mul(sw[r], dx));
                zp[r][t] = vf_fmadd(sw[r], cx, zp[r][t]);
            }
        }
    }
    for (; bits == 8 && b + 2 <= blocks; b += 2) { /* int8: 2 blocks left at a time */
        vf sw[TILE_ROWS];
        vw ww[TILE_ROWS];
        for (int r = 0; r < R; r++)
            sw[r] = scales2(sr[r], half, b), ww[r] = vw_of(vi_xor(vi_load(wr[r] + BLOCK * b), flips));
        for (int t = 0; t < N; t++) {
            const vi x = vi_load(q[t] + BLOCK * b);
            const vf dx = vf_load2(d[t] + b), cx = vf_load2(corr[t] + b);
            for (int r = 0; r < R; r++) {
                acc[r][t] = scaled2(acc[r][t], vw_dot(vi_zero(), ww[r], x), 0, vf_mul(sw[r], dx));
                zp[r][t] = vf_fmadd(sw[r], cx, zp[r][t]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < N; t++) {
            float total = vf_sum(vf_add(vf_add(acc[r][t], acc2[r][t]), zp[r][t]));
            for (int c = b; c < blocks; c++) { /* the blocks left over, as dot_rows sums them */
                int dot = 0;
                if (bits == 4) {
                    for (int j = 0; j < 16; j++) {
                        const size_t at = lane ? lane_byte(c, j, 16, blocks) : (size_t)16 * c + j;
                        const uint8_t v = wr[r][at] ^ flip;
                        dot += (v & 15) * q[t][at] + (v >> 4) * q[t][K / 2 + at];
                    }
                } else {
                    for (int j = 0; j < BLOCK; j++) {
                        const size_t at = lane ? lane_byte(c, j, BLOCK, blocks) : (size_t)BLOCK * c + j;
                        dot += (uint8_t)(wr[r][at] ^ flip) * q[t][at];
                    }
                }
                total += scale_at(sr[r], half, c) * ((float)dot * d[t][c] + corr[t][c]);
            }
            out[t * out_tok + r * out_row] = total;
        }
}

/* tile with bits, R and N constant in each call, so that its loops unroll into registers */
static void tile_of(const uint8_t *w, size_t row_step, const void *s, size_t scale_step, int half, int K, int bits,
                    int R, int N, const int8_t *const *q, const float *const *d, const float *const *corr, float *out,
                    size_t out_row, size_t out_tok, uint8_t flip, int lane) {
#define CASE(B, R_, N_)                                                                                             \
    case 100 * B + 10 * R_ + N_:                                                                                   \
        tile(w, row_step, s, scale_step, half, K, B, R_, N_, q, d, corr, out, out_row, out_tok, flip, lane);        \
        break;
#if TILE_TOKENS == 4
#define CASES(B, R_) CASE(B, R_, 1) CASE(B, R_, 2) CASE(B, R_, 3) CASE(B, R_, 4)
#elif TILE_TOKENS == 3
#define CASES(B, R_) CASE(B, R_, 1) CASE(B, R_, 2) CASE(B, R_, 3)
#elif TILE_TOKENS == 2
#define CASES(B, R_) CASE(B, R_, 1) CASE(B, R_, 2)
#else
#define CASES(B, R_) CASE(B, R_, 1)
#endif
    switch (100 * bits + 10 * R + N) {
        CASES(4, TILE_ROWS) CASES(8, TILE_ROWS)
#if TILE_ROWS != 1
        CASES(4, 1) CASES(8, 1)
#endif
    }
#undef CASES
#undef CASE
}
#endif

/* `count` weight rows (row i at w + i * row_step bytes, its scales i * scale_step values from s) against n (<= 4)
 * tokens (quantize_row's q, d, corr): out[t * out_tok + i * out_row] = row_i . x_t, in tiles of TILE_ROWS rows; the
 * same outputs as dot_row row by row, bit for bit (portable C: dot_row itself) */
static void tile_rows(const uint8_t *w, size_t row_step, const void *s, size_t scale_step, int half, int K, int bits,
                      int count, int n, const int8_t *const *q, const float *const *d, const float *const *corr,
                      float *out, size_t out_row, size_t out_tok, uint8_t flip, int lane) {
    int i = 0;
#if SIMD
    for (int t = 0; K > TILE_MIN_K && t < n; t += TILE_TOKENS) {
        const int m = n - t < TILE_TOKENS ? n - t : TILE_TOKENS;
        for (i = 0; i + TILE_ROWS <= count; i += TILE_ROWS)
            tile_of(w + (size_t)i * row_step, row_step, scale_row(s, half, (size_t)i * scale_step), scale_step, half, K,
                    bits, TILE_ROWS, m, q + t, d + t, corr + t, out + (size_t)i * out_row + t * out_tok, out_row,
                    out_tok, flip, lane);
        for (; i < count; i++)
            tile_of(w + (size_t)i * row_step, row_step, scale_row(s, half, (size_t)i * scale_step), scale_step, half, K,
                    bits, 1, m, q + t, d + t, corr + t, out + (size_t)i * out_row + t * out_tok, out_row, out_tok, flip,
                    lane);
    }
    if (K > TILE_MIN_K) i = count;
#endif
    for (; i < count; i++)
        dot_row(w + (size_t)i * row_step, scale_row(s, half, (size_t)i * scale_step), half, K, bits, n, q, d, corr,
                out + (size_t)i * out_row, out_tok, flip, lane);
}

#if SIMD
/* the sums of 4 vectors' lanes: [sum a, sum b, sum c, sum d] */
AI __m128 sums4(vf a, vf b, vf c, vf d) {
#define HALVES(v) _mm256_add_ps(vf_low(v), vf_high(v))
    const __m256 ab = _mm256_hadd_ps(HALVES(a), HALVES(b)), cd = _mm256_hadd_ps(HALVES(c), HALVES(d));
#undef HALVES
    const __m256 all = _mm256_hadd_ps(ab, cd); /* [a, b, c, d] per 128-bit half */
    return _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1));
}

/* dot_rows for one token and 4 weight rows at once (w[i], s[i]: row i's weights and scales): out[i] = row_i . x, the
 * same products and partial sums as dot_rows per row, the 16 lanes summed in another order; the 4 rows' chains
 * interleave and their lanes are summed together (a decode step's product is one token against thousands of rows:
 * per row a quarter of a reduction and of a call, and 4 independent chains). Only where dot4_fits: every block in
 * the vector groups (int4: blocks of 4; int8: blocks of 16). */
AI void dot4(const uint8_t *const *w, const void *const *s, int half, int K, int bits, const int8_t *q, const float *d,
             const float *corr, float *out, uint8_t flip) {
    const int blocks = K / BLOCK;
    const vi flips = vi_bytes(flip);
    vf acc[4], acc2[4], zp[4];
    for (int r = 0; r < 4; r++) acc[r] = acc2[r] = zp[r] = vf_zero();
    int b = 0;
    for (; b + 16 <= blocks; b += 16) {
        const vf dx = vf_load(d + b), cx = vf_load(corr + b);
        vf scale[4];
        for (int r = 0; r < 4; r++) {
            const vf sw = scales16(s[r], half, b);
            scale[r] = vf_mul(sw, dx);
            zp[r] = vf_fmadd(sw, cx, zp[r]);
        }
        if (bits == 4) {
            for (int g = 0; g < 4; g++) {
                const int at = 16 * (b + 4 * g);
                const vi even_x = vi_load(q + at), odd_x = vi_load(q + K / 2 + at);
                for (int r = 0; r < 4; r++) {
                    const vi dot = vi_nibble_dot(vi_xor(vi_load(w[r] + at), flips), even_x, odd_x);
                    if (g & 1)
                        acc2[r] = scaled4(acc2[r], dot, g, scale[r]);
                    else
                        acc[r] = scaled4(acc[r], dot, g, scale[r]);
                }
            }
        } else {
            for (int g = 0; g < 8; g++) {
                const int at = BLOCK * (b + 2 * g);
                const vi x = vi_load(q + at);
                for (int r = 0; r < 4; r++) {
                    const vi packed = vi_xor(vi_load(w[r] + at), flips);
                    acc[r] = scaled2(acc[r], vi_dot(vi_zero(), packed, x), g, scale[r]);
                }
            }
        }
    }
    for (; bits == 4 && b + 4 <= blocks; b += 4) {
        const vf dx = vf_load4(d + b), cx = vf_load4(corr + b);
        const vi even_x = vi_load(q + 16 * b), odd_x = vi_load(q + K / 2 + 16 * b);
        for (int r = 0; r < 4; r++) {
            const vf sw = scales4(s[r], half, b);
            const vi dot = vi_nibble_dot(vi_xor(vi_load(w[r] + 16 * b), flips), even_x, odd_x);
            acc[r] = scaled4(acc[r], dot, 0, vf_mul(sw, dx));
            zp[r] = vf_fmadd(sw, cx, zp[r]);
        }
    }
    for (int r = 0; r < 4; r++) acc[r] = vf_add(vf_add(acc[r], acc2[r]), zp[r]);
    _mm_storeu_ps(out, sums4(acc[0], acc[1], acc[2], acc[3]));
}
#endif

/* the longest rows dot_row4 takes: longer ones (a layer's projections, K 2048) ran slower 4 at a time than one by
 * one (a full-size V2-Lite int4 decode step's BlockwiseMatMul nodes: 20 -> 36 ms), shorter ones faster (the
 * absorbed attention's W_UK, K 128, and W_UV, K 512) */
#define DOT4_MAX_K 512

/* whether dot_row4 takes rows of K values of `bits` */
static inline int dot4_fits(int K, int bits) {
    return SIMD && K <= DOT4_MAX_K && K % BLOCK == 0 && (bits == 4 ? (K / BLOCK) % 4 == 0 : (K / BLOCK) % 16 == 0);
}

/* dot4 with the bits and the scales' type constant in each call */
static void dot_row4(const uint8_t *const *w, const void *const *s, int half, int K, int bits, const int8_t *q,
                     const float *d, const float *corr, float *out, uint8_t flip) {
#if SIMD
    switch (10 * (half != 0) + bits) {
    case 4: dot4(w, s, 0, K, 4, q, d, corr, out, flip); break;
    case 8: dot4(w, s, 0, K, 8, q, d, corr, out, flip); break;
    case 14: dot4(w, s, 1, K, 4, q, d, corr, out, flip); break;
    case 18: dot4(w, s, 1, K, 8, q, d, corr, out, flip); break;
    }
#else
    (void)w, (void)s, (void)half, (void)K, (void)bits, (void)q, (void)d, (void)corr, (void)out, (void)flip;
#endif
}

/* ---- the operator -------------------------------------------------------------------------------------------- */

typedef struct {
    union { /* the attributes, in the order new_kernel reads them */
        int64_t attributes[4];
        struct {
            int64_t k, bits, block, normalize;
        };
    };
    int advised;     /* the weights were advised onto huge pages (advise_huge) */
    int interleaved; /* the weights are in the interleaved layout (lane_byte): the optional attribute, 0 or 1 */
} Kernel;

/* Ask for the weights the kernel streams to be read into 2 MiB pages, once, before their first read. The engine's
   weights are the pages of its .data file, which ONNX Runtime maps; Linux fills a file mapping with 2 MiB page-cache
   folios, mapped by one page-table entry each, only where the mapping asks for them (MADV_HUGEPAGE) when the file is
   not cached yet, and with 4 KiB pages otherwise. A hint: where it cannot be followed nothing changes. */
static void advise_huge(int *advised, const void *const *weights, const size_t *bytes, int n) {
    if (__atomic_exchange_n(advised, 1, __ATOMIC_RELAXED)) return;
#ifdef MADV_HUGEPAGE
    for (int i = 0; i < n; i++) {
        const uintptr_t page = 4096, first = (uintptr_t)weights[i] & ~(page - 1);
        const uintptr_t end = ((uintptr_t)weights[i] + bytes[i] + page - 1) & ~(page - 1);
        (void)madvise((void *)first, end - first, MADV_HUGEPAGE);
    }
#endif
}

/* the shared experts of a layer, where the node is given them (inputs 7 to 12): one SwiGLU MLP of intermediate size
 * I every token runs, its output added with weight 1. Its weights are three MatMulNBits products' as they are: gate
 * and up [I, D/32, 32*bits/8] (row i of each: intermediate unit i), down [D, I/32, 32*bits/8], each with its N*K/32
 * scales in row order */
typedef struct {
    int I; /* 0: no shared experts */
    const uint8_t *gate, *up, *down;
    const void *gs, *us, *ds;
    Rows a;   /* [T, I]: silu(gate) * up quantized */
    float *o; /* [T, D]: down's rows */
} Shared;

/* one layer's call: routing, then work items over (expert, tile of weight rows), the shared experts' after */
typedef struct {
    int T, D, I, bits, half; /* half: the scales are float16 */
    const uint8_t *fc1, *fc2;
    const void *s1, *s2;
    size_t fc1_row, fc2_row; /* bytes per weight row */
    int *count, *start;      /* per expert: how many (token, choice) pairs and where its pairs begin */
    int *pair_token;         /* the pairs ordered by expert: their token */
    int *experts_used;       /* the experts with pairs */
    Rows x;                  /* [T, D]: the tokens quantized */
    Rows a;                  /* [pairs, I]: silu(gate) * up quantized */
    float *o;                /* [pairs, D]: fc2's rows */
    int tiles2;              /* fc2 tiles per expert */
    int items1, items2;      /* the routed experts' work items of each stage (the shared experts' follow) */
    Shared shared;
} Work;

/* one activation block of a SwiGLU MLP for n rows of operands (the tokens first .. first + n - 1, or, where token_of,
 * the pairs first .. whose token it gives): its 32 gate rows (row i at gate + i * step bytes, its scales i * scale_step
 * values from gs) and 32 up rows (the same from up, us), read one gate and one up row at a time; then silu(gate) * up
 * of that block quantized into each operand's row of act (block `block` of act->K) */
static void swiglu_block(const Work *w, const uint8_t *gate, const uint8_t *up, size_t step, const void *gs,
                         const void *us, size_t scale_step, int block, const int *token_of, int first, int n,
                         const Rows *act) {
    const int D = w->D, K = act->K, blocks = K / BLOCK;
    float h[4][2 * BLOCK], a[BLOCK];
    for (int p = 0; p < n; p += 4) {
        const int m = n - p < 4 ? n - p : 4;
        const int8_t *q[4];
        const float *d[4], *c[4];
        for (int j = 0; j < m; j++)
            row_of(&w->x, (size_t)(token_of ? token_of[first + p + j] : first + p + j), &q[j], &d[j], &c[j]);
        if (m == 1 && up == gate + step / 2 && us == scale_row(gs, w->half, scale_step / 2)) /* gate, up, gate, ... */
            dot_rows_of(gate, step / 2, gs, scale_step / 2, w->half, D, w->bits, q[0], d[0], c[0], h[0], 1, 2 * BLOCK, 0,
                        w->x.lane);
        else if (m == 1) { /* the 32 gate rows, then the 32 up rows */
            dot_rows_of(gate, step, gs, scale_step, w->half, D, w->bits, q[0], d[0], c[0], h[0], 2, BLOCK, 0, w->x.lane);
            dot_rows_of(up, step, us, scale_step, w->half, D, w->bits, q[0], d[0], c[0], h[0] + 1, 2, BLOCK, 0,
                        w->x.lane);
        } else if (up == gate + step / 2 && us == scale_row(gs, w->half, scale_step / 2)) /* gate, up, gate, ... */
            tile_rows(gate, step / 2, gs, scale_step / 2, w->half, D, w->bits, 2 * BLOCK, m, q, d, c, h[0], 1,
                      2 * BLOCK, 0, w->x.lane);
        else { /* the 32 gate rows, then the 32 up rows, in tiles of rows x these tokens */
            tile_rows(gate, step, gs, scale_step, w->half, D, w->bits, BLOCK, m, q, d, c, h[0], 2, 2 * BLOCK, 0,
                      w->x.lane);
            tile_rows(up, step, us, scale_step, w->half, D, w->bits, BLOCK, m, q, d, c, h[0] + 1, 2, 2 * BLOCK, 0,
                      w->x.lane);
        }
        for (int j = 0; j < m; j++) {
            const size_t row = (size_t)(first + p + j);
            for (int i = 0; i < BLOCK; i++) {
                const float g = h[j][2 * i], u = h[j][2 * i + 1];
                a[i] = g / (1.f + expf(-g)) * u;
            }
            quantize_block(a, K, block, w->bits, act->lane, act->q + row * K, act->d + row * blocks,
                           act->c + row * blocks);
        }
    }
}

/* rows r0 .. r1 - 1 of a down projection (weights: D rows of act->K values, scales in row order) for the operands
 * first .. first + n - 1 of act, into o's rows first .. (D wide) */
static void down_rows(const Work *w, const uint8_t *weights, const void *scales, int r0, int r1, const Rows *act,
                      int first, int n, float *o) {
    const int D = w->D, K = act->K;
    const size_t row_bytes = (size_t)K * w->bits / 8;
    for (int p = 0; p < n; p += 4) {
        const int m = n - p < 4 ? n - p : 4;
        const int8_t *q[4];
        const float *d[4], *c[4];
        for (int j = 0; j < m; j++) row_of(act, (size_t)(first + p + j), &q[j], &d[j], &c[j]);
        if (m == 1) {
            dot_rows_of(weights + (size_t)r0 * row_bytes, row_bytes, scale_row(scales, w->half, (size_t)r0 * (K / BLOCK)),
                        (size_t)(K / BLOCK), w->half, K, w->bits, q[0], d[0], c[0], o + (size_t)(first + p) * D + r0, 1,
                        r1 - r0, 0, act->lane);
            continue;
        }
        tile_rows(weights + (size_t)r0 * row_bytes, row_bytes, scale_row(scales, w->half, (size_t)r0 * (K / BLOCK)),
                  (size_t)(K / BLOCK), w->half, K, w->bits, r1 - r0, m, q, d, c, o + (size_t)(first + p) * D + r0, 1,
                  (size_t)D, 0, act->lane);
    }
}

/* stage 1, one item: a routed expert's 64 fc1 rows of one activation block (32 gate and 32 up rows, interleaved) for
 * all its pairs, or one block of the shared experts' gate and up rows for all tokens */
static void run_fc1(void *data, size_t item) {
    Work *w = (Work *)data;
    if ((int)item >= w->items1) {
        const Shared *s = &w->shared;
        const int block = (int)item - w->items1, D = w->D;
        const size_t first = (size_t)block * BLOCK;
        swiglu_block(w, s->gate + first * w->fc1_row, s->up + first * w->fc1_row, w->fc1_row,
                     scale_row(s->gs, w->half, first * (D / BLOCK)), scale_row(s->us, w->half, first * (D / BLOCK)),
                     D / BLOCK, block, NULL, 0, w->T, &s->a);
        return;
    }
    const int blocks = w->I / BLOCK, e = w->experts_used[item / blocks], block = (int)(item % blocks);
    const int D = w->D, rows = 2 * w->I;
    const size_t row = (size_t)e * rows + (size_t)block * 2 * BLOCK; /* the block's first (gate) row */
    swiglu_block(w, w->fc1 + row * w->fc1_row, w->fc1 + (row + 1) * w->fc1_row, 2 * w->fc1_row,
                 scale_row(w->s1, w->half, row * (D / BLOCK)), scale_row(w->s1, w->half, (row + 1) * (D / BLOCK)),
                 2 * (size_t)(D / BLOCK), block, w->pair_token, w->start[e], w->count[e], &w->a);
}

/* stage 2, one item: a routed expert's TILE fc2 rows for all its pairs, or the shared experts' for all tokens */
static void run_fc2(void *data, size_t item) {
    Work *w = (Work *)data;
    const int D = w->D, shared = (int)item >= w->items2;
    const int tile = shared ? (int)item - w->items2 : (int)(item % w->tiles2);
    const int r0 = tile * TILE, r1 = r0 + TILE < D ? r0 + TILE : D;
    if (shared) {
        down_rows(w, w->shared.down, w->shared.ds, r0, r1, &w->shared.a, 0, w->T, w->shared.o);
        return;
    }
    const int e = w->experts_used[item / w->tiles2];
    down_rows(w, w->fc2 + (size_t)e * D * w->fc2_row, scale_row(w->s2, w->half, (size_t)e * D * (w->I / BLOCK)), r0,
              r1, &w->a, w->start[e], w->count[e], w->o);
}

/* fn(data, i) for i in [0, n): on this thread where `work` (about the multiply-adds or values of the whole) is below
 * INLINE_WORK, where handing it to the intra-op pool costs more than it saves; over the pool otherwise */
#define INLINE_WORK (1 << 18)
static OrtStatus *parallel(OrtKernelContext *ctx, void (*fn)(void *, size_t), size_t n, void *data, size_t work) {
    if (n <= 1 || work < INLINE_WORK) {
        for (size_t i = 0; i < n; i++) fn(data, i);
        return NULL;
    }
    return CALL(KernelContext_ParallelFor)(ctx, fn, n, 0, data);
}

/* quantize rows->x's M rows: on this thread for a few (decode), over the intra-op pool for more */
static OrtStatus *quantize_rows(OrtKernelContext *ctx, Rows *rows, size_t M) {
    return parallel(ctx, run_quantize, M, rows, M * (size_t)rows->K * 4);
}

/* value's element type (into *type) and, when it has `rank` dimensions, its dimensions; refused (`what`) otherwise */
static OrtStatus *typed_shape(const OrtValue *value, size_t rank, int64_t *dims, int *type, const char *what) {
    OrtShapeInfo *info;
    CHECK(CALL(GetTensorTypeAndShape)(value, &info));
    size_t got = 0;
    OrtStatus *status = CALL(GetDimensionsCount)(info, &got);
    if (!status) status = CALL(GetTensorElementType)(info, type);
    if (!status && got == rank) status = CALL(GetDimensions)(info, dims, rank);
    CALL(ReleaseTensorTypeAndShapeInfo)(info);
    if (status) return status;
    return got != rank ? fail(what) : NULL;
}

static OrtStatus *shape_of(const OrtValue *value, int want_type, size_t rank, int64_t *dims, const char *what) {
    int type = 0;
    CHECK(typed_shape(value, rank, dims, &type, what));
    return type != want_type ? fail(what) : NULL;
}

/* block scales of `rank` dimensions, float or float16 (*half set for float16) */
static OrtStatus *scales_of(const OrtValue *value, size_t rank, int64_t *dims, int *half, const char *what) {
    int type = 0;
    CHECK(typed_shape(value, rank, dims, &type, what));
    *half = type == TYPE_FLOAT16;
    return type != TYPE_FLOAT && type != TYPE_FLOAT16 ? fail(what) : NULL;
}

/* the (token, choice) pairs of chosen [T * k] grouped by expert: per expert its pairs' count and first pair, the
 * experts with pairs (used; returns how many), each pair's token and each choice's pair */
static int group_pairs(const int *chosen, size_t pairs, int k, int E, int *count, int *start, int *used,
                       int *pair_token, int *pair_of) {
    memset(count, 0, E * sizeof(int));
    for (size_t i = 0; i < pairs; i++) count[chosen[i]]++;
    int n_used = 0;
    for (int e = 0, offset = 0; e < E; e++) {
        start[e] = offset;
        offset += count[e];
        if (count[e]) used[n_used++] = e;
        count[e] = 0;
    }
    for (size_t i = 0; i < pairs; i++) {
        const int e = chosen[i], pair = start[e] + count[e]++;
        pair_token[pair] = (int)(i / k);
        pair_of[i] = pair;
    }
    return n_used;
}

/* y [T, D] = for each token, the sum over its k choices of the choice's weight times its pair's row of o [pairs, D],
 * plus its row of shared [T, D] where given (the shared experts') */
static void combine(float *y, int T, int D, int k, const float *weight, const int *pair_of, const float *o,
                    const float *shared) {
    for (int t = 0; t < T; t++) {
        float *out = y + (size_t)t * D;
        if (shared)
            memcpy(out, shared + (size_t)t * D, D * sizeof(float));
        else
            memset(out, 0, D * sizeof(float));
        for (int j = 0; j < k; j++) {
            const float wj = weight[(size_t)t * k + j];
            const float *row = o + (size_t)pair_of[(size_t)t * k + j] * D;
            for (int i = 0; i < D; i++) out[i] += wj * row[i];
        }
    }
}

static OrtStatus *shared_of(const OrtValue *const *in, int D, int bits, int half, Shared *s) {
    s->I = 0;
    int given = 0;
    for (int i = 0; i < 6; i++) given += in[i] != NULL;
    if (!given) return NULL;
    if (given != 6) return fail("RoutedExperts: the shared experts take all of inputs 7 to 12 or none");
    int64_t g[3], u[3], dn[3];
    const char *layout = "RoutedExperts: shared gate and up weights must be uint8 [I, D/32, 32*bits/8], down [D, I/32, "
                         "32*bits/8], each with N*K/32 float or float16 scales of the routed experts' type";
    CHECK(shape_of(in[0], TYPE_UINT8, 3, g, layout));
    CHECK(shape_of(in[2], TYPE_UINT8, 3, u, layout));
    CHECK(shape_of(in[4], TYPE_UINT8, 3, dn, layout));
    const int64_t I = g[0], row = BLOCK * bits / 8;
    if (I < BLOCK || I % BLOCK || g[1] != D / BLOCK || g[2] != row || u[0] != I || u[1] != g[1] || u[2] != row ||
        dn[0] != D || dn[1] != I / BLOCK || dn[2] != row)
        return fail(layout);
    for (int i = 1; i < 6; i += 2) {
        OrtShapeInfo *info;
        size_t count = 0;
        int type = 0;
        CHECK(CALL(GetTensorTypeAndShape)(in[i], &info));
        OrtStatus *status = CALL(GetTensorShapeElementCount)(info, &count);
        if (!status) status = CALL(GetTensorElementType)(info, &type);
        CALL(ReleaseTensorTypeAndShapeInfo)(info);
        if (status) return status;
        if (count != (size_t)I * (D / BLOCK) || type != (half ? TYPE_FLOAT16 : TYPE_FLOAT)) return fail(layout);
    }
    void *ptr[6];
    for (int i = 0; i < 6; i++) CHECK(CALL(GetTensorMutableData)((OrtValue *)in[i], &ptr[i]));
    s->I = (int)I;
    s->gate = ptr[0], s->gs = ptr[1], s->up = ptr[2], s->us = ptr[3], s->down = ptr[4], s->ds = ptr[5];
    return NULL;
}

static OrtStatus *compute(void *kernel_data, OrtKernelContext *ctx) {
    const Kernel *kernel = (const Kernel *)kernel_data;
    const int given = kernel->normalize == 0; /* the routing comes chosen: weights [T, k] and experts [T, k] */
    const OrtValue *in[INPUTS];
    for (size_t i = 0; i < INPUTS; i++) CHECK(CALL(KernelContext_GetInput)(ctx, i, &in[i]));
    int64_t xs[2], rs[2], w1[3], s1[3], w2[3], s2[3], cs[2];
    for (int i = 0; i < 6; i++)
        if (!in[i]) return fail("RoutedExperts: inputs 0 to 5 are required");
    if (given != (in[6] != NULL))
        return fail("RoutedExperts: the chosen experts (input 6) go with normalize_routing_weights 0, only there");
    CHECK(shape_of(in[0], TYPE_FLOAT, 2, xs, "RoutedExperts: input must be float [T, D]"));
    CHECK(shape_of(in[1], TYPE_FLOAT, 2, rs, given ? "RoutedExperts: the routing weights must be float [T, k]"
                                                   : "RoutedExperts: router_probs must be float [T, E]"));
    if (given) CHECK(shape_of(in[6], TYPE_INT64, 2, cs, "RoutedExperts: the chosen experts must be int64 [T, k]"));
    CHECK(shape_of(in[2], TYPE_UINT8, 3, w1, "RoutedExperts: fc1 weights must be uint8 [E, 2I, D*bits/8]"));
    int half1 = 0, half2 = 0;
    CHECK(scales_of(in[3], 3, s1, &half1, "RoutedExperts: fc1 scales must be float or float16 [E, 2I, D/32]"));
    CHECK(shape_of(in[4], TYPE_UINT8, 3, w2, "RoutedExperts: fc2 weights must be uint8 [E, D, I*bits/8]"));
    CHECK(scales_of(in[5], 3, s2, &half2, "RoutedExperts: fc2 scales must be float or float16 [E, D, I/32]"));
    if (half1 != half2) return fail("RoutedExperts: fc1 and fc2 scales must be of one type");
    const int T = (int)xs[0], D = (int)xs[1], E = (int)w1[0], I = (int)(w1[1] / 2), bits = (int)kernel->bits;
    const int k = (int)kernel->k;
    if (given && (rs[1] != k || cs[0] != T || cs[1] != k))
        return fail("RoutedExperts: the routing weights and the chosen experts must both be [T, k]");
    if (rs[0] != T || (!given && rs[1] != E) || w1[1] != 2 * I || w1[2] != (int64_t)D * bits / 8 || s1[0] != E ||
        s1[1] != 2 * I || s1[2] != D / BLOCK || w2[0] != E || w2[1] != D || w2[2] != (int64_t)I * bits / 8 ||
        s2[0] != E || s2[1] != D || s2[2] != I / BLOCK || D % BLOCK || I % BLOCK || k < 1 || k > E)
        return fail("RoutedExperts: the input shapes do not agree (see cpu_ops.c)");
    Shared shared;
    CHECK(shared_of(in + 7, D, bits, half1, &shared));
    const int Is = shared.I;
    OrtValue *output;
    CHECK(CALL(KernelContext_GetOutput)(ctx, 0, xs, 2, &output));
    void *ptr[7];
    for (int i = 0; i < 6; i++) CHECK(CALL(GetTensorMutableData)((OrtValue *)in[i], &ptr[i]));
    CHECK(CALL(GetTensorMutableData)(output, &ptr[6]));
    float *y = (float *)ptr[6];
    const size_t scale = scale_bytes(half1), shared_rows = (size_t)Is * D * bits / 8, shared_scales = (size_t)Is * (D / BLOCK) * scale;
    const void *weights[10] = {ptr[2], ptr[3], ptr[4], ptr[5], shared.gate, shared.gs, shared.up, shared.us, shared.down, shared.ds};
    const size_t weight_bytes[10] = {(size_t)E * 2 * I * D * bits / 8, (size_t)E * 2 * I * (D / BLOCK) * scale,
                                     (size_t)E * D * I * bits / 8, (size_t)E * D * (I / BLOCK) * scale,
                                     shared_rows, shared_scales, shared_rows, shared_scales, shared_rows, shared_scales};
    advise_huge(&((Kernel *)kernel_data)->advised, weights, weight_bytes, Is ? 10 : 4);
    if (T == 0) return NULL;
    const float *x = (const float *)ptr[0], *router = (const float *)ptr[1];
    const int64_t *picked = NULL;
    if (given) {
        void *p;
        CHECK(CALL(GetTensorMutableData)((OrtValue *)in[6], &p));
        picked = (const int64_t *)p;
        for (size_t i = 0; i < (size_t)T * k; i++)
            if (picked[i] < 0 || picked[i] >= E) return fail("RoutedExperts: a chosen expert lies outside [0, E)");
    }

    /* routing: each token's top k, its weights, and the pairs grouped by expert; every buffer in one allocation */
    const size_t pairs = (size_t)T * k;
    const size_t bytes = aligned(pairs * sizeof(int)) * 3 + aligned(E * sizeof(int)) * 3 +
                         aligned(pairs * sizeof(float)) + aligned((size_t)T * D) +
                         2 * aligned((size_t)T * (D / BLOCK) * sizeof(float)) + aligned(pairs * I) +
                         2 * aligned(pairs * (I / BLOCK) * sizeof(float)) + aligned(pairs * D * sizeof(float)) +
                         aligned((size_t)T * Is) + 2 * aligned((size_t)T * (Is / BLOCK) * sizeof(float)) +
                         aligned((size_t)(Is ? T : 0) * D * sizeof(float));
    Scratch scratch = {malloc(bytes), NULL};
    if (!scratch.base) return CALL(CreateStatus)(ORT_FAIL, "RoutedExperts: out of memory");
    scratch.at = scratch.base;
    int *chosen = take(&scratch, pairs * sizeof(int)), *pair_token = take(&scratch, pairs * sizeof(int));
    int *pair_of = take(&scratch, pairs * sizeof(int)), *count = take(&scratch, E * sizeof(int));
    int *start = take(&scratch, E * sizeof(int)), *used = take(&scratch, E * sizeof(int));
    float *weight = take(&scratch, pairs * sizeof(float));
    for (size_t at = 0; given && at < pairs; at++) chosen[at] = (int)picked[at], weight[at] = router[at];
    for (int t = 0; !given && t < T; t++) {
        const float *r = router + (size_t)t * E;
        int *c = chosen + (size_t)t * k;
        for (int j = 0; j < k; j++) { /* selection: k is small */
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++) taken |= c[i] == e;
                if (!taken && (best < 0 || r[e] > r[best])) best = e;
            }
            c[j] = best;
        }
        const float top = r[c[0]];
        float sum = 0.f;
        for (int j = 0; j < k; j++) sum += expf(r[c[j]] - top);
        for (int j = 0; j < k; j++) weight[(size_t)t * k + j] = expf(r[c[j]] - top) / sum;
    }
    const int n_used = group_pairs(chosen, pairs, k, E, count, start, used, pair_token, pair_of);

    Work w = {T, D, I, bits, half1, (const uint8_t *)ptr[2], (const uint8_t *)ptr[4], ptr[3], ptr[5],
              (size_t)D * bits / 8, (size_t)I * bits / 8, count, start, pair_token, used,
              {x, D, bits, NULL, NULL, NULL, kernel->interleaved}, {NULL, I, bits, NULL, NULL, NULL, kernel->interleaved},
              NULL, (D + TILE - 1) / TILE, n_used * (I / BLOCK), 0, shared};
    w.items2 = n_used * w.tiles2;
    w.x.q = take(&scratch, (size_t)T * D), w.x.d = take(&scratch, (size_t)T * (D / BLOCK) * sizeof(float));
    w.x.c = take(&scratch, (size_t)T * (D / BLOCK) * sizeof(float)), w.a.q = take(&scratch, pairs * I);
    w.a.d = take(&scratch, pairs * (I / BLOCK) * sizeof(float));
    w.a.c = take(&scratch, pairs * (I / BLOCK) * sizeof(float)), w.o = take(&scratch, pairs * D * sizeof(float));
    w.shared.a = (Rows){NULL, Is, bits, take(&scratch, (size_t)T * Is), NULL, NULL, kernel->interleaved};
    w.shared.a.d = take(&scratch, (size_t)T * (Is / BLOCK) * sizeof(float));
    w.shared.a.c = take(&scratch, (size_t)T * (Is / BLOCK) * sizeof(float));
    w.shared.o = take(&scratch, (size_t)(Is ? T : 0) * D * sizeof(float));
    const size_t items1 = (size_t)w.items1 + (Is ? (size_t)Is / BLOCK : 0), items2 = (size_t)w.items2 + (Is ? w.tiles2 : 0);
    OrtStatus *status = quantize_rows(ctx, &w.x, (size_t)T);
    if (!status) status = CALL(KernelContext_ParallelFor)(ctx, run_fc1, items1, 0, &w);
    if (!status) status = CALL(KernelContext_ParallelFor)(ctx, run_fc2, items2, 0, &w);
    if (!status) combine(y, T, D, k, weight, pair_of, w.o, Is ? w.shared.o : NULL);
    free(scratch.base);
    return status;
}

/* A kernel of `size` bytes that begins with its four integer attributes `names` (read, then checked by `valid`, before
   anything is allocated): Kernel and LinearKernel. */
static OrtStatus *new_kernel(const OrtKernelInfo *info, const char *const names[4], int (*valid)(const int64_t *),
                             const char *refusal, size_t size, void **out) {
    int64_t a[4];
    for (int i = 0; i < 4; i++) CHECK(CALL(KernelInfoGetAttribute_int64)(info, names[i], &a[i]));
    if (!valid(a)) return fail(refusal);
    int64_t *kernel = calloc(1, size);
    if (!kernel) return CALL(CreateStatus)(ORT_FAIL, "mla_deploy operator: out of memory");
    memcpy(kernel, a, sizeof a);
    *out = kernel;
    return NULL;
}

/* the optional attribute `interleaved` of a node whose weights the build may store in the interleaved layout
 * (lane_byte): 0 where absent */
static OrtStatus *interleaved_of(const OrtKernelInfo *info, const char *refusal, int *out) {
    int64_t value = 0;
    OrtStatus *absent = CALL(KernelInfoGetAttribute_int64)(info, "interleaved", &value);
    if (absent) CALL(ReleaseStatus)(absent), value = 0;
    if (value != 0 && value != 1) return fail(refusal);
    *out = (int)value;
    return NULL;
}

static int experts_valid(const int64_t *a) { /* k, bits, block, normalize */
    return (a[1] == 4 || a[1] == 8) && a[2] == BLOCK && a[0] >= 1 && (a[3] == 0 || a[3] == 1);
}

static OrtStatus *create_kernel(const OrtCustomOp *op, const void *ort_api, const OrtKernelInfo *info, void **out) {
    (void)op, (void)ort_api;
    const char *names[4] = {"k", "expert_weight_bits", "block_size", "normalize_routing_weights"};
    int interleaved = 0; /* 0: the weights as QMoE holds them */
    CHECK(interleaved_of(info, "RoutedExperts: interleaved must be 0 or 1", &interleaved));
    CHECK(new_kernel(info, names, experts_valid, "RoutedExperts: expert_weight_bits must be 4 or 8, block_size 32, "
                     "k >= 1, normalize_routing_weights 0 or 1", sizeof(Kernel), out));
    ((Kernel *)*out)->interleaved = interleaved;
    return NULL;
}

static void destroy_kernel(void *kernel) { free(kernel); }
static const char *op_name(const OrtCustomOp *op) { (void)op; return "RoutedExperts"; }
static const char *op_provider(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static int input_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 2 || i == 4 || i == 7 || i == 9 || i == 11 ? TYPE_UINT8
           : i == 6                                         ? TYPE_INT64
           : i == 3 || i == 5 || i >= 8                     ? TYPE_UNDEFINED /* scales: float or float16 */
                                                            : TYPE_FLOAT;
}
static size_t input_count(const OrtCustomOp *op) { (void)op; return INPUTS; }
static int optional_last(const OrtCustomOp *op, size_t i) { (void)op; return i >= 6; } /* 1: INPUT_OUTPUT_OPTIONAL */
static int output_type(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return TYPE_FLOAT; }
static size_t output_count(const OrtCustomOp *op) { (void)op; return 1; }
static int required(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return 0; }
static int default_memory(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return 0; }
static int one(const OrtCustomOp *op) { (void)op; return 1; }

/* an operator's table at version 16 (CreateKernelV2, KernelComputeV2: errors come back as statuses); OP_TABLE's
 * kernels are freed with free(), OP_TABLE_FREED's with `destroy` */
#define OP_TABLE_FREED(name, input_type, input_count, create, compute, inputs, destroy)                               \
    {                                                                                                              \
        .version = 16, .GetName = name, .GetExecutionProviderType = op_provider, .GetInputType = input_type,      \
        .GetInputTypeCount = input_count, .GetOutputType = output_type, .GetOutputTypeCount = output_count,       \
        .KernelDestroy = destroy, .GetInputCharacteristic = inputs, .GetOutputCharacteristic = required,           \
        .GetInputMemoryType = default_memory, .GetVariadicInputMinArity = one, .GetVariadicInputHomogeneity = one, \
        .GetVariadicOutputMinArity = one, .GetVariadicOutputHomogeneity = one, .CreateKernelV2 = create,          \
        .KernelComputeV2 = compute,                                                                                \
    }
#define OP_TABLE(name, input_type, input_count, create, compute, inputs)                                               \
    OP_TABLE_FREED(name, input_type, input_count, create, compute, inputs, destroy_kernel)

static OrtCustomOp routed_experts = OP_TABLE(op_name, input_type, input_count, create_kernel, compute, optional_last);

/* ---- mla_deploy.BlockwiseMatMul: MatMulNBits's product, computed the same way ---------------------------------
 * Inputs: 0 A float [..., K]; 1 B uint8 [N, K/32, 32*bits/8] (MatMulNBits's layout: zero point 2^(bits-1), int4
 * low nibble first); 2 scales float or float16, N * K/32 values ([N, K/32] in order). Output: float [..., N] =
 * A . W^T, each row of A quantized to int8 per block of 32 (as MatMulNBits at accuracy_level 4). Attributes: K, N, bits (4, 8),
 * block_size (32). */

typedef struct {
    union { /* the attributes, in the order new_kernel reads them */
        int64_t attributes[4];
        struct {
            int64_t K, N, bits, block;
        };
    };
    int advised;     /* advise_huge */
    int interleaved; /* BlockwiseMatMul: B in the interleaved layout (lane_byte), the optional attribute */
} LinearKernel;
_Static_assert(offsetof(Kernel, attributes) == 0 && offsetof(LinearKernel, attributes) == 0,
               "new_kernel writes the attributes at the start of each kernel");

/* one call of BlockwiseMatMul (heads 1) or HeadwiseMatMul: work items over (head, tile of weight rows) */
typedef struct {
    int M, N, tiles; /* per head: A's rows, the weight's rows, their tiles (run_products sets tiles) */
    const uint8_t *w;
    const void *s; /* float, or float16 where half */
    int half;
    size_t row_bytes;
    uint8_t flip; /* dot_rows' */
    Rows a;       /* [heads * M, K]: A's rows quantized */
    float *out;   /* [heads, M, N] */
    int rows;     /* weight rows per tile: TILE or more, so that a tile holds ITEM_BYTES (run_products sets it) */
    const struct Panels *panels; /* the weights copied into panels of 16 rows (LatentAttention's, a few tokens) */
} LinearWork;

/* A head's weight rows (HeadwiseMatMul's layout: N rows of K values, blocks of 32, signed) copied once into panels of
 * PANEL rows: per block of the panel, piece g (4 bytes) of row j lies in lane j of the block's g-th 64-byte vector,
 * flipped to the zero point, and the block's PANEL row scales follow in one vector of their own array. A token's
 * product then keeps each row's sum in its own lane: one integer multiply-add per 64 bytes and one scale per block
 * of 16 rows, and no per-row horizontal sum, which took most of a per-head row's time (64 bytes for W_UK's 128 int4
 * values, 256 for W_UV's 512). */
#define PANEL 16
#define PANEL_TOKENS 4 /* a decode step of up to this many tokens takes the panels; more rows go row by row */
typedef struct Panels {
    uint8_t *w; /* [H, N / PANEL, K / 32, PANEL * 32 * bits / 8] */
    float *s;   /* [H, N / PANEL, K / 32, PANEL] */
    int N, K, bits;
} Panels;

/* bytes of weights a work item reads at least where the rows allow: short rows (W_UK's 128 int4 values, 64 bytes)
 * in tiles of TILE made items too small to pay for their scheduling */
#define ITEM_BYTES 16384

static void run_linear(void *data, size_t item) {
    LinearWork *w = (LinearWork *)data;
    const int K = w->a.K, N = w->N, h = (int)item / w->tiles, tile = (int)item % w->tiles;
    const int r0 = tile * w->rows, r1 = r0 + w->rows < N ? r0 + w->rows : N;
    const size_t head = (size_t)h * N; /* the head's first weight row */
    float *out = w->out + (size_t)h * w->M * N;
    if (w->M == 1) { /* a decode step: short rows 4 at a time, the others one after the other */
        const int8_t *q;
        const float *d, *c;
        row_of(&w->a, (size_t)h, &q, &d, &c);
        int r = r0;
        for (; dot4_fits(K, w->a.bits) && !w->a.lane && r + 4 <= r1; r += 4) {
            const uint8_t *rows[4];
            const void *scales[4];
            for (int i = 0; i < 4; i++) {
                rows[i] = w->w + (head + r + i) * w->row_bytes;
                scales[i] = scale_row(w->s, w->half, (head + r + i) * (K / BLOCK));
            }
            dot_row4(rows, scales, w->half, K, w->a.bits, q, d, c, out + r, w->flip);
        }
        dot_rows_of(w->w + (head + r) * w->row_bytes, w->row_bytes, scale_row(w->s, w->half, (head + r) * (K / BLOCK)),
                    (size_t)(K / BLOCK), w->half, K, w->a.bits, q, d, c, out + r, 1, r1 - r, w->flip, w->a.lane);
        return;
    }
    for (int p = 0; p < w->M; p += 4) {
        const int m = w->M - p < 4 ? w->M - p : 4;
        const int8_t *q[4];
        const float *d[4], *c[4];
        for (int j = 0; j < m; j++) row_of(&w->a, (size_t)h * w->M + (size_t)(p + j), &q[j], &d[j], &c[j]);
        tile_rows(w->w + (head + r0) * w->row_bytes, w->row_bytes, scale_row(w->s, w->half, (head + r0) * (K / BLOCK)),
                  (size_t)(K / BLOCK), w->half, K, w->a.bits, r1 - r0, m, q, d, c, out + (size_t)p * N + r0, 1,
                  (size_t)N, w->flip, w->a.lane);
    }
}

#if SIMD
/* one token's row (quantize_row's, not interleaved) against panel `panel` of head h: out[panel * PANEL + j] */
static void panel_rows(const Panels *p, int h, int panel, const int8_t *q, const float *d, const float *c,
                       float *out) {
    const int blocks = p->K / BLOCK, block_bytes = BLOCK * p->bits / 8;
    const size_t first = ((size_t)h * (p->N / PANEL) + panel) * blocks;
    const uint8_t *w = p->w + first * PANEL * block_bytes;
    const float *s = p->s + first * PANEL;
    vf acc = vf_zero(), zp = vf_zero();
    for (int b = 0; b < blocks; b++, w += PANEL * block_bytes, s += PANEL) {
        vi lo = vi_zero(), hi = vi_zero();
        int32_t piece[8];
        if (p->bits == 4) { /* the odd weights as dot_rows takes them (vi_nibbles) */
            memcpy(piece, q + 16 * b, 16), memcpy(piece + 4, q + p->K / 2 + 16 * b, 16);
            for (int g = 0; g < 4; g++)
                vi_nibbles(&lo, &hi, vi_load(w + 64 * g), vi_words(piece[g]), vi_words(piece[4 + g]));
            hi = vi_nibbles_done(hi);
        } else {
            memcpy(piece, q + BLOCK * b, 32);
            for (int g = 0; g < 8; g += 2) {
                lo = vi_dot(lo, vi_load(w + 64 * g), vi_words(piece[g]));
                hi = vi_dot(hi, vi_load(w + 64 * g + 64), vi_words(piece[g + 1]));
            }
        }
        const vf sw = vf_load(s);
        acc = vf_fmadd(vf_float(vi_add(lo, hi)), vf_mul(sw, vf_set1(d[b])), acc);
        zp = vf_fmadd(sw, vf_set1(c[b]), zp);
    }
    vf_store(out + (size_t)panel * PANEL, vf_add(acc, zp));
}

#define PANELS_PER_ITEM 8
/* one work item: up to PANELS_PER_ITEM panels of one head, for each of the M tokens */
static void run_panels(void *data, size_t item) {
    const LinearWork *w = (const LinearWork *)data;
    const Panels *p = w->panels;
    const int per_head = (p->N / PANEL + PANELS_PER_ITEM - 1) / PANELS_PER_ITEM, h = (int)item / per_head;
    const int first = (int)item % per_head * PANELS_PER_ITEM, last = first + PANELS_PER_ITEM < p->N / PANEL
                                                                          ? first + PANELS_PER_ITEM : p->N / PANEL;
    for (int t = 0; t < w->M; t++) {
        const int8_t *q;
        const float *d, *c;
        row_of(&w->a, (size_t)h * w->M + t, &q, &d, &c);
        for (int panel = first; panel < last; panel++)
            panel_rows(p, h, panel, q, d, c, w->out + ((size_t)h * w->M + t) * p->N);
    }
}
#endif

/* quantize A's heads * M rows, then run the work items; `weights`: the kernel's B and scales for advise_huge */
static OrtStatus *run_products(OrtKernelContext *ctx, LinearWork *w, int heads, int *advised) {
    const size_t rows = (size_t)heads * w->M, K = (size_t)w->a.K;
    const void *weights[2] = {w->w, w->s};
    const size_t rows_of_weights = (size_t)heads * w->N;
    const size_t weight_bytes[2] = {rows_of_weights * w->row_bytes,
                                    rows_of_weights * (K / BLOCK) * scale_bytes(w->half)};
    advise_huge(advised, weights, weight_bytes, 2);
    if (rows == 0) return NULL;
    Scratch scratch = {malloc(aligned(rows * K) + 2 * aligned(rows * (K / BLOCK) * sizeof(float))), NULL};
    if (!scratch.base) return CALL(CreateStatus)(ORT_FAIL, "mla_deploy product: out of memory");
    scratch.at = scratch.base;
    w->a.q = take(&scratch, rows * K), w->a.d = take(&scratch, rows * (K / BLOCK) * sizeof(float));
    w->a.c = take(&scratch, rows * (K / BLOCK) * sizeof(float));
    OrtStatus *status = quantize_rows(ctx, &w->a, rows);
    w->rows = TILE;
    while (w->rows < w->N && (size_t)w->rows * w->row_bytes < ITEM_BYTES) w->rows *= 2;
    w->tiles = (w->N + w->rows - 1) / w->rows;
#if SIMD
    if (!status && w->panels) {
        const size_t per_head = (size_t)(w->N / PANEL + PANELS_PER_ITEM - 1) / PANELS_PER_ITEM;
        status = parallel(ctx, run_panels, (size_t)heads * per_head, w, rows * (size_t)w->N * K);
    } else
#endif
    if (!status) status = CALL(KernelContext_ParallelFor)(ctx, run_linear, (size_t)heads * w->tiles, 0, w);
    free(scratch.base);
    return status;
}

/* A [..., K] of a product: its element type (into *type), rank and dimensions (up to 8; a higher rank is left for
 * the caller to refuse, *rank set) */
static OrtStatus *operand_shape(const OrtValue *value, int64_t dims[8], size_t *rank, int *type) {
    OrtShapeInfo *info;
    CHECK(CALL(GetTensorTypeAndShape)(value, &info));
    OrtStatus *status = CALL(GetDimensionsCount)(info, rank);
    if (!status) status = CALL(GetTensorElementType)(info, type);
    if (!status && *rank >= 1 && *rank <= 8) status = CALL(GetDimensions)(info, dims, *rank);
    CALL(ReleaseTensorTypeAndShapeInfo)(info);
    return status;
}

static OrtStatus *linear_compute(void *kernel_data, OrtKernelContext *ctx) {
    const LinearKernel *kernel = (const LinearKernel *)kernel_data;
    const int K = (int)kernel->K, N = (int)kernel->N, bits = (int)kernel->bits;
    const OrtValue *in[3];
    for (size_t i = 0; i < 3; i++) CHECK(CALL(KernelContext_GetInput)(ctx, i, &in[i]));
    OrtShapeInfo *info;
    int64_t dims[8], b[3];
    size_t rank = 0, scales = 0;
    int type = 0;
    CHECK(operand_shape(in[0], dims, &rank, &type));
    if (type != TYPE_FLOAT || rank < 1 || rank > 8 || dims[rank - 1] != K)
        return fail("BlockwiseMatMul: A must be float [..., K]");
    CHECK(shape_of(in[1], TYPE_UINT8, 3, b, "BlockwiseMatMul: B must be uint8 [N, K/32, 32*bits/8]"));
    CHECK(CALL(GetTensorTypeAndShape)(in[2], &info));
    OrtStatus *status = CALL(GetTensorShapeElementCount)(info, &scales);
    if (!status) status = CALL(GetTensorElementType)(info, &type);
    CALL(ReleaseTensorTypeAndShapeInfo)(info);
    if (status) return status;
    if (b[0] != N || b[1] != K / BLOCK || b[2] != BLOCK * bits / 8 || (type != TYPE_FLOAT && type != TYPE_FLOAT16) ||
        scales != (size_t)N * (K / BLOCK))
        return fail("BlockwiseMatMul: B and scales do not agree with the attributes K and N");
    size_t M = 1;
    for (size_t i = 0; i + 1 < rank; i++) M *= (size_t)dims[i];
    dims[rank - 1] = N;
    OrtValue *output;
    CHECK(CALL(KernelContext_GetOutput)(ctx, 0, dims, rank, &output));
    void *ptr[4];
    for (int i = 0; i < 3; i++) CHECK(CALL(GetTensorMutableData)((OrtValue *)in[i], &ptr[i]));
    CHECK(CALL(GetTensorMutableData)(output, &ptr[3]));
    LinearWork w = {(int)M, N, 0, (const uint8_t *)ptr[1], ptr[2], type == TYPE_FLOAT16,
                    (size_t)K * bits / 8, 0, {(const float *)ptr[0], K, bits, NULL, NULL, NULL, kernel->interleaved},
                    (float *)ptr[3], 0, NULL};
    return run_products(ctx, &w, 1, &((LinearKernel *)kernel_data)->advised);
}

static int linear_valid(const int64_t *a) { /* K, N, bits, block */
    return (a[2] == 4 || a[2] == 8) && a[3] == BLOCK && a[0] >= BLOCK && a[0] % BLOCK == 0 && a[1] >= 1;
}

/* a LinearKernel of BlockwiseMatMul or HeadwiseMatMul (the same attributes), `refusal` naming the operator */
static OrtStatus *product_kernel(const OrtKernelInfo *info, const char *refusal, void **out) {
    const char *names[4] = {"K", "N", "bits", "block_size"};
    return new_kernel(info, names, linear_valid, refusal, sizeof(LinearKernel), out);
}

static OrtStatus *linear_create(const OrtCustomOp *op, const void *ort_api, const OrtKernelInfo *info, void **out) {
    (void)op, (void)ort_api;
    int interleaved = 0;
    CHECK(interleaved_of(info, "BlockwiseMatMul: interleaved must be 0 or 1", &interleaved));
    CHECK(product_kernel(info, "BlockwiseMatMul: bits must be 4 or 8, block_size 32, K a multiple of 32, N >= 1", out));
    ((LinearKernel *)*out)->interleaved = interleaved;
    return NULL;
}

static const char *linear_name(const OrtCustomOp *op) { (void)op; return "BlockwiseMatMul"; }
static int linear_input_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 1 ? TYPE_UINT8 : i == 2 ? TYPE_UNDEFINED : TYPE_FLOAT; /* scales: float or float16 */
}
static size_t linear_input_count(const OrtCustomOp *op) { (void)op; return 3; }

static OrtCustomOp blockwise_matmul =
    OP_TABLE(linear_name, linear_input_type, linear_input_count, linear_create, linear_compute, required);

/* ---- mla_deploy.HeadwiseMatMul: the absorbed attention's per-head products, MatMul(A, W) with W [H, K, N] held as
 * signed integers per output row (mla_deploy.quant.formats.HEADWISE) --------------------------------------------
 * Inputs: 0 A float [H, M, K]; 1 B uint8 [H, N, K*bits/8]: the bytes of the ONNX INT4/INT8 tensor [H, N, K] (signed,
 * no zero point; int4 two per byte, low nibble first), each output row's K values in blocks of 32; 2 scales float
 * [H, N, K/32]. Output: float [H, M, N], head h = A[h] . W[h], each row of A quantized to int8 per block of 32 (the
 * engine's fast compute, as BlockwiseMatMul). Attributes: K, N, bits (4, 8), block_size (32). */

static OrtStatus *headwise_compute(void *kernel_data, OrtKernelContext *ctx) {
    const LinearKernel *kernel = (const LinearKernel *)kernel_data;
    const int K = (int)kernel->K, N = (int)kernel->N, bits = (int)kernel->bits;
    const OrtValue *in[3];
    for (size_t i = 0; i < 3; i++) CHECK(CALL(KernelContext_GetInput)(ctx, i, &in[i]));
    int64_t a[3], b[3], s[3];
    CHECK(shape_of(in[0], TYPE_FLOAT, 3, a, "HeadwiseMatMul: A must be float [H, M, K]"));
    CHECK(shape_of(in[1], TYPE_UINT8, 3, b, "HeadwiseMatMul: B must be uint8 [H, N, K*bits/8]"));
    CHECK(shape_of(in[2], TYPE_FLOAT, 3, s, "HeadwiseMatMul: scales must be float [H, N, K/32]"));
    if (a[2] != K || b[0] != a[0] || b[1] != N || b[2] != (int64_t)K * bits / 8 || s[0] != a[0] || s[1] != N ||
        s[2] != K / BLOCK)
        return fail("HeadwiseMatMul: A, B and scales do not agree with each other and the attributes K and N");
    const int64_t dims[3] = {a[0], a[1], N};
    OrtValue *output;
    CHECK(CALL(KernelContext_GetOutput)(ctx, 0, dims, 3, &output));
    void *ptr[4];
    for (int i = 0; i < 3; i++) CHECK(CALL(GetTensorMutableData)((OrtValue *)in[i], &ptr[i]));
    CHECK(CALL(GetTensorMutableData)(output, &ptr[3]));
    LinearWork w = {(int)a[1], N, 0, (const uint8_t *)ptr[1], ptr[2], 0,
                    (size_t)K * bits / 8, signed_flip(bits), {(const float *)ptr[0], K, bits, NULL, NULL, NULL, 0},
                    (float *)ptr[3], 0, NULL};
    return run_products(ctx, &w, (int)a[0], &((LinearKernel *)kernel_data)->advised);
}

static OrtStatus *headwise_create(const OrtCustomOp *op, const void *ort_api, const OrtKernelInfo *info, void **out) {
    (void)op, (void)ort_api;
    return product_kernel(info, "HeadwiseMatMul: bits must be 4 or 8, block_size 32, K a multiple of 32, N >= 1", out);
}

static const char *headwise_name(const OrtCustomOp *op) { (void)op; return "HeadwiseMatMul"; }

static OrtCustomOp headwise_matmul =
    OP_TABLE(headwise_name, linear_input_type, linear_input_count, headwise_create, headwise_compute, required);

/* ---- mla_deploy.LatentAttention: one layer's absorbed MLA attention over a concatenated latent cache -----------
 * What mla_deploy.model.mla.AbsorbedMLAttention (form A_CC, concat cache, float32) computes between its projections:
 * from the query projection's and kv_a_proj_with_mqa's outputs to o_proj's input and the present cache.
 * Inputs (B sequences, S new tokens, P cached rows, T = P + S, H heads, dn/dr the query's no-rope/rope widths, r the
 * latent rank, C = r + dr, dv the value width):
 *   0 q        float [B, S, H*(dn+dr)]   per head [q_nope | q_pe]
 *   1 kv       float [B, S, C]           [c_kv | k_pe] before the norm and the rope
 *   2 past     float [B, P, C] (a concatenated cache), or [B, 1, T, C] (a static one, with input 15)
 *   3 mask     bool  [B or 1, 1, S, T]   hidden where it equals the attribute hidden_when
 *   4, 5       float q's rope tables cos, sin (B*S*dr values, [B, S, dr] in order; shared by the heads)
 *   6, 7       float k's rope tables cos, sin (the same layout)
 *   8, 9       int64 [dr] q's and k's rope pairs: rope(x)[j] = x[j] * cos[j] + x[pairs[j]] * sin[j]
 *   10         float [r] kv_a_layernorm's weight: c = w * (x / sqrt(mean(x^2) + eps))
 *   11, 12     w_uk as HeadwiseMatMul reads it: uint8 [H, r, dn*bits/8], scales float [H, r, dn/32]; or, where
 *              bits_uk is 32, float [H, dn, r] as the source graph's MatMul holds it, and no scales
 *   13, 14     w_uv likewise: uint8 [H, dv, r*bits/8], scales float [H, dv, r/32]; or float [H, r, dv], no scales
 *   15         int64 [B] write_indices (optional; a static cache only): sequence b's new rows go to slots
 *              write_indices[b] + [0, S) (ONNX TensorScatter, mode linear)
 * Outputs: 0 float [B, S, H*dv] (o_proj's input, heads in order); 1 present: float [B, T, C] = past then the new rows
 * [norm(c_kv) | rope(k_pe)] (concatenated), or [B, 1, T, C] = past with the new rows written at write_indices (static;
 * where ONNX Runtime gives the past's own buffer as the present's, as an in-place IO binding does, nothing is
 * copied). Every slot of the T is a row the scores may see; the mask says which.
 * Per head h and token s: q_lat = q_nope . W_UK[h] (HeadwiseMatMul's compute: int8 activations), scores over the
 * T rows = [q_lat | rope(q_pe)] . row * scale, hidden ones set to `fill`, softmax, o = sum p * row[:r], output
 * o . W_UV[h] (HeadwiseMatMul's compute; float32 weights: head_products, in float32). r must be a multiple of 32
 * (the weighted sum's CHANNELS; quantized weights' blocks imply it). Attributes: bits_uk, bits_uv
 * (4, 8, or 32 for float32 weights), hidden_when (0, 1); scale, eps, fill (float). */

typedef struct {
    int64_t bits_uk, bits_uv, hidden_when;
    float scale, eps, fill;
    int advised_uk, advised_uv;
    int panels_state;           /* 0: not made, 1: being made by a call, 2: made, 3: not to be made (no memory) */
    const void *panels_from[4]; /* the weights and scales they were made from (a call with others does not use them) */
    Panels uk, uv;
} AttentionKernel;

#if SIMD
/* the panels of `heads` weights of N rows of K values (uint8, HeadwiseMatMul's layout, signed: stored flipped to
 * the zero point) and their float scales [heads, N, K/32]; 0 where the memory is not there */
static int make_panels(Panels *p, const uint8_t *w, const float *s, int heads, int N, int K, int bits) {
    const int blocks = K / BLOCK, block_bytes = BLOCK * bits / 8;
    const uint8_t flip = signed_flip(bits);
    const size_t rows = (size_t)heads * N;
    p->w = aligned_alloc(64, aligned(rows * blocks * block_bytes));
    p->s = aligned_alloc(64, aligned(rows * blocks * sizeof(float)));
    if (!p->w || !p->s) {
        free(p->w), free(p->s);
        p->w = NULL, p->s = NULL;
        return 0;
    }
    for (size_t row = 0; row < rows; row++) {
        const size_t h = row / N, panel = row % N / PANEL, j = row % PANEL;
        for (int b = 0; b < blocks; b++) {
            const size_t at = (h * (N / PANEL) + panel) * blocks + b; /* the panel's block */
            const uint8_t *from = w + (row * blocks + b) * block_bytes;
            uint8_t *to = p->w + at * PANEL * block_bytes + 4 * j;
            for (int m = 0; m < block_bytes; m++) to[64 * (m / 4) + m % 4] = from[m] ^ flip;
            p->s[at * PANEL + j] = s[row * blocks + b];
        }
    }
    p->N = N, p->K = K, p->bits = bits;
    return 1;
}
#endif

/* whether this call may take the kernel's panels for w_uk (H heads of r rows of dn) and w_uv (H of dv rows of r):
 * the first call that asks makes them (once: a call meanwhile goes row by row), from these very weights */
static int panels_ready(AttentionKernel *k, const void *const from[4], int H, int r, int dn, int dv) {
#if SIMD
    int state = __atomic_load_n(&k->panels_state, __ATOMIC_ACQUIRE), idle = 0;
    if (state == 0 && r % PANEL == 0 && dv % PANEL == 0 &&
        __atomic_compare_exchange_n(&k->panels_state, &idle, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
        const int bits_uk = (int)k->bits_uk, bits_uv = (int)k->bits_uv;
        int made = make_panels(&k->uk, from[0], from[1], H, r, dn, bits_uk);
        made = made && make_panels(&k->uv, from[2], from[3], H, dv, r, bits_uv);
        for (int i = 0; i < 4; i++) k->panels_from[i] = from[i];
        state = made ? 2 : 3;
        __atomic_store_n(&k->panels_state, state, __ATOMIC_RELEASE);
    }
    if (state != 2) return 0;
    for (int i = 0; i < 4; i++)
        if (k->panels_from[i] != from[i]) return 0;
    return k->uk.N == r && k->uk.K == dn && k->uv.N == dv && k->uv.K == r;
#else
    (void)k, (void)from, (void)H, (void)r, (void)dn, (void)dv;
    return 0;
#endif
}

static void attention_destroy(void *data) {
    AttentionKernel *kernel = (AttentionKernel *)data;
    free(kernel->uk.w), free(kernel->uk.s), free(kernel->uv.w), free(kernel->uv.s);
    free(kernel);
}

#define LANES 16 /* query rows per panel: one vector */
#define SPAN 64  /* cache rows per scores item */
#define CHANNELS 32 /* value channels per values item */

typedef struct {
    int B, S, T, H, C, r, panels; /* panels per sequence: ceil(S * H / LANES); row n of a sequence = (s, h) */
    const float *present;         /* [B, T, C] */
    const float *qt;              /* [B, panels, C, LANES]: the queries, transposed per panel (0 past the rows) */
    float *p;                     /* [B, panels, T, LANES]: scores, then probabilities */
    const int *limit;             /* [B, panels]: cache rows the panel's rows may see (others are hidden) */
    const uint8_t *mask;          /* [Bm, 1, S, T] */
    int mask_batch, hidden_when;
    float scale, fill;
    float *o;                     /* [H, B*S, r]: the weighted sums, as HeadwiseMatMul takes them */
} AttentionWork;

/* rows t .. t + R - 1 of the cache against a panel's transposed queries qt [C, LANES]: p[t + i] = row_i . qt */
#define SCORE_ROWS 8
static void run_scores(void *data, size_t item) {
    const AttentionWork *w = (const AttentionWork *)data;
    const int spans = (w->T + SPAN - 1) / SPAN, b = (int)(item / ((size_t)w->panels * spans));
    const int panel = (int)(item / spans % w->panels), t0 = (int)(item % spans) * SPAN;
    const int limit = w->limit[b * w->panels + panel], t1 = t0 + SPAN < limit ? t0 + SPAN : limit;
    const int C = w->C;
    const float *qt = w->qt + ((size_t)b * w->panels + panel) * C * LANES;
    float *p = w->p + ((size_t)b * w->panels + panel) * w->T * LANES;
    const float *rows = w->present + (size_t)b * w->T * C;
    int t = t0;
#if SIMD
    for (; t + SCORE_ROWS <= t1; t += SCORE_ROWS) {
        const float *row = rows + (size_t)t * C;
        vf acc[SCORE_ROWS];
        for (int i = 0; i < SCORE_ROWS; i++) acc[i] = vf_zero();
        for (int c = 0; c < C; c++) {
            const vf q = vf_load(qt + (size_t)c * LANES);
            for (int i = 0; i < SCORE_ROWS; i++) acc[i] = vf_fmadd(vf_set1(row[(size_t)i * C + c]), q, acc[i]);
        }
        for (int i = 0; i < SCORE_ROWS; i++) vf_store(p + (size_t)(t + i) * LANES, acc[i]);
    }
    for (; t < t1; t++) {
        const float *row = rows + (size_t)t * C;
        vf acc = vf_zero();
        for (int c = 0; c < C; c++) acc = vf_fmadd(vf_set1(row[c]), vf_load(qt + c * LANES), acc);
        vf_store(p + (size_t)t * LANES, acc);
    }
#else
    for (; t < t1; t++) {
        const float *row = rows + (size_t)t * C;
        float acc[LANES] = {0};
        for (int c = 0; c < C; c++)
            for (int l = 0; l < LANES; l++) acc[l] += row[c] * qt[c * LANES + l];
        memcpy(p + (size_t)t * LANES, acc, sizeof acc);
    }
#endif
}

#if SIMD
/* e^x for 16 floats (Cephes' expf: a degree-6 polynomial on [-ln2/2, ln2/2], then a scale by 2^n; ~1 ulp; 0 far
 * below -87, as expf) */
AI vf vf_exp(vf x) {
    x = vf_max(x, vf_set1(-104.f));
    x = vf_min(x, vf_set1(88.7f));
    const vf n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fnmadd(n, vf_set1(0.693359375f), x);
    r = vf_fnmadd(n, vf_set1(-2.12194440e-4f), r);
    vf y = vf_set1(1.9875691500E-4f);
    y = vf_fmadd(y, r, vf_set1(1.3981999507E-3f));
    y = vf_fmadd(y, r, vf_set1(8.3334519073E-3f));
    y = vf_fmadd(y, r, vf_set1(4.1665795894E-2f));
    y = vf_fmadd(y, r, vf_set1(1.6666665459E-1f));
    y = vf_fmadd(y, r, vf_set1(5.0000001201E-1f));
    y = vf_fmadd(y, vf_mul(r, r), vf_add(r, vf_set1(1.f)));
    return vf_scale2(y, n);
}
#endif

/* one panel: scale, hide, softmax over its `limit` rows (rows past it are hidden and weigh exactly 0) */
static void run_softmax(void *data, size_t item) {
    const AttentionWork *w = (const AttentionWork *)data;
    const int b = (int)(item / w->panels), panel = (int)(item % w->panels), limit = w->limit[item];
    float *p = w->p + item * w->T * LANES;
    const int rows = w->S * w->H;
    float top[LANES], sum[LANES];
    for (int l = 0; l < LANES; l++) top[l] = -INFINITY, sum[l] = 0.f;
#if SIMD
    const int first = panel * LANES / w->H, last = ((panel + 1) * LANES - 1) / w->H;
    if (first == last) { /* one token's heads: one mask row for every lane */
        const uint8_t *hidden = w->mask + ((size_t)(w->mask_batch == 1 ? 0 : b) * w->S + first) * w->T;
        const vf scale = vf_set1(w->scale), fill = vf_set1(w->fill);
        vf most = vf_set1(-INFINITY);
        for (int t = 0; t < limit; t++) {
            float *v = p + (size_t)t * LANES;
            const vf x = (hidden[t] != 0) == w->hidden_when ? fill : vf_mul(vf_load(v), scale);
            vf_store(v, x);
            most = vf_max(most, x);
        }
        vf_store(top, most);
    } else
#endif
        for (int l = 0; l < LANES; l++) {
            const int n = panel * LANES + l, s = n < rows ? n / w->H : 0;
            const uint8_t *hidden = w->mask + ((size_t)(w->mask_batch == 1 ? 0 : b) * w->S + s) * w->T;
            for (int t = 0; t < limit; t++) {
                float *v = p + (size_t)t * LANES + l;
                *v = (hidden[t] != 0) == w->hidden_when ? w->fill : *v * w->scale;
                top[l] = fmaxf(top[l], *v);
            }
        }
#if SIMD
    const vf most = vf_load(top);
    vf total = vf_zero();
    for (int t = 0; t < limit; t++) {
        const vf e = vf_exp(vf_sub(vf_load(p + (size_t)t * LANES), most));
        vf_store(p + (size_t)t * LANES, e);
        total = vf_add(total, e);
    }
    const vf inverse = vf_div(vf_set1(1.f), total);
    for (int t = 0; t < limit; t++) vf_store(p + (size_t)t * LANES, vf_mul(vf_load(p + (size_t)t * LANES), inverse));
    (void)sum;
#else
    for (int t = 0; t < limit; t++)
        for (int l = 0; l < LANES; l++) {
            float *v = p + (size_t)t * LANES + l;
            *v = expf(*v - top[l]);
            sum[l] += *v;
        }
    for (int t = 0; t < limit; t++)
        for (int l = 0; l < LANES; l++) p[(size_t)t * LANES + l] /= sum[l];
#endif
}

/* one (sequence, panel, CHANNELS channels of r): o[h, b*S + s, c] = sum_t p[t, n] row_t[c] */
static void run_values(void *data, size_t item) {
    const AttentionWork *w = (const AttentionWork *)data;
    const int chunks = (w->r + CHANNELS - 1) / CHANNELS, b = (int)(item / ((size_t)w->panels * chunks));
    const int panel = (int)(item / chunks % w->panels), c0 = (int)(item % chunks) * CHANNELS;
    const int limit = w->limit[b * w->panels + panel];
    const int rows = w->S * w->H;
    const float *p = w->p + ((size_t)b * w->panels + panel) * w->T * LANES;
    for (int half = 0; half < LANES; half += 8) {
        float acc[8][CHANNELS];
#if SIMD
        vf lo[8], hi[8];
        for (int l = 0; l < 8; l++) lo[l] = hi[l] = vf_zero();
        for (int t = 0; t < limit; t++) {
            const float *row = w->present + ((size_t)b * w->T + t) * w->C + c0;
            const vf a = vf_load(row), z = vf_load(row + 16);
            const float *pt = p + (size_t)t * LANES + half;
            for (int l = 0; l < 8; l++) {
                const vf pl = vf_set1(pt[l]);
                lo[l] = vf_fmadd(pl, a, lo[l]);
                hi[l] = vf_fmadd(pl, z, hi[l]);
            }
        }
        for (int l = 0; l < 8; l++) vf_store(acc[l], lo[l]), vf_store(acc[l] + 16, hi[l]);
#else
        memset(acc, 0, sizeof acc);
        for (int t = 0; t < limit; t++) {
            const float *row = w->present + ((size_t)b * w->T + t) * w->C + c0;
            for (int l = 0; l < 8; l++) {
                const float pl = p[(size_t)t * LANES + half + l];
                for (int c = 0; c < CHANNELS; c++) acc[l][c] += pl * row[c];
            }
        }
#endif
        for (int l = 0; l < 8; l++) {
            const int n = panel * LANES + half + l;
            if (n >= rows) break;
            const int s = n / w->H, h = n % w->H;
            memcpy(w->o + (((size_t)h * w->B + b) * w->S + s) * w->r + c0, acc[l], CHANNELS * sizeof(float));
        }
    }
}

/* LatentAttention's per-head products for float32 weights: y[h, t, :N] = x[h, t, :K] . w[h] for w [H, K, N] as the
 * source graph's MatMul holds it (its rows of N are streamed; each loaded row serves HEAD_TOKENS tokens). One item:
 * a head's next HEAD_TOKENS tokens. */
typedef struct {
    int H, tokens, K, N;
    const float *x; /* [H, tokens, K] */
    const float *w; /* [H, K, N] */
    float *y;       /* [H, tokens, N] */
} HeadFloatWork;

#define HEAD_TOKENS 4
static inline __attribute__((always_inline)) void head_rows(const float *w, int K, int N, int m, const float *x,
                                                           float *y) {
    int c = 0;
#if defined(__AVX512F__)
    for (; c + 64 <= N; c += 64) { /* 64 columns: m x 4 vectors of sums */
        __m512 acc[HEAD_TOKENS][4];
        for (int j = 0; j < m; j++)
            for (int v = 0; v < 4; v++) acc[j][v] = _mm512_setzero_ps();
        for (int k = 0; k < K; k++) {
            __m512 row[4];
            for (int v = 0; v < 4; v++) {
                row[v] = _mm512_loadu_ps(w + (size_t)k * N + c + 16 * v);
                __asm__("" : "+v"(row[v])); /* loaded once for the m tokens (see float_dots_4rows) */
            }
            for (int j = 0; j < m; j++) {
                const __m512 xk = _mm512_set1_ps(x[(size_t)j * K + k]);
                for (int v = 0; v < 4; v++) acc[j][v] = _mm512_fmadd_ps(row[v], xk, acc[j][v]);
            }
        }
        for (int j = 0; j < m; j++)
            for (int v = 0; v < 4; v++) _mm512_storeu_ps(y + (size_t)j * N + c + 16 * v, acc[j][v]);
    }
    for (; c + 16 <= N; c += 16) {
        __m512 acc[HEAD_TOKENS];
        for (int j = 0; j < m; j++) acc[j] = _mm512_setzero_ps();
        for (int k = 0; k < K; k++) {
            const __m512 row = _mm512_loadu_ps(w + (size_t)k * N + c);
            for (int j = 0; j < m; j++) acc[j] = _mm512_fmadd_ps(row, _mm512_set1_ps(x[(size_t)j * K + k]), acc[j]);
        }
        for (int j = 0; j < m; j++) _mm512_storeu_ps(y + (size_t)j * N + c, acc[j]);
    }
#endif
    for (; c < N; c++) /* the columns left over (all of them without AVX-512), each sum in double */
        for (int j = 0; j < m; j++) {
            double sum = 0.;
            for (int k = 0; k < K; k++) sum += (double)x[(size_t)j * K + k] * w[(size_t)k * N + c];
            y[(size_t)j * N + c] = (float)sum;
        }
}

static void run_head_products(void *data, size_t item) {
    const HeadFloatWork *w = (const HeadFloatWork *)data;
    const int blocks = (w->tokens + HEAD_TOKENS - 1) / HEAD_TOKENS, h = (int)(item / blocks);
    const int t0 = (int)(item % blocks) * HEAD_TOKENS, m = w->tokens - t0 < HEAD_TOKENS ? w->tokens - t0 : HEAD_TOKENS;
    const float *weights = w->w + (size_t)h * w->K * w->N, *x = w->x + ((size_t)h * w->tokens + t0) * w->K;
    float *y = w->y + ((size_t)h * w->tokens + t0) * w->N;
    switch (m) { /* m constant in each call, so that the sums stay in registers */
    case 1: head_rows(weights, w->K, w->N, 1, x, y); break;
    case 2: head_rows(weights, w->K, w->N, 2, x, y); break;
    case 3: head_rows(weights, w->K, w->N, 3, x, y); break;
    default: head_rows(weights, w->K, w->N, 4, x, y); break;
    }
}

static OrtStatus *head_products(OrtKernelContext *ctx, const HeadFloatWork *w) {
    const size_t blocks = (size_t)(w->tokens + HEAD_TOKENS - 1) / HEAD_TOKENS;
    return parallel(ctx, run_head_products, (size_t)w->H * blocks, (void *)w, (size_t)w->H * w->tokens * w->K * w->N);
}

static void rope(const float *x, const float *cos, const float *sin, const int64_t *pairs, int d, float *out) {
    for (int j = 0; j < d; j++) out[j] = x[j] * cos[j] + x[pairs[j]] * sin[j];
}

static OrtStatus *element_count(const OrtValue *value, int want_type, size_t want, const char *what) {
    OrtShapeInfo *info;
    size_t count = 0;
    int type = 0;
    CHECK(CALL(GetTensorTypeAndShape)(value, &info));
    OrtStatus *status = CALL(GetTensorShapeElementCount)(info, &count);
    if (!status) status = CALL(GetTensorElementType)(info, &type);
    CALL(ReleaseTensorTypeAndShapeInfo)(info);
    if (status) return status;
    return count != want || type != want_type ? fail(what) : NULL;
}

static OrtStatus *attention_compute(void *kernel_data, OrtKernelContext *ctx) {
    AttentionKernel *kernel = (AttentionKernel *)kernel_data;
    const int bits_uk = (int)kernel->bits_uk, bits_uv = (int)kernel->bits_uv;
    const int float_uk = bits_uk == 32, float_uv = bits_uv == 32; /* float32 per-head weights, no scales */
    const OrtValue *in[16];
    for (size_t i = 0; i < 16; i++) CHECK(CALL(KernelContext_GetInput)(ctx, i, &in[i]));
    for (int i = 0; i < 15; i++)
        if (!in[i] && !(i == 12 && float_uk) && !(i == 14 && float_uv))
            return fail("LatentAttention: inputs 0 to 14 are required (the scales only for quantized weights)");
    const int is_static = in[15] != NULL;
    int64_t qd[3], kd[3], pd[4], md[4], uk[3], uks[3], uv[3], uvs[3], wd[1], slots = 0;
    CHECK(shape_of(in[0], TYPE_FLOAT, 3, qd, "LatentAttention: q must be float [B, S, H*(dn+dr)]"));
    CHECK(shape_of(in[1], TYPE_FLOAT, 3, kd, "LatentAttention: kv must be float [B, S, C]"));
    if (is_static) {
        CHECK(shape_of(in[2], TYPE_FLOAT, 4, pd, "LatentAttention: a static past must be float [B, 1, T, C]"));
        CHECK(shape_of(in[15], TYPE_INT64, 1, wd, "LatentAttention: write_indices must be int64 [B]"));
        if (pd[1] != 1 || wd[0] != pd[0])
            return fail("LatentAttention: a static past is [B, 1, T, C] and write_indices [B]");
        slots = pd[2];
        pd[1] = 0, pd[2] = pd[3]; /* as [B, P, C] with no rows before the new ones */
    } else {
        CHECK(shape_of(in[2], TYPE_FLOAT, 3, pd, "LatentAttention: past must be float [B, P, C]"));
    }
    CHECK(shape_of(in[3], TYPE_BOOL, 4, md, "LatentAttention: mask must be bool [B or 1, 1, S, T]"));
    if (float_uk)
        CHECK(shape_of(in[11], TYPE_FLOAT, 3, uk, "LatentAttention: a float w_uk must be float [H, dn, r]"));
    else {
        CHECK(shape_of(in[11], TYPE_UINT8, 3, uk, "LatentAttention: w_uk must be uint8 [H, r, dn*bits/8]"));
        CHECK(shape_of(in[12], TYPE_FLOAT, 3, uks, "LatentAttention: w_uk's scales must be float [H, r, dn/32]"));
    }
    if (float_uv)
        CHECK(shape_of(in[13], TYPE_FLOAT, 3, uv, "LatentAttention: a float w_uv must be float [H, r, dv]"));
    else {
        CHECK(shape_of(in[13], TYPE_UINT8, 3, uv, "LatentAttention: w_uv must be uint8 [H, dv, r*bits/8]"));
        CHECK(shape_of(in[14], TYPE_FLOAT, 3, uvs, "LatentAttention: w_uv's scales must be float [H, dv, r/32]"));
    }
    const int B = (int)qd[0], S = (int)qd[1], P = (int)pd[1], C = (int)kd[2], H = (int)uk[0];
    const int T = is_static ? (int)slots : P + S; /* static: every slot */
    const int r = (int)(float_uk ? uk[2] : uk[1]), dn = (int)(float_uk ? uk[1] : uk[2] * 8 / bits_uk), dr = C - r;
    const int dv = (int)(float_uv ? uv[2] : uv[1]);
    const int uk_agrees = float_uk || (uks[0] == H && uks[1] == r && uks[2] == dn / BLOCK && dn % BLOCK == 0 &&
                                       r % BLOCK == 0);
    const int uv_agrees = float_uv ? uv[1] == r : uv[2] == (int64_t)r * bits_uv / 8 && uvs[0] == H && uvs[1] == dv &&
                                                  uvs[2] == r / BLOCK && r % BLOCK == 0;
    if (kd[0] != B || kd[1] != S || pd[0] != B || pd[2] != C || dr <= 0 || dr % 2 || qd[2] != (int64_t)H * (dn + dr) ||
        !uk_agrees || !uv_agrees || uv[0] != H || dn <= 0 || r <= 0 || r % CHANNELS || dv <= 0 ||
        (md[0] != 1 && md[0] != B) ||
        md[1] != 1 || md[2] != S || md[3] != T)
        return fail("LatentAttention: the input shapes do not agree (see cpu_ops.c)");
    const size_t tokens = (size_t)B * S;
    for (int i = 4; i < 8; i++)
        CHECK(element_count(in[i], TYPE_FLOAT, tokens * dr, "LatentAttention: a rope table must hold B*S*dr floats"));
    for (int i = 8; i < 10; i++)
        CHECK(element_count(in[i], TYPE_INT64, (size_t)dr, "LatentAttention: the rope pairs must be int64 [dr]"));
    CHECK(element_count(in[10], TYPE_FLOAT, (size_t)r, "LatentAttention: the norm's weight must be float [r]"));
    void *ptr[15] = {NULL};
    for (int i = 0; i < 15; i++)
        if (in[i]) CHECK(CALL(GetTensorMutableData)((OrtValue *)in[i], &ptr[i]));
    const int64_t *pairs[2] = {(const int64_t *)ptr[8], (const int64_t *)ptr[9]};
    for (int k = 0; k < 2; k++)
        for (int j = 0; j < dr; j++)
            if (pairs[k][j] < 0 || pairs[k][j] >= dr) return fail("LatentAttention: a rope pair lies outside [0, dr)");
    const int64_t *writes = NULL;
    if (is_static) {
        void *w;
        CHECK(CALL(GetTensorMutableData)((OrtValue *)in[15], &w));
        writes = (const int64_t *)w;
        for (int b = 0; b < B; b++)
            if (writes[b] < 0 || writes[b] + S > T)
                return fail("LatentAttention: write_indices + S must lie in [0, T] (the static cache is full)");
    }
    const int64_t out_dims[3] = {B, S, (int64_t)H * dv}, present_dims[4] = {B, 1, T, C};
    const int64_t concat_dims[3] = {B, T, C};
    OrtValue *outputs[2];
    CHECK(CALL(KernelContext_GetOutput)(ctx, 0, out_dims, 3, &outputs[0]));
    CHECK(CALL(KernelContext_GetOutput)(ctx, 1, is_static ? present_dims : concat_dims, is_static ? 4 : 3,
                                        &outputs[1]));
    void *out_ptr[2];
    for (int i = 0; i < 2; i++) CHECK(CALL(GetTensorMutableData)(outputs[i], &out_ptr[i]));
    float *y = (float *)out_ptr[0], *present = (float *)out_ptr[1];
    const float *q = (const float *)ptr[0], *kv = (const float *)ptr[1], *past = (const float *)ptr[2];
    const float *tables[4] = {(const float *)ptr[4], (const float *)ptr[5], (const float *)ptr[6],
                              (const float *)ptr[7]};
    const float *norm = (const float *)ptr[10];

    /* the present cache: the past, then the new rows (static: the past, the new rows at write_indices) */
    if (is_static && present != past) memcpy(present, past, (size_t)B * T * C * sizeof(float));
    for (int b = 0; b < B; b++) {
        if (!is_static) memcpy(present + (size_t)b * T * C, past + (size_t)b * P * C, (size_t)P * C * sizeof(float));
        const int at = is_static ? (int)writes[b] : P;
        for (int s = 0; s < S; s++) {
            const size_t token = (size_t)b * S + s;
            const float *x = kv + token * C;
            float *row = present + ((size_t)b * T + at + s) * C;
            float squares = 0.f;
            for (int j = 0; j < r; j++) squares += x[j] * x[j];
            const float root = sqrtf(squares / (float)r + kernel->eps);
            for (int j = 0; j < r; j++) row[j] = norm[j] * (x[j] / root);
            rope(x + r, tables[2] + token * dr, tables[3] + token * dr, pairs[1], dr, row + r);
        }
    }
    if (tokens == 0) return NULL;

    const int rows = S * H, panels = (rows + LANES - 1) / LANES;
    const size_t heads_rows = (size_t)H * tokens;
    const size_t bytes = aligned(heads_rows * dn * sizeof(float)) + aligned(heads_rows * r * sizeof(float)) * 2 +
                         aligned(heads_rows * dr * sizeof(float)) +
                         aligned((size_t)B * panels * C * LANES * sizeof(float)) +
                         aligned((size_t)B * panels * T * LANES * sizeof(float)) +
                         aligned((size_t)B * panels * sizeof(int)) + aligned(heads_rows * dv * sizeof(float));
    Scratch scratch = {malloc(bytes), NULL};
    if (!scratch.base) return CALL(CreateStatus)(ORT_FAIL, "LatentAttention: out of memory");
    scratch.at = scratch.base;
    float *nope = take(&scratch, heads_rows * dn * sizeof(float));
    float *lat = take(&scratch, heads_rows * r * sizeof(float));
    float *pe = take(&scratch, heads_rows * dr * sizeof(float));
    float *qt = take(&scratch, (size_t)B * panels * C * LANES * sizeof(float));
    float *p = take(&scratch, (size_t)B * panels * T * LANES * sizeof(float));
    int *limit = take(&scratch, (size_t)B * panels * sizeof(int));
    float *o = take(&scratch, heads_rows * r * sizeof(float)), *ov = take(&scratch, heads_rows * dv * sizeof(float));

    /* the queries: q_nope heads first [H, B*S, dn] for W_UK, rope(q_pe) [B*S, H, dr] */
    for (size_t token = 0; token < tokens; token++)
        for (int h = 0; h < H; h++) {
            const float *x = q + token * H * (dn + dr) + (size_t)h * (dn + dr);
            memcpy(nope + ((size_t)h * tokens + token) * dn, x, (size_t)dn * sizeof(float));
            rope(x + dn, tables[0] + token * dr, tables[1] + token * dr, pairs[0], dr,
                 pe + (token * H + h) * dr);
        }
    OrtStatus *status;
    const void *per_head[4] = {ptr[11], ptr[12], ptr[13], ptr[14]};
    const int by_panels = !float_uk && !float_uv && tokens <= PANEL_TOKENS &&
                          panels_ready(kernel, per_head, H, r, dn, dv);
    if (float_uk) {
        const HeadFloatWork uk_work = {H, (int)tokens, dn, r, nope, (const float *)ptr[11], lat};
        status = head_products(ctx, &uk_work);
    } else {
        LinearWork uk_work = {(int)tokens, r, 0, (const uint8_t *)ptr[11], ptr[12], 0, (size_t)dn * bits_uk / 8,
                              signed_flip(bits_uk), {nope, dn, bits_uk, NULL, NULL, NULL, 0}, lat, 0,
                              by_panels ? &kernel->uk : NULL};
        status = run_products(ctx, &uk_work, H, &kernel->advised_uk);
    }

    /* each sequence's S*H query rows in panels of LANES, transposed: [q_lat | rope(q_pe)] per row */
    const uint8_t *mask = (const uint8_t *)ptr[3];
    const int hidden_when = (int)kernel->hidden_when;
    for (int b = 0; !status && b < B; b++)
        for (int panel = 0; panel < panels; panel++) {
            float *t_panel = qt + ((size_t)b * panels + panel) * C * LANES;
            int seen = 0, scanned = -1, sees = T; /* scanned: the token whose mask row `sees` was read from */
            for (int l = 0; l < LANES; l++) {
                const int n = panel * LANES + l;
                if (n >= rows) {
                    for (int c = 0; c < C; c++) t_panel[c * LANES + l] = 0.f;
                    continue;
                }
                const int s = n / H, h = n % H;
                const size_t token = (size_t)b * S + s;
                const float *ql = lat + ((size_t)h * tokens + token) * r, *qp = pe + (token * H + h) * dr;
                for (int c = 0; c < r; c++) t_panel[c * LANES + l] = ql[c];
                for (int c = 0; c < dr; c++) t_panel[(r + c) * LANES + l] = qp[c];
                /* the rows this query may see: up to its last visible one; all of them when it sees none. One read
                 * of the token's mask row for its H heads, from the end: a static cache's unwritten slots are hidden
                 * and its capacity may be far beyond the rows written */
                if (s != scanned) {
                    const uint8_t *hidden = mask + ((size_t)(md[0] == 1 ? 0 : b) * S + s) * T;
                    int t = T - 1;
                    while (t >= 0 && (hidden[t] != 0) == hidden_when) t--;
                    sees = t < 0 ? T : t + 1;
                    scanned = s;
                }
                seen = sees > seen ? sees : seen;
            }
            limit[b * panels + panel] = seen;
        }
    AttentionWork work = {B, S, T, H, C, r, panels, present, qt, p, limit, mask, (int)md[0], hidden_when,
                          kernel->scale, kernel->fill, o};
    const size_t spans = (size_t)(T + SPAN - 1) / SPAN, chunks = (size_t)(r + CHANNELS - 1) / CHANNELS;
    const size_t seen = (size_t)B * panels * LANES * T; /* the scores: query rows x cache rows */
    if (!status) status = parallel(ctx, run_scores, (size_t)B * panels * spans, &work, seen * C);
    if (!status) status = parallel(ctx, run_softmax, (size_t)B * panels, &work, seen * 8);
    if (!status) status = parallel(ctx, run_values, (size_t)B * panels * chunks, &work, seen * r);
    if (!status && float_uv) {
        const HeadFloatWork uv_work = {H, (int)tokens, r, dv, o, (const float *)ptr[13], ov};
        status = head_products(ctx, &uv_work);
    } else if (!status) {
        LinearWork uv_work = {(int)tokens, dv, 0, (const uint8_t *)ptr[13], ptr[14], 0, (size_t)r * bits_uv / 8,
                              signed_flip(bits_uv), {o, r, bits_uv, NULL, NULL, NULL, 0}, ov, 0,
                              by_panels ? &kernel->uv : NULL};
        status = run_products(ctx, &uv_work, H, &kernel->advised_uv);
    }
    for (size_t token = 0; !status && token < tokens; token++)
        for (int h = 0; h < H; h++)
            memcpy(y + (token * H + h) * dv, ov + ((size_t)h * tokens + token) * dv, (size_t)dv * sizeof(float));
    free(scratch.base);
    return status;
}

static OrtStatus *attention_create(const OrtCustomOp *op, const void *ort_api, const OrtKernelInfo *info, void **out) {
    (void)op, (void)ort_api;
    int64_t bits_uk, bits_uv, hidden_when;
    float scale, eps, fill;
    CHECK(CALL(KernelInfoGetAttribute_int64)(info, "bits_uk", &bits_uk));
    CHECK(CALL(KernelInfoGetAttribute_int64)(info, "bits_uv", &bits_uv));
    CHECK(CALL(KernelInfoGetAttribute_int64)(info, "hidden_when", &hidden_when));
    CHECK(CALL(KernelInfoGetAttribute_float)(info, "scale", &scale));
    CHECK(CALL(KernelInfoGetAttribute_float)(info, "eps", &eps));
    CHECK(CALL(KernelInfoGetAttribute_float)(info, "fill", &fill));
    if ((bits_uk != 4 && bits_uk != 8 && bits_uk != 32) || (bits_uv != 4 && bits_uv != 8 && bits_uv != 32) ||
        (hidden_when != 0 && hidden_when != 1))
        return fail("LatentAttention: bits_uk and bits_uv must be 4, 8 or 32 (float weights), hidden_when 0 or 1");
    AttentionKernel *kernel = calloc(1, sizeof(AttentionKernel));
    if (!kernel) return CALL(CreateStatus)(ORT_FAIL, "mla_deploy operator: out of memory");
    *kernel = (AttentionKernel){bits_uk, bits_uv, hidden_when, scale, eps, fill, 0, 0, 0, {NULL}, {0}, {0}};
    *out = kernel;
    return NULL;
}

static const char *attention_name(const OrtCustomOp *op) { (void)op; return "LatentAttention"; }
static int attention_input_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    if (i == 3) return TYPE_BOOL;
    /* the per-head weights: uint8 (quantized) or float (bits 32), as the attributes say */
    return i == 8 || i == 9 || i == 15 ? TYPE_INT64 : i == 11 || i == 13 ? TYPE_UNDEFINED : TYPE_FLOAT;
}
static size_t attention_input_count(const OrtCustomOp *op) { (void)op; return 16; }
static size_t two(const OrtCustomOp *op) { (void)op; return 2; }
/* 1: optional: the scales (absent for float weights) and write_indices */
static int optional_writes(const OrtCustomOp *op, size_t i) { (void)op; return i == 12 || i == 14 || i == 15; }

static OrtCustomOp latent_attention = {
    .version = 16, .GetName = attention_name, .GetExecutionProviderType = op_provider,
    .GetInputType = attention_input_type, .GetInputTypeCount = attention_input_count, .GetOutputType = output_type,
    .GetOutputTypeCount = two, .KernelDestroy = attention_destroy, .GetInputCharacteristic = optional_writes,
    .GetOutputCharacteristic = required, .GetInputMemoryType = default_memory, .GetVariadicInputMinArity = one,
    .GetVariadicInputHomogeneity = one, .GetVariadicOutputMinArity = one, .GetVariadicOutputHomogeneity = one,
    .CreateKernelV2 = attention_create, .KernelComputeV2 = attention_compute,
};

/* ---- mla_deploy.FloatExperts: RoutedExperts for float32 expert weights, the routing given -----------------------
 * Inputs: 0 input float [T, D]; 1 weights float [T, k] (used as they are); 2 fc1 float [E, 2I, D] (gate and up rows
 * interleaved, as ONNX Runtime's MoE takes them with swiglu_fusion 1); 3 fc2 float [E, D, I]; 4 chosen int64 [T, k]
 * (each in [0, E)); 5, 6 (optional) the layer's shared experts as S more experts of the same layout, fc1 float
 * [S, 2I, D] and fc2 float [S, D, I], each added to every token with weight 1 (a shared MLP of S*I units is S such
 * experts: SwiGLU acts unit by unit and down sums over the units). Output: float [T, D] = sum_j w_j *
 * fc2_j(silu(gate_j) * up_j) (+ the shared experts'), computed in float32 (ONNX Runtime's MoE and MatMul compute the
 * same sums in another order). Attribute: k. The CPU engine's build swaps it for a float MoE node where the export's
 * routing round trip feeds it, and gives it the shared experts where the graph adds them to its output
 * (mla_deploy/quant/own_ops.py). */

typedef struct {
    int64_t k;
    int advised;
} FloatExpertsKernel;

typedef struct {
    int D, I, T, k, E;          /* experts e >= E are the shared ones, e - E in fc1s and fc2s */
    const float *x, *fc1, *fc2, *fc1s, *fc2s;
    const int *count, *start, *pair_token, *used;
    float *a; /* [pairs, I]: silu(gate) * up */
    float *o; /* [pairs, D]: fc2's rows */
    int tiles2;
} FloatWork;

/* out[j * stride] = w . x_j for m (<= 4) vectors of K floats */
static inline __attribute__((always_inline)) void float_dots(const float *w, int K, int m, const float *const *x,
                                                             float *out, size_t stride) {
    float total[4] = {0.f, 0.f, 0.f, 0.f};
    int c = 0;
#if defined(__AVX512F__)
    __m512 acc[4];
    for (int j = 0; j < 4; j++) acc[j] = _mm512_setzero_ps();
    if (m == 1) { /* one vector (a decode step): two chains of FMAs, so that the loads, not the FMAs' latency, set the
                   * pace */
        __m512 odd = _mm512_setzero_ps();
        for (; c + 32 <= K; c += 32) {
            acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(w + c), _mm512_loadu_ps(x[0] + c), acc[0]);
            odd = _mm512_fmadd_ps(_mm512_loadu_ps(w + c + 16), _mm512_loadu_ps(x[0] + c + 16), odd);
        }
        acc[0] = _mm512_add_ps(acc[0], odd);
    }
    for (; c + 16 <= K; c += 16) {
        __m512 v = _mm512_loadu_ps(w + c);
        __asm__("" : "+v"(v)); /* held in a register for the m products (float_dots_4rows) */
        for (int j = 0; j < m; j++) acc[j] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x[j] + c), acc[j]);
    }
    for (int j = 0; j < m; j++) total[j] = _mm512_reduce_add_ps(acc[j]);
#endif
    double rest[4] = {0., 0., 0., 0.}; /* the values left over (all of them without AVX-512): one sum each, in double
                                        * so that a long one is no less exact than the vectors' 16 */
    for (; c < K; c++)
        for (int j = 0; j < m; j++) rest[j] += (double)w[c] * x[j][c];
    for (int j = 0; j < m; j++) out[j * stride] = (float)(total[j] + rest[j]);
}

/* out[j * stride + i] = w_i . x_j for 4 rows w_i (row_stride floats apart) and m (<= 4) vectors: each weight and
 * vector load serves 4 products (a prefill's experts compute, not stream). Each loaded value is held in a register
 * (the empty asm statements): without them GCC folds a load into every FMA, reading each weight 4 times, or each
 * vector 4 times, from cache; with them a V2-Lite MoE layer's experts over 512 tokens (FloatExperts alone, 2
 * threads) went from 68-71 to 143-150 GFLOP/s, the same sums in the same order. */
static void float_dots_4rows(const float *w, size_t row_stride, int K, int m, const float *const *x, float *out,
                             size_t stride) {
#if defined(__AVX512F__)
    if (K % 16 == 0) {
        __m512 acc[4][4];
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
        for (int c = 0; c < K; c += 16) {
            __m512 xs[4];
            for (int j = 0; j < m; j++) {
                xs[j] = _mm512_loadu_ps(x[j] + c);
                __asm__("" : "+v"(xs[j]));
            }
            for (int i = 0; i < 4; i++) {
                __m512 v = _mm512_loadu_ps(w + i * row_stride + c);
                __asm__("" : "+v"(v));
                for (int j = 0; j < m; j++) acc[i][j] = _mm512_fmadd_ps(v, xs[j], acc[i][j]);
            }
        }
        for (int j = 0; j < m; j++)
            for (int i = 0; i < 4; i++) out[j * stride + i] = _mm512_reduce_add_ps(acc[i][j]);
        return;
    }
#endif
    for (int i = 0; i < 4; i++) float_dots(w + i * row_stride, K, m, x, out + i, stride);
}

static void float_dot(const float *w, int K, int m, const float *const *x, float *out, size_t stride) {
    switch (m) {
    case 1: float_dots(w, K, 1, x, out, stride); break;
    case 2: float_dots(w, K, 2, x, out, stride); break;
    case 3: float_dots(w, K, 3, x, out, stride); break;
    default: float_dots(w, K, 4, x, out, stride); break;
    }
}

/* expert e's fc1 [2I, D] and fc2 [D, I]: a routed one's, or a shared one's (e >= E) */
static const float *float_fc1(const FloatWork *w, int e) {
    return e < w->E ? w->fc1 + (size_t)e * 2 * w->I * w->D : w->fc1s + (size_t)(e - w->E) * 2 * w->I * w->D;
}
static const float *float_fc2(const FloatWork *w, int e) {
    return e < w->E ? w->fc2 + (size_t)e * w->D * w->I : w->fc2s + (size_t)(e - w->E) * w->D * w->I;
}

/* stage 1, one item: an expert's 64 fc1 rows (32 gate and 32 up, interleaved) for all its pairs */
static void run_float_fc1(void *data, size_t item) {
    FloatWork *w = (FloatWork *)data;
    const int blocks = w->I / BLOCK, e = w->used[item / blocks], block = (int)(item % blocks), D = w->D;
    const float *rows = float_fc1(w, e) + (size_t)block * 2 * BLOCK * D;
    const int first = w->start[e], n = w->count[e];
    float h[4][2 * BLOCK];
    for (int p = 0; p < n; p += 4) {
        const int m = n - p < 4 ? n - p : 4;
        const float *x[4] = {NULL, NULL, NULL, NULL};
        for (int j = 0; j < m; j++) x[j] = w->x + (size_t)w->pair_token[first + p + j] * D;
        if (m == 4) /* many tokens (a prefill): four rows at a time */
            for (int r = 0; r < 2 * BLOCK; r += 4)
                float_dots_4rows(rows + (size_t)r * D, D, D, 4, x, &h[0][r], 2 * BLOCK);
        else
            for (int r = 0; r < 2 * BLOCK; r++) float_dot(rows + (size_t)r * D, D, m, x, &h[0][r], 2 * BLOCK);
        for (int j = 0; j < m; j++) {
            float *a = w->a + (size_t)(first + p + j) * w->I + block * BLOCK;
            for (int i = 0; i < BLOCK; i++) {
                const float gate = h[j][2 * i], up = h[j][2 * i + 1];
                a[i] = gate / (1.f + expf(-gate)) * up;
            }
        }
    }
}

/* stage 2, one item: an expert's TILE fc2 rows for all its pairs */
static void run_float_fc2(void *data, size_t item) {
    FloatWork *w = (FloatWork *)data;
    const int e = w->used[item / w->tiles2], tile = (int)(item % w->tiles2), D = w->D, K = w->I;
    const int r0 = tile * TILE, r1 = r0 + TILE < D ? r0 + TILE : D;
    const int first = w->start[e], n = w->count[e];
    for (int p = 0; p < n; p += 4) {
        const int m = n - p < 4 ? n - p : 4;
        const float *x[4] = {NULL, NULL, NULL, NULL};
        for (int j = 0; j < m; j++) x[j] = w->a + (size_t)(first + p + j) * K;
        int r = r0;
        const float *fc2 = float_fc2(w, e);
        for (; m == 4 && r + 4 <= r1; r += 4)
            float_dots_4rows(fc2 + (size_t)r * K, K, K, 4, x, w->o + (size_t)(first + p) * D + r, (size_t)D);
        for (; r < r1; r++) float_dot(fc2 + (size_t)r * K, K, m, x, w->o + (size_t)(first + p) * D + r, (size_t)D);
    }
}

static OrtStatus *float_experts_compute(void *kernel_data, OrtKernelContext *ctx) {
    FloatExpertsKernel *kernel = (FloatExpertsKernel *)kernel_data;
    const OrtValue *in[7];
    for (size_t i = 0; i < 7; i++) CHECK(CALL(KernelContext_GetInput)(ctx, i, &in[i]));
    for (int i = 0; i < 5; i++)
        if (!in[i]) return fail("FloatExperts: inputs 0 to 4 are required");
    if (!in[5] != !in[6]) return fail("FloatExperts: the shared experts need both fc1 and fc2 (inputs 5 and 6)");
    int64_t xs[2], ws[2], w1[3], w2[3], cs[2], s1[3] = {0, 0, 0}, s2[3] = {0, 0, 0};
    CHECK(shape_of(in[0], TYPE_FLOAT, 2, xs, "FloatExperts: input must be float [T, D]"));
    CHECK(shape_of(in[1], TYPE_FLOAT, 2, ws, "FloatExperts: the routing weights must be float [T, k]"));
    CHECK(shape_of(in[2], TYPE_FLOAT, 3, w1, "FloatExperts: fc1 must be float [E, 2I, D]"));
    CHECK(shape_of(in[3], TYPE_FLOAT, 3, w2, "FloatExperts: fc2 must be float [E, D, I]"));
    CHECK(shape_of(in[4], TYPE_INT64, 2, cs, "FloatExperts: the chosen experts must be int64 [T, k]"));
    if (in[5]) {
        CHECK(shape_of(in[5], TYPE_FLOAT, 3, s1, "FloatExperts: the shared fc1 must be float [S, 2I, D]"));
        CHECK(shape_of(in[6], TYPE_FLOAT, 3, s2, "FloatExperts: the shared fc2 must be float [S, D, I]"));
    }
    const int T = (int)xs[0], D = (int)xs[1], E = (int)w1[0], I = (int)(w1[1] / 2), k = (int)kernel->k;
    const int S = (int)s1[0], kk = k + S; /* each token's choices: its k routed experts, then the S shared ones */
    if (ws[0] != T || ws[1] != k || cs[0] != T || cs[1] != k || w1[1] != 2 * I || w1[2] != D || w2[0] != E ||
        w2[1] != D || w2[2] != I || I % BLOCK || k < 1 ||
        (S && (s1[1] != 2 * I || s1[2] != D || s2[0] != S || s2[1] != D || s2[2] != I)))
        return fail("FloatExperts: the input shapes do not agree (see cpu_ops.c)");
    OrtValue *output;
    CHECK(CALL(KernelContext_GetOutput)(ctx, 0, xs, 2, &output));
    void *ptr[8] = {NULL};
    for (int i = 0; i < 7; i++)
        if (in[i]) CHECK(CALL(GetTensorMutableData)((OrtValue *)in[i], &ptr[i]));
    CHECK(CALL(GetTensorMutableData)(output, &ptr[7]));
    const void *weights[4] = {ptr[2], ptr[3], ptr[5], ptr[6]};
    const size_t weight_bytes[4] = {(size_t)E * 2 * I * D * sizeof(float), (size_t)E * D * I * sizeof(float),
                                    (size_t)S * 2 * I * D * sizeof(float), (size_t)S * D * I * sizeof(float)};
    advise_huge(&kernel->advised, weights, weight_bytes, S ? 4 : 2);
    if (T == 0) return NULL;
    const float *routing = (const float *)ptr[1];
    const int64_t *picked = (const int64_t *)ptr[4];
    const size_t pairs = (size_t)T * kk;
    for (size_t i = 0; i < (size_t)T * k; i++)
        if (picked[i] < 0 || picked[i] >= E) return fail("FloatExperts: a chosen expert lies outside [0, E)");
    Scratch scratch = {malloc(aligned(pairs * sizeof(int)) * 3 + aligned((E + S) * sizeof(int)) * 3 +
                              aligned(pairs * sizeof(float)) + aligned(pairs * I * sizeof(float)) +
                              aligned(pairs * D * sizeof(float))), NULL};
    if (!scratch.base) return CALL(CreateStatus)(ORT_FAIL, "FloatExperts: out of memory");
    scratch.at = scratch.base;
    int *pair_token = take(&scratch, pairs * sizeof(int)), *pair_of = take(&scratch, pairs * sizeof(int));
    int *count = take(&scratch, (E + S) * sizeof(int)), *start = take(&scratch, (E + S) * sizeof(int));
    int *used = take(&scratch, (E + S) * sizeof(int)), *chosen = take(&scratch, pairs * sizeof(int));
    float *weight = take(&scratch, pairs * sizeof(float));
    for (int t = 0; t < T; t++)
        for (int j = 0; j < kk; j++) {
            const size_t at = (size_t)t * kk + j, given = (size_t)t * k + j;
            chosen[at] = j < k ? (int)picked[given] : E + (j - k);
            weight[at] = j < k ? routing[given] : 1.f;
        }
    const int n_used = group_pairs(chosen, pairs, kk, E + S, count, start, used, pair_token, pair_of);
    FloatWork w = {D, I, T, kk, E, (const float *)ptr[0], (const float *)ptr[2], (const float *)ptr[3],
                   (const float *)ptr[5], (const float *)ptr[6], count, start, pair_token, used,
                   take(&scratch, pairs * I * sizeof(float)), take(&scratch, pairs * D * sizeof(float)),
                   (D + TILE - 1) / TILE};
    OrtStatus *status = CALL(KernelContext_ParallelFor)(ctx, run_float_fc1, (size_t)n_used * (I / BLOCK), 0, &w);
    if (!status) status = CALL(KernelContext_ParallelFor)(ctx, run_float_fc2, (size_t)n_used * w.tiles2, 0, &w);
    if (!status) combine((float *)ptr[7], T, D, kk, weight, pair_of, w.o, NULL);
    free(scratch.base);
    return status;
}

static OrtStatus *float_experts_create(const OrtCustomOp *op, const void *ort_api, const OrtKernelInfo *info,
                                       void **out) {
    (void)op, (void)ort_api;
    int64_t k;
    CHECK(CALL(KernelInfoGetAttribute_int64)(info, "k", &k));
    if (k < 1) return fail("FloatExperts: k must be >= 1");
    FloatExpertsKernel *kernel = calloc(1, sizeof(FloatExpertsKernel));
    if (!kernel) return CALL(CreateStatus)(ORT_FAIL, "mla_deploy operator: out of memory");
    kernel->k = k;
    *out = kernel;
    return NULL;
}

static const char *float_experts_name(const OrtCustomOp *op) { (void)op; return "FloatExperts"; }
static int float_experts_input_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 4 ? TYPE_INT64 : TYPE_FLOAT;
}
static size_t float_experts_input_count(const OrtCustomOp *op) { (void)op; return 7; }
static int optional_shared(const OrtCustomOp *op, size_t i) { (void)op; return i >= 5; } /* the shared experts */

static OrtCustomOp float_experts = OP_TABLE(float_experts_name, float_experts_input_type, float_experts_input_count,
                                            float_experts_create, float_experts_compute, optional_shared);

/* ---- mla_deploy.FloatMatMul: ONNX MatMul for float32 A and a weight given transposed ---------------------------
 * Inputs: 0 A float [..., K] (a weight of 2 dimensions) or [..., H, M, K] (of 3: a product per head); 1 WT float
 * [N, K] or [H, N, K] (the graph's weight [K, N] or [H, K, N] transposed by the engine build,
 * own_ops.swap_float_linear: row n holds output column n's K weights). Output: float [..., N] or [..., H, M, N] = A . W.
 * Up to FLOAT_ROWS rows of A per head (a decode step): computed here, each output a dot product over one of WT's
 * rows, WT streamed once, row after row, from where ONNX Runtime maps it (on 2 MiB pages, advise_huge), each work
 * item FLOAT_ITEM_BYTES of one head's rows. More rows (a prefill): ONNX Runtime's own FusedMatMul (com.microsoft,
 * transB 1: a MatMul of A and WT with its last two axes swapped), created with the kernel (CreateOp) and run on the
 * same inputs and output (InvokeOp; it packs WT per call, as it does for a weight it was not given at load). The
 * sums are float32 in another order than MLAS's.
 * Why W^T: a dot product over a row streams one run of memory, where A . W over W's rows (each row of W scaled by one
 * of A's values and added into N sums) streams several at once and rewrites the sums: two threads streamed a 2048 x
 * 102400 weight at 55-58 GB/s that way, 62-63 as dot products, where a plain read of it reached 62-64 (a throwaway
 * microbenchmark on the development machine, in its fast bandwidth state; the same in its slow state). */

#define FLOAT_ROWS 8                  /* rows of A per head computed here; more go to ONNX Runtime's FusedMatMul */
#define FLOAT_ITEM_BYTES (128 << 10) /* bytes of WT per work item, at least one row */

typedef struct {
    OrtOp *matmul; /* ONNX Runtime's FusedMatMul (transB) for more than FLOAT_ROWS rows */
    int advised;
} FloatLinearKernel;

typedef struct {
    int K, N, H;      /* H: heads, 1 for a weight of 2 dimensions */
    int P, M;         /* A's rows of each head: M at each of P leading positions */
    int rows, chunks; /* rows of WT per item; items per head */
    const float *a, *wt;
    float *out;
} FloatLinearWork;

/* one item: out[p, h, j, n] = a[p, h, j] . wt[h, n] for its head h, its rows n of WT and every p, j */
static void run_float_linear(void *data, size_t item) {
    const FloatLinearWork *w = (const FloatLinearWork *)data;
    const int h = (int)item / w->chunks, chunk = (int)item % w->chunks, K = w->K;
    const int n0 = chunk * w->rows, n1 = n0 + w->rows < w->N ? n0 + w->rows : w->N;
    const float *wt = w->wt + (size_t)h * w->N * K;
    const float *x[FLOAT_ROWS];
    float *o[FLOAT_ROWS];
    int m = 0;
    for (int p = 0; p < w->P; p++)
        for (int j = 0; j < w->M; j++, m++) {
            const size_t row = ((size_t)p * w->H + h) * w->M + j;
            x[m] = w->a + row * K;
            o[m] = w->out + row * w->N;
        }
    for (int n = n0; n < n1; n++)
        for (int j = 0; j < m; j += 4) { /* more than 4 rows of A: WT's row again, from cache */
            const int count = m - j < 4 ? m - j : 4;
            float sums[4];
            float_dot(wt + (size_t)n * K, K, count, x + j, sums, 1);
            for (int i = 0; i < count; i++) o[j + i][n] = sums[i];
        }
}

static OrtStatus *float_linear_compute(void *kernel_data, OrtKernelContext *ctx) {
    FloatLinearKernel *kernel = (FloatLinearKernel *)kernel_data;
    const OrtValue *in[2];
    for (size_t i = 0; i < 2; i++) CHECK(CALL(KernelContext_GetInput)(ctx, i, &in[i]));
    int64_t dims[8], wd[8], od[8];
    size_t rank = 0, wrank = 0;
    int type = 0, wtype = 0;
    CHECK(operand_shape(in[0], dims, &rank, &type));
    CHECK(operand_shape(in[1], wd, &wrank, &wtype));
    if (wtype != TYPE_FLOAT || (wrank != 2 && wrank != 3))
        return fail("FloatMatMul: WT must be float [N, K] or [H, N, K]");
    const int H = wrank == 3 ? (int)wd[0] : 1, N = (int)wd[wrank - 2], K = (int)wd[wrank - 1];
    if (type != TYPE_FLOAT || rank < wrank - 1 || rank > 7 || dims[rank - 1] != K)
        return fail(wrank == 3 ? "FloatMatMul: A must be float [..., M, K] for WT [H, N, K]"
                               : "FloatMatMul: A must be float [..., K], K the columns of WT [N, K]");
    /* the output, as MatMul broadcasts: A [..., K] . W [K, N] -> [..., N]; A [..., M, K] . W [H, K, N] -> the
     * batch axes of A and [H] broadcast, then [M, N] */
    size_t orank = rank;
    memcpy(od, dims, rank * sizeof(int64_t));
    int own = 1; /* A [..., H, M, K] or W of 2 dimensions: computed here (up to FLOAT_ROWS rows a head) */
    if (wrank == 3) {
        if (rank == 2) { /* A [M, K]: every head's */
            od[0] = H, od[1] = dims[0], orank = 3, own = 0;
        } else if (dims[rank - 3] != H) {
            if (dims[rank - 3] != 1 && H != 1)
                return fail("FloatMatMul: A's heads axis must be WT's H or 1");
            od[rank - 3] = dims[rank - 3] == 1 ? H : dims[rank - 3];
            own = 0;
        }
    }
    od[orank - 1] = N;
    OrtValue *output;
    CHECK(CALL(KernelContext_GetOutput)(ctx, 0, od, orank, &output));
    size_t rows = 1; /* of A per head */
    for (size_t i = 0; i + 1 < rank; i++) rows *= (size_t)dims[i];
    if (own) rows /= (size_t)(H ? H : 1);
    if (!own || rows > FLOAT_ROWS) return CALL(InvokeOp)(ctx, kernel->matmul, in, 2, &output, 1);
    void *ptr[3];
    for (int i = 0; i < 2; i++) CHECK(CALL(GetTensorMutableData)((OrtValue *)in[i], &ptr[i]));
    CHECK(CALL(GetTensorMutableData)(output, &ptr[2]));
    const void *weights[1] = {ptr[1]};
    const size_t weight_bytes[1] = {(size_t)H * K * N * sizeof(float)};
    advise_huge(&kernel->advised, weights, weight_bytes, 1);
    if (rows == 0 || N == 0 || H == 0) return NULL;
    if (K == 0) {
        memset(ptr[2], 0, rows * H * (size_t)N * sizeof(float));
        return NULL;
    }
    const int M = wrank == 3 ? (int)dims[rank - 2] : (int)rows, P = (int)rows / M;
    const size_t row_bytes = (size_t)K * sizeof(float);
    const int per_item = row_bytes >= FLOAT_ITEM_BYTES ? 1 : (int)(FLOAT_ITEM_BYTES / row_bytes);
    const int chunks = (N + per_item - 1) / per_item;
    FloatLinearWork w = {K, N, H, P, M, per_item, chunks, (const float *)ptr[0], (const float *)ptr[1],
                         (float *)ptr[2]};
    return parallel(ctx, run_float_linear, (size_t)H * chunks, &w, rows * H * (size_t)K * N);
}

static OrtStatus *float_linear_create(const OrtCustomOp *op, const void *ort_api, const OrtKernelInfo *info,
                                      void **out) {
    (void)op, (void)ort_api;
    FloatLinearKernel *kernel = calloc(1, sizeof(FloatLinearKernel));
    if (!kernel) return CALL(CreateStatus)(ORT_FAIL, "mla_deploy operator: out of memory");
    const char *names[1] = {"T"};
    const int types[1] = {TYPE_FLOAT};
    const int64_t one = 1;
    OrtOpAttr *trans_b;
    OrtStatus *status = CALL(CreateOpAttr)("transB", &one, 1, 1, &trans_b);
    if (!status) {
        const void *attrs[1] = {trans_b};
        status = CALL(CreateOp)(info, "FusedMatMul", "com.microsoft", 1, names, types, 1, attrs, 1, 2, 1,
                                &kernel->matmul);
        CALL(ReleaseOpAttr)(trans_b);
    }
    if (status) {
        free(kernel);
        return status;
    }
    *out = kernel;
    return NULL;
}

static void float_linear_destroy(void *data) {
    FloatLinearKernel *kernel = (FloatLinearKernel *)data;
    if (kernel->matmul) CALL(ReleaseOp)(kernel->matmul);
    free(kernel);
}

static const char *float_linear_name(const OrtCustomOp *op) { (void)op; return "FloatMatMul"; }
static int float_linear_input_type(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return TYPE_FLOAT; }
static size_t float_linear_input_count(const OrtCustomOp *op) { (void)op; return 2; }

static OrtCustomOp float_matmul = OP_TABLE_FREED(float_linear_name, float_linear_input_type, float_linear_input_count,
                                                 float_linear_create, float_linear_compute, required,
                                                 float_linear_destroy);

/* which code path this build computes with: 1 AVX-512 VNNI, 0 another (mla_deploy_cpu_ops_isa says which) */
int mla_deploy_cpu_ops_vnni(void) { return VNNI; }

/* the instruction set of this build's integer products: "avx512-vnni", "avx-vnni", "avx2" or "portable"; also a
 * marker in the library's bytes, which mla_deploy/ort/operators.py reads without loading the library (a process
 * that loaded a library from a path keeps that one for the path, whatever file is there later) */
#define ISA_MARKER "mla_deploy_cpu_ops_isa="
static const char isa_marker[] __attribute__((used)) = ISA_MARKER ISA ";";
const char *mla_deploy_cpu_ops_isa(void) { return ISA; }

/* the OrtApi version whose table positions this file uses (mla_deploy/ort/operators.py refuses an older ONNX Runtime) */
int mla_deploy_cpu_ops_api_version(void) { return API_VERSION; }

__attribute__((visibility("default"))) OrtStatus *RegisterCustomOps(OrtSessionOptions *options,
                                                                    const OrtApiBase *base) {
    const void *table = base->GetApi(API_VERSION);
    if (!table) { /* an ONNX Runtime older than the entries used here: say so through the oldest API */
        void *const *oldest = (void *const *)base->GetApi(1);
        return ((CreateStatus_t)oldest[API_CreateStatus])(ORT_FAIL, "the mla-deploy operators need a newer ONNX Runtime C API");
    }
    api = (void *const *)table;
    static OrtCustomOpDomain *domain; /* lives as long as the process: sessions keep pointing at it */
    if (!domain) {
        OrtCustomOpDomain *created;
        CHECK(CALL(CreateCustomOpDomain)("mla_deploy", &created));
        CHECK(CALL(CustomOpDomain_Add)(created, &routed_experts));
        CHECK(CALL(CustomOpDomain_Add)(created, &blockwise_matmul));
        CHECK(CALL(CustomOpDomain_Add)(created, &headwise_matmul));
        CHECK(CALL(CustomOpDomain_Add)(created, &latent_attention));
        CHECK(CALL(CustomOpDomain_Add)(created, &float_experts));
        CHECK(CALL(CustomOpDomain_Add)(created, &float_matmul));
        domain = created;
    }
    return CALL(AddCustomOpDomain)(options, domain);
}
