"""The report's verdict classes, from best to worst (classify.py says what each means). A module of its own so
that the plots, which colour by class, depend on these names and nothing else of the metrics: an edit of the
metrics leaves the plot cache (plot_cache.py) valid, the plots' inputs carrying what the metrics computed."""

# changed: the result or its inputs changed after the run (report/integrity.py); the run is not judged.
CLASSES = ("exact", "within-budget", "near-tie", "router-near-tie", "precision-tie", "convention", "over-budget",
           "real", "failed", "changed")
SEVERITY = {c: i for i, c in enumerate(CLASSES)}  # higher = worse
