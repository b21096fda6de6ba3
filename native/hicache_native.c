/*
 * _hicache_native: the storage read path of hicache's file backend, in C, with the GIL released.
 *
 * read_pages() reads and verifies a whole batch of pages (page format v2, see
 * storage_backends/page_format.py; each page's name is a hard link to the group file its put wrote, whose
 * footer and table say where in it the page lies: find_page, docs/storage.md) straight into the caller's buffers in one call that releases the GIL for
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
 * 4.1.0 sdist, which builds the same release) and compiled inline (XXH_INLINE_ALL): no library to link. On
 * x86 its dispatcher (xxh_x86dispatch.c, from the same sdist) is compiled in too and the checksums go
 * through it: built for SSE2 only, xxh3-64 ran at a third of the speed AVX-512 gives on our machines.
 * tests/storage/test_native.py checks its digests against python-xxhash's.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <fcntl.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include "xxhash/xxhash.h"
#if defined(__x86_64__) || defined(__i386__) /* as native/xxh_dispatch.c, which compiles it */
/* x86: XXH3_* calls go to xxHash's runtime dispatcher (native/xxhash/xxh_x86dispatch.c), which runs the
   widest vector unit the CPU has (AVX-512, AVX2 or SSE2) while this file is built for the baseline. */
#include "xxhash/xxh_x86dispatch.h"
#endif

/* Outcome codes, one byte per page; storage_backends/file_pages.py names them. */
enum {
    CODE_HIT = 0,          /* read and verified */
    CODE_MISS = 1,         /* the file does not exist */
    CODE_RETRY = 2,        /* something unusual: the caller re-reads the page and names the problem */
    CODE_ERROR = 3,        /* open or read failed (not a missing file): errno in the errors list */
};

/* Bumped whenever the module's interface changes: storage_backends/native.py refuses a build made from an
   older source (a worktree that merged a new hicache_native.c without rebuilding) with an error that says
   to rebuild, instead of failing later on a missing method. */
#define NATIVE_BUILD 9 /* 3: chain_page_keys; 4: job sets (submit's leader); 5: ReadJob.finished;
                          6: READAHEAD, separate from the probe; stat-only RETRY for a path that is no file;
                          7: ReadQueue.call, a job that runs a Python callable;
                          8: one directory level, root/ab/<key>;
                          9: pages in group files (a name per page, hard links to one file per put) */

#define HEADER_SIZE 56
#define CHUNK_BYTES (256 * 1024) /* read then hash this much at a time: stays in L2 between the two */
#define MAX_PATH_BYTES 4096
#define MIN_KEY_CHARS 4
#define MAX_KEY_CHARS 128
#define READAHEAD_PAGES 32 /* files one thread keeps open (and advised) ahead of the page it reads */
/* In read_pages' flags, beside the probe flags: read ahead (a cold batch) instead of one page at a time.
   Above every RWF_* flag, so "read ahead" and "probe" are two bits, and a refused probe drops only its own
   (one flag for both switched read-ahead off for good on the NFS and FUSE mounts that refuse the probe). */
#define READAHEAD_FLAG (1 << 24)

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
    int nowait_flags; /* READAHEAD_FLAG | probe flags (RWF_NOWAIT), or 0: plain reads; the probe flags
                         are dropped when the filesystem refuses them, READAHEAD_FLAG stays */
} read_ctx;

