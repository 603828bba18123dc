/* run()'s per-call path in C: re-check a validated call's signature, launch.
 *
 * BatchAttention.run() validates a call in Python once per signature (each array's type,
 * shape, strides, dtype and device; the params; sm_scale). For a validated signature it
 * makes a FastRun here, holding that signature and the packed arguments of the plan's
 * launches. A later call goes to FastRun first: it reads q, k_cache, v_cache, out and the
 * device-array params again, compares everything but their addresses with the validated
 * call, checks the four arrays' addresses for 16-byte alignment, writes the addresses into
 * the packed arguments and launches. Whatever it is not
 * sure of (another signature, a misaligned pointer, another current device, a stream that
 * plan()'s copy has not been ordered before, stream capture) makes it return None without
 * launching: run() then takes its Python path, which checks everything and says what is
 * wrong. So this file makes run() faster and never more permissive.
 *
 * Arrays are read through DLPack's C exchange API where their type offers it (torch >= 2.10:
 * a struct filled in C, and the current stream with it), else through their Python
 * attributes (CuPy, older torch). On the H100 machine's host (benchmarks/host.py, 32 layers,
 * B16 L1024): run() 15.2 us per call on the Python path, 6.0 us here with out=, 9.8 us with
 * the output allocated (torch.empty_like); cuLaunchKernel alone is ~4.5 us of that. The GIL
 * is held throughout: concurrent run() calls on one BatchAttention serialise, as in Python.
 *
 * Driver entry points come in as addresses (attnlang/runtime/hostpath.py resolves them from
 * libcuda), so tests can hand in fakes and run all of this without a GPU. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* The CUDA driver API signatures used here (no cuda.h needed: handles are pointers). */
typedef int (*LaunchFn)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned smem, void *stream,
                        void **params, void **extra);
typedef int (*IsCapturingFn)(void *stream, int *status);
typedef int (*CtxGetCurrentFn)(void **ctx);
typedef int (*EventRecordFn)(void *event, void *stream);
typedef int (*GetErrorNameFn)(int error, const char **name);
/* cuLaunchKernelEx's config with one attribute: CUlaunchConfig and CUlaunchAttribute as
 * cuda.h lays them out (the attribute's value a 64-byte union, 8-byte aligned). */
typedef struct {
    int id;
    char pad[4];
    union { char bytes[64]; int value; void *align; } value;
} LaunchAttribute;
typedef struct {
    unsigned grid[3], block[3], smem;
    void *stream;
    LaunchAttribute *attrs;
    unsigned num_attrs;
} LaunchConfig;
typedef int (*LaunchExFn)(const LaunchConfig *config, void *f, void **params, void **extra);
/* CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION: the kernel may start before the one
 * before it in the stream has completed (it waits for it with griddepcontrol.wait). */
enum { ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6 };

enum { ARRAY_TORCH = 0, ARRAY_CUPY = 1 };
enum { Q, K, V, OUT, NUM_ARRAYS };
enum { MAX_TENSOR_PARAMS = 16 };  /* more: the call takes the Python path */

/* DLPack's C exchange API (dlpack.h 1.3): torch.Tensor.__dlpack_c_exchange_api__ gives
 * an array's DLTensor and the current stream without a Python call. Only the parts used. */
typedef struct { uint32_t major, minor; } DLPackVersion;
typedef struct { int32_t device_type, device_id; } DLDevice;
typedef struct { uint8_t code, bits; uint16_t lanes; } DLDataType;
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape, *strides;
    uint64_t byte_offset;
} DLTensor;
typedef struct {
    DLPackVersion version;
    void *prev_api;
    void *managed_tensor_allocator, *managed_tensor_from_py_object_no_sync,
        *managed_tensor_to_py_object_no_sync;
    int (*dltensor_from_py_object_no_sync)(void *py_object, DLTensor *out);
    int (*current_work_stream)(int32_t device_type, int32_t device_id, void **stream);
} DLPackExchangeAPI;

enum { MAX_DIMS = 8 };

/* Everything validation reads of an array but its address, in comparable form. */
typedef struct {
    PyTypeObject *type;
    int ndim;
    int64_t shape[MAX_DIMS], strides[MAX_DIMS];
    uintptr_t dtype;   /* DLPack's (code, bits, lanes), else the dtype object (singletons) */
    int64_t device;    /* DLPack's (type, id), else the device ordinal */
} Meta;

