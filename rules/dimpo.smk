# DimPO (seed 003): capture post-RoPE queries/keys of a frozen model on held-out text, fit one
# shared query/key projection per layer and objective and d', score attention fidelity.


rule capture_qkv:
    input:
        model=dimpo_model_dir,
        documents=lambda wc: documents(
            config["dimpo"]["dataset"], "validation" if wc.purpose == "fit" else "test"
        ),
    output:
        f"{DIMPO}/{{model}}/capture_{{purpose}}.safetensors",
    log:
        f"{LOGS}/dimpo/capture_{{model}}_{{purpose}}.log",
    benchmark:
        f"{BENCH}/dimpo/capture_{{model}}_{{purpose}}.tsv"
    wildcard_constraints:
        purpose="fit|eval",
    conda:
        "../envs/torch.yaml"
    threads: 1
    resources:
        runtime=dimpo_resources("runtime", 30),
        mem_mb=dimpo_resources("mem_mb", 8000),
        gpu=gpu_count(),
    params:
        source=dimpo_model_source,
        capture=config.get("dimpo", {}).get("capture", {}),
        device=config["device"],
    script:
        "../workflow_scripts/capture_qkv.py"


rule fit_projection:
    input:
        f"{DIMPO}/{{model}}/capture_fit.safetensors",
    output:
        f"{DIMPO}/{{model}}/projections/{{objective}}-d{{d_prime}}.safetensors",
    log:
        f"{LOGS}/dimpo/fit_{{model}}_{{objective}}_d{{d_prime}}.log",
    benchmark:
        f"{BENCH}/dimpo/fit_{{model}}_{{objective}}_d{{d_prime}}.tsv"
    wildcard_constraints:
        d_prime=r"\d+",
    conda:
        "../envs/torch.yaml"
    threads: config.get("dimpo", {}).get("resources", {}).get("threads", 1)
    resources:
        runtime=dimpo_resources("runtime", 30),
        mem_mb=dimpo_resources("mem_mb", 4000),
        gpu=gpu_count(),
    params:
        hparams=config.get("dimpo", {}).get("hparams", {}),
        device=config["device"],
    script:
        "../workflow_scripts/fit_projection.py"


rule attention_fidelity:
    input:
        capture=f"{DIMPO}/{{model}}/capture_eval.safetensors",
        projections=f"{DIMPO}/{{model}}/projections/{{objective}}-d{{d_prime}}.safetensors",
    output:
        f"{DIMPO}/{{model}}/fidelity/{{objective}}-d{{d_prime}}.csv",
    log:
        f"{LOGS}/dimpo/fidelity_{{model}}_{{objective}}_d{{d_prime}}.log",
    benchmark:
        f"{BENCH}/dimpo/fidelity_{{model}}_{{objective}}_d{{d_prime}}.tsv"
    wildcard_constraints:
        d_prime=r"\d+",
    conda:
        "../envs/torch.yaml"
    threads: 1
    resources:
        runtime=dimpo_resources("runtime", 30),
        mem_mb=dimpo_resources("mem_mb", 8000),
        gpu=gpu_count(),
    script:
        "../workflow_scripts/attention_fidelity.py"