/* The page's path: root/ab/<key><suffix> (PageFiles.path). Returns 0, or -1 if it does not fit. */
static int build_path(const read_ctx *ctx, const char *key, Py_ssize_t key_len, char *out) {
    Py_ssize_t need = ctx->root_len + 4 + key_len + ctx->suffix_len + 1;
    if (key_len < MIN_KEY_CHARS || need > MAX_PATH_BYTES) return -1;
    char *p = out;
    memcpy(p, ctx->root, ctx->root_len);
    p += ctx->root_len;
    *p++ = '/';
    *p++ = key[0];
    *p++ = key[1];
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

/* Group files (native/hicache_write.c, docs/storage.md): pages, then a table of (key digest, offset) entries,
   then a footer (magic "HKVG", version, count, xxh3-64 of the table). */
#define GROUP_VERSION 1
#define ENTRY_SIZE 24
#define FOOTER_SIZE 24

/* pread exactly `len` bytes at `off`: 0, an internal result (WOULD_BLOCK, NOWAIT_UNSUPPORTED) or a code. */
static int pread_exact(int fd, void *buf, size_t len, off_t off, int flags, int *err) {
    struct iovec iov = {buf, len};
    ssize_t got = preadv2_all(fd, &iov, 1, off, flags);
    if (got < 0) {
        if (flags && errno == EAGAIN) return WOULD_BLOCK;
        if (flags && (errno == EOPNOTSUPP || errno == EINVAL)) return NOWAIT_UNSUPPORTED;
        *err = errno;
        return CODE_ERROR;
    }
    if ((size_t)got != len) return flags ? WOULD_BLOCK : CODE_RETRY;
    return 0;
}

/*
 * Find page `digest` in the group file of `size` bytes: its offset and extent (header + payload bytes, up to
 * the next page or the table). Returns 0, or a code/internal result: a file without a whole footer and table
 * whose checksum holds (a torn group, an old one-file page), or without the key in its table, is RETRY.
 */
static int find_page(int fd, off_t size, const unsigned char *digest, int flags, uint64_t *offset,
                     uint64_t *extent, int *err) {
    if (size < FOOTER_SIZE + ENTRY_SIZE) return CODE_RETRY;
    unsigned char footer[FOOTER_SIZE];
    int r = pread_exact(fd, footer, FOOTER_SIZE, size - FOOTER_SIZE, flags, err);
    if (r) return r;
    uint64_t count = load_le64(footer + 8);
    /* each entry names a page of at least a header before the table: a count beyond that is torn, and the
       table's allocation never exceeds what the file's pages could need */
    if (memcmp(footer, "HKVG", 4) != 0 || footer[4] != GROUP_VERSION || footer[5] || footer[6] || footer[7] ||
        count == 0 || count > (uint64_t)(size - FOOTER_SIZE) / (ENTRY_SIZE + HEADER_SIZE))
        return CODE_RETRY;
    size_t table_len = (size_t)count * ENTRY_SIZE;
    uint64_t table_start = (uint64_t)size - FOOTER_SIZE - table_len;
    unsigned char *table = malloc(table_len);
    if (table == NULL) {
        *err = ENOMEM;
        return CODE_ERROR;
    }
    r = pread_exact(fd, table, table_len, (off_t)table_start, flags, err);
    if (!r && XXH3_64bits(table, table_len) != load_le64(footer + 16)) r = CODE_RETRY;
    if (!r) {
        r = CODE_RETRY; /* a key absent from the table */
        for (uint64_t j = 0; j < count; j++) {
            const unsigned char *e = table + j * ENTRY_SIZE;
            if (memcmp(e, digest, 16) != 0) continue;
            uint64_t end = j + 1 < count ? load_le64(e + ENTRY_SIZE + 16) : table_start;
            *offset = load_le64(e + 16);
            if (*offset <= end && end <= table_start) {
                *extent = end - *offset;
                r = 0;
            }
            break;
        }
    }
    free(table);
    return r;
}

/*
 * Read and verify one page from an open group file of `size` bytes; `flags` is 0 or the probe flags
 * (RWF_NOWAIT). The footer and table say where the page is (find_page); a page whose extent is not exactly
 * header + payload is RETRY, never loaded as a hit.
 */
static int read_fd(const read_ctx *ctx, int fd, off_t size, const char *key, Py_ssize_t key_len,
                   unsigned char *buf, Py_ssize_t n, int flags, int *err) {
    XXH128_canonical_t kd;
    XXH128_canonicalFromHash(&kd, XXH3_128bits(key, (size_t)key_len));
    uint64_t base = 0, extent = 0;
    int found = find_page(fd, size, kd.digest, flags, &base, &extent, err);
    if (found) return found;
    if (extent != HEADER_SIZE + (uint64_t)n) return CODE_RETRY;
    unsigned char header[HEADER_SIZE];
    size_t first = n < CHUNK_BYTES ? (size_t)n : CHUNK_BYTES;
    struct iovec iov[2] = {{header, HEADER_SIZE}, {buf, first}};
    ssize_t got = preadv2_all(fd, iov, 2, (off_t)base, flags);
    if (got < 0) {
        if (flags && errno == EAGAIN) return WOULD_BLOCK;
        if (flags && (errno == EOPNOTSUPP || errno == EINVAL)) return NOWAIT_UNSUPPORTED;
        *err = errno;
        return CODE_ERROR;
    }
    if ((size_t)got != HEADER_SIZE + first) return flags ? WOULD_BLOCK : CODE_RETRY;
    /* magic, version 2, no flags, no reserved bits, namespace, key digest, payload length */
    if (memcmp(header, "HKVP", 4) != 0 || header[4] != 2 || header[5] != 0 || header[6] != 0 ||
        header[7] != 0 || memcmp(header + 8, ctx->namespace_digest, 16) != 0 ||
        load_le64(header + 40) != (uint64_t)n || memcmp(header + 24, kd.digest, 16) != 0)
        return CODE_RETRY;

    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    XXH3_64bits_update(&state, buf, first);
    Py_ssize_t off = (Py_ssize_t)first;
    while (off < n) {
        size_t len = (size_t)(n - off) < CHUNK_BYTES ? (size_t)(n - off) : CHUNK_BYTES;
        struct iovec chunk = {buf + off, len};
        ssize_t r = preadv2_all(fd, &chunk, 1, (off_t)(base + HEADER_SIZE + (uint64_t)off), flags);
        if (r < 0 && flags && errno == EAGAIN) return WOULD_BLOCK;
        if (r < 0 && !flags) {
            *err = errno;
            return CODE_ERROR;
        }
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
static int open_page(const read_ctx *ctx, const char *key, Py_ssize_t key_len, struct stat *st, int *err) {
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
    if (fstat(fd, st) < 0 || !S_ISREG(st->st_mode) || fcntl(fd, F_SETFL, 0) < 0) {
        close(fd);
        return NOT_REGULAR;
    }
    return fd;
}

/* The outcome of a page whose open_page failed: NOT_REGULAR goes back to Python, which names it, and so
   does EMFILE/ENFILE: Python re-reads the page once the batch is over and every read thread's read-ahead
   files are closed, so a page fails for want of descriptors only where a plain read would. */
static int open_failure(int fd, int err) {
    if (fd == NOT_REGULAR || err == EMFILE || err == ENFILE) return CODE_RETRY;
    return err == ENOENT ? CODE_MISS : CODE_ERROR;
}

/* Open and read one page. */
static int read_one(const read_ctx *ctx, const char *key, Py_ssize_t key_len, unsigned char *buf,
                    Py_ssize_t n, int flags, int *err) {
    struct stat st;
    int fd = open_page(ctx, key, key_len, &st, err);
    if (fd < 0) return open_failure(fd, *err);
    int code = read_fd(ctx, fd, st.st_size, key, key_len, buf, n, flags, err);
    close(fd);
    return code;
}

/*
 * Descriptors that read threads hold open ahead of the page they read, across every thread of the process,
 * and the most they may: a quarter of the soft RLIMIT_NOFILE, read at each batch. Without the shared bound
 * each thread held READAHEAD_PAGES files whatever the limit (4 threads: 128, against a limit of 64), and
 * cold reads failed with EMFILE where plain reads succeed. A page opened ahead beyond the budget, or whose
 * open fails with EMFILE/ENFILE, is opened again at its own turn (the window shrinks, the read goes on).
 */
static int64_t readahead_held;

static int64_t readahead_budget(void) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) < 0 || rl.rlim_cur == RLIM_INFINITY) return INT32_MAX;
    return (int64_t)(rl.rlim_cur / 4);
}

static int take_readahead_slot(int64_t budget) {
    if (__atomic_add_fetch(&readahead_held, 1, __ATOMIC_RELAXED) <= budget) return 1;
    __atomic_sub_fetch(&readahead_held, 1, __ATOMIC_RELAXED);
    return 0;
}

static void give_readahead_slot(void) { __atomic_sub_fetch(&readahead_held, 1, __ATOMIC_RELAXED); }

/*
 * Without READAHEAD_FLAG, every page is read plainly. With it and a probe flag (RWF_NOWAIT), pages are read
 * with the probe while the page cache holds them (one pass, as fast as a plain read); the first page that
 * would wait for the device switches the rest of the batch to read-ahead: keep the next READAHEAD_PAGES
 * pages open and advised (POSIX_FADV_WILLNEED) ahead of the one being read, so a cold batch keeps the device
 * busy with many reads at once instead of one page at a time, within the process's read-ahead budget (no
 * EMFILE). A filesystem that refuses the probe drops the probe flag only: that batch and every later one
 * read ahead from their first page (READAHEAD_FLAG alone).
 */
