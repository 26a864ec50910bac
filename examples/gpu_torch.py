"""The GPU path: torch CUDA tensors in, the same call, the work on the GPU.

A researcher's tensors already live on the GPU; convcov takes them as they are (no copy to
the host, no conversion), computes on their device and on torch's current stream, and
never synchronises: it is asynchronous like any torch op. Without a GPU this script runs
the same code on CPU tensors, so it runs anywhere.

It shows: choosing the layout of ``out`` from the memory it would need (the diagonal
layout is Co times smaller than the seed's full one), one ``accumulate`` call on a layer of
realistic size, which backend ran, ``patch_moment``'s factored form, and a check against
the plain-PyTorch expression of the operation (:mod:`convcov.torch_expr`).

    python examples/gpu_torch.py            # B=8, 32 -> 32 channels, 16x16 (cuda if there)
    python examples/gpu_torch.py --small    # a quick run, for the test suite

On a GPU machine install the CUDA backends first: ``pip install -e '.[cuda13]'`` (or
``cuda12``). ``CONVCOV_EXAMPLES_SMALL=1`` in the environment means ``--small``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import convcov
from convcov import torch_expr


def which_backend(device: str) -> str:
    """The backend an automatic call on this device picks: the first usable one in
    SPEC's order (CONVCOV_BACKEND, when set, takes precedence in real calls)."""
    usable = [b.name for b in convcov.backends() if b.available and b.device == device]
    order = ["cupy", "numba_cuda"] if device == "cuda" else ["numba", "numpy"]
    return next((n for n in order if n in usable), "none usable")


def _free_host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not every OS names these
        return 8 * 2**30


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true",
                        default=os.environ.get("CONVCOV_EXAMPLES_SMALL") == "1",
                        help="a small layer")
    args = parser.parse_args(argv)
    B, Ci, Co, H, k = (2, 4, 4, 8, 3) if args.small else (8, 32, 32, 16, 3)
    Ho = H - k + 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32

    # Layout: the full (B, Co, Ho, Wo, Co, Ho, Wo) out is Co times the diagonal one.
    item = torch.finfo(dtype).bits // 8
    full_bytes = B * Co * Ho**2 * Co * Ho**2 * item
    free = torch.cuda.mem_get_info()[0] if device == "cuda" else _free_host_memory()
    layout = "full" if full_bytes < free // 4 else "diag"
    shape = (B, Co, Ho, Ho, Co, Ho, Ho) if layout == "full" else (B, Co, Ho, Ho, Ho, Ho)
    print(f"device {device}; full out would be {full_bytes / 1e9:.2f} GB of "
          f"{free / 1e9:.0f} GB free: using the {layout} layout {shape}")

    g = torch.Generator(device=device).manual_seed(0)
    mu = torch.rand(B, Ci, H, H, device=device, dtype=dtype, generator=g)
    gamma = 0.01 * torch.rand(B, Ci, H, H, H, H, device=device, dtype=dtype, generator=g)
    c = torch.full((Co,), 0.05, device=device, dtype=dtype)  # per-channel noise variance
    out = torch.zeros(shape, device=device, dtype=dtype)

    name = which_backend(device)
    try:
        convcov.accumulate(out, gamma, mu, c, k)  # first call: JIT / module load
    except convcov.BackendError as exc:  # e.g. a GPU without the cuda extra installed
        raise SystemExit(f"no backend for {device} tensors here: {exc}") from None
    out.zero_()
    t0 = time.perf_counter()
    res = convcov.accumulate(out, gamma, mu, c, k)  # returns at once on CUDA: async
    t_launch = time.perf_counter() - t0
    if device == "cuda":
        torch.cuda.synchronize()  # only to time it and to read the result
    t_done = time.perf_counter() - t0
    assert res is out and out.device.type == device
    print(f"backend {name}: accumulate returned after {t_launch * 1e3:.2f} ms, "
          f"done after {t_done * 1e3:.2f} ms")

    # The factored form: S per group, Co times smaller than out's diagonal.
    S = convcov.patch_moment(gamma, mu, k)
    diag = out if layout == "diag" else out.diagonal(dim1=1, dim2=4).permute(0, 5, 1, 2, 3, 4)
    assert torch.allclose(diag, c[None, :, None, None, None, None] * S, rtol=1e-5)
    print(f"patch_moment: S {tuple(S.shape)} on {S.device}; out's diagonal == c[c0] * S")

    # Against the plain PyTorch expression, on the same device.
    ref = torch_expr.accumulate(torch.zeros_like(out), gamma, mu, c, k, k)
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < 1e-5, err
    print(f"relative difference to the plain PyTorch expression: {err:.1e}")


if __name__ == "__main__":
    main()
