"""What the report's figures are, without drawing them (no matplotlib, which costs a report a few tenths of a
second to import and is loaded only where a plot is drawn, report/plot_cache.py): their files, element ids and
captions, the colour of each divergence class, and the label of a row."""

from __future__ import annotations

import pandas as pd

COLORS = {"exact": "#43a047", "within-budget": "#9ccc65", "near-tie": "#fdd835", "router-near-tie": "#fb8c00",
          "precision-tie": "#4fc3f7", "convention": "#7e57c2", "over-budget": "#ad1457", "real": "#e53935",
          "failed": "#37474f", "changed": "#8e24aa"}

PLOTS = {  # file name -> (element id, caption)
    "match_grid.png": ("plot-match-grid", "Match grid: every run x accuracy (rows) against every prompt (columns), "
                       "coloured by the class of its first divergence; the number is the first divergent step."),
    "logit_error.png": ("plot-logit-error", "Logit error on the shared top-k per step, up to and including the "
                        "first divergent step (x)."),
    "first_bad_layer.png": ("plot-first-bad-layer", "First layer whose fingerprint relative L2 error exceeds "
                            "fingerprint_rtol (circle, labelled with its step), and first MoE layer whose expert "
                            "set differs from the golden's (triangle)."),
    "acceptance.png": ("plot-acceptance", "DDTree acceptance lengths (tokens committed per round, root "
                       "included) of the engines against the golden traces."),
    "format_effect.png": ("plot-format-effect", "Format effect: the int4 golden against the fp32 golden of the "
                          "same model, both decoding their own tokens."),
    "score_kl.png": ("plot-score-kl", "Score mode: the distribution of KL(golden || engine) over every (prompt, "
                     "step) position of each score run (fraction of positions whose KL is at least x), one panel "
                     "per engine; dashed: the int4 golden model forced on the fp32 golden sequence (int4-format)."),
}


def row_labels(rows: pd.DataFrame) -> pd.Series:
    acc = rows["accuracy"].map(lambda a: "" if pd.isna(a) else f" p={a:g}")
    return (rows["engine"].astype(str) + " " + rows["model"].astype(str) + "/" + rows["precision"].astype(str)
            + " " + rows["mode"].astype(str) + acc)
