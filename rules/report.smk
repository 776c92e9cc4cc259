# Reporting (dimattn.reporting): raw outputs -> tidy CSV summaries (summarize_*), then LaTeX
# tables and PNG figures from the summaries alone (render_*, one rule per report category).
# Which summaries and outputs exist is dimattn.reporting.outputs' call, from the planned runs.

import functools

from dimattn.reporting import outputs
from dimattn.reporting.findings import TIERS as FINDINGS_TIERS

REPORT_ASKS = dict(
    runs=[PLAN.runs[run].fields for run in PLAN.reported_runs],
    lm_eval=bool(PLAN.lm_eval_runs),
    dimpo=PLAN.dimpo_studies,
    longctx=bool(PLAN.longctx_runs),
)
SUMMARIES = outputs.wanted_summaries(**REPORT_ASKS)

REPORTED = outputs.wanted(**REPORT_ASKS)
# report_targets(): every summary CSV and every table and figure (the Snakefile's `rule all`).
report_targets = functools.partial(outputs.targets, **REPORT_ASKS)


rule summarize_perplexity:
    input:
        perplexity_files(),
    output:
        paths.summary("dar_perplexity"),
    log:
        paths.log("report", "summarize_perplexity"),
    benchmark:
        paths.bench("summarize_perplexity", "summarize_perplexity")
    conda:
        "../envs/report.yaml"
    threads: 1
    resources:
        runtime=scaled(5, "runtime"),
        mem_mb=scaled(1000, "mem_mb"),
    script:
        "../workflow_scripts/summarize.py"


rule summarize_trajectory:
    input:
        model_dirs(),
    output:
        paths.summary("dar_trajectory"),
    log:
        paths.log("report", "summarize_trajectory"),
    benchmark:
        paths.bench("summarize_trajectory", "summarize_trajectory")
    conda:
        "../envs/report.yaml"
    threads: 1
    resources:
        runtime=scaled(5, "runtime"),
        mem_mb=scaled(1000, "mem_mb"),
    params:
        datasets={name: run.dataset for name, run in PLAN.runs.items()},
    script:
        "../workflow_scripts/summarize.py"


rule summarize_lm_eval:
    input:
        lm_eval_files(),
    output:
        paths.summary("lm_eval"),
    log:
        paths.log("report", "summarize_lm_eval"),
    benchmark:
        paths.bench("summarize_lm_eval", "summarize_lm_eval")
    conda:
        "../envs/report.yaml"
    threads: 1
    resources:
        runtime=scaled(5, "runtime"),
        mem_mb=scaled(1000, "mem_mb"),
    script:
        "../workflow_scripts/summarize.py"


# One row per long-context run, suite corpus and subtask, plus the average.
rule summarize_longctx:
    input:
        longctx_files(),
    output:
        paths.summary("longctx"),
    log:
        paths.log("report", "summarize_longctx"),
    benchmark:
        paths.bench("summarize_longctx", "summarize_longctx")
    conda:
        "../envs/report.yaml"
    threads: 1
    resources:
        runtime=scaled(5, "runtime"),
        mem_mb=scaled(1000, "mem_mb"),
    script:
        "../workflow_scripts/summarize.py"


# The needle heat map's data: niah_single per run, suite corpus and needle-depth bin.
rule summarize_longctx_needle:
    input:
        longctx_files(),
    output:
        paths.summary("longctx_needle"),
    log:
        paths.log("report", "summarize_longctx_needle"),
    benchmark:
        paths.bench("summarize_longctx_needle", "summarize_longctx_needle")
    conda:
        "../envs/report.yaml"
    threads: 1
    resources:
        runtime=scaled(5, "runtime"),
        mem_mb=scaled(1000, "mem_mb"),
    script:
        "../workflow_scripts/summarize.py"


# One row per recall run and distance bin, plus its overall accuracy.
rule summarize_recall:
    input:
        recall_files(),
    output:
        paths.summary("recall"),
    log:
        paths.log("report", "summarize_recall"),
    benchmark:
        paths.bench("summarize_recall", "summarize_recall")
    conda:
        "../envs/report.yaml"
    threads: 1
    resources:
        runtime=scaled(5, "runtime"),
        mem_mb=scaled(1000, "mem_mb"),
    script:
        "../workflow_scripts/summarize.py"


rule summarize_fidelity:
    input:
        list(fidelity_studies()),
    output:
        paths.summary("dimpo_fidelity"),
    log:
        paths.log("report", "summarize_fidelity"),
    benchmark:
        paths.bench("summarize_fidelity", "summarize_fidelity")
    conda:
        "../envs/report.yaml"
    threads: 1
    resources:
        runtime=scaled(5, "runtime"),
        mem_mb=scaled(1000, "mem_mb"),
    params:
        studies=fidelity_studies(),
    script:
        "../workflow_scripts/summarize.py"


