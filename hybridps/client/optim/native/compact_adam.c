/*
 * The Adam step over compact (8-bit blockwise) moment rows, on the CPU: torchao's AdamW8bit /
 * bitsandbytes' 8-bit Adam, element for element (see hybridps/client/optim/compact_adam.py,
 * [Note: the compact step], for the arithmetic and where it comes from).
 *
 * Owns the loops over whole blocks of BLOCK elements: dequantize the old moments, step them
 * and the master in fp32, take each new moment block's absmax, quantize it; one pass over a
 * block, its new moments kept in L1. Does not own the maps, the bucket tables or the
 * hyperparameters' fp32 values (built in Python and passed in: moment_codes.py,
 * compact_adam.py), nor threads (the caller splits a range into pieces of whole blocks, one per
 * thread; ctypes lets the GIL go for the call).
 *
 * Plain C99 with no Python headers. Where the compiler targets AVX-512 with VBMI (byte
 * permutes: Ice Lake and later, Zen 4 and later) whole blocks take an intrinsics path that
 * looks tables up in registers (see [Note: register lookups]); elsewhere (or built with
 * -DHPS_PORTABLE_ONLY), and for a range's last partial block, the portable loops, which the
 * compiler vectorizes where it can. Both compute the same bits. Built with -ffp-contract=off:
 * every operation rounds as torch's separate ops do. The one fused multiply-add is the lerp's,
 * written out, as torch's vectorized CPU lerp fuses it where the build has FMA
 * (Vectorized::fmadd).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VBMI__) && \
    defined(__FMA__) && !defined(HPS_PORTABLE_ONLY)
#define HPS_AVX512 1
#include <immintrin.h>
#else
#define HPS_AVX512 0
#endif

#define BLOCK 256
#define ABI_VERSION 3
#define SIMD_MIN_EXPONENT 96 /* the first binade the SIMD quantizer tells apart */

/* One map's tables, laid out as native/__init__.py's codebook() builds them. A value's code is
 * the number of the map's rounding thresholds at or below it; each quantizer finds the bucket
 * the value lies in (a bucket holds at most one threshold), takes the code of its lowest value
 * and adds one if the value reaches the bucket's threshold. */
typedef struct {
    float qmap[256]; /* the map's values, sorted */
    /* portable: by a float's top 16 bits, the low byte is the code of the bucket's lowest value,
     * the bits above the key (bucket_key_) of the one threshold inside the bucket, 0x10000 if none */
    uint32_t bucket[65536];
    uint8_t qmap_planes[4][256];      /* SIMD: byte p of each map value */
    uint8_t threshold_planes[4][256]; /* SIMD: byte p of each threshold (the 256th is NaN) */
    /* SIMD, for |x| <= 1: by sign and binade (exponent field - SIMD_MIN_EXPONENT, clamped to
     * [0, 31]), the binade's first sub-bucket | shift << 16: its sub-bucket is mantissa >> shift */
    uint32_t binades[2][32];
    uint8_t sub_bucket[512]; /* SIMD: the code of each sub-bucket's lowest value */
} hps_codebook;

int hps_codebook_bytes(void) { return (int)sizeof(hps_codebook); }

/* The fp32 scalars of a step, in this order (compact_adam.py fills them). */
enum {
    H_LR,          /* lr */
    H_LR_WD,       /* lr * weight_decay (decoupled) */
    H_WD,          /* weight_decay (coupled: added to the grad) */
    H_W1,          /* 1 - beta1: the momentum's lerp weight */
    H_W2,          /* 1 - beta2: the variance's lerp weight */
    H_EPS,         /* eps */
    H_BC1,         /* 1 - beta1 ** step */
    H_BC2_SQRT,    /* sqrt(1 - beta2 ** step) */
    H_SCALE_FLOOR, /* the smallest block scale (1e-12) */
    H_COUNT
};

enum { F_DECOUPLED = 1, F_MAXIMIZE = 2 };

