from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.evaluation.scoring import HELDOUT_TASK, NEXT_LINE_TASK, write_lm_eval_data

    write_lm_eval_data(
        Path(snakemake.input.test),
        {HELDOUT_TASK: Path(snakemake.output.heldout), NEXT_LINE_TASK: Path(snakemake.output.next_line)},
        heldout_docs=snakemake.params.heldout_docs,
        next_line_docs=snakemake.params.next_line_docs,
        skip_lines=snakemake.params.skip_lines,
        seed=snakemake.params.seed,
    )
