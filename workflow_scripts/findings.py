from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.reporting import findings

    p = snakemake.params
    reference_dir = Path(snakemake.input.claims).parent  # claims.yaml lies among the papers' numbers
    findings.write(p.dest, published_root=p.published, reference_dir=reference_dir, tiers=tuple(p.tiers))
