/* The radix tree's walk in C: following a key down through whole, device-resident nodes.
 *
 * `hicache.tree` keeps its nodes as Python objects (`TreeNode`, a class with __slots__); this module reads and
 * writes their slots directly, at the offsets CPython gives the slots' member descriptors (resolved once by
 * `bind`), so the per-node cost of a walk is a dict lookup and a memcmp instead of some twenty bytecodes.
 * The walk changes no structure: it stops before the first node that needs a split or new values and says
 * which one. The one structural change in C is an insert's new leaf (`add_leaf`, the common end of an insert
 * of a new suffix), which reads and writes the tree's and its leaf set's slots the same way.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Bumped whenever a function's behaviour or signature changes (hicache/tree/node.py checks it). */
#define BUILD 6

static PyTypeObject *node_type = NULL;
/* numpy.empty, numpy.int64 and torch.from_numpy (set by bind): the tree's own index tensors are numpy memory
 * filled here and viewed as tensors (a torch op costs more than the rest of an insert's bookkeeping). */
static PyObject *np_empty = NULL, *np_int64 = NULL, *from_numpy = NULL;
static PyObject *str_is_cpu = NULL, *str_is_contiguous = NULL, *str_data_ptr = NULL, *str_numel = NULL;
static Py_ssize_t off_children, off_key, off_device, off_host, off_pending, off_access, off_hits, off_ref;
static Py_ssize_t off_dev_children;
/* The tree's class, its leaf sets' class and the handle class (set by bind_tree), and their slots add_leaf uses. */
static PyTypeObject *tree_type = NULL, *leafset_type = NULL, *ref_type = NULL;
static PyObject *leaf_maker = NULL, *heappush = NULL;
static Py_ssize_t off_t_ids, off_t_serial, off_t_ctx, off_t_nodes, off_t_device_tokens, off_t_evictable, off_t_leaves,
    off_t_root, off_t_step;
static Py_ssize_t off_l_members, off_l_heap, off_l_seq, off_l_key;

#define SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))

static int slot_offset(PyObject *type, const char *name, Py_ssize_t *out) {
    PyObject *descr = PyDict_GetItemString(((PyTypeObject *)type)->tp_dict, name); /* borrowed */
    if (descr == NULL || Py_TYPE(descr) != &PyMemberDescr_Type) {
        PyErr_Format(PyExc_TypeError, "bind: %s.%s is not a __slots__ member", ((PyTypeObject *)type)->tp_name, name);
        return -1;
    }
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    if (member->type != T_OBJECT_EX || (member->flags & READONLY)) {
        PyErr_Format(PyExc_TypeError, "bind: %s.%s is not a writable object slot", ((PyTypeObject *)type)->tp_name,
                     name);
        return -1;
    }
    *out = member->offset;
    return 0;
}

static PyObject *bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyType_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "bind: expected (node class, numpy.empty, numpy.int64, torch.from_numpy)");
        return NULL;
    }
    PyObject *type = args[0];
    if (slot_offset(type, "children", &off_children) < 0 || slot_offset(type, "key", &off_key) < 0 ||
        slot_offset(type, "device_value", &off_device) < 0 || slot_offset(type, "host_value", &off_host) < 0 ||
        slot_offset(type, "backup_pending", &off_pending) < 0 ||
        slot_offset(type, "last_access", &off_access) < 0 || slot_offset(type, "hit_count", &off_hits) < 0 ||
        slot_offset(type, "_ref", &off_ref) < 0 || slot_offset(type, "_dev_children", &off_dev_children) < 0)
        return NULL;
    if (str_numel == NULL) {
        str_is_cpu = PyUnicode_InternFromString("is_cpu");
        str_is_contiguous = PyUnicode_InternFromString("is_contiguous");
        str_data_ptr = PyUnicode_InternFromString("data_ptr");
        str_numel = PyUnicode_InternFromString("numel");
        if (str_is_cpu == NULL || str_is_contiguous == NULL || str_data_ptr == NULL || str_numel == NULL) return NULL;
    }
    Py_INCREF(type);
    Py_XSETREF(node_type, (PyTypeObject *)type);
    Py_INCREF(args[1]);
    Py_XSETREF(np_empty, args[1]);
    Py_INCREF(args[2]);
    Py_XSETREF(np_int64, args[2]);
    Py_INCREF(args[3]);
    Py_XSETREF(from_numpy, args[3]);
    Py_RETURN_NONE;
}

/* A slot's value (borrowed); NULL with AttributeError when unset. */
static inline PyObject *get_slot(PyObject *node, Py_ssize_t off, const char *name) {
    PyObject *v = SLOT(node, off);
    if (v == NULL) PyErr_Format(PyExc_AttributeError, "node slot %s is unset", name);
    return v;
}