rule summarize_downstream:
    input:
        downstream_files(),
    output:
        paths.summary("dimpo_downstream"),
        needle=paths.summary("dimpo_needle"),
    log:
        paths.log("report", "summarize_downstream"),
    benchmark:
        paths.bench("summarize_downstream", "summarize_downstream")
    conda:
        "../envs/report.yaml"
    threads: 1
    resources:
        runtime=scaled(5, "runtime"),
        mem_mb=scaled(1000, "mem_mb"),
    params:
        studies=downstream_studies(),
    script:
        "../workflow_scripts/summarize.py"


rule summarize_latency:
    input:
        latency_files(),
    output:
        paths.summary("dimpo_latency"),
    log:
        paths.log("report", "summarize_latency"),
    benchmark:
        paths.bench("summarize_latency", "summarize_latency")
    conda:
        "../envs/report.yaml"
    threads: 1
    resources:
        runtime=scaled(5, "runtime"),
        mem_mb=scaled(1000, "mem_mb"),
    script:
        "../workflow_scripts/summarize.py"


# The KV frontier's points: every scored run and projected model beside its measured cache.
rule summarize_frontier:
    input:
        perplexity_files() + recall_files() + longctx_files() + downstream_files(),
    output:
        paths.summary("kv_frontier"),
    log:
        paths.log("report", "summarize_frontier"),
    benchmark:
        paths.bench("summarize_frontier", "summarize_frontier")
    conda:
        "../envs/report.yaml"
    threads: 1
    resources:
        runtime=scaled(5, "runtime"),
        mem_mb=scaled(1000, "mem_mb"),
    script:
        "../workflow_scripts/summarize.py"


# render_dar, render_baselines, render_recall, render_lm_eval, render_dimpo: each declares
# exactly the category's wanted outputs and reads the summaries they need.
for category, names in outputs.by_category(REPORTED).items():
    slug = category.lower().replace("-", "_")

    rule:
        name:
            f"render_{slug}"
        input:
            [paths.summary(s) for s in outputs.reads(names, SUMMARIES)],
        output:
            [
                report(
                    outputs.OUTPUTS[name].path,
                    caption=f"../report/{outputs.OUTPUTS[name].caption}.rst",
                    category=category,
                )
                for name in names
            ],
        log:
            paths.log("report", f"render_{slug}"),
        benchmark:
            paths.bench(f"render_{slug}", f"render_{slug}")
        conda:
            "../envs/report.yaml"
        threads: 1
        resources:
            runtime=scaled(5, "runtime"),
            mem_mb=scaled(2000, "mem_mb"),
        params:
            outputs=names,
            reference_dir=PLAN.config["reference_dir"],
        script:
            "../workflow_scripts/render.py"


# `snakemake figures` (make figures: --config figures_from=published): re-render every table and
# figure the summaries on disk call for, with no training. It declares no input on purpose, so
# Snakemake never schedules upstream jobs for it, and no output (not even a benchmark file), so
# it runs whenever it is asked for.
rule figures:
    log:
        paths.log("report", "figures"),
    conda:
        "../envs/report.yaml"
    threads: every_core  # it runs alone: its outputs are drawn in parallel (outputs.render)
    resources:
        runtime=scaled(5, "runtime"),
        mem_mb=scaled(2000, "mem_mb"),
    params:
        # figures_from: published renders the tier's shipped summaries, checked against their
        # manifest first (dimattn.reporting.published)
        summary_dir=(
            f"{paths.published(PLAN.config['tier'])}/summary"
            if PLAN.config["figures_from"] == "published"
            else paths.SUMMARY
        ),
        published=(paths.published(PLAN.config["tier"]) if PLAN.config["figures_from"] == "published" else None),
        results_dir=paths.RESULTS,
        reference_dir=PLAN.config["reference_dir"],
    script:
        "../workflow_scripts/render.py"


# `snakemake findings` (make findings): docs/findings.md, each claim of reference/claims.yaml read
# off every published tier's summaries (dimattn.reporting.findings). Like figures, no output, so
# it runs whenever asked and never schedules a compute job.
rule findings:
    input:
        claims=f"{PLAN.config['reference_dir']}/claims.yaml",
        manifests=[
            f"{paths.published(tier)}/manifest.json"
            for tier in FINDINGS_TIERS
            if Path(f"{paths.published(tier)}/manifest.json").exists()
        ],
    log:
        paths.log("report", "findings"),
    conda:
        "../envs/report.yaml"
    threads: 1
    resources:
        runtime=scaled(5, "runtime"),
        mem_mb=scaled(1000, "mem_mb"),
    params:
        published=paths.PUBLISHED,
        tiers=list(FINDINGS_TIERS),
        dest="docs/findings.md",
    script:
        "../workflow_scripts/findings.py"
