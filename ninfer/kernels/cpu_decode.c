/* One CPU decode step of a Llama-family model with int8 weight-only matmuls (issue 23).

A decode step on the CPU streams the weights through memory once; torch's int8 weight-only kernel does
that at ~5 GB/s a core and every small torch op costs microseconds, so the whole step runs here, one call
from Python: per layer RMSNorm, the merged q/k/v matmul, RoPE, the KV write, attention over the paged
context in place, o, RMSNorm, gate/up, SiLU-and-mul, down, with the residual stream in fp32.

Matmuls (`qgemv`): each activation row is quantized to int16 against its absolute maximum (16383 levels,
an error ~1e-5 of the maximum, far below the bf16 rounding the torch path takes) so that AVX-512 VNNI's
int16 dot (vpdpwssd) takes 32 weights an instruction. Sums are exact int32 per 256-element chunk, added in
fp32 in chunk order: the vector and the plain C paths give the same bits. Each weight row is read once,
sequentially, for all rows of x (a decode batch), so the hardware prefetcher streams it.

Attention: a job is (sequence, KV head, chunk of CHUNK context tokens); it scores the chunk for the KV
head's query heads, takes its softmax partials (max, sum, weighted V) and the partials merge by
log-sum-exp. The context is read through the page table, in place.

Quantized KV (`--kv-dtype int8 | nvfp4 | k8v4`, layouts in ninfer/forward.py): a step writes each new token's
K and V rows quantized exactly as `ninfer.kernels.attention.quantize_kv` does (the same fp32 operations, so
the same bytes from the same bf16 values). int8 K and V are read in place by the vector passes: their integers
are exact in bf16, a token's K scale multiplies its scores and its V scale its softmax weight. Other quantized
rows (NVFP4, and int8 where the vector passes do not apply) are first expanded into a per-thread bf16 scratch
(each value as `dequantize_kv` gives it in bf16), the bf16 passes then running over that scratch; the
expansion costs about what the fewer bytes save (bench/results/2026-12-05-cpu-s22).

On CPUs with AMX (and head_dim 64 or 128, at most 8 query heads a KV head) a chunk's scores and weighted values
run as tile products instead of the vector passes (`amx_scores`, `amx_values`, `amx_values_int8`;
NINFER_CPU_AMX=0 turns them off): a fifth to a third less compute a token (bench/results/2026-12-05-cpu-s23).

Built and loaded by ninfer/kernels/cpu_native.py (gcc -O3 -march=native -fopenmp). All pointers are to
contiguous tensors owned by Python; bf16 values are uint16 bit patterns. */

#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define NINFER_AVX512 1 /* the matmuls' int16 dot (vpdpwssd) */
#if defined(__AVX512BF16__)
#define NINFER_BF16 1   /* attention's bf16 pair dots (vdpbf16ps) */
#endif
#endif

#define QMAX 16383.0f /* int16 activations: 2^14 - 1 keeps 256 products of |w| <= 127 inside int32 */
#define KCHUNK 256
#define CHUNK 128     /* context tokens per attention job */
#define MAX_HEADS 64  /* query heads */
#define MAX_DIM 256   /* head_dim */

typedef struct {
    const int8_t *w;         /* [n, k] */
    const uint16_t *scale;   /* [n] bf16: row scales */
    int64_t n, k;
} qlinear;

typedef struct {
    const uint16_t *input_norm, *post_norm; /* [hidden] bf16 */
    qlinear qkv, o, gate_up, down;
} layer_t;

/* KV storage of a cache tensor, per (slot, KV head) row: d bf16 values; d int8 values; or an NVFP4 row, d/2
   bytes of E2M1 codes (element 2j in the low nibble) then d/16 E4M3 block scales. Quantized rows have an fp32
   scale each. */
enum { KV_BF16 = 0, KV_INT8 = 1, KV_NVFP4 = 2 };

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter, threads;
    float eps, attn_scale;
    const layer_t *layer;
    const uint16_t *final_norm;
    uint8_t *k_cache, *v_cache;   /* [layers, slots, kv_heads, row] */
    float *k_scale, *v_scale;     /* [layers, slots, kv_heads]: quantized kinds only */
    int64_t k_kind, v_kind;       /* KV_* */
    int64_t k_layer_bytes, v_layer_bytes, scale_layer_stride; /* between two layers (scales: elements) */
} model_t;

/* one layer of one cache tensor, as attention reads it */
typedef struct {
    const uint8_t *rows;
    const float *scale;
    int64_t kind;
} kv_layer;

static inline int64_t kv_row_bytes(int64_t kind, int64_t d) {
    return kind == KV_BF16 ? 2 * d : kind == KV_INT8 ? d : d / 2 + d / 16;
}

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* ---- int8 weight x int16 activation matmul ---------------------------------------------------------- */

/* x [m, k] fp32 -> xq [m, kpad] int16 (zero padded to a multiple of 32) and per-row dequant scales */
static void quantize_rows(const float *x, int64_t m, int64_t k, int64_t kpad, int16_t *xq, float *xs) {
    for (int64_t r = 0; r < m; r++) {
        const float *row = x + r * k;
        float amax = 0.0f;
        for (int64_t i = 0; i < k; i++) amax = fmaxf(amax, fabsf(row[i]));
        float q = amax > 0.0f ? QMAX / amax : 0.0f;
        xs[r] = amax / QMAX;
        int16_t *out = xq + r * kpad;
        for (int64_t i = 0; i < k; i++) out[i] = (int16_t)lrintf(row[i] * q);
        for (int64_t i = k; i < kpad; i++) out[i] = 0;
    }
}

static inline int64_t pad32(int64_t k) { return (k + 31) & ~(int64_t)31; }

/* sum_i w[i] * xq[i] over k (xq zero padded to a multiple of 32): int32 per KCHUNK, fp32 across them */
static inline float dot_q(const int8_t *w, const int16_t *xq, int64_t k) {
    float total = 0.0f;
    for (int64_t c = 0; c < k; c += KCHUNK) {
        int64_t end = c + KCHUNK < k ? c + KCHUNK : k;
        int64_t i = c;
        int32_t part = 0;
#ifdef NINFER_AVX512
        __m512i acc = _mm512_setzero_si512();
        for (; i + 32 <= end; i += 32) {
            __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + i)));
            acc = _mm512_dpwssd_epi32(acc, wv, _mm512_loadu_si512((const void *)(xq + i)));
        }
        part = _mm512_reduce_add_epi32(acc);
#endif
        for (; i < end; i++) part += (int32_t)w[i] * (int32_t)xq[i];
        total += (float)part;
    }
    return total;
}

/* y[r, n] = scale[n] * xs[r] * sum_i w[n, i] * xq[r, i] for the m rows of x; shares the rows of W among
   the threads of the enclosing parallel region (an orphaned `omp for`, barrier at its end). */
static void qgemv(const qlinear *L, const int16_t *xq, const float *xs, int64_t m, float *y) {
    int64_t n = L->n, k = L->k, kp = pad32(k);
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const int8_t *wr = L->w + j * k;
        float s = bf16_to_f32(L->scale[j]);
        for (int64_t r = 0; r < m; r++) y[r * n + j] = dot_q(wr, xq + r * kp, k) * s * xs[r];
    }
}

/* ---- small per-row ops -------------------------------------------------------------------------------- */

static void rms_norm(const float *x, const uint16_t *w, int64_t h, float eps, float *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < h; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)h + eps);
    for (int64_t i = 0; i < h; i++) out[i] = x[i] * inv * bf16_to_f32(w[i]);
}