static inline void set_slot(PyObject *node, Py_ssize_t off, PyObject *value) {
    Py_INCREF(value);
    Py_XSETREF(SLOT(node, off), value);
}

PyDoc_STRVAR(walk_doc,
             "walk(node, key, pos, step, tick, last_host, values, backups, backup_hits, /)\n"
             "    -> tuple[int, node, node, node | None, int]\n\n"
             "Follow `key` (page-aligned bytes) from byte `pos` below `node` through children the key covers whole\n"
             "and that hold device data, touching each (last_access = tick). values: a list that gets each passed\n"
             "node's device value, or None. backups: None, or a list: each passed node's hit_count is raised by\n"
             "one, and the handle (_ref) of a node reaching backup_hits (> 0) that is neither backed up nor pending\n"
             "is appended.\n"
             "Stops at a missing child, at the key's end, or before the first child that is matched only in part\n"
             "or holds no device data: returns (pos, node, last_host, stop, matched), where last_host is the\n"
             "deepest passed node with a host value (the given one if none), stop that child (None otherwise)\n"
             "and matched the key bytes of it that match, in whole pages (0 without one).");

static PyObject *walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "walk: expected 9 arguments");
        return NULL;
    }
    if (node_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "walk: bind() was not called");
        return NULL;
    }
    PyObject *node = args[0], *kb = args[1], *last_host = args[5], *values = args[6], *backups = args[7];
    if (!PyBytes_CheckExact(kb)) {
        PyErr_SetString(PyExc_TypeError, "walk: key must be bytes");
        return NULL;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[2]), step = PyLong_AsSsize_t(args[3]);
    Py_ssize_t backup_hits = PyLong_AsSsize_t(args[8]);
    if ((pos == -1 || step == -1 || backup_hits == -1) && PyErr_Occurred()) return NULL;
    PyObject *tick = args[4];
    if (Py_TYPE(node) != node_type || Py_TYPE(last_host) != node_type) {
        PyErr_SetString(PyExc_TypeError, "walk: expected tree nodes");
        return NULL;
    }
    if ((values != Py_None && !PyList_CheckExact(values)) || (backups != Py_None && !PyList_CheckExact(backups))) {
        PyErr_SetString(PyExc_TypeError, "walk: values and backups must be lists or None");
        return NULL;
    }
    const char *k = PyBytes_AS_STRING(kb);
    Py_ssize_t end = PyBytes_GET_SIZE(kb);
    if (step <= 0 || pos < 0 || pos > end || (end - pos) % step) {
        PyErr_SetString(PyExc_ValueError, "walk: the key from pos must be a whole number of pages");
        return NULL;
    }
    PyObject *stop = Py_None;
    Py_ssize_t matched = 0;
    while (pos < end) {
        PyObject *children = get_slot(node, off_children, "children");
        if (children == NULL) return NULL;
        if (!PyDict_CheckExact(children)) {
            PyErr_SetString(PyExc_TypeError, "walk: a node's children must be a dict");
            return NULL;
        }
        PyObject *first = PyBytes_FromStringAndSize(k + pos, step);
        if (first == NULL) return NULL;
        PyObject *child = PyDict_GetItemWithError(children, first); /* borrowed */
        Py_DECREF(first);
        if (child == NULL) {
            if (PyErr_Occurred()) return NULL;
            break;
        }
        if (Py_TYPE(child) != node_type) {
            PyErr_SetString(PyExc_TypeError, "walk: a child that is not a tree node");
            return NULL;
        }
        PyObject *ck = get_slot(child, off_key, "key");
        if (ck == NULL) return NULL;
        if (!PyBytes_CheckExact(ck)) {
            PyErr_SetString(PyExc_TypeError, "walk: a node key must be bytes");
            return NULL;
        }
        Py_ssize_t clen = PyBytes_GET_SIZE(ck);
        const char *c = PyBytes_AS_STRING(ck);
        PyObject *dv = get_slot(child, off_device, "device_value");
        if (dv == NULL) return NULL;
        if (clen > end - pos || memcmp(k + pos, c, (size_t)clen) != 0 || dv == Py_None) {
            /* Matched in part (in whole pages: the first is known to match) or not on the device. */
            Py_ssize_t lim = clen < end - pos ? clen : end - pos, i = step;
            while (i < lim && memcmp(k + pos + i, c + i, (size_t)step) == 0) i += step;
            stop = child;
            matched = i;
            break;
        }
        set_slot(child, off_access, tick);
        if (values != Py_None && PyList_Append(values, dv) < 0) return NULL;
        PyObject *hv = get_slot(child, off_host, "host_value");
        if (hv == NULL) return NULL;
        if (hv != Py_None) last_host = child;
        if (backups != Py_None) {
            PyObject *hits = get_slot(child, off_hits, "hit_count");
            if (hits == NULL) return NULL;
            Py_ssize_t h = PyLong_AsSsize_t(hits);
            if (h == -1 && PyErr_Occurred()) return NULL;
            PyObject *nh = PyLong_FromSsize_t(h + 1);
            if (nh == NULL) return NULL;
            Py_XSETREF(SLOT(child, off_hits), nh);
            if (backup_hits > 0 && h + 1 >= backup_hits && hv == Py_None) {
                PyObject *pv = get_slot(child, off_pending, "backup_pending");
                if (pv == NULL) return NULL;
                if (pv == Py_None) {
                    PyObject *ref = get_slot(child, off_ref, "_ref");
                    if (ref == NULL || PyList_Append(backups, ref) < 0) return NULL;
                }
            }
        }
        pos += clen;
        node = child;
    }
    PyObject *out = PyTuple_New(5);
    if (out == NULL) return NULL;
    PyObject *p = PyLong_FromSsize_t(pos), *m = PyLong_FromSsize_t(matched);
    if (p == NULL || m == NULL) {
        Py_XDECREF(p);
        Py_XDECREF(m);
        Py_DECREF(out);
        return NULL;
    }
    Py_INCREF(node);
    Py_INCREF(last_host);
    Py_INCREF(stop);
    PyTuple_SET_ITEM(out, 0, p);
    PyTuple_SET_ITEM(out, 1, node);
    PyTuple_SET_ITEM(out, 2, last_host);
    PyTuple_SET_ITEM(out, 3, stop);
    PyTuple_SET_ITEM(out, 4, m);
    return out;
}


