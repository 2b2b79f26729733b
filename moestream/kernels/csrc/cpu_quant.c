/* Quantized matrix-vector products on the CPU, straight from GGUF blocks (the types block_bytes names).
 *
 * y[p][r] = sum_i W[mats[p]][r][i] * x[p][i], for the experts a small batch chose, read where they lie (the
 * memory-mapped file): no dequantized copy. Each block is unpacked to floats on the stack and multiplied in
 * float32; rows are shared out over OpenMP threads. Compiled on first use for the machine it runs on
 * (kernels/cpu_quant.py), so -march=native picks its vector units.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "iq_grids.h" /* the IQ grids and 7-bit sign patterns, generated from gguf's by kernels/cpu_quant.py */

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, MXFP4 = 39 };
enum { IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ3_S = 21, IQ2_S = 22, IQ1_M = 29 };
enum { IQ4_NL = 20, IQ4_XS = 23, TQ1_0 = 34, TQ2_0 = 35 };

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__F16C__)
static float f16(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8))); } /* exact */
#else
static float f16(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 1024)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 1023) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

/* Q2_K and Q3_K: value 128 h + 32 j + l is the 2-bit field j of byte 32 h + l, in sub-block 8 h + 2 j + l / 16. */
static void q2_k_block(const uint8_t *b, float *out) {
    const float d = f16(b + 80), dmin = f16(b + 82);
    const uint8_t *qs = b + 16;
    for (int s = 0; s < 16; s++) {
        const float dl = d * (b[s] & 15), ml = dmin * (b[s] >> 4);
        const int h = s / 8, j = s % 8 / 2, l0 = 16 * (s % 2);
        for (int l = l0; l < l0 + 16; l++) out[128 * h + 32 * j + l] = dl * ((qs[32 * h + l] >> (2 * j)) & 3) - ml;
    }
}

static void q3_k_block(const uint8_t *b, float *out) {
    const float d = f16(b + 108);
    const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
    for (int s = 0; s < 16; s++) {
        const int scale = (((sc[s % 8] >> (4 * (s / 8))) & 15) | (((sc[8 + s % 4] >> (2 * (s / 4))) & 3) << 4)) - 32;
        const float dl = d * scale;
        const int h = s / 8, j = s % 8 / 2, l0 = 16 * (s % 2);
        for (int l = l0; l < l0 + 16; l++) { /* a clear hmask bit takes 4 off */
            const int q = ((qs[32 * h + l] >> (2 * j)) & 3) | (((hmask[l] >> (4 * h + j)) & 1) << 2);
            out[128 * h + 32 * j + l] = dl * (q - 4);
        }
    }
}

/* Q4_K and Q5_K: sub-block k of 32 has a 6-bit scale and min; its values are nibbles of bytes 32 (k / 2) + l
 * (low for even k), with Q5_K's fifth bit k of qh[l]. */
static void k_scale_min(const uint8_t *s, int k, int *sc, int *mn) {
    *sc = k < 4 ? (s[k] & 63) : ((s[k + 4] & 15) | ((s[k - 4] >> 6) << 4));
    *mn = k < 4 ? (s[k + 4] & 63) : ((s[k + 4] >> 4) | ((s[k] >> 6) << 4));
}

static void q4_k_block(const uint8_t *b, float *out) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t *s = b + 4, *qs = b + 16;
    for (int j = 0; j < 4; j++) {
        float sc[2], mn[2];
        for (int h = 0; h < 2; h++) {
            int a, m;
            k_scale_min(s, 2 * j + h, &a, &m);
            sc[h] = d * a;
            mn[h] = dmin * m;
        }
        for (int l = 0; l < 32; l++) {
            out[64 * j + l] = sc[0] * (qs[32 * j + l] & 15) - mn[0];
            out[64 * j + 32 + l] = sc[1] * (qs[32 * j + l] >> 4) - mn[1];
        }
    }
}

static void q5_k_block(const uint8_t *b, float *out) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t *s = b + 4, *qh = b + 16, *qs = b + 48;
    for (int k = 0; k < 8; k++) {
        int a, m;
        k_scale_min(s, k, &a, &m);
        const float sc = d * a, mn = dmin * m;
        for (int l = 0; l < 32; l++) {
            const int q = ((qs[32 * (k / 2) + l] >> (4 * (k % 2))) & 15) | (((qh[l] >> k) & 1) << 4);
            out[32 * k + l] = sc * q - mn;
        }
    }
}

