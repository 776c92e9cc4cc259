from pathlib import Path

from _workflow import logged

with logged(snakemake):
    from dimattn.training import TrainConfig, pretrain

    spec = snakemake.params.spec
    pretrain(
        model_spec=spec["model"],
        train_cfg=TrainConfig.from_dict(spec["training"]),
        train_bin=Path(snakemake.input.train),
        val_bin=Path(snakemake.input.validation),
        tokenizer_dir=Path(snakemake.input.tokenizer),
        out_dir=Path(snakemake.output[0]),
        checkpoint_dir=Path(snakemake.params.checkpoint_dir),
        device=snakemake.params.device,
    )