typedef struct {
    float lr, lr_wd, wd, eps, bc1, bc2_sqrt, floor_;
    float c1, c2;       /* the lerps' coefficients: w if small, else w - 1 */
    int small1, small2; /* |w| < 0.5: torch's lerp takes the other formula */
    int decoupled, maximize;
} step_args;

int hps_abi_version(void) { return ABI_VERSION; }

/* torch's lerp: w < 0.5 ? a + w * (b - a) : b - (b - a) * (1 - w), one multiply-add where
 * torch's vectorized kernel has one (coeff is w or w - 1; 1 - w is exact for w in [0.5, 1]). */
static inline float lerp_(float a, float b, float coeff, int small) {
#ifdef __FMA__
    return fmaf(coeff, b - a, small ? a : b);
#else
    return small ? a + coeff * (b - a) : b + coeff * (b - a);
#endif
}

/* The key of a float inside its bucket: its low 16 bits, reversed for negatives, so the keys
 * order as the values do. */
static inline uint32_t bucket_key_(uint32_t bits) { return (bits & 0xFFFFu) ^ ((uint32_t)((int32_t)bits >> 31) & 0xFFFFu); }

/* The code of x (already divided by its block's scale): the bucket's low byte, plus one if x is
 * at or above the bucket's threshold. NaN: a quiet NaN's bucket reads 0 with no threshold. */
static inline uint8_t quantize_(float x, const hps_codebook *book) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint32_t entry = book->bucket[bits >> 16];
    return (uint8_t)((entry & 0xFFu) + (bucket_key_(bits) >= entry >> 8));
}

/* |x| as its bits: for non-NaN values their integer order is their value order, and NaN's are
 * above infinity's, so an integer max of these is torch's NaN-propagating amax. */
static inline uint32_t abs_bits_(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits & 0x7FFFFFFFu;
}

static inline float block_scale_(uint32_t absmax_bits, float floor_) {
    float absmax;
    memcpy(&absmax, &absmax_bits, sizeof absmax);
    return absmax < floor_ ? floor_ : absmax; /* NaN stays NaN, as torch's clip */
}

static void quantize_block_(const float *restrict values, float scale, const hps_codebook *restrict book,
                            uint8_t *restrict codes) {
    for (int i = 0; i < BLOCK; ++i) codes[i] = quantize_(values[i] / scale, book);
}

/* One block of n <= BLOCK elements, portable (the rest of the block is padding: zero moments). */
static void step_block_portable_(float *restrict master, const float *restrict grad, uint8_t *restrict m_codes,
                                 float *restrict m_scale, uint8_t *restrict v_codes, float *restrict v_scale, int n,
                                 const hps_codebook *restrict m_book, const hps_codebook *restrict v_book,
                                 const step_args *a) {
    float m_new[BLOCK], v_new[BLOCK];
    const float m_old_scale = *m_scale, v_old_scale = *v_scale;
    const float lr = a->lr, lr_wd = a->lr_wd, wd = a->wd, eps = a->eps, bc1 = a->bc1, bc2_sqrt = a->bc2_sqrt;
    const float c1 = a->c1, c2 = a->c2;
    const int small1 = a->small1, small2 = a->small2, decoupled = a->decoupled, maximize = a->maximize;
    uint32_t m_max = 0, v_max = 0;
    for (int i = 0; i < n; ++i) { /* branch-free (selects), so it vectorizes */
        const float g_in = maximize ? -grad[i] : grad[i];
        const float p_in = master[i];
        const float p_decayed = p_in - lr_wd * p_in;
        const float g_decayed = g_in + wd * p_in;
        const float p = decoupled ? p_decayed : p_in;
        const float g = decoupled ? g_in : g_decayed;
        const float m_old = m_book->qmap[m_codes[i]] * m_old_scale;
        const float v_old = v_book->qmap[v_codes[i]] * v_old_scale;
        const float m = lerp_(m_old, g, c1, small1);
        const float v = lerp_(v_old, g * g, c2, small2);
        m_new[i] = m;
        v_new[i] = v;
        const uint32_t m_abs = abs_bits_(m), v_abs = abs_bits_(v);
        m_max = m_abs > m_max ? m_abs : m_max;
        v_max = v_abs > v_max ? v_abs : v_max;
        const float denom = sqrtf(v) / bc2_sqrt + eps;
        master[i] = p - lr * (m / bc1) / denom;
    }
    for (int i = n; i < BLOCK; ++i) m_new[i] = v_new[i] = 0.0f;
    const float m_s = block_scale_(m_max, a->floor_), v_s = block_scale_(v_max, a->floor_);
    quantize_block_(m_new, m_s, m_book, m_codes);
    quantize_block_(v_new, v_s, v_book, v_codes);
    *m_scale = m_s;
    *v_scale = v_s;
}

