"""Columns of the files one stage writes and another reads, where the writer imports torch and
the reader must not (the reporting stage runs without it): the per-layer attention fidelity CSV
that dimattn.dimpo.projections.fidelity_to_file writes and dimattn.reporting.summaries gathers.
Imports nothing.
"""

# One row per (fit, layer) of a fit's CSV; seed is the fit's.
# top_k, topk_recall: of each query's top_k keys by attention, the share the projection's top_k
# keep (dimattn.dimpo.fidelity.attention_fidelity), k the paper's share of the key list.
FIDELITY_COLUMNS = ["model", "objective", "setting", "d_prime", "head_dim", "seed", "layer", "kl", "mse",
                    "kl_inference", "mse_inference", "top_k", "topk_recall"]