typedef struct {
    void *fn;
    unsigned grid[3], block[3], smem;
    int slot[NUM_ARRAYS];   /* the u64 slot of q, k_cache, v_cache, out; -1 if not an arg */
    int params0;            /* the slot of the variant's first param */
    uint64_t *values;       /* the packed arguments, one 8-byte slot each */
    void **params;          /* params[i] = &values[i]: what cuLaunchKernel reads */
    int dependent;          /* a programmatic dependent launch (cuLaunchKernelEx) */
} Launch;

/* A device-array param of the validated call: read again per call like q, its address
 * written into slot params0 + index of every launch. */
typedef struct {
    PyObject *name;
    int kind;               /* ARRAY_TORCH or ARRAY_CUPY: how it is read (a CuPy array may
                               come beside torch tensors: an fp8 cache's float scales) */
    int index;              /* its place among the variant's params */
    Meta expected;
    PyObject *dtype;        /* kept alive where the dtype is compared by identity */
} TensorParam;

typedef struct {
    PyObject_HEAD
    int array_kind;
    const DLPackExchangeAPI *dlpack;  /* NULL: read arrays through their attributes */
    Meta expected[NUM_ARRAYS];        /* the validated call's arrays */
    PyObject *dtypes[NUM_ARRAYS];     /* their dtype objects when compared by identity */
    int allocate;                     /* the validated call had no out: allocate one */
    PyObject *params;       /* None, or ((name, type, value), ...) of the dict's scalars */
    Py_ssize_t num_params;  /* the dict's size: scalars and tensors */
    int num_tensors;
    TensorParam tensors[MAX_TENSOR_PARAMS];
    PyObject *sm_scale;     /* the validated sm_scale argument: None or a number */
    PyObject *stream_fn;    /* () -> current stream handle (int), without DLPack */
    PyObject *empty_like;   /* (q) -> a new output */
    PyObject *waited;       /* set of stream handles already ordered after plan()'s copy */
    uintptr_t context, copy_stream, run_done;
    LaunchFn launch;
    LaunchExFn launch_ex;   /* NULL where the driver has none: no dependent launches */
    IsCapturingFn is_capturing;
    CtxGetCurrentFn ctx_get_current;
    EventRecordFn event_record;
    GetErrorNameFn get_error_name;
    int num_launches;
    Launch *launches;
    int ran, ran_on_copy_stream;  /* read (and reset) by plan(), as run()'s own flags */
} FastRun;

static PyObject *str_shape, *str_stride, *str_strides, *str_dtype, *str_get_device,
    *str_device, *str_id, *str_data_ptr, *str_data, *str_ptr;

static int int64s(PyObject *tuple, int64_t *out, int n) {
    if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != n) return -1;
    for (int i = 0; i < n; i++) {
        out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, i));
        if (out[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static int address_of(int kind, PyObject *x, uintptr_t *ptr) {
    PyObject *address;
    if (kind == ARRAY_TORCH) {
        address = PyObject_CallMethodNoArgs(x, str_data_ptr);
    } else {
        PyObject *data = PyObject_GetAttr(x, str_data);
        address = data ? PyObject_GetAttr(data, str_ptr) : NULL;
        Py_XDECREF(data);
    }
    if (address == NULL) return -1;
    *ptr = (uintptr_t)PyLong_AsUnsignedLongLong(address);
    Py_DECREF(address);
    return PyErr_Occurred() ? -1 : 0;
}

/* x's Meta and address through its Python attributes (CuPy; torch without DLPack's API). */
static int read_attributes(int kind, PyObject *x, Meta *m, uintptr_t *ptr) {
    PyObject *shape = NULL, *strides = NULL, *dtype = NULL, *device = NULL;
    int ok = -1;
    if ((shape = PyObject_GetAttr(x, str_shape)) == NULL) goto done;
    if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) > MAX_DIMS) goto done;
    m->ndim = (int)PyTuple_GET_SIZE(shape);
    strides = kind == ARRAY_TORCH ? PyObject_CallMethodNoArgs(x, str_stride)
                                  : PyObject_GetAttr(x, str_strides);
    if (strides == NULL || int64s(shape, m->shape, m->ndim) < 0 ||
        int64s(strides, m->strides, m->ndim) < 0)
        goto done;
    if ((dtype = PyObject_GetAttr(x, str_dtype)) == NULL) goto done;
    m->dtype = (uintptr_t)dtype;  /* compared by identity: an equal non-identical dtype only
                                     sends the call to the Python path */
    if (kind == ARRAY_TORCH) {
        device = PyObject_CallMethodNoArgs(x, str_get_device);
    } else {
        PyObject *d = PyObject_GetAttr(x, str_device);
        device = d ? PyObject_GetAttr(d, str_id) : NULL;
        Py_XDECREF(d);
    }
    if (device == NULL || ((m->device = PyLong_AsLongLong(device)) == -1 && PyErr_Occurred()))
        goto done;
    ok = address_of(kind, x, ptr);
done:
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    Py_XDECREF(dtype);
    Py_XDECREF(device);
    return ok;
}