#if HPS_AVX512
/* [Note: register lookups]
 * Gathers are slow on some CPUs (Zen 4: about two cycles an element), so the SIMD path looks
 * its tables up in registers with byte permutes (vpermi2b: 128 one-byte entries for 64 lanes in
 * one instruction). A 256-entry table of fp32 (the map, the thresholds) is kept as 4 byte
 * planes; 64 codes look up each plane (two permutes and a blend by the code's top bit) and the
 * planes interleave back into 4 vectors of 16 fp32 (unpacks, which work within 128-bit lanes;
 * the codes are shuffled first so the results come out in order). The quantizer's bucket is
 * found without the 2**16-entry table: a 64-entry table by sign and binade gives where the
 * binade's sub-buckets start and how many mantissa bits tell them apart (as few as keep one
 * threshold a sub-bucket; 512 sub-buckets in all, looked up as bytes), then the threshold
 * T[code] is looked up by the code. Valid for |x| <= 1, which is what a block divided by a
 * finite absmax holds; a block with a NaN or infinite scale takes the portable quantizer. */

/* planes[p][r]: entries 64r .. 64r + 63 of byte plane p */
typedef struct {
    __m512i planes[4][4];
} table256;

static inline table256 load_table256_(const uint8_t planes[4][256]) {
    table256 t;
    for (int p = 0; p < 4; ++p)
        for (int r = 0; r < 4; ++r) t.planes[p][r] = _mm512_loadu_si512((const void *)(planes[p] + 64 * r));
    return t;
}

/* lanes 16q + 4L + j of 64 indices to position 16L + 4q + j, so the unpacks' results come in order */
static inline __m512i unpack_order_(void) {
    uint8_t order[64];
    for (int q = 0; q < 4; ++q)
        for (int l = 0; l < 4; ++l)
            for (int j = 0; j < 4; ++j) order[16 * l + 4 * q + j] = (uint8_t)(16 * q + 4 * l + j);
    return _mm512_loadu_si512((const void *)order);
}

/* table[idx] for 64 byte indices, as 4 vectors of 16 dwords (lanes 0-15, 16-31, ...). */
static inline void lookup256_(const table256 *t, __m512i idx, __m512i order, __m512i out[4]) {
    idx = _mm512_permutexvar_epi8(order, idx);
    const __mmask64 high = _mm512_movepi8_mask(idx);
    __m512i b[4];
    for (int p = 0; p < 4; ++p)
        b[p] = _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(t->planes[p][0], idx, t->planes[p][1]),
                                      _mm512_permutex2var_epi8(t->planes[p][2], idx, t->planes[p][3]));
    const __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
    out[0] = _mm512_unpacklo_epi16(lo01, lo23);
    out[1] = _mm512_unpackhi_epi16(lo01, lo23);
    out[2] = _mm512_unpacklo_epi16(hi01, hi23);
    out[3] = _mm512_unpackhi_epi16(hi01, hi23);
}

static inline __mmask64 join_masks_(const __mmask16 m[4]) {
    return _mm512_kunpackd(_mm512_kunpackw(m[3], m[2]), _mm512_kunpackw(m[1], m[0]));
}

