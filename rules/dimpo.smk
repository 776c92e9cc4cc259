# DimPO (seed 003): capture post-RoPE queries/keys of a frozen model on held-out text, fit one
# shared query/key projection per layer and objective and d', and score its attention fidelity.


rule capture_qkv:
    input:
        model=dimpo_model_dir,
        documents=lambda wc: paths.documents(
            PLAN.dimpo["dataset"], "validation" if wc.purpose == "fit" else "test"
        ),
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
        runtime=dimpo_resource("runtime"),
        mem_mb=dimpo_resource("mem_mb"),
        gpu=gpu_count(),
    params:
        source=dimpo_model_source,
        capture=PLAN.dimpo["capture"],
        hparams=PLAN.dimpo["hparams"],
        device=PLAN.config["device"],
    script:
        "../workflow_scripts/capture_qkv.py"


# One job fits a projection (on the fit capture) and scores its attention fidelity (on the
# eval capture): two process starts become one.
rule fit_projection:
    input:
        fit=paths.capture("{model}", "fit"),
        eval=paths.capture("{model}", "eval"),
    output:
        projections=paths.projection("{model}", "{objective}", "{d_prime}", "{seed}"),
        fidelity=paths.fidelity("{model}", "{objective}", "{d_prime}", "{seed}"),
    log:
        paths.log("dimpo", "fit_{model}_{objective}_d{d_prime}_s{seed}"),
    benchmark:
        paths.bench("fit_projection", "fit_{model}_{objective}_d{d_prime}_s{seed}")
    wildcard_constraints:
        d_prime=r"\d+",
        seed=r"\d+",
    conda:
        "../envs/torch.yaml"
    threads: PLAN.dimpo["resources"]["threads"]
    resources:
        runtime=dimpo_resource("runtime"),
        mem_mb=dimpo_resource("mem_mb"),
        gpu=gpu_count(),
    params:
        hparams=lambda wc: PLAN.dimpo["hparams"] | {"seed": int(wc.seed)},
        device=PLAN.config["device"],
    script:
        "../workflow_scripts/fit_projection.py"
