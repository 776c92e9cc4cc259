"""dimattn.reporting.dimpo: seed 003 Table 1 (attention fidelity), ours beside the paper's."""

import re

import pandas as pd
import pytest
from reporting_fixtures import (
    REFERENCE,
    is_png,
    summary_path,
    table_line,
    write_fidelity_csvs,
    write_fidelity_summary,
    write_summaries,
)

from dimattn.reporting import outputs, summaries

DIMPO = ["tables/dimpo_fidelity.tex", "figures/dimpo_fidelity.png"]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    root = tmp_path_factory.mktemp("dimpo")
    summary = write_summaries(root)
    outputs.render(DIMPO, summary, REFERENCE, root)
    return root, summary


def test_dimpo_table_matches_paper_by_ratio(rendered):
    root, summary = rendered
    tex = (root / "tables" / "dimpo_fidelity.tex").read_text()
    # Columns widest first: ours d' = 16, 8, 4, 2 of d = 32 are the paper's 64, 32, 16, 8 of d = 128.
    assert re.search(r"d\$'\$ ours \(d = 32\)\}.*\{16\}.*\{8\}.*\{4\}.*\{2\}", tex)
    assert re.search(r"d\$'\$ paper \(d = 128\)\}.*\{64\}.*\{32\}.*\{16\}.*\{8\}", tex)
    kl_paper = table_line(tex, "KL & paper")
    assert kl_paper.split("&")[2:4] == [" 0.26 ", " 0.001 "]  # paper d' = 64, as printed
    random_paper = table_line(tex, "Random & paper")
    assert random_paper.rstrip(" \\").split("&")[-2:] == [" 16.58 ", " 0.112"]  # paper d' = 8
    # Both paper DimPO settings, and paper-only objectives, are there; ours is one unlabelled setting.
    assert "DimPO ($k{=}0$, $\\lambda{=}0$) & paper" in tex
    assert "DimPO ($k{=}64$, $\\lambda{=}1$) & paper" in tex
    assert "DimPO & ours" in tex
    for objective in ("Triplet", "CPO", "SimPO", "ORPO"):
        assert f"{objective} & paper" in tex and f"{objective} & ours" not in tex
    # Our cells are layer means of the fixture.
    fid = pd.read_csv(summary_path(summary, "dimpo_fidelity"))
    mean = fid[(fid["objective"] == "kl") & (fid["d_prime"] == 16)]["kl"].mean()
    assert table_line(tex, "KL & ours").split("&")[2].strip() == f"{mean:.3g}"


def test_dimpo_figure_is_a_png(rendered):
    root, _ = rendered
    assert is_png(root / "figures" / "dimpo_fidelity.png")


def test_dimpo_figure_has_kl_mse_and_the_top_k_share_beside_the_paper(rendered, tmp_path, monkeypatch):
    """Our row: KL, MSE and the top-k share, a line per objective through its layer means (d'/d
    on x); the paper's row: KL and MSE, its third panel hidden (it reports no top-k share)."""
    from matplotlib.figure import Figure

    from dimattn.reporting import dimpo

    _, summary = rendered
    saved, savefig = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), savefig(fig, *a, **k)))
    fid = summaries.read(summary_path(summary, "dimpo_fidelity"), "dimpo_fidelity")
    dimpo.figure({"dimpo_fidelity": fid}, REFERENCE, tmp_path / "f.png")
    axes = saved[0].axes
    assert [ax.get_title().split("\n")[0] for ax in axes[:3]] == [
        "KL divergence of attention weights", "MSE of attention outputs",
        "Top-k keys kept (k = 4, 1/64 of the keys; higher is better)"]
    assert axes[3].get_title().startswith("KL divergence") and "paper" in axes[3].get_title()
    assert not axes[5].get_visible()
    table1 = fid[(fid["study"] == "table1") & (fid["setting"] == "default")]
    for objective, label in (("kl", "KL"), ("dimpo", "DimPO"), ("pca", "PCA")):
        want = table1[table1["objective"] == objective].groupby("d_prime")["topk_recall"].mean()
        (line,) = [ln for ln in axes[2].get_lines() if ln.get_label() == label]
        x, y = line.get_data()
        assert list(x) == pytest.approx([d / 32 for d in sorted(want.index)])
        assert list(y) == pytest.approx(list(want.sort_index()))


