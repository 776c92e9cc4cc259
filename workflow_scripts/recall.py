from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.evaluation import scoring as evaluation

    # the recall probe, or the long-context suite: a run scored on one synthetic corpus
    evaluate = {"recall": evaluation.evaluate_recall, "longctx": evaluation.evaluate_longctx}[snakemake.rule]
    evaluate(
        model_dir=Path(snakemake.input.model),
        tokens_bin=Path(snakemake.input.tokens),
        out_json=Path(snakemake.output[0]),
        batch_size=snakemake.params.batch_size,
        device=snakemake.params.device,
        corpus=snakemake.params.corpus,
    )
