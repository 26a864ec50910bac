"""Monte Carlo proof against reality: convcov's term is the covariance of a real noisy conv.

A layer with noisy weights ``W = Wbar + E`` (``E`` independent per weight, variance
``c[c0]``) applied by ``torch.nn.functional.conv2d`` to random inputs with mean ``mu`` and
per-channel covariance ``gamma`` (channels independent, positions correlated through a
random SPD matrix per ``(b, ci)``) has the output covariance, for each batch element,

    Cov(y) = A Gamma A^T  +  blockdiag_c0( c[c0] * S[b, g(c0)] )

where ``A`` is the conv with the mean weights ``Wbar`` as a matrix (the *mean-weight term*,
computed here directly) and the block diagonal is what ``convcov.accumulate`` adds into a
diagonal-layout ``out``. With ``Wbar = 0`` the convcov term is the whole covariance and
the cross-channel blocks vanish.

The check is statistical, and the estimator's own noise is the tolerance: ``N``
independent draws (fresh weights and inputs each) give the sample covariance ``s_pq``
(centred on the exact mean ``conv(mu, Wbar)``, so it is unbiased), and its per-element
standard error comes from the same draws' fourth moments,
``se_pq^2 = (mean_n(d_p^2 d_q^2) - s_pq^2) / N`` (distribution-free: ``y`` is a sum of
products of Gaussians, not Gaussian). Every unique element gives ``z = (s - Sigma) / se``;
the test asserts that the ``z`` are standard-normal-like (bounded, mean ~0, spread ~1),
and :func:`test_the_check_rejects_wrong_covariances` shows the same check fails on
covariances that are wrong by a few percent or miss a term, so it can fail.

Seeded and CPU-only; the draws are made once per layer (module fixture) and shared by the
backends. The draws use one grouped ``conv2d`` call: sample ``n`` is group ``n`` of the
channel dimension, so every sample has its own weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

import convcov
from convcov import _registry

torch = pytest.importorskip("torch")
F = torch.nn.functional

#: Draws per layer: the relative standard error of a variance is about sqrt(2 / N) ~ 1 %.
N_DRAWS = 20_000

# Bounds on the standardised errors of one set of elements (a hundred to a few thousand
# per layer). Under the null each z is ~N(0, 1), but the z of one layer are correlated (the
# same draws feed every element), which widens the spread of their mean and std beyond the
# independent-case 1/sqrt(n). Calibrated over seeds 0..39 of every layer and subset: max
# |z| reached 5.0, |mean z| 0.54, std z 0.77..1.22. The bounds leave a margin above that;
# the mean bound is what catches a scale error: c wrong by 5 % moves the mean z of the
# variances by 1.6 (a layer with a mean-weight term) to 4.5 (without), by 0.9..2.6 at 3 %.
Z_MAX = 6.0
MEAN_MAX = 0.75
STD_RANGE = (0.65, 1.35)


@dataclass(frozen=True)
class Layer:
    name: str
    B: int
    Ci: int
    Co: int
    H: int
    W: int
    kernel: tuple
    stride: tuple = (1, 1)
    padding: tuple = (0, 0)
    dilation: tuple = (1, 1)
    groups: int = 1
    mean_weights: bool = False  # Wbar != 0: the mean-weight term A Gamma A^T is present
    gamma_layout: str = "diag"  # how gamma is handed to convcov: "full" or "diag"

    @property
    def conv(self):
        return dict(stride=self.stride, padding=self.padding, dilation=self.dilation,
                    groups=self.groups)


LAYERS = [
    # the seed's setting (stride 1, no padding), full-layout gamma as in the seed
    Layer("plain", 2, 3, 4, 7, 7, (3, 3), gamma_layout="full"),
    Layer("stride-padding", 2, 2, 3, 8, 8, (3, 3), stride=(2, 2), padding=(1, 1),
          mean_weights=True),
    Layer("dilation", 1, 2, 3, 7, 6, (3, 2), padding=(2, 1), dilation=(2, 2)),
    Layer("groups", 2, 4, 4, 6, 7, (3, 3), stride=(1, 2), padding=(1, 1), groups=2,
          mean_weights=True),
]


def _spd(rng, H, W):
    """A random SPD (H*W, H*W) matrix: a smooth spatial correlation plus a Wishart part,
    so near and far position pairs both carry covariance."""
    i, j = np.divmod(np.arange(H * W), W)
    dist = np.hypot(i[:, None] - i[None, :], j[:, None] - j[None, :])
    A = rng.normal(size=(H * W, H * W))
    return 0.5 * np.exp(-dist / 2.0) + A @ A.T / (2 * H * W)


@dataclass
class Draws:
    """One layer's inputs, analytic pieces and Monte Carlo moments (all float64 numpy)."""

    layer: Layer
    mu: np.ndarray  # (B, Ci, H, W)
    gamma: np.ndarray  # (B, Ci, H*W, H*W): the per-channel covariance blocks
    c: np.ndarray  # (Co,)
    mean_term: np.ndarray  # (B, P, P), P = Co*Ho*Wo: A Gamma A^T
    sample_cov: np.ndarray  # (B, P, P)
    se: np.ndarray  # (B, P, P): standard error of sample_cov
    z_mean: np.ndarray  # (B, P): standardised error of the sample mean
    out_shape: tuple  # (Co, Ho, Wo)