/* RoPE in the rotate-half form: out = x * cos + rotate_half(x) * sin, cos/sin [d] (halves repeated) */
static void rope(float *x, const float *cos, const float *sin, int64_t d) {
    int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* exp for x <= 0 (scores minus their maximum): 2^n * 2^f with f in [-0.5, 0.5], a degree-7 series
   (relative error ~1e-7); plain arithmetic so the compiler vectorizes a loop of it */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.4426950408889634f;
    float n = rintf(t);
    float f = (t - n) * 0.6931471805599453f;
    float p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720 + f * (1.0f / 5040)))))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* ---- quantized KV rows -------------------------------------------------------------------------------- */

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* an E4M3 (float8_e4m3fn) byte's value; every byte a quantized row holds is finite and non-negative */
static inline float e4m3_value(uint8_t c) {
    uint32_t e = (c >> 3) & 15, m = c & 7, bits = ((e + 120) << 23) | (m << 20); /* normal: fp32 fields */
    float v;
    memcpy(&v, &bits, 4);
    v = e ? v : (float)m * 0x1p-9f; /* subnormal: m 2^-9 */
    return c & 0x80 ? -v : v;
}

/* 0 <= x <= 448 rounded to the nearest E4M3 byte, ties to even (torch's fp32 -> float8_e4m3fn) */
static uint8_t e4m3_rne(float x) {
    if (x < 0x1p-6f) return (uint8_t)nearbyintf(x * 512.0f); /* subnormals: steps of 2^-9 (8: the first normal) */
    int e;
    float m = frexpf(x, &e);              /* x = m 2^e, m in [0.5, 1) */
    int q = (int)nearbyintf(m * 16.0f - 8.0f); /* 3 mantissa bits, exact operands */
    if (q == 8) q = 0, e++;
    return (uint8_t)(((e - 1 + 7) << 3) | q);
}

/* the E2M1 code nearest v (a value over its block scale): ties to the even code, saturating at 6, no -0
   (ninfer.quant.nvfp4._e2m1_codes) */
static inline uint8_t e2m1_code(float v) {
    float a = fabsf(v);
    uint8_t c = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
    return v < 0.0f && c ? c | 8 : c;
}

/* x (d values, bf16 already) -> one quantized row at dst and its scale: the fp32 operations of
   ninfer.kernels.attention.quantize_kv, in its order */
static void quantize_kv_row(const float *x, int64_t d, int64_t kind, uint8_t *dst, float *scale) {
    float amax = 0.0f;
    for (int64_t i = 0; i < d; i++) amax = fmaxf(amax, fabsf(x[i]));
    float s = amax * (kind == KV_INT8 ? (float)(1.0 / 127.0) : (float)(1.0 / 2688.0));
    s = s < FLT_MIN ? FLT_MIN : s;
    float r = 1.0f / s;
    *scale = s;
    if (kind == KV_INT8) {
        for (int64_t i = 0; i < d; i++) {
            volatile float y = x[i] * r; /* rounded before the half is added: no fused multiply-add */
            float v = fminf(fmaxf(y, -127.0f), 127.0f);
            ((int8_t *)dst)[i] = (int8_t)truncf(v >= 0.0f ? v + 0.5f : v - 0.5f);
        }
        return;
    }
    float u[MAX_DIM];
    for (int64_t i = 0; i < d; i++) u[i] = x[i] * r;
    for (int64_t j = 0; j < d / 16; j++) {
        const float *blk = u + 16 * j;
        float bm = 0.0f;
        for (int i = 0; i < 16; i++) bm = fmaxf(bm, fabsf(blk[i]));
        uint8_t code = e4m3_rne(fminf(bm / 6.0f, 448.0f));
        float b = e4m3_value(code);
        dst[d / 2 + j] = code;
        for (int i = 0; i < 16; i += 2) {
            uint8_t lo = b > 0.0f ? e2m1_code(blk[i] / b) : 0, hi = b > 0.0f ? e2m1_code(blk[i + 1] / b) : 0;
            dst[8 * j + i / 2] = (uint8_t)(lo | (hi << 4));
        }
    }
}

/* one quantized row (scale s) -> d bf16 values, each as dequantize_kv gives it in bf16: int8 value * s;
   NVFP4: e2m1 * block scale (exact) * s; rounded once */
static void dequantize_kv_row(const uint8_t *src, float s, int64_t d, int64_t kind, uint16_t *out) {
    int64_t i = 0;
    if (kind == KV_INT8) {
#ifdef NINFER_BF16
        const __m512 sv = _mm512_set1_ps(s);
        for (; i + 16 <= d; i += 16) {
            __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + i))));
            _mm256_storeu_si256((__m256i *)(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(f, sv)));
        }
#endif
        for (; i < d; i++) out[i] = f32_to_bf16((float)((const int8_t *)src)[i] * s);
        return;
    }
    const uint8_t *scales = src + d / 2;
#ifdef NINFER_BF16
    const __m512 table = _mm512_loadu_ps(E2M1), sv = _mm512_set1_ps(s);
    const __m128i nibble = _mm_set1_epi8(0x0F);
    for (; i + 16 <= d; i += 16) {
        __m128i b = _mm_loadl_epi64((const __m128i *)(src + i / 2));
        __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(b, nibble), _mm_and_si128(_mm_srli_epi16(b, 4), nibble));
        __m512 v = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(codes), table);
        v = _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(e4m3_value(scales[i / 16]))), sv);
        _mm256_storeu_si256((__m256i *)(out + i), (__m256i)_mm512_cvtneps_pbh(v));
    }
#endif
    for (; i < d; i++) {
        uint8_t c = (src[i / 2] >> (4 * (i & 1))) & 15;
        out[i] = f32_to_bf16(E2M1[c] * e4m3_value(scales[i / 16]) * s);
    }
}

/* rows [n, d] (bf16 values as fp32) quantized into n rows of `kind` and their scales (tests) */
int ninfer_quantize_kv(const float *x, int64_t n, int64_t d, int64_t kind, uint8_t *dst, float *scales) {
    if (kind != KV_INT8 && kind != KV_NVFP4) return -1;
    if (d > MAX_DIM || (kind == KV_NVFP4 && d % 16)) return -1;
    for (int64_t r = 0; r < n; r++) quantize_kv_row(x + r * d, d, kind, dst + r * kv_row_bytes(kind, d), scales + r);
    return 0;
}

/* n quantized rows -> [n, d] bf16 (tests) */
int ninfer_dequantize_kv(const uint8_t *src, const float *scales, int64_t n, int64_t d, int64_t kind, uint16_t *out) {
    if (kind != KV_INT8 && kind != KV_NVFP4) return -1;
    for (int64_t r = 0; r < n; r++) dequantize_kv_row(src + r * kv_row_bytes(kind, d), scales[r], d, kind, out + r * d);
    return 0;
}

/* ---- attention ------------------------------------------------------------------------------------------ */

typedef struct {
    int64_t seq, start, end;
} attn_job;

#ifdef NINFER_BF16
/* exp_nonpos on 16 lanes: scalef(p(f), n) = p(f) * 2^n */
static inline __m512 exp_nonpos16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

#ifdef NINFER_BF16
#define VEC_HEADS 32 /* the vector path: at most this many query heads, head_dim at most 128 */

