/*
 * _hicache_write: the file backend's write path in C (issue 25), the twin of hicache_native.c's reader.
 *
 * write_group() writes one group of pages (one worker thread's share of a put) as one group file, and gives
 * each page its name by a hard link, the whole group with the GIL released:
 *
 *   1. a temporary file in the root: every page (its 56-byte page header, storage_backends/page_format.py
 *      version 2, computed in the same pass, then its payload), then the table (per page: the xxh3-128 key
 *      digest and the page's offset, u64) and the footer (magic "HKVG", group format version, page count,
 *      xxh3-64 of the table): one create, one writev, one close (docs/storage.md, "Group files");
 *   2. with durable, fsync of the group file;
 *   3. per page, link(tmp, root/ab/<key>.kvp); a name already there (EEXIST) is replaced: a link to a
 *      per-page temporary name, renamed over it (the page there may be an old one-file page, a torn or a
 *      foreign one: skipping it would keep the miss for good, and telling a good one apart costs a read);
 *   4. unlink of the temporary name; with durable, fsync of each page directory.
 *
 * No reader sees half a group: the group file is complete before its first name exists. The filesystem
 * frees the group when its last name goes (delete, or an overwrite). Creating an inode per page was the whole
 * kernel cost of the one-file-per-page layout (BENCHMARKS.md: ~920 us of kernel CPU per page at load 5-10,
 * against ~53 us for a group file per put plus a link per page).
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
#define WRITE_BUILD 2 /* 2: write_group, one group file per call (was write_pages: a file per page) */
#define GROUP_VERSION 1
#define ENTRY_SIZE 24  /* key digest (16) + offset (u64) */
#define FOOTER_SIZE 24 /* magic "HKVG" (4), version (1), reserved (3), count (u64), xxh3-64 of the table */
#define IOV_BATCH 512

typedef struct {
    char path[MAX_PATH_BYTES]; /* the final name, root/ab/<key><suffix> */
    char dir[MAX_PATH_BYTES];  /* root/ab */
    const char *key;           /* points into path */
    size_t key_len;
    Py_buffer view;
    unsigned char header[HEADER_SIZE];
    int err; /* 0: written; else the errno of the step that failed */
} Page;

static void store_le64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static int fsync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return errno;
    int err = fsync(fd) < 0 ? errno : 0;
    close(fd);
    return err;
}

/* Write every iovec fully, in batches, continuing after short writes. Returns 0 or an errno. */
static int writev_full(int fd, struct iovec *iov, size_t count) {
    size_t i = 0;
    while (i < count) {
        size_t batch = count - i < IOV_BATCH ? count - i : IOV_BATCH;
        ssize_t w = writev(fd, iov + i, (int)batch);
        if (w < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        size_t done = (size_t)w;
        while (i < count && done >= iov[i].iov_len) done -= iov[i++].iov_len;
        if (i < count && done) {
            iov[i].iov_base = (char *)iov[i].iov_base + done;
            iov[i].iov_len -= done;
        }
    }
    return 0;
}

static void page_header(Page *pg, const unsigned char *namespace_digest, unsigned char *entry, uint64_t off) {
    unsigned char *h = pg->header;
    memcpy(h, "HKVP", 4);
    h[4] = 2;
    h[5] = h[6] = h[7] = 0;
    memcpy(h + 8, namespace_digest, 16);
    XXH128_canonical_t kd;
    XXH128_canonicalFromHash(&kd, XXH3_128bits(pg->key, pg->key_len));
    memcpy(h + 24, kd.digest, 16);
    store_le64(h + 40, (uint64_t)pg->view.len);
    store_le64(h + 48, (uint64_t)XXH3_64bits(pg->view.buf, (size_t)pg->view.len));
    memcpy(entry, kd.digest, 16);
    store_le64(entry + 16, off);
}

/* Give page `pg` its name: a link to the group file; a name already there is replaced through a per-page
   temporary link renamed over it; an empty directory in its place (exists() counts it absent) is removed;
   a page directory removed behind our back is made again, once. */
static int name_page(Page *pg, const char *tmp, const char *tmp_tag) {
    if (link(tmp, pg->path) == 0) return 0;
    if (errno == ENOENT && mkdir(pg->dir, 0755) == 0 && link(tmp, pg->path) == 0) return 0;
    if (errno != EEXIST) return errno;
    char over[MAX_PATH_BYTES];
    int len = snprintf(over, MAX_PATH_BYTES, "%s/.%s%s", pg->dir, pg->key, tmp_tag);
    if (len < 0 || len >= MAX_PATH_BYTES) return ENAMETOOLONG;
    if (link(tmp, over) < 0) return errno;
    int err = 0;
    if (rename(over, pg->path) < 0) {
        err = errno;
        if (err == EISDIR && rmdir(pg->path) == 0) err = rename(over, pg->path) < 0 ? errno : 0;
    }
    if (err) unlink(over);
    return err;
}

/* The group, without the GIL. */
static void write_all(Page *pages, Py_ssize_t n, const char *tmp, const char *tmp_tag,
                      const unsigned char *namespace_digest, int durable) {
    size_t table_len = (size_t)n * ENTRY_SIZE;
    unsigned char *tail = malloc(table_len + FOOTER_SIZE);
    struct iovec *iov = malloc(sizeof(struct iovec) * (2 * (size_t)n + 1));
    int err = 0;
    if (tail == NULL || iov == NULL) err = ENOMEM;
    int fd = -1;
    if (!err) {
        uint64_t off = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            page_header(&pages[i], namespace_digest, tail + (size_t)i * ENTRY_SIZE, off);
            iov[2 * i] = (struct iovec){pages[i].header, HEADER_SIZE};
            iov[2 * i + 1] = (struct iovec){pages[i].view.buf, (size_t)pages[i].view.len};
            off += HEADER_SIZE + (uint64_t)pages[i].view.len;
        }
        unsigned char *footer = tail + table_len;
        memcpy(footer, "HKVG", 4);
        footer[4] = GROUP_VERSION;
        footer[5] = footer[6] = footer[7] = 0;
        store_le64(footer + 8, (uint64_t)n);
        store_le64(footer + 16, (uint64_t)XXH3_64bits(tail, table_len));
        iov[2 * n] = (struct iovec){tail, table_len + FOOTER_SIZE};
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        if (fd < 0) err = errno;
    }
    if (!err) {
        err = writev_full(fd, iov, 2 * (size_t)n + 1);
        if (!err && durable && fsync(fd) < 0) err = errno;
    }
    if (fd >= 0 && close(fd) < 0 && !err) err = errno;
    free(iov);
    free(tail);
    for (Py_ssize_t i = 0; i < n; i++) pages[i].err = err ? err : name_page(&pages[i], tmp, tmp_tag);
    if (fd >= 0) unlink(tmp);
    if (!durable || err) return;
    unsigned char synced[256] = {0}; /* page directories are root/ab: one flag per first byte */
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *k = pages[i].key;
        unsigned idx = (unsigned)(((k[0] & 0x0f) + (k[0] > '9' ? 9 : 0)) << 4) |
                       (unsigned)((k[1] & 0x0f) + (k[1] > '9' ? 9 : 0));
        if (pages[i].err || synced[idx & 0xff]) continue;
        synced[idx & 0xff] = 1;
        int e = fsync_dir(pages[i].dir);
        if (e) pages[i].err = e;
    }
}