def test_dimpo_table_optional_setting_column(tmp_path):
    summary = tmp_path / "summary"
    path = summary_path(summary, "dimpo_fidelity")
    summaries.summarize_fidelity(write_fidelity_csvs(tmp_path, setting="k=64,lam=1"), path)
    table, figure = outputs.render(DIMPO, summary, REFERENCE, tmp_path)
    assert "DimPO ($k{=}64$, $\\lambda{=}1$) & ours" in table.read_text()
    assert is_png(figure)


# ---- the studies of dimpo.ablations ----------------------------------------------------------------

STUDY_OUTPUTS = ["tables/dimpo_quirks.tex", "tables/dimpo_ablation.tex", "figures/dimpo_pairs.png"]


@pytest.fixture(scope="module")
def studies(tmp_path_factory):
    root = tmp_path_factory.mktemp("studies")
    summary = root / "summary"
    write_fidelity_summary(root, summary, seeds=(0, 1, 2))
    written = outputs.render(DIMPO + STUDY_OUTPUTS, summary, REFERENCE, root)
    return root, summary, {p.name: p for p in written}


def test_table1_shows_only_its_own_study(studies):
    """Ablation fits (DimPO at other settings) stay out of Table 1."""
    _, _, written = studies
    tex = written["dimpo_fidelity.tex"].read_text()
    assert "DimPO & ours" in tex and "preset" not in tex and "k{=}64$, $\\lambda{=}2" not in tex


def test_quirks_table_rows_follow_the_config_with_both_scales(studies):
    _, summary, written = studies
    tex = written["dimpo_quirks.tex"].read_text()
    rows = [line for line in tex.splitlines() if line.startswith("preset")]
    assert [r.split("&")[0].strip() for r in rows] == [
        "preset = authors", "preset = authors, causal = true", "preset = ours"]
    fid = pd.read_csv(summary_path(summary, "dimpo_fidelity"))
    fit = fid[(fid["study"] == "quirks") & (fid["setting"] == "preset=ours")]
    per_seed = fit.groupby("seed")[["kl", "mse", "kl_inference"]].mean()
    kl, mse, kl_inf = (cell.strip() for cell in rows[2].rstrip(" \\").split("&")[1:])
    # Mean over layers, then over seeds, and the seeds' [min, max] beside.
    assert kl.startswith(f"{per_seed['kl'].mean():.3g}") and f"[{per_seed['kl'].min():.3g}" in kl
    assert kl_inf.startswith(f"{per_seed['kl_inference'].mean():.3g}")
    assert "DimPO, $d'{=}4$" in tex and "minimum and maximum" in tex


def test_ablation_table_puts_table6_kl_beside_ours(studies):
    _, summary, written = studies
    tex = written["dimpo_ablation.tex"].read_text()
    fid = pd.read_csv(summary_path(summary, "dimpo_fidelity"))
    k0 = table_line(tex, "DimPO ($k{=}0$, $\\lambda{=}0$)")
    ours = fid[(fid["study"] == "table6") & (fid["setting"] == "k=0,lam=0")].groupby("seed")["kl"].mean().mean()
    cells = [c.strip() for c in k0.rstrip(" \\").split("&")]
    # Table 6, as printed: KL and RULER 4k of Llama-3.1-8B and Qwen3-4B
    assert cells[1].startswith(f"{ours:.3g}") and cells[2:] == ["0.74", "0.73", "35.6", "63.4"]
    assert [c.strip() for c in table_line(tex, "DimPO ($k{=}64$, $\\lambda{=}2$)").rstrip(" \\").split("&")][2:4] == [
        "0.56", "0.54"]
    # Table 1's KL fit at the same d' is the KL row, with the paper's KL beside; no paper row for k = 64, lambda = 1.5.
    assert [c.strip() for c in table_line(tex, "KL &").rstrip(" \\").split("&")][2:] == ["0.26", "0.27", "38.9", "50.2"]
    assert r"$d'{=}16$" in tex


