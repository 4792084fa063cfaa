"""Fingerprints: per step and layer, the relative L2 error of the engine's hidden-state fingerprint."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from k2vec.report.arrays import REL_EPS
from k2vec.report.golden_data import Golden

FINGERPRINT_COLUMNS = ("first_bad_step", "first_bad_layer", "first_bad_rel_err", "fingerprint_rel_max",
                       "fingerprint_rel_before")


def compare_fingerprints(g: Golden, datas: Sequence[Mapping[str, Any]], prompt: np.ndarray, upto: np.ndarray,
                         fs: np.ndarray, fingerprint_rtol: float, rel_out: list | None = None) -> dict[str, np.ndarray]:
    """The largest error over the compared steps and over those before the first divergent step fs,
    and the first (step, layer) above `fingerprint_rtol`. `rel_out`, when given, gets each row's
    [compared steps, layers] relative errors (None for a row without usable fingerprints).
    One array operation per row (rows differ in which golden prompt they read)."""
    cols = {c: np.full(len(datas), np.nan) for c in FINGERPRINT_COLUMNS}
    n_compared = upto.sum(axis=1)
    rels: list = [None] * len(datas)
    for r, d in enumerate(datas):
        fp = d.get("fingerprints")
        if fp is None:
            continue
        a = np.asarray(fp, np.float32)
        if a.size == 0:
            continue
        gf = g.fingerprints[prompt[r]]
        n = min(len(a), int(n_compared[r]), gf.shape[0])
        if a.ndim != 3 or a.shape[1:] != gf.shape[1:]:   # wrong shape: bad from the first layer on
            cols["first_bad_step"][r], cols["first_bad_layer"][r], cols["first_bad_rel_err"][r] = 0, 0, np.inf
            cols["fingerprint_rel_max"][r] = cols["fingerprint_rel_before"][r] = np.inf
            continue
        gref = gf[:n].astype(np.float64)
        rel_l2 = np.linalg.norm(a[:n] - gref, axis=-1) / np.maximum(np.linalg.norm(gref, axis=-1), REL_EPS)  # [n, L]
        rel_l2 = np.where(np.isfinite(rel_l2), rel_l2, np.inf)   # NaN from the engine counts as bad
        rels[r] = rel_l2
        cols["fingerprint_rel_max"][r] = rel_l2.max()
        if fs[r] > 0:
            cols["fingerprint_rel_before"][r] = rel_l2[:fs[r]].max()
        bad = rel_l2 > fingerprint_rtol
        if bad.any():
            s, layer = divmod(int(bad.argmax()), bad.shape[1])
            cols["first_bad_step"][r], cols["first_bad_layer"][r] = s, layer
            cols["first_bad_rel_err"][r] = rel_l2[s, layer]
    if rel_out is not None:
        rel_out.extend(rels)
    return cols