PyDoc_STRVAR(write_group_doc,
             "write_group(root, keys, buffers, namespace_digest, suffix, tmp_tag, durable, /) -> list[int]\n\n"
             "Write the buffers as one group file (pages, table, footer) under the temporary name\n"
             "root/.group+tmp_tag, then link each page's name root/keys[i][:2]/keys[i]+suffix to it (a name\n"
             "already there is replaced) and unlink the temporary name; with durable, the group file is\n"
             "fsync'ed before the first link and each page directory after the last. The directories\n"
             "must exist (one removed behind our back is made again). Runs with the GIL released.\n"
             "Returns one errno per page (0: written).");

static PyObject *write_group(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "write_group() takes 7 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *keys = args[1], *buffers = args[2];
    if (!PyList_Check(keys) || !PyList_Check(buffers)) {
        PyErr_SetString(PyExc_TypeError, "write_group: keys and buffers must be lists");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (PyList_GET_SIZE(buffers) != n) {
        PyErr_SetString(PyExc_ValueError, "write_group: keys and buffers differ in length");
        return NULL;
    }
    Py_ssize_t root_len;
    const char *root = PyUnicode_AsUTF8AndSize(args[0], &root_len);
    if (root == NULL) return NULL;
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
    char tmp[MAX_PATH_BYTES];
    int tl = snprintf(tmp, MAX_PATH_BYTES, "%s/.group%s", root, tmp_tag);
    if (tl < 0 || tl >= MAX_PATH_BYTES) {
        PyErr_SetString(PyExc_ValueError, "root: the group file's path is too long");
        return NULL;
    }

    Page *pages = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Page));
    if (pages == NULL) return PyErr_NoMemory();
    Py_ssize_t got = 0; /* pages whose buffer is held */
    PyObject *result = NULL;
    for (; got < n; got++) {
        Page *pg = &pages[got];
        Py_ssize_t klen;
        /* The key is kept in the page's path buffer (the GIL is let go of, the list may change). */
        const char *key = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(keys, got), &klen);
        if (key == NULL) goto done;
        if (klen < 2) {
            PyErr_Format(PyExc_ValueError, "keys[%zd]: too short", got);
            goto done;
        }
        int len = snprintf(pg->path, MAX_PATH_BYTES, "%s/%.2s/%s%s", root, key, key, suffix);
        int dl = snprintf(pg->dir, MAX_PATH_BYTES, "%s/%.2s", root, key);
        if (len < 0 || len >= MAX_PATH_BYTES || dl < 0 || dl >= MAX_PATH_BYTES) {
            PyErr_Format(PyExc_ValueError, "keys[%zd]: the page path is too long", got);
            goto done;
        }
        pg->key = pg->path + root_len + 4;
        pg->key_len = (size_t)klen;
        if (PyObject_GetBuffer(PyList_GET_ITEM(buffers, got), &pg->view, PyBUF_C_CONTIGUOUS) < 0) goto done;
    }
    if (n > 0) {
        Py_BEGIN_ALLOW_THREADS
        write_all(pages, n, tmp, tmp_tag, namespace_digest, durable);
        Py_END_ALLOW_THREADS
    }
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
    {"write_group", (PyCFunction)(void (*)(void))write_group, METH_FASTCALL, write_group_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_hicache_write",
    .m_doc = "hicache's storage write path in C: a group file of pages, a hard link per page, without the GIL.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__hicache_write(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "HEADER_SIZE", HEADER_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "BUILD", WRITE_BUILD) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
