from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.evaluation import prefetch

    p = snakemake.params
    prefetch(models=p.models, tasks=p.tasks, metadata=p.metadata, out_json=Path(snakemake.output[0]))
