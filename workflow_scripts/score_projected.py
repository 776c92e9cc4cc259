from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.evaluation.projected import score_projected
    from dimattn.model.kv_compression import kv_fields
    from dimattn.model.configuration_projected import ProjectedConfig

    wc, p, inputs = snakemake.wildcards, snakemake.params, snakemake.input
    ds = p.scoring
    corpora = {"tokens": dict(zip(p.corpora, map(Path, inputs.tokens))),
               "recall": dict(zip(p.recall_corpora, map(Path, inputs.recall))),
               "suite": dict(zip(p.suite_corpora, map(Path, inputs.suite)))}
    # one projected model a fit seed, in turn (the base model's job: one)
    for model_dir, seed, out, partial in zip(map(Path, inputs.model), p.seeds, snakemake.output, p.lm_eval_partial,
                                             strict=True):
        config = ProjectedConfig.from_pretrained(model_dir)
        fields = {"model": wc.model, "objective": wc.objective, "setting": wc.setting, "d_prime": int(wc.d_prime),
                  "num_projected": int(wc.num_projected),
                  "n_layers": config.dimattn_fit.get("n_layers"), "scale": config.scale, "kv": wc.kv,
                  **kv_fields(config.kv), "seed": int(seed)}
        score_projected(model_dir=model_dir, fields=fields, **corpora, seq_len=p.seq_len, batch_size=p.batch_size,
                        max_tokens=ds["max_tokens"], tasks=p.tasks, limit=ds["limit"], metadata=ds["metadata"],
                        out_json=Path(out), device=p.device, partial_dir=Path(partial), precision=p.precision)
