from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.evaluation import write_lm_eval_tasks

    write_lm_eval_tasks(
        Path(snakemake.input.test),
        Path(snakemake.output[0]),
        heldout_docs=snakemake.params.heldout_docs,
        next_line_docs=snakemake.params.next_line_docs,
    )
