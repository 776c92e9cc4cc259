from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.configuration_projected import save_projected_model

    wc, p = snakemake.wildcards, snakemake.params
    projections = Path(snakemake.input.projections) if snakemake.input.projections else None
    save_projected_model(out_dir=Path(snakemake.output[0]), base_model=str(p.source), projections_path=projections,
                         num_projected=int(wc.num_projected), scale=p.scale, kv=p.kv,
                         meta={"model": wc.model, "kv_name": wc.kv})
