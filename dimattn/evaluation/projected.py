"""DimPO at work (seed 003, Section 4): projected models (dimattn.model.modeling_projected) scored on
held-out perplexity, the recall probe and lm-eval, and the prefetch of the hub models and task
data that this scoring reads offline (the reporting of these scores: reporting/dimpo_downstream).

The scorers themselves (perplexity, lm-eval's ``hf`` model) are those of our own runs, in
dimattn.evaluation.scoring; this module says what a projected model is scored on.
"""

import shutil
from pathlib import Path

from dimattn.model.atomic import write_json
from dimattn.data.corpora import load_tokens
from dimattn.evaluation.scoring import in_dtype, lm_eval_results, load_model, perplexity
from dimattn.evaluation.lm_eval_tasks import TASKS_DIR, own_task_names
from dimattn.workflow.schema import task_defaults
from dimattn.workflow.settings import downstream_tasks


# What AutoModelForCausalLM / AutoTokenizer.from_pretrained read of a hub model: config and
# generation config, tokenizer files (json, sentencepiece, tiktoken, a chat template), weights as
# safetensors. Not the rest of the repository: Llama's original/ (consolidated.*.pth, about the
# size of the safetensors again), *.bin or *.pt duplicates, other formats.
HUB_MODEL_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
HUB_MODEL_SKIP = ["original/*"]


def prefetch(models: list[str], tasks: list[dict], metadata: dict | None, out_json: Path,
             lm_eval_tasks: list[dict] = (), *, allow_unsafe_code: bool,
             ruler_qa_sources: dict | None = None) -> dict:
    """Fill the Hugging Face cache on a machine with network (a SLURM login node), so that compute
    nodes run offline: the files of each hub model that from_pretrained reads (HUB_MODEL_FILES),
    and each lm-eval task built once with that model's tokenizer, which downloads its dataset
    (RULER: the essays; nltk's punkt_tab) and generates RULER's samples at every
    metadata.max_seq_lengths. RULER QA's SQuAD and HotpotQA, which lm-eval fetches into memory
    only, are saved to files that our ruler_qa_* tasks read (lm_eval_tasks/ruler_qa.py), from
    ``ruler_qa_sources`` where given. ``lm_eval_tasks``: our runs' (evaluation.lm_eval.tasks,
    Table 4), built once for their datasets; MBPP's, which loads and tries evaluate's code_eval
    as it is built, only with ``allow_unsafe_code`` (the config's opt-in)."""
    import os

    from huggingface_hub import snapshot_download
    from lm_eval.tasks import TaskManager

    names = [t["name"] for t in tasks]
    if {"ruler_qa_squad", "ruler_qa_hotpot"} & set(names) or "ruler" in names:
        from dimattn.evaluation.lm_eval_tasks import ruler_qa

        ruler_qa.fetch(ruler_qa_sources)
    harness = [t["name"] for t in lm_eval_tasks if t["name"] not in own_task_names()]
    if harness:
        if allow_unsafe_code:
            os.environ["HF_ALLOW_CODE_EVAL"] = "1"  # MBPP's task file runs code_eval once as it loads
        TaskManager(include_path=str(TASKS_DIR)).load_task_or_group(harness)
    done = {}
    for model in models:
        snapshot_download(model, allow_patterns=HUB_MODEL_FILES, ignore_patterns=HUB_MODEL_SKIP)
        if names:
            manager = TaskManager(include_path=str(TASKS_DIR), metadata={"tokenizer": model, **(metadata or {})})
            manager.load_task_or_group(names)
        done[model] = names
    write_json({"models": done, "lm_eval_tasks": harness, "metadata": metadata or {}}, out_json)
    return done


def score_projected(model_dir: Path, fields: dict, tokens: dict[str, Path], seq_len: int, batch_size: int,
                    max_tokens: int | None, tasks: list[dict], limit: int | None, out_json: Path, *,
                    device: str, precision: str, metadata: dict | None = None,
                    recall: dict[str, Path] | None = None, partial_dir: Path | None = None,
                    suite: dict[str, Path] | None = None) -> dict:
    """A projected model directory (dimattn.model.modeling_projected) scored as our runs are: held-out
    perplexity per corpus ({corpus: tokens.bin}), the recall probe per synthetic corpus
    ({corpus: test tokens.bin}; the context prefilled and the questions decoded through the
    model's KV cache, so that KV compression acts: dimattn.data.recall.score_recall, seed 003's RULER
    at CPU scale), the long-context suite per corpus ({corpus: test tokens.bin}: each prompt
    prefilled through the cache, its question inside SnapKV's observation window, the answer
    generated greedily: dimattn.data.longctx.score_suite) and lm-eval's `hf` model on those of
    ``tasks`` that score its d' (downstream_tasks); JSON with ``fields`` (model, objective, d', l, kv, ...)
    beside. ``partial_dir``: each lm-eval task's result as it finishes, as our runs' score_text
    keeps them (dimattn.evaluation.scoring.lm_eval_results), removed once the record is written.
    ``precision``: perplexity's and lm-eval's (evaluation.precision); the recall probe decodes
    in the model's dtype, as our runs' is scored."""
    from dimattn.data.longctx import load_suite, score_suite
    from dimattn.data.recall import load_examples, score_recall

    for path in (recall or {}).values():
        load_examples(path)  # a damaged corpus fails before any scoring
    for path in (suite or {}).values():
        load_suite(path)
    record = {**fields, "perplexity": {}, "recall": {}, "longctx": {}, "results": {}, "num_fewshot": {}}
    model = None
    if tokens or recall or suite:
        model = load_model(model_dir, device)
        for corpus, path in tokens.items():
            record["perplexity"][corpus] = perplexity(model, load_tokens(path)[0], seq_len, batch_size, max_tokens,
                                                    precision)
        for corpus, path in (recall or {}).items():
            record["recall"][corpus] = score_recall(model, path, batch_size, through_cache=True)
        for corpus, path in (suite or {}).items():
            record["longctx"][corpus] = score_suite(model, path, batch_size)
    tasks = downstream_tasks(tasks, fields.get("d_prime", 0))  # a task's d_prime: the widths it scores
    # lm-eval scores the loaded model where a task is in its dtype; else it is freed first
    defaults = task_defaults()
    if model is not None and not any(in_dtype(model, (defaults | t)["dtype"]) for t in tasks):
        model = None
    if tasks:
        record.update(lm_eval_results(model_dir, tasks, batch_size, limit, device, metadata=metadata,
                                      partial_dir=partial_dir, model=model, precision=precision))
    del model
    write_json(record, out_json)
    if partial_dir is not None:
        shutil.rmtree(partial_dir, ignore_errors=True)
    return record