static void q6_k_block(const uint8_t *b, float *out) {
    const float d = f16(b + 208);
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        const int8_t *sc = (const int8_t *)(b + 192 + 8 * h);
        float *o = out + 128 * h;
        for (int g = 0; g < 2; g++) { /* 16 elements share a scale: a constant inner loop vectorises */
            const float s0 = d * sc[g], s1 = d * sc[g + 2], s2 = d * sc[g + 4], s3 = d * sc[g + 6];
            for (int l = 16 * g; l < 16 * g + 16; l++) {
                o[l] = s0 * (((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32);
                o[l + 32] = s1 * (((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
                o[l + 64] = s2 * (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                o[l + 96] = s3 * (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
    }
}

static void q8_0_block(const uint8_t *b, float *out) {
    const float d = f16(b);
    for (int l = 0; l < 32; l++) out[l] = d * (int8_t)b[2 + l];
}

/* The 32-value blocks: d (and m) fp16, then for the _1 types' fifth bits a little-endian uint32 (bit j: value
 * j), then 16 bytes of nibbles (low: values 0..15, high: 16..31). */
static void q4_0_block(const uint8_t *b, float *out) {
    const float d = f16(b);
    for (int l = 0; l < 16; l++) {
        out[l] = d * ((b[2 + l] & 15) - 8);
        out[l + 16] = d * ((b[2 + l] >> 4) - 8);
    }
}

static void q4_1_block(const uint8_t *b, float *out) {
    const float d = f16(b), m = f16(b + 2);
    for (int l = 0; l < 16; l++) {
        out[l] = d * (b[4 + l] & 15) + m;
        out[l + 16] = d * (b[4 + l] >> 4) + m;
    }
}

static uint32_t fifth_bits(const uint8_t *p) { return p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24; }

static void q5_0_block(const uint8_t *b, float *out) {
    const float d = f16(b);
    const uint32_t qh = fifth_bits(b + 2);
    for (int l = 0; l < 16; l++) {
        out[l] = d * (int)(((b[6 + l] & 15) | ((qh >> l) & 1) << 4) - 16);
        out[l + 16] = d * (int)(((b[6 + l] >> 4) | ((qh >> (l + 16)) & 1) << 4) - 16);
    }
}

static void q5_1_block(const uint8_t *b, float *out) {
    const float d = f16(b), m = f16(b + 2);
    const uint32_t qh = fifth_bits(b + 4);
    for (int l = 0; l < 16; l++) {
        out[l] = d * ((b[8 + l] & 15) | ((qh >> l) & 1) << 4) + m;
        out[l + 16] = d * ((b[8 + l] >> 4) | ((qh >> (l + 16)) & 1) << 4) + m;
    }
}

#if defined(__SSSE3__)
#include <immintrin.h>
#endif

/* 16 bytes of nibbles (low: values 0..15, high: 16..31) through a table of 16 codes, plus offset: one byte
 * shuffle a half where SSSE3 has it (a lookup a value otherwise, 6x slower). */
static void codes_of(const uint8_t *restrict q, const int8_t *restrict table, int offset, uint8_t *restrict u) {
#if defined(__SSSE3__)
    const __m128i t = _mm_add_epi8(_mm_loadu_si128((const __m128i *)table), _mm_set1_epi8((char)offset));
    const __m128i v = _mm_loadu_si128((const __m128i *)q), low = _mm_set1_epi8(15);
    _mm_storeu_si128((__m128i *)u, _mm_shuffle_epi8(t, _mm_and_si128(v, low)));
    _mm_storeu_si128((__m128i *)(u + 16), _mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(v, 4), low)));
#else
    for (int l = 0; l < 16; l++) {
        u[l] = (uint8_t)(table[q[l] & 15] + offset);
        u[l + 16] = (uint8_t)(table[q[l] >> 4] + offset);
    }
#endif
}

/* 32 codes (16 bytes of nibbles) as table values times d: the lookups as codes_of's shuffles. */
static void scaled_codes(const uint8_t *q, const int8_t *table, float d, float *out) {
    uint8_t u[32];
    codes_of(q, table, 0, u);
    for (int l = 0; l < 32; l++) out[l] = d * (int8_t)u[l];
}

static const int8_t E2M1_DOUBLED[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static float e8m0_half(uint8_t e) { /* half the scale 2^(e - 127): 2^(e - 128), a subnormal for e 0 and 1 */
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void mxfp4_block(const uint8_t *b, float *out) { scaled_codes(b + 1, E2M1_DOUBLED, e8m0_half(b[0]), out); }

static uint32_t u16le(const uint8_t *p) { return p[0] | (uint32_t)p[1] << 8; }

static uint32_t u32le(const uint8_t *p) { return u16le(p) | u16le(p + 2) << 16; }

/* The IQ grid types: each group of 8 (IQ3: 4) values is a grid row; the products are the reference's
 * (formats/quants/grids.py): the scale times the grid value, then the sign; or times grid value plus delta. */
static void signed_row(float db, const uint8_t *grid, int n, uint32_t signs, float *out) {
    for (int j = 0; j < n; j++) {
        const float v = db * grid[j];
        out[j] = (signs >> j) & 1 ? -v : v;
    }
}

static void shifted_row(float dl, const int8_t *grid, float delta, float *out) {
    for (int j = 0; j < 8; j++) out[j] = dl * (grid[j] + delta);
}

static void iq2_xxs_block(const uint8_t *b, float *out) {
    const float d = f16(b);
    for (int ib = 0; ib < 8; ib++, out += 32) {
        const uint8_t *q = b + 2 + 8 * ib;
        const uint32_t aux = u32le(q + 4);
        const float db = d * (0.5f + (aux >> 28)) * 0.25f;
        for (int l = 0; l < 4; l++) signed_row(db, IQ2XXS_GRID[q[l]], 8, KSIGNS[(aux >> 7 * l) & 127], out + 8 * l);
    }
}

static void iq2_xs_block(const uint8_t *b, float *out) {
    const float d = f16(b);
    for (int ib = 0; ib < 8; ib++, out += 32) {
        for (int l = 0; l < 4; l++) {
            const uint32_t q = u16le(b + 2 + 8 * ib + 2 * l);
            const float db = d * (0.5f + ((b[66 + ib] >> 4 * (l / 2)) & 15)) * 0.25f;
            signed_row(db, IQ2XS_GRID[q & 511], 8, KSIGNS[q >> 9], out + 8 * l);
        }
    }
}

static void iq2_s_block(const uint8_t *b, float *out) {
    const float d = f16(b);
    for (int ib = 0; ib < 8; ib++, out += 32) {
        for (int l = 0; l < 4; l++) {
            const int index = b[2 + 4 * ib + l] | ((b[66 + ib] >> 2 * l) & 3) << 8;
            const float db = d * (0.5f + ((b[74 + ib] >> 4 * (l / 2)) & 15)) * 0.25f;
            signed_row(db, IQ2S_GRID[index], 8, b[34 + 4 * ib + l], out + 8 * l);
        }
    }
}

static void iq3_xxs_block(const uint8_t *b, float *out) {
    const float d = f16(b);
    for (int ib = 0; ib < 8; ib++, out += 32) {
        const uint32_t aux = u32le(b + 66 + 4 * ib);
        const float db = d * (0.5f + (aux >> 28)) * 0.5f;
        for (int l = 0; l < 4; l++) {
            const uint32_t signs = KSIGNS[(aux >> 7 * l) & 127];
            signed_row(db, IQ3XXS_GRID[b[2 + 8 * ib + 2 * l]], 4, signs, out + 8 * l);
            signed_row(db, IQ3XXS_GRID[b[3 + 8 * ib + 2 * l]], 4, signs >> 4, out + 8 * l + 4);
        }
    }
}

static void iq3_s_block(const uint8_t *b, float *out) {
    const float d = f16(b);
    for (int ib = 0; ib < 8; ib++, out += 32) {
        const float db = d * (1 + 2 * ((b[106 + ib / 2] >> 4 * (ib % 2)) & 15));
        for (int l = 0; l < 4; l++) {
            const uint32_t signs = b[74 + 4 * ib + l], high = b[66 + ib] >> 2 * l;
            signed_row(db, IQ3S_GRID[b[2 + 8 * ib + 2 * l] | (high & 1) << 8], 4, signs, out + 8 * l);
            signed_row(db, IQ3S_GRID[b[3 + 8 * ib + 2 * l] | (high & 2) << 7], 4, signs >> 4, out + 8 * l + 4);
        }
    }
}

static void iq1_s_block(const uint8_t *b, float *out) {
    const float d = f16(b);
    for (int ib = 0; ib < 8; ib++, out += 32) {
        const uint32_t qh = u16le(b + 34 + 2 * ib);
        const float dl = d * (2 * ((qh >> 12) & 7) + 1), delta = qh & 0x8000 ? -0.125f : 0.125f;
        for (int l = 0; l < 4; l++) shifted_row(dl, IQ1S_GRID[b[2 + 4 * ib + l] | ((qh >> 3 * l) & 7) << 8], delta, out + 8 * l);
    }
}

static void iq1_m_block(const uint8_t *b, float *out) {
    uint32_t sc[4], bits = 0;
    for (int k = 0; k < 4; k++) {
        sc[k] = u16le(b + 48 + 2 * k);
        bits |= (sc[k] >> 12) << 4 * k; /* d's nibbles, lowest first */
    }
    uint8_t h[2] = {(uint8_t)bits, (uint8_t)(bits >> 8)};
    const float d = f16(h);
    for (int ib = 0; ib < 8; ib++, out += 32) {
        for (int l = 0; l < 4; l++) {
            const uint32_t nibble = b[32 + 2 * ib + l / 2] >> 4 * (l % 2);
            const float dl = d * (2 * ((sc[ib / 2] >> (6 * (ib % 2) + 3 * (l / 2))) & 7) + 1);
            shifted_row(dl, IQ1S_GRID[b[4 * ib + l] | (nibble & 7) << 8], nibble & 8 ? -0.125f : 0.125f, out + 8 * l);
        }
    }
}

static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* IQ4_NL: d fp16, then 16 bytes of codes laid out as Q4_0's. */
static void iq4_nl_block(const uint8_t *b, float *out) { scaled_codes(b + 2, IQ4_VALUES, f16(b), out); }

/* IQ4_XS: d fp16, scales_h (2 bits a sub-block), scales_l[4] (4 bits a sub-block), then 8 sub-blocks of 32
 * codes as IQ4_NL's, each scaled by d (6-bit scale - 32): sub-block i's scale. */
static float iq4_xs_scale(const uint8_t *b, int i) {
    const int high = b[2] | b[3] << 8;
    return f16(b) * ((((b[4 + i / 2] >> (4 * (i % 2))) & 15) | (((high >> (2 * i)) & 3) << 4)) - 32);
}

static void iq4_xs_block(const uint8_t *b, float *out) {
    for (int i = 0; i < 8; i++) scaled_codes(b + 8 + 16 * i, IQ4_VALUES, iq4_xs_scale(b, i), out + 32 * i);
}

/* TQ1_0: qs[48] of 5 trits, qh[4] of 4 trits, d fp16. Trit k of byte v is the top of (v 3^k mod 256) 3 / 256. */
static int trit(uint8_t v, int pow3) { return (((uint8_t)(v * pow3)) * 3 >> 8) - 1; }

static void tq1_0_block(const uint8_t *b, float *out) {
    const float d = f16(b + 52);
    for (int k = 0, p = 1; k < 5; k++, p *= 3) {
        for (int l = 0; l < 32; l++) out[32 * k + l] = d * trit(b[l], p);
        for (int l = 0; l < 16; l++) out[160 + 16 * k + l] = d * trit(b[32 + l], p);
        if (k < 4)
            for (int l = 0; l < 4; l++) out[240 + 4 * k + l] = d * trit(b[48 + l], p);
    }
}

/* TQ2_0: qs[64] of 2-bit fields laid out as Q2_K's, d fp16; x = d (q - 1). */
static void tq2_0_block(const uint8_t *b, float *out) {
    const float d = f16(b + 64);
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) out[128 * h + 32 * j + l] = d * (((b[32 * h + l] >> (2 * j)) & 3) - 1);
}

/* Bytes a block of qtype takes (and *elems the values it holds); 0 for a type this file does not know. */
static int block_bytes(int qtype, int *elems) {
    switch (qtype) {
    case Q2_K: *elems = 256; return 84;
    case Q3_K: *elems = 256; return 110;
    case Q4_K: *elems = 256; return 144;
    case Q5_K: *elems = 256; return 176;
    case Q6_K: *elems = 256; return 210;
    case Q4_0: *elems = 32; return 18;
    case Q4_1: *elems = 32; return 20;
    case Q5_0: *elems = 32; return 22;
    case Q5_1: *elems = 32; return 24;
    case Q8_0: *elems = 32; return 34;
    case MXFP4: *elems = 32; return 17;
    case IQ2_XXS: *elems = 256; return 66;
    case IQ2_XS: *elems = 256; return 74;
    case IQ2_S: *elems = 256; return 82;
    case IQ3_XXS: *elems = 256; return 98;
    case IQ3_S: *elems = 256; return 110;
    case IQ1_S: *elems = 256; return 50;
    case IQ1_M: *elems = 256; return 56;
    case IQ4_NL: *elems = 32; return 18;
    case IQ4_XS: *elems = 256; return 136;
    case TQ1_0: *elems = 256; return 54;
    case TQ2_0: *elems = 256; return 66;
    }
    return 0;
}

static void expand(int qtype, const uint8_t *b, float *out) {
    switch (qtype) {
    case Q2_K: q2_k_block(b, out); break;
    case Q3_K: q3_k_block(b, out); break;
    case Q4_K: q4_k_block(b, out); break;
    case Q5_K: q5_k_block(b, out); break;
    case Q6_K: q6_k_block(b, out); break;
    case Q4_0: q4_0_block(b, out); break;
    case Q4_1: q4_1_block(b, out); break;
    case Q5_0: q5_0_block(b, out); break;
    case Q5_1: q5_1_block(b, out); break;
    case Q8_0: q8_0_block(b, out); break;
    case MXFP4: mxfp4_block(b, out); break;
    case IQ2_XXS: iq2_xxs_block(b, out); break;
    case IQ2_XS: iq2_xs_block(b, out); break;
    case IQ2_S: iq2_s_block(b, out); break;
    case IQ3_XXS: iq3_xxs_block(b, out); break;
    case IQ3_S: iq3_s_block(b, out); break;
    case IQ1_S: iq1_s_block(b, out); break;
    case IQ1_M: iq1_m_block(b, out); break;
    case IQ4_NL: iq4_nl_block(b, out); break;
    case IQ4_XS: iq4_xs_block(b, out); break;
    case TQ1_0: tq1_0_block(b, out); break;
    case TQ2_0: tq2_0_block(b, out); break;
    }
}

/* One row of n_blocks blocks against x. */
static float row_dot(int qtype, const uint8_t *row, int64_t n_blocks, const float *x) {
    float w[256], acc = 0.0f;
    int elems;
    const int size = block_bytes(qtype, &elems);
    for (int64_t j = 0; j < n_blocks; j++) {
        expand(qtype, row + j * size, w);
        const float *xs = x + j * elems;
        float part = 0.0f;
#pragma omp simd reduction(+ : part)
        for (int l = 0; l < elems; l++) part += w[l] * xs[l];
        acc += part;
    }
    return acc;
}

/* Returns 0, or -1 for a type this file does not know. */
int matvec_picked(const uint8_t *w, int qtype, int64_t n_out, int64_t n_in, int64_t row_bytes, const int64_t *mats,
                  int64_t n_pick, const float *x, float *y, int n_threads) {
    int elems;
    if (!block_bytes(qtype, &elems)) return -1;
    const int64_t n_blocks = n_in / elems;
#pragma omp parallel for collapse(2) schedule(static) num_threads(n_threads)
    for (int64_t p = 0; p < n_pick; p++) {
        for (int64_t r = 0; r < n_out; r++) {
            const uint8_t *row = w + ((mats ? mats[p] : 0) * n_out + r) * row_bytes;
            y[p * n_out + r] = row_dot(qtype, row, n_blocks, x + p * n_in);
        }
    }
    return 0;
}

/* ---- Integer dots: x quantized to int8, as llama.cpp's CPU backend does, for the experts of a few tokens.
 * A block unpacks to unsigned integers u (at most 255) with a float scale and min a sub-block of 16 values and
 * an offset a type: w = scale[s] * (u - offset) - minv[s]. x comes as int8 xq a 32 values with a scale dx,
 * with per 16 values the sum of xq (for the offset) and the exact float sum of x (for the min terms, so only
 * the u * x products see x's rounding). With AVX512-VNNI a multiply-add instruction does 64 products. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define VNNI 1
#else
#define VNNI 0
#endif

typedef uint8_t v16 __attribute__((vector_size(16)));

/* The type's offset, or -1 where it has no integer unpack below. */
int int8_offset(int qtype) {
    switch (qtype) {
    case Q4_K: case Q5_K: case Q2_K: return 0;
    case Q6_K: return 32;
    case Q3_K: return 4;
    case Q4_0: return 8;
    case MXFP4: return 12;
    case Q8_0: case IQ4_NL: case IQ4_XS: return 128;
    }
    return -1;
}

/* Q4_K's and Q5_K's 8 scales and mins (of 32 values), as the 16 sub-blocks of 16 the integer dots take. */
static void k_scales(const uint8_t *restrict b, float *restrict scale, float *restrict minv) {
    const float d = f16(b), dmin = f16(b + 2);
#if defined(__AVX512F__)
    /* k_scale_min for all eight at once, a byte a lane of 32-bit words: bytes 0-3 scales 0-3, 4-7 mins 0-3,
     * 8-11 the low (scale) and high (min) nibbles of 4-7 whose top two bits are those of bytes 0-3 / 4-7 (a
     * quarter of a Q4_K block's integer dot, one by one) */
    uint32_t w[3], v[4];
    memcpy(w, b + 4, 12);
    const uint32_t six = 0x3f3f3f3fu, nibble = 0x0f0f0f0fu, two = 0x03030303u;
    v[0] = w[0] & six;
    v[1] = (w[2] & nibble) | ((w[0] >> 6) & two) << 4;
    v[2] = w[1] & six;
    v[3] = ((w[2] >> 4) & nibble) | ((w[1] >> 6) & two) << 4;
    const __m512 all = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)v)));
    const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    _mm512_storeu_ps(scale, _mm512_mul_ps(_mm512_set1_ps(d), _mm512_permutexvar_ps(pairs, all)));
    _mm512_storeu_ps(minv, _mm512_mul_ps(_mm512_set1_ps(dmin),
                                         _mm512_permutexvar_ps(_mm512_add_epi32(pairs, _mm512_set1_epi32(8)), all)));
#else
    for (int k = 0; k < 8; k++) {
        int a, m;
        k_scale_min(b + 4, k, &a, &m);
        scale[2 * k] = scale[2 * k + 1] = d * a;
        minv[2 * k] = minv[2 * k + 1] = dmin * m;
    }
#endif
}

static void unpack_q4_k(const uint8_t *restrict b, uint8_t *restrict u, float *restrict scale, float *restrict minv) {
    const uint8_t *qs = b + 16;
    k_scales(b, scale, minv);
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) {
            u[64 * j + l] = qs[32 * j + l] & 15;
            u[64 * j + 32 + l] = qs[32 * j + l] >> 4;
        }
}

static void unpack_q5_k(const uint8_t *restrict b, uint8_t *restrict u, float *restrict scale, float *restrict minv) {
    const uint8_t *qh = b + 16, *qs = b + 48;
    k_scales(b, scale, minv);
    for (int k = 0; k < 8; k++)
        for (int l = 0; l < 32; l++)
            u[32 * k + l] = ((qs[32 * (k / 2) + l] >> (4 * (k % 2))) & 15) | (((qh[l] >> k) & 1) << 4);
}

static void unpack_q6_k(const uint8_t *restrict b, uint8_t *restrict u, float *restrict scale, float *restrict minv) {
    const float d = f16(b + 208);
    for (int s = 0; s < 16; s++) {
        scale[s] = d * (int8_t)b[192 + s];
        minv[s] = 0.0f;
    }
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        uint8_t *o = u + 128 * h;
        for (int l = 0; l < 32; l++) {
            o[l] = (ql[l] & 15) | ((qh[l] & 3) << 4);
            o[l + 32] = (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4);
            o[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            o[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
}

static void unpack_q2_k(const uint8_t *restrict b, uint8_t *restrict u, float *restrict scale, float *restrict minv) {
    const float d = f16(b + 80), dmin = f16(b + 82);
    const uint8_t *qs = b + 16;
    for (int s = 0; s < 16; s++) {
        scale[s] = d * (b[s] & 15);
        minv[s] = dmin * (b[s] >> 4);
    }
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) u[128 * h + 32 * j + l] = (qs[32 * h + l] >> (2 * j)) & 3;
}

static void unpack_q3_k(const uint8_t *restrict b, uint8_t *restrict u, float *restrict scale, float *restrict minv) {
    const float d = f16(b + 108);
    const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
    for (int s = 0; s < 16; s++) {
        scale[s] = d * ((((sc[s % 8] >> (4 * (s / 8))) & 15) | (((sc[8 + s % 4] >> (2 * (s / 4))) & 3) << 4)) - 32);
        minv[s] = 0.0f;
    }
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++)
                u[128 * h + 32 * j + l] = ((qs[32 * h + l] >> (2 * j)) & 3) | (((hmask[l] >> (4 * h + j)) & 1) << 2);
}

static void unpack_q8_0(const uint8_t *restrict b, uint8_t *restrict u, float *restrict scale, float *restrict minv) {
    scale[0] = scale[1] = f16(b);
    minv[0] = minv[1] = 0.0f;
    for (int l = 0; l < 32; l++) u[l] = (uint8_t)(b[2 + l] ^ 0x80); /* two's complement + 128 */
}

static void unpack_q4_0(const uint8_t *restrict b, uint8_t *restrict u, float *restrict scale, float *restrict minv) {
    scale[0] = scale[1] = f16(b);
    minv[0] = minv[1] = 0.0f;
    v16 q; /* as 16 lanes: a plain loop here compiled to byte-by-byte stores */
    memcpy(&q, b + 2, 16);
    const v16 lo = q & 15, hi = q >> 4;
    memcpy(u, &lo, 16);
    memcpy(u + 16, &hi, 16);
}

static void unpack_iq4_xs(const uint8_t *restrict b, uint8_t *restrict u, float *restrict scale, float *restrict minv) {
    for (int i = 0; i < 8; i++) {
        scale[2 * i] = scale[2 * i + 1] = iq4_xs_scale(b, i);
        minv[2 * i] = minv[2 * i + 1] = 0.0f;
        codes_of(b + 8 + 16 * i, IQ4_VALUES, 128, u + 32 * i);
    }
}

/* Blocks of 32 values go eight at a time, so that every unpack fills 256 values. */
static inline __attribute__((always_inline)) void unpack(int qtype, const uint8_t *b, int size, uint8_t *u, float *scale,
                                                         float *minv) {
    switch (qtype) {
    case Q4_K: unpack_q4_k(b, u, scale, minv); return;
    case Q5_K: unpack_q5_k(b, u, scale, minv); return;
    case Q6_K: unpack_q6_k(b, u, scale, minv); return;
    case Q2_K: unpack_q2_k(b, u, scale, minv); return;
    case Q3_K: unpack_q3_k(b, u, scale, minv); return;
    case IQ4_XS: unpack_iq4_xs(b, u, scale, minv); return;
    }
    for (int i = 0; i < 8; i++) {
        const uint8_t *bi = b + i * size;
        minv[2 * i] = minv[2 * i + 1] = 0.0f;
        switch (qtype) {
        case Q8_0: unpack_q8_0(bi, u + 32 * i, scale + 2 * i, minv + 2 * i); break;
        case Q4_0: unpack_q4_0(bi, u + 32 * i, scale + 2 * i, minv + 2 * i); break;
        case IQ4_NL:
            scale[2 * i] = scale[2 * i + 1] = f16(bi);
            codes_of(bi + 2, IQ4_VALUES, 128, u + 32 * i);
            break;
        case MXFP4: /* the codes doubled, the scale halved: all integers */
            scale[2 * i] = scale[2 * i + 1] = e8m0_half(bi[0]);
            codes_of(bi + 1, E2M1_DOUBLED, 12, u + 32 * i);
            break;
        }
    }
}

/* x [n] (n a multiple of 256) as int8 xq (round to nearest, |xq| <= 127) with a scale dx a 32 values, and per
 * 16 values the sums of xq (xqs) and of x (xs). */
void quantize_x(const float *x, int64_t n, int8_t *xq, float *dx, int32_t *xqs, float *xs) {
    for (int64_t b = 0; b < n / 32; b++) {
        const float *v = x + 32 * b;
        float amax = 0.0f;
        for (int l = 0; l < 32; l++) amax = fmaxf(amax, fabsf(v[l]));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int l = 0; l < 32; l++) xq[32 * b + l] = (int8_t)lrintf(v[l] * id);
        dx[b] = amax / 127.0f;
        for (int h = 0; h < 2; h++) {
            int32_t qsum = 0;
            float sum = 0.0f;
            for (int l = 16 * h; l < 16 * h + 16; l++) {
                qsum += xq[32 * b + l];
                sum += v[l];
            }
            xqs[2 * b + h] = qsum;
            xs[2 * b + h] = sum;
        }
    }
}

/* One row of n_super 256-value blocks against quantized x; inlined into row_dot_int8's switch below with qtype
 * a constant: one loop a type, its unpack inlined. */
static inline __attribute__((always_inline)) float row_dot_typed(int qtype, int offset, const uint8_t *row, int size,
                                                                 int64_t n_super, const int8_t *xq, const float *dx,
                                                                 const int32_t *xqs, const float *xs) {
    uint8_t u[256] __attribute__((aligned(64)));
    float scale[16], minv[16], acc = 0.0f;
    int elems;
    block_bytes(qtype, &elems);
    const int per_super = 256 / elems; /* blocks a 256 values */
#if VNNI
    __m512 vacc = _mm512_setzero_ps(), vcorr = _mm512_setzero_ps();
    const __m512i voffset = _mm512_set1_epi32(offset);
    const __m512i halves = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
#endif
    for (int64_t j = 0; j < n_super; j++) {
        unpack(qtype, row + j * per_super * size, size, u, scale, minv);
        const int8_t *xb = xq + 256 * j;
        const float *db = dx + 8 * j, *sb = xs + 16 * j;
        const int32_t *qb = xqs + 16 * j;
#if VNNI
        const __m512 vsdx = _mm512_mul_ps(_mm512_loadu_ps(scale), _mm512_permutexvar_ps(halves, _mm512_castps256_ps512(_mm256_loadu_ps(db))));
        vcorr = _mm512_fmadd_ps(vsdx, _mm512_cvtepi32_ps(_mm512_mullo_epi32(_mm512_loadu_si512(qb), voffset)), vcorr);
        vcorr = _mm512_fmadd_ps(_mm512_loadu_ps(minv), _mm512_loadu_ps(sb), vcorr);
        for (int c = 0; c < 4; c++) { /* 64 values: lane i holds 4 products of sub-block 4 c + i / 4 */
            const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_load_si512(u + 64 * c),
                                                    _mm512_loadu_si512(xb + 64 * c));
            const __m512 lane_scale = _mm512_permutexvar_ps(_mm512_add_epi32(spread, _mm512_set1_epi32(4 * c)), vsdx);
            vacc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), lane_scale, vacc);
        }
#else
        float sdx[16];
        for (int s = 0; s < 16; s++) {
            sdx[s] = scale[s] * db[s / 2];
            acc -= sdx[s] * (float)(offset * qb[s]) + minv[s] * sb[s];
        }
        for (int s = 0; s < 16; s++) {
            int32_t dot = 0;
            for (int l = 0; l < 16; l++) dot += u[16 * s + l] * xb[16 * s + l];
            acc += sdx[s] * (float)dot;
        }
#endif
    }