static void read_batch(read_ctx *ctx, Py_ssize_t count, const char *const *keys, const Py_ssize_t *key_lens,
                       Py_buffer *views, unsigned char *codes) {
    Py_ssize_t i = 0;
    if (!(ctx->nowait_flags & READAHEAD_FLAG)) {
        /* readahead off: plain blocking reads, no probe, no advice */
        for (; i < count; i++)
            codes[i] = (unsigned char)read_one(ctx, keys[i], key_lens[i], views[i].buf, views[i].len, 0,
                                               &ctx->errnos[i]);
        return;
    }
    int probe = ctx->nowait_flags & ~READAHEAD_FLAG;
    for (; probe && i < count; i++) {
        int code = read_one(ctx, keys[i], key_lens[i], views[i].buf, views[i].len, probe, &ctx->errnos[i]);
        if (code == NOWAIT_UNSUPPORTED) {
            ctx->nowait_flags = READAHEAD_FLAG; /* this filesystem cannot tell: read ahead from now on */
            break;
        }
        if (code == WOULD_BLOCK) break;
        codes[i] = (unsigned char)code;
    }
    int fds[READAHEAD_PAGES];            /* the open file of page k is fds[k % READAHEAD_PAGES] */
    off_t sizes[READAHEAD_PAGES];        /* and its size */
    unsigned char ahead[READAHEAD_PAGES]; /* whether that file holds a read-ahead slot */
    int64_t budget = readahead_budget();
    dev_t advised_dev = 0; /* the group file read ahead last: the batch's next pages are mostly in it */
    ino_t advised_ino = 0;
    Py_ssize_t opened = i;
    for (Py_ssize_t k = i; k < count; k++) {
        for (; opened < count && opened < k + READAHEAD_PAGES; opened++) {
            int slot = opened > k; /* opened before its turn: it holds a slot of the budget */
            if (slot && !take_readahead_slot(budget)) break;
            int *err = &ctx->errnos[opened];
            struct stat st;
            int fd = open_page(ctx, keys[opened], key_lens[opened], &st, err);
            if (fd == -1 && slot && (*err == EMFILE || *err == ENFILE)) {
                *err = 0;
                give_readahead_slot();
                break; /* out of descriptors: this page is opened again at its own turn */
            }
            /* the whole group file, once per file: its table and footer are read first, then the page, and
               the batch's next pages are mostly in the same group (one put's pages are one group) */
            if (fd >= 0) {
                if (st.st_dev != advised_dev || st.st_ino != advised_ino) {
                    (void)posix_fadvise(fd, 0, 0, POSIX_FADV_WILLNEED);
                    advised_dev = st.st_dev;
                    advised_ino = st.st_ino;
                }
            } else if (slot) {
                give_readahead_slot();
                slot = 0;
            }
            fds[opened % READAHEAD_PAGES] = fd;
            sizes[opened % READAHEAD_PAGES] = fd >= 0 ? st.st_size : 0;
            ahead[opened % READAHEAD_PAGES] = (unsigned char)slot;
        }
        int fd = fds[k % READAHEAD_PAGES];
        if (fd < 0) {
            codes[k] = (unsigned char)open_failure(fd, ctx->errnos[k]);
            continue;
        }
        codes[k] = (unsigned char)read_fd(ctx, fd, sizes[k % READAHEAD_PAGES], keys[k], key_lens[k],
                                          views[k].buf, views[k].len, 0, &ctx->errnos[k]);
        close(fd);
        if (ahead[k % READAHEAD_PAGES]) give_readahead_slot();
    }
}

/*
 * ReadJob: one batch of pages to read, with everything the read needs held for its whole life: a reference
 * to every key and a buffer export of every buffer (another thread may change the caller's sequences, or
 * drop them, while a worker reads without the GIL). read_pages() runs one job in the calling thread;
 * ReadQueue runs them in its worker threads. A call job (ReadQueue.call) holds a Python callable instead,
 * which its worker calls with the GIL: every other blocking call of a backend runs in the same threads.
 */
enum { JOB_NEW, JOB_QUEUED, JOB_RUNNING, JOB_DONE, JOB_CANCELLED };

typedef struct ReadJob {
    PyObject_HEAD
    struct ReadJob *next; /* in the queue's pending or done list */
    struct ReadJob *prev; /* in the pending list only: cancel() unlinks a job in O(1) */
    uint64_t queue_id;    /* the generation number of the ReadQueue it was submitted to (0: none) */
    struct ReadJob *leader; /* a strong reference to the first job of its set, or NULL: it leads its own */
    Py_ssize_t set_left;    /* on a set's leader: the set's jobs not finished nor cancelled yet (under mu) */
    int state;            /* JOB_*, changed under the queue's mutex (JOB_DONE: a release store) */
    int stat_only;        /* no buffers: only say which pages exist (up to the first absent one) */
    int is_call;          /* a call job (ReadQueue.call) */
    PyObject *func;       /* a call job's callable (NULL for a read; dropped once called) */
    PyObject *returned, *raised; /* a call job's return value or exception, once it ran */
    read_ctx ctx;
    PyObject *root_obj, *suffix_obj, *ns_obj, *hook;
    Py_ssize_t count, n_keys, n_views;
    PyObject **key_objs;
    const char **keys;
    Py_ssize_t *key_lens;
    Py_buffer *views;
    unsigned char *codes;
    int64_t t_queued, t_started, t_done; /* CLOCK_MONOTONIC ns (0: not yet); ReadJob.times() */
} ReadJob;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static PyTypeObject ReadJobType;

static int job_traverse(ReadJob *job, visitproc visit, void *arg) {
    Py_VISIT(job->hook);
    Py_VISIT(job->leader);
    Py_VISIT(job->func);
    Py_VISIT(job->returned);
    Py_VISIT(job->raised);
    return 0;
}

/* Only the hook and a call's callable and outcome can lead back to the job (keys, root, suffix and namespace
   are str and bytes; a leader is a job): clearing them breaks every cycle. A queued or running job is never
   cleared: the queue's reference to it is visible to the collector only while the queue itself is garbage,
   and then no worker runs it. */
static int job_clear(ReadJob *job) {
    Py_CLEAR(job->hook);
    Py_CLEAR(job->func);
    Py_CLEAR(job->returned);
    Py_CLEAR(job->raised);
    return 0;
}

static void job_dealloc(ReadJob *job) {
    PyObject_GC_UnTrack(job);
    for (Py_ssize_t j = 0; j < job->n_views; j++) PyBuffer_Release(&job->views[j]);
    for (Py_ssize_t j = 0; j < job->n_keys; j++) Py_DECREF(job->key_objs[j]);
    PyMem_Free(job->key_objs);
    PyMem_Free(job->keys);
    PyMem_Free(job->key_lens);
    PyMem_Free(job->views);
    PyMem_Free(job->ctx.errnos);
    PyMem_Free(job->codes);
    Py_XDECREF(job->root_obj);
    Py_XDECREF(job->suffix_obj);
    Py_XDECREF(job->ns_obj);
    Py_XDECREF(job->hook);
    Py_XDECREF(job->leader);
    Py_XDECREF(job->func);
    Py_XDECREF(job->returned);
    Py_XDECREF(job->raised);
    Py_TYPE(job)->tp_free((PyObject *)job);
}

