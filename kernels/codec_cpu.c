/* The Lynx codec on the CPU: the four hot loops of lynx_hf.quant.lynx in C, for the `cpu` kernels (kernels/cpu.py
 * builds this file once per machine and calls it through ctypes, one row range per thread).
 *
 * Contract: every function computes exactly what its torch twin computes (same IEEE fp32 operations in the same
 * order; built with -ffp-contract=off, never -ffast-math), so codes, statistics and dequantized values are bit-identical
 * to the reference. Tensors are contiguous; x is [BH, S, D] (B and H folded), D <= LYNX_MAX_D and even.
 * dtype: 0 = float32, 1 = float16, 2 = bfloat16. Statistics mu / rho are fp16 (stat_u8 = 0) or uint8 in units of
 * 1/255 (stat_u8 = 1); gmin / gscale (page stage, "paper" only) are fp16 or NULL. */
#include <stdint.h>
#include <string.h>

#define LYNX_MAX_D 1024

/* The ABI kernels/cpu.py checks at load: bump LYNX_ABI whenever an entry point or an argument struct changes (the
 * Python side mirrors the structs field for field and compares their sizes too). */
#define LYNX_ABI 3
int lynx_abi(void) { return LYNX_ABI; }


typedef struct {  /* lynx_encode_rows: x [BH, S, D] → anchor [BH, S, D·b/8] / residual [BH, S, D·(8−b)/8] codes */
    const void *x; int64_t dtype, S, D;
    const _Float16 *gmin, *gscale; int64_t NP, page;           /* page stage ("paper"), or NULL */
    const void *mu, *rho; int64_t stat_u8, token_axis, NC, chunk;
    const float *thr; int64_t nthr, sign_mag; float alpha, inv_l;
    const float *poly; int64_t npoly;                        /* y(|u|) polynomial, or npoly = 0 */
    const int32_t *grid; int64_t ngrid; float grid_lo, grid_scale;
    uint8_t *anchor, *residual; int64_t anchor_bits;         /* b: the anchor's top bits of each 8-bit code */
} lynx_encode_args;
typedef struct {  /* lynx_dequantize_rows: codes → x̂ in out_dtype, row (bh, s) at bh·out_bh_stride + s·D */
    const uint8_t *anchor, *residual;                        /* residual NULL: the anchor tier */
    const _Float16 *gmin, *gscale; int64_t NP, page;
    const void *mu, *rho; int64_t stat_u8, token_axis, chunk;
    const float *lut; int64_t S, D, out_dtype;
    void *out; int64_t out_bh_stride; int64_t anchor_bits;
} lynx_dequantize_args;
int64_t lynx_sizeof_encode_args(void) { return (int64_t)sizeof(lynx_encode_args); }
int64_t lynx_sizeof_dequantize_args(void) { return (int64_t)sizeof(lynx_dequantize_args); }

typedef _Float16 f16;

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* row of D values starting at element `off`, as float32 (a pointer into x when x is float32) */
static inline const float *row_f32(const void *x, int dtype, int64_t off, int64_t D, float *buf) {
    if (dtype == 0) return (const float *)x + off;
    if (dtype == 1) {
        const f16 *h = (const f16 *)x + off;
        for (int64_t d = 0; d < D; d++) buf[d] = (float)h[d];
    } else {
        const uint16_t *h = (const uint16_t *)x + off;
        for (int64_t d = 0; d < D; d++) buf[d] = bf16_to_f32(h[d]);
    }
    return buf;
}