/* 32 int8 values (|v| <= 127) as 32 bf16, exactly */
static inline __m512bh bf16_of_int8(const int8_t *p) {
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* Scores of one KV head's g query heads (q: [g, 32 * n32]) against a chunk's rows of that head (kh + rows[t]),
   as bf16 pair dots (q rounded to bf16 once, as the torch path holds it; fp32 sums), times scale. 16 tokens'
   partial vectors are summed across lanes together (a transposing reduction, ~2 operations a token instead
   of ~8). int8 K (kh8 and kscale, each token's scale): the rows are read as their integers and a token's dots
   taken times its scale. */
static inline __attribute__((always_inline)) void scores_pass(const int64_t g, const int64_t n32, const float *q,
                                                             const uint16_t *kh, const int64_t *rows, int64_t len,
                                                             float scale, float *scores, const int8_t *kh8,
                                                             const float *kscale) {
    static const int token_lane[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
    const __m512i order = _mm512_loadu_si512((const void *)token_lane);
    __m512bh qv[VEC_HEADS * 4];
    for (int64_t h = 0; h < g; h++)
        for (int64_t i = 0; i < n32; i++) {
            const float *src = q + (h * n32 + i) * 32;
            qv[h * n32 + i] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
        }
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        int64_t tn = len - t0 < 16 ? len - t0 : 16;
        __m512 r[VEC_HEADS][16];
        for (int64_t tt = 0; tt < 16; tt++) {
            __m512bh kb[4];
            for (int64_t i = 0; i < n32; i++)
                kb[i] = tt >= tn ? (__m512bh)_mm512_setzero_si512()
                        : kh8 ? bf16_of_int8(kh8 + rows[t0 + tt] + 32 * i)
                              : (__m512bh)_mm512_loadu_si512((const void *)(kh + rows[t0 + tt] + 32 * i));
            for (int64_t h = 0; h < g; h++) {
                __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[h * n32], kb[0]);
                for (int64_t i = 1; i < n32; i++) acc = _mm512_dpbf16_ps(acc, qv[h * n32 + i], kb[i]);
                r[h][tt] = acc;
            }
        }
        for (int64_t h = 0; h < g; h++) {
            __m512 *v = r[h];
            for (int i = 0; i < 8; i++) /* lanes 0-7: token i, 8-15: token i + 8 */
                v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
            for (int i = 0; i < 4; i++) /* 4-lane blocks: tokens i, i + 8, i + 4, i + 12 */
                v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 4], 0x88), _mm512_shuffle_f32x4(v[i], v[i + 4], 0xDD));
            for (int i = 0; i < 2; i++)
                v[i] = _mm512_add_ps(_mm512_shuffle_ps(v[i], v[i + 2], 0x44), _mm512_shuffle_ps(v[i], v[i + 2], 0xEE));
            __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
            /* lane l now holds token token_lane[l] (an involution): put them in token order */
            __mmask16 valid = (__mmask16)((1u << tn) - 1);
            __m512 s = _mm512_mul_ps(_mm512_permutexvar_ps(order, sums), _mm512_set1_ps(scale));
            if (kscale) s = _mm512_mul_ps(s, _mm512_maskz_loadu_ps(valid, kscale + t0));
            _mm512_mask_storeu_ps(scores + h * CHUNK + t0, valid, s);
        }
    }
}

/* g heads' scores -> exp(score - max) as bf16 in pb (zero padded to even length); the partials' m and l. int8 V
   (vscale: each token's scale): a token's weight in pb is exp(score - max) times its scale, so the values pass
   reads the rows' integers. */
static inline __attribute__((always_inline)) void softmax_pass(const int64_t g, const float *scores, uint16_t *pb,
                                                              int64_t len, float *part, int64_t d, const float *vscale) {
    for (int64_t h = 0; h < g; h++) {
        const float *sh = scores + h * CHUNK;
        float *ph = part + h * (d + 2);
        uint16_t *bh = pb + h * (CHUNK + 2);
        __m512 mv = _mm512_set1_ps(-INFINITY);
        int64_t t = 0;
        for (; t + 16 <= len; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sh + t));
        float m = _mm512_reduce_max_ps(mv);
        for (; t < len; t++) m = fmaxf(m, sh[t]);
        __m512 lv = _mm512_setzero_ps(), mb = _mm512_set1_ps(m);
        float l = 0.0f;
        for (t = 0; t + 16 <= len; t += 16) {
            __m512 e = exp_nonpos16(_mm512_sub_ps(_mm512_loadu_ps(sh + t), mb));
            __m512 w = vscale ? _mm512_mul_ps(e, _mm512_loadu_ps(vscale + t)) : e;
            _mm256_storeu_si256((__m256i *)(bh + t), (__m256i)_mm512_cvtneps_pbh(w));
            lv = _mm512_add_ps(lv, e);
        }
        for (; t < len; t++) {
            float e = exp_nonpos(sh[t] - m);
            l += e;
            bh[t] = f32_to_bf16(vscale ? e * vscale[t] : e);
        }
        bh[len] = 0;
        ph[0] = m;
        ph[1] = l + _mm512_reduce_add_ps(lv);
    }
}

/* part's acc of each of g heads = sum_t p[h][t] * the KV head's V row t (vh + rows[t]): two tokens a bf16
   pair dot, their rows interleaved by unpacklo/hi (so an accumulator's lanes hold a permutation of 16 of 32
   dims, undone at the end); int8 V (vh8): the rows' integers, their scales already in the weights */
static inline __attribute__((always_inline)) void values_pass(const int64_t g, const int64_t n32, const uint16_t *vh,
                                                             const int64_t *rows, int64_t len, const uint16_t *pb,
                                                             float *part, const int8_t *vh8) {
    static const int lo_dims[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
    static const int hi_dims[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
    __m512 acc[VEC_HEADS * 8];
    for (int64_t i = 0; i < g * 2 * n32; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 2) {
        int64_t r0 = rows[t], r1 = t + 1 < len ? rows[t + 1] : r0; /* p = 0 for the pad */
        __m512i lo[4], hi[4];
        for (int64_t i = 0; i < n32; i++) {
            __m512i a = vh8 ? (__m512i)bf16_of_int8(vh8 + r0 + 32 * i) : _mm512_loadu_si512((const void *)(vh + r0 + 32 * i));
            __m512i b = vh8 ? (__m512i)bf16_of_int8(vh8 + r1 + 32 * i) : _mm512_loadu_si512((const void *)(vh + r1 + 32 * i));
            lo[i] = _mm512_unpacklo_epi16(a, b);
            hi[i] = _mm512_unpackhi_epi16(a, b);
        }
        for (int64_t h = 0; h < g; h++) {
            uint32_t pair;
            memcpy(&pair, pb + h * (CHUNK + 2) + t, 4);
            __m512bh w = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int64_t i = 0; i < n32; i++) {
                acc[(h * n32 + i) * 2] = _mm512_dpbf16_ps(acc[(h * n32 + i) * 2], (__m512bh)lo[i], w);
                acc[(h * n32 + i) * 2 + 1] = _mm512_dpbf16_ps(acc[(h * n32 + i) * 2 + 1], (__m512bh)hi[i], w);
            }
        }
    }
    const __m512i first = _mm512_loadu_si512((const void *)lo_dims), second = _mm512_loadu_si512((const void *)hi_dims);
    for (int64_t h = 0; h < g; h++)
        for (int64_t i = 0; i < n32; i++) { /* lo lanes: dims 8k + j, hi: 8k + 4 + j (k the 128-bit block) */
            __m512 l = acc[(h * n32 + i) * 2], u = acc[(h * n32 + i) * 2 + 1];
            float *dst = part + h * (32 * n32 + 2) + 2 + 32 * i;
            _mm512_storeu_ps(dst, _mm512_permutex2var_ps(l, first, u));
            _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(l, second, u));
        }
}

/* Read a chunk's K and V rows (row_elems contiguous 16-bit elements a token, from rows[t] * stride) once in
   memory order, so that the passes below, one KV head's strided slice at a time, find them in cache: a strided
   pass straight from memory streams at ~9 GB/s on the dev machine, this sweep at ~20. */
static void touch_rows(const uint16_t *kc, const uint16_t *vc, const int64_t *rows, int64_t len, int64_t row_elems,
                       int64_t stride) {
    __m512i sink = _mm512_setzero_si512();
    for (int64_t t = 0; t < len; t++)
        for (int64_t i = 0; i < row_elems; i += 32) {
            sink = _mm512_or_si512(sink, _mm512_loadu_si512((const void *)(kc + rows[t] * stride + i)));
            sink = _mm512_or_si512(sink, _mm512_loadu_si512((const void *)(vc + rows[t] * stride + i)));
        }
    __asm__ volatile("" : : "v"(sink)); /* keep the loads */
}
#endif