/* The quantizer's tables in registers. */
typedef struct {
    table256 thresholds;
    __m512i binades[2][2];  /* [sign][half]: 16 entries each */
    __m512i sub_bucket[8];  /* 64 entries each */
    __m512i pack_select[2]; /* pack_byte_'s selects of each dword's byte 0 and byte 1 */
} quantizer;

/* vpermt2b's select of byte `byte` of each dword of two vectors, into the low 32 bytes. */
static inline __m512i pack_select_(int byte) {
    uint8_t select[64];
    for (int i = 0; i < 64; ++i) select[i] = (uint8_t)((i < 16 ? 4 * i : 64 + 4 * (i - 16)) + byte);
    return _mm512_loadu_si512((const void *)select);
}

static inline void load_quantizer_(quantizer *q, const hps_codebook *book) {
    q->pack_select[0] = pack_select_(0);
    q->pack_select[1] = pack_select_(1);
    q->thresholds = load_table256_(book->threshold_planes);
    for (int s = 0; s < 2; ++s)
        for (int h = 0; h < 2; ++h) q->binades[s][h] = _mm512_loadu_si512((const void *)(book->binades[s] + 16 * h));
    for (int r = 0; r < 8; ++r) q->sub_bucket[r] = _mm512_loadu_si512((const void *)(book->sub_bucket + 64 * r));
}

/* The sub-bucket of 16 values x (|x| <= 1) as dwords. The binade index saturates at 0 below
 * SIMD_MIN_EXPONENT; vpermt2d reads its 5 low bits, so no clamp above is needed (|x| <= 1). */
static inline __m512i sub_bucket16_(const quantizer *q, __m512i bits) {
    const __m512i exponent = _mm512_and_si512(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(0xFF));
    const __m512i binade = _mm512_subs_epu16(exponent, _mm512_set1_epi32(SIMD_MIN_EXPONENT));
    const __m512i entry = _mm512_mask_blend_epi32(_mm512_movepi32_mask(bits),
                                                  _mm512_permutex2var_epi32(q->binades[0][0], binade, q->binades[0][1]),
                                                  _mm512_permutex2var_epi32(q->binades[1][0], binade, q->binades[1][1]));
    const __m512i mantissa = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFF));
    const __m512i first = _mm512_and_si512(entry, _mm512_set1_epi32(0xFFFF));
    return _mm512_add_epi32(first, _mm512_srlv_epi32(mantissa, _mm512_srli_epi32(entry, 16)));
}

/* Byte `byte` of each dword of 4 vectors (lanes 0-15, 16-31, ...), as 64 bytes in order:
 * select is pack_select_(byte). */
static inline __m512i pack_byte_(const __m512i v[4], __m512i select) {
    const __m512i low = _mm512_permutex2var_epi8(v[0], select, v[1]), high = _mm512_permutex2var_epi8(v[2], select, v[3]);
    return _mm512_inserti64x4(low, _mm512_castsi512_si256(high), 1);
}

/* Codes of 64 values divided by scale, each quotient at most 1 in magnitude (not NaN). */
static inline void quantize64_(const float *restrict values, __m512 scale, const quantizer *q, __m512i order,
                               uint8_t *restrict codes) {
    __m512 x[4];
    __m512i sub[4];
    __mmask16 up[4];
    for (int k = 0; k < 4; ++k) {
        x[k] = _mm512_div_ps(_mm512_loadu_ps(values + 16 * k), scale);
        sub[k] = sub_bucket16_(q, _mm512_castps_si512(x[k]));
    }
    const __m512i idx = pack_byte_(sub, q->pack_select[0]);
    const __mmask64 bit7 = _mm512_movepi8_mask(idx);
    const __mmask64 bit8 = _mm512_test_epi8_mask(pack_byte_(sub, q->pack_select[1]), _mm512_set1_epi8(1));
    const __m512i *sb = q->sub_bucket;
    const __m512i low =
        _mm512_mask_blend_epi8(bit7, _mm512_permutex2var_epi8(sb[0], idx, sb[1]), _mm512_permutex2var_epi8(sb[2], idx, sb[3]));
    const __m512i top =
        _mm512_mask_blend_epi8(bit7, _mm512_permutex2var_epi8(sb[4], idx, sb[5]), _mm512_permutex2var_epi8(sb[6], idx, sb[7]));
    const __m512i code = _mm512_mask_blend_epi8(bit8, low, top);
    __m512i threshold[4];
    lookup256_(&q->thresholds, code, order, threshold);
    for (int k = 0; k < 4; ++k) up[k] = _mm512_cmp_ps_mask(x[k], _mm512_castsi512_ps(threshold[k]), _CMP_GE_OQ);
    _mm512_storeu_si512((void *)codes, _mm512_mask_add_epi8(code, join_masks_(up), code, _mm512_set1_epi8(1)));
}

