"""Moments through a stack of three noisy conv layers, against Monte Carlo.

A 3 -> 8 -> 8 -> 4 channel stack (3x3 kernels; the middle layer has stride 2) on an 8x8
input whose mean is a smooth image and whose covariance is full (positions and channels
correlated). Every weight carries independent noise whose standard deviation is 20 % of
its magnitude (a per-weight variance, ``c = (0.2 w)**2``, as noise models of analog
hardware have it), every bias a noise of variance 0.01. ``convcov.conv2d_moments``
carries the mean and the full covariance through the three layers, each layer's full
``gamma_out`` feeding the next: for a linear stack this is exact. Monte Carlo pushes ``N``
inputs, each through freshly drawn noisy weights and biases, through
``torch.nn.functional.conv2d``; the sample mean and covariance of the last layer's output
are compared with the propagated ones, element by element, through their standard
errors (``z``), and both are timed.

    python examples/moments_stack.py                    # N = 20000 draws
    python examples/moments_stack.py --figure           # also docs/figures/moments_mc.png
    python examples/moments_stack.py --small            # N = 2000 (the test suite's size)

``CONVCOV_EXAMPLES_SMALL=1`` in the environment means ``--small``. The figure needs
matplotlib (``pip install 'convcov[plot]'``).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import convcov

FIGURE = Path(__file__).resolve().parents[1] / "docs" / "figures" / "moments_mc.png"
B, Ci, H, W = 1, 3, 8, 8
#: (Ci, Co, kernel, stride, padding) of each layer
STACK = [(3, 8, 3, 1, 1), (8, 8, 3, 2, 1), (8, 4, 3, 1, 1)]
REL_STD, BIAS_VAR = 0.2, 0.01


def inputs(rng):
    """mu (B, Ci, H, W) and a full covariance (B, Ci, H, W, Ci, H, W): a smooth spatial
    correlation, channels correlated by a random 3x3 correlation, plus a random PSD part."""
    i, j = np.divmod(np.arange(H * W), W)
    mu = (1 + 0.5 * np.sin(i / 2.0)[None] * np.cos(j / 3.0 + np.arange(Ci)[:, None]))
    mu = mu.reshape(B, Ci, H, W)
    spatial = np.exp(-np.hypot(i[:, None] - i, j[:, None] - j) / 2.0)
    A = rng.normal(size=(Ci, Ci))
    channels = A @ A.T / Ci + np.eye(Ci)
    R = rng.normal(size=(Ci * H * W, Ci * H * W))
    gamma = 0.3 * np.kron(channels, spatial) + R @ R.T / (8 * Ci * H * W)
    return mu, gamma.reshape(B, Ci, H, W, Ci, H, W)


def layers(rng):
    return [dict(weight=(w := rng.normal(0, 1 / math.sqrt(ci * k * k), (co, ci, k, k))),
                 bias=rng.normal(0, 0.1, co), c=(REL_STD * w) ** 2,
                 c_bias=np.full(co, BIAS_VAR), stride=s, padding=p)
            for ci, co, k, s, p in STACK]


def propagate(mu, gamma, stack):
    """The last layer's mean (P,) and full covariance (P, P), batch element 0."""
    m, g = torch.from_numpy(mu), torch.from_numpy(gamma)
    for L in stack:
        m, g = convcov.conv2d_moments(m, g, torch.from_numpy(L["weight"]),
                                      torch.from_numpy(L["bias"]), torch.from_numpy(L["c"]),
                                      c_bias=torch.from_numpy(L["c_bias"]),
                                      stride=L["stride"], padding=L["padding"])
    P = m[0].numel()
    return m[0].reshape(P).numpy(), g[0].reshape(P, P).numpy()


def monte_carlo(rng, mu, gamma, stack, n):
    """n draws of the last layer's output, (n, P): sample i is group i of one conv2d."""
    P = Ci * H * W
    x = mu.reshape(1, P) + rng.standard_normal((n, P)) @ np.linalg.cholesky(
        gamma.reshape(P, P)).T
    y = torch.from_numpy(x.reshape(1, n * Ci, H, W))
    for L in stack:
        w = L["weight"] + np.sqrt(L["c"]) * rng.standard_normal((n, *L["weight"].shape))
        b = L["bias"] + np.sqrt(L["c_bias"]) * rng.standard_normal((n, L["bias"].size))
        co = L["weight"].shape[0]
        y = F.conv2d(y, torch.from_numpy(w.reshape(n * co, *w.shape[2:])),
                     torch.from_numpy(b.reshape(-1)), L["stride"], L["padding"], groups=n)
    return y.numpy().reshape(n, -1)


