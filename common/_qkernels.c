/* One-pass kernels of the int8 / int4 wire codecs (common/quant.py holds the format and the
 * reference implementation in torch; these compute the same bytes, faster), and the shard's
 * accumulation of one answer into a merge (common/merge.py OuterAccumulator.add_answer).
 *
 * Built by setup.py as an optional extension: where no C compiler is found the build is
 * skipped and common.quant uses its torch implementation. Both are tested to produce identical
 * payloads and identical decoded values.
 *
 * Format (see common/quant.py): blocks of 64 values, scale = bf16_rne(absmax / L),
 * q = clamp(round_half_even(x / d), -L, L) with d = scale (or 1 when the scale is 0), decoded
 * as q * scale. int4 packs two values per byte, low nibble first, 4-bit two's complement; the
 * nibbles of an odd tail are zero.
 *
 * The GIL is released while a kernel runs, so a learner's network thread and a shard's merge
 * workers encode and decode beside the Python threads of the same process.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <strings.h>
#include <float.h>
#include <stdarg.h>
#include <math.h>

#define BLOCK 64
#define ROUND_MAGIC 12582912.0f /* 1.5 * 2^23: v + M - M rounds v half-to-even for |v| < 2^22 */

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && defined(__GLIBC__)
#define MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MULTIVERSION
#endif

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* float -> bf16 bits, round to nearest even (c10::BFloat16's rule; the input is finite). */
static inline uint16_t bf16_rne(float f) {
    uint32_t u = f32_bits(f);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float bf16_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* The b-th bf16 scale of a frame, which need not be 2-byte aligned. */
static inline uint16_t load_scale(const uint8_t *scales, Py_ssize_t b) {
    uint16_t h;
    memcpy(&h, scales + 2 * b, 2);
    return h;
}

#define CHUNK 64 /* blocks per pass: 16 KiB of input, still in L1 while it is quantised */

/* One code: round(v / d) half to even, clamped to [-levels, levels]. |v / d| <= ~1.5 L (d >= absmax
 * / L rounded): far inside int32. The codes go straight to their output (an int4 pair packed in
 * registers): a block of codes stored to the stack and read back at another width stalled store
 * forwarding, a third of the encoder's time. */
static inline __attribute__((always_inline)) int32_t quantise_one(float v, float d, int levels) {
    int32_t r = (int32_t)((v / d + ROUND_MAGIC) - ROUND_MAGIC);
    r = r < levels ? r : levels;                 /* an integer clamp vectorises, a float one less */
    return r > -levels ? r : -levels;
}

/* The per-block scales of a chunk from its blocks' absmax bits: bf16_rne(absmax / L), and the
 * divisor (1 for a block whose scale is 0: an all-zero or underflowed block encodes as 0s). */
static inline __attribute__((always_inline)) void chunk_scales(const uint32_t *amax, Py_ssize_t n_blocks, int levels,
                                                               uint16_t *scales_out, float *d) {
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        uint16_t sc = bf16_rne(bits_f32(amax[b]) / (float)levels);
        float sf = bf16_f32(sc);
        scales_out[b] = sc;
        d[b] = sf > 0.0f ? sf : 1.0f;
    }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define HAVE_QUANTISE_512 1
static int have_avx512f = -1;   /* set at import (PyInit__qkernels) */

/* quantise_chunk with AVX-512F intrinsics, where the CPU has it: the same bytes (an exact
 * division, rounding half to even by the conversion itself, the same integer clamp, each int4
 * pair packed inside a 64-bit lane, then narrowed), without the permutes and the ymm-wide
 * packing the compiler made of the portable loop. */
__attribute__((target("avx512f"), noinline))
static int quantise_chunk_512(const float *x, Py_ssize_t n_blocks, int levels,
                              uint8_t *values_out, uint16_t *scales_out) {
    uint32_t amax[CHUNK], worst = 0;
    float d[CHUNK];
    const __m512i absmask = _mm512_set1_epi32(0x7FFFFFFF);
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        const float *xb = x + b * BLOCK;
        __m512i m0 = _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(xb)), absmask);
        __m512i m1 = _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(xb + 16)), absmask);
        __m512i m2 = _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(xb + 32)), absmask);
        __m512i m3 = _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(xb + 48)), absmask);
        uint32_t m = _mm512_reduce_max_epu32(_mm512_max_epu32(_mm512_max_epu32(m0, m1), _mm512_max_epu32(m2, m3)));
        amax[b] = m;
        worst = m > worst ? m : worst;
    }
    if (worst >= 0x7F800000u) return 0;          /* inf, or NaN (whose bits sort above inf) */
    chunk_scales(amax, n_blocks, levels, scales_out, d);
    const __m512i lo = _mm512_set1_epi32(-levels), hi = _mm512_set1_epi32(levels);
    const __m512i nib = _mm512_set1_epi64(0x0000000F0000000FLL);
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        const __m512 dv = _mm512_set1_ps(d[b]);
        const float *xb = x + b * BLOCK;
        for (int k = 0; k < 4; k++) {
            __m512 v = _mm512_div_ps(_mm512_loadu_ps(xb + 16 * k), dv);
            __m512i q = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q = _mm512_min_epi32(_mm512_max_epi32(q, lo), hi);
            if (levels == 7) {                   /* lane j of 64 bits: (q[2j] & 15) | (q[2j+1] & 15) << 4 */
                __m512i t = _mm512_and_si512(q, nib);
                t = _mm512_or_si512(t, _mm512_srli_epi64(t, 28));
                _mm_storel_epi64((__m128i *)(values_out + b * (BLOCK / 2) + 8 * k), _mm512_cvtepi64_epi8(t));
            } else {
                _mm_storeu_si128((__m128i *)(values_out + b * BLOCK + 16 * k), _mm512_cvtepi32_epi8(q));
            }
        }
    }
    return 1;
}
#endif

/* Quantise n_blocks full blocks (n_blocks <= CHUNK); returns 0 if they hold NaN/inf. The
 * per-block scale arithmetic runs as loops over the chunk's blocks, so it vectorises too. */
