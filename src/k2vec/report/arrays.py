"""Array helpers shared by the report's comparisons (ragged JSON lists to padded arrays, row statistics)."""

from __future__ import annotations

import numpy as np

REL_EPS = 2.22e-16  # Polygraphy's guard for a zero reference value


def stack_rows(values: list, shape_tail: tuple[int, ...], n: int, fill, dtype) -> np.ndarray:
    """Rows of possibly ragged nested lists -> one [rows, n, *tail] array (padded with `fill`).
    The common case (every row complete and same-shaped) is a single np.asarray. A row that does not
    convert (ragged inside, or an integer past int64: the runner refuses both) stays `fill`."""
    out = None
    try:
        arr = np.asarray(values, dtype=dtype)
        if arr.ndim == 2 + len(shape_tail) and arr.shape[1:] == (n, *shape_tail):
            out = arr
    except (ValueError, TypeError, OverflowError):
        pass
    if out is None:
        out = np.full((len(values), n, *shape_tail), fill, dtype=dtype)
        for i, v in enumerate(values):
            try:
                a = np.asarray(v, dtype=dtype)
            except (ValueError, TypeError, OverflowError):
                continue
            if a.ndim != 1 + len(shape_tail) or a.size == 0:
                continue
            sl = tuple(slice(0, min(s, t)) for s, t in zip(a.shape, (n, *shape_tail)))
            out[(i, *sl)] = a[sl]
    return out


def first_2d(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For [R, A, B] bool: (any, first a, first b) in row-major (a, then b) order."""
    flat = mask.reshape(mask.shape[0], -1)
    anyv = flat.any(axis=1)
    idx = flat.argmax(axis=1)
    return anyv, idx // mask.shape[2], idx % mask.shape[2]


def nan_percentile_rows(a: np.ndarray, q: float) -> np.ndarray:
    """np.nanpercentile(a, q, axis=1) (linear interpolation) in a few whole-array passes; numpy's
    version loops over rows in Python when there are NaNs."""
    s = np.sort(a, axis=1)                       # NaNs sort last
    n = (~np.isnan(a)).sum(axis=1)
    pos = q / 100.0 * np.maximum(n - 1, 0)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, np.maximum(n - 1, 0))
    r = np.arange(a.shape[0])
    v = s[r, lo] + (s[r, hi] - s[r, lo]) * (pos - lo)
    return np.where(n > 0, v, np.nan)


def logsumexp(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return m + np.log(np.exp(x - m).sum(-1, keepdims=True))