/* x's Meta and address, x an array of `kind`; 0 on success, -1 with or without a Python
 * error set. */
static int read_array_of(const FastRun *self, int kind, PyObject *x, Meta *m, uintptr_t *ptr) {
    m->type = Py_TYPE(x);
    if (self->dlpack == NULL || kind != ARRAY_TORCH) return read_attributes(kind, x, m, ptr);
    DLTensor t;
    if (self->dlpack->dltensor_from_py_object_no_sync(x, &t) != 0 || t.ndim > MAX_DIMS) return -1;
    m->ndim = t.ndim;
    memcpy(m->shape, t.shape, t.ndim * sizeof(int64_t));
    memcpy(m->strides, t.strides, t.ndim * sizeof(int64_t));
    m->dtype = t.dtype.code | (uintptr_t)t.dtype.bits << 8 | (uintptr_t)t.dtype.lanes << 16;
    m->device = (int64_t)t.device.device_type << 32 | (uint32_t)t.device.device_id;
    *ptr = (uintptr_t)t.data + t.byte_offset;
    return 0;
}

static int read_array(const FastRun *self, PyObject *x, Meta *m, uintptr_t *ptr) {
    return read_array_of(self, self->array_kind, x, m, ptr);
}

/* 1 if x, an array of `kind`, reads as `expected` (its address into *ptr), else 0. */
static int matches_of(const FastRun *self, int kind, PyObject *x, const Meta *expected,
                      uintptr_t *ptr) {
    Meta m;
    if (Py_TYPE(x) != expected->type) return 0;
    if (read_array_of(self, kind, x, &m, ptr) < 0) {
        PyErr_Clear();  /* an unreadable array: the Python path says what is wrong */
        return 0;
    }
    return m.ndim == expected->ndim && m.dtype == expected->dtype &&
           m.device == expected->device &&
           memcmp(m.shape, expected->shape, m.ndim * sizeof(int64_t)) == 0 &&
           memcmp(m.strides, expected->strides, m.ndim * sizeof(int64_t)) == 0;
}

static int matches(const FastRun *self, PyObject *x, const Meta *expected, uintptr_t *ptr) {
    return matches_of(self, self->array_kind, x, expected, ptr);
}

/* 1 if `params` is the validated params (the same names; scalars of the same types and
 * values; device arrays that read as the validated ones, their addresses into
 * tensor_ptr[]), else 0 / -1. */
static int same_params(const FastRun *self, PyObject *params, uintptr_t *tensor_ptr) {
    if (self->params == Py_None) return params == Py_None;
    if (!PyDict_CheckExact(params) || PyDict_GET_SIZE(params) != self->num_params) return 0;
    Py_ssize_t n = PyTuple_GET_SIZE(self->params);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(self->params, i);
        PyObject *value = PyDict_GetItemWithError(params, PyTuple_GET_ITEM(item, 0));
        if (value == NULL) return PyErr_Occurred() ? -1 : 0;
        if ((PyObject *)Py_TYPE(value) != PyTuple_GET_ITEM(item, 1)) return 0;
        int same = PyObject_RichCompareBool(value, PyTuple_GET_ITEM(item, 2), Py_EQ);
        if (same != 1) return same;
    }
    for (int j = 0; j < self->num_tensors; j++) {
        const TensorParam *t = &self->tensors[j];
        PyObject *value = PyDict_GetItemWithError(params, t->name);
        if (value == NULL) return PyErr_Occurred() ? -1 : 0;
        if (!matches_of(self, t->kind, value, &t->expected, &tensor_ptr[j])) return 0;
    }
    return 1;
}

