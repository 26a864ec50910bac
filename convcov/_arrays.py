"""Array kinds, devices and dtypes: how convcov recognises what the user holds.

Owns: telling a numpy array, a torch tensor, a CuPy array and any other object with
``__cuda_array_interface__`` apart; reading their shape, strides, dtype, data pointer and
device; zero-copy host (numpy) views of host tensors; and allocating a result "like" an
input (``patch_moment``).

Rule: never import a framework the user has not imported. A torch tensor can only exist
if ``torch`` is already in ``sys.modules``, so kinds are recognised by looking there
(the habit of array-api-compat), never by importing.
"""

from __future__ import annotations

import math
import operator
import sys
from typing import NamedTuple

import numpy as np

#: The dtypes convcov computes on, by name. bfloat16 arrives as torch tensors (or numpy
#: arrays of ml_dtypes' bfloat16); it has no numpy dtype, so host views hold its bits as uint16.
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}

_NUMPY_TYPESTR = {"f2": "float16", "f4": "float32", "f8": "float64"}


class ArrayInfo(NamedTuple):
    """What the front end and the GPU backends need to know about one array."""

    kind: str  # "numpy" | "torch" | "cupy" | "cai"
    device: tuple  # ("cpu", None) or ("cuda", ordinal or None when unknown)
    dtype: str  # one of FLOAT_DTYPES (or the foreign name, before validation rejects it)
    shape: tuple
    strides: tuple  # in elements
    ptr: int  # address of element [0, ..., 0]
    readonly: bool
    #: A generic CUDA array's ``__cuda_array_interface__`` "stream" (v3): the stream its
    #: producer's pending work on it is queued on, None when nothing is pending. Always
    #: None for numpy arrays, torch tensors and CuPy arrays (their library's current
    #: stream is the one that matters).
    stream: int | None = None


def _torch():
    return sys.modules.get("torch")


def _cupy():
    return sys.modules.get("cupy")


def is_torch(x) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def is_cupy(x) -> bool:
    cupy = _cupy()
    return cupy is not None and isinstance(x, cupy.ndarray)


_NUMPY_NAMES = {np.dtype(n): n for n in ("float16", "float32", "float64")}
_TORCH_NAMES: dict = {}  # torch.dtype -> name, filled on first use (torch is imported then)


def _numpy_dtype_name(dt: np.dtype) -> str:
    name = _NUMPY_NAMES.get(dt)  # dt.name costs ~1.5 µs: too much on the toy workload
    if name is not None:
        return name
    return "bfloat16" if dt.name == "bfloat16" else str(dt)  # ml_dtypes.bfloat16


def _torch_dtype_name(dt) -> str:
    name = _TORCH_NAMES.get(dt)
    if name is None:
        name = _TORCH_NAMES[dt] = str(dt).removeprefix("torch.")
    return name


