"""Held-out perplexity, and lm-evaluation-harness through its stock ``hf`` model on task YAMLs
that the workflow writes itself from the held-out split (so the default run stays offline).
"""

import contextlib
import json
import math
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from dimattn.model.atomic import atomic_file, write_json
from dimattn.data.corpora import load_tokens, read_documents
from dimattn.evaluation.lm_eval_tasks import TASKS_DIR, own_task_names
from dimattn.pretraining.precision import autocast, resolve_precision
from dimattn.workflow.runs import run_metadata
from dimattn.workflow.schema import task_defaults

# The workflow's own lm-eval tasks: YAMLs in TASKS_DIR, data written by write_lm_eval_data.
HELDOUT_TASK = "dimattn_heldout"  # loglikelihood_rolling over held-out documents
NEXT_LINE_TASK = "dimattn_next_line"  # 4-way choice of the true next line
MIN_DOC_CHARS = 1500  # a held-out document: paragraphs grouped to at least this many characters
MIN_LINE_CHARS = 20  # a next-line candidate: at least this long
CONTEXT_LINES = 4  # lines of context before the line to choose


def load_model(model_dir: Path, device: str):
    # Our own directory: trust_remote_code runs the modeling file saved beside the weights.
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True)
    return model.to(device).eval()


@torch.no_grad()
def perplexity(model, tokens: np.ndarray, seq_len: int, batch_size: int, max_tokens: int | None = None,
               precision: str = "fp32") -> dict:
    """Mean next-token NLL over non-overlapping windows of seq_len covering the split;
    ``precision`` (dimattn.pretraining.precision, evaluation.precision) autocasts the forwards;
    ``cache_bytes_per_token``: the model's generation cache over the first window
    (dimattn.data.recall.cache_bytes_per_token), in the model's dtype."""
    from dimattn.data.recall import cache_bytes_per_token

    n = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
    n_windows = n // seq_len
    if n_windows == 0:
        raise ValueError(f"held-out split has {n} tokens, fewer than seq_len={seq_len}")
    windows = torch.from_numpy(tokens[: n_windows * seq_len].astype(np.int64)).view(n_windows, seq_len)
    device = next(model.parameters()).device
    precision = resolve_precision(precision, device)  # once, not a batch
    total_nll, total_count = 0.0, 0
    for x in tqdm(windows.split(batch_size), desc="perplexity", mininterval=5):
        x = x.to(device)
        count = x[:, 1:].numel()
        # The mean NLL without the (tokens x vocabulary) logits where the model can (ours on
        # CPU: dimattn.model.modeling_dimattn.lm_head_loss, its softmax in float32), else from the logits.
        with autocast(device, precision):
            loss = model(x, labels=x, return_logits=False).loss.double()
        total_nll += loss.item() * count
        total_count += count
    loss = total_nll / total_count
    # one window as a prompt: what a cache of this model holds for a context of seq_len tokens
    cache = cache_bytes_per_token(model, windows[:1])
    return {"n_tokens": total_count, "loss": loss, "ppl": math.exp(loss), "precision": precision,
            "cache_bytes_per_token": cache}


def evaluate_perplexity(model_dir: Path, tokens_bin: Path, corpus: str, seq_len: int, batch_size: int,
                        max_tokens: int | None, out_json: Path, *, device: str, precision: str,
                        model=None) -> dict:
    """``model``: model_dir already loaded (load_model), so that one job loads it once."""
    tokens, _ = load_tokens(tokens_bin)
    model = load_model(model_dir, device) if model is None else model
    result = {**run_metadata(model_dir), "corpus": corpus, "split": "test"}
    result.update(perplexity(model, tokens, seq_len, batch_size, max_tokens, precision))
    write_json(result, out_json)
    return result


# --- lm-evaluation-harness -------------------------------------------------------------------


def _chunks(text: str, min_chars: int) -> list[str]:
    """Group blank-line separated paragraphs (speeches) into documents of at least min_chars."""
    docs, current = [], []
    for para in text.split("\n\n"):
        if para.strip():
            current.append(para.strip("\n"))
        if sum(len(p) for p in current) >= min_chars:
            docs.append("\n\n".join(current))
            current = []
    if current:
        docs.append("\n\n".join(current))
    return docs


def _lines(text: str, skip_lines: str | None) -> list[str]:
    """Lines of running text: skip short lines, all-caps lines (headings, speaker names),
    bracketed stage directions, and lines matching the corpus's own ``skip_lines`` pattern
    (evaluation.lm_eval.skip_lines: Shakespeare's "ACT"/"SCENE" headings)."""
    skip = re.compile(skip_lines) if skip_lines else None
    return [s for s in (line.strip() for line in text.splitlines())
            if len(s) >= MIN_LINE_CHARS and not s.isupper() and not s.startswith("[")
            and not (skip and skip.search(s))]


