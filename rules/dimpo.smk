# DimPO (seed 003): capture post-RoPE queries/keys of a frozen model on held-out text, fit one
# shared query/key projection per layer and objective and d', and score its attention fidelity.


# Hub models and lm-eval task data come from the network: this job runs where Snakemake runs
# (the SLURM login node), so that compute jobs run offline (rules/common.smk).
localrules:
    prefetch,


rule prefetch:
    output:
        paths.prefetched(),
    log:
        paths.log("dimpo", "prefetch"),
    conda:
        "../envs/lm_eval.yaml"
    params:
        models=[m["hub"] for m in PLAN.dimpo["models"] if "hub" in m],
        tasks=PLAN.downstream["tasks"] if PLAN.dimpo_projected else [],
        metadata=PLAN.downstream["metadata"],
        ruler_qa_sources=PLAN.downstream["ruler_qa_sources"],
        # Table 4's harness tasks (score_text): their datasets, and MBPP's code_eval
        lm_eval_tasks=PLAN.lm_eval["tasks"] if PLAN.lm_eval_runs else [],
        allow_unsafe_code=PLAN.lm_eval["allow_unsafe_code"],
    script:
        "../workflow_scripts/prefetch.py"


rule capture_qkv:
    input:
        model=dimpo_model_dir,
        documents=capture_documents,
    output:
        paths.capture("{model}", "{purpose}"),
    log:
        paths.log("dimpo", "capture_{model}_{purpose}"),
    benchmark:
        paths.bench("capture_qkv", "capture_{model}_{purpose}")
    wildcard_constraints:
        purpose="fit|eval",
    conda:
        "../envs/torch.yaml"
    threads: 1
    resources:
        runtime=capture_resource("runtime"),
        mem_mb=capture_resource("mem_mb"),
        gpu=gpu_count(),
    params:
        source=dimpo_model_source,
        capture=lambda wc: PLAN.dimpo_capture(wc.model),
        hparams=capture_hparams(),
        device=DEVICE,
    script:
        "../workflow_scripts/capture_qkv.py"


# One job fits a projection (on the fit capture) and scores its attention fidelity (on the
# eval capture), for each fit seed in turn: one process start for all of them.
rule fit_projection:
    input:
        fit=paths.capture("{model}", "fit"),
        eval=paths.capture("{model}", "eval"),
    output:
        projections=each_seed(paths.projection, *FIT),
        fidelity=each_seed(paths.fidelity, *FIT),
    log:
        paths.log("dimpo", f"fit_{FIT_STEM}"),
    benchmark:
        paths.bench("fit_projection", f"fit_{FIT_STEM}")
    conda:
        "../envs/torch.yaml"
    threads: PLAN.dimpo["resources"]["threads"]
    resources:
        runtime=fit_resource("runtime"),
        mem_mb=fit_resource("mem_mb"),
        cpus_per_task=lambda wc, threads: threads,  # dimpo.resources.threads, over any default
        gpu=gpu_count(),
    params:
        hparams=fit_hparams,
        seeds=PLAN.dimpo["seeds"],
        # each seed's fit as it finishes: a retry fits only the seeds missing
        partial=paths.fit_partial(*FIT),
        device=DEVICE,
    script:
        "../workflow_scripts/fit_projection.py"


# dimpo.downstream: Table 1's projections at work. A projected model is a model directory
# (dimattn.model.modeling_projected) that lm-eval's `hf` model loads; the base model (objective
# "base", l = 0) is one too, so that KV compression applies to it alike. One job builds (and one
# scores) the projected models of every fit seed in turn: a process start (torch, transformers,
# lm-eval: about 4 s) once for all of them; the base model, one seed, has jobs of its own.
rule project_model:
    input:
        base=dimpo_model_dir,
        projections=projected_inputs,
    output:
        [directory(d) for d in each_seed(paths.projected_model, *PROJECTED)],
    log:
        paths.log("dimpo", f"project_{PROJECTED_STEM}"),
    benchmark:
        paths.bench("project_model", f"project_{PROJECTED_STEM}")
    wildcard_constraints:
        objective=fitted_objectives(),
    conda:
        "../envs/torch.yaml"
    threads: 1
    resources:
        runtime=scaled(10, "runtime"),
        mem_mb=scaled(2000, "mem_mb"),
    params:
        source=dimpo_model_source,
        scale=PLAN.downstream["scale"],
        kv=lambda wc: PLAN.kv_settings(wc.kv),
        seeds=job_seeds,
    script:
        "../workflow_scripts/project_model.py"


