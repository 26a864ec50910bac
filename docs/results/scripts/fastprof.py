"""Host cost of accumulate's paths on torch CPU tensors: a do-nothing backend that binds
(the fast path) or not (the full path), and the numba backend with torch tensors."""
import time, statistics as st, torch, convcov
from convcov import _registry, _frontend

class Nop(_registry.Backend):
    name, device = "nop", "cpu"
    dtypes = frozenset({"float16", "bfloat16", "float32", "float64"})
    binds = True
    def accumulate(self, p): pass
    def bind(self, p):
        return (lambda *a: None) if self.binds else None

nop = Nop(); convcov.register_backend(nop)
def med(f, n=20000):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return st.median(ts) * 1e6
for name, (B, Ci, Co, H, k) in {"toy": (2, 3, 3, 9, 3), "mid": (16, 32, 32, 16, 3)}.items():
    Ho = H - k + 1
    out = torch.zeros(B, Co, Ho, Ho, Co, Ho, Ho); g = torch.rand(B, Ci, H, H, Ci, H, H)
    mu = torch.rand(B, Ci, H, H); c = torch.rand(Co)
    for binds in (False, True):
        nop.binds = binds; getattr(_frontend, "_bound", {}).clear()
        f = lambda: convcov.accumulate(out, g, mu, c, k, backend="nop")
        print(f"{name} nop binds={binds}: {med(f):.2f} us")
    f = lambda: convcov.accumulate(out, g, mu, c, k, backend="numba")
    print(f"{name} numba (torch cpu): {med(f, 3000):.2f} us")
