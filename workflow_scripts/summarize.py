from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn import reporting

    summarize = {
        "summarize_perplexity": reporting.summarize_perplexity,
        "summarize_trajectory": reporting.summarize_trajectory,
        "summarize_lm_eval": reporting.summarize_lm_eval,
        "summarize_recall": reporting.summarize_recall,
        "summarize_fidelity": reporting.summarize_fidelity,
    }[snakemake.rule]
    # params are keyword arguments: synthetic (perplexity), datasets (trajectory)
    summarize([Path(p) for p in snakemake.input], Path(snakemake.output[0]), **dict(snakemake.params.items()))
