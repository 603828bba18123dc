"""run()'s C path (attnlang/runtime/hostpath.c) without a GPU: fake driver entry points.

FastRun must launch exactly the validated call's arguments with the new pointers, and must
hand everything else back to the Python path (return None, launch nothing): another shape,
dtype, strides, type, params, sm_scale, a misaligned pointer, another context, capture, a
stream not yet ordered after plan()'s copy. The GPU tests run the same path on the device.
"""

import ctypes
import struct

import pytest

from attnlang.runtime import hostpath

try:
    import torch
except ImportError:  # the tests below that need it skip; FakeTensor's run everywhere
    torch = None

CONTEXT, COPY_STREAM, RUN_DONE, FN = 0x1000, 0x2000, 0x3000, 0x4000
SLOTS = 8  # packed 8-byte arguments of the fake kernel: q k v out lse, then 3 more

_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7,
                           ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)
_IS_CAPTURING = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))
_CTX = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))
_RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_NAME = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))


class _Attribute(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("dims", ctypes.c_uint * 6), ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


_LAUNCH_EX = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_Config), ctypes.c_void_p,
                              ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)


class FakeDriver:
    """The six driver entry points, recording what FastRun asks of them (a launch through
    cuLaunchKernelEx with its attributes as (id, value) pairs after the launch's fields)."""

    def __init__(self):
        self.launches, self.records = [], []
        self.context, self.capturing, self.launch_status = CONTEXT, 0, 0

        def launch(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
            values = [ctypes.cast(params[i], ctypes.POINTER(ctypes.c_uint64))[0]
                      for i in range(SLOTS)]
            self.launches.append((f, (gx, gy, gz), (bx, by, bz), smem, stream or 0, values))
            return self.launch_status

        def launch_ex(config, f, params, extra):
            c = config[0]
            values = [ctypes.cast(params[i], ctypes.POINTER(ctypes.c_uint64))[0]
                      for i in range(SLOTS)]
            attributes = [(c.attrs[i].id, c.attrs[i].value) for i in range(c.num_attrs)]
            self.launches.append((f, tuple(c.dims[:3]), tuple(c.dims[3:]), c.smem,
                                  c.stream or 0, values, attributes))
            return self.launch_status

        def is_capturing(stream, status):
            status[0] = self.capturing
            return 0

        def ctx_get_current(ctx):
            ctx[0] = self.context
            return 0

        def event_record(event, stream):
            self.records.append((event, stream or 0))
            return 0

        def error_name(status, name):
            name[0] = b"CUDA_ERROR_LAUNCH_FAILED"
            return 0

        # Kept referenced: FastRun holds only their addresses.
        self._fns = (_LAUNCH(launch), _IS_CAPTURING(is_capturing), _CTX(ctx_get_current),
                     _RECORD(event_record), _NAME(error_name), _LAUNCH_EX(launch_ex))
        self.addresses = tuple(ctypes.cast(f, ctypes.c_void_p).value for f in self._fns)


@pytest.fixture(scope="module")
def module():
    built = hostpath.load()
    if built is None:
        pytest.skip(f"no C path here: {hostpath.unavailable_reason()}")
    return built


DLPACK_API = getattr(getattr(torch, "Tensor", None), "__dlpack_c_exchange_api__", None)


@pytest.fixture(params=["attributes", "dlpack"])
def reader(request):
    """How FastRun reads arrays: their Python attributes, or DLPack's C exchange API (torch
    >= 2.10), whose current stream on the CPU is 0."""
    if torch is None:
        pytest.skip("needs torch (test_fake_tensors_without_torch runs without it)")
    if request.param == "dlpack" and DLPACK_API is None:
        pytest.skip("this torch has no __dlpack_c_exchange_api__")
    return request.param


class FakeTensor:
    """What FastRun's attribute reader reads of a torch tensor, and nothing else."""

    def __init__(self, shape, address, dtype="bf16"):
        self.shape, self.dtype, self._address = tuple(shape), dtype, address

    def stride(self):
        out, step = [], 1
        for n in reversed(self.shape):
            out.insert(0, step)
            step *= n
        return tuple(out)

    def get_device(self):
        return 0

    def data_ptr(self):
        return self._address


def test_fake_tensors_without_torch(module):
    driver = FakeDriver()
    q, k, v, o = (FakeTensor(s, a) for s, a in (((4, 8, 16), 0x100), ((6, 2, 2, 16), 0x200),
                                                 ((6, 2, 2, 16), 0x300), ((4, 8, 16), 0x400)))
    launches = ((FN, (5, 1, 1), (128, 1, 1), 1024, (0, 1, 2, 3), 6, PACKED, False),)
    fast = module.FastRun(hostpath.TORCH, None, (q, k, v, o), None, None, launches,
                          lambda: COPY_STREAM, None, set(), CONTEXT, COPY_STREAM, RUN_DONE,
                          driver.addresses)
    q2, o2 = FakeTensor(q.shape, 0x1100), FakeTensor(o.shape, 0x1400)
    assert fast(q2, (k, v), None, o2, None) is o2
    assert driver.launches[0][5][:5] == [0x1100, 0x200, 0x300, 0x1400, 0xAAA0]
    for bad in (FakeTensor((2, 8, 16), 0x1100), FakeTensor(q.shape, 0x1100, "fp16"),
                FakeTensor(q.shape, 0x1108)):
        assert fast(bad, (k, v), None, o2, None) is None
    assert len(driver.launches) == 1


def arrays():
    q = torch.randn(4, 8, 16, dtype=torch.bfloat16)
    k = torch.randn(6, 2, 2, 16, dtype=torch.bfloat16)
    return q, k, torch.randn_like(k), torch.empty_like(q)


PACKED = struct.pack(f"<{SLOTS}Q", 0, 0, 0, 0, 0xAAA0, 11, 22, 33)


def make(module, driver, reader, *, out=True, scalars=None, tensors=(), sm_scale=None,
         stream=None, waited=(), merge=False, validated=None):
    """A FastRun validated on fresh arrays (or `validated`); the current stream is `stream`
    (attributes reader; default: plan()'s copy stream). Params: None, or the scalars
    ((name, type, value), ...) and device arrays ((name, array, kind, index), ...); the
    variant's params start at slot 6 (the merge kernel's at 7: its out is slot 6)."""
    q, k, v, o = validated or arrays()
    slots = (-1, -1, -1, 6) if merge else (0, 1, 2, 3)
    launches = ((FN, (5, 1, 1), (128, 1, 1), 1024, slots, 7 if merge else 6, PACKED, merge),)
    params = None if scalars is None and not tensors else (scalars or (), tuple(tensors))
    api = DLPACK_API if reader == "dlpack" else None
    copy_stream = 0 if reader == "dlpack" else COPY_STREAM
    current = copy_stream if stream is None else stream
    return module.FastRun(hostpath.TORCH, api, (q, k, v, o if out else None), params, sm_scale,
                          launches, lambda: current, torch.empty_like, set(waited), CONTEXT,
                          copy_stream, RUN_DONE, driver.addresses)


def test_a_validated_signature_launches_with_the_new_pointers(module, reader):
    driver = FakeDriver()
    fast = make(module, driver, reader)
    q, k, v, o = arrays()  # new buffers, same signatures
    assert fast(q, (k, v), None, o, None) is o
    [(f, grid, block, smem, stream, values)] = driver.launches
    copy_stream = 0 if reader == "dlpack" else COPY_STREAM
    assert (f, grid, block, smem, stream) == (FN, (5, 1, 1), (128, 1, 1), 1024, copy_stream)
    assert values == [q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), 0xAAA0, 11, 22, 33]
    assert driver.records == [] and fast.ran_on_copy_stream == 1 and fast.ran == 0


