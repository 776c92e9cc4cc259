"""dimattn.evaluation and dimattn.runs: held-out perplexity against a naive loop, the data of
our lm-eval tasks on any corpus, the task YAMLs shipped in the repository, and run metadata."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dimattn import DimAttnConfig, DimAttnForCausalLM, evaluation
from dimattn.data import write_documents
from dimattn.runs import run_metadata
from dimattn.variants import RUN_FIELDS

REPO = Path(__file__).resolve().parents[1]


def tiny_model(**kw):
    torch.manual_seed(0)
    cfg = DimAttnConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        max_position_embeddings=64, **kw)
    return DimAttnForCausalLM(cfg).eval()


def test_perplexity_is_the_mean_nll_over_whole_windows():
    model = tiny_model()
    tokens = np.random.default_rng(0).integers(0, 50, size=100).astype(np.uint16)
    result = evaluation.perplexity(model, tokens, seq_len=16, batch_size=4)
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, 96, 16):  # 6 whole windows; the last 4 tokens are dropped
            x = torch.from_numpy(tokens[start:start + 16].astype(np.int64))[None]
            logp = torch.log_softmax(model(x).logits[0, :-1].float(), -1)
            nll -= logp.gather(1, x[0, 1:, None]).sum().item()
            count += 15
    assert result["n_tokens"] == count
    assert result["loss"] == pytest.approx(nll / count, rel=1e-5)
    assert result["ppl"] == pytest.approx(math.exp(nll / count), rel=1e-5)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        evaluation.perplexity(model, tokens[:10], seq_len=16, batch_size=4)


def test_run_metadata_reads_the_saved_config(tmp_path):
    model = tiny_model(attention="dilated", window=4, dilation=2)
    model.save_pretrained(tmp_path / "tiny-dilated-w4-r2")
    meta = run_metadata(tmp_path / "tiny-dilated-w4-r2")
    assert list(meta) == RUN_FIELDS
    assert meta["run"] == "tiny-dilated-w4-r2" and meta["attention"] == "dilated"
    assert (meta["window"], meta["dilation"], meta["d_down"], meta["hidden_size"]) == (4, 2, None, 32)


PROSE = """Chapter One

THE HARBOUR

ACTUALLY the ships had come in late that year, long after the ice had gone from the bay.
The harbour master counted them from the window of the customs house every morning.
[A note in the margin]
SCENERY along the coast was the only thing the travellers ever wrote home about.
Nobody in the town remembered a spring so slow, nor a summer that came so suddenly.
The fishermen mended their nets on the quay and argued about the price of salt.
By August the warehouses were full and the merchants began to talk of a second voyage.
"""


def test_lm_eval_data_from_any_corpus(tmp_path):
    """Lines starting "ACT"/"SCENE" were once dropped for every corpus; now only a pattern the
    config gives (Shakespeare's headings) removes lines."""
    docs = tmp_path / "test.jsonl"
    write_documents([{"id": "novel", "text": PROSE * 3}], docs)
    data = evaluation.build_lm_eval_data(docs, heldout_docs=2, next_line_docs=50, skip_lines=None, seed=0)
    lines = {c for row in data[evaluation.NEXT_LINE_TASK] for c in row["choices"]}
    assert any(line.startswith("ACTUALLY") for line in lines)
    assert any(line.startswith("SCENERY") for line in lines)
    assert not any(line.startswith("[") or line.isupper() or len(line) < 20 for line in lines)
    for row in data[evaluation.NEXT_LINE_TASK]:
        assert len(row["choices"]) == 4 and 0 <= row["label"] < 4
        assert len(row["context"].splitlines()) == evaluation.CONTEXT_LINES
    skipped = evaluation.build_lm_eval_data(docs, 2, 50, skip_lines=r"^(ACT|SCENE)", seed=0)
    lines = {c for row in skipped[evaluation.NEXT_LINE_TASK] for c in row["choices"]}
    assert not any(line.startswith(("ACTUALLY", "SCENERY")) for line in lines)
    assert data == evaluation.build_lm_eval_data(docs, 2, 50, skip_lines=None, seed=0)  # deterministic


def test_lm_eval_data_files_are_what_the_yamls_read(tmp_path, monkeypatch):
    docs = tmp_path / "test.jsonl"
    write_documents([{"id": "novel", "text": PROSE * 3}], docs)
    monkeypatch.chdir(tmp_path)  # YAML data paths are relative to the workflow directory
    from dimattn import paths

    tasks = (evaluation.HELDOUT_TASK, evaluation.NEXT_LINE_TASK)
    evaluation.write_lm_eval_data(docs, {t: Path(paths.lm_eval_data(t)) for t in tasks}, 2, 5, None, 0)
    for task in tasks:
        spec = yaml.safe_load((evaluation.TASKS_DIR / f"{task}.yaml").read_text())
        assert spec["task"] == task and spec["include"] == "_dimattn_template_yaml"
        data = Path(spec["dataset_kwargs"]["data_files"]["test"])
        assert data.as_posix() == paths.lm_eval_data(task)
        rows = [json.loads(line) for line in data.read_text().splitlines()]
        assert rows and len(rows) <= 5
    with pytest.raises(ValueError, match="no documents"):
        write_documents([{"id": "short", "text": "too short"}], docs)
        evaluation.write_lm_eval_data(docs, {t: tmp_path / f"{t}.out" for t in tasks}, 2, 5, None, 0)
    assert not list(tmp_path.glob("*.out"))  # nothing half-made


def test_task_yamls_load_through_lm_evals_task_manager():
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(evaluation.TASKS_DIR), include_defaults=False)
    assert {evaluation.HELDOUT_TASK, evaluation.NEXT_LINE_TASK} <= set(manager.all_tasks)
    assert "_dimattn_template_yaml" not in manager.all_tasks
