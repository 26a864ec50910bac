"""Two changes to cupy's small calls, each ABAB in one process (_timing.row: the bench's
median, whole and GPU part, per-kernel times). Part 1 needs walk-segments.patch applied
(it was measured slower and not kept):
1. the walk's diagonals split in segments (_WALK_SEG: 14 = whole diagonals, the code
   before; None = the device's fill asks, 5 on mid; and 7, 4, 3, 2) on mid and big-f16;
2. the fast path's host work, before (os.environ.get; the bound launcher through
   _on_device, _launch, current_stream and _scratch) and after (the environment's own
   dict; one closure with all of that looked up at bind time) on toy and mid."""
import os

import torch

from _timing import abab, knob, row, rotating

from convcov import _frontend, bench
from convcov._arrays import current_stream
from convcov.backends import cupy as cb

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy {bw / 1e9:.0f} GB/s", flush=True)

abab(dev, bw, ["mid"], ["cupy"], knob(cupy="_WALK_SEG"), "wseg",
     flags=(14, None, 7, 4, 3, 2), rounds=2)
abab(dev, bw, ["big-f16"], ["cupy"], knob(cupy="_WALK_SEG"), "wseg", flags=(30, None),
     rounds=2)
cb._WALK_SEG = None

new_bind, new_env = cb.CupyBackend.bind, (_frontend._environ_get, _frontend._ENV_KEY)


def old_bind(self, p):  # the bound launcher before this change
    if p.device[1] is None:
        return None
    plan = self._on_device(p.device, self._plan_of, p)
    device, kind, on_device, launch = p.device, p.kind, self._on_device, self._launch

    def run(out, gamma, mu, c, optr, gptr, mptr, cptr, c_value):
        on_device(device, launch, plan, kind, optr, gptr, mptr, cptr, c_value)

    return run


def set_host(old):
    cb.CupyBackend.bind = old_bind if old else new_bind
    _frontend._environ_get, _frontend._ENV_KEY = ((os.environ.get, "CONVCOV_BACKEND") if old
                                                  else new_env)
    _frontend._bound.clear()


assert current_stream  # (the old launcher's path, through _launch)
WL = {w.name: w for w in bench.WORKLOADS}
for name in ("toy", "mid"):
    w = WL[name]
    sets = [bench._inputs(dev, w) for _ in range(1 if name == "toy" else 3)]
    f = rotating(sets, w, "cupy")
    for rnd in range(3):
        for old in (True, False):
            set_host(old)
            print(f"{name:8s} host {'before' if old else 'after ':6s} r{rnd}: {row(dev, f, w, bw)}",
                  flush=True)
    del sets, f
    torch.cuda.empty_cache()
set_host(False)
