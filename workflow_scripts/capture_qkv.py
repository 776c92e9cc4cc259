from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.dimpo.capture import capture_to_file

    cfg = snakemake.params.capture
    purpose = snakemake.wildcards.purpose
    capture_to_file(
        source=snakemake.params.source,
        documents=Path(snakemake.input.documents),
        seq_len=cfg["seq_len"],
        n_sequences=cfg["fit_sequences" if purpose == "fit" else "eval_sequences"],
        out_path=Path(snakemake.output[0]),
        model_name=snakemake.wildcards.model,
        device=snakemake.params.device,
        hparams=snakemake.params.hparams,  # capture_dtype, special_tokens of the preset
    )
