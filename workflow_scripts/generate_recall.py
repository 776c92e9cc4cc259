from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.recall import RecallSettings, write_recall_corpus

    write_recall_corpus(RecallSettings.from_spec(snakemake.params.spec), Path(snakemake.params.out_dir))