static inline float stat(const void *t, int stat_u8, int64_t i, float k) {
    return stat_u8 ? (float)((const uint8_t *)t)[i] * k : (float)((const f16 *)t)[i] * k;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define LYNX_AVX512 1

/* Codes of 16 lanes, arithmetically. y = sign·ln(1+α|u|)/ln(1+α) comes from y16 (below) and p = A·y + B puts
 * every code edge on an integer. Lanes whose p lies within EDGE_EPS of an integer (fp32 rounding of u, of the
 * thresholds and of y are all < 1e-4 in p), or |u| > 1 (never for "lynx": σ is rounded outward), are flagged for the exact search; the rest are decided by
 * floor(p) alone. */
#define EDGE_EPS 1e-3f
static inline __m512i codes_from_y16(__m512 u, __m512 y, int sign_mag, __mmask16 *slow) {
    __m512 p;
    if (sign_mag) {
        p = _mm512_fmadd_ps(y, _mm512_set1_ps(127.0f), _mm512_set1_ps(0.5f));  /* edges at m + 0.5 of 127·y */
    } else {
        y = _mm512_or_ps(y, _mm512_and_ps(u, _mm512_set1_ps(-0.0f)));          /* sign of u */
        p = _mm512_fmadd_ps(y, _mm512_set1_ps(240.0f), _mm512_set1_ps(256.0f));  /* 480·t + 16 */
    }
    __m512 fl = _mm512_roundscale_ps(p, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC), fr = _mm512_sub_ps(p, fl);
    *slow = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(fr, _mm512_set1_ps(0.5f))),
                               _mm512_set1_ps(0.5f - EDGE_EPS), _CMP_NLT_UQ) |
            _mm512_cmp_ps_mask(_mm512_abs_ps(u), _mm512_set1_ps(1.0f), _CMP_NLE_UQ);
    __m512i K = _mm512_cvttps_epi32(fl), c;
    if (sign_mag) {  /* m = clamp(K, 0, 127), + 128 for u < 0 */
        c = _mm512_min_epi32(_mm512_max_epi32(K, _mm512_setzero_si512()), _mm512_set1_epi32(127));
        c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(u, _mm512_setzero_ps(), _CMP_LT_OQ), c,
                                  _mm512_set1_epi32(128));
    } else {  /* K = 480·t + 16: anchor a = K / 32, offset within the cell r = min(15, (K % 32 + 1) / 2) */
        const __m512i r_lo = _mm512_setr_epi32(0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8);
        const __m512i r_hi = _mm512_setr_epi32(8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15, 15);
        c = _mm512_add_epi32(_mm512_slli_epi32(_mm512_srai_epi32(K, 5), 4),
                             _mm512_permutex2var_epi32(r_lo, K, r_hi));  /* r by K % 32 */
        c = _mm512_min_epi32(_mm512_max_epi32(c, _mm512_setzero_si512()), _mm512_set1_epi32(255));
    }
    return c;
}

/* y = ln(1+α|u|)/ln(1+α) for 16 lanes: ln from exponent + atanh series (|error| < 1e-6) */
static inline __m512 ylog16(__m512 au, float alpha, float inv_l) {
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 w = _mm512_fmadd_ps(_mm512_set1_ps(alpha), au, one);
    __m512 e = _mm512_getexp_ps(w), m = _mm512_getmant_ps(w, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
    __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356f), _CMP_GT_OQ);
    m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
    e = _mm512_mask_add_ps(e, big, e, one);
    __m512 t = _mm512_div_ps(_mm512_sub_ps(m, one), _mm512_add_ps(m, one)), t2 = _mm512_mul_ps(t, t);
    __m512 q = _mm512_fmadd_ps(t2, _mm512_set1_ps(1.0f / 9), _mm512_set1_ps(1.0f / 7));
    q = _mm512_fmadd_ps(q, t2, _mm512_set1_ps(1.0f / 5));
    q = _mm512_fmadd_ps(q, t2, _mm512_set1_ps(1.0f / 3));
    q = _mm512_fmadd_ps(q, t2, one);
    __m512 ln = _mm512_fmadd_ps(e, _mm512_set1_ps(0.693147181f), _mm512_mul_ps(_mm512_add_ps(t, t), q));
    return _mm512_mul_ps(ln, _mm512_set1_ps(inv_l));
}

/* 16 codes (channels 2j, 2j+1 adjacent) → 8 anchor bytes and 8 residual bytes */
static inline void pack16(__m512i c, uint8_t *oa, uint8_t *orr) {
    __m512i lo = _mm512_and_si512(c, _mm512_set1_epi64(0xff)), hi = _mm512_srli_epi64(c, 32);
    __m512i a = _mm512_or_si512(_mm512_srli_epi64(lo, 4), _mm512_and_si512(hi, _mm512_set1_epi64(0xf0)));
    __m512i r = _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi64(15)),
                                _mm512_slli_epi64(_mm512_and_si512(hi, _mm512_set1_epi64(15)), 4));
    _mm_storel_epi64((__m128i *)oa, _mm512_cvtepi64_epi8(a));
    _mm_storel_epi64((__m128i *)orr, _mm512_cvtepi64_epi8(r));
}

