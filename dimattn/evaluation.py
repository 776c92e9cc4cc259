"""Held-out perplexity, and lm-evaluation-harness through its stock ``hf`` model on task YAMLs
that the workflow writes itself from the held-out split (so the default run stays offline).
"""

import json
import math
import random
import re
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from .atomic import atomic_file
from .data import load_tokens, read_documents
from .runs import run_metadata

# The workflow's own lm-eval tasks: YAMLs in TASKS_DIR, data written by write_lm_eval_data.
TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
HELDOUT_TASK = "dimattn_heldout"  # loglikelihood_rolling over held-out documents
NEXT_LINE_TASK = "dimattn_next_line"  # 4-way choice of the true next line
MIN_DOC_CHARS = 1500  # a held-out document: paragraphs grouped to at least this many characters
MIN_LINE_CHARS = 20  # a next-line candidate: at least this long
CONTEXT_LINES = 4  # lines of context before the line to choose


def load_model(model_dir: Path, device: str = "cpu"):
    # Our own directory: trust_remote_code runs the modeling file saved beside the weights.
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True)
    return model.to(device).eval()


@torch.no_grad()
def perplexity(model, tokens: np.ndarray, seq_len: int, batch_size: int, max_tokens: int | None = None) -> dict:
    """Mean next-token NLL over non-overlapping windows of seq_len covering the split."""
    n = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
    n_windows = n // seq_len
    if n_windows == 0:
        raise ValueError(f"held-out split has {n} tokens, fewer than seq_len={seq_len}")
    windows = torch.from_numpy(tokens[: n_windows * seq_len].astype(np.int64)).view(n_windows, seq_len)
    device = next(model.parameters()).device
    total_nll, total_count = 0.0, 0
    for x in tqdm(windows.split(batch_size), desc="perplexity", mininterval=5):
        x = x.to(device)
        count = x[:, 1:].numel()
        # The mean NLL without the (tokens x vocabulary) logits where the model can (ours on
        # CPU, in float32: dimattn.modeling_dimattn.lm_head_loss), else from the logits.
        loss = model(x, labels=x, return_logits=False).loss.double()
        total_nll += loss.item() * count
        total_count += count
    loss = total_nll / total_count
    return {"n_tokens": total_count, "loss": loss, "ppl": math.exp(loss)}


def evaluate_perplexity(model_dir: Path, tokens_bin: Path, corpus: str, seq_len: int, batch_size: int,
                        max_tokens: int | None, out_json: Path, device: str = "cpu") -> dict:
    tokens, _ = load_tokens(tokens_bin)
    model = load_model(model_dir, device)
    result = {**run_metadata(model_dir), "corpus": corpus, "split": "test"}
    result.update(perplexity(model, tokens, seq_len, batch_size, max_tokens))
    _write_json(result, out_json)
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


