from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.dimpo.projections import fit_seeds_to_files

    wc, out, p = snakemake.wildcards, snakemake.output, snakemake.params
    fit_seeds_to_files(fit_capture=Path(snakemake.input.fit), eval_capture=Path(snakemake.input.eval),
                       objective=wc.objective, d_prime=int(wc.d_prime), hparams=p.hparams, seeds=p.seeds,
                       projections_out=[Path(x) for x in out.projections],
                       fidelity_out=[Path(x) for x in out.fidelity], partial_dir=Path(p.partial),
                       model_name=wc.model, setting=wc.setting, device=p.device)
