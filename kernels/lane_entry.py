"""The plan lanes' compiled entry (host time of an eager call; kernels/renorm_lane.py).

A lane's Python (its key, its conditions, the plan's call around one direct launch) costs 5-12 us of host
time per call on an H100 host. For the lanes whose plan is one direct launch through Triton's C launch
(the one-launch top-k at small batches: renorm_top_k_fused.py), `Entry` holds the same conditions in C:
a call of the public API or the drop-in surface first asks `call` (a C function), which builds the lane
key as `renorm_lane.lane_key` does, finds the entry, checks every condition of the lane, allocates the
output with ``torch.empty_like`` and, under the plan cache's lock, checks that the cache still holds the plan,
keeps its LRU order and calls the launcher with the recorded arguments, the call's addresses and scalars
substituted. Any condition not met: None,
and the call takes its lane in Python (or the full way) as before.

Off unless ``TPGUARD_LANE_ENTRY=1`` (read when a lane would make its entry, and compared on every call
through one): on an H100 host the entries took a top-k call at 1-64 x 32000 from 19-25 to 13-17 us of host
time, below flashinfer's, but `tests/test_renorm_lane.py::test_lanes_on_gpu`, which compares what they serve with
the full way's bits, has not passed on a GPU yet (docs/benchmarks.md, "Compiled lane entries"). Built once
per process with the C compiler Triton's own launchers need (``cc``, Python's headers), into
``~/.cache/tpguard`` (``TPGUARD_CACHE_DIR``), keyed by the source's hash; no compiler or a failed build: no
entries (the Python lanes serve). Python 3 ABI only (no torch or CUDA headers): a tensor is read through its
Python attributes, the current device and stream through torch's C calls.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import tempfile
import threading

import torch

from tpguard.config import env_snapshot, env_value

SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>

enum { PROBS, OUT, K, P, FP, NROLES };

typedef struct {
    PyObject *shape, *dtype, *device, *param_shape;      /* probs' and a per-row parameter's */
    PyObject *k_dtype, *p_dtype, *fp_dtype;               /* int32, float32, int64 */
    long device_index;
    unsigned long long stream;
    int cuda;
    PyObject *get_device, *get_stream, *capturing;       /* torch's C calls (stand-ins in CPU tests) */
    PyObject *empty_like, *launcher, *args;              /* the launcher and its recorded arguments */
    Py_ssize_t slot[NROLES];                              /* argument index of each role, -1: none */
    long align[NROLES];                                   /* a tensor role's recorded address % 16 */
    int kind[NROLES];                                     /* K, P: 0 absent, 1 scalar, 2 tensor */
    long vocab;
    int min_p;
    PyObject *env, *env_keys, *env_values;                /* os.environ's dict, the knobs, their values */
    PyObject *hook_owner, *hook_enter, *hook_exit;        /* triton.knobs.runtime and its recorded hooks */
    PyObject *plans, *plan_key, *lock, *plan;            /* the cache, the plan's key, their lock, the plan */
} Entry;

static PyObject *s_shape, *s_dtype, *s_device, *s_is_contiguous, *s_data_ptr, *s_numel, *s_move_to_end,
    *s_acquire, *s_release, *s_enter, *s_exit, *s_calls;
static PyObject *tensor_type, *table;

static void entry_free(PyObject *capsule) {
    Entry *e = (Entry *)PyCapsule_GetPointer(capsule, "tpguard.lane_entry");
    if (!e) return;
    PyObject **refs[] = {&e->shape, &e->dtype, &e->device, &e->param_shape, &e->k_dtype, &e->p_dtype,
                         &e->fp_dtype, &e->get_device, &e->get_stream, &e->capturing, &e->empty_like,
                         &e->launcher, &e->args, &e->env, &e->env_keys, &e->env_values, &e->hook_owner,
                         &e->hook_enter, &e->hook_exit, &e->plans, &e->plan_key, &e->lock, &e->plan};
    for (size_t i = 0; i < sizeof(refs) / sizeof(refs[0]); i++) Py_XDECREF(*refs[i]);
    PyMem_Free(e);
}

/* 1 true, 0 false, -1 error (cleared: the caller answers None) */
static int attr_is(PyObject *obj, PyObject *name, PyObject *want) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (!v) { PyErr_Clear(); return -1; }
    int same = v == want ? 1 : PyObject_RichCompareBool(v, want, Py_EQ);
    Py_DECREF(v);
    if (same < 0) { PyErr_Clear(); return -1; }
    return same;
}

static int method_true(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_CallMethodNoArgs(obj, name);
    if (!v) { PyErr_Clear(); return -1; }
    int t = v == Py_True;
    Py_DECREF(v);
    return t;
}

/* a tensor parameter already in the kernels' form (renorm_args.tensor_ready) */
static int ready(Entry *e, PyObject *t, PyObject *dtype) {
    if (Py_TYPE(t) != (PyTypeObject *)tensor_type) return 0;
    return attr_is(t, s_dtype, dtype) == 1 && attr_is(t, s_shape, e->param_shape) == 1 &&
           attr_is(t, s_device, e->device) == 1 && method_true(t, s_is_contiguous) == 1;
}

static long long address(PyObject *t) {
    PyObject *v = PyObject_CallMethodNoArgs(t, s_data_ptr);
    if (!v) { PyErr_Clear(); return -1; }
    long long a = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (a == -1 && PyErr_Occurred()) { PyErr_Clear(); return -1; }
    return a;
}

static int hook_idle(Entry *e, PyObject *name, PyObject *want) {
    PyObject *h = PyObject_GetAttr(e->hook_owner, name);
    if (!h) { PyErr_Clear(); return 0; }
    int ok = h == want;
    Py_DECREF(h);
    if (!ok || want == Py_None) return ok;
    PyObject *calls = PyObject_GetAttr(want, s_calls);
    if (!calls) { PyErr_Clear(); return 0; }
    ok = PyObject_IsTrue(calls) == 0;
    Py_DECREF(calls);
    return ok;
}

static int conditions(Entry *e, PyObject *probs, PyObject *k, PyObject *p, PyObject *fp) {
    if (e->cuda) {
        PyObject *v = PyObject_CallNoArgs(e->get_device);
        if (!v) { PyErr_Clear(); return 0; }
        long dev = PyLong_AsLong(v);
        Py_DECREF(v);
        if (dev != e->device_index) { PyErr_Clear(); return 0; }
        v = PyObject_CallFunction(e->get_stream, "l", dev);
        if (!v) { PyErr_Clear(); return 0; }
        unsigned long long stream = PyLong_AsUnsignedLongLong(v);
        Py_DECREF(v);
        if (PyErr_Occurred()) { PyErr_Clear(); return 0; }
        if (stream != e->stream) return 0;
        v = PyObject_CallNoArgs(e->capturing);
        if (!v) { PyErr_Clear(); return 0; }
        int cap = PyObject_IsTrue(v);
        Py_DECREF(v);
        if (cap != 0) { PyErr_Clear(); return 0; }
    }
    if (method_true(probs, s_is_contiguous) != 1) return 0;
    if (e->kind[K] == 1) {
        long v = PyLong_AsLong(k);
        if (v == -1 && PyErr_Occurred()) { PyErr_Clear(); return 0; }
        if (!(0 < v && v < e->vocab)) return 0;  /* its Triton class (== 1, % 16 == 0) is in the key */
    } else if (e->kind[K] == 2 && !ready(e, k, e->k_dtype)) return 0;
    if (e->kind[P] == 1) {
        double v = PyFloat_AS_DOUBLE(p);
        if (!(e->min_p ? (0.0 <= v && v <= 1.0) : (0.0 < v && v <= 1.0))) return 0;  /* NaN fails both */
    } else if (e->kind[P] == 2 && !ready(e, p, e->p_dtype)) return 0;
    if (fp != Py_None) {
        if (Py_TYPE(fp) != (PyTypeObject *)tensor_type || attr_is(fp, s_dtype, e->fp_dtype) != 1 ||
            attr_is(fp, s_device, e->device) != 1) return 0;
        PyObject *n = PyObject_CallMethodNoArgs(fp, s_numel);
        if (!n) { PyErr_Clear(); return 0; }
        long numel = PyLong_AsLong(n);
        Py_DECREF(n);
        if (numel != 1) { PyErr_Clear(); return 0; }
    }
    if (e->env) {  /* the knobs as the lane saw them (TPGUARD_RENORM_CONFIG, TPGUARD_RENORM_PLANS) */
        Py_ssize_t n = PyTuple_GET_SIZE(e->env_keys);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *now = PyDict_GetItemWithError(e->env, PyTuple_GET_ITEM(e->env_keys, i));
            if (!now && PyErr_Occurred()) { PyErr_Clear(); return 0; }
            PyObject *was = PyTuple_GET_ITEM(e->env_values, i);
            if (!now) { if (was != Py_None) return 0; continue; }
            if (was == Py_None) return 0;
            int same = PyObject_RichCompareBool(now, was, Py_EQ);
            if (same != 1) { PyErr_Clear(); return 0; }
        }
    }
    if (e->hook_owner != Py_None &&
        !(hook_idle(e, s_enter, e->hook_enter) && hook_idle(e, s_exit, e->hook_exit))) return 0;
    return 1;
}

/* lane_key(op, probs, k, p, backend, fp, validate) as renorm_lane.lane_key builds it; NULL: no lane */
static PyObject *lane_key(PyObject *op, PyObject *probs, PyObject *k, PyObject *p, PyObject *backend,
                          PyObject *fp, int validate) {
    if (Py_TYPE(probs) != (PyTypeObject *)tensor_type) return NULL;
    PyObject *kc;
    if (PyLong_CheckExact(k)) {
        long v = PyLong_AsLong(k);
        if (v == -1 && PyErr_Occurred()) { PyErr_Clear(); return NULL; }
        kc = PyTuple_Pack(2, v == 1 ? Py_True : Py_False, v % 16 == 0 ? Py_True : Py_False);
        if (!kc) { PyErr_Clear(); return NULL; }
    } else if (Py_TYPE(k) == (PyTypeObject *)tensor_type) {
        if (validate) return NULL;
        kc = tensor_type; Py_INCREF(kc);
    } else if (k == Py_None) {
        kc = (PyObject *)Py_TYPE(Py_None); Py_INCREF(kc);
    } else return NULL;
    PyObject *pc;
    if (Py_TYPE(p) == (PyTypeObject *)tensor_type) {
        if (validate) { Py_DECREF(kc); return NULL; }
        pc = tensor_type;
    } else if (PyFloat_CheckExact(p)) pc = (PyObject *)&PyFloat_Type;
    else if (p == Py_None) pc = (PyObject *)Py_TYPE(Py_None);
    else { Py_DECREF(kc); return NULL; }
    Py_INCREF(pc);
    PyObject *shape = PyObject_GetAttr(probs, s_shape);
    PyObject *dtype = shape ? PyObject_GetAttr(probs, s_dtype) : NULL;
    PyObject *device = dtype ? PyObject_GetAttr(probs, s_device) : NULL;
    PyObject *key = NULL;
    if (device)
        key = PyTuple_Pack(8, op, backend, shape, dtype, device, kc, pc, fp == Py_None ? Py_True : Py_False);
    Py_XDECREF(shape); Py_XDECREF(dtype); Py_XDECREF(device); Py_DECREF(kc); Py_DECREF(pc);
    if (!key) PyErr_Clear();
    return key;
}

/* call(op, probs, top_k, top_p, fingerprint_out, backend, validate) -> the output, or None */
static PyObject *call(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    if (n != 7) { PyErr_SetString(PyExc_TypeError, "call takes 7 arguments"); return NULL; }
    if (!table || PyDict_GET_SIZE(table) == 0) Py_RETURN_NONE;
    PyObject *probs = a[1], *k = a[2], *p = a[3], *fp = a[4];
    PyObject *key = lane_key(a[0], probs, k, p, a[5], fp, PyObject_IsTrue(a[6]) == 1);
    if (!key) Py_RETURN_NONE;
    PyObject *capsule = PyDict_GetItemWithError(table, key);  /* borrowed */
    Py_DECREF(key);
    if (!capsule) { PyErr_Clear(); Py_RETURN_NONE; }
    Py_INCREF(capsule);  /* the table may drop it while the launcher runs */
    Entry *e = (Entry *)PyCapsule_GetPointer(capsule, "tpguard.lane_entry");
    PyObject *out = NULL, *args = NULL, *r = NULL, *result = Py_None;
    if (!e || !conditions(e, probs, k, p, fp)) { PyErr_Clear(); goto done; }
    PyObject *role_value[NROLES] = {probs, NULL, k, p, fp};
    out = PyObject_CallOneArg(e->empty_like, probs);
    if (!out) goto fail;
    role_value[OUT] = out;
    Py_ssize_t nargs = PyTuple_GET_SIZE(e->args);
    args = PyTuple_New(nargs);
    if (!args) goto fail;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyObject *v = PyTuple_GET_ITEM(e->args, i);
        Py_INCREF(v);
        PyTuple_SET_ITEM(args, i, v);
    }
    for (int role = 0; role < NROLES; role++) {
        if (e->slot[role] < 0) continue;
        PyObject *v = role_value[role];
        PyObject *put;
        if (role == PROBS || role == OUT || role == FP || e->kind[role] == 2) {
            long long addr = address(v);
            if (addr < 0 || addr % 16 != e->align[role]) goto done;  /* another alignment: not this launch */
            put = PyLong_FromLongLong(addr);
        } else {
            put = v; Py_INCREF(put);
        }
        if (!put) goto fail;
        PyObject *old = PyTuple_GET_ITEM(args, e->slot[role]);
        PyTuple_SET_ITEM(args, e->slot[role], put);
        Py_DECREF(old);
    }
    /* Under the cache's lock, as the Python lane calls its plan: the plan still cached under its key (not
       evicted, nor replaced by a new plan whose workspace the recorded arguments do not name), its LRU
       order kept, and the launch issued before another thread can evict it. The entry holds the plan, so
       its workspace outlives the launch whatever happens after. */
    r = PyObject_CallMethodNoArgs(e->lock, s_acquire);
    if (!r) goto fail;
    Py_DECREF(r);
    int stale = 0;
    PyObject *et = NULL, *ev = NULL, *tb = NULL;
    PyObject *cached = PyObject_GetItem(e->plans, e->plan_key);
    if (!cached) {
        if (PyErr_ExceptionMatches(PyExc_KeyError)) { PyErr_Clear(); stale = 1; }  /* the Python lane decides */
        else PyErr_Fetch(&et, &ev, &tb);
    } else {
        stale = cached != e->plan;
        Py_DECREF(cached);
    }
    if (!stale && !et) {
        r = PyObject_CallMethodOneArg(e->plans, s_move_to_end, e->plan_key);  /* the LRU order, as the lane keeps it */
        if (r) { Py_DECREF(r); r = PyObject_Call(e->launcher, args, NULL); }
        if (r) Py_DECREF(r);
        else PyErr_Fetch(&et, &ev, &tb);
    }
    PyObject *unlocked = PyObject_CallMethodNoArgs(e->lock, s_release);
    if (!unlocked) { Py_XDECREF(et); Py_XDECREF(ev); Py_XDECREF(tb); goto fail; }
    Py_DECREF(unlocked);
    if (et) { PyErr_Restore(et, ev, tb); goto fail; }
    if (stale) goto done;
    result = out;
    goto done;
fail:
    Py_XDECREF(out); Py_XDECREF(args); Py_DECREF(capsule);
    return NULL;
done:
    Py_XDECREF(args);
    Py_DECREF(capsule);
    if (result == out) return out;
    Py_XDECREF(out);
    Py_RETURN_NONE;
}

static PyObject *get_obj(PyObject *d, const char *name) {
    PyObject *v = PyDict_GetItemString(d, name);
    if (!v) { PyErr_Format(PyExc_KeyError, "entry field %s missing", name); return NULL; }
    Py_INCREF(v);
    return v;
}

/* entry(fields: dict) -> a capsule */
static PyObject *entry(PyObject *self, PyObject *d) {
    if (!PyDict_Check(d)) { PyErr_SetString(PyExc_TypeError, "entry takes a dict"); return NULL; }
    Entry *e = (Entry *)PyMem_Calloc(1, sizeof(Entry));
    if (!e) return PyErr_NoMemory();
    PyObject *capsule = PyCapsule_New(e, "tpguard.lane_entry", entry_free);
    if (!capsule) { PyMem_Free(e); return NULL; }
#define OBJ(f) if (!(e->f = get_obj(d, #f))) goto bad;
    OBJ(shape) OBJ(dtype) OBJ(device) OBJ(param_shape) OBJ(k_dtype) OBJ(p_dtype) OBJ(fp_dtype)
    OBJ(get_device) OBJ(get_stream) OBJ(capturing) OBJ(empty_like) OBJ(launcher) OBJ(args)
    OBJ(env_keys) OBJ(env_values) OBJ(hook_owner) OBJ(hook_enter) OBJ(hook_exit) OBJ(plans) OBJ(plan_key) OBJ(lock) OBJ(plan)
#undef OBJ
    e->env = PyDict_GetItemString(d, "env");
    if (e->env == Py_None) e->env = NULL;
    Py_XINCREF(e->env);
    if (!PyTuple_Check(e->args)) { PyErr_SetString(PyExc_TypeError, "args must be a tuple"); goto bad; }
    PyObject *ints = PyDict_GetItemString(d, "ints");  /* device_index, stream, cuda, vocab, min_p */
    PyObject *roles = PyDict_GetItemString(d, "roles");  /* ((slot, align, kind) per role) */
    if (!ints || !roles || !PyArg_ParseTuple(ints, "lKilp", &e->device_index, &e->stream, &e->cuda, &e->vocab,
                                             &e->min_p)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "ints / roles missing");
        goto bad;
    }
    if (!PyTuple_Check(roles) || PyTuple_GET_SIZE(roles) != NROLES) {
        PyErr_SetString(PyExc_TypeError, "roles: one (slot, align, kind) per role"); goto bad;
    }
    for (int i = 0; i < NROLES; i++)
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(roles, i), "nli", &e->slot[i], &e->align[i], &e->kind[i])) goto bad;
    for (int i = 0; i < NROLES; i++)
        if (e->slot[i] >= PyTuple_GET_SIZE(e->args)) { PyErr_SetString(PyExc_IndexError, "slot"); goto bad; }
    return capsule;
bad:
    Py_DECREF(capsule);
    return NULL;
}

/* setup(table, tensor_type): the dict of entries by lane key, and torch.Tensor */
static PyObject *setup(PyObject *self, PyObject *args) {
    PyObject *t, *tt;
    if (!PyArg_ParseTuple(args, "O!O", &PyDict_Type, &t, &tt)) return NULL;
    Py_XDECREF(table); Py_XDECREF(tensor_type);
    Py_INCREF(t); Py_INCREF(tt);
    table = t; tensor_type = tt;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"call", (PyCFunction)(void (*)(void))call, METH_FASTCALL, "the call through its entry, or None"},
    {"entry", entry, METH_O, "an entry from its fields"},
    {"setup", setup, METH_VARARGS, "the entries' table and torch.Tensor"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tpguard_lane_entry", NULL, -1, methods};

PyMODINIT_FUNC PyInit_tpguard_lane_entry(void) {
#define S(v, text) if (!(v = PyUnicode_InternFromString(text))) return NULL;
    S(s_shape, "shape") S(s_dtype, "dtype") S(s_device, "device") S(s_is_contiguous, "is_contiguous")
    S(s_data_ptr, "data_ptr") S(s_numel, "numel") S(s_move_to_end, "move_to_end") S(s_acquire, "acquire")
    S(s_release, "release") S(s_enter, "launch_enter_hook") S(s_exit, "launch_exit_hook") S(s_calls, "calls")
#undef S
    return PyModule_Create(&module);
}
"""

