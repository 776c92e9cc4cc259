from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.workflow.resources import online

    cfg, out_dir = snakemake.params.tokenizer, Path(snakemake.output[0])
    if cfg["hub"]:
        online()  # then a download rule (localrules): the user's network settings, not the jobs' offline ones
    from dimattn.data.corpora import save_hub_tokenizer, train_tokenizer

    max_len = cfg["model_max_length"]
    if cfg["hub"]:
        save_hub_tokenizer(cfg["hub"], out_dir, max_len)
    else:
        train_tokenizer(Path(snakemake.input.train), cfg["vocab_size"], out_dir, max_len)
