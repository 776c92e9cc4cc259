from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.data import save_hub_tokenizer, train_tokenizer

    cfg, out_dir = snakemake.params.tokenizer, Path(snakemake.output[0])
    max_len = cfg.get("model_max_length", 2048)
    if cfg.get("hub"):
        save_hub_tokenizer(cfg["hub"], out_dir, max_len)
    else:
        train_tokenizer(Path(snakemake.input.train), cfg.get("vocab_size", 8192), out_dir, max_len)