# the knobs a lane reads per call (renorm_lane.Lane.admits: the config, plans on) and this entry's switch
KNOBS = ("TPGUARD_RENORM_CONFIG", "TPGUARD_RENORM_PLANS", "TPGUARD_LANE_ENTRY")
PROBS, OUT, K, P, FP = range(5)  # the roles an entry substitutes (renorm_graph.ROLES' first five)

_MODULE = None
_TRIED = False
_BUILD_LOCK = threading.Lock()
FAILURE = ""  # why there is no compiled entry (benchmarks and tests print it)


def cache_dir() -> str:
    return env_value("TPGUARD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tpguard")


def enabled() -> bool:
    """TPGUARD_LANE_ENTRY=1 turns the compiled entries on (off by default until their GPU test has passed:
    the module doc; docs/kernels.md, "Call plans")."""
    return env_value("TPGUARD_LANE_ENTRY", "0").strip() == "1"


def module():
    """The compiled module (built on first use, once per process), or None (`FAILURE` says why)."""
    global _MODULE, _TRIED, FAILURE
    if _TRIED:
        return _MODULE
    with _BUILD_LOCK:
        if _TRIED:
            return _MODULE
        try:
            _MODULE = _build()
        except Exception as e:  # noqa: BLE001 - no compiled entry: the Python lanes serve
            FAILURE = f"{type(e).__name__}: {e}"[:300]
        _TRIED = True
    return _MODULE