def _elem_strides(byte_strides, itemsize):
    # numpy allows byte strides that are not multiples of the item size (as_strided tricks);
    # convcov indexes in elements, so validation refuses such arrays (strides None).
    strides = tuple([s // itemsize for s in byte_strides])
    if itemsize > 1 and any([s % itemsize for s in byte_strides]):
        return None
    return strides


_HOST = ("cpu", None)


def info(x, name: str) -> ArrayInfo:
    """Describe array argument ``name``; TypeError for anything that is not an array.

    Called four times per ``accumulate``: every attribute read here is on the hot path of
    small calls, hence the dtype-name caches.
    """
    if isinstance(x, np.ndarray):
        if type(x) is not np.ndarray and isinstance(x, np.ma.MaskedArray):
            raise TypeError(f"{name}: masked arrays are not supported (the mask would be "
                            f"ignored); pass {name}.filled(...) or {name}.data")
        return ArrayInfo("numpy", _HOST, _numpy_dtype_name(x.dtype), x.shape,
                         _elem_strides(x.strides, x.itemsize),
                         x.__array_interface__["data"][0], not x.flags.writeable)
    if is_torch(x):
        if x.is_cuda:
            device = ("cuda", x.get_device())
        else:
            dev = x.device
            device = _HOST if dev.type == "cpu" else (dev.type, dev.index)
        if x.layout is not _torch().strided:
            raise TypeError(f"{name}: expected a dense (strided) torch tensor; got layout "
                            f"{x.layout}")
        if x.is_neg():
            # A lazily negated view (e.g. z.conj().imag): its memory holds -x, and the
            # kernels read memory.
            raise TypeError(f"{name}: is a lazily negated view (is_neg() is True); pass "
                            f"{name}.resolve_neg()")
        try:
            strides, ptr = x.stride(), x.data_ptr()
        except RuntimeError as exc:  # no storage: functorch's wrappers (vmap), and the like
            raise TypeError(f"{name}: a torch tensor without readable memory ({exc})") from None
        return ArrayInfo("torch", device, _torch_dtype_name(x.dtype), tuple(x.shape),
                         strides, ptr, False)
    if is_cupy(x):
        return ArrayInfo("cupy", ("cuda", x.device.id), _numpy_dtype_name(x.dtype), x.shape,
                         _elem_strides(x.strides, x.dtype.itemsize), x.data.ptr, False)
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        typestr = cai["typestr"]
        # Little-endian (or byte-order free) only: GPUs read memory little-endian, so a
        # big-endian typestr keeps its full name and validation refuses it.
        dtype = _NUMPY_TYPESTR.get(typestr[1:], typestr) if typestr[0] in "<|" else typestr
        itemsize = np.dtype(typestr).itemsize
        shape = tuple(cai["shape"])
        strides = cai.get("strides")
        if strides is None:  # C-contiguous
            strides, acc = [], itemsize
            for n in reversed(shape):
                strides.append(acc)
                acc *= max(n, 1)
            strides = tuple(reversed(strides))
        ptr, readonly = cai["data"]
        stream = cai.get("stream")
        if stream is not None:
            # CAI v3: None, or an integer stream handle (1: the legacy default stream, 2:
            # the per-thread default stream; NumPy integers count). A producer's stream
            # is waited for, never guessed: what cannot be a handle is refused.
            try:
                if isinstance(stream, (bool, np.bool_)):
                    raise TypeError
                stream = operator.index(stream)
                if stream < 0:
                    raise TypeError
            except TypeError:
                raise TypeError(f"{name}: __cuda_array_interface__['stream'] must be None "
                                f"or a non-negative integer stream handle; got {stream!r}"
                                ) from None
        return ArrayInfo("cai", ("cuda", _cai_device(x, ptr)), dtype, shape,
                         _elem_strides(strides, itemsize), ptr, bool(readonly), stream)
    raise TypeError(
        f"{name}: expected a numpy.ndarray, torch.Tensor, cupy.ndarray or an object with "
        f"__cuda_array_interface__; got {type(x).__module__}.{type(x).__qualname__}"
    )


def _cai_device(x, ptr) -> int | None:
    """Device ordinal of a generic CUDA array (numba device arrays and the like): the
    driver's (``pointer_device``), else numba's own record; None when neither knows.
    (The driver first: numba records the context current when an array was made, and a
    wrapper of another device's memory, ``cuda.as_cuda_array``, records the wrong one.)"""
    device = pointer_device(ptr)
    if device is None and hasattr(x, "gpu_data") and sys.modules.get("numba.cuda"):
        try:
            return x.gpu_data.context.device.id  # numba DeviceNDArray
        except AttributeError:
            pass
    return device


_driver_module = None  # cuda.bindings.driver once imported; False: cuda-python is unusable
_unanswered: set = set()  # driver calls that raised: no driver library, or a driver without them
_initialised = False  # the driver answered once that CUDA is initialised (it stays so)


def _driver():
    """``cuda.bindings.driver`` (cuda-python's driver API, on which Numba's CUDA target runs),
    imported when a generic CUDA array first needs the driver; None where it is not
    installed. Importing it loads no driver library; its first call does, and never
    initialises CUDA (``cuInit``): a driver that no library has initialised answers
    CUDA_ERROR_NOT_INITIALIZED."""
    global _driver_module
    drv = _driver_module
    if drv is None:
        try:
            from cuda.bindings import driver as drv
        except Exception:  # not installed, or an install that cannot load
            drv = False
        _driver_module = drv
    return drv or None


def _ask(drv, name: str, *args):
    """The value driver call ``name`` returns for ``args`` (cuda.bindings returns a
    ``(CUresult, value)`` tuple); None for an error result, and for a call that raises (no
    driver library on this machine, or a driver older than the call), which is then not
    made again."""
    if name in _unanswered:
        return None
    try:
        err, value = getattr(drv, name)(*args)
    except Exception:
        _unanswered.add(name)
        return None
    return value if err == drv.CUresult.CUDA_SUCCESS else None


def _driver_initialised(drv) -> bool:
    """Whether some library has initialised CUDA in this process (``cuDeviceGetCount``
    answers CUDA_ERROR_NOT_INITIALIZED until then). Stream calls dereference their handle
    even before that, so a handle is only passed to the driver once it can be real."""
    global _initialised
    if not _initialised:
        _initialised = _ask(drv, "cuDeviceGetCount") is not None
    return _initialised


def pointer_device(ptr: int) -> int | None:
    """Ordinal of the device that holds address ``ptr``, from the CUDA driver
    (``cuPointerGetAttribute`` through cuda-python); None when cuda-python or the driver
    is missing, the driver has not been initialised (no CUDA array can exist then), or it
    does not know the address. Nothing but a missing driver is remembered: an address
    asked about before the driver was initialised is answered once it is.

    Without this, an array whose producer records no device would be computed on the
    current device, wherever it lives."""
    if not ptr:  # no address (an empty array): nothing to ask
        return None
    drv = _driver()
    if drv is None:
        return None
    ordinal = _ask(drv, "cuPointerGetAttribute",
                   drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, int(ptr))
    return None if ordinal is None else int(ordinal)


#: Stream handles that name a default stream of whichever device is current (the null
#: handle and CU_STREAM_LEGACY: the legacy one; CU_STREAM_PER_THREAD), not one device's.
DEFAULT_STREAMS = (0, 1, 2)


def stream_device(handle: int) -> int | None:
    """Ordinal of the device that stream ``handle`` belongs to, from the CUDA driver
    (``cuStreamGetDevice`` through cuda-python, drivers for CUDA 12.8 and later); None for
    a default-stream handle (``DEFAULT_STREAMS``), for a stream being captured into a CUDA
    graph, and when cuda-python or the driver is missing, the driver is older, or it does
    not know the handle. A generic CUDA array that names another device's stream is
    refused before anything is queued (``_frontend._check_streams``): a launch there would
    run on that device with this one's addresses."""
    if handle in DEFAULT_STREAMS:
        return None
    drv = _driver()
    if drv is None:
        return None
    if not _driver_initialised(drv):  # no stream can exist, and the driver reads the handle
        return None
    stream = drv.CUstream(int(handle))
    # Asked of a stream being captured, cuStreamGetDevice ends the capture with an error:
    # such a stream is the backends' to refuse (a BackendError).
    status = _ask(drv, "cuStreamIsCapturing", stream)
    if status is None or status != drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE:
        return None
    device = _ask(drv, "cuStreamGetDevice", stream)
    return None if device is None else int(device)


def span(a: ArrayInfo) -> tuple[int, int] | None:
    """[lo, hi) byte range an array can touch, relative to its address; None when it has
    no elements."""
    if 0 in a.shape:
        return None
    size = ITEMSIZE.get(a.dtype, 1)
    spans = [(n - 1) * s for n, s in zip(a.shape, a.strides)]
    return (size * sum([d for d in spans if d < 0]),
            size * (sum([d for d in spans if d > 0]) + 1))


#: Elements an undecided layout's offsets are enumerated up to (a few milliseconds, once a
#: signature); beyond it such a layout is refused rather than guessed.
OVERLAP_SEARCH = 1 << 20


def self_overlapping(a: ArrayInfo) -> bool | None:
    """Whether two elements of ``a`` lie at one address: True, False, or None where that
    cannot be settled cheaply (the front end refuses such an out).

    Two elements meet where ``sum of d[k] * stride[k] = 0`` for a nonzero ``d`` with
    ``|d[k]| < shape[k]``. Settled, cheapest first: a zero stride or two equal strides on
    dims longer than 1 meet; a dim whose stride exceeds all that the others reach
    together must have ``d = 0`` and is set aside (repeatedly, largest first: every view
    of a dense array is settled so); a stride that is a small enough multiple of another
    meets it; what remains is searched element by element up to ``OVERLAP_SEARCH``
    elements."""
    if 0 in a.shape:
        return False
    dims = sorted([(abs(s), n) for n, s in zip(a.shape, a.strides) if n > 1])
    strides = [s for s, _ in dims]
    if not dims:
        return False
    if strides[0] == 0 or len(set(strides)) < len(strides):
        return True
    reach = sum((n - 1) * s for s, n in dims)  # the largest offset the dims reach
    while dims and dims[-1][0] > reach - (dims[-1][1] - 1) * dims[-1][0]:
        s, n = dims.pop()
        reach -= (n - 1) * s
    if not dims:
        return False
    for k, (s, n) in enumerate(dims):
        for t, _ in dims[k + 1:]:
            if t % s == 0 and t // s < n:
                return True
    if math.prod([n for _, n in dims]) > OVERLAP_SEARCH:
        return None
    offsets = np.zeros(1, np.int64)
    for s, n in dims:
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * s).ravel()
    return bool(np.unique(offsets).size < offsets.size)


class _Interface:
    """A numpy array interface for an ArrayInfo: numpy arrays over its addresses, for
    numpy's exact overlap test (which reads no memory, so device addresses serve)."""

    def __init__(self, a: ArrayInfo):
        size = ITEMSIZE[a.dtype]
        self.__array_interface__ = {
            "shape": a.shape, "typestr": f"<u{size}", "data": (a.ptr, True), "version": 3,
            "strides": tuple([s * size for s in a.strides])}


def shares_memory(a: ArrayInfo, b: ArrayInfo) -> bool:
    """Whether arrays a and b have an element at a common address: numpy's exact test,
    for arrays whose bounds overlap (``overlaps``). A problem too large to settle is
    taken as sharing."""
    try:
        return bool(np.shares_memory(np.asarray(_Interface(a)), np.asarray(_Interface(b)),
                                     max_work=1 << 20))
    except np.exceptions.TooHardError:
        return True


def overlaps(a: ArrayInfo, sa, b: ArrayInfo, sb) -> bool:
    """Whether arrays a and b, with their spans sa and sb (``span``), may share memory:
    a bounds check."""
    return (sa is not None and sb is not None
            and a.ptr + sa[0] < b.ptr + sb[1] and b.ptr + sb[0] < a.ptr + sa[1])


def overlapping(a: ArrayInfo, x, others):
    """Names of ``others`` ((name, info, array) triples, info None for absent ones) that
    may share memory with array x described by a."""
    sa = span(a)
    return [(n, y) for n, b, y in others if b is not None and overlaps(a, sa, b, span(b))]


def host_view(x, dtype: str) -> np.ndarray:
    """Zero-copy numpy view of a host array (numpy, or torch on the CPU).

    bfloat16 has no numpy dtype: its view holds the raw bits as uint16, and the host
    backends that accept bfloat16 decode them.
    """
    if isinstance(x, np.ndarray):
        return x.view(np.uint16) if dtype == "bfloat16" else x
    # A view sharing storage: writes through it reach the user's tensor. detach() only
    # when needed (numpy() refuses tensors that require grad): it costs ~0.3 µs a call.
    t = x.detach() if x.requires_grad else x
    if dtype == "bfloat16":
        torch = _torch()
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def zeros_like_kind(like, info_: ArrayInfo, shape: tuple, dtype: str):
    """A zero array of ``shape`` and ``dtype`` in the same library and on the same device
    as ``like`` (the result of ``patch_moment``)."""
    if info_.kind == "numpy":
        return np.zeros(shape, dtype=dtype)
    if info_.kind == "torch":
        torch = _torch()
        return torch.zeros(shape, dtype=getattr(torch, dtype), device=like.device)
    if info_.kind == "cupy":
        cupy = _cupy()
        with cupy.cuda.Device(info_.device[1]):
            return cupy.zeros(shape, dtype=dtype)
    numba_cuda = sys.modules.get("numba.cuda")
    if numba_cuda is not None and hasattr(like, "gpu_data"):
        # A numba device array: allocate on its device, zero it with a driver memset. On
        # mu's stream, if it has one: S then names that stream, so the launch goes there
        # too (launch_streams) and S's interface tells a consumer what to wait for.
        stream = getattr(like, "stream", 0)
        with numba_cuda.gpus[info_.device[1] or 0]:
            out = numba_cuda.device_array(shape, dtype=dtype, stream=stream)
            numba_cuda.driver.device_memset(out, 0, out.nbytes, stream=stream)
        return out
    raise TypeError(
        f"patch_moment: cannot allocate a result like {type(like).__module__}."
        f"{type(like).__qualname__}; pass numpy, torch, cupy or numba arrays"
    )


def diag_strides(strides, full: bool) -> tuple:
    """Element strides (b, channel-diagonal, x, y, x', y') of a full (7-d) layout's channel
    diagonal a[b, c, x, y, c, x', y'], or a diagonal (6-d) layout's own strides."""
    s = strides
    return (s[0], s[1] + s[4], s[2], s[3], s[5], s[6]) if full else tuple(s)


# Layout questions the GPU backends ask before they vectorise an access.
def contiguous(strides, shape):
    """Whether axes with these strides and sizes are one contiguous run (row-major)."""
    expect = 1
    for st, n in zip(reversed(strides), reversed(shape)):
        if n != 1 and st != expect:
            return False
        expect *= n
    return True


def vector_width(itemsize, n_q, q_strides, q_shape, other_strides, ptr, extra=()):
    """Widest V (elements) for which V consecutive q are one aligned <= 16-byte access.

    ``extra``: more (itemsize, q_strides, other_strides, ptr) arrays read with the same V
    (mu beside gamma); their vectors may exceed 16 bytes and then need 16-byte alignment.
    """
    if not contiguous(q_strides, q_shape):
        return 1
    if any(not contiguous(e_q, q_shape) for _, e_q, _, _ in extra):
        return 1
    for v in (8, 4, 2):
        if v * itemsize > 16 or n_q % v:
            continue
        if ptr % (v * itemsize) or any(s % v for s in other_strides):
            continue
        if any(e_ptr % min(16, v * e_size) or any(s % v for s in e_other)
               for e_size, _, e_other, e_ptr in extra):
            continue
        return v
    return 1


def torch_scratch(nbytes: int, dev: int, stream: int, current: bool = False):
    """``nbytes`` of scratch on CUDA device ``dev`` from torch's caching allocator:
    (owner, address), a ``torch.empty`` tensor. torch orders it on its current stream of
    ``dev``, which must be the launch stream ``stream`` (it is for torch tensors:
    ``launch_streams``). Dropping the owner after the launches are queued returns the
    memory to that stream's pool, where only work queued behind them can reuse it; under a
    CUDA-graph capture it comes from the graph's private pool, as any tensor's does.
    ``current`` (the caller has just made ``dev`` the current device) is accepted and not
    needed: torch places the tensor by ``dev`` alone."""
    torch = sys.modules["torch"]
    t = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=torch.device("cuda", dev))
    return t, t.data_ptr()


