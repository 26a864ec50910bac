"""Moment propagation through a small CNN with noisy weights, on scikit-learn's digits.

The setting convcov was made for: a trained network deployed on analog hardware whose
weights are perturbed by independent noise (here ``std = eta * max |W[c0]|`` per output
channel, a common model of conductance noise). Instead of sampling noisy networks, push
the mean and the covariance of every activation through the network, layer by layer:

* a conv with noisy weights: mean ``conv(m, W)``, covariance ``W Gamma W^T`` (the
  *mean-weight* term: noise from earlier layers, carried forward) plus ``c[c0] * S``
  (the *weight-noise* term this layer adds: ``convcov.accumulate``);
* a ReLU: the exact mean and variance of a rectified Gaussian, and the covariance
  linearised, ``Phi(m_p/s_p) Phi(m_q/s_q) Gamma[p, q]`` off the diagonal (it stays positive
  semi-definite: the exact variance is at least the linearised one, Cacoullos' bound).

The covariance is kept in convcov's full layout ``(B, C, H, W, C, H, W)`` (8x8 images make
it small) because the mean-weight term needs the cross-channel blocks; convcov itself reads
only the channel diagonal of it. The table shows how much variance each layer adds and how
much it inherits; the end compares the propagated logit spread with sampled noisy networks
(real ``torch.nn.functional.conv2d`` calls).

    python examples/digits_cnn.py            # 16 test images, 300 sampled networks
    python examples/digits_cnn.py --small    # a quick run (less training), for the tests

Needs scikit-learn (``pip install scikit-learn``) for the data set, which ships inside it.
``CONVCOV_EXAMPLES_SMALL=1`` in the environment means ``--small``.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn.functional as F

import convcov

# The network: (name, in channels, out channels, kernel, stride, padding, groups).
# The classifier is a 4x4 conv on the 4x4 feature map: a linear layer as a conv.
LAYERS = [
    ("conv1", 1, 8, 3, 1, 1, 1),
    ("conv2", 8, 16, 3, 2, 1, 1),
    ("conv3", 16, 16, 3, 1, 1, 2),
    ("head", 16, 10, 4, 1, 0, 1),
]


def load_digits():
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit("this example needs scikit-learn: pip install scikit-learn") from None
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (1797, 1, 8, 8)
    return x, torch.tensor(d.target)


def make_net():
    return torch.nn.ModuleList(
        torch.nn.Conv2d(ci, co, k, stride=s, padding=p, groups=g)
        for _, ci, co, k, s, p, g in LAYERS)


def forward(net, x, weights=None):
    """The network; ``weights`` replaces the trained weights (a sampled noisy network)."""
    for i, conv in enumerate(net):
        w = conv.weight if weights is None else weights[i]
        x = F.conv2d(x, w, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)
        if i < len(net) - 1:
            x = F.relu(x)
    return x.flatten(1)


def train(net, x, y, epochs):
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=g).split(64):
            opt.zero_grad()
            F.cross_entropy(forward(net, x[idx]), y[idx]).backward()
            opt.step()


def conv_cov(gamma, conv, w):
    """W Gamma W^T for a full-layout covariance: the conv applied to both position sets."""
    B, C, H, W = gamma.shape[:4]
    kw = dict(stride=conv.stride, padding=conv.padding, groups=conv.groups)
    t = F.conv2d(gamma.reshape(B * C * H * W, C, H, W), w, **kw)  # along the second set
    Co, Ho, Wo = t.shape[1:]
    t = t.reshape(B, C * H * W, Co * Ho * Wo).transpose(1, 2)
    t = F.conv2d(t.reshape(B * Co * Ho * Wo, C, H, W), w, **kw)  # along the first set
    return t.reshape(B, Co, Ho, Wo, Co, Ho, Wo)


def relu_moments(m, gamma):
    """Mean and covariance after a ReLU, for Gaussian pre-activations (see the docstring)."""
    B = m.shape[0]
    n = m[0].numel()
    G = gamma.reshape(B, n, n)
    v = G.diagonal(dim1=1, dim2=2).clamp_min(1e-30)
    s, mf = v.sqrt(), m.reshape(B, n)
    a = mf / s
    Phi = 0.5 * (1 + torch.erf(a / math.sqrt(2)))
    phi = torch.exp(-0.5 * a * a) / math.sqrt(2 * math.pi)
    mean = mf * Phi + s * phi
    var = (mf * mf + v) * Phi + mf * s * phi - mean * mean
    out = G * Phi[:, :, None] * Phi[:, None, :]
    out.diagonal(dim1=1, dim2=2).copy_(var.clamp_min(0))
    return mean.reshape(m.shape), out.reshape(gamma.shape)


def propagate(net, x, eta):
    """Mean and covariance of every layer's output; one table row per conv layer."""
    m, gamma, rows = x.double(), None, []
    for i, (conv, (name, *_)) in enumerate(zip(net, LAYERS)):
        w = conv.weight.detach().double()
        # weight-noise variance per output channel: eta times the channel's largest |weight|
        c = (eta * w.abs().amax(dim=(1, 2, 3))) ** 2
        mean = F.conv2d(m, w, conv.bias.detach().double(), conv.stride, conv.padding,
                        groups=conv.groups)
        B, Co, Ho, Wo = mean.shape
        out = (torch.zeros(B, Co, Ho, Wo, Co, Ho, Wo, dtype=torch.float64) if gamma is None
               else conv_cov(gamma, conv, w))
        carried = _mean_var(out)
        convcov.accumulate(out, gamma, m, c, tuple(w.shape), stride=conv.stride,
                           padding=conv.padding, groups=conv.groups)
        total = _mean_var(out)
        rows.append((name, f"{Co}x{Ho}x{Wo}", carried, total - carried, total,
                     math.sqrt(total) / mean.pow(2).mean().sqrt().item()))
        m, gamma = mean, out
        if i < len(net) - 1:
            m, gamma = relu_moments(m, gamma)
    return m.flatten(1), gamma.reshape(m.shape[0], 10, 10).diagonal(dim1=1, dim2=2), rows


