# Evaluation: held-out perplexity, and lm-eval's stock `hf` model on the workflow's own tasks.


rule perplexity:
    input:
        model=paths.model("{run}"),
        tokens=paths.tokens("{dataset}", "test"),
    output:
        paths.perplexity("{run}", "{dataset}"),
    log:
        paths.log("evaluate", "perplexity_{run}_{dataset}"),
    benchmark:
        paths.bench("evaluate", "perplexity_{run}_{dataset}")
    conda:
        "../envs/torch.yaml"
    threads: 1
    resources:
        runtime=30,
        mem_mb=lambda wc, attempt: 4000 * attempt,
        gpu=gpu_count(),
    params:
        seq_len=lambda wc: RUNS[wc.run].training["seq_len"],
        batch_size=PLAN.config["evaluation"]["perplexity"]["batch_size"],
        max_tokens=PLAN.config["evaluation"]["perplexity"]["max_tokens"],
        device=PLAN.config["device"],
    script:
        "../workflow_scripts/perplexity.py"


rule recall:
    input:
        model=paths.model("{run}"),
        tokens=paths.tokens("{dataset}", "test"),
    output:
        paths.recall("{run}", "{dataset}"),
    log:
        paths.log("evaluate", "recall_{run}_{dataset}"),
    benchmark:
        paths.bench("evaluate", "recall_{run}_{dataset}")
    wildcard_constraints:
        dataset=one_of(PLAN.synthetic_datasets),
    conda:
        "../envs/torch.yaml"
    threads: 1
    resources:
        runtime=30,
        mem_mb=lambda wc, attempt: 4000 * attempt,
        gpu=gpu_count(),
    params:
        batch_size=PLAN.config["evaluation"]["recall"]["batch_size"],
        device=PLAN.config["device"],
        corpus=lambda wc: wc.dataset,
    script:
        "../workflow_scripts/recall.py"


# The data of the workflow's own lm-eval tasks (YAMLs in dimattn/lm_eval_tasks).
rule write_lm_eval_data:
    input:
        test=lambda wc: paths.documents(PLAN.lm_eval["write_tasks_from"], "test"),
    output:
        heldout=paths.lm_eval_data("dimattn_heldout"),
        next_line=paths.lm_eval_data("dimattn_next_line"),
    log:
        paths.log("evaluate", "write_lm_eval_data"),
    benchmark:
        paths.bench("evaluate", "write_lm_eval_data")
    conda:
        "../envs/lm_eval.yaml"
    threads: 1
    resources:
        runtime=10,
        mem_mb=2000,
    params:
        heldout_docs=PLAN.lm_eval["heldout_docs"],
        next_line_docs=PLAN.lm_eval["next_line_docs"],
        skip_lines=PLAN.lm_eval["skip_lines"],
        seed=PLAN.lm_eval["seed"],
    script:
        "../workflow_scripts/write_lm_eval_data.py"


rule lm_eval:
    input:
        model=paths.model("{run}"),
        data=lm_eval_data_files(),
    output:
        paths.lm_eval("{run}"),
    log:
        paths.log("evaluate", "lm_eval_{run}"),
    benchmark:
        paths.bench("evaluate", "lm_eval_{run}")
    conda:
        "../envs/lm_eval.yaml"
    threads: 1
    resources:
        runtime=60,
        mem_mb=lambda wc, attempt: 8000 * attempt,
        gpu=gpu_count(),
    params:
        tasks=PLAN.lm_eval["tasks"],
        batch_size=PLAN.lm_eval["batch_size"],
        limit=PLAN.lm_eval["limit"],
        device=PLAN.config["device"],
    script:
        "../workflow_scripts/lm_eval.py"
