from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.projections import fidelity_to_file

    fidelity_to_file(
        capture_path=Path(snakemake.input.capture),
        projections_path=Path(snakemake.input.projections),
        out_csv=Path(snakemake.output[0]),
        model_name=snakemake.wildcards.model,
        objective=snakemake.wildcards.objective,
        d_prime=int(snakemake.wildcards.d_prime),
    )
