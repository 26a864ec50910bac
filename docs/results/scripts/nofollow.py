"""The new backward-stream test must fail when the second written stream is not made to
wait (launch_streams' third item dropped): run it so, and expect failures."""
import sys

import pytest

from convcov import _arrays
from convcov.backends import cupy as cupy_mod
from convcov.backends import numba_cuda as nc_mod

real = _arrays.launch_streams


def no_then(*a, **k):
    launch, waits, _ = real(*a, **k)
    return launch, waits, ()


cupy_mod.launch_streams = nc_mod.launch_streams = no_then
rc = pytest.main(["-q", "-p", "no:cacheprovider",
                  "tests/test_cuda_interface.py::test_backward_orders_both_gradients_streams"])
print("rc with the follow dropped:", int(rc), "(1 = the test caught it)")
sys.exit(0 if rc == 1 else 1)
