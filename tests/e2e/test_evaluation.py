"""dimattn.evaluation.scoring and dimattn.workflow.runs: held-out perplexity against a naive loop, the data of
our lm-eval tasks on any corpus, the task YAMLs shipped in the repository, and run metadata."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dimattn import DimAttnConfig, DimAttnForCausalLM

from dimattn.evaluation import scoring as evaluation
from dimattn.data.corpora import write_documents
from dimattn.workflow.runs import run_metadata
from dimattn.model.variants import RUN_FIELDS

REPO = Path(__file__).resolve().parents[2]
# The jobs' entry points take every value the config holds; these are the CPU tiers'.
LM_EVAL = dict(device="cpu", dtype="float32", allow_unsafe_code=False, exclude_shorter_than_window=False,
               precision="fp32")


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
    from dimattn.workflow import paths

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


def test_the_suite_scores_with_lm_evals_ruler_metrics_loaded_from_their_file():
    """dimattn.data.longctx loads lm-eval's RULER metrics from their file, skipping lm_eval.tasks'
    registry: the same file as the package import's, and the same score on every case."""
    from lm_eval.tasks.ruler import common_utils

    from dimattn.data import longctx

    loaded = longctx._ruler_metrics()
    assert Path(loaded.__file__) == Path(common_utils.__file__)
    cases = [("v01 v02", ["v01"]), ("V01 x", ["v01", "v03"]), ("w02", ["v02"]), ("", ["a", "b"])]
    for task in ("qa", "niah_multivalue"):
        metric = common_utils.string_match_part if task in longctx.PART_SCORED else common_utils.string_match_all
        scores = [longctx.example_score(task, pred, refs) for pred, refs in cases]
        assert scores == [float(metric([pred], [refs])) for pred, refs in cases] == [1.0, 0.5, 0.0, 0.0]


def test_perplexity_measures_the_cache_of_one_window():
    """cache_bytes_per_token: what the model's own generation cache holds a token of a seq_len
    window, from its tensors: full keys and values (2 layers x 2 x 32 dims x 4 bytes), and DAR's
    latent (d_down) beside the last w - 1 tokens' keys and values, plus each slot's position."""
    tokens = np.random.default_rng(0).integers(0, 50, size=100).astype(np.uint16)
    vanilla = evaluation.perplexity(tiny_model(), tokens, seq_len=16, batch_size=4)
    assert vanilla["cache_bytes_per_token"] == 2 * 2 * 32 * 4
    dar = evaluation.perplexity(tiny_model(attention="dar", window=4, d_down=8), tokens, seq_len=16, batch_size=4)
    expected = 2 * (8 * 16 + 2 * 32 * 3) * 4 + 16 * 4  # latents, near k/v of 3 slots, int32 positions
    assert dar["cache_bytes_per_token"] == pytest.approx(expected / 16)


def test_perplexity_in_bf16_autocasts_the_forwards_and_stays_near_fp32(monkeypatch):
    """evaluation.precision bf16: the matmuls run in bfloat16 (a Linear's output is bf16), the
    loss reduces in float32 and stays within bf16 rounding of the float32 one."""
    import dimattn.data.recall

    monkeypatch.setattr(dimattn.data.recall, "cache_bytes_per_token", lambda *a, **k: 0.0)  # its forward is fp32
    model = tiny_model()
    tokens = np.random.default_rng(0).integers(0, 50, size=100).astype(np.uint16)
    seen = []
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    fp32 = evaluation.perplexity(model, tokens, seq_len=16, batch_size=4)
    assert fp32["precision"] == "fp32" and set(seen) == {torch.float32}
    seen.clear()
    bf16 = evaluation.perplexity(model, tokens, seq_len=16, batch_size=4, precision="bf16")
    assert bf16["precision"] == "bf16" and set(seen) == {torch.bfloat16}
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=1e-2) and bf16["loss"] != fp32["loss"]
    assert next(model.parameters()).dtype == torch.float32  # the weights are left as they were


@pytest.fixture
def scored_run(tmp_path, monkeypatch):
    """One of our tiny runs with a tokenizer, and our two lm-eval tasks' data, in a working
    directory laid out like the workflow's (the task YAMLs read results/lm_eval_data/)."""
    from dimattn.workflow import paths
    from dimattn.data.corpora import train_tokenizer

    monkeypatch.chdir(tmp_path)
    docs = tmp_path / "test.jsonl"
    write_documents([{"id": "novel", "text": PROSE * 3}], docs)
    run = tmp_path / "tiny-vanilla"
    tokenizer = train_tokenizer(docs, vocab_size=300, out_dir=run)
    torch.manual_seed(0)
    cfg = DimAttnConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        max_position_embeddings=2048)
    DimAttnForCausalLM(cfg).save_pretrained(run)
    tasks = (evaluation.HELDOUT_TASK, evaluation.NEXT_LINE_TASK)
    evaluation.write_lm_eval_data(docs, {t: Path(paths.lm_eval_data(t)) for t in tasks}, 2, 4, None, 0)
    return run


