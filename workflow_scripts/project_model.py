from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.model.configuration_projected import save_projected_model

    wc, p = snakemake.wildcards, snakemake.params
    # the base model's job has no projections; a projected setting's has one a seed
    projections = snakemake.input.projections or [None] * len(p.seeds)
    for path, out in zip(projections, snakemake.output, strict=True):
        save_projected_model(out_dir=Path(out), base_model=str(p.source), projections_path=path and Path(path),
                             num_projected=int(wc.num_projected), scale=p.scale, kv=p.kv,
                             meta={"model": wc.model, "kv_name": wc.kv})