#if VNNI
    acc += _mm512_reduce_add_ps(_mm512_sub_ps(vacc, vcorr));
#endif
    return acc;
}

static float row_dot_int8(int qtype, int offset, const uint8_t *row, int size, int64_t n_super, const int8_t *xq,
                          const float *dx, const int32_t *xqs, const float *xs) {
#define TYPED(T) \
    case T: return row_dot_typed(T, offset, row, size, n_super, xq, dx, xqs, xs);
    switch (qtype) {
        TYPED(Q4_K) TYPED(Q5_K) TYPED(Q6_K) TYPED(Q2_K) TYPED(Q3_K) TYPED(Q4_0) TYPED(Q8_0) TYPED(IQ4_NL)
        TYPED(IQ4_XS) TYPED(MXFP4)
    }
#undef TYPED
    return 0.0f;
}

/* matvec_picked with x quantized by quantize_x (a row of n_in a pick; n_in a multiple of 256); 0, or -1 for a
 * type int8_offset does not know. */
int matvec_picked_int8(const uint8_t *w, int qtype, int64_t n_out, int64_t n_in, int64_t row_bytes,
                       const int64_t *mats, int64_t n_pick, const int8_t *xq, const float *dx, const int32_t *xqs,
                       const float *xs, float *y, int n_threads) {
    int elems;
    const int offset = int8_offset(qtype), size = block_bytes(qtype, &elems);
    if (offset < 0 || !size || n_in % 256) return -1;
#pragma omp parallel for collapse(2) schedule(static) num_threads(n_threads)
    for (int64_t p = 0; p < n_pick; p++) {
        for (int64_t r = 0; r < n_out; r++) {
            const uint8_t *row = w + ((mats ? mats[p] : 0) * n_out + r) * row_bytes;
            y[p * n_out + r] = row_dot_int8(qtype, offset, row, size, n_in / 256, xq + p * n_in, dx + p * n_in / 32,
                                            xqs + p * n_in / 16, xs + p * n_in / 16);
        }
    }
    return 0;
}