#if defined(NINFER_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#define NINFER_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

/* AMX tile attention (Sapphire Rapids and later). A chunk's scores for one KV head are one tile product per 16
   tokens (K rows as A, the g query heads as B's columns), its weighted values one product per 32 tokens and
   16 dims (the g heads' softmax weights as A, V rows interleaved in token pairs as B): the per-token dot
   products, lane sums and pair interleaves of the vector passes become a few tile loads. q is rounded to bf16
   once, as the vector path holds it; int8 K takes q's bf16 values split into an int8 high part and an int8 low
   part (1/256 of a step), two columns of B, so its scores keep ~15 bits of q, and exact int32 sums. int8 V does
   the same with the softmax weights (16-bit fixed point in two 8-bit parts, against each head's largest) and
   reads the rows' integers as B directly, four tokens a cell, instead of widening them to bf16. */
static int amx_on = 0;

/* Ask Linux once for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) and turn the tile
   path on, or turn it off (want = 0: tests, NINFER_CPU_AMX=0). Returns whether it is on. */
int ninfer_amx(int64_t want) {
    amx_on = want && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx_on;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config;

/* tiles 0-3: a values product's 4 x 16 dims (g rows); 4: softmax weights (g rows of 32 tokens); 5: any B;
   6: 16 K rows; 7: 16 tokens' scores. Configured per chunk: torch's oneDNN kernels share these threads. */
#define T_WEIGHTS 4
#define T_B 5
#define T_K 6
#define T_SCORES 7
/* the tile intrinsics paste their register numbers as written: these expand the names first */
#define tile_zero(t) _tile_zero(t)
#define tile_load(t, p, stride) _tile_loadd(t, p, stride)
#define tile_store(t, p, stride) _tile_stored(t, p, stride)
#define tile_dot_bf16(c, a, b) _tile_dpbf16ps(c, a, b)
#define tile_dot_int8(c, a, b) _tile_dpbssd(c, a, b)
#define tile_dot_u8s8(c, a, b) _tile_dpbusd(c, a, b)

static void amx_configure(int64_t g) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.colsb[i] = 64, c.rows[i] = i <= T_WEIGHTS ? (uint8_t)g : 16;
    _tile_loadconfig(&c);
}

/* 0, 16, 32, ..: the 4-byte cells of one column of a 16 x 64-byte tile */
static inline __m512i tile_column(void) {
    return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                              _mm512_set1_epi32(16));
}

/* the first n of 16 lanes */
static inline __mmask16 first_lanes(int64_t n) { return (__mmask16)(n >= 16 ? 0xFFFF : (1u << n) - 1); }

/* y as 16-bit fixed point in two 8-bit parts: y ~ high + low / 256, high = y rounded, low in -127..127 */
static inline void split_fixed(__m512 y, __m512 *high, __m512 *low) {
    *high = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 l = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(y, *high), _mm512_set1_ps(256.0f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    *low = _mm512_min_ps(_mm512_max_ps(l, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
}

/* g heads of q ([g, d] fp32) as B tiles of 16 rows x 64 bytes. bf16 K: bf16 pairs, d / 32 tiles, head h in
   column h. int8 K: quadruples of int8, d / 64 tiles, head h's high part in column h, its low part in column
   g + h, q_h ~ qscale[h] * (high + low / 256). A column's 16 4-byte cells lie 64 bytes apart: one scatter. */
static void amx_q_tiles(int64_t g, int64_t d, const float *q, int int8_k, uint8_t *tiles, float *qscale) {
    const __m512i cells = tile_column();
    memset(tiles, 0, (size_t)d * (int8_k ? 16 : 32));
    for (int64_t h = 0; h < g; h++) {
        __m512 x[MAX_DIM / 16], amax = _mm512_setzero_ps();
        for (int64_t i = 0; i < d / 16; i++) { /* q rounded to bf16, as the vector path takes it */
            __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(q + h * d + 16 * i));
            x[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
            amax = _mm512_max_ps(amax, _mm512_abs_ps(x[i]));
        }
        if (!int8_k) {
            for (int64_t t = 0; t < d / 32; t++)
                _mm512_i32scatter_epi32(tiles + 1024 * t + 4 * h, cells,
                                        (__m512i)_mm512_cvtne2ps_pbh(x[2 * t + 1], x[2 * t]), 4);
            continue;
        }
        float m = _mm512_reduce_max_ps(amax), s = m > 0.0f ? m / 127.0f : 1.0f;
        qscale[h] = s;
        for (int64_t t = 0; t < d / 64; t++) {
            __m512i high = _mm512_setzero_si512(), low = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++) {
                __m512 hv, lv;
                split_fixed(_mm512_div_ps(x[4 * t + i], _mm512_set1_ps(s)), &hv, &lv);
                high = _mm512_inserti32x4(high, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(hv)), i);
                low = _mm512_inserti32x4(low, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(lv)), i);
            }
            _mm512_i32scatter_epi32(tiles + 1024 * t + 4 * h, cells, high, 4);
            _mm512_i32scatter_epi32(tiles + 1024 * t + 4 * (g + h), cells, low, 4);
        }
    }
}

/* scores [g, CHUNK] (times scale; int8: times each token's kscale and q's) of a chunk whose token t has its row of
   this KV head at base + rows[t] * esize; a 16-token block's rows lie `stride` bytes apart and are read whole
   (16 of them: the caller keeps them in memory) */
static void amx_scores(int64_t g, int64_t d, const uint8_t *base, const int64_t *rows, int64_t stride, int int8_k, int64_t len,
                       const uint8_t *qtiles, const float *qscale, const float *kscale, float scale, float *scores) {
    int32_t c[256] __attribute__((aligned(64)));
    const __m512i column = tile_column();
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const uint8_t *block = base + rows[t0] * (int8_k ? 1 : 2);
        tile_zero(T_SCORES);
        if (int8_k)
            for (int64_t s = 0; s < d / 64; s++) {
                tile_load(T_K, block + 64 * s, stride);
                tile_load(T_B, qtiles + 1024 * s, 64);
                tile_dot_int8(T_SCORES, T_K, T_B);
            }
        else
            for (int64_t s = 0; s < d / 32; s++) {
                tile_load(T_K, block + 64 * s, stride);
                tile_load(T_B, qtiles + 1024 * s, 64);
                tile_dot_bf16(T_SCORES, T_K, T_B);
            }
        tile_store(T_SCORES, c, 64);
        __mmask16 valid = first_lanes(len - t0);
        for (int64_t h = 0; h < g; h++) {
            __m512 v;
            if (int8_k) {
                __m512 high = _mm512_cvtepi32_ps(_mm512_i32gather_epi32(column, c + h, 4));
                __m512 low = _mm512_cvtepi32_ps(_mm512_i32gather_epi32(column, c + g + h, 4));
                v = _mm512_mul_ps(_mm512_fmadd_ps(low, _mm512_set1_ps(1.0f / 256), high), _mm512_set1_ps(scale * qscale[h]));
                v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(valid, kscale + t0));
            } else
                v = _mm512_mul_ps(_mm512_i32gather_ps(column, (const float *)c + h, 4), _mm512_set1_ps(scale));
            _mm512_mask_storeu_ps(scores + h * CHUNK + t0, valid, v);
        }
    }
}

/* part's acc of g heads (set; g the tiles' configured rows) = sum_t w[h][t] * V row t, w the bf16 weights
   [g, CHUNK + 2] (zero up to a multiple of 32 tokens); token t's bf16 V row at base + rows[t] */