/* A job for read_pages' six arguments (root, suffix, keys, buffers, namespace_digest, nowait_flags), or NULL
   with an exception set. */
/* A job holding nothing yet (untracked by the collector), or NULL with an exception set. */
static ReadJob *job_alloc(void) {
    ReadJob *job = PyObject_GC_New(ReadJob, &ReadJobType);
    if (job == NULL) return NULL;
    job->next = job->prev = NULL;
    job->queue_id = 0;
    job->leader = NULL;
    job->set_left = 0;
    job->state = JOB_NEW;
    job->stat_only = job->is_call = 0;
    job->func = job->returned = job->raised = NULL;
    memset(&job->ctx, 0, sizeof(job->ctx));
    job->root_obj = job->suffix_obj = job->ns_obj = job->hook = NULL;
    job->count = job->n_keys = job->n_views = 0;
    job->key_objs = NULL;
    job->keys = NULL;
    job->key_lens = NULL;
    job->views = NULL;
    job->codes = NULL;
    job->t_queued = job->t_started = job->t_done = 0;
    return job;
}

static ReadJob *job_new(PyObject *const *args) {
    ReadJob *job = job_alloc();
    if (job == NULL) return NULL;
    job->stat_only = args[3] == Py_None;
    PyObject *key_seq = NULL, *buf_seq = NULL;

    job->ctx.root = PyUnicode_AsUTF8AndSize(args[0], &job->ctx.root_len);
    if (job->ctx.root == NULL) goto fail;
    job->root_obj = Py_NewRef(args[0]);
    job->ctx.suffix = PyUnicode_AsUTF8AndSize(args[1], &job->ctx.suffix_len);
    if (job->ctx.suffix == NULL) goto fail;
    job->suffix_obj = Py_NewRef(args[1]);
    /* A NUL would cut every page's path short. */
    if (strlen(job->ctx.root) != (size_t)job->ctx.root_len ||
        strlen(job->ctx.suffix) != (size_t)job->ctx.suffix_len) {
        PyErr_SetString(PyExc_ValueError, "root, suffix: expected no NUL character");
        goto fail;
    }
    if (!PyBytes_Check(args[4]) || PyBytes_GET_SIZE(args[4]) != 16) {
        PyErr_SetString(PyExc_ValueError, "namespace_digest: expected 16 bytes");
        goto fail;
    }
    job->ns_obj = Py_NewRef(args[4]);
    job->ctx.namespace_digest = (const unsigned char *)PyBytes_AS_STRING(args[4]);
    long nowait_flags = PyLong_AsLong(args[5]);
    if (nowait_flags == -1 && PyErr_Occurred()) goto fail;
    job->ctx.nowait_flags = (int)nowait_flags;

    key_seq = PySequence_Fast(args[2], "keys: expected a sequence of str");
    if (key_seq == NULL) goto fail;
    buf_seq = PySequence_Fast(job->stat_only ? args[2] : args[3], "buffers: expected a sequence of buffers");
    if (buf_seq == NULL) goto fail;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(key_seq);
    if (PySequence_Fast_GET_SIZE(buf_seq) != count) {
        PyErr_Format(PyExc_ValueError, "buffers: expected one buffer per key (%zd), got %zd", count,
                     PySequence_Fast_GET_SIZE(buf_seq));
        goto fail;
    }
    job->count = count;
    job->key_objs = PyMem_Malloc(sizeof(PyObject *) * (size_t)(count + 1));
    job->keys = PyMem_Malloc(sizeof(char *) * (size_t)(count + 1));
    job->key_lens = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(count + 1));
    job->views = PyMem_Malloc(sizeof(Py_buffer) * (size_t)(count + 1));
    job->ctx.errnos = PyMem_Calloc((size_t)(count + 1), sizeof(int));
    job->codes = PyMem_Malloc((size_t)(count + 1));
    if (job->key_objs == NULL || job->keys == NULL || job->key_lens == NULL || job->views == NULL ||
        job->ctx.errnos == NULL || job->codes == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (; job->n_keys < count; job->n_keys++) {
        Py_ssize_t k = job->n_keys;
        PyObject *key = PySequence_Fast_GET_ITEM(key_seq, k);
        if (!PyUnicode_Check(key)) {
            PyErr_Format(PyExc_TypeError, "keys[%zd]: expected str, got %.100s", k, Py_TYPE(key)->tp_name);
            goto fail;
        }
        job->keys[k] = PyUnicode_AsUTF8AndSize(key, &job->key_lens[k]);
        if (job->keys[k] == NULL) goto fail;
        if (!is_page_key(job->keys[k], job->key_lens[k])) {
            PyErr_Format(PyExc_ValueError, "keys[%zd]: expected %d-%d lowercase hex characters", k,
                         MIN_KEY_CHARS, MAX_KEY_CHARS);
            goto fail;
        }
        job->key_objs[k] = Py_NewRef(key);
    }
    for (; !job->stat_only && job->n_views < count; job->n_views++) {
        Py_ssize_t k = job->n_views;
        PyObject *buf = PySequence_Fast_GET_ITEM(buf_seq, k);
        if (PyObject_GetBuffer(buf, &job->views[k], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "buffers[%zd]: expected a writable C-contiguous buffer", k);
            goto fail;
        }
    }
    Py_DECREF(key_seq);
    Py_DECREF(buf_seq);
    PyObject_GC_Track(job);
    return job;
fail:
    Py_XDECREF(key_seq);
    Py_XDECREF(buf_seq);
    Py_DECREF(job);
    return NULL;
}

/* Which of a stat-only job's pages exist, up to the first that does not (MISS), is no regular file (RETRY: a
   directory, FIFO, socket or device, symlinks followed, is no page) or cannot be stat-ed (ERROR, with its
   errno); the pages after it are MISS unasked. */
static void stat_batch(ReadJob *job) {
    Py_ssize_t i = 0;
    for (; i < job->count; i++) {
        char path[MAX_PATH_BYTES];
        struct stat st;
        int code = CODE_HIT;
        if (build_path(&job->ctx, job->keys[i], job->key_lens[i], path) < 0) {
            job->ctx.errnos[i] = ENAMETOOLONG;
            code = CODE_ERROR;
        } else if (stat(path, &st) < 0) {
            job->ctx.errnos[i] = errno;
            code = open_failure(-1, errno);
        } else if (!S_ISREG(st.st_mode)) {
            code = CODE_RETRY;
        }
        job->codes[i] = (unsigned char)code;
        if (code != CODE_HIT) break;
    }
    for (i++; i < job->count; i++) job->codes[i] = CODE_MISS;
}

