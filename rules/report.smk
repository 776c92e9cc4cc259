# Reporting: tidy CSV summaries, then LaTeX tables and figures from them alone.


rule summarize_perplexity:
    input:
        perplexity_files(),
    output:
        f"{SUMMARY}/dar_perplexity.csv",
    log:
        f"{LOGS}/report/summarize_perplexity.log",
    benchmark:
        f"{BENCH}/report/summarize_perplexity.tsv"
    conda:
        "../envs/report.yaml"
    threads: 1
    resources:
        runtime=5,
        mem_mb=1000,
    params:
        synthetic=synthetic_datasets(),
    script:
        "../workflow_scripts/summarize.py"


rule summarize_trajectory:
    input:
        expand(f"{MODELS}/{{run}}", run=RUNS),
    output:
        f"{SUMMARY}/dar_trajectory.csv",
    log:
        f"{LOGS}/report/summarize_trajectory.log",
    benchmark:
        f"{BENCH}/report/summarize_trajectory.tsv"
    conda:
        "../envs/report.yaml"
    threads: 1
    resources:
        runtime=5,
        mem_mb=1000,
    params:
        datasets={run: spec["dataset"] for run, spec in RUNS.items()},
    script:
        "../workflow_scripts/summarize.py"


rule summarize_lm_eval:
    input:
        expand(f"{EVAL}/{{run}}/lm_eval.json", run=lm_eval_runs()),
    output:
        f"{SUMMARY}/lm_eval.csv",
    log:
        f"{LOGS}/report/summarize_lm_eval.log",
    benchmark:
        f"{BENCH}/report/summarize_lm_eval.tsv"
    conda:
        "../envs/report.yaml"
    threads: 1
    resources:
        runtime=5,
        mem_mb=1000,
    script:
        "../workflow_scripts/summarize.py"


# One row per recall run and distance bin, plus its overall accuracy (dimattn.reporting.summarize_recall).
rule summarize_recall:
    input:
        recall_files(),
    output:
        f"{SUMMARY}/recall.csv",
    log:
        f"{LOGS}/report/summarize_recall.log",
    benchmark:
        f"{BENCH}/report/summarize_recall.tsv"
    conda:
        "../envs/report.yaml"
    threads: 1
    resources:
        runtime=5,
        mem_mb=1000,
    script:
        "../workflow_scripts/summarize.py"


rule summarize_fidelity:
    input:
        expand(
            f"{DIMPO}/{{model}}/fidelity/{{objective}}-d{{d_prime}}.csv",
            model=dimpo_models(),
            objective=config.get("dimpo", {}).get("objectives", []),
            d_prime=config.get("dimpo", {}).get("d_prime", []),
        ),
    output:
        f"{SUMMARY}/dimpo_fidelity.csv",
    log:
        f"{LOGS}/report/summarize_fidelity.log",
    benchmark:
        f"{BENCH}/report/summarize_fidelity.tsv"
    conda:
        "../envs/report.yaml"
    threads: 1
    resources:
        runtime=5,
        mem_mb=1000,
    script:
        "../workflow_scripts/summarize.py"


rule render_dar_report:
    input:
        [f for f in summary_files() if "dimpo" not in f],
    output:
        [
            report(path, caption=dar_report_caption(path), category="DAR")
            for path in dar_report_files()
        ],
    log:
        f"{LOGS}/report/render_dar.log",
    benchmark:
        f"{BENCH}/report/render_dar.tsv"
    conda:
        "../envs/report.yaml"
    threads: 1
    resources:
        runtime=5,
        mem_mb=2000,
    params:
        group="dar",
        reference_dir=config["reference_dir"],
    script:
        "../workflow_scripts/render.py"


rule render_dimpo_report:
    input:
        f"{SUMMARY}/dimpo_fidelity.csv",
    output:
        report(
            f"{TABLES}/dimpo_fidelity.tex",
            caption="../report/dimpo_fidelity.rst",
            category="DimPO",
        ),
        report(
            f"{FIGURES}/dimpo_fidelity.png",
            caption="../report/dimpo_fidelity.rst",
            category="DimPO",
        ),
    log:
        f"{LOGS}/report/render_dimpo.log",
    benchmark:
        f"{BENCH}/report/render_dimpo.tsv"
    conda:
        "../envs/report.yaml"
    threads: 1
    resources:
        runtime=5,
        mem_mb=2000,
    params:
        group="dimpo",
        reference_dir=config["reference_dir"],
    script:
        "../workflow_scripts/render.py"


# `snakemake figures`: re-render every table and figure from the summaries that exist, with no
# training. It declares no input on purpose, so Snakemake never schedules upstream jobs for it,
# and no output (not even a benchmark file), so it runs whenever it is asked for.
rule figures:
    log:
        f"{LOGS}/report/figures.log",
    conda:
        "../envs/report.yaml"
    threads: 1
    resources:
        runtime=5,
        mem_mb=2000,
    params:
        group="all",
        summary_dir=SUMMARY,
        tables_dir=TABLES,
        figures_dir=FIGURES,
        reference_dir=config["reference_dir"],
    script:
        "../workflow_scripts/render.py"