static void amx_values(int64_t d, const uint16_t *base, const int64_t *rows, int64_t len, const uint16_t *w,
                       float *part) {
    static const int16_t pair_lo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    static const int16_t pair_hi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                        24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i lo = _mm512_loadu_si512((const void *)pair_lo), hi = _mm512_loadu_si512((const void *)pair_hi);
    uint16_t b[4][512] __attribute__((aligned(64))); /* B tiles: token pairs x 16 dims, interleaved */
    for (int64_t dg = 0; dg < d; dg += 64) {
        tile_zero(0);
        tile_zero(1);
        tile_zero(2);
        tile_zero(3);
        for (int64_t t0 = 0; t0 < len; t0 += 32) {
            tile_load(T_WEIGHTS, w + t0, (CHUNK + 2) * 2);
            for (int64_t r = 0; r < 16; r++) {
                __m512i x[2][2]; /* [token of the pair][32 dims] */
                for (int j = 0; j < 2; j++) {
                    int64_t t = t0 + 2 * r + j;
                    for (int i = 0; i < 2; i++)
                        x[j][i] = t >= len ? _mm512_setzero_si512()
                                           : _mm512_loadu_si512((const void *)(base + rows[t] + dg + 32 * i));
                }
                for (int i = 0; i < 2; i++) {
                    _mm512_store_si512((void *)(b[2 * i] + 32 * r), _mm512_permutex2var_epi16(x[0][i], lo, x[1][i]));
                    _mm512_store_si512((void *)(b[2 * i + 1] + 32 * r), _mm512_permutex2var_epi16(x[0][i], hi, x[1][i]));
                }
            }
            tile_load(T_B, b[0], 64);
            tile_dot_bf16(0, T_WEIGHTS, T_B);
            tile_load(T_B, b[1], 64);
            tile_dot_bf16(1, T_WEIGHTS, T_B);
            tile_load(T_B, b[2], 64);
            tile_dot_bf16(2, T_WEIGHTS, T_B);
            tile_load(T_B, b[3], 64);
            tile_dot_bf16(3, T_WEIGHTS, T_B);
        }
        int64_t ps = (d + 2) * (int64_t)sizeof(float);
        tile_store(0, part + 2 + dg, ps);
        tile_store(1, part + 2 + dg + 16, ps);
        tile_store(2, part + 2 + dg + 32, ps);
        tile_store(3, part + 2 + dg + 48, ps);
    }
}

/* int8 V: the softmax partials (m, l) of g heads and their weights w = exp(score - m) * the token's V scale as
   fixed point against the head's largest, w ~ wscale[h] * (high + low / 256) with high in 0..255 (unsigned) and
   low in -127..127, rows of CHUNK bytes zero padded to a multiple of 64 tokens (the A tiles of the values) */
static void amx_int8_weights(int64_t g, const float *scores, int64_t len, float *part, int64_t d, const float *vscale,
                             uint8_t *high, int8_t *low, float *wscale) {
    float w[CHUNK] __attribute__((aligned(64)));
    int64_t padded = (len + 63) & ~(int64_t)63;
    for (int64_t h = 0; h < g; h++) {
        const float *sh = scores + h * CHUNK;
        __m512 mv = _mm512_set1_ps(-INFINITY);
        for (int64_t t = 0; t < len; t += 16)
            mv = _mm512_mask_max_ps(mv, first_lanes(len - t), mv, _mm512_maskz_loadu_ps(first_lanes(len - t), sh + t));
        float m = _mm512_reduce_max_ps(mv);
        __m512 mb = _mm512_set1_ps(m), lv = _mm512_setzero_ps(), wv = _mm512_setzero_ps();
        for (int64_t t = 0; t < len; t += 16) {
            __mmask16 valid = first_lanes(len - t);
            __m512 e = _mm512_maskz_mov_ps(valid, exp_nonpos16(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, sh + t), mb)));
            __m512 x = _mm512_mul_ps(e, _mm512_maskz_loadu_ps(valid, vscale + t));
            _mm512_store_ps(w + t, x);
            lv = _mm512_add_ps(lv, e);
            wv = _mm512_max_ps(wv, x);
        }
        float wmax = _mm512_reduce_max_ps(wv), ws = wmax > 0.0f ? wmax / 255.0f : 1.0f;
        wscale[h] = ws;
        part[h * (d + 2)] = m, part[h * (d + 2) + 1] = _mm512_reduce_add_ps(lv);
        __m512 inv = _mm512_set1_ps(1.0f / ws);
        for (int64_t t = 0; t < padded; t += 16) {
            __m512 hv, lo;
            split_fixed(t < len ? _mm512_mul_ps(_mm512_load_ps(w + t), inv) : _mm512_setzero_ps(), &hv, &lo); /* 0 past len */
            hv = _mm512_min_ps(hv, _mm512_set1_ps(255.0f));
            _mm_store_si128((__m128i *)(high + h * CHUNK + t), _mm512_cvtusepi32_epi8(_mm512_cvtps_epu32(hv)));
            _mm_store_si128((__m128i *)(low + h * CHUNK + t), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(lo)));
        }
    }
}

/* int8 V: part's acc of g heads = wscale[h] * sum_t (high + low / 256)[h][t] * V row t's integers (its scale is in
   the weights). V as B: four tokens' int8 a 4-byte cell, interleaved in registers (two unpack levels, which leave
   a cell's 16 dims permuted, undone at the end); the high weights multiply as unsigned, the low as signed. */
static void amx_values_int8(int64_t g, int64_t d, const int8_t *base, const int64_t *rows, int64_t len,
                            const uint8_t *high, const int8_t *low, const float *wscale, float *part) {
    int8_t b[CHUNK / 64][4][1024] __attribute__((aligned(64))); /* per 64 tokens, 4 B tiles of 16 dims each */
    int32_t c[4][256] __attribute__((aligned(64)));
    __m512 sums[8][4]; /* per head, dim block i's 16 sums (permuted dims) */
    int64_t blocks = (len + 63) / 64;
    for (int64_t dg = 0; dg < d; dg += 64) {
        for (int64_t blk = 0; blk < blocks; blk++)
            for (int64_t r = 0; r < 16; r++) { /* B row r: tokens 4r..4r+3 of the block */
                __m512i x[4];
                for (int j = 0; j < 4; j++) {
                    int64_t t = blk * 64 + 4 * r + j;
                    x[j] = t < len ? _mm512_loadu_si512((const void *)(base + rows[t] + dg)) : _mm512_setzero_si512();
                }
                __m512i lo01 = _mm512_unpacklo_epi8(x[0], x[1]), hi01 = _mm512_unpackhi_epi8(x[0], x[1]);
                __m512i lo23 = _mm512_unpacklo_epi8(x[2], x[3]), hi23 = _mm512_unpackhi_epi8(x[2], x[3]);
                _mm512_store_si512((void *)(b[blk][0] + 64 * r), _mm512_unpacklo_epi16(lo01, lo23));
                _mm512_store_si512((void *)(b[blk][1] + 64 * r), _mm512_unpackhi_epi16(lo01, lo23));
                _mm512_store_si512((void *)(b[blk][2] + 64 * r), _mm512_unpacklo_epi16(hi01, hi23));
                _mm512_store_si512((void *)(b[blk][3] + 64 * r), _mm512_unpackhi_epi16(hi01, hi23));
            }
        for (int half = 0; half < 2; half++) { /* tiles 0-1: high sums of dim blocks 2 half, 2 half + 1; 2-3: low */
            tile_zero(0);
            tile_zero(1);
            tile_zero(2);
            tile_zero(3);
            for (int64_t blk = 0; blk < blocks; blk++) {
                tile_load(T_WEIGHTS, high + 64 * blk, CHUNK);
                tile_load(T_B, b[blk][2 * half], 64);
                tile_dot_u8s8(0, T_WEIGHTS, T_B);
                tile_load(T_B, b[blk][2 * half + 1], 64);
                tile_dot_u8s8(1, T_WEIGHTS, T_B);
                tile_load(T_WEIGHTS, low + 64 * blk, CHUNK);
                tile_load(T_B, b[blk][2 * half], 64);
                tile_dot_int8(2, T_WEIGHTS, T_B);
                tile_load(T_B, b[blk][2 * half + 1], 64);
                tile_dot_int8(3, T_WEIGHTS, T_B);
            }
            tile_store(0, c[0], 64);
            tile_store(1, c[1], 64);
            tile_store(2, c[2], 64);
            tile_store(3, c[3], 64);
            for (int64_t h = 0; h < g; h++)
                for (int k = 0; k < 2; k++) {
                    __m512 high_sum = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(c[k] + 16 * h)));
                    __m512 low_sum = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(c[2 + k] + 16 * h)));
                    sums[h][2 * half + k] = _mm512_mul_ps(_mm512_fmadd_ps(low_sum, _mm512_set1_ps(1.0f / 256), high_sum),
                                                          _mm512_set1_ps(wscale[h]));
                }
        }
        for (int64_t h = 0; h < g; h++) { /* block i's 128-bit lane L holds dims 16 L + 4 i .. + 3: a 4 x 4 transpose */
            __m512 *v = sums[h], a = _mm512_shuffle_f32x4(v[0], v[1], 0x44), b2 = _mm512_shuffle_f32x4(v[2], v[3], 0x44);
            __m512 e = _mm512_shuffle_f32x4(v[0], v[1], 0xEE), f = _mm512_shuffle_f32x4(v[2], v[3], 0xEE);
            float *acc = part + h * (d + 2) + 2 + dg;
            _mm512_storeu_ps(acc, _mm512_shuffle_f32x4(a, b2, 0x88));
            _mm512_storeu_ps(acc + 16, _mm512_shuffle_f32x4(a, b2, 0xDD));
            _mm512_storeu_ps(acc + 32, _mm512_shuffle_f32x4(e, f, 0x88));
            _mm512_storeu_ps(acc + 48, _mm512_shuffle_f32x4(e, f, 0xDD));
        }
    }
}
#else
int ninfer_amx(int64_t want) {
    (void)want;
    return 0;
}
#endif