/* 64 codes (4 vectors of 16 channels) → 32 anchor bytes and 32 residual bytes */
static inline void pack64(const __m512i *c, uint8_t *oa, uint8_t *orr) {
    __m512i b = _mm512_castsi128_si512(_mm512_cvtepi32_epi8(c[0]));
    b = _mm512_inserti32x4(b, _mm512_cvtepi32_epi8(c[1]), 1);
    b = _mm512_inserti32x4(b, _mm512_cvtepi32_epi8(c[2]), 2);
    b = _mm512_inserti32x4(b, _mm512_cvtepi32_epi8(c[3]), 3);  /* 16-bit lanes: c_even | c_odd << 8 */
    const __m512i lo4 = _mm512_set1_epi16(0x000f), hi4 = _mm512_set1_epi16(0x00f0);
    __m512i a = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(b, 4), lo4),
                                _mm512_and_si512(_mm512_srli_epi16(b, 8), hi4));
    __m512i r = _mm512_or_si512(_mm512_and_si512(b, lo4), _mm512_and_si512(_mm512_srli_epi16(b, 4), hi4));
    _mm256_storeu_si256((__m256i *)oa, _mm512_cvtepi16_epi8(a));
    _mm256_storeu_si256((__m256i *)orr, _mm512_cvtepi16_epi8(r));
}

/* 16 values of x (dtype 0 f32, 1 f16, 2 bf16) as f32 */
static inline __m512 load16(const void *x, int dtype, int64_t off) {
    if (dtype == 0) return _mm512_loadu_ps((const float *)x + off);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + off));
    if (dtype == 1) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 statistics (fp16, or uint8 times k) as f32 */
static inline __m512 stat16(const void *t, int stat_u8, int64_t off, float k) {
    if (stat_u8)
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                                 (const __m128i *)((const uint8_t *)t + off)))), _mm512_set1_ps(k));
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)t + off)));
}
#endif

/* minmax twin: for work units [u0, u1) of (bh, chunk): per (chunk, channel) min / max into lo_c / hi_c
 * [BH, NC, D] and per token min / max over D into lo_t / hi_t [BH, S] (NULL: skipped). NaN propagates. */
void lynx_minmax(const void *x, int dtype, int64_t S, int64_t D, int64_t chunk, int64_t u0, int64_t u1,
                 float *lo_c, float *hi_c, float *lo_t, float *hi_t) {
    enum { L = 16 };
    float buf[LYNX_MAX_D], lo[LYNX_MAX_D], hi[LYNX_MAX_D];
    int32_t nan[LYNX_MAX_D];
    int64_t NC = (S + chunk - 1) / chunk;
#ifdef LYNX_AVX512
    if (D % 16 == 0 && D <= 256) {
        const __m512 inf = _mm512_set1_ps(__builtin_inff()), ninf = _mm512_set1_ps(-__builtin_inff());
        const __m512 qnan = _mm512_set1_ps(__builtin_nanf(""));
        const int64_t nv = D / 16;
        for (int64_t unit = u0; unit < u1; unit++) {
            int64_t bh = unit / NC, c = unit % NC, s1 = (c + 1) * chunk < S ? (c + 1) * chunk : S;
            __m512 lv[16], hv[16];
            __mmask16 nm[16];
            for (int64_t i = 0; i < nv; i++) { lv[i] = inf; hv[i] = ninf; nm[i] = 0; }
            for (int64_t s = c * chunk; s < s1; s++) {
                __m512 tl = inf, th = ninf;
                __mmask16 tn = 0;
                for (int64_t i = 0; i < nv; i++) {
                    __m512 v = load16(x, dtype, (bh * S + s) * D + 16 * i);
                    __mmask16 n = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                    lv[i] = _mm512_min_ps(lv[i], v);
                    hv[i] = _mm512_max_ps(hv[i], v);
                    nm[i] |= n;
                    tl = _mm512_min_ps(tl, v);
                    th = _mm512_max_ps(th, v);
                    tn |= n;
                }
                if (lo_t) {
                    lo_t[bh * S + s] = tn ? __builtin_nanf("") : _mm512_reduce_min_ps(tl);
                    hi_t[bh * S + s] = tn ? __builtin_nanf("") : _mm512_reduce_max_ps(th);
                }
            }
            for (int64_t i = 0; i < nv; i++) {
                _mm512_storeu_ps(lo_c + unit * D + 16 * i, _mm512_mask_mov_ps(lv[i], nm[i], qnan));
                _mm512_storeu_ps(hi_c + unit * D + 16 * i, _mm512_mask_mov_ps(hv[i], nm[i], qnan));
            }
        }
        return;
    }
#endif
    for (int64_t unit = u0; unit < u1; unit++) {
        int64_t bh = unit / NC, c = unit % NC, s1 = (c + 1) * chunk < S ? (c + 1) * chunk : S;
        for (int64_t d = 0; d < D; d++) { lo[d] = __builtin_inff(); hi[d] = -__builtin_inff(); nan[d] = 0; }
        for (int64_t s = c * chunk; s < s1; s++) {
            const float *v = row_f32(x, dtype, (bh * S + s) * D, D, buf);
            for (int64_t d = 0; d < D; d++) {
                float e = v[d];
                lo[d] = e < lo[d] ? e : lo[d];
                hi[d] = e > hi[d] ? e : hi[d];
                nan[d] |= e != e;
            }
            if (lo_t) { /* lane-wise, then across lanes: vectorises without reassociating anything inexact */
                float tl[L], th[L];
                int32_t tn[L];
                for (int l = 0; l < L; l++) { tl[l] = __builtin_inff(); th[l] = -__builtin_inff(); tn[l] = 0; }
                int64_t d = 0;
                for (; d + L <= D; d += L)
                    for (int l = 0; l < L; l++) {
                        float e = v[d + l];
                        tl[l] = e < tl[l] ? e : tl[l];
                        th[l] = e > th[l] ? e : th[l];
                        tn[l] |= e != e;
                    }
                for (; d < D; d++) {
                    float e = v[d];
                    tl[0] = e < tl[0] ? e : tl[0];
                    th[0] = e > th[0] ? e : th[0];
                    tn[0] |= e != e;
                }
                float a = tl[0], b = th[0];
                int32_t n = tn[0];
                for (int l = 1; l < L; l++) { a = tl[l] < a ? tl[l] : a; b = th[l] > b ? th[l] : b; n |= tn[l]; }
                lo_t[bh * S + s] = n ? __builtin_nanf("") : a;
                hi_t[bh * S + s] = n ? __builtin_nanf("") : b;
            }
        }
        float *ol = lo_c + unit * D, *oh = hi_c + unit * D;
        for (int64_t d = 0; d < D; d++) {
            ol[d] = nan[d] ? __builtin_nanf("") : lo[d];
            oh[d] = nan[d] ? __builtin_nanf("") : hi[d];
        }
    }
}

