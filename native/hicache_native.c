/*
 * _hicache_native: the storage read path of hicache's file backend, in C, with the GIL released.
 *
 * read_pages() reads and verifies a whole batch of page files (page format v2, see
 * storage_backends/page_format.py) straight into the caller's buffers in one call that releases the GIL for
 * the whole batch. Each page is read in chunks and each chunk is hashed (xxh3-64) right after the read
 * copied it into the buffer, while it is still in the CPU cache: a verified page costs one pass over memory,
 * not two (copy, then checksum). Anything unusual (a short or overlong file, a header that does not match, a
 * checksum mismatch, a path that is not a regular file) is reported as RETRY and left to the Python side,
 * which re-reads that page and names the problem: this file only ever says "verified", "absent", "error"
 * (with its errno) or "look again".
 *
 * xxh3_64() is the payload checksum of page format v2 (xxh3-64, seed 0), releasing the GIL.
 *
 * xxhash.h is vendored from xxHash 0.8.4 (BSD 2-Clause, native/xxhash/LICENSE; taken from the python-xxhash
 * 4.1.0 sdist, which builds the same release) and compiled inline (XXH_INLINE_ALL): no library to link.
 * tests/storage/test_native.py checks its digests against python-xxhash's.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include "xxhash/xxhash.h"

/* Outcome codes, one byte per page; storage_backends/file_pages.py names them. */
enum {
    CODE_HIT = 0,          /* read and verified */
    CODE_MISS = 1,         /* the file does not exist */
    CODE_RETRY = 2,        /* something unusual: the caller re-reads the page and names the problem */
    CODE_ERROR = 3,        /* open or read failed (not a missing file): errno in the errors list */
};

#define HEADER_SIZE 56
#define CHUNK_BYTES (256 * 1024) /* read then hash this much at a time: stays in L2 between the two */
#define MAX_PATH_BYTES 4096
#define MIN_KEY_CHARS 4
#define MAX_KEY_CHARS 128
#define READAHEAD_PAGES 32 /* files one thread keeps open (and advised) ahead of the page it reads */

#ifndef RWF_NOWAIT
#define RWF_NOWAIT 0x00000008
#endif

typedef struct {
    int *errnos; /* per page: the errno of a CODE_ERROR */
    const char *root;
    Py_ssize_t root_len;
    const char *suffix;
    Py_ssize_t suffix_len;
    const unsigned char *namespace_digest; /* 16 bytes */
    int nowait_flags;                      /* RWF_NOWAIT (or 0: no probe); set to 0 when refused */
} read_ctx;

/* The page's path: root/ab/cd/<key><suffix> (FileBackend._path). Returns 0, or -1 if it does not fit. */
static int build_path(const read_ctx *ctx, const char *key, Py_ssize_t key_len, char *out) {
    Py_ssize_t need = ctx->root_len + 7 + key_len + ctx->suffix_len + 1;
    if (key_len < MIN_KEY_CHARS || need > MAX_PATH_BYTES) return -1;
    char *p = out;
    memcpy(p, ctx->root, ctx->root_len);
    p += ctx->root_len;
    *p++ = '/';
    *p++ = key[0];
    *p++ = key[1];
    *p++ = '/';
    *p++ = key[2];
    *p++ = key[3];
    *p++ = '/';
    memcpy(p, key, key_len);
    p += key_len;
    memcpy(p, ctx->suffix, ctx->suffix_len);
    p += ctx->suffix_len;
    *p = '\0';
    return 0;
}

/* A page key as storage_backends.page_format.validate_keys allows it: it cannot leave the root. */
static int is_page_key(const char *key, Py_ssize_t len) {
    if (len < MIN_KEY_CHARS || len > MAX_KEY_CHARS) return 0;
    for (Py_ssize_t j = 0; j < len; j++)
        if (!((key[j] >= '0' && key[j] <= '9') || (key[j] >= 'a' && key[j] <= 'f'))) return 0;
    return 1;
}

static uint64_t load_le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* Read outcome of one attempt: a code, or one of these two internal results. */
#define WOULD_BLOCK (-1)  /* RWF_NOWAIT: not (wholly) in the page cache */
#define NOWAIT_UNSUPPORTED (-2)

static ssize_t preadv2_all(int fd, const struct iovec *iov, int iovcnt, off_t off, int flags) {
    ssize_t r;
    do {
        r = preadv2(fd, iov, iovcnt, off, flags);
    } while (r < 0 && errno == EINTR);
    return r;
}

/*
 * Read and verify one page from an open file; `flags` is 0 or the probe flags (RWF_NOWAIT). The read of the
 * payload's last chunk asks for one byte more, into `past_end`: a file longer than header + payload fills
 * it and is handed back (RETRY) like a short one, never loaded, at no extra system call.
 */
