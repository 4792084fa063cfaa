"""The report's plots (matplotlib, Agg, no pyplot global state). Each returns PNG bytes.

Every plot is always drawn, with a short message when there is nothing to show, so the set of
output files is fixed (Snakemake declares them). Beyond a few dozen runs the plots aggregate or keep
the worst rows and say so in their title.
"""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from k2vec.report.classes import CLASSES, SEVERITY
from k2vec.report.figures import COLORS, row_labels
from k2vec.report.words import plural

MAX_GRID_ROWS = 60
MAX_LINES = 40
MAX_LAYER_ROWS = 60
MAX_PANELS = 12
FLOOR = 1e-16   # log axes: the lowest floor on which exact zeros are drawn
DPI = 100


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()


def _empty(message: str, title: str) -> bytes:
    fig = Figure(figsize=(8, 1.6), layout="constrained")
    ax = fig.add_subplot()
    ax.axis("off")
    ax.set_title(title, loc="left", fontsize=11, fontweight="bold")
    ax.text(0.5, 0.4, message, ha="center", va="center", fontsize=11, color="#555")
    return _png(fig)


def _floor(values: pd.Series) -> float:
    """Where a log axis draws exact zeros: a decade below the smallest positive value."""
    pos = values[values > 0]
    return max(FLOOR, 10.0 ** (np.floor(np.log10(pos.min())) - 1)) if len(pos) else 1.0


def _mark_floor(ax, floor: float) -> None:
    ax.axhline(floor, color="#999", ls=":", lw=0.8)
    ax.annotate("exact (0)", (1, floor), xycoords=("axes fraction", "data"), xytext=(-4, 3),
                textcoords="offset points", ha="right", va="bottom", fontsize=7, color="#555")


def _legend_handles(classes=CLASSES):
    return [Patch(facecolor=COLORS[c], edgecolor="#999", label=c) for c in classes]


# ---------------------------------------------------------------------------------------- match grid