/* ---------------------------------------------------------------- an insert's new leaf */

PyDoc_STRVAR(bind_tree_doc,
             "bind_tree(tree_class, leaf_set_class, ref_class, leaf_maker, heappush, /) -> None\n\n"
             "Resolve the slots add_leaf uses of the tree's class and its leaf sets' class, and keep the handle\n"
             "class (a tuple subclass), the maker of a new leaf (new_leaf) and heapq.heappush (once).");

static PyObject *bind_tree(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyType_Check(args[0]) || !PyType_Check(args[1]) || !PyType_Check(args[2]) ||
        !PyType_IsSubtype((PyTypeObject *)args[2], &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError,
                        "bind_tree: expected (tree class, leaf set class, handle class, leaf maker, heappush)");
        return NULL;
    }
    PyObject *t = args[0], *l = args[1];
    if (slot_offset(t, "_ids", &off_t_ids) < 0 || slot_offset(t, "_serial", &off_t_serial) < 0 ||
        slot_offset(t, "_ctx", &off_t_ctx) < 0 || slot_offset(t, "_nodes", &off_t_nodes) < 0 ||
        slot_offset(t, "_device_tokens", &off_t_device_tokens) < 0 ||
        slot_offset(t, "_evictable_size", &off_t_evictable) < 0 ||
        slot_offset(t, "_device_leaves", &off_t_leaves) < 0 || slot_offset(t, "_root", &off_t_root) < 0 ||
        slot_offset(t, "_step", &off_t_step) < 0 || slot_offset(l, "members", &off_l_members) < 0 ||
        slot_offset(l, "_heap", &off_l_heap) < 0 || slot_offset(l, "_seq", &off_l_seq) < 0 ||
        slot_offset(l, "_key", &off_l_key) < 0)
        return NULL;
    for (int i = 0; i < 5; i++) Py_INCREF(args[i]);
    Py_XSETREF(tree_type, (PyTypeObject *)t);
    Py_XSETREF(leafset_type, (PyTypeObject *)l);
    Py_XSETREF(ref_type, (PyTypeObject *)args[2]);
    Py_XSETREF(leaf_maker, args[3]);
    Py_XSETREF(heappush, args[4]);
    Py_RETURN_NONE;
}