/* Softmax partials of one job (a chunk of one sequence's context, all heads): for each query head m (max
   score), l (sum of exp), acc (sum of exp * v, d values) at part + head * (d + 2). q: [hq, d] fp32,
   scores times `scale`; query head h reads KV head h / (hq / hkv). */
static void attend_chunk(const float *q, float scale, int64_t hq, int64_t hkv, int64_t d, const kv_layer *kl,
                         const kv_layer *vl, const int32_t *pages, int64_t page_size, int64_t start, int64_t end,
                         float *part, uint16_t *scratch) {
    float scores[MAX_HEADS * CHUNK] __attribute__((aligned(64)));
    int64_t rows[CHUNK];       /* element offset of each token's K and V rows in kc / vc */
    int64_t slot_heads[CHUNK]; /* each token's slot times hkv: its first KV head's row (and scale) index */
    int64_t len = end - start, g = hq / hkv;
    const uint16_t *kc = (const uint16_t *)kl->rows, *vc = (const uint16_t *)vl->rows;
    int quantized = kl->kind != KV_BF16 || vl->kind != KV_BF16, fused = 0;
    int64_t page = start / page_size, offset = start % page_size; /* walked, not divided, per token */
    for (int64_t t = 0; t < len; t++) {
        slot_heads[t] = ((int64_t)pages[page] * page_size + offset) * hkv;
        rows[t] = slot_heads[t] * d;
        if (++offset == page_size) offset = 0, page++;
    }
#ifdef NINFER_BF16
    /* int8 K and V: the vector passes read the rows' integers in place, the scales folded into scores and weights */
    fused = kl->kind == KV_INT8 && vl->kind == KV_INT8 && d % 32 == 0 && d <= 128 && hq <= VEC_HEADS && hkv * d % 64 == 0;
#endif
    if (quantized && !fused) { /* the chunk's rows expanded to bf16 in the thread's scratch, [len, hkv, d] each */
        uint16_t *ks = scratch, *vs = scratch + CHUNK * hkv * d;
        const kv_layer *src[2] = {kl, vl};
        uint16_t *dst[2] = {ks, vs};
        for (int64_t t = 0; t < len; t++) {
            int64_t slot_head = slot_heads[t];
            for (int c = 0; c < 2; c++) {
                if (src[c]->kind == KV_BF16) {
                    memcpy(dst[c] + t * hkv * d, (const uint16_t *)src[c]->rows + rows[t], (size_t)(hkv * d) * 2);
                    continue;
                }
                int64_t rb = kv_row_bytes(src[c]->kind, d);
                for (int64_t h = 0; h < hkv; h++)
                    dequantize_kv_row(src[c]->rows + (slot_head + h) * rb, src[c]->scale[slot_head + h], d,
                                      src[c]->kind, dst[c] + (t * hkv + h) * d);
            }
            rows[t] = t * hkv * d;
        }
        kc = ks, vc = vs;
    }
#ifdef NINFER_BF16
    if (d % 32 == 0 && d <= 128 && hq <= VEC_HEADS) {
        uint16_t pb[VEC_HEADS * (CHUNK + 2)] __attribute__((aligned(64))); /* exp'd scores in bf16 */
        if (!quantized || fused) { /* rows in place (bf16 or int8), d 16-bit words a row or d / 2 */
            int64_t words = fused ? d / 2 : d;
            touch_rows((const uint16_t *)kl->rows, (const uint16_t *)vl->rows, slot_heads, len, hkv * words, words);
        }
#ifdef NINFER_AMX
        /* tiles read 16 rows from a block's first: whole blocks lie in one page (or the scratch) */
        int amx = amx_on && g <= 8 && d % 64 == 0 && (page_size % 16 == 0 || (quantized && !fused));
        uint8_t qtiles[4096] __attribute__((aligned(64)));
        float qscale[8];
        if (amx) amx_configure(g);
#endif
        for (int64_t kvh = 0; kvh < hkv; kvh++) { /* one KV head's query heads a pass: their sums in registers */
            const float *qg = q + kvh * g * d;
            float *sg = scores + kvh * g * CHUNK, *pg = part + kvh * g * (d + 2);
            uint16_t *bg = pb + kvh * g * (CHUNK + 2);
            const uint16_t *kh = kc + kvh * d, *vh = vc + kvh * d;
            const int8_t *kh8 = NULL, *vh8 = NULL;
            float kscale[CHUNK], vscale[CHUNK];
            const float *ksp = NULL, *vsp = NULL;
            if (fused) {
                kh8 = (const int8_t *)kl->rows + kvh * d, vh8 = (const int8_t *)vl->rows + kvh * d;
                for (int64_t t = 0; t < len; t++) {
                    kscale[t] = kl->scale[slot_heads[t] + kvh];
                    vscale[t] = vl->scale[slot_heads[t] + kvh];
                }
                ksp = kscale, vsp = vscale;
            }
#ifdef NINFER_AMX
            if (amx) {
                const uint8_t *k0 = fused ? (const uint8_t *)kh8 : (const uint8_t *)kh;
                amx_q_tiles(g, d, qg, fused, qtiles, qscale);
                amx_scores(g, d, k0, rows, hkv * d * (fused ? 1 : 2), fused, len, qtiles, qscale, ksp, scale, sg);
                if (fused) {
                    uint8_t high[8 * CHUNK] __attribute__((aligned(64)));
                    int8_t low[8 * CHUNK] __attribute__((aligned(64)));
                    float wscale[8];
                    amx_int8_weights(g, sg, len, pg, d, vsp, high, low, wscale);
                    amx_values_int8(g, d, vh8, rows, len, high, low, wscale, pg);
                    continue;
                }
                softmax_pass(g, sg, bg, len, pg, d, vsp);
                for (int64_t h = 0; h < g; h++) /* the weights tile reads up to a multiple of 32 tokens */
                    memset(bg + h * (CHUNK + 2) + len, 0, (size_t)((-len & 31) + 1) * 2);
                amx_values(d, vh, rows, len, bg, pg);
                continue;
            }
#endif
            /* the sizes as constants where they are common, so the compiler unrolls */
#define GROUP_CASE(G, N32) \
    case G * 100 + N32: \
        scores_pass(G, N32, qg, kh, rows, len, scale, sg, kh8, ksp); \
        softmax_pass(G, sg, bg, len, pg, d, vsp); \
        values_pass(G, N32, vh, rows, len, bg, pg, vh8); \
        break;
            switch (g * 100 + d / 32) {
                GROUP_CASE(1, 2) GROUP_CASE(2, 2) GROUP_CASE(3, 2) GROUP_CASE(4, 2) GROUP_CASE(5, 2) GROUP_CASE(7, 2)
                GROUP_CASE(1, 4) GROUP_CASE(2, 4) GROUP_CASE(4, 4)
            default:
                scores_pass(g, d / 32, qg, kh, rows, len, scale, sg, kh8, ksp);
                softmax_pass(g, sg, bg, len, pg, d, vsp);
                values_pass(g, d / 32, vh, rows, len, bg, pg, vh8);
            }
#undef GROUP_CASE
        }
#ifdef NINFER_AMX
        if (amx) _tile_release();
#endif
        return;
    }
#endif
    float kf[MAX_DIM];
    for (int64_t h = 0; h < hq; h++) memset(part + h * (d + 2) + 2, 0, (size_t)d * sizeof(float));
    for (int64_t t = 0; t < len; t++) {
        for (int64_t kvh = 0; kvh < hkv; kvh++) {
            for (int64_t i = 0; i < d; i++) kf[i] = bf16_to_f32(kc[rows[t] + kvh * d + i]);
            for (int64_t h = kvh * g; h < (kvh + 1) * g; h++) {
                const float *qh = q + h * d;
                float s = 0.0f;
                for (int64_t i = 0; i < d; i++) s += qh[i] * kf[i];
                scores[h * CHUNK + t] = s * scale;
            }
        }
    }
    for (int64_t h = 0; h < hq; h++) {
        float *sh = scores + h * CHUNK, *ph = part + h * (d + 2);
        float m = -INFINITY, l = 0.0f;
        for (int64_t t = 0; t < len; t++) m = fmaxf(m, sh[t]);
        for (int64_t t = 0; t < len; t++) l += (sh[t] = exp_nonpos(sh[t] - m));
        ph[0] = m;
        ph[1] = l;
    }
    for (int64_t t = 0; t < len; t++) {
        for (int64_t kvh = 0; kvh < hkv; kvh++) {
            for (int64_t i = 0; i < d; i++) kf[i] = bf16_to_f32(vc[rows[t] + kvh * d + i]);
            for (int64_t h = kvh * g; h < (kvh + 1) * g; h++) {
                float p = scores[h * CHUNK + t], *acc = part + h * (d + 2) + 2;
                for (int64_t i = 0; i < d; i++) acc[i] += p * kf[i];
            }
        }
    }
}

