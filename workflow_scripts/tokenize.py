from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.data.corpora import tokenize_documents

    tokenize_documents(
        Path(snakemake.input.documents),
        Path(snakemake.input.tokenizer),
        Path(snakemake.output.bin),
        min_tokens=snakemake.params.min_tokens,
    )
