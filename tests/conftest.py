"""Test setup: the CUDA simulator when there is no GPU, hypothesis profiles.

Without a CUDA device, ``NUMBA_ENABLE_CUDASIM=1`` is set before anything imports numba,
so the numba_cuda kernel runs (tiny shapes) through Numba's CUDA simulator: that is how CI
exercises it. With a device, the real GPU backends run.
"""

import os
import subprocess
import sys

from hypothesis import HealthCheck, Phase, settings


def _cuda_device_count() -> int:
    """CUDA devices as Numba sees them, asked in a child process: this one must not import
    numba before it knows whether to select the simulator."""
    ask = "from numba import cuda; print(len(cuda.gpus) if cuda.is_available() else 0)"
    try:
        r = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True,
                           timeout=120)
        return int(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else 0
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0


if "NUMBA_ENABLE_CUDASIM" not in os.environ and _cuda_device_count() == 0:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                     HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=200, **_common)
settings.register_profile("gpu", max_examples=1000, **_common)
settings.register_profile("quick", max_examples=25, **_common)
# for a short device lease: no shrinking (each new dtype mix compiles a GPU kernel)
settings.register_profile("gpu-quick", max_examples=60, print_blob=True,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate], **_common)
settings.load_profile(os.environ.get("CONVCOV_HYPOTHESIS_PROFILE", "ci"))
