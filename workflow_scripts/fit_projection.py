from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.projections import fit_to_file

    fit_to_file(
        capture_path=Path(snakemake.input[0]),
        objective=snakemake.wildcards.objective,
        d_prime=int(snakemake.wildcards.d_prime),
        hparams=snakemake.params.hparams,
        out_path=Path(snakemake.output[0]),
        device=snakemake.params.device,
    )
