"""Seed 003 Tables 2-3 and 5 (dimattn.reporting.dimpo_downstream.subtask_table, kv_table): the
long-context probes (RULER through lm-eval at paper scale, the recall probe at CPU scale) by
subtask, and with KV-cache compression, the paper's rows beside."""

import pytest
from reporting_fixtures import REFERENCE, summary_path, table_line, write_long_context_jsons

from dimattn.reporting import dimpo_downstream, outputs, summaries
from dimattn.workflow.sweeps import RULER_TASKS

@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    df = summaries.summarize_downstream(
        write_long_context_jsons(root), summary_path(root / "summary", "dimpo_downstream")
    )
    names = ["tables/dimpo_ruler.tex", "tables/dimpo_kv.tex"]
    written = outputs.render(names, root / "summary", REFERENCE, root)
    return df, {p.name: p.read_text() for p in written}


def _cells(tex, start):
    return [c.strip() for c in table_line(tex, start).rstrip(" \\").split("&")[1:]]


def test_the_summary_keeps_recall_bins_and_drops_ruler_lengths_not_run(rendered):
    df, _ = rendered
    recall = df[df["task"] == "recall:recall"]
    assert set(recall["metric"]) == {"acc", "acc,d8-20", "acc,d21-33"}
    ruler = df[df["task"].isin(RULER_TASKS)]
    assert set(ruler["metric"]) == {"4096"} and len(ruler) == 3 * 13  # the -1 of 8192 is no score
    assert set(df["kv_method"]) == {"none", "kivi", "snapkv"}


def test_ruler_columns_follow_the_papers_grouping(rendered):
    df, _ = rendered
    scores = dimpo_downstream.long_context(df)
    base = scores[(scores["model"] == "tiny-llama") & (scores["objective"] == "base")].set_index("column")["value"]
    # NIAH: the 8 niah_* subtasks (i = 0..7); the average: all 13 (i = 0..12), unweighted
    assert base["NIAH"] == pytest.approx(50 + 40 + 3.5)
    assert base["CWE"] == pytest.approx(50 + 40 + RULER_TASKS.index("ruler_cwe"))
    assert base["avg"] == pytest.approx(50 + 40 + 6)
    assert list(scores[scores["model"] == "tiny-llama"].drop_duplicates("column")["column"]) == [
        "NIAH", "SQuAD", "HotpotQA", "VT", "CWE", "FWE", "avg"]


def test_an_incomplete_ruler_run_has_no_average(rendered):
    df, _ = rendered
    partial = df[~((df["task"] == "ruler_vt") & (df["objective"] == "kl"))]
    scores = dimpo_downstream.long_context(partial).set_index(["model", "objective", "column"])["value"]
    assert scores.isna()[("tiny-llama", "kl", "avg")] and scores[("tiny-llama", "kl", "NIAH")] > 0


def test_the_subtask_table_sits_at_the_separating_l_beside_the_paper(rendered):
    _, tex = rendered
    tex = tex["dimpo_ruler.tex"]
    # recall: objectives differ most at l = 2 (kl 0.675 vs dimpo 0.475 overall, seeds averaged)
    assert r"recall by query distance, $l{=}2$ of 2" in tex and r"RULER 4096, $l{=}20$ of 32" in tex
    dimpo = _cells(tex, "DimPO &")
    assert dimpo[:3] == [r"50.5 {\scriptsize[50.0, 51.0]}", r"40.5 {\scriptsize[40.0, 41.0]}",
                         r"48.0 {\scriptsize[47.5, 48.5]}"]
    assert dimpo[-14:-7] == ["51.3", "60.3", "38.4", "39.6", "61.2", "71.5", "52.4"]  # paper, Table 2 (Llama)
    assert dimpo[-7:] == ["73.0", "46.2", "36.4", "69.6", "56.5", "64.5", "65.9"]  # Table 3 (Qwen3-4B)
    assert _cells(tex, "Base (l = 0) &")[:3] == ["90.0", "80.0", "87.5"]
    assert "DimPO, listwise only &" in tex  # the paper's k = 0 row, ours missing


def test_the_kv_table_puts_compressions_in_columns(rendered):
    _, tex = rendered
    tex = tex["dimpo_kv.tex"]
    assert "KIVI (bits 2 / 2)" in tex and "SnapKV (budget 8 / 1024)" in tex and "SnapKV (budget -- / 2048)" in tex
    base = _cells(tex, "ours: recall-vanilla, recall, DimPO, l = 0 &")
    assert base == ["87.5", f"{100 * (0.88 * 30 + 0.70 * 10) / 40:.1f}", "--", "57.5", "--"]
    l2 = _cells(tex, "ours: recall-vanilla, recall, DimPO, l = 2 &")
    assert l2[0].startswith("48.0") and l2[1].startswith("43.0") and l2[3].startswith("28.0")
    assert _cells(tex, "paper: Llama-3.1-8B-Instruct, RULER 4k, DimPO, l = 16 &") == [
        "90.5", "83.4", "90.6", "90.5", "90.5"]


def test_outputs_are_wanted_from_the_summary_alone(tmp_path):
    summaries.summarize_downstream(
        write_long_context_jsons(tmp_path), summary_path(tmp_path / "summary", "dimpo_downstream")
    )
    asked = outputs.runs_in(tmp_path / "summary")
    assert {"downstream", "long_context", "kv"} <= set(asked.dimpo)
    wanted = outputs.wanted(asked.runs, asked.lm_eval, asked.dimpo)
    assert {"tables/dimpo_ruler.tex", "tables/dimpo_kv.tex"} <= set(wanted)
