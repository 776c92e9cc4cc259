from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn import reporting

    group, reference = snakemake.params.group, Path(snakemake.params.reference_dir)
    if group == "all":  # the `figures` target: whatever summaries exist
        p = snakemake.params
        reporting.render_all(Path(p.summary_dir), reference, Path(p.tables_dir), Path(p.figures_dir))
    else:
        outputs = [Path(p) for p in snakemake.output]
        summary_dir = Path(snakemake.input[0]).parent
        tables = next(p.parent for p in outputs if p.suffix == ".tex")
        figures = next(p.parent for p in outputs if p.suffix == ".png")
        if group == "dar":
            # Exactly the declared outputs; one whose runs are absent becomes a "not run" placeholder.
            reporting.render_dar(summary_dir, reference, tables, figures, only=[p.name for p in outputs])
        else:
            reporting.render_dimpo(summary_dir, reference, tables, figures)