/* ---- A streamed layer's routed experts for a few tokens, whole, as a CUDA host function: the GPU queues the
 * copies of x, the picks and their weights to page-locked buffers, then this, then the copy of out back, so a
 * decode step with experts on the CPU still replays as one graph. SwiGLU (silu(gate) * up, down, weighted sum
 * over the picks), or with biases gpt-oss's clamped GLU (ops/moe_swiglu.py ClampedGlu); products as
 * matvec_picked_int8 where the type allows, else float. */
typedef struct {
    const uint8_t *w[3]; /* gate, up, down stacks [E, rows, row bytes] */
    int64_t qtype[3], row_bytes[3];
    int64_t n_embd, n_ff, n_tokens, n_used, n_threads;
    const float *x;       /* [T, D] */
    const int64_t *ids;   /* [T, K] */
    const float *weights; /* [T, K] */
    float *out;           /* [T, D] */
    float *gu;            /* [T * K, 2 F]: gate then up of each pick, then h in the first F */
    float *down;          /* [T * K, D] */
    int8_t *xq;           /* [max(T, T * K) * max(D, F)] and the matching dx, xqs, xs */
    float *dx, *xs;
    int32_t *xqs;
    const float *gate_b, *up_b, *down_b; /* [T * K, F], [T * K, F], [T * K, D] (the pairs'), or all NULL */
    float alpha, limit;
} host_swiglu_args;

