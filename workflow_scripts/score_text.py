from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.evaluation.scoring import evaluate_perplexity, load_model, run_lm_eval

    p, model_dir = snakemake.params, Path(snakemake.input.model)
    model = load_model(model_dir, p.device)  # once, for every corpus and lm-eval
    ppl = p.perplexity
    for corpus, tokens, out in zip(ppl["corpora"], snakemake.input.tokens, snakemake.output.perplexity):
        evaluate_perplexity(model_dir=model_dir, tokens_bin=Path(tokens), corpus=corpus, seq_len=ppl["seq_len"],
                            batch_size=ppl["batch_size"], max_tokens=ppl["max_tokens"], out_json=Path(out),
                            device=p.device, model=model, precision=p.precision)
    if p.lm_eval:
        run_lm_eval(
            model_dir=model_dir,
            tasks=p.lm_eval["tasks"],
            batch_size=p.lm_eval["batch_size"],
            limit=p.lm_eval["limit"],
            out_json=Path(snakemake.output.lm_eval),
            device=p.device,
            dtype=p.lm_eval["dtype"],
            allow_unsafe_code=p.lm_eval["allow_unsafe_code"],
            partial_dir=Path(p.lm_eval_partial),
            exclude_shorter_than_window=p.lm_eval["exclude_shorter_than_window"],
            model=model,
            precision=p.precision,
        )
