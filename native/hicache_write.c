/*
 * _hicache_write: the file backend's write path in C (issue 25), the twin of hicache_native.c's reader.
 *
 * write_pages() writes a group of pages, each atomically (a temporary file in the page's directory, then
 * rename over the final name), computing each page's header (storage_backends/page_format.py, version 2:
 * magic, version, flags, namespace digest, xxh3-128 key digest, payload length, xxh3-64 checksum) in the
 * same pass, the whole group with the GIL released. Page by page in Python the writer took the GIL back
 * six times per page (header, open, writev, close, rename), and on a saturated 2-core machine every
 * hand-off waited for the event loop's switch interval: the writer fell behind the serving loop.
 *
 * A separate extension module (not hicache_native.c's) so the two data paths build and change apart; it
 * compiles xxHash inline the same way, through the same x86 dispatcher (native/xxh_dispatch.c).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include "xxhash/xxhash.h"
#if defined(__x86_64__) || defined(__i386__) /* as native/xxh_dispatch.c, which compiles it */
#include "xxhash/xxh_x86dispatch.h"
#endif

#define HEADER_SIZE 56
#define MAX_PATH_BYTES 4096

typedef struct {
    char path[MAX_PATH_BYTES];  /* the final name */
    char tmp[MAX_PATH_BYTES];   /* the temporary name, in the same directory */
    char dir[MAX_PATH_BYTES];   /* the directory (fsync'ed when durable) */
    const char *key;            /* points into keys_copy */
    size_t key_len;
    Py_buffer view;
    int err;                    /* 0: written; else the errno of the step that failed */
} Page;

static void store_le64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static int write_full(int fd, const unsigned char *header, const char *buf, size_t n) {
    struct iovec iov[2] = {{(void *)header, HEADER_SIZE}, {(void *)buf, n}};
    size_t total = HEADER_SIZE + n, done = 0;
    while (done < total) {
        ssize_t w;
        if (done < HEADER_SIZE) {
            struct iovec part[2] = {{(void *)(header + done), HEADER_SIZE - done}, iov[1]};
            w = writev(fd, part, 2);
        } else {
            w = write(fd, buf + (done - HEADER_SIZE), total - done);
        }
        if (w < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        done += (size_t)w;
    }
    return 0;
}

static int fsync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return errno;
    int err = fsync(fd) < 0 ? errno : 0;
    close(fd);
    return err;
}

/* One page, without the GIL: header, temporary file, write, (fsync), rename. */
static void write_one(Page *pg, const unsigned char *namespace_digest, int durable) {
    unsigned char header[HEADER_SIZE];
    memcpy(header, "HKVP", 4);
    header[4] = 2;
    header[5] = header[6] = header[7] = 0;
    memcpy(header + 8, namespace_digest, 16);
    XXH128_canonical_t kd;
    XXH128_canonicalFromHash(&kd, XXH3_128bits(pg->key, pg->key_len));
    memcpy(header + 24, kd.digest, 16);
    store_le64(header + 40, (uint64_t)pg->view.len);
    store_le64(header + 48, (uint64_t)XXH3_64bits(pg->view.buf, (size_t)pg->view.len));

    int fd = open(pg->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
        pg->err = errno;
        return;
    }
    int err = write_full(fd, header, pg->view.buf, (size_t)pg->view.len);
    if (!err && durable && fsync(fd) < 0) err = errno;
    if (close(fd) < 0 && !err) err = errno;
    if (!err && rename(pg->tmp, pg->path) < 0) err = errno;
    if (err) {
        unlink(pg->tmp);
        pg->err = err;
        return;
    }
    pg->err = durable ? fsync_dir(pg->dir) : 0;
}

PyDoc_STRVAR(write_pages_doc,
             "write_pages(dirs, keys, buffers, namespace_digest, suffix, tmp_tag, durable, /) -> list[int]\n\n"
             "Write each buffer as the page file dirs[i]/keys[i]+suffix (header + payload), atomically: via\n"
             "the temporary file dirs[i]/.keys[i]+tmp_tag, renamed over it; with durable, fsync'ed (file and\n"
             "directory). The group runs with the GIL released. Returns one errno per page (0: written).");

static PyObject *write_pages(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "write_pages() takes 7 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *dirs = args[0], *keys = args[1], *buffers = args[2];
    if (!PyList_Check(dirs) || !PyList_Check(keys) || !PyList_Check(buffers)) {
        PyErr_SetString(PyExc_TypeError, "write_pages: dirs, keys and buffers must be lists");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (PyList_GET_SIZE(dirs) != n || PyList_GET_SIZE(buffers) != n) {
        PyErr_SetString(PyExc_ValueError, "write_pages: dirs, keys and buffers differ in length");
        return NULL;
    }
    Py_buffer ns;
    if (PyObject_GetBuffer(args[3], &ns, PyBUF_SIMPLE) < 0) return NULL;
    if (ns.len != 16) {
        PyBuffer_Release(&ns);
        PyErr_SetString(PyExc_ValueError, "namespace_digest: expected 16 bytes");
        return NULL;
    }
    unsigned char namespace_digest[16];
    memcpy(namespace_digest, ns.buf, 16);
    PyBuffer_Release(&ns);
    const char *suffix = PyUnicode_AsUTF8(args[4]);
    const char *tmp_tag = suffix == NULL ? NULL : PyUnicode_AsUTF8(args[5]);
    int durable = tmp_tag == NULL ? -1 : PyObject_IsTrue(args[6]);
    if (durable < 0) return NULL;

    Page *pages = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Page));
    if (pages == NULL) return PyErr_NoMemory();
    Py_ssize_t got = 0; /* pages whose buffer is held */
    PyObject *result = NULL;
    for (; got < n; got++) {
        Page *pg = &pages[got];
        Py_ssize_t dlen, klen;
        const char *dir = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(dirs, got), &dlen);
        if (dir == NULL) goto done;
        /* The key is kept in the page's path buffer (the GIL is let go of, the list may change). */
        const char *key = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(keys, got), &klen);
        if (key == NULL) goto done;
        int len = snprintf(pg->path, MAX_PATH_BYTES, "%s/%s%s", dir, key, suffix);
        int tlen = snprintf(pg->tmp, MAX_PATH_BYTES, "%s/.%s%s", dir, key, tmp_tag);
        int dl = snprintf(pg->dir, MAX_PATH_BYTES, "%s", dir);
        if (len < 0 || len >= MAX_PATH_BYTES || tlen < 0 || tlen >= MAX_PATH_BYTES || dl >= MAX_PATH_BYTES) {
            PyErr_Format(PyExc_ValueError, "keys[%zd]: the page path is too long", got);
            goto done;
        }
        pg->key = pg->path + dlen + 1;
        pg->key_len = (size_t)klen;
        if (PyObject_GetBuffer(PyList_GET_ITEM(buffers, got), &pg->view, PyBUF_C_CONTIGUOUS) < 0) goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) write_one(&pages[i], namespace_digest, durable);
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    if (result == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *err = PyLong_FromLong(pages[i].err);
        if (err == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, err);
    }
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&pages[i].view);
    PyMem_Free(pages);
    return result;
}

static PyMethodDef methods[] = {
    {"write_pages", (PyCFunction)(void (*)(void))write_pages, METH_FASTCALL, write_pages_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_hicache_write",
    .m_doc = "hicache's storage write path in C: page files written with their header, without the GIL.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__hicache_write(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "HEADER_SIZE", HEADER_SIZE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