static float dot_row(int qtype, const uint8_t *row, int64_t n_in, const float *x, const int8_t *xq, const float *dx,
                     const int32_t *xqs, const float *xs) {
    int elems;
    const int size = block_bytes(qtype, &elems), offset = int8_offset(qtype);
    if (offset >= 0 && n_in % 256 == 0) return row_dot_int8(qtype, offset, row, size, n_in / 256, xq, dx, xqs, xs);
    return row_dot(qtype, row, n_in / elems, x);
}

void host_swiglu(void *arg) {
    const host_swiglu_args *a = (const host_swiglu_args *)arg;
    const int64_t D = a->n_embd, F = a->n_ff, T = a->n_tokens, K = a->n_used, P = T * K;
#pragma omp parallel num_threads((int)a->n_threads)
    { /* one team for the whole layer: each step below ends at the loop's barrier */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            quantize_x(a->x + t * D, D, a->xq + t * D, a->dx + t * D / 32, a->xqs + t * D / 16, a->xs + t * D / 16);
#pragma omp for collapse(2) schedule(static)
        for (int64_t p = 0; p < P; p++) {
            for (int64_t r = 0; r < 2 * F; r++) { /* gate rows, then up rows */
                const int s = r >= F, t = (int)(p / K);
                const uint8_t *row = a->w[s] + (a->ids[p] * F + r - s * F) * a->row_bytes[s];
                a->gu[p * 2 * F + r] = dot_row((int)a->qtype[s], row, D, a->x + t * D, a->xq + t * D,
                                               a->dx + t * D / 32, a->xqs + t * D / 16, a->xs + t * D / 16);
            }
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++) { /* h = silu(gate) * up, then rounded for down's integer dots */
            float *g = a->gu + p * 2 * F;
            if (a->gate_b) {
                const float *gb = a->gate_b + p * F, *ub = a->up_b + p * F;
                for (int64_t i = 0; i < F; i++) {
                    const float gi = fminf(g[i] + gb[i], a->limit), ui = fmaxf(fminf(g[F + i] + ub[i], a->limit), -a->limit);
                    g[i] = gi / (1.0f + expf(-a->alpha * gi)) * (ui + 1.0f);
                }
            } else {
                for (int64_t i = 0; i < F; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * g[F + i];
            }
            quantize_x(g, F, a->xq + p * F, a->dx + p * F / 32, a->xqs + p * F / 16, a->xs + p * F / 16);
        }
#pragma omp for collapse(2) schedule(static)
        for (int64_t p = 0; p < P; p++) {
            for (int64_t r = 0; r < D; r++) {
                const uint8_t *row = a->w[2] + (a->ids[p] * D + r) * a->row_bytes[2];
                a->down[p * D + r] = dot_row((int)a->qtype[2], row, F, a->gu + p * 2 * F, a->xq + p * F,
                                             a->dx + p * F / 32, a->xqs + p * F / 16, a->xs + p * F / 16);
            }
        }
#pragma omp for collapse(2) schedule(static)
        for (int64_t t = 0; t < T; t++)
            for (int64_t d = 0; d < D; d++) {
                float sum = 0.0f;
                for (int64_t k = 0; k < K; k++) {
                    const int64_t at = (t * K + k) * D + d;
                    sum += a->weights[t * K + k] * (a->down_b ? a->down[at] + a->down_b[at] : a->down[at]);
                }
                a->out[t * D + d] = sum;
            }
    }
}