static inline uint16_t f16_bits(f16 h) { uint16_t b; memcpy(&b, &h, 2); return b; }
static inline f16 f16_from_bits(uint16_t b) { f16 h; memcpy(&h, &b, 2); return h; }

/* range_stats twin: mid-range μ and half-range σ in fp16, σ rounded outward so that σ >= max(hi − μ, μ − lo). */
void lynx_range_stats(const float *lo, const float *hi, int64_t n, f16 *mu, f16 *sigma) {
    int64_t i = 0;
#ifdef LYNX_AVX512
    const int rne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (; i + 16 <= n; i += 16) {
        __m512 l = _mm512_loadu_ps(lo + i), h = _mm512_loadu_ps(hi + i);
        __m256i m = _mm512_cvtps_ph(_mm512_div_ps(_mm512_add_ps(h, l), _mm512_set1_ps(2.0f)), rne);
        __m512 mf = _mm512_cvtph_ps(m);
        __m512 span = _mm512_max_ps(_mm512_sub_ps(h, mf), _mm512_sub_ps(mf, l));
        __m256i q = _mm512_cvtps_ph(_mm512_max_ps(span, _mm512_set1_ps(0x1p-24f)), rne);
        __mmask16 up = _mm512_cmp_ps_mask(_mm512_cvtph_ps(q), span, _CMP_LT_OQ) &
                       _mm256_cmpneq_epi16_mask(q, _mm256_set1_epi16(0x7c00));
        q = _mm256_mask_add_epi16(q, up, q, _mm256_set1_epi16(1));
        _mm256_storeu_si256((__m256i *)(mu + i), m);
        _mm256_storeu_si256((__m256i *)(sigma + i), q);
    }
#endif
    for (; i < n; i++) {
        f16 m = (f16)((hi[i] + lo[i]) / 2.0f);
        float mf = (float)m, a = hi[i] - mf, b = mf - lo[i];
        float span = a > b ? a : b;  /* torch.maximum: NaN-free here (inputs checked finite) */
        float cl = span < 0x1p-24f ? 0x1p-24f : span;
        f16 s = (f16)cl;
        if ((float)s < span) {
            uint16_t bits = f16_bits(s);
            if (bits != 0x7c00) s = f16_from_bits((uint16_t)(bits + 1));  /* s > 0: next fp16 up */
        }
        mu[i] = m;
        sigma[i] = s;
    }
}