def compare(samples, mean, cov):
    """z of the sample mean and of the unique covariance elements, and the covariance's
    relative error (Frobenius)."""
    n = len(samples)
    d = samples - mean
    z_mean = d.mean(0) / (d.std(0) / math.sqrt(n))
    s = d.T @ d / n
    se = np.sqrt(np.maximum((d * d).T @ (d * d) / n - s * s, 0) / n)
    iu = np.triu_indices(len(cov))
    return z_mean, ((s - cov) / se)[iu], np.linalg.norm(s - cov) / np.linalg.norm(cov), s


def draw(cov, empirical, z, n, path):
    from matplotlib.figure import Figure

    Co = STACK[-1][1]
    Q = len(cov) // Co
    fig = Figure(figsize=(12, 3.9), layout="constrained")
    ax = fig.subplots(1, 3, width_ratios=[1, 1, 1.15])
    lim = np.abs(cov).max()
    for a, m, title in ((ax[0], cov, "conv2d_moments, 3 layers"),
                        (ax[1], empirical, f"Monte Carlo, {n} noisy stacks")):
        im = a.imshow(m, cmap="RdBu_r", vmin=-lim, vmax=lim)
        a.set_title(f"{title}\noutput covariance, {Co} channels x {Q} positions", fontsize=10)
        for k in range(1, Co):
            a.axhline(k * Q - 0.5, color="k", lw=0.3)
            a.axvline(k * Q - 0.5, color="k", lw=0.3)
    fig.colorbar(im, ax=ax[:2], shrink=0.85, label="covariance")
    t = np.linspace(-5, 5, 201)
    ax[2].hist(z, bins=60, range=(-5, 5), density=True, color="C0", alpha=0.7,
               label=f"{z.size} unique elements")
    ax[2].plot(t, np.exp(-t * t / 2) / math.sqrt(2 * math.pi), "k", lw=1.2, label="N(0, 1)")
    ax[2].set_title(f"standardised errors of the covariance\nmean {z.mean():+.2f}, "
                    f"std {z.std():.2f}, max |z| {np.abs(z).max():.1f}", fontsize=10)
    ax[2].set_xlabel("z = (Monte Carlo - propagated) / standard error")
    ax[2].legend(fontsize=8, loc="upper left")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true",
                        default=os.environ.get("CONVCOV_EXAMPLES_SMALL") == "1",
                        help="N = 2000 draws instead of 20000")
    parser.add_argument("--figure", nargs="?", const=str(FIGURE), metavar="PATH",
                        help=f"also draw the comparison (default path {FIGURE.name} in "
                             "docs/figures)")
    args = parser.parse_args(argv)
    n = 2000 if args.small else 20000
    rng = np.random.default_rng(0)
    mu, gamma = inputs(rng)
    stack = layers(rng)

    times = []
    for _ in range(3):  # the median of three: the first call also sets torch up
        t0 = time.perf_counter()
        mean, cov = propagate(mu, gamma, stack)
        times.append(time.perf_counter() - t0)
    t1 = time.perf_counter()
    samples = monte_carlo(rng, mu, gamma, stack, n)
    t_mc = time.perf_counter() - t1
    z_mean, z_cov, rel, empirical = compare(samples, mean, cov)

    print(f"stack {' -> '.join(str(s[0]) for s in STACK)} -> {STACK[-1][1]} channels, "
          f"input {H}x{W}, output {len(cov)} values")
    print(f"conv2d_moments, 3 layers, full covariance: {sorted(times)[1] * 1e3:8.1f} ms")
    print(f"Monte Carlo, {n} draws: {t_mc * 1e3:26.1f} ms")
    print(f"mean: max |z| {np.abs(z_mean).max():.2f}; covariance: {z_cov.size} unique elements, "
          f"mean z {z_cov.mean():+.2f}, std z {z_cov.std():.2f}, max |z| "
          f"{np.abs(z_cov).max():.2f}; relative error {rel:.3f} (Monte Carlo's own)")
    if args.figure:
        draw(cov, empirical, z_cov, n, args.figure)
        print(f"wrote {args.figure}")


if __name__ == "__main__":
    main()