def build_lm_eval_data(test_jsonl: Path, heldout_docs: int, next_line_docs: int, skip_lines: str | None,
                       seed: int) -> dict[str, list[dict]]:
    """The rows of each task: held-out documents, and next-line choices from each work's lines."""
    rng = random.Random(seed)
    works = list(read_documents(test_jsonl))
    heldout = [d for w in works for d in _chunks(w["text"], MIN_DOC_CHARS)]
    rng.shuffle(heldout)
    next_line = []
    for w in works:
        lines = _lines(w["text"], skip_lines)
        for i in range(CONTEXT_LINES, len(lines)):
            distractors = rng.sample([l for j, l in enumerate(lines) if j != i], 3)
            choices = [lines[i]] + distractors
            rng.shuffle(choices)
            next_line.append({
                "context": "\n".join(lines[i - CONTEXT_LINES : i]),
                "choices": choices,
                "label": choices.index(lines[i]),
            })
    rng.shuffle(next_line)
    return {HELDOUT_TASK: [{"text": t} for t in heldout[:heldout_docs]], NEXT_LINE_TASK: next_line[:next_line_docs]}


def write_lm_eval_data(test_jsonl: Path, out_files: dict[str, Path], heldout_docs: int, next_line_docs: int,
                       skip_lines: str | None, seed: int) -> None:
    """The JSONL files that the task YAMLs of ``TASKS_DIR`` read, one per task (``out_files``)."""
    data = build_lm_eval_data(test_jsonl, heldout_docs, next_line_docs, skip_lines, seed)
    for name, rows in data.items():
        if not rows:
            raise ValueError(f"lm-eval task {name}: no documents could be built from {test_jsonl}")
    for name, rows in data.items():
        with atomic_file(Path(out_files[name])) as tmp:
            with open(tmp, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)


def _fingerprint(model_dir: Path) -> dict:
    """What a partial lm-eval result was scored on: each file of the model directory by size and
    modification time, so a retrained (or re-projected) model never reuses an old one's scores."""
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(Path(model_dir).iterdir()) if p.is_file()}


