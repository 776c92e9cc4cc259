"""The needle heat map (dimattn.reporting.long_context): from the runs' suite JSONs through the
longctx_needle summary to a panel per run, the base first, each cell the bin's score."""

import json

import pytest
from matplotlib.collections import QuadMesh

from dimattn.reporting import long_context, summaries

BINS = [(0.0, 0.5), (0.5, 1.0)]
SCORES = {("long-vanilla", 128): [100.0, 80.0], ("long-vanilla", 256): [60.0, 40.0],
          ("long-dar-w8-d16", 128): [90.0, 10.0], ("long-dar-w8-d16", 256): [20.0, 0.0]}  # fmt: skip


def _record(run, seq_len):
    model = {"attention": "vanilla", "hidden_size": 64} if run == "long-vanilla" else \
        {"attention": "dar", "hidden_size": 64, "d_down": 16, "window": 8}  # fmt: skip
    bins = [{"depth_lo": lo, "depth_hi": hi, "score": s, "n": 6 + i}
            for i, ((lo, hi), s) in enumerate(zip(BINS, SCORES[run, seq_len]))]  # fmt: skip
    needle = {"niah_single": [b | {"score": 100.0} for b in bins], "niah_multikey": bins}
    return {"run": run, **model, "seed": 0, "corpus": f"suite{seq_len}", "split": "test", "seq_len": seq_len,
            "subtasks": {"niah_single": {"score": 0.0, "exact": 0.0, "n": 13}}, "average": 0.0, "needle": needle}


@pytest.fixture
def drawn(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    paths = []
    for run, seq_len in SCORES:  # the DAR run first: the figure still puts the base first
        paths.append(tmp_path / f"{run}_{seq_len}.json")
        paths[-1].write_text(json.dumps(_record(run, seq_len)))
    summaries.summarize_longctx_needle(paths[::-1], tmp_path / "longctx_needle.csv")
    df = summaries.read(tmp_path / "longctx_needle.csv", "longctx_needle")
    saved, savefig = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), savefig(fig, *a, **k)))
    long_context.figure(df, tmp_path / "needle.png")
    return df, saved[0]


def test_the_summary_has_a_row_per_run_length_and_bin(drawn):
    df, _ = drawn
    assert len(df) == 16 and list(df["run"][:8]) == ["long-vanilla"] * 4 + ["long-dar-w8-d16"] * 4  # vanilla first
    assert list(df["subtask"][:4]) == ["niah_multikey"] * 2 + ["niah_single"] * 2
    assert list(df["depth_lo"][:2]) == [0.0, 0.5] and list(df["corpus"]) == ["suite128"] * 8 + ["suite256"] * 8
    multikey = df[df["subtask"] == "niah_multikey"]
    row = multikey[(multikey["run"] == "long-dar-w8-d16") & (multikey["seq_len"] == 128) & (multikey["depth_lo"] == 0.5)].iloc[0]
    assert (row["score"], row["n"], row["depth_hi"]) == (10.0, 7, 1.0)


def test_a_panel_per_run_and_subtask_base_first_cells_are_the_bins_scores(drawn):
    _, fig = drawn
    panels = [ax for ax in fig.axes if ax.get_title()]
    titles = [ax.get_title().split("\n")[0] for ax in panels]
    assert titles == [f"{run}: {task}" for task in ("niah_multikey", "niah_single") for run in ("long-vanilla", "long-dar-w8-d16")]
    for ax in panels[2:]:  # niah_single: every cell the fixture's 100
        (mesh,) = [c for c in ax.collections if isinstance(c, QuadMesh)]
        assert mesh.get_array().tolist() == [[100.0, 100.0], [100.0, 100.0]]
    for ax in panels[:2]:
        run = ax.get_title().split(":")[0]
        assert ax.get_xlabel() == "context length (tokens)" and ax.get_ylabel().startswith("needle depth")
        assert [t.get_text() for t in ax.get_xticklabels()] == ["128", "256"]
        assert [t.get_text() for t in ax.get_yticklabels()] == ["0-50%", "50-100%"]  # shallow first
        (mesh,) = [c for c in ax.collections if isinstance(c, QuadMesh)]
        cells = mesh.get_array().reshape(2, 2)  # rows: depth bins, columns: lengths
        assert cells.tolist() == [[SCORES[run, 128][0], SCORES[run, 256][0]], [SCORES[run, 128][1], SCORES[run, 256][1]]]
        assert "6 examples" in ax.get_title()
        assert sorted(t.get_text() for t in ax.texts) == sorted(f"{s:.0f}" for L in (128, 256) for s in SCORES[run, L])


def test_a_record_without_needle_scores_is_refused(tmp_path):
    record = _record("long-vanilla", 128)
    del record["needle"]
    (tmp_path / "r.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="no needle-depth scores"):
        summaries.summarize_longctx_needle([tmp_path / "r.json"], tmp_path / "n.csv")
