# How many dimensions attention needs: DAR (seed 000), sliding-window attention (seed 001)
# and DimPO (seed 003), from data download to LaTeX tables and figures.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config.yaml"


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/data.smk"
include: "rules/pretrain.smk"
include: "rules/evaluate.smk"
include: "rules/dimpo.smk"
include: "rules/report.smk"


# The tier's run record (dimattn.workflow.tiers), kept by the main process of a run that computes (not
# `snakemake figures`): the published manifest's wall time and config digest.
onstart:
    if recorded():
        tiers.start(PLAN.config, logs=log)


onsuccess:
    if recorded():
        tiers.finish(ok=True)


onerror:
    if recorded():
        tiers.finish(ok=False)


rule all:
    input:
        report_targets(),
