"""Pretrain one run: in this process, or as nproc x nodes torchrun processes (resources.nproc,
resources.nodes), each running ``python -m dimattn.pretraining.training`` on the same arguments."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from _workflow import logged

REPO = Path(__file__).resolve().parents[1]

with logged(snakemake):
    from dimattn.model.atomic import atomic_file
    from dimattn.pretraining.training import TrainConfig, launch_command, pretrain

    spec = snakemake.params.spec
    nproc, nodes = snakemake.params.nproc, snakemake.params.nodes
    checkpoint_dir = Path(snakemake.params.checkpoint_dir)
    if nproc * nodes == 1:
        pretrain(
            model_spec=spec["model"],
            train_cfg=TrainConfig.from_dict(spec["training"]),
            train_bin=Path(snakemake.input.train),
            val_bin=Path(snakemake.input.validation),
            tokenizer_dir=Path(snakemake.input.tokenizer),
            out_dir=Path(snakemake.output[0]),
            checkpoint_dir=checkpoint_dir,
            device=snakemake.params.device,
        )
    else:
        TrainConfig.from_dict(spec["training"]).micro_batches(nproc * nodes)  # fail here, not in every rank
        spec_path = checkpoint_dir / "spec.json"
        with atomic_file(spec_path) as tmp:
            tmp.write_text(json.dumps({"model": spec["model"], "training": spec["training"]}, indent=2))
        threads = max(1, snakemake.threads // nproc)  # the job's CPUs, shared by its processes on a node
        cli_args = [
            "--spec", str(spec_path),
            "--train", snakemake.input.train,
            "--validation", snakemake.input.validation,
            "--tokenizer", snakemake.input.tokenizer,
            "--out", snakemake.output[0],
            "--checkpoint-dir", str(checkpoint_dir),
            "--device", snakemake.params.device,
            "--threads", str(threads),
        ]
        job_id = os.environ.get("SLURM_JOB_ID", "0")
        cmd = launch_command(
            cli_args,
            nproc,
            nodes,
            # This script runs on the job's first node (the batch host), one of those srun uses.
            rdzv_host=socket.gethostname(),
            rdzv_id=f"{snakemake.wildcards.run}-{job_id}",
            rdzv_port=29500 + int(job_id) % 1000 if job_id.isdigit() else 29500,
            cpus_per_node=snakemake.resources.get("cpus_per_task", snakemake.threads),
        )
        # dimattn is not installed in the conda env: the processes import it from the repository.
        pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": str(threads)}
        print("launching:", " ".join(cmd), flush=True)
        sys.stderr.flush()
        # Every rank writes to this rule's log, as the in-process run does.
        subprocess.run(cmd, env=env, stdout=sys.stdout, stderr=sys.stderr, check=True)
