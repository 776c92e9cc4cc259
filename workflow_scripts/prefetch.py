from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.workflow.resources import online

    online()  # a download rule (localrules): the user's network settings, not the jobs' offline ones
    from dimattn.evaluation.projected import prefetch

    p = snakemake.params
    prefetch(models=p.models, tasks=p.tasks, metadata=p.metadata, out_json=Path(snakemake.output[0]),
             lm_eval_tasks=p.lm_eval_tasks, allow_unsafe_code=p.allow_unsafe_code, ruler_qa_sources=p.ruler_qa_sources)