/* A block's codes: the SIMD quantizer where the scale is finite (every quotient is then at
 * most 1 in magnitude), else the portable one (NaN and infinite values). */
static inline void quantize_block_simd_(const float *restrict values, float scale, const quantizer *q, __m512i order,
                                        const hps_codebook *book, uint8_t *restrict codes) {
    if (!isfinite(scale)) {
        quantize_block_(values, scale, book, codes);
        return;
    }
    for (int i = 0; i < BLOCK; i += 64) quantize64_(values + i, _mm512_set1_ps(scale), q, order, codes + i);
}

static inline __m512 lerp16_(__m512 a, __m512 b, __m512 coeff, int small) {
    return _mm512_fmadd_ps(coeff, _mm512_sub_ps(b, a), small ? a : b);
}

/* Everything a whole-block SIMD step reads, in registers. */
typedef struct {
    table256 m_map, v_map;
    quantizer m_q, v_q;
    __m512i order;
    const hps_codebook *m_book, *v_book;
} simd_tables;

/* The step's scalars broadcast, once per call. */
typedef struct {
    __m512 lr, lr_wd, wd, eps, bc1, bc2_sqrt, c1, c2;
    __m512i grad_sign; /* the sign bit if maximize: g = -g exactly */
    int small1, small2, decoupled;
} simd_args;

static simd_args simd_args_(const step_args *a) {
    simd_args s;
    s.lr = _mm512_set1_ps(a->lr);
    s.lr_wd = _mm512_set1_ps(a->lr_wd);
    s.wd = _mm512_set1_ps(a->wd);
    s.eps = _mm512_set1_ps(a->eps);
    s.bc1 = _mm512_set1_ps(a->bc1);
    s.bc2_sqrt = _mm512_set1_ps(a->bc2_sqrt);
    s.c1 = _mm512_set1_ps(a->c1);
    s.c2 = _mm512_set1_ps(a->c2);
    s.grad_sign = _mm512_set1_epi32(a->maximize ? (int32_t)0x80000000u : 0);
    s.small1 = a->small1;
    s.small2 = a->small2;
    s.decoupled = a->decoupled;
    return s;
}

#define HPS_INLINE static inline __attribute__((always_inline))

/* 16 lanes of the step: the same operations as step_block_portable_'s loop. The flags are
 * arguments so that calls with constants compile to loops without their tests. */
HPS_INLINE void step16_(float *restrict master, const float *restrict grad, __m512 m_old, __m512 v_old,
                        float *restrict m_new, float *restrict v_new, __m512i *m_max, __m512i *v_max,
                        const simd_args *a, int decoupled, int small1, int small2) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    __m512 g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_loadu_ps(grad)), a->grad_sign));
    __m512 p = _mm512_loadu_ps(master);
    if (decoupled)
        p = _mm512_sub_ps(p, _mm512_mul_ps(a->lr_wd, p));
    else
        g = _mm512_add_ps(g, _mm512_mul_ps(a->wd, p));
    const __m512 m = lerp16_(m_old, g, a->c1, small1);
    const __m512 v = lerp16_(v_old, _mm512_mul_ps(g, g), a->c2, small2);
    _mm512_storeu_ps(m_new, m);
    _mm512_storeu_ps(v_new, v);
    *m_max = _mm512_max_epu32(*m_max, _mm512_and_si512(_mm512_castps_si512(m), abs_mask));
    *v_max = _mm512_max_epu32(*v_max, _mm512_and_si512(_mm512_castps_si512(v), abs_mask));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), a->bc2_sqrt), a->eps);
    const __m512 step = _mm512_div_ps(_mm512_mul_ps(a->lr, _mm512_div_ps(m, a->bc1)), denom);
    _mm512_storeu_ps(master, _mm512_sub_ps(p, step));
}

