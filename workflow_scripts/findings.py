from _workflow import logged

with logged(snakemake):
    from dimattn.reporting import findings

    p = snakemake.params
    findings.write(p.dest, published_root=p.published, reference_dir=p.reference_dir, tiers=tuple(p.tiers))
