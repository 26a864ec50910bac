"""Fifteenth session. Host cost of cupy's bound launcher (Backend.bind's run) without a GPU:
fake CuPy runtime and driver, stream and kept scratch; the owning thread (its own Args)
against another thread (copies of the templates), µs a call, best of 9 rounds."""
import array
import threading
import time
import types

from convcov.backends import cupy as cb


def best_us(f, n=50000):
    rounds = []
    for _ in range(9):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            f()
        rounds.append((time.perf_counter_ns() - t0) / n)
    return min(rounds) / 1000


rt = types.SimpleNamespace(getDevice=lambda: 0, setDevice=lambda d: None,
                           streamIsCapturing=lambda s: False)
drv = types.SimpleNamespace(launchKernel=lambda *a: None)
be = cb.CupyBackend()
be._cp = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt, driver=drv))
launches = [cb._Launch(object(), 1024, array.array("q", [0] * 70)) for _ in range(3)]
plan = cb._Plan(launches, 1000, 1000, "float32")
be._on_device = lambda dev, fn, p: plan
cb.torch_stream_getter = lambda: (lambda d: 7)
cb.kept_torch_scratch = lambda n, d, s: 1 << 20
run = be.bind(types.SimpleNamespace(device=("cuda", 0), kind="torch"))
call = lambda: run(None, None, None, None, 1, 2, 3, 4, 0.0)  # noqa: E731
be._tls.ready = {0}
print(f"owning thread {best_us(call):.2f}")
other = []
th = threading.Thread(target=lambda: other.append(best_us(call)))
th.start()
th.join()
print(f"another thread (templates copied) {other[0]:.2f}")
