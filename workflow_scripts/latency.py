from pathlib import Path

from _workflow import logged

with logged(snakemake):
    import torch

    from dimattn.evaluation.latency import latency_to_file

    p = snakemake.params
    torch.set_num_threads(snakemake.threads)
    latency_to_file(
        source=str(p.source),
        projections_path=Path(snakemake.input.projections),
        out_json=Path(snakemake.output[0]),
        model_name=snakemake.wildcards.model,
        prompt=p.latency["prompt"],
        new=p.latency["new"],
        repeats=p.latency["repeats"],
        device=p.device,
    )
