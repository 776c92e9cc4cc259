# Evaluation: held-out perplexity and lm-eval's stock `hf` model (text runs), the recall probe
# (runs trained on the synthetic recall corpus).


# One job scores a text run: perplexity on every evaluation.perplexity.datasets corpus, and
# lm-eval on our tasks when the run is one lm-eval scores (importing torch, transformers and
# lm-eval is most of a small job's time; see README, "Benchmarks").
rule score_text:
    input:
        model=paths.model("{run}"),
        tokens=[paths.tokens(d, "test") for d in PLAN.perplexity_datasets],
        lm_eval_data=lm_eval_data_files(),
        prefetched=lm_eval_prefetched(),
    output:
        perplexity=[paths.perplexity("{run}", d) for d in PLAN.perplexity_datasets],
        lm_eval=paths.lm_eval("{run}"),
    log:
        paths.log("evaluate", "score_{run}"),
    benchmark:
        paths.bench("score_text", "score_{run}")
    wildcard_constraints:
        run=one_of(PLAN.lm_eval_runs),
    conda:
        "../envs/lm_eval.yaml"
    threads: 1
    resources:
        runtime=score_resource("score_text", "runtime"),
        mem_mb=score_resource("score_text", "mem_mb"),
        gpu=gpu_count(),
    params:
        perplexity=score_params,
        lm_eval=lm_eval_params(),
        # each task's result as it finishes: a rerun scores only the tasks missing
        lm_eval_partial=lambda wc: f"{paths.checkpoints(wc.run)}/lm_eval",
        precision=SCORE_PRECISION,
        device=DEVICE,
    script:
        "../workflow_scripts/score_text.py"


# Text runs that lm-eval does not score (evaluation.lm_eval.scales): perplexity alone.
rule perplexity:
    input:
        model=paths.model("{run}"),
        tokens=[paths.tokens(d, "test") for d in PLAN.perplexity_datasets],
    output:
        perplexity=[paths.perplexity("{run}", d) for d in PLAN.perplexity_datasets],
    log:
        paths.log("evaluate", "perplexity_{run}"),
    benchmark:
        paths.bench("perplexity", "perplexity_{run}")
    wildcard_constraints:
        run=one_of([r for r in PLAN.text_runs if r not in PLAN.lm_eval_runs]),
    conda:
        "../envs/torch.yaml"
    threads: 1
    resources:
        runtime=score_resource("perplexity", "runtime"),
        mem_mb=score_resource("perplexity", "mem_mb"),
        gpu=gpu_count(),
    params:
        perplexity=score_params,
        lm_eval=None,
        precision=SCORE_PRECISION,
        device=DEVICE,
    script:
        "../workflow_scripts/score_text.py"


rule recall:
    input:
        model=paths.model("{run}"),
        tokens=paths.tokens("{dataset}", "test"),
    output:
        paths.recall("{run}", "{dataset}"),
    log:
        paths.log("evaluate", "recall_{run}_{dataset}"),
    benchmark:
        paths.bench("recall", "recall_{run}_{dataset}")
    wildcard_constraints:
        dataset=one_of(PLAN.synthetic_datasets),
    conda:
        "../envs/torch.yaml"
    threads: 1
    resources:
        runtime=scaled(30, "runtime"),
        mem_mb=scaled(4000, "mem_mb"),
        gpu=gpu_count(),
    params:
        batch_size=PLAN.config["evaluation"]["recall"]["batch_size"],
        device=DEVICE,
        corpus=lambda wc: wc.dataset,
    script:
        "../workflow_scripts/recall.py"


# The long-context suite (dimattn.data.longctx), on the run's own corpus and evaluation.longctx.datasets.
rule longctx:
    input:
        model=paths.model("{run}"),
        tokens=paths.tokens("{dataset}", "test"),
    output:
        paths.longctx("{run}", "{dataset}"),
    log:
        paths.log("evaluate", "longctx_{run}_{dataset}"),
    benchmark:
        paths.bench("longctx", "longctx_{run}_{dataset}")
    wildcard_constraints:
        dataset=one_of(PLAN.longctx_datasets),
    conda:
        "../envs/lm_eval.yaml"  # lm-eval's RULER string match
    threads: 1
    resources:
        runtime=scaled(30, "runtime"),
        mem_mb=scaled(4000, "mem_mb"),
        gpu=gpu_count(),
    params:
        batch_size=PLAN.config["evaluation"]["longctx"]["batch_size"],
        device=PLAN.config["device"],
        corpus=lambda wc: wc.dataset,
    script:
        "../workflow_scripts/recall.py"


# The data of the workflow's own lm-eval tasks (YAMLs in dimattn/evaluation/lm_eval_tasks).
rule write_lm_eval_data:
    input:
        test=lambda wc: paths.documents(PLAN.lm_eval["write_tasks_from"], "test"),
    output:
        heldout=paths.lm_eval_data("dimattn_heldout"),
        next_line=paths.lm_eval_data("dimattn_next_line"),
    log:
        paths.log("evaluate", "write_lm_eval_data"),
    benchmark:
        paths.bench("write_lm_eval_data", "write_lm_eval_data")
    conda:
        "../envs/lm_eval.yaml"
    threads: 1
    resources:
        runtime=scaled(10, "runtime"),
        mem_mb=scaled(2000, "mem_mb"),
    params:
        heldout_docs=PLAN.lm_eval["heldout_docs"],
        next_line_docs=PLAN.lm_eval["next_line_docs"],
        skip_lines=PLAN.lm_eval["skip_lines"],
        seed=PLAN.lm_eval["seed"],
    script:
        "../workflow_scripts/write_lm_eval_data.py"
