from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.reporting import outputs

    p = snakemake.params
    if snakemake.rule == "figures":  # every output the summaries on disk call for
        if p.published:  # a shipped tier: every file as its manifest lists it, or nothing drawn
            from dimattn.reporting.published import verify

            verify(p.published)
        outputs.render_existing(Path(p.summary_dir), Path(p.reference_dir), Path(p.results_dir),
                                processes=snakemake.threads)
    else:  # exactly the rule's outputs (names relative to results/), from its input summaries alone
        summaries = [Path(s) for s in snakemake.input]
        results_dir = Path(snakemake.output[0]).parents[len(Path(p.outputs[0]).parts) - 1]
        outputs.render(p.outputs, summaries[0].parent, Path(p.reference_dir), results_dir,
                       available=[s.stem for s in summaries])