static int same_scale(PyObject *expected, PyObject *sm_scale) {
    if (expected == Py_None || sm_scale == Py_None) return expected == sm_scale;
    if (Py_TYPE(expected) != Py_TYPE(sm_scale)) return 0;
    return PyObject_RichCompareBool(expected, sm_scale, Py_EQ);
}

static PyObject *driver_error(FastRun *self, const char *call, int status) {
    const char *name = NULL;
    if (self->get_error_name == NULL || self->get_error_name(status, &name) != 0) name = NULL;
    PyErr_Format(PyExc_RuntimeError, "%s failed: %s (CUresult %d)", call,
                 name ? name : "unknown error", status);
    return NULL;
}

/* The caller's current stream: DLPack's current_work_stream, else stream_fn(). */
static int current_stream(FastRun *self, uintptr_t *stream) {
    if (self->dlpack != NULL) {
        void *s = NULL;
        int32_t type = (int32_t)(self->expected[Q].device >> 32);
        int32_t id = (int32_t)(self->expected[Q].device & 0xffffffff);
        if (self->dlpack->current_work_stream(type, id, &s) != 0) return -1;
        *stream = (uintptr_t)s;
        return 0;
    }
    PyObject *handle = PyObject_CallNoArgs(self->stream_fn);
    if (handle == NULL) return -1;
    *stream = (uintptr_t)PyLong_AsUnsignedLongLong(handle);
    Py_DECREF(handle);
    return PyErr_Occurred() ? -1 : 0;
}

/* A new output like q (validated contiguous) and its address. (DLPack's allocator is no
 * faster than torch.empty_like: both go through torch's caching allocator.) */
static PyObject *allocate_like(FastRun *self, PyObject *q, uintptr_t *ptr) {
    Meta m;
    PyObject *out = PyObject_CallOneArg(self->empty_like, q);
    if (out != NULL && read_array(self, out, &m, ptr) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "FastRun: cannot read the new output");
        Py_CLEAR(out);
    }
    return out;
}