def test_each_lm_eval_task_is_kept_as_it_finishes_and_a_rerun_scores_only_the_missing(scored_run, tmp_path,
                                                                                     monkeypatch):
    """Table 4's score_text: one failing task (MBPP, once) loses nothing else; the rerun scores it
    alone, and the record equals an uninterrupted one."""
    import lm_eval

    real, calls, fail_once = lm_eval.simple_evaluate, [], [evaluation.HELDOUT_TASK]

    def flaky(*args, **kw):
        calls.append((kw["tasks"], kw["confirm_run_unsafe_code"]))
        if kw["tasks"][0] in fail_once:
            fail_once.remove(kw["tasks"][0])
            raise RuntimeError("code_eval is not available")
        return real(*args, **kw)

    monkeypatch.setattr(lm_eval, "simple_evaluate", flaky)
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    tasks = [{"name": evaluation.NEXT_LINE_TASK}, {"name": evaluation.HELDOUT_TASK}]
    partial, out = tmp_path / "checkpoints/tiny-vanilla/lm_eval", tmp_path / "lm_eval.json"
    kw = dict(model_dir=scored_run, tasks=tasks, batch_size=2, limit=2, out_json=out, partial_dir=partial, **LM_EVAL)
    with pytest.raises(RuntimeError, match=f"{evaluation.HELDOUT_TASK}.*a rerun scores only the failed"):
        evaluation.run_lm_eval(**kw)
    assert not out.exists() and sorted(p.name for p in partial.iterdir()) == [f"{evaluation.NEXT_LINE_TASK}.json"]
    # both tasks were tried, unsafe code never confirmed nor allowed
    assert {c[0][0] for c in calls} == {evaluation.HELDOUT_TASK, evaluation.NEXT_LINE_TASK}
    assert not any(c[1] for c in calls) and "HF_ALLOW_CODE_EVAL" not in __import__("os").environ
    calls.clear()
    record = evaluation.run_lm_eval(**(kw | {"allow_unsafe_code": True}))
    assert calls == [([evaluation.HELDOUT_TASK], True)]  # the kept task is not scored again
    assert __import__("os").environ["HF_ALLOW_CODE_EVAL"] == "1"
    assert not partial.exists() and json.loads(out.read_text()) == record
    assert set(record["results"]) == {evaluation.HELDOUT_TASK, evaluation.NEXT_LINE_TASK}
    calls.clear()
    fresh = evaluation.lm_eval_results(scored_run, tasks, 2, 2)
    assert fresh["results"] == record["results"] and len(calls) == 2


def test_a_projected_model_keeps_each_lm_eval_task_as_it_finishes(scored_run, tmp_path, monkeypatch):
    """score_projected as score_text: a failing task loses nothing else, the rerun scores it alone,
    and the kept results go once the record is written."""
    import lm_eval

    from dimattn.evaluation.projected import score_projected

    real, calls, fail_once = lm_eval.simple_evaluate, [], [evaluation.HELDOUT_TASK]

    def flaky(*args, **kw):
        calls.append(kw["tasks"][0])
        if kw["tasks"][0] in fail_once:
            fail_once.remove(kw["tasks"][0])
            raise RuntimeError("one task fails")
        return real(*args, **kw)

    monkeypatch.setattr(lm_eval, "simple_evaluate", flaky)
    tasks = [{"name": evaluation.NEXT_LINE_TASK}, {"name": evaluation.HELDOUT_TASK}]
    partial, out = tmp_path / "checkpoints/projected", tmp_path / "downstream.json"
    kw = dict(model_dir=scored_run, fields={"objective": "base", "d_prime": 0}, tokens={}, seq_len=64, batch_size=2,
              max_tokens=None, tasks=tasks, limit=2, out_json=out, partial_dir=partial, device="cpu", precision="fp32")
    with pytest.raises(RuntimeError, match=evaluation.HELDOUT_TASK):
        score_projected(**kw)
    assert not out.exists() and [p.name for p in partial.iterdir()] == [f"{evaluation.NEXT_LINE_TASK}.json"]
    calls.clear()
    record = score_projected(**kw)
    assert calls == [evaluation.HELDOUT_TASK] and not partial.exists()
    assert set(record["results"]) == {evaluation.HELDOUT_TASK, evaluation.NEXT_LINE_TASK}