/* the exact code of u: #thresholds <= u (sign-magnitude: of |u|, + 128 for u < 0), through the grid */
static inline int32_t code_grid(float u, const float *thr, int sign_mag, const int32_t *grid, int64_t ngrid,
                                float grid_lo, float grid_scale) {
    float e = sign_mag ? __builtin_fabsf(u) : u, f = (e - grid_lo) * grid_scale, top = (float)(ngrid - 1);
    f = f > 0.0f ? f : 0.0f;
    f = f < top ? f : top;
    int32_t c = grid[(int32_t)f];
    c += thr[c] <= e;
    c += thr[c] <= e;
    return sign_mag ? c + (u < 0.0f) * 128 : c;
}

#ifdef LYNX_AVX512
typedef struct {
    const void *x; int dtype; const f16 *gmin, *gscale; const void *mu, *rho; int stat_u8, token_axis, sign_mag;
    float k, alpha, inv_l; const float *poly; int npoly; const float *thr; const int32_t *grid; int64_t ngrid;
    float grid_lo, grid_scale;
} enc_args;

/* nv·16 consecutive channels of one row (x from element xoff; stats from cs, page stats from ps). Each phase runs
 * over all nv vectors before the next, so the polynomial's nv dependency chains interleave. */
static inline __attribute__((always_inline)) void encode_row16(const enc_args *a, int64_t xoff, int64_t cs,
                                                               int64_t ps, uint8_t *oa, uint8_t *orr, const int nv) {
    __m512 u[8], y[8];
    for (int v = 0; v < nv; v++) {
        __m512 x = load16(a->x, a->dtype, xoff + 16 * v);
        if (a->gmin)
            x = _mm512_div_ps(_mm512_sub_ps(x, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(a->gmin + ps + 16 * v)))),
                              _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(a->gscale + ps + 16 * v))));
        __m512 m = a->token_axis ? _mm512_set1_ps(stat(a->mu, a->stat_u8, cs, a->k)) : stat16(a->mu, a->stat_u8, cs + 16 * v, a->k);
        __m512 q = a->token_axis ? _mm512_set1_ps(stat(a->rho, a->stat_u8, cs, a->k)) : stat16(a->rho, a->stat_u8, cs + 16 * v, a->k);
        u[v] = _mm512_div_ps(_mm512_sub_ps(x, m), q);
    }
    if (a->npoly > 0) {  /* y as a polynomial in 2|u| − 1 fitted for this α (error < 3e-7 on [0, 1], checked) */
        __m512 t[8];
        for (int v = 0; v < nv; v++) {
            t[v] = _mm512_fmsub_ps(_mm512_abs_ps(u[v]), _mm512_set1_ps(2.0f), _mm512_set1_ps(1.0f));
            y[v] = _mm512_set1_ps(a->poly[a->npoly - 1]);
        }
        for (int i = a->npoly - 2; i >= 0; i--) {
            const __m512 ci = _mm512_set1_ps(a->poly[i]);
            for (int v = 0; v < nv; v++) y[v] = _mm512_fmadd_ps(y[v], t[v], ci);
        }
    } else {
        for (int v = 0; v < nv; v++)
            y[v] = a->alpha != 0.0f ? ylog16(_mm512_abs_ps(u[v]), a->alpha, a->inv_l) : _mm512_abs_ps(u[v]);
    }
    __m512i cv[8];
    for (int v = 0; v < nv; v++) {
        __mmask16 slow;
        __m512i c = codes_from_y16(u[v], y[v], a->sign_mag, &slow);
        if (slow) {  /* rare (~0.1 % of lanes): lanes next to a code edge take the exact search */
            int32_t tmp[16];
            float ut[16];
            _mm512_storeu_si512(tmp, c);
            _mm512_storeu_ps(ut, u[v]);
            for (unsigned m = slow; m; m &= m - 1) {
                int l = __builtin_ctz(m);
                tmp[l] = code_grid(ut[l], a->thr, a->sign_mag, a->grid, a->ngrid, a->grid_lo, a->grid_scale);
            }
            c = _mm512_loadu_si512(tmp);
        }
        cv[v] = c;
    }
    if (nv % 4 == 0)
        for (int v = 0; v < nv; v += 4) pack64(cv + v, oa + 8 * v, orr + 8 * v);
    else
        for (int v = 0; v < nv; v++) pack16(cv[v], oa + 8 * v, orr + 8 * v);
}
#endif