/* One whole block, SIMD. */
HPS_INLINE void step_block_simd_(float *restrict master, const float *restrict grad, uint8_t *restrict m_codes,
                                 float *restrict m_scale, uint8_t *restrict v_codes, float *restrict v_scale,
                                 const simd_tables *t, const simd_args *a, float scale_floor, int decoupled, int small1,
                                 int small2) {
    float m_new[BLOCK], v_new[BLOCK];
    const __m512 m_old_scale = _mm512_set1_ps(*m_scale), v_old_scale = _mm512_set1_ps(*v_scale);
    __m512i m_max = _mm512_setzero_si512(), v_max = _mm512_setzero_si512();
    for (int i = 0; i < BLOCK; i += 64) {
        __m512i m_old[4], v_old[4];
        lookup256_(&t->m_map, _mm512_loadu_si512((const void *)(m_codes + i)), t->order, m_old);
        lookup256_(&t->v_map, _mm512_loadu_si512((const void *)(v_codes + i)), t->order, v_old);
        for (int k = 0; k < 4; ++k) {
            const int j = i + 16 * k;
            step16_(master + j, grad + j, _mm512_mul_ps(_mm512_castsi512_ps(m_old[k]), m_old_scale),
                    _mm512_mul_ps(_mm512_castsi512_ps(v_old[k]), v_old_scale), m_new + j, v_new + j, &m_max, &v_max, a,
                    decoupled, small1, small2);
        }
    }
    const float m_s = block_scale_(_mm512_reduce_max_epu32(m_max), scale_floor);
    const float v_s = block_scale_(_mm512_reduce_max_epu32(v_max), scale_floor);
    quantize_block_simd_(m_new, m_s, &t->m_q, t->order, t->m_book, m_codes);
    quantize_block_simd_(v_new, v_s, &t->v_q, t->order, t->v_book, v_codes);
    *m_scale = m_s;
    *v_scale = v_s;
}

static void load_simd_tables_(simd_tables *t, const hps_codebook *m_book, const hps_codebook *v_book) {
    t->m_map = load_table256_(m_book->qmap_planes);
    t->v_map = load_table256_(v_book->qmap_planes);
    load_quantizer_(&t->m_q, m_book);
    load_quantizer_(&t->v_q, v_book);
    t->order = unpack_order_();
    t->m_book = m_book;
    t->v_book = v_book;
}

/* The whole blocks of [s, s + blocks * BLOCK). */
HPS_INLINE void simd_blocks_(float *master, const float *grad, uint8_t *m_codes, float *m_scales, uint8_t *v_codes,
                             float *v_scales, int64_t s, int64_t blocks, const simd_tables *t, const simd_args *a,
                             float scale_floor, int decoupled, int small1, int small2) {
    for (int64_t k = 0; k < blocks; ++k, s += BLOCK)
        step_block_simd_(master + s, grad + s, m_codes + s, m_scales + s / BLOCK, v_codes + s, v_scales + s / BLOCK, t, a,
                         scale_floor, decoupled, small1, small2);
}

/* simd_blocks_ compiled for the usual flags (both lerp weights under 0.5, as for betas over
 * 0.5), and for any. */