def test_pairs_figure_has_a_panel_per_study(studies):
    _, _, written = studies
    assert is_png(written["dimpo_pairs.png"])


def test_pairs_figure_names_a_setting_without_its_x(tmp_path):
    summary = tmp_path / "summary"
    csvs = write_fidelity_csvs(tmp_path, setting="pair_mode=all", objectives=["dimpo"], d_primes=[4])
    summaries.summarize_fidelity(csvs, summary_path(summary, "dimpo_fidelity"),
                                 studies={str(p): [["figure4a", 0]] for p in csvs})
    with pytest.raises(ValueError, match=r"figure4a: setting\(s\) \['pair_mode=all'\] do not set num_sampled_keys"):
        outputs.render(["figures/dimpo_pairs.png"], summary, REFERENCE, tmp_path)


def test_ablation_table_adds_the_projected_models_long_context_average(tmp_path):
    """Table 6's RULER column at our scale: the recall probe of each (k, lambda) projected on the
    last l layers (dimpo.downstream.studies), beside the KL."""
    import json

    summary = tmp_path / "summary"
    write_fidelity_summary(tmp_path, summary, seeds=(0, 1))
    jsons, studies = [], {}
    for setting, acc in (("k=0,lam=0", 0.40), ("k=64,lam=1", 0.60)):
        for seed in (0, 1):
            record = {"model": "tiny-vanilla", "objective": "dimpo", "setting": setting, "d_prime": 16,
                      "num_projected": 2, "n_layers": 4, "scale": "d_prime", "kv": "none", "kv_method": "none",
                      "kv_level": 0, "seed": seed, "perplexity": {}, "results": {}, "num_fewshot": {},
                      "recall": {"recall": {"accuracy": acc + 0.02 * seed, "n_queries": 10, "by_distance": []}}}
            path = tmp_path / f"{setting}-{seed}.json"
            path.write_text(json.dumps(record))
            jsons.append(path)
            studies[str(path)] = ["table6"]
    summaries.summarize_downstream(jsons, summary_path(summary, "dimpo_downstream"), studies=studies)
    (table,) = outputs.render(["tables/dimpo_ablation.tex"], summary, REFERENCE, tmp_path)
    tex = table.read_text()
    assert r"ours: tiny-vanilla, recall avg (\%), $l{=}2$" in tex
    k0 = [c.strip() for c in table_line(tex, "DimPO ($k{=}0$, $\\lambda{=}0$)").rstrip(" \\").split("&")]
    assert r"41.0 {\scriptsize[40.0, 42.0]}" in k0
    k64 = [c.strip() for c in table_line(tex, "DimPO ($k{=}64$, $\\lambda{=}1$)").rstrip(" \\").split("&")]
    assert r"61.0 {\scriptsize[60.0, 62.0]}" in k64 and k64[-2:] == ["52.4", "65.9"]  # the paper's RULER 4k


def test_a_k_share_row_of_table6_meets_the_papers_k_it_stands_for():
    """k_share 1/64 of our lists is the paper's k = 64 of its 4,096 keys: that row of Table 6."""
    from dimattn.reporting.dimpo import _parse_setting

    assert _parse_setting("k_share=0.015625,lam=1") == (64, 1.0)
    assert _parse_setting("k_share=0.0078125,lam=0.5") == (32, 0.5)
    assert _parse_setting("k=64,lam=2") == (64, 2.0) and _parse_setting("k=0,lam=0") == (0, 0.0)
    assert _parse_setting("k_share=0.015625") is None and _parse_setting("default") is None