def _mean_var(cov):
    B = cov.shape[0]
    n = cov[0].numel()
    return cov.reshape(B, int(math.isqrt(n)), -1).diagonal(dim1=1, dim2=2).mean().item()


def sample(net, x, eta, n, gen):
    """Logits of n sampled noisy networks (the same noise model), by real conv2d calls."""
    outs = []
    with torch.no_grad():
        for _ in range(n):
            ws = []
            for conv in net:
                w = conv.weight
                std = eta * w.abs().amax(dim=(1, 2, 3), keepdim=True)
                ws.append(w + std * torch.randn(w.shape, generator=gen))
            outs.append(forward(net, x, ws))
    return torch.stack(outs).double()  # (n, B, 10)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true",
                        default=os.environ.get("CONVCOV_EXAMPLES_SMALL") == "1",
                        help="fewer epochs, images and samples")
    parser.add_argument("--eta", type=float, default=0.1,
                        help="weight noise std relative to each channel's max |weight|")
    args = parser.parse_args(argv)
    epochs, n_train, n_images, n_samples = (2, 600, 4, 100) if args.small else (
        12, None, 16, 300)

    torch.manual_seed(0)
    x, y = load_digits()
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))
    test, train_idx = perm[:300], perm[300:][:n_train]
    net = make_net()
    train(net, x[train_idx], y[train_idx], epochs)
    with torch.no_grad():
        acc = (forward(net, x[test]).argmax(1) == y[test]).float().mean().item()
    print(f"digits: {len(train_idx)} training images, test accuracy {acc:.1%} "
          f"(noise-free weights); weight noise eta = {args.eta}")

    xb = x[test[:n_images]]
    with torch.no_grad():
        mean, var, rows = propagate(net, xb, args.eta)

    print(f"\nmean output variance per layer, averaged over {n_images} test images:")
    print(f"{'layer':<6} {'output':>8} {'carried in':>11} {'added here':>11} {'total':>10} "
          f"{'std/rms mean':>13}")
    for name, shape, carried, added, total, ratio in rows:
        print(f"{name:<6} {shape:>8} {carried:11.3g} {added:11.3g} {total:10.3g} {ratio:13.3f}")

    logits = sample(net, xb, args.eta, n_samples, torch.Generator().manual_seed(2))
    ratio = (var.sqrt() / logits.std(0)).mean().item()
    noisy_acc = (logits.argmax(2) == y[test[:n_images]]).double().mean().item()
    print(f"\nlogit std, propagated / sampled over {n_samples} noisy networks: {ratio:.2f} "
          f"(1 = exact; the ReLU step is an approximation)")
    print(f"mean logit, propagated vs sampled: max difference "
          f"{(mean - logits.mean(0)).abs().max().item():.3f} "
          f"(logit std {logits.std(0).mean().item():.3f})")
    print(f"accuracy of the sampled noisy networks on these images: {noisy_acc:.1%}")


if __name__ == "__main__":
    main()