/* D codes of `bits` bits → D·bits/8 bytes: groups of g = 8/gcd(8, bits) codes, code i of a group in bits
 * [bits·i, bits·i + bits) of the group's little-endian word (quant/pack.py's layout; bits 4: nibbles) */
static inline int64_t group_of(int bits) { return bits == 4 ? 2 : bits == 2 || bits == 6 ? 4 : bits == 8 ? 1 : 8; }
static void pack_row(const int32_t *v, int64_t D, int bits, int shift, int mask, uint8_t *out) {
    const int64_t g = group_of(bits), nb = g * bits / 8;
    for (int64_t j = 0; j < D; j += g) {
        uint64_t w = 0;
        for (int64_t i = 0; i < g; i++) w |= (uint64_t)((v[j + i] >> shift) & mask) << (bits * i);
        for (int64_t k = 0; k < nb; k++) *out++ = (uint8_t)(w >> (8 * k));
    }
}
static void unpack_row(const uint8_t *in, int64_t D, int bits, int32_t *v) {
    const int64_t g = group_of(bits), nb = g * bits / 8;
    for (int64_t j = 0; j < D; j += g) {
        uint64_t w = 0;
        for (int64_t k = 0; k < nb; k++) w |= (uint64_t)*in++ << (8 * k);
        for (int64_t i = 0; i < g; i++) v[j + i] = (int32_t)((w >> (bits * i)) & ((1u << bits) - 1));
    }
}

/* encode_codes twin for rows [r0, r1) of [BH·S]: u = ((x − γ_min)/γ_scale − μ)/σ, code = #thresholds <= u (or
 * <= |u| + 128·[u < 0] for sign-magnitude). With AVX-512 and alpha >= 0 the code comes from encode_row16 above (exact
 * search for flagged lanes); else through `grid`: grid[i] = #thresholds below bin i of a uniform grid fine enough
 * that at most two thresholds can lie in a bin (checked in Python when the grid is built), then at most two
 * comparisons. thr holds nthr thresholds followed by two +inf. Codes split into the anchor (top b bits) and the
 * residual (the other 8 − b), each packed by pack_row (b = 4: two codes a byte, even channel in the low nibble). */