/* FastRun(q, kv_cache, params, out, sm_scale) -> out, or None: take the Python path. */
static PyObject *FastRun_call(FastRun *self, PyObject *args, PyObject *kwargs) {
    PyObject *q, *kv_cache, *params, *out, *sm_scale;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "FastRun takes positional arguments only");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "FastRun", 5, 5, &q, &kv_cache, &params, &out, &sm_scale))
        return NULL;
    if (!(PyTuple_CheckExact(kv_cache) || PyList_CheckExact(kv_cache)) ||
        PySequence_Fast_GET_SIZE(kv_cache) != 2 || self->allocate != (out == Py_None))
        Py_RETURN_NONE;
    PyObject *arrays[NUM_ARRAYS] = {q, PySequence_Fast_GET_ITEM(kv_cache, 0),
                                    PySequence_Fast_GET_ITEM(kv_cache, 1), out};
    uintptr_t tensor_ptr[MAX_TENSOR_PARAMS];
    int same = same_params(self, params, tensor_ptr);
    if (same == 1) same = same_scale(self->sm_scale, sm_scale);
    if (same != 1) {
        if (same < 0) return NULL;
        Py_RETURN_NONE;
    }
    uintptr_t ptr[NUM_ARRAYS] = {0};
    for (int i = 0; i < NUM_ARRAYS - self->allocate; i++)
        if (!matches(self, arrays[i], &self->expected[i], &ptr[i])) Py_RETURN_NONE;
    if ((ptr[Q] | ptr[K] | ptr[V] | ptr[OUT]) & 15) Py_RETURN_NONE;

    void *context = NULL;
    if (self->ctx_get_current(&context) != 0 || (uintptr_t)context != self->context)
        Py_RETURN_NONE;
    uintptr_t stream;
    if (current_stream(self, &stream) < 0) return NULL;
    int capture = 0;
    int status = self->is_capturing((void *)stream, &capture);
    if (status != 0) return driver_error(self, "cuStreamIsCapturing", status);
    if (capture != 0) Py_RETURN_NONE;  /* the plan's capture launches: Python */
    if (stream != self->copy_stream) {  /* ordered after plan()'s copy yet? (Python waits) */
        PyObject *handle = PyLong_FromUnsignedLongLong(stream);
        int ordered = handle ? PySet_Contains(self->waited, handle) : -1;
        Py_XDECREF(handle);
        if (ordered != 1) {
            if (ordered < 0) return NULL;
            Py_RETURN_NONE;
        }
    }

    PyObject *result = out;
    if (self->allocate) {
        result = allocate_like(self, q, &ptr[OUT]);
        if (result == NULL) return NULL;
    } else {
        Py_INCREF(result);
    }
    for (int i = 0; i < self->num_launches; i++) {
        Launch *l = &self->launches[i];
        for (int a = 0; a < NUM_ARRAYS; a++)
            if (l->slot[a] >= 0) l->values[l->slot[a]] = ptr[a];
        for (int j = 0; j < self->num_tensors; j++)
            l->values[l->params0 + self->tensors[j].index] = tensor_ptr[j];
        /* The driver copies the values at launch: the next call may rewrite them. */
        if (l->dependent) {
            LaunchAttribute attr = {ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, {0}, {{0}}};
            attr.value.value = 1;
            LaunchConfig config = {{l->grid[0], l->grid[1], l->grid[2]},
                                   {l->block[0], l->block[1], l->block[2]}, l->smem,
                                   (void *)stream, &attr, 1};
            status = self->launch_ex(&config, l->fn, l->params, NULL);
        } else {
            status = self->launch(l->fn, l->grid[0], l->grid[1], l->grid[2], l->block[0],
                                  l->block[1], l->block[2], l->smem, (void *)stream, l->params,
                                  NULL);
        }
        if (status != 0) {
            Py_DECREF(result);
            return driver_error(self, l->dependent ? "cuLaunchKernelEx" : "cuLaunchKernel",
                                status);
        }
    }
    if (stream == self->copy_stream) {
        self->ran_on_copy_stream = 1;
    } else {
        /* plan() must not rewrite the workspace before these launches have read it. */
        status = self->event_record((void *)self->run_done, (void *)stream);
        if (status != 0) {
            Py_DECREF(result);
            return driver_error(self, "cuEventRecord", status);
        }
        self->ran = 1;
    }
    return result;
}

/* The validated call's params (FastRun's `params` argument): its scalars as given, its
 * device arrays read now. */
static int init_params(FastRun *self, PyObject *params) {
    if (params == Py_None) {
        Py_INCREF(Py_None);
        self->params = Py_None;
        return 0;
    }
    PyObject *scalars, *tensors;
    if (!PyArg_ParseTuple(params, "O!O!", &PyTuple_Type, &scalars, &PyTuple_Type, &tensors))
        return -1;
    Py_INCREF(scalars);
    self->params = scalars;
    Py_ssize_t n = PyTuple_GET_SIZE(tensors);
    if (n > MAX_TENSOR_PARAMS) {
        PyErr_SetString(PyExc_ValueError, "FastRun: too many device-array params");
        return -1;
    }
    self->num_params = PyTuple_GET_SIZE(scalars) + n;
    for (Py_ssize_t j = 0; j < n; j++) {
        TensorParam *t = &self->tensors[self->num_tensors];
        PyObject *name, *array;
        uintptr_t ptr;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(tensors, j), "UOii", &name, &array, &t->kind,
                              &t->index))
            return -1;
        if ((t->kind != ARRAY_TORCH && t->kind != ARRAY_CUPY) || t->index < 0) {
            PyErr_SetString(PyExc_ValueError, "FastRun: a device-array param's kind or index");
            return -1;
        }
        if (read_array_of(self, t->kind, array, &t->expected, &ptr) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "FastRun: a param's array cannot be read");
            return -1;
        }
        Py_INCREF(name);
        t->name = name;
        if (self->dlpack == NULL || t->kind != ARRAY_TORCH) {  /* dtype compared by identity */
            t->dtype = (PyObject *)t->expected.dtype;
            Py_INCREF(t->dtype);
        }
        self->num_tensors++;
    }
    return 0;
}