/* `*slot += delta` for a slot holding an int. */
static int add_to_slot(PyObject *obj, Py_ssize_t off, Py_ssize_t delta, const char *name) {
    PyObject *v = get_slot(obj, off, name);
    if (v == NULL) return -1;
    Py_ssize_t x = PyLong_AsSsize_t(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    PyObject *nv = PyLong_FromSsize_t(x + delta);
    if (nv == NULL) return -1;
    Py_XSETREF(SLOT(obj, off), nv);
    return 0;
}

PyDoc_STRVAR(add_leaf_doc,
             "add_leaf(tree, parent, key, pos, value, tick, backups, backup_hits, /) -> node\n\n"
             "An insert's new device leaf below `parent` (a device node or the root, which has no child for the\n"
             "page of `key` at byte `pos`), made and counted in C: it holds key[pos:] and `value` (the tree's copy\n"
             "of its device indices), last_access = tick and one hit (none under backup_hits None). It goes into\n"
             "the parent's children and the tree's node table; the tree's device and evictable token counts grow\n"
             "by its tokens; the parent's device child count by one (a parent that was an evictable device leaf\n"
             "stops being one); its handle is appended to `backups` when backup_hits is 1; and it joins the\n"
             "tree's evictable device leaves (as LeafSet.push: a heap entry keyed by the set's key function).\n"
             "What `RadixTree._new_node` and `_set_device` do, for the one case an insert of a new suffix needs.");

static PyObject *add_leaf(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "add_leaf: expected 8 arguments");
        return NULL;
    }
    if (tree_type == NULL || node_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "add_leaf: bind() and bind_tree() were not called");
        return NULL;
    }
    PyObject *tree = args[0], *parent = args[1], *kb = args[2], *value = args[4], *tick = args[5];
    PyObject *backups = args[6], *backup_hits = args[7];
    if (Py_TYPE(tree) != tree_type || Py_TYPE(parent) != node_type || !PyBytes_CheckExact(kb) ||
        !PyList_CheckExact(backups) || !PyLong_CheckExact(tick)) {
        PyErr_SetString(PyExc_TypeError, "add_leaf: expected (tree, node, bytes, int, value, int, list, int | None)");
        return NULL;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[3]);
    if (pos == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t hits_at = 0; /* 0: never at insert */
    if (backup_hits != Py_None) {
        hits_at = PyLong_AsSsize_t(backup_hits);
        if (hits_at == -1 && PyErr_Occurred()) return NULL;
    }
    PyObject *step_o = get_slot(tree, off_t_step, "_step");
    if (step_o == NULL) return NULL;
    Py_ssize_t step = PyLong_AsSsize_t(step_o), end = PyBytes_GET_SIZE(kb);
    if (step == -1 && PyErr_Occurred()) return NULL;
    if (step <= 0 || pos < 0 || pos >= end || (end - pos) % step) {
        PyErr_SetString(PyExc_ValueError, "add_leaf: the key from pos must be one or more whole pages");
        return NULL;
    }
    PyObject *leaves = get_slot(tree, off_t_leaves, "_device_leaves");
    PyObject *nodes = get_slot(tree, off_t_nodes, "_nodes");
    PyObject *children = get_slot(parent, off_children, "children");
    PyObject *root = get_slot(tree, off_t_root, "_root");
    PyObject *ids = get_slot(tree, off_t_ids, "_ids"), *serial = get_slot(tree, off_t_serial, "_serial");
    PyObject *ctx = get_slot(tree, off_t_ctx, "_ctx");
    if (leaves == NULL || nodes == NULL || children == NULL || root == NULL || ids == NULL || serial == NULL ||
        ctx == NULL)
        return NULL;
    if (Py_TYPE(leaves) != leafset_type || !PyDict_CheckExact(nodes) || !PyDict_CheckExact(children)) {
        PyErr_SetString(PyExc_TypeError, "add_leaf: a tree field of the wrong type");
        return NULL;
    }
    PyObject *members = get_slot(leaves, off_l_members, "members"), *heap = get_slot(leaves, off_l_heap, "_heap");
    PyObject *keyfn = get_slot(leaves, off_l_key, "_key");
    if (members == NULL || heap == NULL || keyfn == NULL) return NULL;
    if (!PySet_CheckExact(members) || !PyList_CheckExact(heap)) {
        PyErr_SetString(PyExc_TypeError, "add_leaf: a leaf set field of the wrong type");
        return NULL;
    }
    /* Everything that can fail short of memory first; then the changes. */
    PyObject *nid = NULL, *ref = NULL, *lkey = NULL, *leaf = NULL, *first = NULL, *sort_key = NULL, *seq = NULL;
    PyObject *entry = NULL, *res = NULL;
    const char *k = PyBytes_AS_STRING(kb);
    nid = PyIter_Next(ids);
    if (nid == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "add_leaf: the node ids ran out");
        goto fail;
    }
    ref = ref_type->tp_alloc(ref_type, 2);
    if (ref == NULL) goto fail;
    Py_INCREF(serial);
    PyTuple_SET_ITEM(ref, 0, serial);
    Py_INCREF(nid);
    PyTuple_SET_ITEM(ref, 1, nid);
    if (pos) {
        lkey = PyBytes_FromStringAndSize(k + pos, end - pos);
        if (lkey == NULL) goto fail;
    } else {
        Py_INCREF(kb);
        lkey = kb;
    }
    PyObject *hits = PyLong_FromLong(hits_at ? 1 : 0);
    if (hits == NULL) goto fail;
    PyObject *margs[8] = {nid, parent, lkey, ctx, ref, value, tick, hits};
    leaf = PyObject_Vectorcall(leaf_maker, margs, 8, NULL);
    Py_DECREF(hits);
    if (leaf == NULL) goto fail;
    if (Py_TYPE(leaf) != node_type) {
        PyErr_SetString(PyExc_TypeError, "add_leaf: the leaf maker made something else");
        goto fail;
    }
    first = PyBytes_FromStringAndSize(k + pos, step);
    if (first == NULL) goto fail;
    sort_key = PyObject_CallOneArg(keyfn, leaf);
    if (sort_key == NULL) goto fail;
    PyObject *seq_o = get_slot(leaves, off_l_seq, "_seq");
    if (seq_o == NULL) goto fail;
    Py_ssize_t seq_n = PyLong_AsSsize_t(seq_o);
    if (seq_n == -1 && PyErr_Occurred()) goto fail;
    seq = PyLong_FromSsize_t(seq_n + 1);
    if (seq == NULL) goto fail;
    entry = PyTuple_Pack(4, sort_key, nid, seq, leaf);
    if (entry == NULL) goto fail;
    int has = PyDict_Contains(children, first);
    if (has) {
        if (has > 0) PyErr_SetString(PyExc_ValueError, "add_leaf: the parent has a child for that page already");
        goto fail;
    }
    /* The changes. */
    if (PyDict_SetItem(children, first, leaf) < 0 || PyDict_SetItem(nodes, nid, leaf) < 0) goto fail;
    Py_ssize_t n = (end - pos) >> 3;
    if (add_to_slot(tree, off_t_device_tokens, n, "_device_tokens") < 0 ||
        add_to_slot(tree, off_t_evictable, n, "_evictable_size") < 0 ||
        add_to_slot(parent, off_dev_children, 1, "_dev_children") < 0)
        goto fail;
    PyObject *dc = SLOT(parent, off_dev_children);
    if (parent != root && PyLong_AsSsize_t(dc) == 1 && PySet_Discard(members, parent) < 0) goto fail;
    /* Its first device child: the parent (a device node, as every node on an insert's path is) stops
     * being an evictable device leaf; with device children already, it was none. */
    if (hits_at == 1 && PyList_Append(backups, ref) < 0) goto fail;
    if (PySet_Add(members, leaf) < 0) goto fail;
    Py_INCREF(seq);
    Py_XSETREF(SLOT(leaves, off_l_seq), seq);
    PyObject *hargs[2] = {heap, entry};
    res = PyObject_Vectorcall(heappush, hargs, 2, NULL);
    if (res == NULL) goto fail;
    Py_DECREF(res);
    if (PyList_GET_SIZE(heap) > 2 * PySet_GET_SIZE(members) + 64) {
        res = PyObject_CallMethod(leaves, "_compact", NULL);
        if (res == NULL) goto fail;
        Py_DECREF(res);
    }
    Py_DECREF(nid);
    Py_DECREF(ref);
    Py_DECREF(lkey);
    Py_DECREF(first);
    Py_DECREF(sort_key);
    Py_DECREF(seq);
    Py_DECREF(entry);
    return leaf;