def long_enough_samples(lm, manager, name: str, shots: int, chat: bool, limit: int | None,
                        min_tokens: int) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Seed 000 Table 4 "exclude[s] samples whose input context is shorter than the window": the
    documents of task ``name`` (each subtask of a group) whose context, the few-shot examples
    included, has at least ``min_tokens`` tokens of the model's tokenizer, as lm-eval's
    ``samples`` ({subtask: doc indices}), and {subtask: [kept, of]}.

    The contexts are lm-eval's own (its requests, built as simple_evaluate builds them: the
    task's num_fewshot rule, the fixed few-shot seed). A subset draws its few-shot examples anew,
    so the selection is repeated on the subset until every kept context is long enough."""
    from lm_eval.defaults import DEFAULT_OTHER_SEED
    from lm_eval.evaluator_utils import get_sample_size

    samples, counts = {}, {}
    for sub, task in manager.load([name])["tasks"].items():
        if task.get_config("num_fewshot") != 0:  # simple_evaluate keeps a task's own 0
            task.set_config(key="num_fewshot", value=shots)
        keep, total = None, None
        for _ in range(8):
            task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)
            task.build_all_requests(limit=get_sample_size(task, limit) if keep is None else None, samples=keep,
                                    rank=0, world_size=1, apply_chat_template=chat, fewshot_as_multiturn=True,
                                    chat_template=lm.apply_chat_template if chat else None,
                                    tokenizer_name=lm.tokenizer_name if chat else "")
            lengths = {inst.doc_id: len(lm.tok_encode(inst.args[0])) for inst in task.instances}
            total = len(lengths) if total is None else total
            index = keep if keep is not None else sorted(lengths)  # with samples, doc ids count the subset
            kept = [index[d] for d, n in sorted(lengths.items()) if n >= min_tokens]
            if not kept:
                raise ValueError(f"lm-eval task {sub}: no document's context has {min_tokens} tokens or more "
                                 "(evaluation.lm_eval.exclude_shorter_than_window)")
            if kept == keep:
                break
            keep = kept
        samples[sub], counts[sub] = keep, [len(keep), total]
    return samples, counts


def in_dtype(model, dtype: str) -> bool:
    """Whether a loaded model's weights are in ``dtype`` (a task's dtype: lm-eval can score it as loaded)."""
    return model.dtype == getattr(torch, dtype, None)


def lm_eval_results(model_dir: Path, tasks: list[dict], batch_size: int, limit: int | None, device: str = "cpu",
                    dtype: str = "float32", metadata: dict | None = None, allow_unsafe_code: bool = False,
                    partial_dir: Path | None = None, min_context: int | None = None, model=None,
                    precision: str = "fp32") -> dict:
    """lm-eval's own `hf` model on ``model_dir``: {"results": ..., "num_fewshot": ...}.

    tasks = [{"name", "num_fewshot", "batch_size", "chat_template", "dtype"}] (the last three
    optional, else ``batch_size``, no chat template and ``dtype``), ours (TASKS_DIR) or lm-eval's;
    ``metadata`` goes to lm-eval's TaskManager with the model's tokenizer (RULER's
    max_seq_lengths). ``allow_unsafe_code`` (evaluation.lm_eval.allow_unsafe_code) lets tasks
    marked ``unsafe_code`` (MBPP) execute the model's code: lm-eval's confirm_run_unsafe_code,
    and HF_ALLOW_CODE_EVAL for `evaluate`'s code_eval.

    One task at a time, each written to ``partial_dir/<task>.json`` as it finishes (with the
    model's fingerprint): a failing task loses nothing else, and a rerun scores only the tasks
    missing there. Every task is tried before the first failure is raised. ``min_context``:
    only documents whose context has that many tokens (long_enough_samples; the record's
    "context_filter" gives {subtask: [kept, of]}). ``model``: model_dir already loaded
    (load_model): lm-eval's `hf` model wraps it for the tasks in its dtype instead of loading
    the directory again. ``precision`` "bf16" (or "auto" resolving to it): a float32 task's
    forwards run under bfloat16 autocast, lm-eval's own mixed_precision_dtype, with its
    log-softmax in float32 (softmax_dtype); a task already in bfloat16 is left as it is."""
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    if allow_unsafe_code:
        os.environ["HF_ALLOW_CODE_EVAL"] = "1"  # evaluate's code_eval refuses to run without it
    # Indexing lm-eval's thousands of built-in task files takes most of a CPU run: skip it
    # when every task asked for is one of ours.
    own = own_task_names()
    manager = TaskManager(
        include_path=str(TASKS_DIR), include_defaults=any(t["name"] not in own for t in tasks),
        metadata={"tokenizer": str(model_dir), **(metadata or {})} if metadata else None,
    )
    fingerprint = _fingerprint(model_dir)
    mixed = resolve_precision(precision, device)
    results, configs, failed, filtered = {}, {}, {}, {}
    lm, lm_key = None, None

    # a task's own settings over the block's (batch_size, dtype) over the schema's
    tasks = [task_defaults() | {"batch_size": batch_size, "dtype": dtype} | t for t in tasks]

    def key(t):
        return t["dtype"], t["batch_size"], t["num_fewshot"], bool(t["chat_template"])

    # grouped by model settings, so the model loads once a (dtype, batch size)
    for t in sorted(tasks, key=key):
        spec = {"task": t, "limit": limit, "metadata": metadata or {}, "model": fingerprint, "min_context": min_context,
                "precision": mixed}
        partial = Path(partial_dir) / f"{t['name']}.json" if partial_dir is not None else None
        if partial is not None and partial.is_file():
            done = json.loads(partial.read_text())
            if done.get("spec") == _jsonable(spec):
                results.update(done["results"])
                configs.update(done["num_fewshot"])
                filtered.update(done["context_filter"])
                continue
        task_dtype, size, shots, chat = key(t)
        try:
            if lm_key != (task_dtype, size):
                lm = None  # free the previous model before loading the next
                # lm-eval takes a loaded model as `pretrained` (then it reads neither dtype nor
                # device); the tokenizer is still the directory's
                loaded = model is not None and in_dtype(model, task_dtype)
                autocast_args = ({"mixed_precision_dtype": "bfloat16", "softmax_dtype": "float32"}
                                 if mixed == "bf16" and task_dtype == "float32" else {})
                lm = get_model("hf").create_from_arg_obj(
                    {"pretrained": model if loaded else str(model_dir), "tokenizer": str(model_dir),
                     "trust_remote_code": True, "dtype": task_dtype, **autocast_args},
                    {"batch_size": size, "device": device},
                )
                lm_key = (task_dtype, size)
            samples, counts = None, {}
            if min_context:
                samples, counts = long_enough_samples(lm, manager, t["name"], shots, chat, limit, min_context)
            with _without_env_info():
                out = lm_eval.simple_evaluate(
                    model=lm,
                    tasks=[t["name"]],
                    num_fewshot=shots,
                    batch_size=size,
                    device=device,
                    limit=None if samples else limit,  # lm-eval takes one of the two; limit is in samples
                    samples=samples,
                    task_manager=manager,
                    apply_chat_template=chat,
                    log_samples=False,
                    bootstrap_iters=1000,  # stderr: closed form for means, bootstrap for perplexities
                    confirm_run_unsafe_code=allow_unsafe_code,
                )
        except Exception as e:  # noqa: BLE001 - recorded, the other tasks still run
            import traceback

            traceback.print_exc()
            failed[t["name"]] = f"{type(e).__name__}: {e}"
            continue
        done = {"spec": spec, "results": _jsonable(out["results"]), "context_filter": counts,
                "num_fewshot": {k: v.get("num_fewshot") for k, v in out.get("configs", {}).items()}}
        if partial is not None:
            write_json(done, partial)
        results.update(done["results"])
        configs.update(done["num_fewshot"])
        filtered.update(counts)
    if failed:
        kept = f"; the others are kept in {partial_dir}, and a rerun scores only the failed" if partial_dir else ""
        raise RuntimeError(f"lm-eval tasks failed on {model_dir}: {failed}{kept}")
    return ({"results": _jsonable(results), "num_fewshot": configs, "precision": mixed}
            | ({"context_filter": filtered} if min_context else {}))


def evaluate_recall(model_dir, tokens_bin, out_json, batch_size: int, device: str,
                    distance_bins: list[int] | None = None, corpus: str = "recall",
                    max_examples: int | None = None) -> dict:
    """Recall accuracy (:func:`dimattn.data.recall.score_recall`) of the run at model_dir, as JSON."""
    from dimattn.data.recall import load_examples, score_recall

    if type(batch_size) is not int or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    load_examples(tokens_bin)  # a damaged corpus fails before the model loads
    model = load_model(Path(model_dir), device)
    result = {**run_metadata(Path(model_dir)), "corpus": corpus}
    result.update(score_recall(model, tokens_bin, batch_size, distance_bins, max_examples))
    write_json(result, out_json)
    return result


def evaluate_longctx(model_dir, tokens_bin, out_json, batch_size: int, device: str, corpus: str = "longctx",
                     max_examples: int | None = None) -> dict:
    """The long-context suite's scores (:func:`dimattn.data.longctx.score_suite`) of the run at
    model_dir on one suite corpus, as JSON."""
    from dimattn.data.longctx import score_suite

    model = load_model(Path(model_dir), device)
    result = {**run_metadata(Path(model_dir)), "corpus": corpus}
    result.update(score_suite(model, tokens_bin, batch_size, max_examples))
    write_json(result, out_json)
    return result


@contextlib.contextmanager
def _without_env_info():
    """simple_evaluate adds torch's collect_env report to its results: pip, lscpu and friends in
    subprocesses, about half a second a call and a task, for fields we never keep (we take the
    results, not the environment: the model's fingerprint stands for it)."""
    import lm_eval.evaluator

    kept = lm_eval.evaluator.add_env_info
    lm_eval.evaluator.add_env_info = lambda storage: None
    try:
        yield
    finally:
        lm_eval.evaluator.add_env_info = kept

def run_lm_eval(model_dir: Path, tasks: list[dict], batch_size: int, limit: int | None, out_json: Path, *,
                device: str, dtype: str, allow_unsafe_code: bool, exclude_shorter_than_window: bool, precision: str,
                partial_dir: Path | None = None, model=None) -> dict:
    """lm_eval_results of one of our runs, with its run fields, as JSON; the per-task partial
    results (``partial_dir``) are removed once the whole record is written.
    ``exclude_shorter_than_window``: seed 000 Table 4's filter at the run's window (a run without
    one, or with w = 0, keeps every document). ``model``: the run already loaded (load_model)."""
    meta = run_metadata(model_dir)
    window = meta.get("window") if exclude_shorter_than_window else None
    record = {**meta, **lm_eval_results(model_dir, tasks, batch_size, limit, device, dtype,
                                        allow_unsafe_code=allow_unsafe_code, partial_dir=partial_dir,
                                        min_context=window or None, model=model, precision=precision)}
    write_json(record, out_json)
    if partial_dir is not None:
        shutil.rmtree(partial_dir, ignore_errors=True)
    return record


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    return obj

