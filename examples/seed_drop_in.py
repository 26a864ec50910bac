"""The seed thread's call, with convcov as a drop-in for ``op_slow``.

The forum post (numba.discourse.group, "Using dynamic shared memory", 2022) set up this toy
example and a 9-deep Python loop, ``op_slow``. ``convcov.accumulate`` takes the very same
arguments (``input`` full-layout, ``gamma``, ``mu``, ``c``, ``weight_shape``), adds into
``input`` in place and returns it, so replacing the loop is a one-line change. This script
runs both on the seed's shapes, checks they agree and times them.

    python examples/seed_drop_in.py            # the seed's shapes (op_slow takes ~10 s)
    python examples/seed_drop_in.py --small    # smaller images, for the test suite

``CONVCOV_EXAMPLES_SMALL=1`` in the environment means ``--small``. The seed used
``.to('cuda:0')``; here the device is CUDA when torch sees one, else the CPU, and the same
line runs on both (op_slow is then run on a CPU copy: it indexes one element at a time).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import convcov


def op_slow(input, gamma, mu, c, weight_shape):
    """Verbatim from the seed thread."""
    for bi in range(input.shape[0]):
        for c0 in range(input.shape[1]):
            for i0 in range(input.shape[2]):
                for j0 in range(input.shape[3]):
                    for i0p in range(input.shape[5]):
                        for j0p in range(input.shape[6]):
                            for ci in range(weight_shape[1]):
                                for ii in range(weight_shape[2]):
                                    for ji in range(weight_shape[3]):
                                        input[bi, c0, i0, j0, c0, i0p, j0p] += c[c0] * (mu[bi, ci, i0+ii, j0+ji] * mu[bi, ci, i0p+ii, j0p+ji] + gamma[bi, ci, i0+ii, j0+ji, ci, i0p+ii, j0p+ji])  # noqa: E501
    return input


def op_fast(input, gamma, mu, c, weight_shape):
    """The drop-in: same arguments, same in-place result, same return value."""
    return convcov.accumulate(input, gamma, mu, c, weight_shape)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true",
                        default=os.environ.get("CONVCOV_EXAMPLES_SMALL") == "1",
                        help="5x5 images instead of the seed's 9x9")
    args = parser.parse_args(argv)
    H = 5 if args.small else 9  # the seed: 9x9 inputs, 3x3 kernels, 7x7 outputs
    Ho = H - 2

    # The seed's toy example, as posted (the device is the only change).
    torch.manual_seed(0)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    input = torch.rand(2, 3, Ho, Ho, 3, Ho, Ho).to(device)
    gamma = torch.rand(2, 3, H, H, 3, H, H).to(device)
    mu = torch.rand(2, 3, H, H).to(device)
    c = torch.tensor(1.).to(device)
    if c.dim() == 0:
        c = c.repeat(input.shape[1])
    weight_shape = [3, 3, 3, 3]

    # op_slow indexes one element at a time: give it float64 numpy copies (fast, exact).
    t0 = time.perf_counter()
    ref = op_slow(input.double().cpu().numpy(), gamma.double().cpu().numpy(),
                  mu.double().cpu().numpy(), c.double().cpu().numpy(), weight_shape)
    t_slow = time.perf_counter() - t0

    fast = op_fast(input.clone(), gamma, mu, c, weight_shape)  # first call: JIT, caches
    times = []
    for _ in range(5):  # the best of 5: a busy machine only ever makes a call slower
        out = input.clone()
        t0 = time.perf_counter()
        res = op_fast(out, gamma, mu, c, weight_shape)
        if device.type == "cuda":
            torch.cuda.synchronize()  # convcov never synchronises; do it to time the call
        times.append(time.perf_counter() - t0)
    t_fast = min(times)

    assert res is out  # in place, and returned, as op_slow does
    err = float(abs(out.double().cpu().numpy() - ref).max() / abs(ref).max())
    assert torch.equal(fast, out) and err < 1e-6, err
    print(f"seed example on {device}: input {tuple(input.shape)}, gamma {tuple(gamma.shape)}")
    print(f"op_slow  {t_slow * 1e3:9.1f} ms   (python loops, float64)")
    print(f"convcov  {t_fast * 1e3:9.3f} ms   (float32, {t_slow / t_fast:,.0f}x faster)")
    print(f"max relative difference {err:.1e}")


if __name__ == "__main__":
    main()
