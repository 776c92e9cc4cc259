from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.evaluation import evaluate_perplexity

    evaluate_perplexity(
        model_dir=Path(snakemake.input.model),
        tokens_bin=Path(snakemake.input.tokens),
        corpus=snakemake.wildcards.dataset,
        seq_len=snakemake.params.seq_len,
        batch_size=snakemake.params.batch_size,
        max_tokens=snakemake.params.max_tokens,
        out_json=Path(snakemake.output[0]),
        device=snakemake.params.device,
    )
