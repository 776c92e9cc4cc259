from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.projections import fidelity_to_file, fit_to_file

    wc, out = snakemake.wildcards, snakemake.output
    fit_to_file(capture_path=Path(snakemake.input.fit), objective=wc.objective, d_prime=int(wc.d_prime),
                hparams=snakemake.params.hparams, out_path=Path(out.projections), device=snakemake.params.device)
    fidelity_to_file(capture_path=Path(snakemake.input.eval), projections_path=Path(out.projections),
                     out_csv=Path(out.fidelity), model_name=wc.model, objective=wc.objective,
                     setting=wc.setting, d_prime=int(wc.d_prime), device=snakemake.params.device)