fail:
    Py_XDECREF(nid);
    Py_XDECREF(ref);
    Py_XDECREF(lkey);
    Py_XDECREF(leaf);
    Py_XDECREF(first);
    Py_XDECREF(sort_key);
    Py_XDECREF(seq);
    Py_XDECREF(entry);
    return NULL;
}

PyDoc_STRVAR(all_hashes_doc,
             "all_hashes(hashes, /) -> bool\n\n"
             "Whether every item of the list `hashes` is a bytes object (exactly) of 16 bytes: a refill's page\n"
             "hashes checked in one pass (a Python test per hash cost ~50 us per 1,024 pages).");

static PyObject *all_hashes(PyObject *self, PyObject *hashes) {
    if (!PyList_Check(hashes)) {
        PyErr_SetString(PyExc_TypeError, "all_hashes: expected a list");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyList_GET_ITEM(hashes, i);
        if (!PyBytes_CheckExact(h) || PyBytes_GET_SIZE(h) != 16) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* ---------------------------------------------------------------- index copies */

/* A new int64 tensor of `n` elements over numpy memory, its buffer in `*view` (released by the caller after
 * filling it), or NULL with an exception. */
static PyObject *new_indices(Py_ssize_t n, PyObject **array, Py_buffer *view) {
    if (np_empty == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "bind() was not called");
        return NULL;
    }
    PyObject *len = PyLong_FromSsize_t(n);
    if (len == NULL) return NULL;
    PyObject *argv[2] = {len, np_int64};
    PyObject *arr = PyObject_Vectorcall(np_empty, argv, 2, NULL);
    Py_DECREF(len);
    if (arr == NULL) return NULL;
    if (PyObject_GetBuffer(arr, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    if (view->len != 8 * n) {
        PyBuffer_Release(view);
        Py_DECREF(arr);
        PyErr_SetString(PyExc_ValueError, "new_indices: numpy.empty gave a buffer of the wrong size");
        return NULL;
    }
    *array = arr;
    return arr;
}

/* `arr` (a filled numpy array, stolen) viewed as a tensor. */
static PyObject *as_tensor(PyObject *arr) {
    PyObject *t = PyObject_CallOneArg(from_numpy, arr);
    Py_DECREF(arr);
    return t;
}

PyDoc_STRVAR(copy_out_doc,
             "copy_out(src_address, n, /) -> torch.Tensor\n\n"
             "A new int64 tensor (numpy memory) holding the `n` int64 values at the CPU address `src_address` (a\n"
             "contiguous CPU int64 tensor's data_ptr() plus an offset, read by the caller, which keeps the tensor\n"
             "alive and checked it: CPU, contiguous, at least that long). The tree's own copy of a caller's indices.");

static PyObject *copy_out(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "copy_out: expected 2 arguments");
        return NULL;
    }
    void *src = PyLong_AsVoidPtr(args[0]);
    if (src == NULL && PyErr_Occurred()) return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0 || (n && src == NULL)) {
        PyErr_SetString(PyExc_ValueError, "copy_out: a negative length or a null address");
        return NULL;
    }
    PyObject *arr;
    Py_buffer view;
    if (new_indices(n, &arr, &view) == NULL) return NULL;
    memcpy(view.buf, src, (size_t)(8 * n));
    PyBuffer_Release(&view);
    return as_tensor(arr);
}