/* FastRun(array_kind, dlpack_api, arrays, params, sm_scale, launches, stream_fn, empty_like,
 *         waited, context, copy_stream, run_done, driver)
 * dlpack_api: the arrays' type's __dlpack_c_exchange_api__ capsule, or None;
 * arrays: the validated call's q, k_cache, v_cache, out (None: allocate one per call);
 * params: None, or (scalars, tensors) of its params dict: ((name, type, value), ...) and
 * ((name, array, kind, index), ...) (kind: ARRAY_TORCH or ARRAY_CUPY; index: the param's
 * place among the variant's);
 * launches: (fn, grid3, block3, smem, slots4, params0, packed bytes, dependent) each;
 * driver: addresses of cuLaunchKernel, cuStreamIsCapturing, cuCtxGetCurrent,
 * cuEventRecord, cuGetErrorName (0: no names in errors), cuLaunchKernelEx (0: none; then
 * no launch may be dependent). */
static int FastRun_init(FastRun *self, PyObject *args, PyObject *kwargs) {
    PyObject *api, *arrays, *params, *launches, *driver;
    unsigned long long context, copy_stream, run_done;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "FastRun takes positional arguments only");
        return -1;
    }
    if (self->launches != NULL) {
        PyErr_SetString(PyExc_TypeError, "FastRun is initialised once");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "iOO!OOO!OOO!KKKO!", &self->array_kind, &api, &PyTuple_Type,
                          &arrays, &params, &self->sm_scale, &PyTuple_Type, &launches,
                          &self->stream_fn, &self->empty_like, &PySet_Type, &self->waited,
                          &context, &copy_stream, &run_done, &PyTuple_Type, &driver))
        return -1;
    Py_INCREF(self->sm_scale);
    Py_INCREF(self->stream_fn);
    Py_INCREF(self->empty_like);
    Py_INCREF(self->waited);
    if (PyTuple_GET_SIZE(arrays) != NUM_ARRAYS || PyTuple_GET_SIZE(driver) != 6) {
        PyErr_SetString(PyExc_ValueError, "FastRun: 4 arrays and 6 driver entry points");
        return -1;
    }
    if (api != Py_None) {
        const DLPackExchangeAPI *dlpack = PyCapsule_GetPointer(api, "dlpack_exchange_api");
        if (dlpack == NULL) return -1;
        if (dlpack->version.major == 1 && dlpack->dltensor_from_py_object_no_sync != NULL &&
            dlpack->current_work_stream != NULL)
            self->dlpack = dlpack;  /* another major version: the attribute path */
    }
    if (init_params(self, params) < 0) return -1;
    self->allocate = PyTuple_GET_ITEM(arrays, OUT) == Py_None;
    for (int i = 0; i < NUM_ARRAYS - self->allocate; i++) {
        uintptr_t ptr;
        if (read_array(self, PyTuple_GET_ITEM(arrays, i), &self->expected[i], &ptr) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "FastRun: an array cannot be read");
            return -1;
        }
        if (self->dlpack == NULL) {  /* keep the dtype alive: its address is the key */
            self->dtypes[i] = (PyObject *)self->expected[i].dtype;
            Py_INCREF(self->dtypes[i]);
        }
    }
    self->context = (uintptr_t)context;
    self->copy_stream = (uintptr_t)copy_stream;
    self->run_done = (uintptr_t)run_done;
    uintptr_t fns[6];
    for (int i = 0; i < 6; i++) {
        fns[i] = (uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(driver, i));
        if (PyErr_Occurred()) return -1;
    }
    if (!fns[0] || !fns[1] || !fns[2] || !fns[3]) {
        PyErr_SetString(PyExc_ValueError, "FastRun: a driver entry point is missing");
        return -1;
    }
    self->launch = (LaunchFn)fns[0];
    self->is_capturing = (IsCapturingFn)fns[1];
    self->ctx_get_current = (CtxGetCurrentFn)fns[2];
    self->event_record = (EventRecordFn)fns[3];
    self->get_error_name = (GetErrorNameFn)fns[4];
    self->launch_ex = (LaunchExFn)fns[5];

    Py_ssize_t n = PyTuple_GET_SIZE(launches);
    self->launches = PyMem_Calloc(n ? n : 1, sizeof(Launch));
    if (self->launches == NULL) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        Launch *l = &self->launches[self->num_launches];
        unsigned long long fn;
        Py_buffer packed;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(launches, i), "K(III)(III)I(iiii)iy*p", &fn,
                              &l->grid[0], &l->grid[1], &l->grid[2], &l->block[0],
                              &l->block[1], &l->block[2], &l->smem, &l->slot[Q], &l->slot[K],
                              &l->slot[V], &l->slot[OUT], &l->params0, &packed,
                              &l->dependent))
            return -1;
        if (l->dependent && self->launch_ex == NULL) {
            PyBuffer_Release(&packed);
            PyErr_SetString(PyExc_ValueError, "FastRun: a dependent launch needs cuLaunchKernelEx");
            return -1;
        }
        Py_ssize_t slots = packed.len / 8;
        int bad = packed.len % 8 != 0 || slots == 0;
        for (int a = 0; a < NUM_ARRAYS; a++) bad |= l->slot[a] >= slots;
        for (int j = 0; j < self->num_tensors; j++)
            bad |= l->params0 < 0 || l->params0 + self->tensors[j].index >= slots;
        if (bad) {
            PyBuffer_Release(&packed);
            PyErr_SetString(PyExc_ValueError, "FastRun: packed arguments are 8-byte slots");
            return -1;
        }
        l->values = PyMem_Malloc(packed.len);
        l->params = PyMem_Malloc(slots * sizeof(void *));
        if (l->values == NULL || l->params == NULL) {
            PyMem_Free(l->values);
            PyMem_Free(l->params);
            PyBuffer_Release(&packed);
            PyErr_NoMemory();
            return -1;
        }
        memcpy(l->values, packed.buf, packed.len);
        PyBuffer_Release(&packed);
        for (Py_ssize_t s = 0; s < slots; s++) l->params[s] = &l->values[s];
        l->fn = (void *)(uintptr_t)fn;
        self->num_launches++;
    }
    return 0;
}