static int read_fd(const read_ctx *ctx, int fd, const char *key, Py_ssize_t key_len, unsigned char *buf,
                   Py_ssize_t n, int flags, int *err) {
    unsigned char header[HEADER_SIZE];
    unsigned char past_end;
    size_t first = n < CHUNK_BYTES ? (size_t)n : CHUNK_BYTES;
    struct iovec iov[3] = {{header, HEADER_SIZE}, {buf, first}, {&past_end, 1}};
    ssize_t got = preadv2_all(fd, iov, first == (size_t)n ? 3 : 2, 0, flags);
    if (got < 0) {
        if (flags && errno == EAGAIN) return WOULD_BLOCK;
        if (flags && (errno == EOPNOTSUPP || errno == EINVAL)) return NOWAIT_UNSUPPORTED;
        *err = errno;
        return CODE_ERROR;
    }
    if ((size_t)got > HEADER_SIZE + first) return CODE_RETRY; /* overlong */
    if ((size_t)got != HEADER_SIZE + first) return flags ? WOULD_BLOCK : CODE_RETRY;
    /* magic, version 2, no flags, no reserved bits, namespace, key digest, payload length */
    if (memcmp(header, "HKVP", 4) != 0 || header[4] != 2 || header[5] != 0 || header[6] != 0 ||
        header[7] != 0 || memcmp(header + 8, ctx->namespace_digest, 16) != 0 ||
        load_le64(header + 40) != (uint64_t)n)
        return CODE_RETRY;
    XXH128_canonical_t kd;
    XXH128_canonicalFromHash(&kd, XXH3_128bits(key, (size_t)key_len));
    if (memcmp(header + 24, kd.digest, 16) != 0) return CODE_RETRY;

    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    XXH3_64bits_update(&state, buf, first);
    Py_ssize_t off = (Py_ssize_t)first;
    while (off < n) {
        size_t len = (size_t)(n - off) < CHUNK_BYTES ? (size_t)(n - off) : CHUNK_BYTES;
        struct iovec chunk[2] = {{buf + off, len}, {&past_end, 1}};
        int last = off + (Py_ssize_t)len == n;
        ssize_t r = preadv2_all(fd, chunk, last ? 2 : 1, (off_t)(HEADER_SIZE + off), flags);
        if (r < 0 && flags && errno == EAGAIN) return WOULD_BLOCK;
        if (r < 0 && !flags) {
            *err = errno;
            return CODE_ERROR;
        }
        if (r > (ssize_t)len) return CODE_RETRY; /* overlong */
        if (r != (ssize_t)len) return flags ? WOULD_BLOCK : CODE_RETRY;
        XXH3_64bits_update(&state, buf + off, len);
        off += (Py_ssize_t)len;
    }
    return XXH3_64bits_digest(&state) == load_le64(header + 48) ? CODE_HIT : CODE_RETRY;
}

#define NOT_REGULAR (-2) /* open_page: the path is not a regular file (a FIFO, a device, a directory) */

/*
 * Open page `key`'s file: its descriptor, or -1 with the errno in *err, or NOT_REGULAR. Opened with
 * O_NONBLOCK and checked with fstat before any read: a FIFO at a page path would otherwise block the open
 * (and then the read) until some writer came, holding a reader thread and its buffers for good. A regular
 * file ignores O_NONBLOCK on local filesystems; it is cleared anyway so a FUSE daemon sees a plain read.
 */
static int open_page(const read_ctx *ctx, const char *key, Py_ssize_t key_len, int *err) {
    char path[MAX_PATH_BYTES];
    if (build_path(ctx, key, key_len, path) < 0) {
        *err = ENAMETOOLONG;
        return -1;
    }
    int fd;
    do {
        fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        *err = errno;
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || fcntl(fd, F_SETFL, 0) < 0) {
        close(fd);
        return NOT_REGULAR;
    }
    return fd;
}

/* The outcome of a page whose open_page failed: NOT_REGULAR goes back to Python, which names it. */
static int open_failure(int fd, int err) {
    if (fd == NOT_REGULAR) return CODE_RETRY;
    return err == ENOENT ? CODE_MISS : CODE_ERROR;
}

/* Open and read one page. */
static int read_one(const read_ctx *ctx, const char *key, Py_ssize_t key_len, unsigned char *buf,
                    Py_ssize_t n, int flags, int *err) {
    int fd = open_page(ctx, key, key_len, err);
    if (fd < 0) return open_failure(fd, *err);
    int code = read_fd(ctx, fd, key, key_len, buf, n, flags, err);
    close(fd);
    return code;
}

/*
 * Pages are read with RWF_NOWAIT while the page cache holds them (one pass, as fast as a plain read). The
 * first page that would wait for the device switches the rest of the batch to read-ahead: keep the next
 * READAHEAD_PAGES pages open and advised (POSIX_FADV_WILLNEED) ahead of the one being read, so a cold
 * batch keeps the device busy with many reads at once instead of one page at a time, while a batch of
 * thousands of small pages never holds more than READAHEAD_PAGES descriptors (no EMFILE).
 */
