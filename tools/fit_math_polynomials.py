"""Fit the polynomial coefficients used by lighthouse/targets/math_approx.py.

Weighted least squares on Chebyshev nodes in float64 (relative error weighting), printed as
Python literals. Run: python tools/fit_math_polynomials.py
"""

import math

import numpy as np


def chebyshev_nodes(lo, hi, n=4000):
    k = np.arange(n)
    return 0.5 * (lo + hi) + 0.5 * (hi - lo) * np.cos((2 * k + 1) * np.pi / (2 * n))


def fit(xs, ys, basis, weight):
    a = np.stack([b(xs) for b in basis], axis=1) * weight[:, None]
    coef, *_ = np.linalg.lstsq(a, ys * weight, rcond=None)
    approx = np.stack([b(xs) for b in basis], axis=1) @ coef
    return coef, np.max(np.abs((approx - ys) / np.where(ys == 0, 1, ys)))


def report(name, coef, err):
    print(f"{name} = ({', '.join(repr(float(c)) for c in coef)})  # max rel err {err:.2e}")


# tanh(x) = x + x^3 * P(x^2) on |x| <= 0.625
xs = chebyshev_nodes(0.01, 0.625)
ys = (np.tanh(xs) - xs) / xs**3
coef, err = fit(xs, ys, [lambda x, i=i: (x * x) ** i for i in range(7)], 1 / np.abs(ys))
report("TANH_SMALL", coef, err)

# erf(x) = x * P(x^2) on |x| <= 0.875
erf = np.vectorize(math.erf)
erfc = np.vectorize(math.erfc)
xs = chebyshev_nodes(1e-4, 0.875)
ys = erf(xs) / xs
coef, err = fit(xs, ys, [lambda x, i=i: (x * x) ** i for i in range(7)], 1 / np.abs(ys))
report("ERF_SMALL", coef, err)

# erfc(x) * exp(x^2) = Q(t), t = (x - 2.4375) / 1.5625 on 0.875 <= x <= 4
lo, hi = 0.875, 4.0
mid, half = (lo + hi) / 2, (hi - lo) / 2
xs = chebyshev_nodes(lo, hi)
ys = erfc(xs) * np.exp(xs * xs)
coef, err = fit(xs, ys, [lambda x, i=i: ((x - mid) / half) ** i for i in range(14)], 1 / ys)
print(f"ERFC_MID, ERFC_HALF = {mid!r}, {half!r}")
report("ERFC_SCALED", coef, err)