def draw(layer: Layer, seed: int = 0, n: int = N_DRAWS) -> Draws:
    rng = np.random.default_rng(seed)
    L = layer
    kh, kw = L.kernel
    Cg = L.Ci // L.groups
    HW = L.H * L.W
    mu = rng.normal(0.5, 1.0, size=(L.B, L.Ci, L.H, L.W))
    gamma = np.stack([np.stack([_spd(rng, L.H, L.W) for _ in range(L.Ci)]) for _ in range(L.B)])
    c = rng.uniform(0.02, 0.08, size=L.Co)
    Wbar = rng.normal(0, 0.3, size=(L.Co, Cg, kh, kw)) if L.mean_weights else np.zeros(
        (L.Co, Cg, kh, kw))
    tWbar = torch.from_numpy(Wbar)

    # The exact mean E[y] = conv(mu, Wbar), and A^T as the conv of every basis image.
    mean = F.conv2d(torch.from_numpy(mu), tWbar, **L.conv).numpy()
    Co, Ho, Wo = mean.shape[1:]
    P = Co * Ho * Wo
    basis = torch.eye(L.Ci * HW, dtype=torch.float64).reshape(-1, L.Ci, L.H, L.W)
    At = F.conv2d(basis, tWbar, **L.conv).reshape(L.Ci * HW, P).numpy()
    mean_term = np.empty((L.B, P, P))
    for b in range(L.B):
        Gam = np.zeros((L.Ci * HW, L.Ci * HW))  # channels are independent: block diagonal
        for ci in range(L.Ci):
            Gam[ci * HW:(ci + 1) * HW, ci * HW:(ci + 1) * HW] = gamma[b, ci]
        mean_term[b] = At.T @ Gam @ At

    # n draws: inputs mu + chol(gamma) z, weights Wbar + sqrt(c) e, one grouped conv2d.
    chol = np.linalg.cholesky(gamma)  # (B, Ci, HW, HW)
    zin = rng.standard_normal((L.B, n, L.Ci, HW))
    x = mu.reshape(L.B, 1, L.Ci, HW) + np.einsum("bcpq,bncq->bncp", chol, zin)
    w = Wbar + np.sqrt(c)[:, None, None, None] * rng.standard_normal((n, L.Co, Cg, kh, kw))
    # float32 conv: its rounding (1e-7 relative) is far below the ~1 % statistical error
    y = F.conv2d(torch.from_numpy(x.reshape(L.B, n * L.Ci, L.H, L.W)).float(),
                 torch.from_numpy(w.reshape(n * L.Co, Cg, kh, kw)).float(),
                 stride=L.stride, padding=L.padding, dilation=L.dilation,
                 groups=n * L.groups)
    d = y.double().numpy().reshape(L.B, n, P) - mean.reshape(L.B, 1, P)

    sample_cov = np.einsum("bnp,bnq->bpq", d, d) / n
    m22 = np.einsum("bnp,bnq->bpq", d * d, d * d) / n
    se = np.sqrt(np.maximum(m22 - sample_cov**2, 0) / n)
    z_mean = d.mean(1) / (d.std(1) / np.sqrt(n))
    return Draws(layer, mu, gamma, c, mean_term, sample_cov, se, z_mean, (Co, Ho, Wo))