/* A part's data address and length if it is a contiguous CPU tensor (1), else 0; -1 with an exception. */
static int cpu_part(PyObject *part, void **addr, Py_ssize_t *n) {
    PyObject *cpu = PyObject_GetAttr(part, str_is_cpu);
    if (cpu == NULL) return -1;
    int ok = cpu == Py_True;
    Py_DECREF(cpu);
    if (!ok) return 0;
    PyObject *cont = PyObject_CallMethodNoArgs(part, str_is_contiguous);
    if (cont == NULL) return -1;
    ok = cont == Py_True;
    Py_DECREF(cont);
    if (!ok) return 0;
    PyObject *ptr = PyObject_CallMethodNoArgs(part, str_data_ptr);
    if (ptr == NULL) return -1;
    *addr = PyLong_AsVoidPtr(ptr);
    Py_DECREF(ptr);
    if (*addr == NULL && PyErr_Occurred()) return -1;
    PyObject *numel = PyObject_CallMethodNoArgs(part, str_numel);
    if (numel == NULL) return -1;
    *n = PyLong_AsSsize_t(numel);
    Py_DECREF(numel);
    if (*n == -1 && PyErr_Occurred()) return -1;
    return 1;
}

#define JOIN_MAX 64

PyDoc_STRVAR(join_doc,
             "join(parts, /) -> torch.Tensor | None\n\n"
             "The 1-D int64 tensors `parts` (a tuple or list) joined into one new tensor (numpy memory), or None\n"
             "when a part is not a contiguous CPU tensor or there are more than 64 parts (the caller then joins\n"
             "them with torch.cat). The caller checked the dtype and dimensions.");