void lynx_encode_rows(const lynx_encode_args *args, int64_t r0, int64_t r1) {
    const void *x = args->x; const int dtype = args->dtype; const int64_t S = args->S, D = args->D;
    const f16 *gmin = args->gmin, *gscale = args->gscale; const int64_t NP = args->NP, page = args->page;
    const void *mu = args->mu, *rho = args->rho; const int stat_u8 = args->stat_u8, token_axis = args->token_axis;
    const int64_t NC = args->NC, chunk = args->chunk; const float *thr = args->thr; const int64_t nthr = args->nthr;
    const int sign_mag = args->sign_mag; const float alpha = args->alpha, inv_l = args->inv_l;
    const float *poly = args->poly; const int npoly = args->npoly; const int32_t *grid = args->grid;
    const int64_t ngrid = args->ngrid; const float grid_lo = args->grid_lo, grid_scale = args->grid_scale;
    uint8_t *anchor = args->anchor, *residual = args->residual;
    const int bits = (int)args->anchor_bits, low = 8 - bits;
    float buf[LYNX_MAX_D], u[LYNX_MAX_D];
    int32_t code[LYNX_MAX_D];
    const float k = stat_u8 ? (float)(1.0 / 255) : 1.0f;
    (void)NC;
    (void)nthr;
#ifdef LYNX_AVX512
    if (alpha >= 0.0f && D % 16 == 0 && bits == 4) {  /* everything in registers; same fp32 operations as below */
        const int64_t nc = (S + chunk - 1) / chunk;
        const enc_args ea = {x, dtype, gmin, gscale, mu, rho, stat_u8, token_axis, sign_mag, k, alpha, inv_l, poly,
                             npoly, thr, grid, ngrid, grid_lo, grid_scale};
        for (int64_t r = r0, bh = r0 / S, s = r0 % S; r < r1; r++) {
            const int64_t cs = token_axis ? r : (bh * nc + s / chunk) * D, ps = gmin ? (bh * NP + s / page) * D : 0;
            uint8_t *oa = anchor + r * (D / 2), *orr = residual + r * (D / 2);
            if (D == 64) encode_row16(&ea, r * D, cs, ps, oa, orr, 4);  /* constant widths: chains interleave */
            else if (D == 128) encode_row16(&ea, r * D, cs, ps, oa, orr, 8);
            else for (int64_t d = 0; d < D; d += 16) encode_row16(&ea, r * D + d, cs + (token_axis ? 0 : d),
                                                                  ps + d, oa + d / 2, orr + d / 2, 1);
            if (++s == S) { s = 0; bh++; }
        }
        return;
    }
#endif
    for (int64_t r = r0; r < r1; r++) {
        int64_t bh = r / S, s = r % S;
        const float *v = row_f32(x, dtype, r * D, D, buf);
        if (gmin) {
            const int64_t p = (bh * NP + s / page) * D;
            for (int64_t d = 0; d < D; d++) buf[d] = (v[d] - (float)gmin[p + d]) / (float)gscale[p + d];
            v = buf;
        }
        if (token_axis) {
            const float m = stat(mu, stat_u8, r, k), q = stat(rho, stat_u8, r, k);
            for (int64_t d = 0; d < D; d++) u[d] = (v[d] - m) / q;
        } else {
            const int64_t c = (bh * ((S + chunk - 1) / chunk) + s / chunk) * D;
            if (stat_u8) {
                const uint8_t *m = (const uint8_t *)mu + c, *q = (const uint8_t *)rho + c;
                for (int64_t d = 0; d < D; d++) u[d] = (v[d] - (float)m[d] * k) / ((float)q[d] * k);
            } else {
                const f16 *m = (const f16 *)mu + c, *q = (const f16 *)rho + c;
                for (int64_t d = 0; d < D; d++) u[d] = (v[d] - (float)m[d]) / (float)q[d];
            }
        }
        for (int64_t d = 0; d < D; d++) code[d] = code_grid(u[d], thr, sign_mag, grid, ngrid, grid_lo, grid_scale);
        pack_row(code, D, bits, low, (1 << bits) - 1, anchor + r * (D * bits / 8));
        pack_row(code, D, low, 0, (1 << low) - 1, residual + r * (D * low / 8));
    }
}

/* dequantize_codes twin for rows [r0, r1): x̂ = γ_min + γ_scale·(μ + σ·LUT[code]), code = the b-bit anchor (residual
 * NULL, 2^b-entry lut) or anchor·2^(8−b) + residual (256-entry lut); out in out_dtype, row (bh, s) at element
 * bh·out_bh_stride + s·D (a slice of a longer buffer along S, or contiguous with out_bh_stride = S·D). */