def test_a_kept_lm_eval_result_of_another_model_is_scored_again(scored_run, tmp_path, monkeypatch):
    import lm_eval

    partial, calls = tmp_path / "partial", []
    tasks = [{"name": evaluation.NEXT_LINE_TASK}]
    evaluation.lm_eval_results(scored_run, tasks, 2, 2, partial_dir=partial)
    real = lm_eval.simple_evaluate
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda *a, **kw: calls.append(kw["tasks"]) or real(*a, **kw))
    evaluation.lm_eval_results(scored_run, tasks, 2, 2, partial_dir=partial)
    assert calls == []  # same model, same task: kept
    DimAttnForCausalLM.from_pretrained(scored_run).save_pretrained(scored_run)  # retrained: new files
    evaluation.lm_eval_results(scored_run, tasks, 2, 2, partial_dir=partial)
    assert calls == [[evaluation.NEXT_LINE_TASK]]


def test_lm_eval_gets_each_tasks_dtype_batch_and_chat_template(tmp_path, monkeypatch):
    """The authors' RULER runs (bfloat16, batch 1, chat template) and harness runs (bfloat16,
    batch 32) reach lm-eval's hf model as configured; the model loads once a (dtype, batch)."""
    import lm_eval
    import lm_eval.api.registry as registry

    loads, runs = [], []

    class FakeHF:
        @staticmethod
        def create_from_arg_obj(args, extra):
            loads.append((args["dtype"], extra["batch_size"]))
            return ("lm", args["dtype"], extra["batch_size"])

    monkeypatch.setattr(registry, "get_model", lambda name: FakeHF)
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: runs.append(
        (kw["tasks"][0], kw["model"], kw["apply_chat_template"], kw["num_fewshot"])) or {"results": {}, "configs": {}})
    (tmp_path / "config.json").write_text("{}")
    tasks = [{"name": "niah_single_1", "batch_size": 1, "chat_template": True, "dtype": "bfloat16"},
             {"name": "hellaswag", "batch_size": 32, "dtype": "bfloat16"},
             {"name": "ruler_vt", "batch_size": 1, "chat_template": True, "dtype": "bfloat16"},
             {"name": "dimattn_heldout"}]
    evaluation.lm_eval_results(tmp_path, tasks, batch_size=8, limit=None)
    assert sorted(loads) == [("bfloat16", 1), ("bfloat16", 32), ("float32", 8)]
    assert sorted(runs) == [("dimattn_heldout", ("lm", "float32", 8), False, 0),
                            ("hellaswag", ("lm", "bfloat16", 32), False, 0),
                            ("niah_single_1", ("lm", "bfloat16", 1), True, 0),
                            ("ruler_vt", ("lm", "bfloat16", 1), True, 0)]


def test_lm_eval_in_bf16_autocasts_float32_tasks_through_lm_evals_own_arguments(tmp_path, monkeypatch):
    """evaluation.precision bf16 reaches lm-eval's hf model as its mixed_precision_dtype (with
    the log-softmax in float32) for float32 tasks; a task already in bfloat16 gets neither."""
    import lm_eval
    import lm_eval.api.registry as registry

    loads = []

    class FakeHF:
        @staticmethod
        def create_from_arg_obj(args, extra):
            loads.append((args["dtype"], args.get("mixed_precision_dtype"), args.get("softmax_dtype")))
            return "lm"

    monkeypatch.setattr(registry, "get_model", lambda name: FakeHF)
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: {"results": {}, "configs": {}})
    (tmp_path / "config.json").write_text("{}")
    # our own tasks: lm-eval's built-in index (seconds) is not read
    tasks = [{"name": "dimattn_next_line", "batch_size": 32, "dtype": "bfloat16"}, {"name": "dimattn_heldout"}]
    out = evaluation.lm_eval_results(tmp_path, tasks, batch_size=8, limit=None, precision="bf16")
    assert sorted(loads) == [("bfloat16", None, None), ("float32", "bfloat16", "float32")]
    assert out["precision"] == "bf16"
    loads.clear()
    assert evaluation.lm_eval_results(tmp_path, tasks, batch_size=8, limit=None)["precision"] == "fp32"
    assert sorted(loads) == [("bfloat16", None, None), ("float32", None, None)]