static inline int quantise_chunk(const float *x, Py_ssize_t n_blocks, int levels,
                                 uint8_t *values_out, uint16_t *scales_out) {
#ifdef HAVE_QUANTISE_512
    if (have_avx512f > 0) return quantise_chunk_512(x, n_blocks, levels, values_out, scales_out);
#endif
    uint32_t amax[CHUNK], worst = 0;
    float d[CHUNK];
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        uint32_t m = 0;
        for (int i = 0; i < BLOCK; i++) {
            uint32_t a = f32_bits(x[b * BLOCK + i]) & 0x7FFFFFFFu; /* |x| as bits, same order */
            m = a > m ? a : m;
        }
        amax[b] = m;
        worst = m > worst ? m : worst;
    }
    if (worst >= 0x7F800000u) return 0;          /* inf, or NaN (whose bits sort above inf) */
    chunk_scales(amax, n_blocks, levels, scales_out, d);
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        if (levels == 7) {                       /* int4: each pair of codes packed as it is made */
            uint8_t *o = values_out + b * (BLOCK / 2);
            const float *xb = x + b * BLOCK;
            for (int j = 0; j < BLOCK / 2; j++)
                o[j] = (uint8_t)((quantise_one(xb[2 * j], d[b], 7) & 15) | ((quantise_one(xb[2 * j + 1], d[b], 7) & 15) << 4));
            continue;
        }
        int8_t *q = (int8_t *)values_out + b * BLOCK;
        for (int i = 0; i < BLOCK; i++) q[i] = (int8_t)quantise_one(x[b * BLOCK + i], d[b], levels);
    }
    return 1;
}

/* Encode n floats. int8: values_out has n bytes; int4: (n + 1) / 2 bytes. Returns 0 on NaN/inf. */
MULTIVERSION
static int encode_blocks(const float *x, Py_ssize_t n, int levels, uint8_t *values_out,
                         uint16_t *scales_out) {
    Py_ssize_t full = n / BLOCK, stride = levels == 7 ? BLOCK / 2 : BLOCK;
    for (Py_ssize_t b = 0; b < full; b += CHUNK) {
        Py_ssize_t k = full - b < CHUNK ? full - b : CHUNK;
        if (!quantise_chunk(x + b * BLOCK, k, levels, values_out + b * stride, scales_out + b))
            return 0;
    }
    Py_ssize_t rest = n - full * BLOCK;
    if (rest) {                                   /* the tail, padded with zeros */
        float tail[BLOCK] = {0};
        uint8_t v[BLOCK];
        memcpy(tail, x + full * BLOCK, (size_t)rest * sizeof(float));
        if (!quantise_chunk(tail, 1, levels, v, scales_out + full)) return 0;
        memcpy(values_out + full * stride, v, (size_t)(levels == 7 ? (rest + 1) / 2 : rest));
    }
    return 1;
}

static inline __attribute__((always_inline)) void dequantise_block(const uint8_t *v, int levels, float s, float *out) {
    if (levels == 7) {   /* nibbles to bytes (little-endian pairs), sign-extended, then to float: loops that vectorise */
        uint16_t w[BLOCK / 2];
        int8_t q[BLOCK];
        for (int j = 0; j < BLOCK / 2; j++) w[j] = (uint16_t)((v[j] & 0x0Fu) | ((uint16_t)(v[j] & 0xF0u) << 4));
        memcpy(q, w, BLOCK);
        for (int i = 0; i < BLOCK; i++) out[i] = (float)(int8_t)((q[i] ^ 8) - 8) * s;
    } else {
        const int8_t *q = (const int8_t *)v;
        for (int i = 0; i < BLOCK; i++) out[i] = (float)q[i] * s;
    }
}

/* The largest |scale| whose block decodes to finite values whatever its codes: |q| <= 8 (int4)
 * or 128 (int8, a hostile -128), and q * s must stay within FLT_MAX. */
static inline float scale_limit(int levels) { return FLT_MAX / (levels == 7 ? 8.0f : 128.0f); }

/* Every scale of n values is finite and within scale_limit: then every decoded value is finite
 * (the decoder's answer to "is this payload finite", one pass over n / 64 scales). */
static int scales_ok(const uint8_t *scales, Py_ssize_t n, int levels) {
    Py_ssize_t n_blocks = (n + BLOCK - 1) / BLOCK;
    float limit = scale_limit(levels);
    for (Py_ssize_t b = 0; b < n_blocks; b++)
        if (!(fabsf(bf16_f32(load_scale(scales, b))) <= limit)) return 0;   /* NaN fails too */
    return 1;
}

/* Decode n values; returns 0 (nothing written) if a scale is NaN/inf or so large that a value
 * would overflow: a decoded payload is always finite. */
MULTIVERSION
static int decode_blocks(const uint8_t *values, const uint8_t *scales, Py_ssize_t n, int levels,
                         float *out) {
    if (!scales_ok(scales, n, levels)) return 0;
    Py_ssize_t full = n / BLOCK;
    Py_ssize_t stride = levels == 7 ? BLOCK / 2 : BLOCK;
    for (Py_ssize_t b = 0; b < full; b++)
        dequantise_block(values + b * stride, levels, bf16_f32(load_scale(scales, b)), out + b * BLOCK);
    Py_ssize_t rest = n - full * BLOCK;
    if (rest) {
        uint8_t v[BLOCK] = {0};
        float tail[BLOCK];
        memcpy(v, values + full * stride, (size_t)(levels == 7 ? (rest + 1) / 2 : rest));
        dequantise_block(v, levels, bf16_f32(load_scale(scales, full)), tail);
        memcpy(out + full * BLOCK, tail, (size_t)rest * sizeof(float));
    }
    return 1;
}

/* An answer's outer gradient at i, o = theta - (base + delta), with torch's two roundings. */
static inline float outer_at(const float *th, const float *ba, const float *de, Py_ssize_t i) {
    float t = ba[i] + de[i];
    return th[i] - t;
}

/* Sum of squares over [a, b) of theta - (base + delta), in double (1e30-sized values must not
 * overflow, as they do in an fp32 norm): sixteen double lanes, summed at the end as four 4-lane
 * vectors (a plain loop of fixed width the compiler keeps in SIMD registers on any target; a
 * vector type's float-to-double conversion compiled to half-width steps, 1.5x slower). */
typedef double v4d __attribute__((vector_size(32)));

static inline double sq_sum(const float *th, const float *ba, const float *de, Py_ssize_t a, Py_ssize_t b) {
    double acc[16] = {0};   /* lane l: the squares of values i + l (a loop the compiler vectorises) */
    Py_ssize_t i = a;
    for (; i + 16 <= b; i += 16)
        for (int l = 0; l < 16; l++) {
            double v = (double)(th[i + l] - (ba[i + l] + de[i + l]));
            acc[l] += v * v;
        }
    v4d s[4];
    memcpy(s, acc, sizeof s);
    double ss = 0.0;
    for (; i < b; i++) {
        double v = (double)outer_at(th, ba, de, i);
        ss += v * v;
    }
    v4d t = (s[0] + s[1]) + (s[2] + s[3]);
    return ss + ((t[0] + t[1]) + (t[2] + t[3]));
}

/* direction += (w / n) * o[i] for one value: in float when w / n is a float (the usual case),
 * else in double (a piece whose norm n is below w / FLT_MAX; |o| <= n keeps the term <= w). */
static inline float unit_term(double ad, float af, int wide, float o) {
    return wide ? (float)(ad * (double)o) : af * o;
}