def lm_eval_results(model_dir: Path, tasks: list[dict], batch_size: int, limit: int | None, device: str = "cpu",
                    dtype: str = "float32", metadata: dict | None = None) -> dict:  # fmt: skip
    """lm-eval's own `hf` model on ``model_dir``: {"results": ..., "num_fewshot": ...}.

    tasks = [{"name", "num_fewshot", "batch_size", "chat_template"}] (the last two optional, else
    ``batch_size`` and no chat template), ours (TASKS_DIR) or lm-eval's; ``metadata`` goes to
    lm-eval's TaskManager with the model's tokenizer (RULER's max_seq_lengths)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    # Indexing lm-eval's thousands of built-in task files takes most of a CPU run: skip it
    # when every task asked for is one of ours.
    own = {p.stem for p in TASKS_DIR.glob("*.yaml")}
    manager = TaskManager(
        include_path=str(TASKS_DIR), include_defaults=any(t["name"] not in own for t in tasks),
        metadata={"tokenizer": str(model_dir), **(metadata or {})} if metadata else None,
    )  # fmt: skip
    results, configs = {}, {}
    groups = {}
    for t in tasks:
        key = (t.get("num_fewshot", 0), t.get("batch_size", batch_size), bool(t.get("chat_template", False)))
        groups.setdefault(key, []).append(t["name"])
    for (shots, size, chat), names in sorted(groups.items()):
        out = lm_eval.simple_evaluate(
            model="hf",
            model_args={"pretrained": str(model_dir), "trust_remote_code": True, "dtype": dtype},
            tasks=names,
            num_fewshot=shots,
            batch_size=size,
            device=device,
            limit=limit,
            task_manager=manager,
            apply_chat_template=chat,
            log_samples=False,
            bootstrap_iters=1000,  # stderr: closed form for means, bootstrap for perplexities
        )
        results.update(out["results"])
        configs.update({k: v.get("num_fewshot") for k, v in out.get("configs", {}).items()})
    return {"results": _jsonable(results), "num_fewshot": configs}


def evaluate_recall(model_dir, tokens_bin, out_json, batch_size: int, device: str = "cpu",
                    distance_bins: list[int] | None = None, corpus: str = "recall",
                    max_examples: int | None = None) -> dict:
    """Recall accuracy (:func:`dimattn.recall.score_recall`) of the run at model_dir, as JSON."""
    from .recall import load_examples, score_recall

    if type(batch_size) is not int or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    load_examples(tokens_bin)  # a damaged corpus fails before the model loads
    model = load_model(Path(model_dir), device)
    result = {**run_metadata(Path(model_dir)), "corpus": corpus}
    result.update(score_recall(model, tokens_bin, batch_size, distance_bins, max_examples))
    with atomic_file(Path(out_json)) as tmp:
        tmp.write_text(json.dumps(result, indent=2))
    return result


def run_lm_eval(model_dir: Path, tasks: list[dict], batch_size: int, limit: int | None, out_json: Path,
                device: str = "cpu", dtype: str = "float32") -> dict:
    """lm_eval_results of one of our runs, with its run fields, as JSON."""
    record = {**run_metadata(model_dir), **lm_eval_results(model_dir, tasks, batch_size, limit, device, dtype)}
    _write_json(record, out_json)
    return record


def prefetch(models: list[str], tasks: list[dict], metadata: dict | None, out_json: Path) -> dict:
    """Fill the Hugging Face cache on a machine with network (a SLURM login node), so that compute
    nodes run offline: each hub model's files, and each lm-eval task built once with that model's
    tokenizer, which downloads its dataset (RULER: the essays, SQuAD, HotpotQA; nltk's punkt_tab)
    and generates RULER's samples at every metadata.max_seq_lengths."""
    from huggingface_hub import snapshot_download
    from lm_eval.tasks import TaskManager

    done = {}
    for model in models:
        snapshot_download(model)
        names = [t["name"] for t in tasks]
        if names:
            manager = TaskManager(metadata={"tokenizer": model, **(metadata or {})})
            manager.load_task_or_group(names)
        done[model] = names
    _write_json({"models": done, "metadata": metadata or {}}, out_json)
    return done


def score_projected(model_dir: Path, fields: dict, tokens: dict[str, Path], seq_len: int, batch_size: int,
                    max_tokens: int | None, tasks: list[dict], limit: int | None, out_json: Path,
                    metadata: dict | None = None, device: str = "cpu",
                    recall: dict[str, Path] | None = None) -> dict:  # fmt: skip
    """A projected model directory (dimattn.modeling_projected) scored as our runs are: held-out
    perplexity per corpus ({corpus: tokens.bin}), the recall probe per synthetic corpus
    ({corpus: test tokens.bin}; the context prefilled and the questions decoded through the
    model's KV cache, so that KV compression acts: dimattn.recall.score_recall, seed 003's RULER
    at CPU scale) and lm-eval's `hf` model on ``tasks``; JSON with ``fields`` (model, objective,
    d', l, kv, ...) beside."""
    from .recall import load_examples, score_recall

    for path in (recall or {}).values():
        load_examples(path)  # a damaged corpus fails before any scoring
    record = {**fields, "perplexity": {}, "recall": {}, "results": {}, "num_fewshot": {}}
    if tokens or recall:
        model = load_model(model_dir, device)
        for corpus, path in tokens.items():
            record["perplexity"][corpus] = perplexity(model, load_tokens(path)[0], seq_len, batch_size, max_tokens)
        for corpus, path in (recall or {}).items():
            record["recall"][corpus] = score_recall(model, path, batch_size, through_cache=True)
        del model
    if tasks:
        record.update(lm_eval_results(model_dir, tasks, batch_size, limit, device, metadata=metadata))
    _write_json(record, out_json)
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


def _write_json(obj: dict, path: Path) -> None:
    with atomic_file(Path(path)) as tmp:
        tmp.write_text(json.dumps(obj, indent=2))