static void simd_blocks_any_(float *master, const float *grad, uint8_t *m_codes, float *m_scales, uint8_t *v_codes,
                             float *v_scales, int64_t s, int64_t blocks, const simd_tables *t, const simd_args *a,
                             float scale_floor) {
    if (a->small1 && a->small2 && a->decoupled)
        simd_blocks_(master, grad, m_codes, m_scales, v_codes, v_scales, s, blocks, t, a, scale_floor, 1, 1, 1);
    else if (a->small1 && a->small2)
        simd_blocks_(master, grad, m_codes, m_scales, v_codes, v_scales, s, blocks, t, a, scale_floor, 0, 1, 1);
    else
        simd_blocks_(master, grad, m_codes, m_scales, v_codes, v_scales, s, blocks, t, a, scale_floor, a->decoupled,
                     a->small1, a->small2);
}
#endif

static step_args step_args_(const float *h, int flags) {
    step_args a;
    a.lr = h[H_LR];
    a.lr_wd = h[H_LR_WD];
    a.wd = h[H_WD];
    a.eps = h[H_EPS];
    a.bc1 = h[H_BC1];
    a.bc2_sqrt = h[H_BC2_SQRT];
    a.floor_ = h[H_SCALE_FLOOR];
    a.small1 = fabsf(h[H_W1]) < 0.5f;
    a.small2 = fabsf(h[H_W2]) < 0.5f;
    a.c1 = a.small1 ? h[H_W1] : h[H_W1] - 1.0f;
    a.c2 = a.small2 ? h[H_W2] : h[H_W2] - 1.0f;
    a.decoupled = (flags & F_DECOUPLED) != 0;
    a.maximize = (flags & F_MAXIMIZE) != 0;
    return a;
}

/* Step elements [start, end) of the flat rows: start on a block boundary; the blocks covering
 * the range are re-quantized (elements of the last block beyond end become zero moments) and
 * master beyond end is untouched. The codes and scales pointers are the whole rows'. */
int hps_compact_adam_step(float *master, const float *grad, uint8_t *m_codes, float *m_scales, uint8_t *v_codes,
                          float *v_scales, int64_t start, int64_t end, const hps_codebook *m_book,
                          const hps_codebook *v_book, const float *hyper, int flags) {
    if (start % BLOCK || end < start) return -1;
    const step_args a = step_args_(hyper, flags);
    int64_t s = start;
#if HPS_AVX512
    simd_tables tables;
    load_simd_tables_(&tables, m_book, v_book);
    const simd_args sa = simd_args_(&a);
    const int64_t blocks = (end - s) / BLOCK;
    simd_blocks_any_(master, grad, m_codes, m_scales, v_codes, v_scales, s, blocks, &tables, &sa, a.floor_);
    s += blocks * BLOCK;
#endif
    for (; s < end; s += BLOCK) {
        const int64_t b = s / BLOCK;
        const int n = end - s < BLOCK ? (int)(end - s) : BLOCK;
        step_block_portable_(master + s, grad + s, m_codes + s, m_scales + b, v_codes + s, v_scales + b, n, m_book,
                             v_book, &a);
    }
    return 0;
}

/* Codes of n values already divided by their scales (tests compare them with torchao's): by
 * the portable quantizer, or (simd != 0) the SIMD one, which takes n a multiple of 64 and
 * |x| <= 1 (no NaN); -1 if that is asked of a build without it. */
int hps_quantize_scaled(const float *x, int64_t n, const hps_codebook *book, uint8_t *codes, int simd) {
    if (!simd) {
        for (int64_t i = 0; i < n; ++i) codes[i] = quantize_(x[i], book);
        return 0;
    }
#if HPS_AVX512
    if (n % 64) return -1;
    quantizer q;
    load_quantizer_(&q, book);
    const __m512i order = unpack_order_();
    for (int64_t i = 0; i < n; i += 64) quantize64_(x + i, _mm512_set1_ps(1.0f), &q, order, codes + i);
    return 0;
#else
    return -1;
#endif
}

/* 1 if whole blocks take the AVX-512 path in this build. */
int hps_uses_avx512(void) { return HPS_AVX512; }