def test_lm_eval_in_bf16_scores_near_fp32(scored_run):
    """The same tiny run through lm-eval in float32 and under bf16 autocast: every metric within
    bf16 rounding, and not bitwise equal (the autocast acted)."""
    tasks = [{"name": evaluation.HELDOUT_TASK}]
    fp32 = evaluation.lm_eval_results(scored_run, tasks, 2, 2)["results"][evaluation.HELDOUT_TASK]
    bf16 = evaluation.lm_eval_results(scored_run, tasks, 2, 2, precision="bf16")["results"][evaluation.HELDOUT_TASK]
    metrics = [k for k, v in fp32.items() if isinstance(v, float) and "stderr" not in k]
    assert metrics and all(bf16[k] == pytest.approx(fp32[k], rel=1e-2) for k in metrics)
    assert any(bf16[k] != fp32[k] for k in metrics)


def test_lm_eval_scores_the_loaded_model_for_tasks_in_its_dtype(scored_run, monkeypatch):
    """score_text loads a run once: lm-eval's hf model wraps the loaded model, with the scores it
    gets from the directory; a task in another dtype loads the directory in that dtype."""
    import transformers

    tasks = [{"name": evaluation.NEXT_LINE_TASK}, {"name": evaluation.HELDOUT_TASK}]
    from_dir = evaluation.lm_eval_results(scored_run, tasks, 2, 2)
    model, loads = evaluation.load_model(scored_run, "cpu"), []
    real = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **kw: loads.append(kw.get("dtype")) or real(*a, **kw))
    assert evaluation.lm_eval_results(scored_run, tasks, 2, 2, model=model) == from_dir and loads == []
    evaluation.lm_eval_results(scored_run, [{"name": evaluation.NEXT_LINE_TASK, "dtype": "bfloat16"}], 2, 2,
                               model=model)
    assert len(loads) == 1 and str(loads[0]).endswith("bfloat16")


def test_table4_scores_only_documents_whose_context_reaches_the_window(scored_run, tmp_path):
    """Seed 000 Table 4 excludes samples whose input context is shorter than the window: lm-eval
    scores exactly the next-line choices whose context ("{{context}}\\n", 0-shot) has at least w
    tokens, and records how many it kept."""
    from transformers import AutoTokenizer

    from dimattn.workflow import paths

    tok = AutoTokenizer.from_pretrained(scored_run)
    rows = [json.loads(line) for line in Path(paths.lm_eval_data(evaluation.NEXT_LINE_TASK)).read_text().splitlines()]
    lengths = sorted(len(tok.encode(r["context"] + "\n", add_special_tokens=False)) for r in rows)
    window = lengths[len(lengths) // 2]  # about half the documents are shorter
    expected = sum(n >= window for n in lengths)
    assert 0 < expected < len(rows)
    tasks = [{"name": evaluation.NEXT_LINE_TASK}]
    full = evaluation.lm_eval_results(scored_run, tasks, 2, None)
    short = evaluation.lm_eval_results(scored_run, tasks, 2, None, min_context=window)
    assert "context_filter" not in full
    assert short["context_filter"] == {evaluation.NEXT_LINE_TASK: [expected, len(rows)]}
    assert short["results"] != full["results"]
    with pytest.raises(RuntimeError, match="no document.s context has 10000 tokens"):
        evaluation.lm_eval_results(scored_run, tasks, 2, None, min_context=10_000)
    # run_lm_eval takes the window from the run: a vanilla run has none, so keeps every document
    record = evaluation.run_lm_eval(scored_run, tasks, 2, None, tmp_path / "out.json",
                                    **(LM_EVAL | {"exclude_shorter_than_window": True}))
    assert record["window"] is None and "context_filter" not in record and record["results"] == full["results"]


def test_lm_eval_builds_no_environment_report(scored_run, monkeypatch):
    # torch's collect_env (pip list, lscpu in subprocesses) ran once a task for fields never kept
    import lm_eval.evaluator
    import torch.utils.collect_env

    reports, kept = [], lm_eval.evaluator.add_env_info
    monkeypatch.setattr(torch.utils.collect_env, "get_pretty_env_info", lambda: reports.append(1) or "")
    out = evaluation.lm_eval_results(scored_run, [{"name": evaluation.NEXT_LINE_TASK}], 2, 2)
    assert reports == [] and evaluation.NEXT_LINE_TASK in out["results"]
    assert lm_eval.evaluator.add_env_info is kept  # lm-eval's own again once the call returns
