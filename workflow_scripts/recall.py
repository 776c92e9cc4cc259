from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.evaluation import evaluate_recall

    evaluate_recall(
        model_dir=Path(snakemake.input.model),
        tokens_bin=Path(snakemake.input.tokens),
        out_json=Path(snakemake.output[0]),
        batch_size=snakemake.params.batch_size,
        device=snakemake.params.device,
        corpus=snakemake.params.corpus,
    )
