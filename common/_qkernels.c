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
#include <float.h>
#include <stdarg.h>
#include <math.h>

#define BLOCK 64
#define ROUND_MAGIC 12582912.0f /* 1.5 * 2^23: v + M - M rounds v half-to-even for |v| < 2^22 */

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && defined(__GLIBC__)
#define MULTIVERSION __attribute__((target_clones("avx2", "default")))
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

static inline void pack_block(const int8_t *q, uint8_t *out) {
    uint16_t w[BLOCK / 2];                     /* (low, high) value pairs, little-endian */
    memcpy(w, q, BLOCK);
    for (int j = 0; j < BLOCK / 2; j++) {
        uint16_t t = w[j] & 0x0F0Fu;
        out[j] = (uint8_t)(t | (t >> 4));
    }
}

#define CHUNK 64 /* blocks per pass: 16 KiB of input, still in L1 while it is quantised */

/* Quantise n_blocks full blocks (n_blocks <= CHUNK); returns 0 if they hold NaN/inf. The
 * per-block scale arithmetic runs as loops over the chunk's blocks, so it vectorises too. */
static inline int quantise_chunk(const float *x, Py_ssize_t n_blocks, int levels,
                                 uint8_t *values_out, uint16_t *scales_out) {
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
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        uint16_t sc = bf16_rne(bits_f32(amax[b]) / (float)levels);
        float sf = bf16_f32(sc);
        scales_out[b] = sc;
        d[b] = sf > 0.0f ? sf : 1.0f;            /* an all-zero (or underflowed) block: 0s */
    }
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        int8_t q[BLOCK];
        for (int i = 0; i < BLOCK; i++) {        /* |x / d| <= ~1.5 L (d >= absmax / L rounded): far inside int32 */
            int32_t r = (int32_t)((x[b * BLOCK + i] / d[b] + ROUND_MAGIC) - ROUND_MAGIC);
            r = r < levels ? r : levels;         /* an integer clamp vectorises, a float one less */
            r = r > -levels ? r : -levels;
            q[i] = (int8_t)r;
        }
        if (levels == 7) pack_block(q, values_out + b * (BLOCK / 2));
        else memcpy(values_out + b * BLOCK, q, BLOCK);
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

static inline void dequantise_block(const uint8_t *v, int levels, float s, float *out) {
    if (levels == 7) {
        for (int j = 0; j < BLOCK / 2; j++) {
            int32_t p = v[j];
            out[2 * j] = (float)(((p & 0x0F) ^ 8) - 8) * s;
            out[2 * j + 1] = (float)(((p >> 4) ^ 8) - 8) * s;
        }
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
 * overflow, as they do in an fp32 norm): four 4-lane double accumulators (GCC/Clang vector
 * types, SIMD on any target). */
typedef float v4f __attribute__((vector_size(16)));
typedef double v4d __attribute__((vector_size(32)));

static inline v4f load4(const float *p) { v4f v; memcpy(&v, p, sizeof v); return v; }

static inline double sq_sum(const float *th, const float *ba, const float *de, Py_ssize_t a, Py_ssize_t b) {
    v4d s[4] = {{0}, {0}, {0}, {0}};
    Py_ssize_t i = a;
    for (; i + 16 <= b; i += 16)
        for (int j = 0; j < 4; j++) {
            Py_ssize_t k = i + 4 * j;
            v4d v = __builtin_convertvector(load4(th + k) - (load4(ba + k) + load4(de + k)), v4d);
            s[j] += v * v;
        }
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

static PyMethodDef methods[] = {
    {"encode", py_encode, METH_VARARGS, encode_doc},
    {"decode", py_decode, METH_VARARGS, decode_doc},
    {"outer_sq_sums", py_outer_sq_sums, METH_VARARGS, outer_sq_sums_doc},
    {"accumulate_outer", py_accumulate_outer, METH_VARARGS, accumulate_outer_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "common._qkernels",
    "One-pass int8/int4 codec kernels (common/quant.py) and the merge accumulation (common/merge.py).", -1, methods,
};

/* What common/quant.py expects (KERNELS_ABI there): a module built from older sources is not used. */
#define QKERNELS_ABI 3

PyMODINIT_FUNC PyInit__qkernels(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "ABI", QKERNELS_ABI) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
