from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.evaluation import run_lm_eval

    run_lm_eval(
        model_dir=Path(snakemake.input.model),
        tasks=snakemake.params.tasks,
        batch_size=snakemake.params.batch_size,
        limit=snakemake.params.limit,
        out_json=Path(snakemake.output[0]),
        device=snakemake.params.device,
    )
