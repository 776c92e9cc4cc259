from pathlib import Path

from _workflow import logged

with logged(snakemake):
    spec, out_dir = snakemake.params.spec, Path(snakemake.params.out_dir)
    if spec["source"] == "synthetic_longctx":
        from dimattn.data.longctx import LongContextSettings, write_longctx_corpus

        write_longctx_corpus(LongContextSettings.from_spec(spec), out_dir)
    else:
        from dimattn.data.recall import RecallSettings, write_recall_corpus

        write_recall_corpus(RecallSettings.from_spec(spec), out_dir)