static void read_batch(read_ctx *ctx, Py_ssize_t count, const char *const *keys, const Py_ssize_t *key_lens,
                       Py_buffer *views, unsigned char *codes) {
    Py_ssize_t i = 0;
    if (!ctx->nowait_flags) {
        /* no probe asked for (readahead off): plain blocking reads, no advice */
        for (; i < count; i++)
            codes[i] = (unsigned char)read_one(ctx, keys[i], key_lens[i], views[i].buf, views[i].len, 0,
                                               &ctx->errnos[i]);
        return;
    }
    for (; i < count; i++) {
        int code = read_one(ctx, keys[i], key_lens[i], views[i].buf, views[i].len, ctx->nowait_flags,
                            &ctx->errnos[i]);
        if (code == NOWAIT_UNSUPPORTED) {
            ctx->nowait_flags = 0; /* this filesystem cannot tell: read plainly from now on */
            break;
        }
        if (code == WOULD_BLOCK) break;
        codes[i] = (unsigned char)code;
    }
    int fds[READAHEAD_PAGES]; /* the open file of page k is fds[k % READAHEAD_PAGES] */
    Py_ssize_t opened = i;
    for (Py_ssize_t k = i; k < count; k++) {
        for (; opened < count && opened < k + READAHEAD_PAGES; opened++) {
            int fd = open_page(ctx, keys[opened], key_lens[opened], &ctx->errnos[opened]);
            if (fd >= 0) (void)posix_fadvise(fd, 0, HEADER_SIZE + views[opened].len, POSIX_FADV_WILLNEED);
            fds[opened % READAHEAD_PAGES] = fd;
        }
        int fd = fds[k % READAHEAD_PAGES];
        if (fd < 0) {
            codes[k] = (unsigned char)open_failure(fd, ctx->errnos[k]);
            continue;
        }
        codes[k] = (unsigned char)read_fd(ctx, fd, keys[k], key_lens[k], views[k].buf, views[k].len, 0,
                                          &ctx->errnos[k]);
        close(fd);
    }
}

PyDoc_STRVAR(read_pages_doc,
             "read_pages(root, suffix, keys, buffers, namespace_digest, nowait_flags, /)\n"
             "    -> tuple[bytes, int, list[tuple[int, int]]]\n\n"
             "Read and verify page files root/ab/cd/<key><suffix> into buffers with the GIL released.\n"
             "Returns one outcome byte per page (HIT, MISS, RETRY, ERROR), the probe flags to pass next\n"
             "time (0 once the filesystem refused them) and (index, errno) of every ERROR page.");