void lynx_dequantize_rows(const lynx_dequantize_args *args, int64_t r0, int64_t r1) {
    const uint8_t *anchor = args->anchor, *residual = args->residual;
    const f16 *gmin = args->gmin, *gscale = args->gscale; const int64_t NP = args->NP, page = args->page;
    const void *mu = args->mu, *rho = args->rho; const int stat_u8 = args->stat_u8, token_axis = args->token_axis;
    const int64_t chunk = args->chunk; const float *lut = args->lut; const int64_t S = args->S, D = args->D;
    const int out_dtype = args->out_dtype; void *out = args->out; const int64_t out_bh_stride = args->out_bh_stride;
    const int bits = (int)args->anchor_bits, low = 8 - bits;
    int32_t code[LYNX_MAX_D], rest[LYNX_MAX_D];
    float xn[LYNX_MAX_D];
    const float k = stat_u8 ? (float)(1.0 / 255) : 1.0f;
    const int64_t NC = (S + chunk - 1) / chunk;
#ifdef LYNX_AVX512
    if (D % 16 == 0 && bits == 4) {  /* table lookups by permutes (16-entry: one vpermps; 256: eight vpermi2ps + selects) */
        const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        const __m512i shift = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
        const __m512i m15 = _mm512_set1_epi32(15);
        __m512 tab[16];
        for (int i = 0; i < (residual ? 16 : 1); i++) tab[i] = _mm512_loadu_ps(lut + 16 * i);
        for (int64_t r = r0, bh = r0 / S, s = r0 % S; r < r1; r++) {
            __m512 mt = _mm512_setzero_ps(), qt = mt;
            if (token_axis) { mt = _mm512_set1_ps(stat(mu, stat_u8, r, k)); qt = _mm512_set1_ps(stat(rho, stat_u8, r, k)); }
            const int64_t cs = (bh * NC + s / chunk) * D, ps = gmin ? (bh * NP + s / page) * D : 0;
            const int64_t o = bh * out_bh_stride + s * D;
            for (int64_t d = 0; d < D; d += 16) {
                const int64_t off = r * (D / 2) + d / 2;
                __m512i c = _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_shuffle_epi8(
                    _mm_loadl_epi64((const __m128i *)(anchor + off)), dup)), shift), m15);
                __m512 u;
                if (residual) {
                    __m512i q = _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_shuffle_epi8(
                        _mm_loadl_epi64((const __m128i *)(residual + off)), dup)), shift), m15);
                    c = _mm512_or_si512(_mm512_slli_epi32(c, 4), q);
                    __m512 v[8];
                    for (int t = 0; t < 8; t++) v[t] = _mm512_permutex2var_ps(tab[2 * t], c, tab[2 * t + 1]);
                    __mmask16 b5 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(32));
                    __mmask16 b6 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(64));
                    __mmask16 b7 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(128));
                    for (int t = 0; t < 4; t++) v[t] = _mm512_mask_mov_ps(v[2 * t], b5, v[2 * t + 1]);
                    for (int t = 0; t < 2; t++) v[t] = _mm512_mask_mov_ps(v[2 * t], b6, v[2 * t + 1]);
                    u = _mm512_mask_mov_ps(v[0], b7, v[1]);
                } else {
                    u = _mm512_permutexvar_ps(c, tab[0]);
                }
                __m512 m = token_axis ? mt : stat16(mu, stat_u8, cs + d, k);
                __m512 q = token_axis ? qt : stat16(rho, stat_u8, cs + d, k);
                __m512 xn = _mm512_add_ps(m, _mm512_mul_ps(q, u));
                if (gmin)
                    xn = _mm512_add_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gmin + ps + d))),
                                       _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gscale + ps + d))), xn));
                if (out_dtype == 0) {
                    _mm512_storeu_ps((float *)out + o + d, xn);
                } else if (out_dtype == 1) {
                    _mm256_storeu_si256((__m256i *)((uint16_t *)out + o + d),
                                        _mm512_cvtps_ph(xn, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                } else {  /* bf16, round to nearest even (NaN cannot occur: codes and stats are finite) */
                    __m512i b = _mm512_castps_si512(xn);
                    b = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                         _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1))));
                    _mm256_storeu_si256((__m256i *)((uint16_t *)out + o + d),
                                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
                }
            }
            if (++s == S) { s = 0; bh++; }
        }
        return;
    }
#endif
    for (int64_t r = r0; r < r1; r++) {
        int64_t bh = r / S, s = r % S;
        const int64_t o = bh * out_bh_stride + s * D;
        unpack_row(anchor + r * (D * bits / 8), D, bits, code);
        if (residual) {
            unpack_row(residual + r * (D * low / 8), D, low, rest);
            for (int64_t d = 0; d < D; d++) code[d] = (code[d] << low) | rest[d];
        }
        if (token_axis) {
            const float m = stat(mu, stat_u8, r, k), q = stat(rho, stat_u8, r, k);
            for (int64_t d = 0; d < D; d++) xn[d] = m + q * lut[code[d]];
        } else {
            const int64_t c = (bh * NC + s / chunk) * D;
            if (stat_u8) {
                const uint8_t *m = (const uint8_t *)mu + c, *q = (const uint8_t *)rho + c;
                for (int64_t d = 0; d < D; d++) xn[d] = (float)m[d] * k + ((float)q[d] * k) * lut[code[d]];
            } else {
                const f16 *m = (const f16 *)mu + c, *q = (const f16 *)rho + c;
                for (int64_t d = 0; d < D; d++) xn[d] = (float)m[d] + (float)q[d] * lut[code[d]];
            }
        }
        if (gmin) {
            const int64_t p = (bh * NP + s / page) * D;
            for (int64_t d = 0; d < D; d++) xn[d] = (float)gmin[p + d] + (float)gscale[p + d] * xn[d];
        }
        if (out_dtype == 0) {
            memcpy((float *)out + o, xn, (size_t)D * 4);
        } else if (out_dtype == 1) {
            f16 *h = (f16 *)out + o;
            for (int64_t d = 0; d < D; d++) h[d] = (f16)xn[d];
        } else {
            uint16_t *h = (uint16_t *)out + o;
            for (int64_t d = 0; d < D; d++) h[d] = f32_to_bf16(xn[d]);
        }
    }
}