static PyObject *join(PyObject *self, PyObject *parts) {
    PyObject *seq = PySequence_Fast(parts, "join: expected a tuple or list of tensors");
    if (seq == NULL) return NULL;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    if (k > JOIN_MAX) {
        Py_DECREF(seq);
        Py_RETURN_NONE;
    }
    void *addrs[JOIN_MAX];
    Py_ssize_t lens[JOIN_MAX], total = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        int r = cpu_part(PySequence_Fast_GET_ITEM(seq, i), &addrs[i], &lens[i]);
        if (r <= 0) {
            Py_DECREF(seq);
            if (r < 0) return NULL;
            Py_RETURN_NONE;
        }
        if (lens[i] && addrs[i] == NULL) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "join: a part with a null address");
            return NULL;
        }
        total += lens[i];
    }
    PyObject *arr;
    Py_buffer view;
    if (new_indices(total, &arr, &view) == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    char *dst = view.buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        memcpy(dst, addrs[i], (size_t)(8 * lens[i]));
        dst += 8 * lens[i];
    }
    PyBuffer_Release(&view);
    Py_DECREF(seq); /* the parts (and their memory) stayed alive through the copy */
    return as_tensor(arr);
}

/* ---------------------------------------------------------------- page runs */

PyDoc_STRVAR(page_runs_doc,
             "page_runs(tokens, out, page_size, num_pages, /) -> int\n\n"
             "Check that the token indices `tokens` (a C-contiguous int64 buffer) are whole runs\n"
             "[p * page_size, p * page_size + page_size) with 0 <= p < num_pages, writing each run's page id p\n"
             "into `out` (a writable int64 buffer of len(tokens) // page_size entries). Returns 0, or why not:\n"
             "1 the length is not a multiple of page_size, 2 a run is misaligned or not consecutive, 3 a page\n"
             "is out of range (2 wins over 3; `out` is then partly written). A pool allocator's validation of\n"
             "the indices it is given back, in one pass.");

static PyObject *page_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "page_runs: expected 4 arguments");
        return NULL;
    }
    long long page_size = PyLong_AsLongLong(args[2]);
    if (page_size == -1 && PyErr_Occurred()) return NULL;
    long long num_pages = PyLong_AsLongLong(args[3]);
    if (num_pages == -1 && PyErr_Occurred()) return NULL;
    if (page_size < 1 || num_pages < 0) {
        PyErr_SetString(PyExc_ValueError, "page_runs: page_size must be >= 1 and num_pages >= 0");
        return NULL;
    }
    Py_buffer in, out;
    if (PyObject_GetBuffer(args[0], &in, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&in);
        return NULL;
    }
    long code = 0;
    Py_ssize_t n = in.len / 8;
    if (in.len % 8 || out.len % 8) {
        PyErr_SetString(PyExc_ValueError, "page_runs: buffers of int64 expected");
        code = -1;
    } else if (n % page_size) {
        code = 1;
    } else if (out.len / 8 != n / page_size) {
        PyErr_SetString(PyExc_ValueError, "page_runs: `out` must hold one entry per run");
        code = -1;
    } else {
        const int64_t *t = in.buf;
        int64_t *pages = out.buf;
        Py_ssize_t runs = n / page_size;
        int misaligned = 0, outside = 0;
        for (Py_ssize_t r = 0; r < runs && !misaligned; r++) {
            const int64_t *run = t + r * page_size;
            int64_t start = run[0];
            /* Floor division, as the Python check it replaces: a negative start is misaligned unless it
             * is a multiple, and then its page is out of range. */
            int64_t p = start / page_size;
            if (start % page_size) {
                misaligned = 1;
                break;
            }
            for (long long j = 1; j < page_size; j++) {
                if (run[j] != start + j) {
                    misaligned = 1;
                    break;
                }
            }
            if (p < 0 || p >= num_pages) outside = 1;
            pages[r] = p;
        }
        code = misaligned ? 2 : outside ? 3 : 0;
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&in);
    if (code < 0) return NULL;
    return PyLong_FromLong(code);
}

/* ---------------------------------------------------------------- records made without __init__ */

/* A maker builds instances of one __slots__ class: the positional arguments fill `fields` in order, every
 * other named slot gets its default (the `dict` type as a default means a fresh empty dict). It costs a
 * fraction of a Python __init__ that assigns the same slots one bytecode at a time. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyTypeObject *cls;
    Py_ssize_t nfields, ndefaults;
    Py_ssize_t *offsets;   /* nfields + ndefaults */
    PyObject **defaults;   /* ndefaults, owned */
} Maker;

static void maker_dealloc(Maker *m) {
    for (Py_ssize_t i = 0; i < m->ndefaults; i++) Py_XDECREF(m->defaults[i]);
    PyMem_Free(m->defaults);
    PyMem_Free(m->offsets);
    Py_XDECREF(m->cls);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyObject *maker_call(Maker *m, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != m->nfields || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_Format(PyExc_TypeError, "%s maker: expected %zd positional arguments, got %zd", m->cls->tp_name,
                     m->nfields, nargs);
        return NULL;
    }
    PyObject *obj = m->cls->tp_alloc(m->cls, 0);
    if (obj == NULL) return NULL;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        Py_INCREF(args[i]);
        SLOT(obj, m->offsets[i]) = args[i];
    }
    for (Py_ssize_t i = 0; i < m->ndefaults; i++) {
        PyObject *d = m->defaults[i];
        PyObject *v = d == (PyObject *)&PyDict_Type ? PyDict_New() : (Py_INCREF(d), d);
        if (v == NULL) {
            Py_DECREF(obj);
            return NULL;
        }
        SLOT(obj, m->offsets[m->nfields + i]) = v;
    }
    return obj;
}

