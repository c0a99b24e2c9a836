"""Fit every polynomial coefficient of transform_ext/expand_math.py (TANH_SMALL,
ERF_SMALL, ERFC_POLY) and transform_ext/exp_expansion.py (EXP_POLY, EXP_POLY_SHORT).

Least squares on Chebyshev nodes in float64, weighted by the relative error of the function
the polynomial stands for; the exp fit reweights it (Lawson's iteration) towards the minimax
polynomial. Printed as the Python literals the code holds
(tests/lighthouse/test_math_approx.py compares them). Run: python tools/fit_math_polynomials.py
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


def powers(n, of=lambda x: x):
    return [lambda x, i=i: of(x) ** i for i in range(n)]


def tanh_small():
    """tanh(x) = x + x^3 P(x^2) on |x| <= 0.625."""
    xs = chebyshev_nodes(0.01, 0.625)
    ys = (np.tanh(xs) - xs) / xs**3
    return fit(xs, ys, powers(7, lambda x: x * x), 1 / np.abs(ys))


def erf_small():
    """erf(x) = x P(x^2) on |x| <= 0.875."""
    xs = chebyshev_nodes(1e-4, 0.875)
    ys = np.vectorize(math.erf)(xs) / xs
    return fit(xs, ys, powers(7, lambda x: x * x), 1 / np.abs(ys))


ERFC_LO, ERFC_HI = 0.875, 4.0
ERFC_MID, ERFC_HALF = (ERFC_LO + ERFC_HI) / 2, (ERFC_HI - ERFC_LO) / 2


def erfc_poly():
    """erfc(x) = Q(t), t = (x - ERFC_MID) / ERFC_HALF on 0.875 <= x <= 4, to an absolute
    error (erf = 1 - Q lies in [0.78, 1), where an f32 ulp is 2^-24); the error returned is
    absolute."""
    xs = chebyshev_nodes(ERFC_LO, ERFC_HI)
    ys = np.vectorize(math.erfc)(xs)
    coef, _ = fit(xs, ys, powers(16, lambda x: (x - ERFC_MID) / ERFC_HALF), np.ones_like(xs))
    t = (xs - ERFC_MID) / ERFC_HALF
    return coef, float(np.max(np.abs(np.polyval(coef[::-1], t) - ys)))


def exp_poly(terms=6, half_width=0.35, rounds=100):
    """e^r = 1 + r P(r) on |r| <= 0.35 (ln2 / 2 and the rounding of k's product), P with
    `terms` coefficients; returns them and the max relative error of e^r."""
    xs = chebyshev_nodes(-half_width, half_width)
    ys = np.expm1(xs) / xs
    relative = np.abs(xs) / np.exp(xs)  # an error d in P is r d / e^r relative in e^r
    lawson = np.ones_like(xs)
    for _ in range(rounds):
        coef, _ = fit(xs, ys, powers(terms), relative * np.sqrt(lawson))
        err = np.abs(relative * (np.polyval(coef[::-1], xs) - ys))
        lawson = lawson * err
        lawson /= lawson.sum()
    return coef, float(np.max(err))


def exp_poly_short():
    """EXP_POLY_SHORT: e^r = 1 + r P(r), P of degree 4."""
    return exp_poly(terms=5)


def report(name, coef, err, kind="rel"):
    print(f"{name} = ({', '.join(repr(float(c)) for c in coef)})  # max {kind} err {err:.2e}")


def main():
    report("TANH_SMALL", *tanh_small())
    report("ERF_SMALL", *erf_small())
    print(f"ERFC_MID, ERFC_HALF = {ERFC_MID!r}, {ERFC_HALF!r}")
    report("ERFC_POLY", *erfc_poly(), kind="abs")
    report("EXP_POLY", *exp_poly())
    report("EXP_POLY_SHORT", *exp_poly_short())


if __name__ == "__main__":
    main()