use rule project_model as project_base with:
    output:
        directory(paths.projected_model(*BASE)),
    log:
        paths.log("dimpo", f"project_{BASE_STEM}"),
    benchmark:
        paths.bench("project_model", f"project_{BASE_STEM}")
    wildcard_constraints:
        objective=sweeps.BASE_OBJECTIVE,


rule score_projected:
    input:
        model=projected_models,
        tokens=projected_tokens,
        recall=projected_recall_tokens,
        suite=projected_suite_tokens,
        lm_eval_data=lm_eval_data_files(),
    output:
        each_seed(paths.downstream, *PROJECTED),
    log:
        paths.log("dimpo", f"score_{PROJECTED_STEM}"),
    benchmark:
        paths.bench("score_projected", f"score_{PROJECTED_STEM}")
    wildcard_constraints:
        objective=fitted_objectives(),
    conda:
        "../envs/lm_eval.yaml"
    threads: 1
    resources:
        runtime=score_resource("score_projected", "runtime"),
        mem_mb=score_resource("score_projected", "mem_mb"),
        gpu=gpu_count(),
    params:
        # only what this job reads: Snakemake reruns a job whose params change, so the whole
        # downstream mapping here made one more kv entry or objective rerun every scoring job
        scoring={k: PLAN.downstream[k] for k in ("max_tokens", "limit", "metadata")},
        tasks=lambda wc: ([] if PLAN.generative_probe(wc.model) else PLAN.downstream["tasks"]),
        recall_corpora=lambda wc: ([PLAN.dimpo_run_dataset(wc.model)] if PLAN.dimpo_probe(wc.model) == "recall" else []),
        suite_corpora=projected_suite_corpora,
        seq_len=PLAN.dimpo["capture"]["seq_len"],
        batch_size=lambda wc: PLAN.config["evaluation"][
            {"recall": "recall", "longctx": "longctx"}.get(PLAN.dimpo_probe(wc.model), "perplexity")
        ]["batch_size"],
        corpora=lambda wc: (PLAN.perplexity_datasets if PLAN.dimpo_probe(wc.model) == "text" else []),
        # each task's result as it finishes, as score_text's: a rerun scores only the tasks missing
        lm_eval_partial=lambda wc, output: [paths.partial(out) for out in output],
        precision=SCORE_PRECISION,
        seeds=job_seeds,
        device=DEVICE,
    script:
        "../workflow_scripts/score_projected.py"


use rule score_projected as score_base with:
    output:
        paths.downstream(*BASE),
    log:
        paths.log("dimpo", f"score_{BASE_STEM}"),
    benchmark:
        paths.bench("score_projected", f"score_{BASE_STEM}")
    wildcard_constraints:
        objective=sweeps.BASE_OBJECTIVE,


# Seed 003 Appendix H: one job a model, on every core, so that nothing runs beside it while it
# times (on SLURM: an exclusive node, profiles/slurm).
rule latency:
    input:
        model=dimpo_model_dir,
        projections=latency_projection,
    output:
        paths.latency("{model}"),
    log:
        paths.log("dimpo", "latency_{model}"),
    benchmark:
        paths.bench("latency", "latency_{model}")
    conda:
        "../envs/torch.yaml"
    # a callable: commands given no --cores (--unlock, --report) never ask for it
    threads: every_core
    resources:
        runtime=dimpo_resource("runtime"),
        mem_mb=dimpo_resource("mem_mb"),
        gpu=gpu_count(),
    params:
        source=dimpo_model_source,
        latency=PLAN.latency,
        device=DEVICE,
    script:
        "../workflow_scripts/latency.py"
