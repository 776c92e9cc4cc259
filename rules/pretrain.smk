# Pretraining: one job per run of the expanded sweeps (pretraining.sweeps).


rule pretrain:
    input:
        train=lambda wc: tokens(config["pretraining"]["dataset"], "train"),
        validation=lambda wc: tokens(config["pretraining"]["dataset"], "validation"),
        tokenizer="results/tokenizer",
    output:
        directory(f"{MODELS}/{{run}}"),
    log:
        f"{LOGS}/pretrain/{{run}}.log",
    benchmark:
        f"{BENCH}/pretrain/{{run}}.tsv"
    conda:
        "../envs/torch.yaml"
    threads: lambda wc: RUNS[wc.run]["resources"].get("threads", 1)
    resources:
        runtime=run_resources("runtime", 30),
        mem_mb=run_resources("mem_mb", 4000),
        gpu=gpu_count(),
    params:
        spec=run_spec,
        checkpoint_dir=lambda wc: f"results/checkpoints/{wc.run}",
        device=config["device"],
    script:
        "../workflow_scripts/pretrain.py"
