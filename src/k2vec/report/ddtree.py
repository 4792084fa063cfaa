"""DDTree: an engine's speculative-decoding rounds against the golden trace, and acceptance lengths."""

from __future__ import annotations

from itertools import chain
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd


class _Unreadable(Exception):
    """Rounds the runner would have refused (docs/engine-contract.md section 5): the report shows them as
    a differing tree rather than stopping."""


def _flat_rounds(rounds: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray | None]:
    try:
        flat = _flat(rounds)
    except (OverflowError, TypeError, ValueError, KeyError) as err:
        raise _Unreadable(f"{type(err).__name__}") from None
    if any(len(r[key]) != len(r["tokens"]) for r in rounds for key in ("parents", "depths") if key in r):
        raise _Unreadable("a round's parents or depths differ in length from its tokens")
    return flat


def _flat(rounds: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray | None]:
    def cat(key):
        return np.fromiter(chain.from_iterable(r[key] for r in rounds), np.int64)

    return {
        "sizes": np.fromiter((len(r["tokens"]) for r in rounds), np.int64, len(rounds)),
        "tokens": cat("tokens"), "parents": cat("parents"),
        "depths": cat("depths") if all("depths" in r for r in rounds) else None,
        "acc_sizes": np.fromiter((len(r["accepted"]) for r in rounds), np.int64, len(rounds)),
        "accepted": cat("accepted"),
        "start": np.fromiter((r["start"] for r in rounds), np.int64, len(rounds)),
        "bonus": np.fromiter((r["bonus"] for r in rounds), np.int64, len(rounds)),
    }


def compare_tree(rounds: Sequence[Mapping[str, Any]], tr: Mapping[str, np.ndarray]
                 ) -> tuple[bool, int | None, int | None, str | None, np.ndarray]:
    """(identical, first differing round, node index in it, what differs, engine acceptance lengths).

    The node is the first index within the round whose token, parent or depth differs, or the
    smaller tree size when one tree is a prefix of the other; a round whose nodes agree but whose
    accepted path, bonus or start differ has node None."""
    try:
        e = _flat_rounds(rounds)
    except _Unreadable as err:   # values past int64, ragged rounds: the runner refuses them; a stray file may not
        return False, 0, None, f"rounds unreadable ({err}): not a valid result", np.zeros(0, np.int64)
    g_sizes, g_acc_sizes = np.diff(tr["node_offsets"]), np.diff(tr["accepted_offsets"])
    same = (np.array_equal(e["sizes"], g_sizes) and np.array_equal(e["tokens"], tr["node_tokens"])
            and np.array_equal(e["parents"], tr["node_parents"])
            and (e["depths"] is None or np.array_equal(e["depths"], tr["node_depths"]))
            and np.array_equal(e["acc_sizes"], g_acc_sizes) and np.array_equal(e["accepted"], tr["accepted"])
            and np.array_equal(e["start"], tr["round_start"]) and np.array_equal(e["bonus"], tr["round_bonus"]))
    if same:
        return True, None, None, None, e["acc_sizes"]
    e_off = np.r_[0, np.cumsum(e["sizes"])]
    e_aoff = np.r_[0, np.cumsum(e["acc_sizes"])]
    for r in range(min(len(e["sizes"]), len(g_sizes))):
        es, gs = slice(e_off[r], e_off[r + 1]), slice(tr["node_offsets"][r], tr["node_offsets"][r + 1])
        n = min(e["sizes"][r], g_sizes[r])
        parts = [("token", e["tokens"][es], tr["node_tokens"][gs]),
                 ("parent", e["parents"][es], tr["node_parents"][gs])]
        if e["depths"] is not None:
            parts.append(("depth", e["depths"][es], tr["node_depths"][gs]))
        bad = np.zeros(n, bool)
        for _, a, b in parts:
            bad |= a[:n] != b[:n]
        if bad.any():
            node = int(bad.argmax())
            what = next(f"{name} (engine {a[node]}, golden {b[node]})" for name, a, b in parts if a[node] != b[node])
            return False, r, node, what, e["acc_sizes"]
        if e["sizes"][r] != g_sizes[r]:
            return False, r, int(n), f"size (engine {e['sizes'][r]} nodes, golden {g_sizes[r]})", e["acc_sizes"]
        ea = e["accepted"][e_aoff[r]:e_aoff[r + 1]]
        ga = tr["accepted"][tr["accepted_offsets"][r]:tr["accepted_offsets"][r + 1]]
        if not np.array_equal(ea, ga):
            return False, r, None, f"accepted (engine {ea.tolist()}, golden {ga.tolist()})", e["acc_sizes"]
        if e["bonus"][r] != tr["round_bonus"][r]:
            return False, r, None, f"bonus (engine {e['bonus'][r]}, golden {tr['round_bonus'][r]})", e["acc_sizes"]
        if e["start"][r] != tr["round_start"][r]:
            return False, r, None, f"start (engine {e['start'][r]}, golden {tr['round_start'][r]})", e["acc_sizes"]
    r = min(len(e["sizes"]), len(g_sizes))
    return False, r, None, f"round count (engine {len(e['sizes'])}, golden {len(g_sizes)})", e["acc_sizes"]


def acceptance_hist(hist_rows) -> pd.DataFrame:
    """Long histogram data: one row per (model, precision, mode, accuracy, source, length) with the
    count of rounds. The golden is counted once per prompt (not once per engine run)."""
    cols = ["model", "precision", "mode", "accuracy", "source", "length", "count"]
    if not hist_rows:
        return pd.DataFrame(columns=cols)
    lens = [h[7] for h in hist_rows]
    n = np.array([len(x) for x in lens])
    df = pd.DataFrame({
        "model": np.repeat([h[0] for h in hist_rows], n), "precision": np.repeat([h[1] for h in hist_rows], n),
        "mode": np.repeat([h[2] for h in hist_rows], n), "accuracy": np.repeat([h[3] for h in hist_rows], n),
        "source": np.repeat([h[4] for h in hist_rows], n), "run": np.repeat([h[5] for h in hist_rows], n),
        "prompt": np.repeat([h[6] for h in hist_rows], n), "length": np.concatenate(lens) if lens else [],
    })
    gold = df["source"] == "golden"
    df = pd.concat([df[~gold], _dedupe_golden(df[gold])])
    return (df.groupby(["model", "precision", "mode", "accuracy", "source", "length"], dropna=False)
              .size().rename("count").reset_index())


def _dedupe_golden(g: pd.DataFrame) -> pd.DataFrame:
    """Golden rounds appear once per engine run that used the trace; keep one run's per prompt."""
    if g.empty:
        return g
    keys = ["model", "precision", "mode", "accuracy", "prompt"]
    return g[g["run"] == g.groupby(keys, dropna=False)["run"].transform("min")]


