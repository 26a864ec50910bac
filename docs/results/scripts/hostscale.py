"""Is the H200 host uniformly slower at the front end's Python than the project's host, or
is one piece slow there? timeit minima (ns) of the torch attribute reads the fast path's
key makes, the key itself, its lookup, a plain Python loop, and a whole accumulate on a
do-nothing backend that binds (the fast path), on CUDA tensors where there is a GPU."""
import sys
import timeit

import torch

import convcov
from convcov import _frontend, _registry

dev = "cuda" if torch.cuda.is_available() else "cpu"


class Nop(_registry.Backend):
    name, device = "nop", dev if dev == "cpu" else "cuda"
    dtypes = frozenset({"float16", "bfloat16", "float32", "float64"})

    def accumulate(self, p):
        pass

    def bind(self, p):
        return lambda *a: None


convcov.register_backend(Nop())
t = torch.zeros(16, 32, 16, 16, device=dev)
o = torch.zeros(2, 3, 7, 7, 3, 7, 7, device=dev)
g = torch.zeros(2, 4, 9, 9, 4, 9, 9, device=dev)
m = torch.zeros(2, 4, 9, 9, device=dev)
c = torch.rand(3, device=dev)
acc = convcov.accumulate
acc(o, g, m, c, 3, backend="nop")
acc(o, g, m, c, 3, backend="nop")
assert any(e is not None for e in _frontend._bound.values())
key = _frontend._torch_fast(o, g, m, c, 3, 1, 0, 1, 1, "nop")
assert key is True


def mk():
    return (3, 1, 0, 1, 1, "nop", None, 0, o.dtype, o.shape, o.stride(), o.device,
            o.data_ptr() & 15, (g.dtype, g.shape, g.stride(), g.device, g.data_ptr() & 15),
            m.dtype, m.shape, m.stride(), m.device, m.data_ptr() & 15, float)


k = mk()
d = {k: 1}
G = dict(globals())
print(sys.version.split()[0], torch.__version__, dev, flush=True)
for expr in ["t.shape", "t.stride()", "t.device", "t.dtype", "t.data_ptr()",
             "t.get_device()", "torch.is_grad_enabled()", "mk()", "d.get(k)",
             "sum(range(100))", "acc(o, g, m, c, 3, backend='nop')",
             "acc(o, g, m, 0.5, 3, backend='nop')"]:
    n = 20000
    r = min(timeit.repeat(expr, globals=G, number=n, repeat=5)) / n * 1e9
    print(f"{expr:40s} {r:8.1f} ns", flush=True)