/* out = the chunks' partials merged (chunk c's at part + c * stride) */
static void merge_partials(const float *part, int64_t chunks, int64_t stride, int64_t d, float *out) {
    float m = -INFINITY;
    for (int64_t c = 0; c < chunks; c++) m = fmaxf(m, part[c * stride]);
    float l = 0.0f;
    for (int64_t i = 0; i < d; i++) out[i] = 0.0f;
    for (int64_t c = 0; c < chunks; c++) {
        const float *p = part + c * stride;
        float w = exp_nonpos(p[0] - m);
        l += w * p[1];
        for (int64_t i = 0; i < d; i++) out[i] += w * p[2 + i];
    }
    float inv = 1.0f / l;
    for (int64_t i = 0; i < d; i++) out[i] *= inv;
}

/* Sequences' contexts cut into chunks: job list, first[r] = sequence r's first job (first[b] = the count) */
static int64_t count_jobs(int64_t b, const int32_t *seq_lens) {
    int64_t n = 0;
    for (int64_t r = 0; r < b; r++) n += (seq_lens[r] + CHUNK - 1) / CHUNK;
    return n;
}

static void plan_jobs(int64_t b, const int32_t *seq_lens, attn_job *jobs, int64_t *first) {
    int64_t j = 0;
    for (int64_t r = 0; r < b; r++) {
        first[r] = j;
        for (int64_t s = 0; s < seq_lens[r]; s += CHUNK)
            jobs[j++] = (attn_job){r, s, s + CHUNK < seq_lens[r] ? s + CHUNK : seq_lens[r]};
    }
    first[b] = j;
}

typedef struct {
    int64_t b, hq, hkv, d, page_size, pt_stride, q_stride;
    float scale;
    kv_layer k, v;
    const int32_t *page_table;
    const attn_job *jobs;
    const int64_t *first;
    float *part;       /* [jobs, hq, d + 2] */
    uint16_t *scratch; /* quantized KV: SCRATCH(hkv, d) bf16 values a thread */
} attn_t;

#define SCRATCH(hkv, d) (2 * CHUNK * (hkv) * (d))

/* a step's attention scratch for `threads` threads (NULL: none needed, or no memory: check `needed`) */
static uint16_t *alloc_scratch(int64_t k_kind, int64_t v_kind, int64_t hkv, int64_t d, int64_t threads, int *needed) {
    *needed = k_kind != KV_BF16 || v_kind != KV_BF16;
    return *needed ? malloc((size_t)(threads * SCRATCH(hkv, d)) * sizeof(uint16_t)) : NULL;
}

/* out [b, hq, d] = decode attention of q ([b] rows q_stride apart, [hq, d] each); called by
   every thread of a parallel region (two orphaned `omp for`: chunks, then merges) */
static void attention(const attn_t *a, const float *q, float *out) {
    int64_t per_job = a->hq * (a->d + 2);
#pragma omp for schedule(dynamic, 1)
    for (int64_t j = 0; j < a->first[a->b]; j++) {
        const attn_job *job = a->jobs + j;
        attend_chunk(q + job->seq * a->q_stride, a->scale, a->hq, a->hkv, a->d, &a->k, &a->v,
                     a->page_table + job->seq * a->pt_stride, a->page_size, job->start, job->end, a->part + j * per_job,
                     a->scratch ? a->scratch + omp_get_thread_num() * SCRATCH(a->hkv, a->d) : NULL);
    }
#pragma omp for schedule(static)
    for (int64_t rh = 0; rh < a->b * a->hq; rh++) {
        int64_t r = rh / a->hq, head = rh % a->hq, first = a->first[r];
        merge_partials(a->part + first * per_job + head * (a->d + 2), a->first[r + 1] - first, per_job, a->d,
                       out + rh * a->d);
    }
}

/* ---- the step --------------------------------------------------------------------------------------------- */

/* one new token's hkv rows (fp32) into a layer of a cache at `slot`: bf16, or quantized from the bf16 values */
static void write_kv(const float *x, uint8_t *cache, float *scales, int64_t kind, int64_t slot, int64_t hkv, int64_t d) {
    if (kind == KV_BF16) {
        uint16_t *dst = (uint16_t *)cache + slot * hkv * d;
        for (int64_t i = 0; i < hkv * d; i++) dst[i] = f32_to_bf16(x[i]);
        return;
    }
    float xb[MAX_DIM];
    int64_t rb = kv_row_bytes(kind, d);
    for (int64_t hh = 0; hh < hkv; hh++) {
        for (int64_t i = 0; i < d; i++) xb[i] = bf16_to_f32(f32_to_bf16(x[hh * d + i]));
        quantize_kv_row(xb, d, kind, cache + (slot * hkv + hh) * rb, scales + slot * hkv + hh);
    }
}

/* Returns 0, -1 when a shape is outside what the kernel supports (the caller keeps to torch), -2 without
   memory. */