/* Call a call job's callable with the GIL, keep what it returned or raised, and drop the callable (and so
   whatever it held) in the worker, before the job counts as finished. */
static void call_func(ReadJob *job) {
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *returned = PyObject_CallNoArgs(job->func);
    if (returned == NULL) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (value != NULL && tb != NULL) PyException_SetTraceback(value, tb);
        Py_XDECREF(type);
        Py_XDECREF(tb);
        job->raised = value != NULL ? value : Py_NewRef(PyExc_SystemError);
    } else {
        job->returned = returned;
    }
    Py_CLEAR(job->func);
    PyGILState_Release(gil);
}

/* Run a job (no GIL needed: a call job takes it). */
static void job_run(ReadJob *job) {
    if (job->is_call) call_func(job);
    else if (job->stat_only) stat_batch(job);
    else read_batch(&job->ctx, job->count, job->keys, job->key_lens, job->views, job->codes);
}

/* (codes, nowait_flags, [(index, errno) of every ERROR page]) of a job that ran. */
static PyObject *job_outcome(ReadJob *job) {
    PyObject *codes = PyBytes_FromStringAndSize((const char *)job->codes, job->count);
    PyObject *errors = PyList_New(0);
    if (codes == NULL || errors == NULL) goto fail;
    for (Py_ssize_t j = 0; j < job->count; j++) {
        if (job->codes[j] != CODE_ERROR) continue;
        PyObject *item = Py_BuildValue("(ni)", j, job->ctx.errnos[j]);
        if (item == NULL || PyList_Append(errors, item) < 0) {
            Py_XDECREF(item);
            goto fail;
        }
        Py_DECREF(item);
    }
    return Py_BuildValue("(NiN)", codes, job->ctx.nowait_flags, errors);
fail:
    Py_XDECREF(codes);
    Py_XDECREF(errors);
    return NULL;
}

static PyObject *job_result(ReadJob *job, PyObject *unused) {
    (void)unused;
    if (job->state != JOB_DONE) {
        PyErr_SetString(PyExc_RuntimeError, "ReadJob.result(): the job has not run");
        return NULL;
    }
    if (job->raised != NULL) {
        PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(job->raised)), Py_NewRef(job->raised),
                      PyException_GetTraceback(job->raised));
        return NULL;
    }
    if (job->returned != NULL) return Py_NewRef(job->returned);
    return job_outcome(job);
}

static PyObject *job_times(ReadJob *job, PyObject *unused) {
    (void)unused;
    return Py_BuildValue("(LLL)", (long long)job->t_queued, (long long)job->t_started, (long long)job->t_done);
}

static PyMethodDef job_methods[] = {
    {"times", (PyCFunction)job_times, METH_NOARGS,
     "times() -> tuple[int, int, int]\n\nWhen the job was queued, started and finished (time.monotonic_ns();\n"
     "0 for what has not happened yet)."},
    {"result", (PyCFunction)job_result, METH_NOARGS,
     "result() -> tuple[bytes, int, list[tuple[int, int]]]\n\nAs read_pages returns, once the job is done;\n"
     "a call job's: what its callable returned (or raise what it raised)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ReadJobType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_hicache_native.ReadJob",
    .tp_basicsize = sizeof(ReadJob),
    .tp_dealloc = (destructor)job_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)job_traverse,
    .tp_clear = (inquiry)job_clear,
    .tp_free = PyObject_GC_Del,
    .tp_doc = "A batch of pages handed to a ReadQueue (its handle: cancel it, or take its result).",
    .tp_methods = job_methods,
};

PyDoc_STRVAR(read_pages_doc,
             "read_pages(root, suffix, keys, buffers, namespace_digest, nowait_flags, /)\n"
             "    -> tuple[bytes, int, list[tuple[int, int]]]\n\n"
             "Read and verify page files root/ab/<key><suffix> into buffers with the GIL released.\n"
             "nowait_flags: 0 (plain reads), or READAHEAD with any probe flags (RWF_NOWAIT): read ahead\n"
             "from the first page that is not in the page cache (from the first page without a probe).\n"
             "Returns one outcome byte per page (HIT, MISS, RETRY, ERROR), the flags to pass next time\n"
             "(the probe dropped once the filesystem refused it, READAHEAD kept) and (index, errno) of\n"
             "every ERROR page.");

static PyObject *read_pages(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "read_pages() takes 6 arguments (%zd given)", nargs);
        return NULL;
    }
    ReadJob *job = job_new(args);
    if (job == NULL) return NULL;
    Py_BEGIN_ALLOW_THREADS
    job_run(job);
    Py_END_ALLOW_THREADS
    job->state = JOB_DONE;
    PyObject *result = job_outcome(job);
    Py_DECREF(job);
    return result;
}

/*
 * ReadQueue: worker threads that read jobs one after another without ever taking the GIL. A thread calls
 * work() once (a Python thread: the queue does not start threads) and stays in it, the GIL released,
 * taking the next pending job as soon as it finishes one: no event-loop round trip and no GIL hand-off
 * between two jobs (with the loop busy, a thread that needed the GIL back waited up to the 5 ms switch
 * interval per job). A finished job goes to the done list; the queue's eventfd is signalled when the last
 * unfinished job of its set finishes (a set: the jobs submitted with the same leader, one caller's batch),
 * so a batch split over four threads wakes the event loop once, not four times; the loop, watching
 * fileno(), takes every finished job with collect(). cancel() always signals (a cancelled caller's finished
 * jobs must be collected even while another job of its set still reads). A pending job can be cancelled (it never
 * starts); a running one cannot (the caller registers its buffers as a stray thread's until collect()
 * returns it). A job with a hook (tests' stand-in for a hung mount) calls it in the worker, with the GIL,
 * before reading.
 */
typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cv;
    ReadJob *head, *tail;           /* pending, FIFO */
    ReadJob *done_head, *done_tail; /* finished, not collected */
    int efd;
    int closed;
    Py_ssize_t retire; /* workers asked to leave */
    uint64_t id;       /* this queue's generation number: its jobs name it by this, never by address */
} ReadQueue;

static uint64_t next_queue_id = 1; /* under the GIL */

/* The pending and finished jobs it holds (a hook can lead back to the queue). Under the mutex: workers
   change the lists without the GIL (they hold the mutex only briefly, and never wait for the GIL in it). */
static int queue_traverse(ReadQueue *q, visitproc visit, void *arg) {
    int r = 0;
    pthread_mutex_lock(&q->mu);
    ReadJob *lists[2] = {q->head, q->done_head};
    for (int l = 0; l < 2 && r == 0; l++)
        for (ReadJob *job = lists[l]; job != NULL && r == 0; job = job->next) r = visit((PyObject *)job, arg);
    pthread_mutex_unlock(&q->mu);
    return r;
}