static void FastRun_dealloc(FastRun *self) {
    for (int i = 0; i < NUM_ARRAYS; i++) Py_XDECREF(self->dtypes[i]);
    for (int j = 0; j < self->num_tensors; j++) {
        Py_XDECREF(self->tensors[j].name);
        Py_XDECREF(self->tensors[j].dtype);
    }
    Py_XDECREF(self->params);
    Py_XDECREF(self->sm_scale);
    Py_XDECREF(self->stream_fn);
    Py_XDECREF(self->empty_like);
    Py_XDECREF(self->waited);
    for (int i = 0; i < self->num_launches; i++) {
        PyMem_Free(self->launches[i].values);
        PyMem_Free(self->launches[i].params);
    }
    PyMem_Free(self->launches);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef FastRun_members[] = {
    {"ran", T_INT, offsetof(FastRun, ran), 0, "launched on a stream other than plan()'s copy"},
    {"ran_on_copy_stream", T_INT, offsetof(FastRun, ran_on_copy_stream), 0,
     "launched on plan()'s copy stream"},
    {NULL},
};

static PyTypeObject FastRunType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "attnlang._hostpath.FastRun",
    .tp_doc = "run()'s per-call path for one validated call signature (see hostpath.c).",
    .tp_basicsize = sizeof(FastRun),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)FastRun_init,
    .tp_dealloc = (destructor)FastRun_dealloc,
    .tp_call = (ternaryfunc)FastRun_call,
    .tp_members = FastRun_members,
};

static struct PyModuleDef hostpath_module = {
    PyModuleDef_HEAD_INIT, .m_name = "_hostpath",
    .m_doc = "run()'s per-call path in C (see hostpath.c).", .m_size = -1,
};

PyMODINIT_FUNC PyInit__hostpath(void) {
    struct { PyObject **name; const char *text; } names[] = {
        {&str_shape, "shape"}, {&str_stride, "stride"}, {&str_strides, "strides"},
        {&str_dtype, "dtype"}, {&str_get_device, "get_device"}, {&str_device, "device"},
        {&str_id, "id"}, {&str_data_ptr, "data_ptr"}, {&str_data, "data"}, {&str_ptr, "ptr"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if ((*names[i].name = PyUnicode_InternFromString(names[i].text)) == NULL) return NULL;
    if (PyType_Ready(&FastRunType) < 0) return NULL;
    PyObject *m = PyModule_Create(&hostpath_module);
    if (m == NULL) return NULL;
    Py_INCREF(&FastRunType);
    if (PyModule_AddObject(m, "FastRun", (PyObject *)&FastRunType) < 0) {
        Py_DECREF(&FastRunType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