def test_the_output_is_allocated_when_out_was_not_given(module, reader):
    driver = FakeDriver()
    fast = make(module, driver, reader, out=False)
    q, k, v, _ = arrays()
    out = fast(q, [k, v], None, None, None)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert driver.launches[0][5][3] == out.data_ptr()


def test_merge_launches_get_only_out(module, reader):
    driver = FakeDriver()
    fast = make(module, driver, reader, merge=True)
    q, k, v, o = arrays()
    fast(q, (k, v), None, o, None)
    assert driver.launches[0][5] == [0, 0, 0, 0, 0xAAA0, 11, o.data_ptr(), 33]


def test_a_dependent_launch_goes_through_launch_kernel_ex(module, reader):
    # the merge kernel's programmatic dependent launch: the same launch, one attribute
    # (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6, allowed)
    driver = FakeDriver()
    fast = make(module, driver, reader, merge=True)
    q, k, v, o = arrays()
    fast(q, (k, v), None, o, None)
    [(f, grid, block, smem, stream, values, attributes)] = driver.launches
    assert (f, grid, block, smem) == (FN, (5, 1, 1), (128, 1, 1), 1024)
    assert stream == (0 if reader == "dlpack" else COPY_STREAM)
    assert values == [0, 0, 0, 0, 0xAAA0, 11, o.data_ptr(), 33]
    assert attributes == [(6, 1)]
    driver.launch_status = 719
    with pytest.raises(RuntimeError, match="cuLaunchKernelEx failed"):
        fast(q, (k, v), None, o, None)


