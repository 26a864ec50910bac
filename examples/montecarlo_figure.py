"""The figure in docs/figures/montecarlo.png: convcov's covariance against a real noisy conv.

One conv layer (3 -> 4 channels, 3x3 kernel, padding 1, 8x8 input) with zero-mean weights
of independent noise, variance ``c[c0]`` per output channel, applied by
``torch.nn.functional.conv2d`` to ``N`` random inputs (mean ``mu``; positions correlated
within each channel by ``gamma``, channels independent), each with freshly drawn weights.
With zero-mean weights the output covariance is exactly the weight-noise term: convcov's
``accumulate`` into a diagonal-layout ``out`` gives its channel-diagonal blocks, and the
cross-channel blocks are 0.

Left and middle: the analytic and the empirical covariance of output channel 0 (a 64 x 64
matrix over the 8x8 output positions). Right: the standardised errors
``z = (empirical - analytic) / standard error`` of every unique element of the whole
(channel-diagonal and cross-channel) covariance, with the standard error from the draws'
own fourth moments; they should follow N(0, 1). The z of one experiment are correlated
(the same draws feed every element), so their histogram shifts as a whole by a few tenths
from one seed to the next; the figure pools R independent experiments to show the shape.
tests/test_montecarlo.py is the rigorous version of this check, over several layers.

    python examples/montecarlo_figure.py                 # R = 6 x N = 20000: the docs figure
    python examples/montecarlo_figure.py --small -o x.png

Needs matplotlib (``pip install 'convcov[plot]'``). ``CONVCOV_EXAMPLES_SMALL=1`` in the
environment means ``--small`` (R = 2, N = 2000).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import convcov

FIGURE = Path(__file__).resolve().parents[1] / "docs" / "figures" / "montecarlo.png"
B, Ci, Co, H, W, K, PAD = 1, 3, 4, 8, 8, 3, 1


def experiment(n, seed=0):
    """(analytic, empirical, standard error) of the (Co*Ho*Wo)^2 covariance of image 0."""
    rng = np.random.default_rng(seed)
    # A smooth positive mean and a smooth correlation (plus a random SPD part), so that
    # the picture shows the structure: near positions covary, bands for the 2-D grid.
    i, j = np.divmod(np.arange(H * W), W)
    mu = 1.0 + 0.5 * np.sin(i / 2.5 + rng.uniform(0, 6, size=(B, Ci, 1))) * np.cos(
        j / 3.0 + rng.uniform(0, 6, size=(B, Ci, 1)))
    mu = mu.reshape(B, Ci, H, W)
    dist = np.hypot(i[:, None] - i[None, :], j[:, None] - j[None, :])
    gamma = np.empty((B, Ci, H * W, H * W))
    for b in range(B):
        for ci in range(Ci):
            A = rng.normal(size=(H * W, H * W))
            gamma[b, ci] = 0.5 * np.exp(-dist / 3.0) + A @ A.T / (4 * H * W)
    c = rng.uniform(0.02, 0.08, size=Co)

    # analytic: convcov, diagonal layout (B, Co, Ho, Wo, Ho, Wo)
    Ho, Wo = H + 2 * PAD - K + 1, W + 2 * PAD - K + 1
    out = torch.zeros(B, Co, Ho, Wo, Ho, Wo, dtype=torch.float64)
    convcov.accumulate(out, torch.from_numpy(gamma.reshape(B, Ci, H, W, H, W)),
                       torch.from_numpy(mu), torch.from_numpy(c), K, padding=PAD)
    Q = Ho * Wo
    analytic = np.zeros((Co * Q, Co * Q))
    for c0 in range(Co):
        analytic[c0 * Q:(c0 + 1) * Q, c0 * Q:(c0 + 1) * Q] = out[0, c0].reshape(Q, Q).numpy()

    # empirical: n draws of inputs and weights, one grouped conv2d (sample s = group s)
    x = mu[0].reshape(1, Ci, H * W) + np.einsum(
        "cpq,ncq->ncp", np.linalg.cholesky(gamma[0]), rng.standard_normal((n, Ci, H * W)))
    w = np.sqrt(c)[:, None, None, None] * rng.standard_normal((n, Co, Ci, K, K))
    y = F.conv2d(torch.from_numpy(x.reshape(1, n * Ci, H, W)).float(),
                 torch.from_numpy(w.reshape(n * Co, Ci, K, K)).float(), padding=PAD,
                 groups=n)
    d = y.double().numpy().reshape(n, Co * Q)  # E[y] = 0: zero-mean weights
    empirical = d.T @ d / n
    se = np.sqrt(np.maximum((d * d).T @ (d * d) / n - empirical**2, 0) / n)
    return analytic, empirical, se


def standardised(analytic, empirical, se):
    p, q = np.triu_indices(len(analytic))
    return ((empirical - analytic) / se)[p, q]


def draw(analytic, empirical, z, n, reps, path):
    """The three panels: channel 0 of the first experiment, z of all experiments."""
    from matplotlib.figure import Figure

    Q = (H + 2 * PAD - K + 1) * (W + 2 * PAD - K + 1)
    fig = Figure(figsize=(12, 3.9), layout="constrained")
    ax = fig.subplots(1, 3, width_ratios=[1, 1, 1.15])
    lim = np.abs(analytic[:Q, :Q]).max()
    for a, m, title in ((ax[0], analytic, "analytic (convcov)"),
                        (ax[1], empirical, f"empirical ({n} noisy conv2d draws)")):
        im = a.imshow(m[:Q, :Q], cmap="viridis", vmin=0, vmax=lim)
        a.set_title(f"{title}\noutput channel 0, 8x8 positions", fontsize=10)
        a.set_xlabel("position (i1, j1)")
        a.set_ylabel("position (i0, j0)")
    fig.colorbar(im, ax=ax[:2], shrink=0.85, label="covariance")
    t = np.linspace(-5, 5, 201)
    ax[2].hist(z, bins=60, range=(-5, 5), density=True, color="C0", alpha=0.7,
               label=f"{z.size // reps} unique elements x {reps} experiments")
    ax[2].plot(t, np.exp(-t * t / 2) / math.sqrt(2 * math.pi), "k", lw=1.2, label="N(0, 1)")
    ax[2].set_title(f"standardised errors of the whole covariance\nmean {z.mean():+.2f}, "
                    f"std {z.std():.2f}, max |z| {np.abs(z).max():.1f}", fontsize=10)
    ax[2].set_xlabel("z = (empirical - analytic) / standard error")
    ax[2].legend(fontsize=8, loc="upper left")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    return z


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true",
                        default=os.environ.get("CONVCOV_EXAMPLES_SMALL") == "1",
                        help="N = 2000 draws instead of 20000")
    parser.add_argument("-o", "--output", default=str(FIGURE), help="the picture to write")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("this example needs matplotlib: pip install 'convcov[plot]'") from None
    n, reps = (2000, 2) if args.small else (20000, 6)
    runs = [experiment(n, seed) for seed in range(reps)]
    z = np.concatenate([standardised(*r) for r in runs])
    draw(runs[0][0], runs[0][1], z, n, reps, args.output)
    print(f"{z.size} standardised errors: mean {z.mean():+.3f}, std {z.std():.3f}, "
          f"max |z| {np.abs(z).max():.2f}; wrote {args.output}")


if __name__ == "__main__":
    main()
