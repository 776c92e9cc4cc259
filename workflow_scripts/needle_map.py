from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.reporting import long_context, summaries

    long_context.figure(summaries.read(snakemake.input[0], "longctx_needle"), Path(snakemake.output[0]))