class FakeCupy:
    """What FastRun's attribute reader reads of a CuPy array."""

    def __init__(self, shape, address, dtype="float32"):
        self.shape, self.dtype = tuple(shape), dtype
        self.strides = tuple(4 * n for n in (shape[1:] + (1,)))[:len(shape)]
        self.device = type("Device", (), {"id": 0})()
        self.data = type("Memory", (), {"ptr": address})()


def test_device_array_params_are_read_again_per_call(module, reader):
    # an fp8 cache's scales (CuPy arrays beside torch tensors where the scale was a float)
    # and a torch tensor param: each call's addresses land in the variant's param slots
    driver = FakeDriver()
    slopes = torch.randn(8)
    k_scale, v_scale = FakeCupy((2,), 0x7000), FakeCupy((2,), 0x7100)
    fast = make(module, driver, reader, scalars=(("cap", float, 30.0),),
                tensors=(("slopes", slopes, hostpath.TORCH, 0),
                         ("k_scale", k_scale, hostpath.CUPY, 1)))
    q, k, v, o = arrays()
    slopes2, k_scale2 = torch.randn(8), FakeCupy((2,), 0x7200)
    assert fast(q, (k, v), {"cap": 30.0, "slopes": slopes2, "k_scale": k_scale2}, o, None) is o
    assert driver.launches[0][5][6:] == [slopes2.data_ptr(), 0x7200]
    for params in ({"cap": 30.0, "slopes": torch.randn(4), "k_scale": k_scale2},  # shape
                   {"cap": 30.0, "slopes": slopes2.double(), "k_scale": k_scale2},  # dtype
                   {"cap": 30.0, "slopes": slopes2, "k_scale": FakeCupy((3,), 0x7200)},
                   {"cap": 30.0, "slopes": slopes2, "k_scale": v_scale.data},  # not an array
                   {"cap": 30.0, "slopes": slopes2}, {"cap": 30.0, "k_scale": k_scale2,
                                                      "scales": slopes2},
                   {"cap": 29.0, "slopes": slopes2, "k_scale": k_scale2}, None):
        assert fast(q, (k, v), params, o, None) is None, params
    assert len(driver.launches) == 1


def test_device_array_params_of_the_merge_kernel(module, reader):
    driver = FakeDriver()
    scale = FakeCupy((2,), 0x7000)
    fast = make(module, driver, reader, tensors=(("v_scale", scale, hostpath.CUPY, 0),),
                merge=True)
    q, k, v, o = arrays()
    fast(q, (k, v), {"v_scale": FakeCupy((2,), 0x7300)}, o, None)
    assert driver.launches[0][5] == [0, 0, 0, 0, 0xAAA0, 11, o.data_ptr(), 0x7300]


def test_another_stream_records_run_done_once_ordered(module):
    if torch is None:
        pytest.skip("needs torch")
    driver = FakeDriver()
    q, k, v, o = arrays()
    not_waited = make(module, driver, "attributes", stream=0x77)
    assert not_waited(q, (k, v), None, o, None) is None
    fast = make(module, driver, "attributes", stream=0x77, waited={0x77})
    assert fast(q, (k, v), None, o, None) is o
    assert driver.records == [(RUN_DONE, 0x77)] and fast.ran == 1