def _build():
    name = "tpguard_lane_entry"
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    digest = hashlib.sha256((SOURCE + suffix).encode()).hexdigest()[:16]
    target = os.path.join(cache_dir(), f"{name}-{digest}{suffix}")
    if not os.path.exists(target):
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise RuntimeError("no C compiler (cc, gcc) on PATH")
        os.makedirs(cache_dir(), exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, f"{name}.c")
            with open(src, "w") as f:
                f.write(SOURCE)
            so = os.path.join(tmp, f"{name}{suffix}")
            include = sysconfig.get_paths()["include"]
            subprocess.run([cc, src, "-O2", "-shared", "-fPIC", f"-I{include}", "-o", so], check=True,
                           capture_output=True, timeout=120)
            os.replace(so, target)  # atomic: another process may build the same file meanwhile
    loader = importlib.machinery.ExtensionFileLoader(name, target)
    spec = importlib.util.spec_from_file_location(name, target, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def fields(*, probs, op: str, args: tuple, slots: dict, aligns: dict, kinds: dict, launcher,
           cuda_calls: tuple, stream: int, hook_owner, hooks: tuple, plans, plan_key: tuple, lock, plan) -> dict:
    """An entry's fields (`entry`): `args` the launcher's arguments with the stream set (None in the
    substituted slots), `slots` / `aligns` role -> argument index / recorded address % 16, `kinds` K and P
    -> 0 absent, 1 scalar, 2 tensor, `cuda_calls` the current
    device, stream and capture state's calls, `hooks` Triton's launch hooks at the recording; `plans`,
    `plan_key`, `lock`: renorm_plan's cache, the plan's key and the cache's lock, `plan` the plan (held, so
    its workspace outlives any launch through the entry)."""
    env = env_snapshot(KNOBS)
    rows, vocab = probs.shape
    return dict(
        shape=probs.shape, dtype=probs.dtype, device=probs.device, param_shape=torch.Size([rows]),
        k_dtype=torch.int32, p_dtype=torch.float32, fp_dtype=torch.int64,
        get_device=cuda_calls[0], get_stream=cuda_calls[1], capturing=cuda_calls[2],
        empty_like=torch.empty_like, launcher=launcher, args=tuple(args),
        env=None if env is None else env[0], env_keys=() if env is None else env[1],
        env_values=() if env is None else env[2],
        hook_owner=hook_owner, hook_enter=hooks[0], hook_exit=hooks[1], plans=plans, plan_key=plan_key, lock=lock,
        plan=plan,
        ints=(probs.device.index if probs.device.index is not None else -1, stream, 1, vocab, op == "min_p"),
        roles=tuple((slots.get(r, -1), aligns.get(r, 0), kinds.get(r, 0)) for r in range(5)))


def for_plan(plan, plan_key: tuple, plans, lock, values: list):
    """A compiled entry to `plan` for calls like this one (`values`: its roles, as the plan got them), or
    None where the plan is not one direct launch through Triton's C launch, or there is no compiled module."""
    from tpguard.kernels import cuda_state
    from tpguard.kernels import direct_launch as dl

    direct, probs = plan.direct, values[PROBS]
    if not enabled() or plan.state != "on" or plan.graphs is not None or not plan.graphs_tried or direct is None \
            or len(direct.launches) != 1 or plan.spec.out_dtype is not None or not probs.is_cuda:
        return None
    (launch,) = direct.launches
    owner = dl.hook_owner()
    cuda_calls = (cuda_state._GET_DEVICE, cuda_state._RAW_STREAM, cuda_state._CAPTURING)
    if not (launch.trimmed and launch.c_launch) or owner is None or None in cuda_calls \
            or env_snapshot(KNOBS) is None or plan_key[6] is None:
        return None
    slots = {}
    for i, role, _ in launch.slots:
        if role in slots or role > FP:  # a role in two arguments, or a role the entry does not substitute
            return None
        slots[role] = i
    k, p = values[K], values[P]
    kinds = {K: 0 if k is None else 2 if isinstance(k, torch.Tensor) else 1,
             P: 0 if p is None else 2 if isinstance(p, torch.Tensor) else 1}
    args = list(launch.template)
    args[3] = plan_key[6]  # the plan's stream (renorm_plan.plan_key)
    m = module()
    if m is None:
        return None
    return m.entry(fields(probs=probs, op=plan.op, args=tuple(args), slots=slots, aligns=dict(direct.tensor_roles),
                          kinds=kinds, launcher=launch.run, cuda_calls=cuda_calls,
                          stream=plan_key[6], hook_owner=owner, hooks=launch.hooks, plans=plans, plan_key=plan_key,
                          lock=lock, plan=plan))


__all__ = ["FAILURE", "KNOBS", "SOURCE", "cache_dir", "enabled", "fields", "for_plan", "module"]
