/* The radix tree's walk in C: following a key down through whole, device-resident nodes.
 *
 * `hicache.tree` keeps its nodes as Python objects (`TreeNode`, a class with __slots__); this module reads and
 * writes their slots directly, at the offsets CPython gives the slots' member descriptors (resolved once by
 * `bind`), so the per-node cost of a walk is a dict lookup and a memcmp instead of some twenty bytecodes.
 * Everything that changes the tree's structure or counters (splits, new nodes, attaching values) stays in
 * Python: the walk stops before the first node that needs it and says which one.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stddef.h>
#include <string.h>

/* Bumped whenever a function's behaviour or signature changes (hicache/tree/walk.py checks it). */
#define BUILD 4

static PyTypeObject *node_type = NULL;
static Py_ssize_t off_children, off_key, off_device, off_host, off_pending, off_access, off_hits, off_ref;

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

static PyObject *bind(PyObject *self, PyObject *type) {
    if (!PyType_Check(type)) {
        PyErr_SetString(PyExc_TypeError, "bind: expected the node class");
        return NULL;
    }
    if (slot_offset(type, "children", &off_children) < 0 || slot_offset(type, "key", &off_key) < 0 ||
        slot_offset(type, "device_value", &off_device) < 0 || slot_offset(type, "host_value", &off_host) < 0 ||
        slot_offset(type, "backup_pending", &off_pending) < 0 ||
        slot_offset(type, "last_access", &off_access) < 0 || slot_offset(type, "hit_count", &off_hits) < 0 ||
        slot_offset(type, "_ref", &off_ref) < 0)
        return NULL;
    Py_INCREF(type);
    Py_XSETREF(node_type, (PyTypeObject *)type);
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
    return Py_BuildValue("(nOOOn)", pos, node, last_host, stop, matched);
}


/* ---------------------------------------------------------------- index copies */

PyDoc_STRVAR(copy_into_doc,
             "copy_into(dst, offset, src_address, nbytes, /) -> None\n\n"
             "Copy `nbytes` bytes from the CPU address `src_address` (a contiguous CPU tensor's data_ptr(), read by\n"
             "the caller, which keeps the tensor alive and checked it: CPU, contiguous, at least that long) into the\n"
             "writable buffer `dst` (a numpy array) at byte `offset`. The tree's own copy of a caller's indices\n"
             "without a torch op (a torch op here costs more than the rest of an insert's bookkeeping).");

static PyObject *copy_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "copy_into: expected 4 arguments");
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[1]), nbytes = PyLong_AsSsize_t(args[3]);
    if ((offset == -1 || nbytes == -1) && PyErr_Occurred()) return NULL;
    void *src = PyLong_AsVoidPtr(args[2]);
    if (src == NULL && PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (offset < 0 || nbytes < 0 || offset > view.len || nbytes > view.len - offset || (nbytes && src == NULL)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "copy_into: the copy does not fit the destination");
        return NULL;
    }
    memcpy((char *)view.buf + offset, src, (size_t)nbytes);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
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
    {"bind", bind, METH_O, "bind(node_class, /) -> None\n\nResolve the slots of the tree's node class (once)."},
    {"walk", (PyCFunction)(void (*)(void))walk, METH_FASTCALL, walk_doc},
    {"maker", (PyCFunction)(void (*)(void))make_maker, METH_FASTCALL, maker_doc},
    {"copy_into", (PyCFunction)(void (*)(void))copy_into, METH_FASTCALL, copy_into_doc},
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