def test_scalar_params_and_sm_scale_must_match_exactly(module, reader):
    driver = FakeDriver()
    fast = make(module, driver, reader, scalars=(("cap", float, 30.0), ("n", int, 3)),
                sm_scale=0.5)
    q, k, v, o = arrays()
    assert fast(q, (k, v), {"cap": 30.0, "n": 3}, o, 0.5) is o
    for params, sm_scale in (({"cap": 30.0, "n": 3}, None), ({"cap": 30.0, "n": 3}, 1),
                             ({"cap": 29.0, "n": 3}, 0.5), ({"cap": 30.0, "n": True}, 0.5),
                             ({"cap": 30.0}, 0.5), ({"cap": 30.0, "m": 3}, 0.5),
                             ({"cap": 30.0, "n": 3, "x": 1}, 0.5), (None, 0.5)):
        assert fast(q, (k, v), params, o, sm_scale) is None, (params, sm_scale)
    assert len(driver.launches) == 1


def test_anything_else_goes_back_to_the_python_path(module, reader):
    driver = FakeDriver()
    fast = make(module, driver, reader)
    q, k, v, o = arrays()
    misaligned = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)
    others = [
        (q[:2], (k, v), o),                             # shape
        (q.float(), (k, v), o),                         # dtype
        (q, (k.transpose(1, 2), v), o),                 # strides (same shape: 2 x 2)
        (torch.nn.Parameter(q), (k, v), o),             # type
        (misaligned, (k, v), o),                        # 16-byte alignment
        (q, (k, v, v), o), (q, k, o), (q, (k, v), None),  # not a pair; out missing
    ]
    for q_, kv, o_ in others:
        assert fast(q_, kv, None, o_, None) is None
    driver.context = 0x999
    assert fast(q, (k, v), None, o, None) is None
    driver.context, driver.capturing = CONTEXT, 1
    assert fast(q, (k, v), None, o, None) is None
    assert driver.launches == []


def test_a_failed_launch_raises_with_the_driver_name(module, reader):
    driver = FakeDriver()
    driver.launch_status = 719
    q, k, v, o = arrays()
    with pytest.raises(RuntimeError, match="cuLaunchKernel failed: CUDA_ERROR_LAUNCH_FAILED"):
        make(module, driver, reader)(q, (k, v), None, o, None)


def test_bad_construction_is_refused(module):
    if torch is None:
        pytest.skip("needs torch")
    driver = FakeDriver()
    q, k, v, o = arrays()
    with pytest.raises(ValueError, match="4 arrays"):
        module.FastRun(0, None, (q, k, v), None, None, (), lambda: 0, torch.empty_like, set(),
                       1, 0, 0, driver.addresses)
    with pytest.raises(ValueError, match="8-byte slots"):
        module.FastRun(0, None, (q, k, v, o), None, None,
                       ((FN, (1, 1, 1), (1, 1, 1), 0, (0, 1, 2, 3), 6, b"\0" * 12, False),),
                       lambda: 0, torch.empty_like, set(), 1, 0, 0, driver.addresses)
    with pytest.raises(ValueError, match="8-byte slots"):  # a param slot past the arguments
        make(module, driver, "attributes", tensors=(("t", torch.randn(2), hostpath.TORCH, 2),))
    with pytest.raises(ValueError, match="needs cuLaunchKernelEx"):
        module.FastRun(0, None, (q, k, v, o), None, None,
                       ((FN, (1, 1, 1), (1, 1, 1), 0, (0, 1, 2, 3), 6, PACKED, True),),
                       lambda: 0, torch.empty_like, set(), 1, 0, 0, driver.addresses[:5] + (0,))


def test_the_python_path_can_be_chosen(monkeypatch):
    monkeypatch.setenv("ATTNLANG_HOST_PATH", "python")
    assert hostpath.load() is None
    assert hostpath.unavailable_reason() == "ATTNLANG_HOST_PATH=python"
    monkeypatch.setenv("ATTNLANG_HOST_PATH", "fast")
    with pytest.raises(ValueError, match="ATTNLANG_HOST_PATH must be"):
        hostpath.load()


def test_a_failed_build_warns_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setattr(hostpath, "_reason", None)  # restored after the test
    monkeypatch.setenv("ATTNLANG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hostpath.sysconfig, "get_config_var",
                        lambda name: "false" if name == "CC" else ".so")
    with pytest.warns(RuntimeWarning, match="Python path .* could not be built"):
        assert hostpath._load_or_explain() is None
    assert "failed" in hostpath.unavailable_reason()
    assert not list(tmp_path.rglob("*.tmp"))