def match_grid(rows: pd.DataFrame) -> bytes:
    title = "Match grid"
    if rows.empty:
        return _empty("no engine runs", title)
    sev = rows["class"].map(SEVERITY)
    df = rows.assign(label=row_labels(rows), sev=sev, bad=(sev > 0).astype(int), acc_key=rows["accuracy"].fillna(-1.0))
    keys = ["run", "acc_key"]
    per = df.groupby(keys, sort=False).agg(label=("label", "first"), worst=("sev", "max"),
                                          bad=("bad", "sum"))
    per["order"] = np.arange(len(per))
    n_all = len(per)
    note = ""
    if n_all > MAX_GRID_ROWS:
        # keep token divergences first (real, router-near-tie, near-tie: the rows to look at), then
        # failed runs (also listed in the failure table), then exact ones; the bar above counts all
        rank = per["worst"].map({SEVERITY["real"]: 0, SEVERITY["over-budget"]: 0, SEVERITY["convention"]: 0,
                                 SEVERITY["router-near-tie"]: 1, SEVERITY["near-tie"]: 2, SEVERITY["precision-tie"]: 2,
                                 SEVERITY["failed"]: 3, SEVERITY["changed"]: 3, SEVERITY["within-budget"]: 4,
                                 SEVERITY["exact"]: 4})
        keep = per.assign(rank=rank).sort_values(["rank", "bad", "order"],
                                                 ascending=[True, False, True]).head(MAX_GRID_ROWS)
        shown = keep["worst"].value_counts()
        total = per["worst"].value_counts()
        parts = [f"{int(shown.get(SEVERITY[c], 0))}/{int(total.get(SEVERITY[c], 0))} {c}"
                 for c in ("real", "over-budget", "convention", "router-near-tie", "near-tie", "precision-tie",
                           "failed", "changed", "within-budget", "exact")
                 if total.get(SEVERITY[c], 0)]
        note = (f"showing {MAX_GRID_ROWS} of {n_all:,} run x accuracy rows, divergences first\n"
                f"(by worst class, shown/all: {', '.join(parts)})")
        per = keep.drop(columns="rank").sort_values("order")
    df = df.set_index(keys).loc[per.index].reset_index()
    n_prompts = int(df["prompt"].max()) + 1
    pos = {k: i for i, k in enumerate(per.index)}
    r_i = np.array([pos[k] for k in zip(df["run"], df["acc_key"])])
    grid = np.full((len(per), n_prompts), np.nan)
    grid[r_i, df["prompt"].to_numpy()] = df["sev"].to_numpy()

    width = min(16.0, max(9.0, 4.5 + 0.42 * n_prompts))
    height = 1.6 + 0.26 * len(per)
    fig = Figure(figsize=(width, height), layout="constrained")
    gs = fig.add_gridspec(2, 1, height_ratios=[0.55, max(1.0, 0.26 * len(per))])
    # totals over every row (also those not drawn below)
    ax0 = fig.add_subplot(gs[0])
    counts = rows["class"].value_counts()
    left = 0
    total = len(rows)
    for c in CLASSES:
        n = int(counts.get(c, 0))
        if n:
            ax0.barh(0, n, left=left, color=COLORS[c], edgecolor="white")
            if n / total > 0.12:
                ax0.text(left + n / 2, 0, f"{c} {n:,}", ha="center", va="center", fontsize=8,
                         color="black" if c in ("near-tie", "exact") else "white")
            left += n
    ax0.set_xlim(0, total)
    ax0.set_yticks([])
    ax0.set_xticks([])
    for s in ax0.spines.values():
        s.set_visible(False)
    ax0.set_title(f"All {total:,} prompt rows: " + ", ".join(f"{c} {int(counts.get(c, 0)):,}" for c in CLASSES
                                                             if counts.get(c, 0)), loc="left", fontsize=10)

    ax = fig.add_subplot(gs[1])
    cmap = ListedColormap([COLORS[c] for c in CLASSES]).with_extremes(bad="#eeeeee")
    ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=-0.5, vmax=len(CLASSES) - 0.5, aspect="auto",
              interpolation="nearest")
    ax.set_yticks(range(len(per)), per["label"].tolist(), fontsize=8)
    step = max(1, n_prompts // 32)
    ax.set_xticks(range(0, n_prompts, step), [f"p{i}" for i in range(0, n_prompts, step)], fontsize=8)
    ax.set_xticks(np.arange(-0.5, n_prompts), minor=True)
    ax.set_yticks(np.arange(-0.5, len(per)), minor=True)
    ax.grid(which="minor", color="white", linewidth=1.2)
    ax.tick_params(which="minor", length=0)
    ax.xaxis.tick_top()
    if n_prompts <= 40:
        fstep = df["first_step"].to_numpy()
        for r, p, sev, s in zip(r_i, df["prompt"].to_numpy(), df["sev"].to_numpy(), fstep):
            if sev >= SEVERITY["failed"]:
                ax.text(p, r, "\u00d7", ha="center", va="center", fontsize=9, color="white")
            elif not pd.isna(s):
                ax.text(p, r, str(int(s)), ha="center", va="center", fontsize=7,
                        color="black" if sev in (1, 2) else "white")
    ax.legend(handles=_legend_handles(), loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.set_title(note or f"{plural(n_all, 'run x accuracy row')} x {plural(n_prompts, 'prompt')} "
                         "(cell: first divergent step)",
                 loc="left", fontsize=9, color="#a00" if note else "#333", pad=18)
    return _png(fig)


# ---------------------------------------------------------------------------------------- logit error


def logit_error(rows: pd.DataFrame, steps: pd.DataFrame) -> bytes:
    title = "Logit error per step (shared top-k)"
    if steps.empty or steps["abs_max"].isna().all():
        return _empty("no engine returned top-k logits", title)
    st = steps.dropna(subset=["abs_max"])
    worst = st.groupby("row")["abs_max"].max()
    nonzero = worst[worst > 0].index
    if not len(nonzero):
        return _empty(f"{'the' if len(worst) == 1 else 'all'} "
                      f"{plural(len(worst), 'row with top-k logits matches', 'rows with top-k logits match')} "
                      "the golden exactly (zero error)", title)
    fig = Figure(figsize=(13, 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    n_rows, n_zero = len(worst), int((worst == 0).sum())
    sub = st[st["row"].isin(nonzero)]
    labels = row_labels(rows) + " p" + rows["prompt"].astype(str)
    for ax, col, name in ((axes[0], "abs_max", "max |logit(engine) - logit(golden)|"),
                          (axes[1], "kl", "KL(golden || engine), top-k softmax")):
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(name, fontsize=10, loc="left")
        ax.grid(alpha=0.3)
        floor = _floor(sub[col])   # steps that match exactly are drawn on this floor
        if len(nonzero) <= MAX_LINES:
            for row, grp in sub.groupby("row"):
                cls = rows.at[row, "class"]
                y = np.maximum(grp[col].to_numpy(float), floor)
                ax.plot(grp["step"], y, "-", marker=".", ms=4, color=COLORS[cls], alpha=0.85, lw=1.3,
                        label=labels.at[row] if col == "abs_max" and len(nonzero) <= 8 else None)
                if cls != "exact":
                    ax.plot(grp["step"].iloc[-1], y[-1], "x", color="black", ms=7, mew=1.6)
        else:  # too many lines: the spread across rows per step, plus the worst few
            q = sub.groupby("step")[col].quantile([0.5, 0.9, 1.0]).unstack()
            ax.fill_between(q.index, np.maximum(q[0.5], floor), np.maximum(q[1.0], floor), color="#90caf9",
                            alpha=0.5, label="median..max over rows")
            ax.plot(q.index, np.maximum(q[0.9], floor), color="#1565c0", lw=1.2, label="p90")
            for row in worst.sort_values(ascending=False).index[:5]:
                grp = sub[sub["row"] == row]
                ax.plot(grp["step"], np.maximum(grp[col].to_numpy(float), floor), "-", lw=1,
                        color=COLORS[rows.at[row, "class"]], label="5 worst rows" if row == worst.idxmax() else None)
            ax.legend(fontsize=8, loc="lower right")
        if col == "abs_max" and len(nonzero) <= 8:
            ax.legend(fontsize=7, loc="lower right")
        _mark_floor(ax, floor)
    note = (f"{len(nonzero)} of {plural(n_rows, 'row')} with top-k {'has' if len(nonzero) == 1 else 'have'} "
            "a nonzero error")
    if n_zero:
        note += f"; {plural(n_zero, 'exact-zero row')} not drawn"
    if len(nonzero) > MAX_LINES:
        note += f"; band over {plural(len(nonzero), 'row')}, lines = 5 worst"
    fig.suptitle(f"{title}: {note}", fontsize=10, x=0.01, ha="left")
    return _png(fig)


# ------------------------------------------------------------------------------------ first bad layer


def first_bad_layer(rows: pd.DataFrame) -> bytes:
    title = "First divergent layer"
    has_fp = rows["fingerprint_rel_max"].notna()
    has_rt = rows["router_diff_layer"].notna()
    bad = rows[rows["first_bad_layer"].notna() | has_rt]
    if not has_fp.any() and not has_rt.any():
        return _empty("no engine returned fingerprints or router choices that differ", title)
    n_bad = int(rows['first_bad_layer'].notna().sum())
    note = (f"{n_bad} of {plural(int(has_fp.sum()), 'row')} with fingerprints {'exceeds' if n_bad == 1 else 'exceed'} "
            f"the threshold; {plural(int(has_rt.sum()), 'row')} with a router difference")
    if bad.empty:
        return _empty(f"no fingerprint or router difference ({note})", title)
    layers = pd.concat([bad["first_bad_layer"], bad["router_diff_layer"]]).dropna()
    lmax = int(layers.max())
    if len(bad) <= MAX_LAYER_ROWS:
        labels = (row_labels(bad) + " p" + bad["prompt"].astype(str)).tolist()
        fig = Figure(figsize=(10, 1.4 + 0.3 * len(bad)), layout="constrained")
        ax = fig.add_subplot()
        y = np.arange(len(bad))
        fl, fs = bad["first_bad_layer"].to_numpy(float), bad["first_bad_step"].to_numpy(float)
        rl, rs = bad["router_diff_layer"].to_numpy(float), bad["router_diff_step"].to_numpy(float)
        colors = [COLORS[c] for c in bad["class"]]
        ax.scatter(fl, y, s=90, c=colors, edgecolors="black", zorder=3, label="fingerprint > rtol")
        ax.scatter(rl + 0.3, y, s=70, marker="^", c=colors, edgecolors="black", zorder=3, label="router set differs")
        for yi, l_, s_ in zip(y, fl, fs):
            if not np.isnan(l_):
                ax.annotate(f"step {int(s_)}", (l_, yi), xytext=(-9, -3), textcoords="offset points", fontsize=7,
                            ha="right")
        for yi, l_, s_ in zip(y, rl, rs):
            if not np.isnan(l_):
                ax.annotate(f"step {int(s_)}", (l_ + 0.3, yi), xytext=(8, -3), textcoords="offset points",
                            fontsize=7, color="#555")
        ax.set_yticks(y, labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(-0.5, lmax + 1.4)
        ax.set_xticks(range(lmax + 1))
        ax.set_xlabel("layer")
        ax.grid(axis="x", alpha=0.3)
        handles = [Line2D([], [], ls="", marker="o", ms=9, mfc="#bbb", mec="black", label="fingerprint > rtol"),
                   Line2D([], [], ls="", marker="^", ms=8, mfc="#bbb", mec="black", label="router set differs"),
                   *_legend_handles([c for c in CLASSES if c in set(bad["class"])])]
        ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    else:  # many rows: how often each layer is the first bad one
        fig = Figure(figsize=(10, 3.8), layout="constrained")
        ax = fig.add_subplot()
        x = np.arange(lmax + 1)
        fpc = bad["first_bad_layer"].dropna().astype(int).value_counts().reindex(x, fill_value=0)
        rtc = bad["router_diff_layer"].dropna().astype(int).value_counts().reindex(x, fill_value=0)
        ax.bar(x - 0.2, fpc.to_numpy(), 0.4, color="#5c6bc0", label="fingerprint > rtol")
        ax.bar(x + 0.2, rtc.to_numpy(), 0.4, color="#fb8c00", label="router set differs")
        ax.set_xticks(x)
        ax.set_xlabel("first divergent layer")
        ax.set_ylabel("prompt rows")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        note += f" (counts over {plural(len(bad), 'row')})"
    ax.set_title(f"{title}: {note}", fontsize=10, loc="left")
    return _png(fig)


# ---------------------------------------------------------------------------------------- acceptance


def acceptance(hist: pd.DataFrame) -> bytes:
    title = "DDTree acceptance length"
    if hist.empty:
        return _empty("no DDTree runs with rounds", title)
    h = hist.assign(acc_key=hist["accuracy"].fillna(-1.0),
                    budget=hist["mode"].str.extract(r"(\d+)$", expand=False).astype(float))
    keys = ["model", "precision", "budget", "mode", "acc_key"]
    panels = sorted(h.groupby(keys, sort=False).groups)
    note = ""
    if len(panels) > MAX_PANELS:
        # keep the panels where the engines' distribution is furthest from the golden's (total variation)
        frac = h.assign(is_gold=h["source"] == "golden").groupby(keys + ["is_gold", "length"])["count"].sum()
        frac = frac / frac.groupby(level=keys + ["is_gold"]).transform("sum")
        wide = frac.unstack("is_gold", fill_value=0.0)
        tv = (wide.get(True, 0.0) - wide.get(False, 0.0)).abs().groupby(level=keys).sum() / 2
        top = set(tv.sort_values(ascending=False, kind="stable").index[:MAX_PANELS])
        note = f" ({MAX_PANELS} of {len(panels)} panels: the largest engine vs golden difference)"
        panels = [p for p in panels if p in top]
    ncols = min(4, len(panels))
    nrows = -(-len(panels) // ncols)
    fig = Figure(figsize=(3.6 * ncols + 0.5, 2.9 * nrows + 0.6), layout="constrained")
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
    palette = ["#1e88e5", "#e53935", "#8e24aa", "#00897b"]
    for ax, key in zip(axes, panels):
        sub = h[(h["model"] == key[0]) & (h["precision"] == key[1]) & (h["mode"] == key[3]) & (h["acc_key"] == key[4])]
        engines = [s for s in sub["source"].unique() if s != "golden"]
        if len(engines) > len(palette):  # pool many engines into one distribution
            sub = sub.assign(source=np.where(sub["source"] == "golden", "golden", plural(len(engines), "engine")))
            sub = sub.groupby(["source", "length"], as_index=False)["count"].sum()
            engines = [plural(len(engines), "engine")]
        lens = np.arange(int(sub["length"].min()), int(sub["length"].max()) + 1)
        series = ["golden"] + engines
        width = 0.8 / len(series)
        for j, src in enumerate(series):
            s = sub[sub["source"] == src].groupby("length")["count"].sum().reindex(lens, fill_value=0)
            total = s.sum()
            if total == 0:
                continue
            mean = float((s.index * s).sum() / total)
            off = (j - (len(series) - 1) / 2) * width
            if src == "golden":
                ax.bar(lens + off, s / total, width, facecolor="#bdbdbd", edgecolor="black",
                       label=f"golden \u03c4={mean:.2f}")
            else:
                ax.bar(lens + off, s / total, width, color=palette[(j - 1) % len(palette)],
                       label=f"{src} \u03c4={mean:.2f}")
        acc = "" if key[4] < 0 else f" p={key[4]:g}"
        ax.set_title(f"{key[0]}/{key[1]} {key[3]}{acc}", fontsize=9)
        ax.set_xticks(lens)
        ax.set_xlabel("tokens per round", fontsize=8)
        ax.set_ylabel("fraction of rounds", fontsize=8)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    for ax in axes[len(panels):]:
        ax.axis("off")
    fig.suptitle(title + note, fontsize=11, x=0.01, ha="left")
    return _png(fig)


# ------------------------------------------------------------------------------------- format effect


def format_effect(fe: pd.DataFrame, fe_steps: pd.DataFrame, n_steps: dict[str, int]) -> bytes:
    title = "Format effect (fp32 vs int4 golden)"
    if fe.empty:
        return _empty("no model has both an fp32 and an int4 golden", title)
    fig = Figure(figsize=(13, 4), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    models = list(dict.fromkeys(fe["model"]))
    palette = ["#1e88e5", "#e53935", "#43a047", "#8e24aa", "#fb8c00", "#00897b"]
    floor = _floor(fe_steps["kl"])   # KL over a single shared id is exactly 0
    for m_i, model in enumerate(models):
        c = palette[m_i % len(palette)]
        sub = fe_steps[fe_steps["model"] == model]
        for p, grp in sub.groupby("prompt"):
            y = np.maximum(grp["kl"].to_numpy(float), floor)
            ax1.plot(grp["step"], y, "-o", ms=3, color=c, alpha=0.7, label=model if p == sub["prompt"].min() else None)
            div = fe[(fe["model"] == model) & (fe["prompt"] == p)]["first_step"]
            if len(div) and not pd.isna(div.iloc[0]):
                ax1.plot(grp["step"].iloc[-1], y[-1], "x", color="black", ms=7)
    ax1.set_yscale("log")
    _mark_floor(ax1, floor)
    ax1.set_xlabel("step")
    last = int(fe_steps["step"].max()) if len(fe_steps) else 0
    ax1.set_xlim(-0.5, last + 0.5)
    ax1.set_xticks(range(0, last + 1, max(1, (last + 1) // 16)))
    ax1.set_title("KL(fp32 || int4) of the top-k softmax per step, to the first divergence (x)", fontsize=9, loc="left")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    # first divergent step per prompt, one bar group per model
    width = 0.8 / len(models)
    for m_i, model in enumerate(models):
        sub = fe[fe["model"] == model]
        n = n_steps.get(model, int(sub["matched_steps"].max()))
        x = sub["prompt"].to_numpy() + (m_i - (len(models) - 1) / 2) * width
        h = sub["matched_steps"].to_numpy(float)
        never = sub["first_step"].isna().to_numpy()
        bars = ax2.bar(x, np.maximum(h, 0.15), width, color=palette[m_i % len(palette)], label=model)
        for b, nv, v in zip(bars, never, h):
            if nv:
                b.set_hatch("//")
            ax2.text(b.get_x() + b.get_width() / 2, max(v, 0.15), f"{int(v)}" + ("" if not nv else "\u2713"),
                     ha="center", va="bottom", fontsize=7)
        ax2.axhline(n, color="#777", ls="--", lw=0.8)
    prompts = sorted(fe["prompt"].unique())
    ax2.set_xticks(prompts, [f"p{int(p)}" for p in prompts])
    ax2.set_ylim(0, max(n_steps.values(), default=1) * 1.1 + 0.5)
    ax2.set_xlabel("prompt")
    ax2.set_ylabel("first divergent step")
    ax2.set_title("first divergent step per prompt (hatched \u2713: none within max_new_tokens)", fontsize=9,
                  loc="left")
    ax2.legend(fontsize=8)
    ax2.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=11, x=0.01, ha="left")
    return _png(fig)


# ------------------------------------------------------------------------------------------ score KL


def score_kl(score_runs: pd.DataFrame, rows: pd.DataFrame, steps: pd.DataFrame, ref_steps: pd.DataFrame) -> bytes:
    """Per engine, the complementary CDF of the per-position KL of its score runs (log x), with the
    format-effect reference of each model; exact zeros are drawn on the floor."""
    title = "Score mode: KL(golden || engine) per position"
    engines = [e for e in dict.fromkeys(score_runs.loc[~score_runs["reference"].astype(bool), "engine"])] \
        if len(score_runs) else []
    if not engines:
        return _empty("no score runs", title)
    score_rows = rows[rows["mode"] == "score"]
    st = steps[steps["row"].isin(score_rows.index)].join(score_rows[["engine", "model", "precision"]], on="row")
    kl_all = pd.concat([st["kl"], ref_steps["kl"]]).dropna()
    floor = _floor(kl_all)
    hi = max(float(kl_all.max()) if len(kl_all) else 1.0, floor * 10)
    engines = engines[:MAX_PANELS]
    fig = Figure(figsize=(min(16.0, 4.2 * len(engines) + 1), 3.6), layout="constrained")
    axes = fig.subplots(1, len(engines), squeeze=False, sharey=True)[0]

    def ccdf(ax, kl: np.ndarray, **kw) -> None:
        kl = np.sort(np.maximum(kl[np.isfinite(kl)], floor))
        if kl.size:
            ax.step(kl, 1.0 - np.arange(kl.size) / kl.size, where="post", **kw)

    for ax, engine in zip(axes, engines):
        for (model, precision), grp in st[st["engine"] == engine].groupby(["model", "precision"], sort=True):
            ccdf(ax, grp["kl"].to_numpy(float), lw=1.4, label=f"{model}/{precision}")
        for model, grp in ref_steps.groupby("model", sort=True):
            ccdf(ax, grp["kl"].to_numpy(float), lw=1.0, ls="--", color="#777", label=f"int4-format {model}")
        ax.set_xscale("log")
        ax.set_xlim(floor / 2, hi * 2)
        ax.axvline(floor, color="#999", ls=":", lw=0.8)
        ax.set_title(engine, fontsize=10)
        ax.set_xlabel("KL per position (nats)")
        ax.legend(fontsize=7, loc="lower left")
    axes[0].set_ylabel("fraction of positions with KL \u2265 x")
    fig.suptitle(title, x=0.01, ha="left", fontsize=11, fontweight="bold")
    return _png(fig)