static PyObject *read_pages(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "read_pages() takes 6 arguments (%zd given)", nargs);
        return NULL;
    }
    read_ctx ctx;
    ctx.root = PyUnicode_AsUTF8AndSize(args[0], &ctx.root_len);
    if (ctx.root == NULL) return NULL;
    ctx.suffix = PyUnicode_AsUTF8AndSize(args[1], &ctx.suffix_len);
    if (ctx.suffix == NULL) return NULL;
    /* A NUL would cut every page's path short. */
    if (strlen(ctx.root) != (size_t)ctx.root_len || strlen(ctx.suffix) != (size_t)ctx.suffix_len) {
        PyErr_SetString(PyExc_ValueError, "root, suffix: expected no NUL character");
        return NULL;
    }
    if (!PyBytes_Check(args[4]) || PyBytes_GET_SIZE(args[4]) != 16) {
        PyErr_SetString(PyExc_ValueError, "namespace_digest: expected 16 bytes");
        return NULL;
    }
    ctx.namespace_digest = (const unsigned char *)PyBytes_AS_STRING(args[4]);
    long nowait_flags = PyLong_AsLong(args[5]);
    if (nowait_flags == -1 && PyErr_Occurred()) return NULL;
    ctx.nowait_flags = (int)nowait_flags;
    ctx.errnos = NULL;

    PyObject *key_seq = PySequence_Fast(args[2], "keys: expected a sequence of str");
    if (key_seq == NULL) return NULL;
    PyObject *buf_seq = PySequence_Fast(args[3], "buffers: expected a sequence of buffers");
    if (buf_seq == NULL) {
        Py_DECREF(key_seq);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(key_seq);
    PyObject *result = NULL, *codes = NULL;
    PyObject **key_objs = NULL;
    const char **keys = NULL;
    Py_ssize_t *key_lens = NULL;
    Py_buffer *views = NULL;
    Py_ssize_t n_keys = 0, n_views = 0;
    if (PySequence_Fast_GET_SIZE(buf_seq) != count) {
        PyErr_Format(PyExc_ValueError, "buffers: expected one buffer per key (%zd), got %zd", count,
                     PySequence_Fast_GET_SIZE(buf_seq));
        goto done;
    }
    key_objs = PyMem_Malloc(sizeof(PyObject *) * (size_t)(count + 1));
    keys = PyMem_Malloc(sizeof(char *) * (size_t)(count + 1));
    key_lens = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(count + 1));
    views = PyMem_Malloc(sizeof(Py_buffer) * (size_t)(count + 1));
    ctx.errnos = PyMem_Calloc((size_t)(count + 1), sizeof(int));
    codes = PyBytes_FromStringAndSize(NULL, count);
    if (key_objs == NULL || keys == NULL || key_lens == NULL || views == NULL || ctx.errnos == NULL ||
        codes == NULL) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    /* Own a reference to every key and a buffer export of every view: another thread may change the
       sequences while this one runs without the GIL. */
    for (; n_keys < count; n_keys++) {
        PyObject *key = PySequence_Fast_GET_ITEM(key_seq, n_keys);
        if (!PyUnicode_Check(key)) {
            PyErr_Format(PyExc_TypeError, "keys[%zd]: expected str, got %.100s", n_keys, Py_TYPE(key)->tp_name);
            goto done;
        }
        keys[n_keys] = PyUnicode_AsUTF8AndSize(key, &key_lens[n_keys]);
        if (keys[n_keys] == NULL) goto done;
        if (!is_page_key(keys[n_keys], key_lens[n_keys])) {
            PyErr_Format(PyExc_ValueError, "keys[%zd]: expected %d-%d lowercase hex characters", n_keys,
                         MIN_KEY_CHARS, MAX_KEY_CHARS);
            goto done;
        }
        Py_INCREF(key);
        key_objs[n_keys] = key;
    }
    for (; n_views < count; n_views++) {
        PyObject *buf = PySequence_Fast_GET_ITEM(buf_seq, n_views);
        if (PyObject_GetBuffer(buf, &views[n_views], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "buffers[%zd]: expected a writable C-contiguous buffer", n_views);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    read_batch(&ctx, count, keys, key_lens, views, (unsigned char *)PyBytes_AS_STRING(codes));
    Py_END_ALLOW_THREADS
    {
        PyObject *errors = PyList_New(0);
        if (errors == NULL) goto done;
        const unsigned char *c = (const unsigned char *)PyBytes_AS_STRING(codes);
        for (Py_ssize_t j = 0; j < count; j++) {
            if (c[j] != CODE_ERROR) continue;
            PyObject *item = Py_BuildValue("(ni)", j, ctx.errnos[j]);
            if (item == NULL || PyList_Append(errors, item) < 0) {
                Py_XDECREF(item);
                Py_DECREF(errors);
                goto done;
            }
            Py_DECREF(item);
        }
        result = Py_BuildValue("(OiN)", codes, ctx.nowait_flags, errors);
    }
done:
    for (Py_ssize_t j = 0; j < n_views; j++) PyBuffer_Release(&views[j]);
    for (Py_ssize_t j = 0; j < n_keys; j++) Py_DECREF(key_objs[j]);
    PyMem_Free(key_objs);
    PyMem_Free(keys);
    PyMem_Free(key_lens);
    PyMem_Free(views);
    PyMem_Free(ctx.errnos);
    Py_XDECREF(codes);
    Py_DECREF(key_seq);
    Py_DECREF(buf_seq);
    return result;
}

PyDoc_STRVAR(xxh3_64_doc,
             "xxh3_64(data, /) -> int\n\n"
             "xxh3-64 (seed 0) of a C-contiguous buffer, as xxhash.xxh3_64_intdigest; releases the GIL.");

static PyObject *xxh3_64(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    XXH64_hash_t h;
    if (view.len >= 4096) {
        Py_BEGIN_ALLOW_THREADS
        h = XXH3_64bits(view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        h = XXH3_64bits(view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong((unsigned long long)h);
}

static PyMethodDef methods[] = {
    {"read_pages", (PyCFunction)(void (*)(void))read_pages, METH_FASTCALL, read_pages_doc},
    {"xxh3_64", xxh3_64, METH_O, xxh3_64_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_hicache_native",
    .m_doc = "hicache's storage read path in C: batched page reads verified in one memory pass, without the GIL.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__hicache_native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "HIT", CODE_HIT) < 0 || PyModule_AddIntConstant(m, "MISS", CODE_MISS) < 0 ||
        PyModule_AddIntConstant(m, "RETRY", CODE_RETRY) < 0 || PyModule_AddIntConstant(m, "ERROR", CODE_ERROR) < 0 ||
        PyModule_AddIntConstant(m, "HEADER_SIZE", HEADER_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "CHUNK_BYTES", CHUNK_BYTES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