/* Close the queue and release its jobs (a garbage queue has no worker: each holds a reference to it). */
static int queue_clear(ReadQueue *q) {
    pthread_mutex_lock(&q->mu);
    ReadJob *lists[2] = {q->head, q->done_head};
    q->head = q->tail = q->done_head = q->done_tail = NULL;
    q->closed = 1;
    pthread_mutex_unlock(&q->mu);
    for (int l = 0; l < 2; l++)
        for (ReadJob *job = lists[l]; job != NULL;) {
            ReadJob *next = job->next;
            /* A caller may still hold the job: it must not name this queue nor point at neighbours freed
               here, and a pending one must not look cancellable. */
            job->next = job->prev = NULL;
            job->queue_id = 0;
            if (job->state == JOB_QUEUED) job->state = JOB_CANCELLED;
            Py_DECREF(job);
            job = next;
        }
    return 0;
}

static void queue_dealloc(ReadQueue *q) {
    PyObject_GC_UnTrack(q);
    queue_clear(q);
    if (q->efd >= 0) close(q->efd);
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->cv);
    Py_TYPE(q)->tp_free((PyObject *)q);
}

static PyObject *queue_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "ReadQueue() takes no arguments");
        return NULL;
    }
    ReadQueue *q = (ReadQueue *)type->tp_alloc(type, 0);
    if (q == NULL) return NULL;
    q->head = q->tail = q->done_head = q->done_tail = NULL;
    q->closed = 0;
    q->retire = 0;
    q->id = next_queue_id++;
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    q->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (q->efd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(q);
        return NULL;
    }
    return (PyObject *)q;
}

static ReadJob *queue_leader(ReadQueue *q, PyObject *arg, int *ok);
static PyObject *queue_enqueue(ReadQueue *q, ReadJob *job, ReadJob *leader);

static PyObject *queue_submit(ReadQueue *q, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 && nargs != 8) {
        PyErr_Format(PyExc_TypeError, "submit() takes 7 or 8 arguments (%zd given)", nargs);
        return NULL;
    }
    int ok;
    ReadJob *leader = queue_leader(q, nargs == 8 ? args[7] : Py_None, &ok);
    if (!ok) return NULL;
    ReadJob *job = job_new(args);
    if (job == NULL) return NULL;
    if (args[6] != Py_None) job->hook = Py_NewRef(args[6]);
    return queue_enqueue(q, job, leader);
}

/* The set leader named by `arg` (None: the job leads its own set), or NULL with an exception set (*ok 0). */
static ReadJob *queue_leader(ReadQueue *q, PyObject *arg, int *ok) {
    *ok = 1;
    if (arg == Py_None) return NULL;
    if (!PyObject_TypeCheck(arg, &ReadJobType) || ((ReadJob *)arg)->queue_id != q->id) {
        PyErr_SetString(PyExc_ValueError, "leader: expected a job submitted to this queue");
        *ok = 0;
        return NULL;
    }
    ReadJob *leader = (ReadJob *)arg;
    return leader->leader != NULL ? leader->leader : leader; /* the set's first job keeps the count */
}

/* Queue `job` (a new reference, handed over) in `leader`'s set; the job, or NULL once the queue closed. */
static PyObject *queue_enqueue(ReadQueue *q, ReadJob *job, ReadJob *leader) {
    pthread_mutex_lock(&q->mu);
    if (q->closed) {
        pthread_mutex_unlock(&q->mu);
        Py_DECREF(job);
        PyErr_SetString(PyExc_RuntimeError, "the queue is closed");
        return NULL;
    }
    if (leader != NULL) {
        job->leader = (ReadJob *)Py_NewRef(leader); /* keeps the count alive while this job is queued */
        leader->set_left++;
    } else {
        job->set_left = 1;
    }
    job->state = JOB_QUEUED;
    job->t_queued = now_ns();
    Py_INCREF(job); /* the queue's reference, handed to collect() */
    job->queue_id = q->id;
    job->prev = q->tail;
    if (q->tail) q->tail->next = job;
    else q->head = job;
    q->tail = job;
    pthread_cond_signal(&q->cv);
    pthread_mutex_unlock(&q->mu);
    return (PyObject *)job;
}

static void signal_loop(ReadQueue *q) {
    uint64_t one = 1;
    while (write(q->efd, &one, sizeof(one)) < 0 && errno == EINTR) {
    }
}

static PyObject *queue_call(ReadQueue *q, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1 && nargs != 2) {
        PyErr_Format(PyExc_TypeError, "call() takes 1 or 2 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!PyCallable_Check(args[0])) {
        PyErr_Format(PyExc_TypeError, "func: expected a callable, got %.100s", Py_TYPE(args[0])->tp_name);
        return NULL;
    }
    int ok;
    ReadJob *leader = queue_leader(q, nargs == 2 ? args[1] : Py_None, &ok);
    if (!ok) return NULL;
    ReadJob *job = job_alloc();
    if (job == NULL) return NULL;
    job->func = Py_NewRef(args[0]);
    job->is_call = 1;
    PyObject_GC_Track(job);
    return queue_enqueue(q, job, leader);
}

static PyObject *queue_cancel(ReadQueue *q, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, &ReadJobType)) {
        PyErr_SetString(PyExc_TypeError, "job: expected a ReadJob");
        return NULL;
    }
    ReadJob *job = (ReadJob *)arg;
    if (job->queue_id != q->id) {
        PyErr_SetString(PyExc_ValueError, "job: expected a job submitted to this queue");
        return NULL;
    }
    int removed = 0;
    pthread_mutex_lock(&q->mu);
    if (job->state == JOB_QUEUED) { /* in the pending list: unlinked through its neighbours, no scan */
        if (job->prev) job->prev->next = job->next;
        else q->head = job->next;
        if (job->next) job->next->prev = job->prev;
        else q->tail = job->prev;
        job->next = job->prev = NULL;
        job->state = JOB_CANCELLED;
        (job->leader ? job->leader : job)->set_left--;
        removed = 1;
    }
    pthread_mutex_unlock(&q->mu);
    /* Finished jobs of this set may wait unsignalled for one still reading: let the loop collect them. */
    signal_loop(q);
    if (removed) Py_DECREF(job); /* the queue's reference */
    return PyBool_FromLong(removed);
}

/* The finished jobs. The list is allocated before any job leaves the done list: on a MemoryError every job
   stays there and the eventfd is signalled again, so a later collect() takes them (dropping them left their
   callers waiting for ever). No allocation under the mutex: a collection it set off could run code that
   takes it (a finaliser closing this queue). */
