# Pretraining: one job per run of the expanded sweeps (pretraining.sweeps), on resources.nproc
# processes a node (torchrun) and resources.nodes nodes (srun, SLURM only). Checkpoints live in
# results/checkpoints/<run>/, not a Snakemake output, so a killed or retried job resumes there.


# (processes a node, nodes) of each run.
PRETRAIN_LAYOUT = {name: (run.resources["nproc"], run.resources["nodes"]) for name, run in RUNS.items()}


rule pretrain:
    input:
        train=run_tokens("train"),
        validation=run_tokens("validation"),
        tokenizer=run_tokenizer,
    output:
        directory(paths.model("{run}")),
    log:
        paths.log("pretrain", "{run}"),
    benchmark:
        paths.bench("pretrain", "{run}")
    conda:
        "../envs/torch.yaml"
    threads: lambda wc: RUNS[wc.run].resources["threads"]
    resources:
        runtime=run_resource("runtime"),
        mem_mb=run_resource("mem_mb"),
        # The SLURM plugin asks --cpus-per-task=<cpus_per_task> over the threads: the scale's threads.
        cpus_per_task=lambda wc, threads: threads,
        # One GPU a process. On one node the SLURM plugin's --gpus (a job total); on several,
        # gres per node, since SLURM may spread a job total unevenly over the nodes.
        gpu=lambda wc: (gpu_count() * PRETRAIN_LAYOUT[wc.run][0] if PRETRAIN_LAYOUT[wc.run][1] == 1 else None),
        gres=lambda wc: (
            f"gpu:{PRETRAIN_LAYOUT[wc.run][0]}" if gpu_count() and PRETRAIN_LAYOUT[wc.run][1] > 1 else None
        ),
        nodes=lambda wc: PRETRAIN_LAYOUT[wc.run][1],
        # Several nodes: the job runs srun itself, one task (a torchrun) a node: an "mpi" job
        # to the plugin; tasks_per_gpu=0 stops it reading tasks as --ntasks-per-gpu.
        mpi=lambda wc: "srun" if PRETRAIN_LAYOUT[wc.run][1] > 1 else None,
        tasks=lambda wc: (PRETRAIN_LAYOUT[wc.run][1] if PRETRAIN_LAYOUT[wc.run][1] > 1 else None),
        tasks_per_gpu=lambda wc: (0 if gpu_count() and PRETRAIN_LAYOUT[wc.run][1] > 1 else None),
    params:
        spec=run_spec,
        checkpoint_dir=lambda wc: paths.checkpoints(wc.run),
        device=DEVICE,
        nproc=lambda wc: PRETRAIN_LAYOUT[wc.run][0],
        nodes=lambda wc: PRETRAIN_LAYOUT[wc.run][1],
    script:
        "../workflow_scripts/pretrain.py"
