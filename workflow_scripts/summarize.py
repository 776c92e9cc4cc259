from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.reporting import summaries

    summarize = {
        "summarize_perplexity": summaries.summarize_perplexity,
        "summarize_trajectory": summaries.summarize_trajectory,
        "summarize_lm_eval": summaries.summarize_lm_eval,
        "summarize_recall": summaries.summarize_recall,
        "summarize_longctx": summaries.summarize_longctx,
        "summarize_longctx_needle": summaries.summarize_longctx_needle,
        "summarize_fidelity": summaries.summarize_fidelity,
        "summarize_downstream": summaries.summarize_downstream,
        "summarize_latency": summaries.summarize_latency,
        "summarize_frontier": summaries.summarize_frontier,
    }[snakemake.rule]
    # params are keyword arguments: datasets (trajectory); a named output "needle" the second file
    # of summarize_downstream (its needle-depth bins)
    extra = {"needle_csv": Path(snakemake.output.needle)} if "needle" in snakemake.output.keys() else {}
    summarize([Path(p) for p in snakemake.input], Path(snakemake.output[0]), **dict(snakemake.params.items()), **extra)