_torch_stream = None  # function: device -> raw handle of torch's current stream on it


def torch_stream_getter():
    """device -> raw handle of torch's current stream on it
    (``torch.cuda.current_stream(device).cuda_stream``)."""
    global _torch_stream
    get = _torch_stream
    if get is None:
        cuda = sys.modules["torch"].cuda
        get = _torch_stream = lambda d: cuda.current_stream(d).cuda_stream
    return get


def current_stream(kind: str, dev) -> int:
    """Raw handle of the current stream of the arrays' library on device ``dev``: torch's
    for torch tensors, CuPy's for CuPy arrays (``launch_streams`` has the stream of any
    call)."""
    if kind == "torch":
        return (_torch_stream or torch_stream_getter())(dev)
    return sys.modules["cupy"].cuda.get_current_stream(-1 if dev is None else dev).ptr


_LEGACY = (0, 1)  # handles of the legacy default stream: the null handle and CU_STREAM_LEGACY

#: Why a GPU backend refuses generic CUDA arrays whose launch stream is being captured.
CAPTURED = ("the stream these CUDA arrays name is being captured into a CUDA graph; "
            "convcov's scratch memory for them would not outlive the call (capture with "
            "torch tensors, whose scratch comes from the graph's own pool)")


def launch_streams(kind: str, dev, infos, written: int = 1) -> tuple[int, tuple, tuple]:
    """(the stream a GPU backend launches on, the streams it must make that one wait for
    first, the streams it must make wait for its launches afterwards), as raw handles.
    ``infos``: the call's ArrayInfos (None for absent ones), the ``written`` arrays first
    (the call's ``written``).

    torch tensors and CuPy arrays: their library's current stream, nothing to wait for.
    Generic CUDA arrays (``__cuda_array_interface__`` v3, numba device arrays): the stream
    the first written array names, so that its producer's pending work comes first and
    work the user queues there next sees the result; the legacy default stream when it
    names none. Every other stream an array names is waited for (an event recorded
    there), as the interface asks of a consumer. A call that writes two arrays naming
    different streams (the backward's grad_gamma and grad_mu) also makes the second's
    stream wait for its launches, so work queued there next sees the result too."""
    if kind != "cai":
        return current_stream(kind, dev), (), ()
    outs = [a for a in infos[:written] if a is not None]
    ins = [a for a in infos[written:] if a is not None]
    launch = 0 if outs[0].stream is None else outs[0].stream

    def others(streams):  # each once, not the launch stream (the legacy one's two handles as one)
        kept = []
        for s in streams:
            if s != launch and s not in kept and not (s in _LEGACY and launch in _LEGACY):
                kept.append(s)
        return tuple(kept)

    # A written array that names no stream is the legacy default stream's, as the first's.
    then = others(0 if a.stream is None else a.stream for a in outs[1:])
    return launch, others(a.stream for a in outs[1:] + ins if a.stream is not None), then