/* Pass 1: per segment, the sum of squares of o (before scaling), in double. */
MULTIVERSION
static void outer_sq_sums(const float *th, const float *ba, const float *de, const int64_t *seg,
                          Py_ssize_t n_seg, double *sums) {
    for (Py_ssize_t k = 0; k < n_seg; k++) {
        Py_ssize_t a = (Py_ssize_t)seg[3 * k], b = (Py_ssize_t)seg[3 * k + 1];
        sums[k] = sq_sum(th, ba, de, a, b);
    }
}

/* Pass 2: mean += w * s * o; rda segments whose (unscaled) norm n_k > 0 also direction +=
 * (w / n_k) * o: the clip scale s cancels out of a unit vector, so it is left out there (a tiny
 * s must not push w / (s n_k) past the float range). */
MULTIVERSION
static void accumulate_outer_segments(const float *th, const float *ba, const float *de, float s,
                                      int scaled, double w, float *mean, float *direction,
                                      const int64_t *seg, Py_ssize_t n_seg, const double *norms) {
    float wf = (float)w;
    for (Py_ssize_t k = 0; k < n_seg; k++) {
        Py_ssize_t a = (Py_ssize_t)seg[3 * k], b = (Py_ssize_t)seg[3 * k + 1];
        if (seg[3 * k + 2] && norms[k] > 0.0) {
            double ad = w / norms[k];
            int wide = !(ad <= FLT_MAX);
            float af = wide ? 0.0f : (float)ad;
            for (Py_ssize_t i = a; i < b; i++) {
                float o = outer_at(th, ba, de, i);
                mean[i] += wf * (scaled ? o * s : o);
                direction[i] += unit_term(ad, af, wide, o);
            }
        } else {
            for (Py_ssize_t i = a; i < b; i++) {
                float o = outer_at(th, ba, de, i);
                mean[i] += wf * (scaled ? o * s : o);
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------ */

static int check_levels(int levels) {
    if (levels != 7 && levels != 127) {
        PyErr_SetString(PyExc_ValueError, "levels must be 7 (int4) or 127 (int8)");
        return 0;
    }
    return 1;
}

static int check_size(const Py_buffer *b, Py_ssize_t want, const char *what) {
    if (b->len != want) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", what, b->len, want);
        return 0;
    }
    return 1;
}

/* float32 buffers must be 4-byte aligned (numpy and torch memory always is). */
static int aligned4(int n, ...) {
    va_list ap;
    va_start(ap, n);
    int ok = 1;
    for (int i = 0; i < n; i++) {
        const Py_buffer *b = va_arg(ap, const Py_buffer *);
        if (b && ((uintptr_t)b->buf & 3u)) ok = 0;
    }
    va_end(ap);
    if (!ok) PyErr_SetString(PyExc_ValueError, "float32 buffers must be 4-byte aligned");
    return ok;
}

static Py_ssize_t values_nbytes(Py_ssize_t n, int levels) { return levels == 7 ? (n + 1) / 2 : n; }

/* The float32 side (n values, aligned) and the codec's two frames sized for n values. */
static int check_codec_buffers(const Py_buffer *f, const Py_buffer *vals, const Py_buffer *scales, int levels) {
    if (!check_levels(levels) || !aligned4(1, f)) return 0;
    if (f->len % 4) {
        PyErr_SetString(PyExc_ValueError, "not a float32 buffer");
        return 0;
    }
    Py_ssize_t n = f->len / 4;
    return check_size(vals, values_nbytes(n, levels), "values") &&
           check_size(scales, 2 * ((n + BLOCK - 1) / BLOCK), "scales");
}

PyDoc_STRVAR(encode_doc,
"encode(x, levels, values_out, scales_out) -> bool\n\n"
"Quantise the float32 buffer x into values_out (int8: n bytes, int4: ceil(n/2)) and the bf16\n"
"scales into scales_out (2 * ceil(n/64) bytes). False if x holds NaN/inf.");

static PyObject *py_encode(PyObject *self, PyObject *args) {
    Py_buffer x, vals, scales;
    int levels;
    if (!PyArg_ParseTuple(args, "y*iw*w*", &x, &levels, &vals, &scales)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = x.len / 4;
    if (!check_codec_buffers(&x, &vals, &scales, levels)) goto done;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = encode_blocks((const float *)x.buf, n, levels, (uint8_t *)vals.buf, (uint16_t *)scales.buf);
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(ok);
done:
    PyBuffer_Release(&x);
    PyBuffer_Release(&vals);
    PyBuffer_Release(&scales);
    return result;
}

PyDoc_STRVAR(decode_doc,
"decode(values, scales, levels, out) -> bool\n\n"
"Dequantise into the float32 buffer out (n values). False if a scale is NaN/inf.");

static PyObject *py_decode(PyObject *self, PyObject *args) {
    Py_buffer vals, scales, out;
    int levels;
    if (!PyArg_ParseTuple(args, "y*y*iw*", &vals, &scales, &levels, &out)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = out.len / 4;
    if (!check_codec_buffers(&out, &vals, &scales, levels)) goto done;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = decode_blocks((const uint8_t *)vals.buf, (const uint8_t *)scales.buf, n, levels,
                       (float *)out.buf);
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(ok);
done:
    PyBuffer_Release(&vals);
    PyBuffer_Release(&scales);
    PyBuffer_Release(&out);
    return result;
}

/* Segments (start, stop, rda) must tile [0, n) in order; rda ones need a direction buffer. */
static int check_segments(const Py_buffer *seg, Py_ssize_t n, int have_dir) {
    if (seg->len % 24 || ((uintptr_t)seg->buf & 7u)) goto bad;
    const int64_t *sg = (const int64_t *)seg->buf;
    Py_ssize_t end = 0, n_seg = seg->len / 24;
    for (Py_ssize_t k = 0; k < n_seg; k++) {
        if (sg[3 * k] != end || sg[3 * k + 1] < sg[3 * k] || sg[3 * k + 1] > n || (sg[3 * k + 2] && !have_dir))
            goto bad;
        end = (Py_ssize_t)sg[3 * k + 1];
    }
    if (end == n) return 1;
bad:
    PyErr_SetString(PyExc_ValueError, "segments must be int64 (start, stop, rda) rows tiling [0, n) in order");
    return 0;
}

PyDoc_STRVAR(outer_sq_sums_doc,
"outer_sq_sums(theta, base, delta, segments, sums) -> None\n\n"
"sums[k] = sum over segment k of (theta - (base + delta))^2 (float64 out, one per segment).");

static PyObject *py_outer_sq_sums(PyObject *self, PyObject *args) {
    Py_buffer th, ba, de, seg, sums;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*", &th, &ba, &de, &seg, &sums)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = th.len / 4;
    if (th.len % 4 || ba.len != th.len || de.len != th.len) {
        PyErr_SetString(PyExc_ValueError, "outer_sq_sums: theta, base and delta must be float32 of one size");
        goto done;
    }
    if (!check_segments(&seg, n, 1) || !aligned4(3, &th, &ba, &de)) goto done;
    if (sums.len != (seg.len / 24) * 8) {
        PyErr_SetString(PyExc_ValueError, "outer_sq_sums: sums must hold one float64 per segment");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    outer_sq_sums((const float *)th.buf, (const float *)ba.buf, (const float *)de.buf,
                  (const int64_t *)seg.buf, seg.len / 24, (double *)sums.buf);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&th); PyBuffer_Release(&ba); PyBuffer_Release(&de);
    PyBuffer_Release(&seg); PyBuffer_Release(&sums);
    return result;
}

PyDoc_STRVAR(accumulate_outer_doc,
"accumulate_outer(theta, base, delta, scale, weight, mean, direction, segments, norms) -> None\n\n"
"With o = theta - (base + delta): mean += weight * scale * o (scale == 1: unscaled); on rda\n"
"segments with norms[k] > 0 (the unscaled norm of o there) also direction += weight / norms[k] * o.");

static PyObject *py_accumulate_outer(PyObject *self, PyObject *args) {
    Py_buffer th, ba, de, mean, dir = {0}, seg, norms;
    PyObject *dir_obj;
    double scale, w;
    if (!PyArg_ParseTuple(args, "y*y*y*ddw*Oy*y*", &th, &ba, &de, &scale, &w, &mean, &dir_obj, &seg, &norms))
        return NULL;
    PyObject *result = NULL;
    int have_dir = dir_obj != Py_None;
    if (have_dir && PyObject_GetBuffer(dir_obj, &dir, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto release;
    Py_ssize_t n = th.len / 4;
    if (th.len % 4 || ba.len != th.len || de.len != th.len || mean.len != th.len ||
        (have_dir && dir.len != th.len)) {
        PyErr_SetString(PyExc_ValueError, "accumulate_outer: buffers must be float32 of one size");
        goto done;
    }
    if (!check_segments(&seg, n, have_dir) || !aligned4(5, &th, &ba, &de, &mean, have_dir ? &dir : NULL))
        goto done;
    if (norms.len != (seg.len / 24) * 8) {
        PyErr_SetString(PyExc_ValueError, "accumulate_outer: norms must hold one float64 per segment");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    accumulate_outer_segments((const float *)th.buf, (const float *)ba.buf, (const float *)de.buf,
                              (float)scale, scale != 1.0, w, (float *)mean.buf,
                              have_dir ? (float *)dir.buf : NULL, (const int64_t *)seg.buf, seg.len / 24,
                              (const double *)norms.buf);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    if (have_dir) PyBuffer_Release(&dir);
release:
    PyBuffer_Release(&th); PyBuffer_Release(&ba); PyBuffer_Release(&de);
    PyBuffer_Release(&mean); PyBuffer_Release(&seg); PyBuffer_Release(&norms);
    return result;
}

/* ------------------------------------------------------------------------------------------ */
/* The shard's quantized-update downlink in one pass (common/merge.py quantized_update): the
 * codes of u = master - replica and the new replica + deq(codes), chunk by chunk through L1;
 * the same bytes and values as encode(master - replica) then replica + decode(...). */
MULTIVERSION
static int encode_update_blocks(const float *master, const float *replica, Py_ssize_t n, int levels,
                                uint8_t *values_out, uint16_t *scales_out, float *out) {
    float x[CHUNK * BLOCK], deq[BLOCK];
    Py_ssize_t stride = levels == 7 ? BLOCK / 2 : BLOCK;
    Py_ssize_t n_blocks = (n + BLOCK - 1) / BLOCK;
    for (Py_ssize_t b = 0; b < n_blocks; b += CHUNK) {
        Py_ssize_t k = n_blocks - b < CHUNK ? n_blocks - b : CHUNK;
        Py_ssize_t a = b * BLOCK, len = (b + k) * BLOCK <= n ? k * BLOCK : n - a;
        for (Py_ssize_t i = 0; i < len; i++) x[i] = master[a + i] - replica[a + i];
        for (Py_ssize_t i = len; i < k * BLOCK; i++) x[i] = 0.0f;       /* the tail's padding */
        uint8_t tailv[BLOCK];
        int partial = len < k * BLOCK;
        uint8_t *vals = values_out + b * stride;
        if (partial) {   /* the last chunk holds the partial block: its codes go through tailv */
            if (k > 1 && !quantise_chunk(x, k - 1, levels, vals, scales_out + b)) return 0;
            if (!quantise_chunk(x + (k - 1) * BLOCK, 1, levels, tailv, scales_out + b + k - 1)) return 0;
            Py_ssize_t rest = len - (k - 1) * BLOCK;
            memcpy(vals + (k - 1) * stride, tailv, (size_t)(levels == 7 ? (rest + 1) / 2 : rest));
        } else if (!quantise_chunk(x, k, levels, vals, scales_out + b)) {
            return 0;
        }
        for (Py_ssize_t j = 0; j < k; j++) {
            const uint8_t *v = (partial && j == k - 1) ? tailv : vals + j * stride;
            dequantise_block(v, levels, bf16_f32(scales_out[b + j]), deq);
            Py_ssize_t lo = j * BLOCK, hi = lo + BLOCK < len ? lo + BLOCK : len;
            for (Py_ssize_t i = lo; i < hi; i++) out[a + i] = replica[a + i] + deq[i - lo];
        }
    }
    return 1;
}

PyDoc_STRVAR(encode_update_doc,
"encode_update(master, replica, levels, values_out, scales_out, out) -> bool\n\n"
"Quantise master - replica into values_out / scales_out (as encode) and write replica + the\n"
"decoded codes into out, in one pass. False (out partly written) if master - replica holds NaN/inf.");

static PyObject *py_encode_update(PyObject *self, PyObject *args) {
    Py_buffer ma, re, vals, scales, out;
    int levels;
    if (!PyArg_ParseTuple(args, "y*y*iw*w*w*", &ma, &re, &levels, &vals, &scales, &out)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = ma.len / 4;
    if (re.len != ma.len || out.len != ma.len || !aligned4(3, &ma, &re, &out)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "encode_update: master, replica and out must be float32 of one size");
        goto done;
    }
    if (!check_codec_buffers(&ma, &vals, &scales, levels)) goto done;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = encode_update_blocks((const float *)ma.buf, (const float *)re.buf, n, levels, (uint8_t *)vals.buf,
                              (uint16_t *)scales.buf, (float *)out.buf);
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(ok);
done:
    PyBuffer_Release(&ma); PyBuffer_Release(&re); PyBuffer_Release(&vals);
    PyBuffer_Release(&scales); PyBuffer_Release(&out);
    return result;
}

/* ------------------------------------------------------------------------------------------ */
/* A whole round at once (common/merge.py OuterAccumulator.measure_round / fold_round): every
 * answer's outer gradient o_m = theta - (base_m + delta_m), where delta_m is fp32 or still int8 /
 * int4 codes (decoded tile by tile into a small buffer, never as a whole vector). Each segment is
 * walked in sub-tiles of TILE values from its start and, within a sub-tile, answer by answer: theta
 * and the accumulators stay in cache while all answers pass over them. Per value, the operations
 * and their order are those of outer_sq_sums / accumulate_outer_segments one answer after the other
 * (the four double accumulators continue across sub-tiles; answers are added in order), so the
 * results are bit-identical to theirs. */

#define TILE 1024   /* values per sub-tile: a multiple of 16 (the sums' chunks) */

typedef struct {
    Py_buffer base, de, vals, scales;   /* de (fp32) or vals + scales (codes) */
    int levels;                         /* 0: fp32 delta */
} round_answer;

/* delta at [x, y) of an answer: a pointer d with d[i - x] = delta[i] (n values in all). */
static inline __attribute__((always_inline)) const float *delta_tile(const round_answer *a, Py_ssize_t n, Py_ssize_t x, Py_ssize_t y, float *buf) {
    if (!a->levels) return (const float *)a->de.buf + x;
    const uint8_t *vals = (const uint8_t *)a->vals.buf, *scales = (const uint8_t *)a->scales.buf;
    Py_ssize_t stride = a->levels == 7 ? BLOCK / 2 : BLOCK;
    Py_ssize_t b0 = x / BLOCK, b1 = (y + BLOCK - 1) / BLOCK;
    for (Py_ssize_t b = b0; b < b1; b++) {
        float s = bf16_f32(load_scale(scales, b));
        float *out = buf + (b - b0) * BLOCK;
        if ((b + 1) * BLOCK <= n) {
            dequantise_block(vals + b * stride, a->levels, s, out);
        } else {                                   /* the last, partial block */
            uint8_t v[BLOCK] = {0};
            Py_ssize_t rest = n - b * BLOCK;
            memcpy(v, vals + b * stride, (size_t)(a->levels == 7 ? (rest + 1) / 2 : rest));
            dequantise_block(v, a->levels, s, out);
        }
    }
    return buf + (x - b0 * BLOCK);
}

typedef struct { v4d s[4]; double tail; } sq_state;   /* 32-byte aligned (its vectors) */

/* sq_sum over [x, y) continued from st: full chunks of 16 from x, the scalar rest only when y
 * ends the segment (x - start is a multiple of 16 for every sub-tile). */
static inline __attribute__((always_inline)) void sq_continue(const float *th, const float *ba, const float *d, Py_ssize_t x, Py_ssize_t y,
                               sq_state *st) {
    Py_ssize_t i = x;
    double acc[16];                 /* lane 4 * j + l is st->s[j][l]: value i + 4 * j + l's square */
    memcpy(acc, st->s, sizeof acc);  /* (in registers for the tile: a plain loop the compiler vectorises) */
    for (; i + 16 <= y; i += 16)
        for (int l = 0; l < 16; l++) {
            double v = (double)(th[i + l] - (ba[i + l] + d[i + l - x]));
            acc[l] += v * v;
        }
    memcpy(st->s, acc, sizeof acc);
    for (; i < y; i++) {
        float t = ba[i] + d[i - x];
        double v = (double)(th[i] - t);
        st->tail += v * v;
    }
}

MULTIVERSION
static void round_sq_sums(const float *th, const round_answer *ans, Py_ssize_t m, Py_ssize_t n,
                          const int64_t *seg, Py_ssize_t n_seg, double *sums, sq_state *st, float *buf) {
    for (Py_ssize_t k = 0; k < n_seg; k++) {
        Py_ssize_t a = (Py_ssize_t)seg[3 * k], b = (Py_ssize_t)seg[3 * k + 1];
        memset(st, 0, sizeof(sq_state) * (size_t)m);
        for (Py_ssize_t x = a; x < b; x += TILE) {
            Py_ssize_t y = b - x > TILE ? x + TILE : b;
            for (Py_ssize_t j = 0; j < m; j++)
                sq_continue(th, (const float *)ans[j].base.buf, delta_tile(&ans[j], n, x, y, buf), x, y, &st[j]);
        }
        for (Py_ssize_t j = 0; j < m; j++) {
            v4d t = (st[j].s[0] + st[j].s[1]) + (st[j].s[2] + st[j].s[3]);
            sums[j * n_seg + k] = st[j].tail + ((t[0] + t[1]) + (t[2] + t[3]));
        }
    }
}

MULTIVERSION
static void round_accumulate(const float *th, const round_answer *ans, Py_ssize_t m, Py_ssize_t n,
                             const double *sw, float *mean, float *direction, const int64_t *seg,
                             Py_ssize_t n_seg, const double *norms, float *buf, int init) {
    for (Py_ssize_t k = 0; k < n_seg; k++) {
        Py_ssize_t a = (Py_ssize_t)seg[3 * k], b = (Py_ssize_t)seg[3 * k + 1];
        for (Py_ssize_t x = a; x < b; x += TILE) {
            Py_ssize_t y = b - x > TILE ? x + TILE : b;
            for (Py_ssize_t j = 0; j < m; j++) {
                const float *ba = (const float *)ans[j].base.buf;
                const float *d = delta_tile(&ans[j], n, x, y, buf);   /* d[i - x] = delta[i] */
                float s = (float)sw[2 * j];
                int scaled = sw[2 * j] != 1.0;
                double w = sw[2 * j + 1], nk = norms[j * n_seg + k];
                float wf = (float)w;
                if (init && j == 0) {   /* the accumulators are not zeroed: 0 + term, as += on zeros */
                    if (seg[3 * k + 2]) {
                        double ad = nk > 0.0 ? w / nk : 0.0;
                        int wide = !(ad <= FLT_MAX);
                        float af = wide ? 0.0f : (float)ad;
                        for (Py_ssize_t i = x; i < y; i++) {
                            float t = ba[i] + d[i - x], o = th[i] - t;
                            mean[i] = 0.0f + wf * (scaled ? o * s : o);
                            direction[i] = nk > 0.0 ? 0.0f + unit_term(ad, af, wide, o) : 0.0f;
                        }
                    } else {
                        for (Py_ssize_t i = x; i < y; i++) {
                            float t = ba[i] + d[i - x], o = th[i] - t;
                            mean[i] = 0.0f + wf * (scaled ? o * s : o);
                        }
                    }
                } else if (seg[3 * k + 2] && nk > 0.0) {
                    double ad = w / nk;
                    int wide = !(ad <= FLT_MAX);
                    float af = wide ? 0.0f : (float)ad;
                    for (Py_ssize_t i = x; i < y; i++) {
                        float t = ba[i] + d[i - x], o = th[i] - t;
                        mean[i] += wf * (scaled ? o * s : o);
                        direction[i] += unit_term(ad, af, wide, o);
                    }
                } else {
                    for (Py_ssize_t i = x; i < y; i++) {
                        float t = ba[i] + d[i - x], o = th[i] - t;
                        mean[i] += wf * (scaled ? o * s : o);
                    }
                }
            }
        }
    }
}

static void release_answers(round_answer *ans, Py_ssize_t m) {
    for (Py_ssize_t j = 0; j < m; j++) {
        if (ans[j].base.obj) PyBuffer_Release(&ans[j].base);
        if (ans[j].de.obj) PyBuffer_Release(&ans[j].de);
        if (ans[j].vals.obj) PyBuffer_Release(&ans[j].vals);
        if (ans[j].scales.obj) PyBuffer_Release(&ans[j].scales);
    }
    PyMem_Free(ans);
}

static int get_buffer(PyObject *o, Py_buffer *b, const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "round: %s is not a contiguous buffer", what);
        return 0;
    }
    return 1;
}

/* answers: a sequence of (base, delta) or (base, values, scales, levels), n values each. */
static round_answer *parse_answers(PyObject *seq, Py_ssize_t n, Py_ssize_t *m_out) {
    PyObject *fast = PySequence_Fast(seq, "round: answers must be a sequence");
    if (!fast) return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(fast);
    round_answer *ans = PyMem_Calloc(m ? (size_t)m : 1, sizeof(round_answer));
    if (!ans) { Py_DECREF(fast); PyErr_NoMemory(); return NULL; }
    for (Py_ssize_t j = 0; j < m; j++) {
        PyObject *t = PySequence_Fast_GET_ITEM(fast, j);
        Py_ssize_t len = PyTuple_Check(t) ? PyTuple_GET_SIZE(t) : -1;
        if (len != 2 && len != 4) {
            PyErr_SetString(PyExc_ValueError, "round: each answer is (base, delta) or (base, values, scales, levels)");
            goto bad;
        }
        round_answer *a = &ans[j];
        if (!get_buffer(PyTuple_GET_ITEM(t, 0), &a->base, "a base")) goto bad;
        if (a->base.len != 4 * n || ((uintptr_t)a->base.buf & 3u)) {
            PyErr_SetString(PyExc_ValueError, "round: each base must be float32 of theta's size, aligned");
            goto bad;
        }
        if (len == 2) {
            if (!get_buffer(PyTuple_GET_ITEM(t, 1), &a->de, "a delta")) goto bad;
            if (a->de.len != 4 * n || ((uintptr_t)a->de.buf & 3u)) {
                PyErr_SetString(PyExc_ValueError, "round: each fp32 delta must be float32 of theta's size, aligned");
                goto bad;
            }
            continue;
        }
        a->levels = (int)PyLong_AsLong(PyTuple_GET_ITEM(t, 3));
        if (PyErr_Occurred() || !check_levels(a->levels)) goto bad;
        if (!get_buffer(PyTuple_GET_ITEM(t, 1), &a->vals, "a values frame") ||
            !get_buffer(PyTuple_GET_ITEM(t, 2), &a->scales, "a scales frame")) goto bad;
        if (!check_size(&a->vals, values_nbytes(n, a->levels), "values") ||
            !check_size(&a->scales, 2 * ((n + BLOCK - 1) / BLOCK), "scales")) goto bad;
        if (!scales_ok((const uint8_t *)a->scales.buf, n, a->levels)) {
            PyErr_SetString(PyExc_ValueError, "round: non-finite values (a scale beyond the fp32 range)");
            goto bad;
        }
    }
    Py_DECREF(fast);
    *m_out = m;
    return ans;
bad:
    Py_DECREF(fast);
    release_answers(ans, m);
    return NULL;
}

PyDoc_STRVAR(round_sq_sums_doc,
"round_sq_sums(theta, answers, segments, sums) -> None\n\n"
"answers: (base, delta) or (base, values, scales, levels) per answer. sums[m * n_seg + k] = the\n"
"sum over segment k of (theta - (base_m + delta_m))^2 (float64), bit-identical to outer_sq_sums.");

static PyObject *py_round_sq_sums(PyObject *self, PyObject *args) {
    Py_buffer th, seg, sums;
    PyObject *answers;
    if (!PyArg_ParseTuple(args, "y*Oy*w*", &th, &answers, &seg, &sums)) return NULL;
    PyObject *result = NULL;
    round_answer *ans = NULL;
    Py_ssize_t m = 0, n = th.len / 4;
    sq_state *st = NULL;
    float *buf = NULL;
    if (th.len % 4 || !aligned4(1, &th) || !check_segments(&seg, n, 1)) goto done;
    if (!(ans = parse_answers(answers, n, &m))) goto done;
    if (sums.len != m * (seg.len / 24) * 8) {
        PyErr_SetString(PyExc_ValueError, "round_sq_sums: sums must hold one float64 per answer and segment");
        goto done;
    }
    st = PyMem_Malloc(sizeof(sq_state) * (size_t)(m + 1));   /* + 1: room to align to the vectors' 32 bytes */
    buf = PyMem_Malloc(sizeof(float) * (TILE + 2 * BLOCK));
    if (!st || !buf) { PyErr_NoMemory(); goto done; }
    sq_state *aligned = (sq_state *)(((uintptr_t)st + 31u) & ~(uintptr_t)31u);
    Py_BEGIN_ALLOW_THREADS
    round_sq_sums((const float *)th.buf, ans, m, n, (const int64_t *)seg.buf, seg.len / 24, (double *)sums.buf,
                  aligned, buf);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    if (ans) release_answers(ans, m);
    PyMem_Free(st); PyMem_Free(buf);
    PyBuffer_Release(&th); PyBuffer_Release(&seg); PyBuffer_Release(&sums);
    return result;
}

PyDoc_STRVAR(round_accumulate_doc,
"round_accumulate(theta, answers, scale_weight, mean, direction, segments, norms, init=False) -> None\n\n"
"accumulate_outer for every answer in order (scale_weight: float64 (scale, weight) per answer;\n"
"norms: float64 per answer and segment), tile by tile: bit-identical to calling it per answer.\n"
"init: mean and direction hold garbage; the first answer writes 0 + its terms (rda segments' direction).");

static PyObject *py_round_accumulate(PyObject *self, PyObject *args) {
    Py_buffer th, sw, mean, dir = {0}, seg, norms;
    PyObject *answers, *dir_obj;
    int init = 0;
    if (!PyArg_ParseTuple(args, "y*Oy*w*Oy*y*|p", &th, &answers, &sw, &mean, &dir_obj, &seg, &norms, &init)) return NULL;
    PyObject *result = NULL;
    round_answer *ans = NULL;
    Py_ssize_t m = 0, n = th.len / 4;
    float *buf = NULL;
    int have_dir = dir_obj != Py_None;
    if (have_dir && PyObject_GetBuffer(dir_obj, &dir, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (th.len % 4 || mean.len != th.len || (have_dir && dir.len != th.len) ||
        !aligned4(3, &th, &mean, have_dir ? &dir : NULL)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "round_accumulate: theta, mean and direction must be float32 of one size");
        goto done;
    }
    if (!check_segments(&seg, n, have_dir)) goto done;
    if (!(ans = parse_answers(answers, n, &m))) goto done;
    if (sw.len != m * 16 || norms.len != m * (seg.len / 24) * 8) {
        PyErr_SetString(PyExc_ValueError, "round_accumulate: scale_weight (2 float64) and norms (float64 per segment) per answer");
        goto done;
    }
    if (!(buf = PyMem_Malloc(sizeof(float) * (TILE + 2 * BLOCK)))) { PyErr_NoMemory(); goto done; }
    Py_BEGIN_ALLOW_THREADS
    round_accumulate((const float *)th.buf, ans, m, n, (const double *)sw.buf, (float *)mean.buf,
                     have_dir ? (float *)dir.buf : NULL, (const int64_t *)seg.buf, seg.len / 24,
                     (const double *)norms.buf, buf, init);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    if (ans) release_answers(ans, m);
    PyMem_Free(buf);
    if (have_dir && dir.obj) PyBuffer_Release(&dir);
    PyBuffer_Release(&th); PyBuffer_Release(&sw); PyBuffer_Release(&mean);
    PyBuffer_Release(&seg); PyBuffer_Release(&norms);
    return result;
}

static PyMethodDef methods[] = {
    {"encode", py_encode, METH_VARARGS, encode_doc},
    {"decode", py_decode, METH_VARARGS, decode_doc},
    {"outer_sq_sums", py_outer_sq_sums, METH_VARARGS, outer_sq_sums_doc},
    {"accumulate_outer", py_accumulate_outer, METH_VARARGS, accumulate_outer_doc},
    {"encode_update", py_encode_update, METH_VARARGS, encode_update_doc},
    {"round_sq_sums", py_round_sq_sums, METH_VARARGS, round_sq_sums_doc},
    {"round_accumulate", py_round_accumulate, METH_VARARGS, round_accumulate_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "common._qkernels",
    "One-pass int8/int4 codec kernels (common/quant.py) and the merge accumulation (common/merge.py).", -1, methods,
};

/* What common/quant.py expects (KERNELS_ABI there): a module built from older sources is not used. */
#define QKERNELS_ABI 3

static int add_learner_kernels(PyObject *m);   /* the learner's sync path: at the end of this file */

PyMODINIT_FUNC PyInit__qkernels(void) {
#ifdef HAVE_QUANTISE_512
    if (have_avx512f < 0) {
        const char *env = getenv("DDLOCO_KERNELS_AVX512");   /* 0/false/off/no: the portable loop (tests compare both) */
        __builtin_cpu_init();
        int off = env && (!strcmp(env, "0") || !strcasecmp(env, "false") || !strcasecmp(env, "off") || !strcasecmp(env, "no"));
        have_avx512f = off ? 0 : __builtin_cpu_supports("avx512f");
    }
#endif
    PyObject *m = PyModule_Create(&module);
#ifdef HAVE_QUANTISE_512
    const char *quantiser = have_avx512f > 0 ? "avx512f" : "portable";
#else
    const char *quantiser = "portable";
#endif
    if (m && (PyModule_AddIntConstant(m, "ABI", QKERNELS_ABI) < 0 || add_learner_kernels(m) < 0
              || PyModule_AddStringConstant(m, "QUANTISER", quantiser) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

/* ------------------------------------------------------------------------------------------ */
/* The learner's sync path (learner/network.py, learner/exchange.py), one pass each over a
 * fragment: an answer's codes of snapshot - base, without the delta as a vector; a broadcast
 * update added to the base as it is decoded; the carry of the steps not merged yet, in place; the
 * snapshot's copy.
 * Per value they make the fp32 operations of the unfused torch expressions, in their order, so
 * the results are bit-identical to them (no multiply is followed by an add in one expression
 * here except q * s + base, which decode_add keeps as two roundings through a buffer, as the
 * shard's encode_update does). Added functions only: common/quant.py finds them by name. */

#if defined(__x86_64__)
#include <immintrin.h>
#define STREAM_STORES 1
#endif
#define STREAM_MIN_BYTES (1 << 20)   /* outputs this large are not read again before they leave the caches */

/* Whether n floats at out are written with streaming (non-temporal) stores: on x86-64, for a large
 * output whose address allows them. A fresh buffer written with ordinary stores is first read
 * into the caches line by line, then evicts other data (the training's); a streaming store does
 * neither. The values written are the same. */
static inline int stream_stores(const float *out, Py_ssize_t n) {
#ifdef STREAM_STORES
    return (Py_ssize_t)sizeof(float) * n >= STREAM_MIN_BYTES && ((uintptr_t)out & 15u) == 0;
#else
    (void)out; (void)n;
    return 0;
#endif
}

/* out[0, k) = v[0, k), k a multiple of 4; streaming stores where ``stream`` (out 16-byte aligned). */
static inline __attribute__((always_inline)) void store_floats(float *out, const float *v, Py_ssize_t k, int stream) {
#ifdef STREAM_STORES
    if (stream) {
        for (Py_ssize_t i = 0; i < k; i += 4) _mm_stream_ps(out + i, _mm_loadu_ps(v + i));
        return;
    }
#endif
    (void)stream;
    memcpy(out, v, (size_t)k * sizeof(float));
}

/* After streaming stores: they are ordered before whatever this thread does next (the Python
 * object that hands the buffer to another thread). */
static inline void stream_fence(int stream) {
#ifdef STREAM_STORES
    if (stream) _mm_sfence();
#endif
    (void)stream;
}

/* encode(a - b): the differences of a chunk go through an L1 buffer, never to memory. */
MULTIVERSION
static int encode_diff_blocks(const float *a, const float *b, Py_ssize_t n, int levels,
                              uint8_t *values_out, uint16_t *scales_out) {
    float x[CHUNK * BLOCK];
    Py_ssize_t stride = levels == 7 ? BLOCK / 2 : BLOCK, full = n / BLOCK;
    for (Py_ssize_t blk = 0; blk < full; blk += CHUNK) {
        Py_ssize_t k = full - blk < CHUNK ? full - blk : CHUNK, off = blk * BLOCK;
        for (Py_ssize_t i = 0; i < k * BLOCK; i++) x[i] = a[off + i] - b[off + i];
        if (!quantise_chunk(x, k, levels, values_out + blk * stride, scales_out + blk)) return 0;
    }
    Py_ssize_t rest = n - full * BLOCK;
    if (rest) {                                   /* the tail, padded with zeros (as encode_blocks) */
        uint8_t v[BLOCK];
        Py_ssize_t off = full * BLOCK;
        for (Py_ssize_t i = 0; i < BLOCK; i++) x[i] = i < rest ? a[off + i] - b[off + i] : 0.0f;
        if (!quantise_chunk(x, 1, levels, v, scales_out + full)) return 0;
        memcpy(values_out + full * stride, v, (size_t)(levels == 7 ? (rest + 1) / 2 : rest));
    }
    return 1;
}

/* base + decode(values, scales): nothing written if a scale fails scales_ok (as decode_blocks). The
 * new base is read again at the next step boundary at the earliest: written past the caches. */
MULTIVERSION
static int decode_add_blocks(const uint8_t *values, const uint8_t *scales, Py_ssize_t n, int levels,
                             const float *base, float *out) {
    if (!scales_ok(scales, n, levels)) return 0;
    float deq[BLOCK], sum[BLOCK];
    Py_ssize_t stride = levels == 7 ? BLOCK / 2 : BLOCK, full = n / BLOCK;
    int stream = stream_stores(out, n);
    for (Py_ssize_t b = 0; b < full; b++) {
        dequantise_block(values + b * stride, levels, bf16_f32(load_scale(scales, b)), deq);
        for (int i = 0; i < BLOCK; i++) sum[i] = base[b * BLOCK + i] + deq[i];
        store_floats(out + b * BLOCK, sum, BLOCK, stream);
    }
    stream_fence(stream);
    Py_ssize_t rest = n - full * BLOCK;
    if (rest) {
        uint8_t v[BLOCK] = {0};
        memcpy(v, values + full * stride, (size_t)(levels == 7 ? (rest + 1) / 2 : rest));
        dequantise_block(v, levels, bf16_f32(load_scale(scales, full)), deq);
        for (Py_ssize_t i = 0; i < rest; i++) out[full * BLOCK + i] = base[full * BLOCK + i] + deq[i];
    }
    return 1;
}

/* dst = src (a learner's snapshot of a fragment: common/fragments.py gather), written past the
 * caches where it is large. */
MULTIVERSION
static void copy_values(float *dst, const float *src, Py_ssize_t n) {
    int stream = stream_stores(dst, n);
    Py_ssize_t k = stream ? n - n % 4 : 0;
    store_floats(dst, src, k, stream);
    stream_fence(stream);
    memcpy(dst + k, src + k, (size_t)(n - k) * sizeof(float));
}

/* theta <- merged + (theta - reference), in place (common/merge.py carry_local_steps). */
MULTIVERSION
static void carry_values(float *theta, const float *merged, const float *reference, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) theta[i] = merged[i] + (theta[i] - reference[i]);
}

PyDoc_STRVAR(encode_diff_doc,
"encode_diff(a, b, levels, values_out, scales_out) -> bool\n\n"
"encode(a - b) without a - b as a vector: the same bytes. False if a - b holds NaN/inf.");

static PyObject *py_encode_diff(PyObject *self, PyObject *args) {
    Py_buffer a, b, vals, scales;
    int levels;
    if (!PyArg_ParseTuple(args, "y*y*iw*w*", &a, &b, &levels, &vals, &scales)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = a.len / 4;
    if (b.len != a.len || !aligned4(2, &a, &b)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "encode_diff: a and b must be float32 of one size");
        goto done;
    }
    if (!check_codec_buffers(&a, &vals, &scales, levels)) goto done;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = encode_diff_blocks((const float *)a.buf, (const float *)b.buf, n, levels, (uint8_t *)vals.buf,
                            (uint16_t *)scales.buf);
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(ok);
done:
    PyBuffer_Release(&a); PyBuffer_Release(&b); PyBuffer_Release(&vals); PyBuffer_Release(&scales);
    return result;
}

PyDoc_STRVAR(decode_add_doc,
"decode_add(values, scales, levels, base, out) -> bool\n\n"
"out = base + decode(values, scales) (float32, n values), in one pass. False (nothing written) if a\n"
"scale is NaN/inf or would overflow, as decode.");

static PyObject *py_decode_add(PyObject *self, PyObject *args) {
    Py_buffer vals, scales, base, out;
    int levels;
    if (!PyArg_ParseTuple(args, "y*y*iy*w*", &vals, &scales, &levels, &base, &out)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = out.len / 4;
    if (base.len != out.len || !aligned4(2, &base, &out)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "decode_add: base and out must be float32 of one size");
        goto done;
    }
    if (!check_codec_buffers(&out, &vals, &scales, levels)) goto done;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = decode_add_blocks((const uint8_t *)vals.buf, (const uint8_t *)scales.buf, n, levels,
                           (const float *)base.buf, (float *)out.buf);
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(ok);
done:
    PyBuffer_Release(&vals); PyBuffer_Release(&scales); PyBuffer_Release(&base); PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(carry_doc,
"carry(theta, merged, reference) -> None\n\n"
"theta = merged + (theta - reference), in place (float32 buffers of one size).");

static PyObject *py_carry(PyObject *self, PyObject *args) {
    Py_buffer th, me, re;
    if (!PyArg_ParseTuple(args, "w*y*y*", &th, &me, &re)) return NULL;
    PyObject *result = NULL;
    if (th.len % 4 || me.len != th.len || re.len != th.len || !aligned4(3, &th, &me, &re)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "carry: theta, merged and reference must be float32 of one size");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    carry_values((float *)th.buf, (const float *)me.buf, (const float *)re.buf, th.len / 4);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&th); PyBuffer_Release(&me); PyBuffer_Release(&re);
    return result;
}

PyDoc_STRVAR(copy_doc,
"copy(dst, src) -> None\n\n"
"dst = src (float32 buffers of one size), with streaming stores where dst is large (>= 1 MiB).");

static PyObject *py_copy(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*", &dst, &src)) return NULL;
    PyObject *result = NULL;
    if (dst.len % 4 || src.len != dst.len || !aligned4(2, &dst, &src)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "copy: dst and src must be float32 of one size");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    copy_values((float *)dst.buf, (const float *)src.buf, dst.len / 4);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&dst); PyBuffer_Release(&src);
    return result;
}

static PyMethodDef learner_methods[] = {
    {"encode_diff", py_encode_diff, METH_VARARGS, encode_diff_doc},
    {"decode_add", py_decode_add, METH_VARARGS, decode_add_doc},
    {"carry", py_carry, METH_VARARGS, carry_doc},
    {"copy", py_copy, METH_VARARGS, copy_doc},
    {NULL, NULL, 0, NULL},
};

static int add_learner_kernels(PyObject *m) { return PyModule_AddFunctions(m, learner_methods); }