def convcov_term(dr: Draws, backend=None, *, gamma=True, mu=True, c_scale=1.0) -> np.ndarray:
    """convcov.accumulate into a diagonal-layout out, with torch float64 tensors.

    The keyword arguments build *wrong* answers for the power test."""
    L = dr.layer
    Co, Ho, Wo = dr.out_shape
    g = dr.gamma.reshape(L.B, L.Ci, L.H, L.W, L.H, L.W)
    if L.gamma_layout == "full":
        full = np.zeros((L.B, L.Ci, L.H, L.W, L.Ci, L.H, L.W))
        for ci in range(L.Ci):
            full[:, ci, :, :, ci] = g[:, ci]
        g = full
    out = torch.zeros(L.B, Co, Ho, Wo, Ho, Wo, dtype=torch.float64)
    convcov.accumulate(out, torch.from_numpy(g) if gamma else None,
                       torch.from_numpy(dr.mu if mu else np.zeros_like(dr.mu)),
                       torch.from_numpy(dr.c * c_scale),
                       (Co, L.Ci // L.groups, *L.kernel), backend=backend, **L.conv)
    return out.numpy()


def analytic(dr: Draws, term: np.ndarray, mean_term=True) -> np.ndarray:
    """Full (B, P, P) covariance: the mean-weight term plus convcov's channel-diagonal blocks."""
    Co, Ho, Wo = dr.out_shape
    Q = Ho * Wo
    cov = dr.mean_term.copy() if mean_term else np.zeros_like(dr.mean_term)
    for c0 in range(Co):
        cov[:, c0 * Q:(c0 + 1) * Q, c0 * Q:(c0 + 1) * Q] += term[:, c0].reshape(-1, Q, Q)
    return cov


def split_z(dr: Draws, cov: np.ndarray) -> dict[str, np.ndarray]:
    """Standardised errors of the unique elements (upper triangle) by kind: the variances,
    all of the channel-diagonal blocks (convcov's), and the cross-channel blocks."""
    Co, Ho, Wo = dr.out_shape
    Q = Ho * Wo
    z = (dr.sample_cov - cov) / dr.se
    p, q = np.triu_indices(Co * Q)
    same = (p // Q) == (q // Q)
    return {"variances": z[:, p[p == q], q[p == q]].ravel(),
            "channel-diagonal blocks": z[:, p[same], q[same]].ravel(),
            "cross-channel blocks": z[:, p[~same], q[~same]].ravel()}


def check_all(zs: dict[str, np.ndarray]) -> list[str]:
    return [f"{kind}: {why}" for kind, z in zs.items() for why in check_z(z)]


def check_z(z: np.ndarray) -> list[str]:
    """Why these standardised errors are not N(0, 1)-like; empty when they are."""
    bad = []
    if not np.all(np.isfinite(z)):
        bad.append("non-finite z")
    elif np.abs(z).max() > Z_MAX:
        bad.append(f"max |z| = {np.abs(z).max():.1f} > {Z_MAX}")
    if abs(z.mean()) > MEAN_MAX:
        bad.append(f"mean z = {z.mean():+.2f}, |.| > {MEAN_MAX}")
    if not STD_RANGE[0] <= z.std() <= STD_RANGE[1]:
        bad.append(f"std z = {z.std():.2f} outside {STD_RANGE}")
    return bad


def _host_backends():
    return [n for n in _registry.names() if _registry.get(n).device == "cpu"]


@pytest.fixture(scope="module", params=LAYERS, ids=[L.name for L in LAYERS])
def draws(request):
    return draw(request.param)


@pytest.mark.parametrize("backend", _host_backends())
def test_covariance_matches_monte_carlo(draws, backend):
    reason = _registry.get(backend).unavailable_reason()
    if reason:
        pytest.skip(f"{backend}: {reason}")
    cov = analytic(draws, convcov_term(draws, backend))
    # With Wbar = 0 the cross-channel blocks of cov are exactly 0, so the empirical ones
    # must be 0 within error; with Wbar != 0 they are the mean-weight term alone (a check
    # of the direct computation, which the channel-diagonal blocks also contain).
    assert draws.layer.mean_weights or not draws.mean_term.any()
    bad = check_all(split_z(draws, cov))
    assert not bad, bad


def test_sample_means_match(draws):
    """The draws themselves are right: the sample mean is conv(mu, Wbar) within error."""
    assert not check_z(draws.z_mean.ravel()), check_z(draws.z_mean.ravel())


def test_the_check_rejects_wrong_covariances(draws):
    """Power: the same draws and check reject answers that are slightly or partly wrong."""
    right = convcov_term(draws, "numpy")
    wrong = {
        "c 5 % too large": analytic(draws, convcov_term(draws, "numpy", c_scale=1.05)),
        "gamma term missing": analytic(draws, convcov_term(draws, "numpy", gamma=False)),
        "mu term missing": analytic(draws, convcov_term(draws, "numpy", mu=False)),
        "weight-noise term missing": analytic(draws, np.zeros_like(right)),
    }
    if draws.layer.mean_weights:
        wrong["mean-weight term missing"] = analytic(draws, right, mean_term=False)
    for what, cov in wrong.items():
        assert check_all(split_z(draws, cov)), f"the check accepted a wrong covariance: {what}"
