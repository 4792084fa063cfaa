"""The mixing-weight ladder: catalogue mutants that put the routed experts' mixing weights off by growing amounts
(at K2's routed_scaling_factor 2.827). The smallest step a bundle's verdict sees at a precision is its resolution
in those terms (report/resolution.py); its own module, so the report reads it without the catalogue."""

MIXING_LADDER = (("router_scaling_truncated", "1%"), ("router_scaling_5pct_low", "5%"),
                 ("router_scaling_10pct_low", "10%"), ("router_scaling_v3_value", "12%"),
                 ("router_scaling_missing", "65%"))