static PyObject *maker_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return maker_call((Maker *)self, args, nargsf, kwnames);
}

static PyTypeObject MakerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_hicache_tree.Maker",
    .tp_basicsize = sizeof(Maker),
    .tp_dealloc = (destructor)maker_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Maker, vectorcall),
    .tp_doc = "A maker of one __slots__ class's instances (see maker()).",
};

PyDoc_STRVAR(maker_doc,
             "maker(cls, fields, defaults, /) -> Callable[..., cls]\n\n"
             "A constructor of `cls` (a class with __slots__) that skips __init__: its positional arguments fill\n"
             "the slots named in `fields` (a tuple of names), in order; each slot named in `defaults` (a dict)\n"
             "gets its value there, the `dict` type meaning a fresh empty dict. Every name must be a writable\n"
             "object slot of `cls`.");

static PyObject *make_maker(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyType_Check(args[0]) || !PyTuple_Check(args[1]) || !PyDict_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "maker: expected (cls, tuple of field names, dict of defaults)");
        return NULL;
    }
    PyObject *cls = args[0], *fields = args[1], *defaults = args[2];
    Py_ssize_t nf = PyTuple_GET_SIZE(fields), nd = PyDict_GET_SIZE(defaults);
    Maker *m = PyObject_New(Maker, &MakerType);
    if (m == NULL) return NULL;
    m->cls = NULL;
    m->nfields = nf;
    m->ndefaults = 0;
    m->offsets = PyMem_Calloc((size_t)(nf + nd + 1), sizeof(Py_ssize_t));
    m->defaults = PyMem_Calloc((size_t)(nd + 1), sizeof(PyObject *));
    m->vectorcall = maker_vectorcall;
    if (m->offsets == NULL || m->defaults == NULL) {
        Py_DECREF(m);
        return PyErr_NoMemory();
    }
    Py_INCREF(cls);
    m->cls = (PyTypeObject *)cls;
    for (Py_ssize_t i = 0; i < nf; i++) {
        PyObject *name = PyTuple_GET_ITEM(fields, i);
        if (!PyUnicode_Check(name) || slot_offset(cls, PyUnicode_AsUTF8(name), &m->offsets[i]) < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "maker: field names must be str");
            Py_DECREF(m);
            return NULL;
        }
    }
    Py_ssize_t pos = 0, i = 0;
    PyObject *name, *value;
    while (PyDict_Next(defaults, &pos, &name, &value)) {
        if (!PyUnicode_Check(name) || slot_offset(cls, PyUnicode_AsUTF8(name), &m->offsets[nf + i]) < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "maker: default names must be str");
            Py_DECREF(m);
            return NULL;
        }
        Py_INCREF(value);
        m->defaults[i++] = value;
        m->ndefaults = i;
    }
    return (PyObject *)m;
}

static PyMethodDef methods[] = {
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "bind(node_class, np_empty, np_int64, from_numpy, /) -> None\n\nResolve the slots of the tree's node class and "
     "keep the makers of its index tensors (once)."},
    {"walk", (PyCFunction)(void (*)(void))walk, METH_FASTCALL, walk_doc},
    {"maker", (PyCFunction)(void (*)(void))make_maker, METH_FASTCALL, maker_doc},
    {"copy_out", (PyCFunction)(void (*)(void))copy_out, METH_FASTCALL, copy_out_doc},
    {"bind_tree", (PyCFunction)(void (*)(void))bind_tree, METH_FASTCALL, bind_tree_doc},
    {"add_leaf", (PyCFunction)(void (*)(void))add_leaf, METH_FASTCALL, add_leaf_doc},
    {"all_hashes", all_hashes, METH_O, all_hashes_doc},
    {"join", join, METH_O, join_doc},
    {"page_runs", (PyCFunction)(void (*)(void))page_runs, METH_FASTCALL, page_runs_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_hicache_tree",
    .m_doc = "hicache's radix tree walk in C: a key followed down through whole device-resident nodes.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__hicache_tree(void) {
    if (PyType_Ready(&MakerType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "BUILD", BUILD) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