int ninfer_llama_decode(const model_t *md, int64_t b, const uint16_t *x_in, const float *cos, const float *sin,
                        const int64_t *slots, const int32_t *page_table, int64_t pt_stride,
                        const int32_t *seq_lens, int64_t page_size, uint16_t *out) {
    int64_t h = md->hidden, hq = md->heads, hkv = md->kv_heads, d = md->head_dim, inter = md->inter;
    int64_t nqkv = (hq + 2 * hkv) * d;
    if (hq > MAX_HEADS || d > MAX_DIM || hq % hkv || d % 2) return -1;
    if ((md->k_kind == KV_NVFP4 || md->v_kind == KV_NVFP4) && d % 16) return -1;
    int64_t kmax = h > inter ? h : inter;
    kmax = kmax > hq * d ? kmax : hq * d;
    int64_t njobs = count_jobs(b, seq_lens);
    size_t floats = (size_t)(b * (3 * h + nqkv + 2 * inter + hq * d + 1)) + (size_t)(njobs * hq * (d + 2));
    float *mem = malloc(floats * sizeof(float));
    int16_t *xq = malloc((size_t)(b * pad32(kmax)) * sizeof(int16_t));
    attn_job *jobs = malloc((size_t)(njobs + 1) * sizeof(attn_job));
    int64_t *first = malloc((size_t)(b + 1) * sizeof(int64_t));
    int needed;
    uint16_t *scratch = alloc_scratch(md->k_kind, md->v_kind, hkv, d, md->threads, &needed);
    if (!mem || !xq || !jobs || !first || (needed && !scratch)) {
        free(mem), free(xq), free(jobs), free(first), free(scratch);
        return -2;
    }
    float *resid = mem, *xn = resid + b * h, *tmp = xn + b * h, *qkv = tmp + b * h, *gu = qkv + b * nqkv;
    float *attn = gu + b * 2 * inter, *xs = attn + b * hq * d, *part = xs + b;
    plan_jobs(b, seq_lens, jobs, first);
    attn_t at = {b, hq, hkv, d, page_size, pt_stride, nqkv, md->attn_scale, {NULL, NULL, md->k_kind},
                 {NULL, NULL, md->v_kind}, page_table, jobs, first, part, scratch};
    for (int64_t i = 0; i < b * h; i++) resid[i] = bf16_to_f32(x_in[i]);

#pragma omp parallel num_threads((int)md->threads) firstprivate(at)
    {
        for (int64_t l = 0; l < md->layers; l++) {
            const layer_t *L = md->layer + l;
            uint8_t *kc = md->k_cache + l * md->k_layer_bytes, *vc = md->v_cache + l * md->v_layer_bytes;
            float *ksc = md->k_scale ? md->k_scale + l * md->scale_layer_stride : NULL;
            float *vsc = md->v_scale ? md->v_scale + l * md->scale_layer_stride : NULL;
#pragma omp single
            {
                for (int64_t r = 0; r < b; r++) rms_norm(resid + r * h, L->input_norm, h, md->eps, xn + r * h);
                quantize_rows(xn, b, h, pad32(h), xq, xs);
            }
            qgemv(&L->qkv, xq, xs, b, qkv);
#pragma omp single
            for (int64_t r = 0; r < b; r++) { /* RoPE on the q and k heads, k and v written */
                float *row = qkv + r * nqkv;
                for (int64_t hh = 0; hh < hq + hkv; hh++) rope(row + hh * d, cos + r * d, sin + r * d, d);
                write_kv(row + hq * d, kc, ksc, md->k_kind, slots[r], hkv, d);
                write_kv(row + (hq + hkv) * d, vc, vsc, md->v_kind, slots[r], hkv, d);
            }
            at.k.rows = kc, at.k.scale = ksc, at.v.rows = vc, at.v.scale = vsc;
            attention(&at, qkv, attn);
#pragma omp single
            quantize_rows(attn, b, hq * d, pad32(hq * d), xq, xs);
            qgemv(&L->o, xq, xs, b, tmp);
#pragma omp single
            {
                for (int64_t i = 0; i < b * h; i++) resid[i] += tmp[i];
                for (int64_t r = 0; r < b; r++) rms_norm(resid + r * h, L->post_norm, h, md->eps, xn + r * h);
                quantize_rows(xn, b, h, pad32(h), xq, xs);
            }
            qgemv(&L->gate_up, xq, xs, b, gu);
#pragma omp single
            {
                for (int64_t r = 0; r < b; r++) { /* silu(gate) * up, packed to [b, inter] */
                    float *gr = gu + r * 2 * inter, *dst = gu + r * inter;
                    for (int64_t i = 0; i < inter; i++) dst[i] = gr[i] / (1.0f + expf(-gr[i])) * gr[inter + i];
                }
                quantize_rows(gu, b, inter, pad32(inter), xq, xs);
            }
            qgemv(&L->down, xq, xs, b, tmp);
#pragma omp single
            for (int64_t i = 0; i < b * h; i++) resid[i] += tmp[i];
        }
    }
    for (int64_t r = 0; r < b; r++) {
        rms_norm(resid + r * h, md->final_norm, h, md->eps, xn + r * h);
        for (int64_t i = 0; i < h; i++) out[r * h + i] = f32_to_bf16(xn[r * h + i]);
    }
    free(mem), free(xq), free(jobs), free(first), free(scratch);
    return 0;
}

/* y [m, n] fp32 = x [m, k] (bf16) @ (w * scale)^T: the logits of a decode batch (same arithmetic as the
   step's matmuls). */
int ninfer_qlinear_bf16(const qlinear *L, int64_t m, const uint16_t *x, float *y, int64_t threads) {
    int64_t kp = pad32(L->k);
    float *xf = malloc((size_t)(m * L->k + m) * sizeof(float));
    int16_t *xq = malloc((size_t)(m * kp) * sizeof(int16_t));
    if (!xf || !xq) {
        free(xf), free(xq);
        return -2;
    }
    for (int64_t i = 0; i < m * L->k; i++) xf[i] = bf16_to_f32(x[i]);
    float *xs = xf + m * L->k;
    quantize_rows(xf, m, L->k, kp, xq, xs);
#pragma omp parallel num_threads((int)threads)
    qgemv(L, xq, xs, m, y);
    free(xf), free(xq);
    return 0;
}

/* One layer's decode attention alone (tests, benchmarks): q [b, hq, d] fp32, out the same. */
int ninfer_decode_attention(int64_t b, int64_t hq, int64_t hkv, int64_t d, const float *q, float scale, const uint8_t *kc,
                            const uint8_t *vc, const float *k_scale, const float *v_scale, int64_t k_kind, int64_t v_kind,
                            const int32_t *page_table, int64_t pt_stride, const int32_t *seq_lens, int64_t page_size,
                            float *out, int64_t threads) {
    if (hq > MAX_HEADS || d > MAX_DIM || hq % hkv) return -1;
    if ((k_kind == KV_NVFP4 || v_kind == KV_NVFP4) && d % 16) return -1;
    int64_t njobs = count_jobs(b, seq_lens);
    attn_job *jobs = malloc((size_t)(njobs + 1) * sizeof(attn_job));
    int64_t *first = malloc((size_t)(b + 1) * sizeof(int64_t));
    float *part = malloc((size_t)(njobs * hq * (d + 2) + 1) * sizeof(float));
    int needed;
    uint16_t *scratch = alloc_scratch(k_kind, v_kind, hkv, d, threads, &needed);
    if (!jobs || !first || !part || (needed && !scratch)) {
        free(jobs), free(first), free(part), free(scratch);
        return -2;
    }
    plan_jobs(b, seq_lens, jobs, first);
    attn_t at = {b, hq, hkv, d, page_size, pt_stride, hq * d, scale, {kc, k_scale, k_kind}, {vc, v_scale, v_kind},
                 page_table, jobs, first, part, scratch};
#pragma omp parallel num_threads((int)threads)
    attention(&at, q, out);
    free(jobs), free(first), free(part), free(scratch);
    return 0;
}
