# Evaluation: held-out perplexity, and lm-eval's stock `hf` model on the workflow's own tasks.


rule perplexity:
    input:
        model=f"{MODELS}/{{run}}",
        tokens=tokens("{dataset}", "test"),
    output:
        f"{EVAL}/{{run}}/perplexity_{{dataset}}.json",
    log:
        f"{LOGS}/evaluate/perplexity_{{run}}_{{dataset}}.log",
    benchmark:
        f"{BENCH}/evaluate/perplexity_{{run}}_{{dataset}}.tsv"
    conda:
        "../envs/torch.yaml"
    threads: 1
    resources:
        runtime=30,
        mem_mb=lambda wc, attempt: 4000 * attempt,
        gpu=gpu_count(),
    params:
        seq_len=lambda wc: RUNS[wc.run]["training"]["seq_len"],
        batch_size=config["evaluation"].get("perplexity", {}).get("batch_size", 8),
        max_tokens=config["evaluation"].get("perplexity", {}).get("max_tokens"),
        device=config["device"],
    script:
        "../workflow_scripts/perplexity.py"


rule recall:
    input:
        model=f"{MODELS}/{{run}}",
        tokens=tokens("{dataset}", "test"),
    output:
        f"{EVAL}/{{run}}/recall_{{dataset}}.json",
    log:
        f"{LOGS}/evaluate/recall_{{run}}_{{dataset}}.log",
    benchmark:
        f"{BENCH}/evaluate/recall_{{run}}_{{dataset}}.tsv"
    wildcard_constraints:
        dataset=one_of(synthetic_datasets()),
    conda:
        "../envs/torch.yaml"
    threads: 1
    resources:
        runtime=30,
        mem_mb=lambda wc, attempt: 4000 * attempt,
        gpu=gpu_count(),
    params:
        batch_size=config["evaluation"].get("recall", {}).get("batch_size", 32),
        device=config["device"],
        corpus=lambda wc: wc.dataset,
    script:
        "../workflow_scripts/recall.py"


rule write_lm_eval_tasks:
    input:
        test=lambda wc: documents(lm_eval_config()["write_tasks_from"], "test"),
    output:
        directory("results/lm_eval_tasks"),
    log:
        f"{LOGS}/evaluate/write_lm_eval_tasks.log",
    benchmark:
        f"{BENCH}/evaluate/write_lm_eval_tasks.tsv"
    conda:
        "../envs/lm_eval.yaml"
    threads: 1
    resources:
        runtime=10,
        mem_mb=2000,
    params:
        heldout_docs=lm_eval_config().get("heldout_docs", 32),
        next_line_docs=lm_eval_config().get("next_line_docs", 200),
    script:
        "../workflow_scripts/write_lm_eval_tasks.py"


rule lm_eval:
    input:
        model=f"{MODELS}/{{run}}",
        tasks=(
            "results/lm_eval_tasks" if lm_eval_config().get("write_tasks_from") else []
        ),
    output:
        f"{EVAL}/{{run}}/lm_eval.json",
    log:
        f"{LOGS}/evaluate/lm_eval_{{run}}.log",
    benchmark:
        f"{BENCH}/evaluate/lm_eval_{{run}}.tsv"
    conda:
        "../envs/lm_eval.yaml"
    threads: 1
    resources:
        runtime=60,
        mem_mb=lambda wc, attempt: 8000 * attempt,
        gpu=gpu_count(),
    params:
        tasks=lm_eval_config().get("tasks", []),
        batch_size=lm_eval_config().get("batch_size", 8),
        limit=lm_eval_config().get("limit"),
        device=config["device"],
    script:
        "../workflow_scripts/lm_eval.py"