static PyObject *queue_collect(ReadQueue *q, PyObject *unused) {
    (void)unused;
    uint64_t count;
    while (read(q->efd, &count, sizeof(count)) < 0 && errno == EINTR) {
    }
    Py_ssize_t n = 0;
    pthread_mutex_lock(&q->mu);
    for (ReadJob *job = q->done_head; job != NULL; job = job->next) n++;
    pthread_mutex_unlock(&q->mu);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        signal_loop(q);
        return NULL;
    }
    pthread_mutex_lock(&q->mu); /* take the first n (fewer if a worker leaving a closed queue took some) */
    ReadJob *job = q->done_head;
    Py_ssize_t taken = 0;
    for (ReadJob *last = NULL; taken < n && job != NULL; taken++) {
        last = job;
        job = job->next;
        if (taken + 1 == n || job == NULL) last->next = NULL;
    }
    ReadJob *first = q->done_head;
    q->done_head = job;
    if (job == NULL) q->done_tail = NULL;
    pthread_mutex_unlock(&q->mu);
    for (Py_ssize_t k = 0; k < taken; k++) {
        ReadJob *next = first->next;
        first->next = NULL;
        PyList_SET_ITEM(out, k, (PyObject *)first); /* the queue's reference, handed to the list */
        first = next;
    }
    if (taken < n && PyList_SetSlice(out, taken, n, NULL) < 0) { /* shrinking: never fails in practice */
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static void call_hook(ReadJob *job) {
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *hook = Py_XNewRef(job->hook); /* read under the GIL, as job_clear writes it */
    PyObject *keys = hook != NULL ? PyTuple_New(job->count) : NULL;
    if (keys != NULL) {
        for (Py_ssize_t k = 0; k < job->count; k++) PyTuple_SET_ITEM(keys, k, Py_NewRef(job->key_objs[k]));
        PyObject *r = PyObject_CallOneArg(hook, keys);
        Py_XDECREF(r);
        Py_DECREF(keys);
    }
    if (PyErr_Occurred()) PyErr_WriteUnraisable(hook);
    Py_XDECREF(hook);
    PyGILState_Release(gil);
}

static PyObject *queue_work(ReadQueue *q, PyObject *unused) {
    (void)unused;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        pthread_mutex_lock(&q->mu);
        while (q->head == NULL && !q->closed && q->retire == 0) pthread_cond_wait(&q->cv, &q->mu);
        if (q->retire > 0) {
            q->retire--;
            pthread_mutex_unlock(&q->mu);
            break;
        }
        ReadJob *job = q->head;
        if (job == NULL) { /* closed, nothing pending */
            pthread_mutex_unlock(&q->mu);
            break;
        }
        q->head = job->next;
        if (q->head == NULL) q->tail = NULL;
        else q->head->prev = NULL;
        job->next = NULL;
        job->state = JOB_RUNNING;
        pthread_mutex_unlock(&q->mu);
        job->t_started = now_ns();

        if (job->hook != NULL) call_hook(job);
        job_run(job);
        job->t_done = now_ns();

        pthread_mutex_lock(&q->mu);
        __atomic_store_n(&job->state, JOB_DONE, __ATOMIC_RELEASE); /* ReadJob.finished reads it unlocked */
        if (q->done_tail) q->done_tail->next = job;
        else q->done_head = job;
        q->done_tail = job;
        int last_of_set = --(job->leader ? job->leader : job)->set_left == 0;
        pthread_mutex_unlock(&q->mu);
        if (last_of_set) signal_loop(q);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ReadJob.finished: an acquire load paired with the worker's release store, so a caller that sees True
   also sees every byte the job wrote (and knows it writes no more). Not under the queue's mutex: a collected
   job may outlive its queue (it keeps only the queue's generation number). */
static PyObject *job_get_finished(ReadJob *job, void *closure) {
    (void)closure;
    return PyBool_FromLong(__atomic_load_n(&job->state, __ATOMIC_ACQUIRE) == JOB_DONE);
}

static PyObject *job_get_call(ReadJob *job, void *closure) {
    (void)closure;
    return PyBool_FromLong(job->is_call);
}

static PyGetSetDef job_getset[] = {
    {"call", (getter)job_get_call, NULL, "Whether the job calls a Python callable (ReadQueue.call), not a read.",
     NULL},
    {"finished", (getter)job_get_finished, NULL,
     "Whether a worker finished the job (its buffers are written for good; collect() may not have taken it).",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyObject *queue_retire(ReadQueue *q, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "n: expected >= 0");
        return NULL;
    }
    pthread_mutex_lock(&q->mu);
    q->retire += n;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    Py_RETURN_NONE;
}

static PyObject *queue_close(ReadQueue *q, PyObject *unused) {
    (void)unused;
    pthread_mutex_lock(&q->mu);
    q->closed = 1;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    Py_RETURN_NONE;
}

static PyObject *queue_fileno(ReadQueue *q, PyObject *unused) {
    (void)unused;
    return PyLong_FromLong(q->efd);
}

static PyObject *queue_get_closed(ReadQueue *q, void *closure) {
    (void)closure;
    pthread_mutex_lock(&q->mu);
    int closed = q->closed;
    pthread_mutex_unlock(&q->mu);
    return PyBool_FromLong(closed);
}

static PyMethodDef queue_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))queue_submit, METH_FASTCALL,
     "submit(root, suffix, keys, buffers, namespace_digest, nowait_flags, hook, leader=None, /) -> ReadJob\n\n"
     "Queue a batch as read_pages takes it; hook (or None) is called with the keys in the worker first.\n"
     "buffers=None: only stat the pages, up to the first absent (MISS) or failing (ERROR) one.\n"
     "leader: a job of this queue whose set this one joins: fileno() is signalled once the set's last\n"
     "unfinished job finishes, not once per job."},
    {"call", (PyCFunction)(void (*)(void))queue_call, METH_FASTCALL,
     "call(func, leader=None, /) -> ReadJob\n\nQueue a job that calls func() in a worker, with the GIL;\n"
     "its result() is what func returned (or raises what it raised). leader: as for submit()."},
    {"cancel", (PyCFunction)queue_cancel, METH_O,
     "cancel(job, /) -> bool\n\nRemove a pending job (it never starts): True; False if it started.\n"
     "Signals fileno() either way (finished jobs of its set may be waiting for collect())."},
    {"collect", (PyCFunction)queue_collect, METH_NOARGS,
     "collect() -> list[ReadJob]\n\nThe jobs finished since the last call (and reset fileno())."},
    {"work", (PyCFunction)queue_work, METH_NOARGS,
     "work() -> None\n\nRun pending jobs in this thread, without the GIL, until close() (once nothing is\n"
     "pending) or retire()."},
    {"retire", (PyCFunction)queue_retire, METH_O, "retire(n, /) -> None\n\nAsk n workers to leave work()."},
    {"close", (PyCFunction)queue_close, METH_NOARGS,
     "close() -> None\n\nRefuse new jobs; workers leave work() once nothing is pending."},
    {"fileno", (PyCFunction)queue_fileno, METH_NOARGS,
     "fileno() -> int\n\nAn eventfd readable while finished jobs wait for collect()."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef queue_getset[] = {
    {"closed", (getter)queue_get_closed, NULL, "Whether close() was called.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ReadQueueType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_hicache_native.ReadQueue",
    .tp_basicsize = sizeof(ReadQueue),
    .tp_dealloc = (destructor)queue_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)queue_traverse,
    .tp_clear = (inquiry)queue_clear,
    .tp_free = PyObject_GC_Del,
    .tp_doc = "Worker threads that read page batches one after another without the GIL.",
    .tp_methods = queue_methods,
    .tp_getset = queue_getset,
    .tp_new = queue_new,
};

PyDoc_STRVAR(chain_hashes_doc,
             "chain_hashes(key, step, namespace_digest, prev, /) -> list[bytes]\n\n"
             "One 16-byte xxh3-128 digest per full step-byte page of key: digest(previous page's hash +\n"
             "namespace_digest + the page's bytes), starting from prev; as hicache.keys.chained_page_hashes.");

static PyObject *chain_hashes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "chain_hashes() takes 4 arguments (%zd given)", nargs);
        return NULL;
    }
    Py_ssize_t step = PyLong_AsSsize_t(args[1]);
    if (step == -1 && PyErr_Occurred()) return NULL;
    if (step < 1) {
        PyErr_Format(PyExc_ValueError, "step: expected >= 1, got %zd", step);
        return NULL;
    }
    if (!PyBytes_Check(args[2]) || PyBytes_GET_SIZE(args[2]) != 16) {
        PyErr_SetString(PyExc_ValueError, "namespace_digest: expected 16 bytes");
        return NULL;
    }
    if (!PyBytes_Check(args[3]) || PyBytes_GET_SIZE(args[3]) != 16) {
        PyErr_SetString(PyExc_ValueError, "prev: expected a 16-byte hash");
        return NULL;
    }
    Py_buffer key;
    if (PyObject_GetBuffer(args[0], &key, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t pages = key.len / step;
    PyObject *out = PyList_New(pages);
    if (out == NULL) {
        PyBuffer_Release(&key);
        return NULL;
    }
    const unsigned char *ns = (const unsigned char *)PyBytes_AS_STRING(args[2]);
    XXH128_canonical_t h;
    memcpy(h.digest, PyBytes_AS_STRING(args[3]), 16);
    XXH3_state_t state;
    for (Py_ssize_t i = 0; i < pages; i++) {
        XXH3_128bits_reset(&state);
        XXH3_128bits_update(&state, h.digest, 16);
        XXH3_128bits_update(&state, ns, 16);
        XXH3_128bits_update(&state, (const unsigned char *)key.buf + i * step, (size_t)step);
        XXH128_canonicalFromHash(&h, XXH3_128bits_digest(&state));
        PyObject *digest = PyBytes_FromStringAndSize((const char *)h.digest, 16);
        if (digest == NULL) {
            Py_DECREF(out);
            PyBuffer_Release(&key);
            return NULL;
        }
        PyList_SET_ITEM(out, i, digest);
    }
    PyBuffer_Release(&key);
    return out;
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

/* hicache.keys' page keys (issue 12's loop stall): defined in the block at the end of this file. */
PyDoc_STRVAR(chain_page_keys_doc,
             "chain_page_keys(key, step, namespace_digest, prev, /) -> tuple[list[bytes], list[str]]\n\n"
             "chain_hashes, and each hash's storage key (its 32 lowercase hex digits), aligned; as\n"
             "hicache.keys.chained_page_keys.");
static PyObject *chain_page_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

static PyMethodDef methods[] = {
    {"read_pages", (PyCFunction)(void (*)(void))read_pages, METH_FASTCALL, read_pages_doc},
    {"xxh3_64", xxh3_64, METH_O, xxh3_64_doc},
    {"chain_hashes", (PyCFunction)(void (*)(void))chain_hashes, METH_FASTCALL, chain_hashes_doc},
    {"chain_page_keys", (PyCFunction)(void (*)(void))chain_page_keys, METH_FASTCALL, chain_page_keys_doc},
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
    ReadJobType.tp_getset = job_getset;
    if (PyType_Ready(&ReadJobType) < 0 || PyType_Ready(&ReadQueueType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "ReadJob", (PyObject *)&ReadJobType) < 0 ||
        PyModule_AddObjectRef(m, "ReadQueue", (PyObject *)&ReadQueueType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "HIT", CODE_HIT) < 0 || PyModule_AddIntConstant(m, "MISS", CODE_MISS) < 0 ||
        PyModule_AddIntConstant(m, "RETRY", CODE_RETRY) < 0 || PyModule_AddIntConstant(m, "ERROR", CODE_ERROR) < 0 ||
        PyModule_AddIntConstant(m, "HEADER_SIZE", HEADER_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "CHUNK_BYTES", CHUNK_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "READAHEAD", READAHEAD_FLAG) < 0 ||
        PyModule_AddIntConstant(m, "BUILD", NATIVE_BUILD) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

/* ---------------------------------------------------------------------------------------------------
 * Page keys for hicache.keys.chained_page_keys (issue 12's loop stall). The storage key of a page is its
 * hash in lowercase hex; built here with the hashes, it costs no Python call per page on the event loop.
 * ------------------------------------------------------------------------------------------------- */

static PyObject *chain_page_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    static const char digits[] = "0123456789abcdef";
    PyObject *hashes = chain_hashes(self, args, nargs);
    if (hashes == NULL) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    PyObject *keys = PyList_New(n);
    if (keys == NULL) {
        Py_DECREF(hashes);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *h = (const unsigned char *)PyBytes_AS_STRING(PyList_GET_ITEM(hashes, i));
        PyObject *key = PyUnicode_New(32, 127);
        if (key == NULL) {
            Py_DECREF(hashes);
            Py_DECREF(keys);
            return NULL;
        }
        Py_UCS1 *out = PyUnicode_1BYTE_DATA(key);
        for (int j = 0; j < 16; j++) {
            out[2 * j] = (Py_UCS1)digits[h[j] >> 4];
            out[2 * j + 1] = (Py_UCS1)digits[h[j] & 15];
        }
        PyList_SET_ITEM(keys, i, key);
    }
    PyObject *pair = PyTuple_Pack(2, hashes, keys);
    Py_DECREF(hashes);
    Py_DECREF(keys);
    return pair;
}
