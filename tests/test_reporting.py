"""Tests for dimattn.reporting on small raw outputs shaped like the other stages' (built here)."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dimattn import reporting

REFERENCE = Path(__file__).resolve().parents[1] / "reference"
D_MODEL = 128
WINDOW = 32
# d_down/d in {1/8, 1/4, 1/2}: the ratios of seed 000 Table 1 (64, 128, 256 of d = 512).
D_DOWNS = (16, 32, 64)
VANILLA_PPL = {"shakespeare": 60.0, "tinystories_val": 12.0}
# Relative perplexities (%) the fixtures are built to give, per (variant, d_down).
REL = {
    ("dar", 64): 99.0,
    ("dar", 32): 100.5,
    ("dar", 16): 103.0,
    ("uniform", 64): 102.0,
    ("uniform", 32): 106.0,
    ("uniform", 16): 112.5,
}
HEAD_DIM = 32
D_PRIMES = (2, 4, 8, 16)
N_LAYERS = 4


def run_name(variant: str, d_down: int | None) -> str:
    if variant == "vanilla":
        return f"tiny_vanilla_d{D_MODEL}"
    if variant == "dar":
        return f"tiny_dar_w{WINDOW}_d{d_down}"
    return f"tiny_uniform_d{d_down}"


def sweep():
    yield "vanilla", None
    for variant in ("dar", "uniform"):
        for d_down in D_DOWNS:
            yield variant, d_down


def write_eval_jsons(root: Path, corpora=tuple(VANILLA_PPL), with_vanilla: bool = True) -> list[Path]:
    paths = []
    for variant, d_down in sweep():
        if variant == "vanilla" and not with_vanilla:
            continue
        for corpus in corpora:
            ppl = VANILLA_PPL[corpus] * REL.get((variant, d_down), 100.0) / 100
            record = {
                "run": run_name(variant, d_down),
                "variant": variant,
                "d_model": D_MODEL,
                "d_down": d_down,
                "window": WINDOW if variant == "dar" else None,
                "corpus": corpus,
                "split": "test",
                "n_tokens": 123456,
                "loss": math.log(ppl),
                "ppl": ppl,
            }
            path = root / "eval" / f"{record['run']}.{corpus}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record))
            paths.append(path)
    return paths


def vanilla_val_loss(step: int) -> float:
    return 4.2 + 3.0 * math.exp(-step / 150)


def write_model_dirs(root: Path, with_vanilla: bool = True) -> list[Path]:
    """config.json + metrics.csv per run; validation every 50 steps, 10 tokens-per-step lines between."""
    dirs = []
    for variant, d_down in sweep():
        if variant == "vanilla" and not with_vanilla:
            continue
        run = root / "models" / run_name(variant, d_down)
        run.mkdir(parents=True)
        config = {
            "model_type": "dimattn",
            "attention": variant,
            "window": 128 if variant != "dar" else WINDOW,  # the config default is kept for every variant
            "d_down": d_down,
            "hidden_size": D_MODEL,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
        }
        (run / "config.json").write_text(json.dumps(config))
        final = REL.get((variant, d_down), 100.0) / 100
        lines = ["step,tokens,lr,train_loss,val_loss"]
        for step in range(0, 501, 10):
            # Early gap above Vanilla that narrows towards the final relative perplexity.
            gap = math.log(final) + 0.08 * math.exp(-step / 120) * (variant != "vanilla")
            val = vanilla_val_loss(step) + gap
            # The vanilla run skips its step-450 evaluation: that step has no baseline.
            evaluated = step % 50 == 0 and not (variant == "vanilla" and step == 450)
            lines.append(f"{step},{step * 8192},0.0006,{val + 0.05:.6f},{f'{val:.6f}' if evaluated else ''}")
        (run / "metrics.csv").write_text("\n".join(lines) + "\n")
        dirs.append(run)
    return dirs


def write_lm_eval_jsons(root: Path) -> list[Path]:
    paths = []
    for variant, d_down in sweep():
        rel = REL.get((variant, d_down), 100.0) / 100
        record = {
            "run": run_name(variant, d_down),
            "variant": variant,
            "d_model": D_MODEL,
            "d_down": d_down,
            "window": WINDOW if variant == "dar" else None,
            "results": {
                "wikitext": {
                    "alias": "wikitext",
                    "word_perplexity,none": 310.0 * rel,
                    "word_perplexity_stderr,none": "N/A",
                    "byte_perplexity,none": 2.9 * rel,
                    "byte_perplexity_stderr,none": "N/A",
                    "bits_per_byte,none": math.log2(2.9 * rel),
                    "bits_per_byte_stderr,none": "N/A",
                },
                "lambada_openai": {
                    "alias": "lambada_openai",
                    "perplexity,none": 900.0 * rel,
                    "perplexity_stderr,none": 40.0,
                    "acc,none": 0.12 / rel,
                    "acc_stderr,none": 0.0045,
                },
            },
        }
        path = root / "lm_eval" / f"{record['run']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
        paths.append(path)
    return paths


FIDELITY_SCALE = {"random": (2.5, 0.02), "pca": (0.9, 0.004), "dimpo": (0.35, 0.0015), "kl": (0.25, 0.0011)}


def write_fidelity_csvs(root: Path, setting: str | None = None) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for objective, (kl0, mse0) in FIDELITY_SCALE.items():
        for d_prime in D_PRIMES:
            shrink = (HEAD_DIM / d_prime) ** (0.1 if objective == "random" else 0.35)
            rows = [
                {
                    "model": "tiny_vanilla_d128",
                    "objective": objective,
                    "d_prime": d_prime,
                    "head_dim": HEAD_DIM,
                    "layer": layer,
                    "kl": kl0 * shrink * (1 + 0.1 * layer + 0.02 * rng.standard_normal()),
                    "mse": mse0 * shrink * (1 + 0.1 * layer),
                }
                for layer in range(N_LAYERS)
            ]
            frame = pd.DataFrame(rows)
            if setting is not None and objective == "dimpo":
                frame["setting"] = setting
            path = root / "dimpo" / f"{objective}_d{d_prime}.csv"
            path.parent.mkdir(parents=True, exist_ok=True)
            frame.to_csv(path, index=False)
            paths.append(path)
    return paths


def write_summaries(root: Path) -> Path:
    summary = root / "summary"
    reporting.summarize_perplexity(write_eval_jsons(root), summary / reporting.SUMMARY_FILES["perplexity"])
    reporting.summarize_trajectory(write_model_dirs(root), summary / reporting.SUMMARY_FILES["trajectory"])
    reporting.summarize_lm_eval(write_lm_eval_jsons(root), summary / reporting.SUMMARY_FILES["lm_eval"])
    reporting.summarize_fidelity(write_fidelity_csvs(root), summary / reporting.SUMMARY_FILES["fidelity"])
    return summary


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    summary = write_summaries(root)
    written = reporting.render_all(summary, REFERENCE, root / "tables", root / "figures")
    return root, written


def table_line(tex: str, *needles: str) -> str:
    """The one body row of a table that contains every needle."""
    lines = [line for line in tex.splitlines() if line.endswith(r"\\") and all(n in line for n in needles)]
    assert len(lines) == 1, (needles, lines)
    return lines[0]


# ----------------------------------------------------------------------------- summaries


def test_summarize_perplexity_relative_to_vanilla(tmp_path):
    out = tmp_path / "ppl.csv"
    df = reporting.summarize_perplexity(write_eval_jsons(tmp_path), out)
    back = pd.read_csv(out)
    assert list(back.columns[: len(reporting.PERPLEXITY_COLUMNS)]) == reporting.PERPLEXITY_COLUMNS
    assert len(back) == 7 * len(VANILLA_PPL)
    for corpus in VANILLA_PPL:
        rows = df[df["corpus"] == corpus].set_index("run")
        assert rows.loc[run_name("vanilla", None), "rel_to_vanilla"] == pytest.approx(100.0)
        for (variant, d_down), rel in REL.items():
            assert rows.loc[run_name(variant, d_down), "rel_to_vanilla"] == pytest.approx(rel)
    # Vanilla first, then DAR widest first; vanilla has no d_down and no window.
    first = back[back["corpus"] == "shakespeare"]
    assert list(first["variant"][:4]) == ["vanilla", "dar", "dar", "dar"]
    assert list(first["d_down"][1:4]) == [64, 32, 16]
    assert pd.isna(first["d_down"].iloc[0]) and pd.isna(first["window"].iloc[0])
    assert "32.0" not in out.read_text()  # integers stay integers


def test_summarize_perplexity_missing_vanilla_names_corpus(tmp_path):
    paths = write_eval_jsons(tmp_path / "a", corpora=("shakespeare",))
    paths += write_eval_jsons(tmp_path / "b", corpora=("tinystories_val",), with_vanilla=False)
    with pytest.raises(ValueError, match="tinystories_val"):
        reporting.summarize_perplexity(paths, tmp_path / "ppl.csv")
    assert not (tmp_path / "ppl.csv").exists()


def test_summarize_trajectory_relative_at_same_step(tmp_path):
    out = tmp_path / "traj.csv"
    df = reporting.summarize_trajectory(write_model_dirs(tmp_path), out)
    assert list(pd.read_csv(out).columns) == reporting.TRAJECTORY_COLUMNS
    vanilla = df[df["variant"] == "vanilla"]
    assert set(vanilla["step"]) == set(range(0, 501, 50)) - {450}
    assert np.allclose(vanilla["rel_to_vanilla"], 100.0)
    assert np.allclose(df["val_ppl"], np.exp(df["val_loss"]))
    dar = df[df["run"] == run_name("dar", 32)].set_index("step")
    assert dar.loc[0, "rel_to_vanilla"] == pytest.approx(100.5 * math.exp(0.08))
    assert dar.loc[500, "rel_to_vanilla"] == pytest.approx(100.5 * math.exp(0.08 * math.exp(-500 / 120)))
    # Vanilla did not evaluate step 450: no baseline, so no relative value rather than a guess.
    assert pd.isna(dar.loc[450, "rel_to_vanilla"])
    # Window is only meaningful for DAR, although every config carries one.
    assert df.loc[df["variant"] == "uniform", "window"].isna().all()
    assert (df.loc[df["variant"] == "dar", "window"] == WINDOW).all()


def test_summarize_trajectory_missing_vanilla(tmp_path):
    with pytest.raises(ValueError, match="vanilla"):
        reporting.summarize_trajectory(write_model_dirs(tmp_path, with_vanilla=False), tmp_path / "t.csv")


def test_summarize_lm_eval_long_format(tmp_path):
    out = tmp_path / "lm.csv"
    df = reporting.summarize_lm_eval(write_lm_eval_jsons(tmp_path), out)
    assert list(pd.read_csv(out).columns) == reporting.LM_EVAL_COLUMNS
    assert set(df["metric"]) == {"word_perplexity", "byte_perplexity", "bits_per_byte", "perplexity", "acc"}
    assert len(df) == 7 * 5
    acc = df[(df["run"] == run_name("vanilla", None)) & (df["metric"] == "acc")].iloc[0]
    assert acc["task"] == "lambada_openai" and acc["value"] == pytest.approx(0.12) and acc["stderr"] == 0.0045
    assert df.loc[df["task"] == "wikitext", "stderr"].isna().all()  # "N/A" is not a number


def test_summarize_lm_eval_keeps_non_default_filter(tmp_path):
    record = {
        "run": "r",
        "variant": "vanilla",
        "d_model": 64,
        "d_down": None,
        "window": None,
        "results": {
            "gsm8k": {
                "alias": "gsm8k",
                "exact_match,flexible-extract": 0.02,
                "exact_match_stderr,flexible-extract": 0.004,
                "sample_len": 1319,  # lm-eval writes the sample count beside the metrics
            }
        },
    }
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record))
    df = reporting.summarize_lm_eval([path], tmp_path / "lm.csv")
    assert df[["metric", "value", "stderr"]].values.tolist() == [["exact_match,flexible-extract", 0.02, 0.004]]


def test_summarize_fidelity_concatenates_and_checks_columns(tmp_path):
    paths = write_fidelity_csvs(tmp_path)
    df = reporting.summarize_fidelity(paths, tmp_path / "fid.csv")
    assert list(df.columns) == reporting.FIDELITY_COLUMNS
    assert len(df) == len(FIDELITY_SCALE) * len(D_PRIMES) * N_LAYERS
    assert list(dict.fromkeys(df["objective"])) == ["random", "pca", "dimpo", "kl"]  # the paper's order
    bad = tmp_path / "bad.csv"
    pd.read_csv(paths[0]).drop(columns="mse").to_csv(bad, index=False)
    with pytest.raises(ValueError, match="mse"):
        reporting.summarize_fidelity([bad], tmp_path / "fid2.csv")


# ----------------------------------------------------------------------------- tables


def test_render_all_writes_everything(rendered):
    root, written = rendered
    names = sorted(p.name for p in written)
    assert names == sorted(
        [
            "dar_perplexity.tex",
            "dar_perplexity.png",
            "dar_trajectory.png",
            "lm_eval.tex",
            "dimpo_fidelity.tex",
            "dimpo_fidelity.png",
        ]
    )
    for path in written:
        assert path.exists() and path.stat().st_size > 0
        if path.suffix == ".png":
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000
    # Atomic writes leave no temporary files behind.
    leftovers = [p for d in ("tables", "figures") for p in (root / d).iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_dar_table_shows_paper_beside_reproduced(rendered):
    root, _ = rendered
    tex = (root / "tables" / "dar_perplexity.tex").read_text()
    for needle in (r"\toprule", r"\midrule", r"\bottomrule", "reproduced", "paper"):
        assert needle in tex

    def paper_cells(*needles):
        """Last cell (Rel. paper) of the rows with every needle, one row per corpus."""
        lines = [line for line in tex.splitlines() if line.endswith(r"\\") and all(n in line for n in needles)]
        assert len(lines) == len(VANILLA_PPL), (needles, lines)
        return {line.rstrip(" \\").split("&")[-1].strip() for line in lines}

    # Matched by d_down/d: ours 32/128 is the paper's 128/512.
    assert paper_cells("& DAR &", "& 1/4 &", "& 100.50 &", "& 32 & 128 &") == {"99.61"}
    assert paper_cells("& Uniform &", "& 1/4 &", "& 106.00 &") == {"105.49"}
    assert paper_cells("& DAR &", "& 1/8 &", "& 103.00 &") == {"101.99"}
    assert paper_cells("& DAR &", "& 1/2 &", "& 99.00 &") == {"98.57"}
    assert paper_cells("& Uniform &", "& 1/8 &", "& 112.50 &") == {"111.30"}
    # The paper has no Uniform at d/2: no number is invented.
    assert paper_cells("& Uniform &", "& 1/2 &", "& 102.00 &") == {"--"}
    assert paper_cells("& Vanilla &", "& 100.00 &") == {"100.00"}
    assert table_line(tex, "shakespeare (test) & Vanilla", "& 60.00 &")
    # Table 2's other scales are quoted in the caption.
    assert "100.88" in tex and "97.98" in tex


def test_lm_eval_table(rendered):
    root, _ = rendered
    tex = (root / "tables" / "lm_eval.tex").read_text()
    assert r"\multicolumn{5}{c}{lambada\_openai}" not in tex  # 2 metrics there, 3 under wikitext
    assert r"\multicolumn{2}{c}{lambada\_openai}" in tex and r"\multicolumn{3}{c}{wikitext}" in tex
    row = table_line(tex, r"tiny\_vanilla\_d128")
    assert r"0.1200 {\scriptsize$\pm$0.0045}" in row
    assert row.count("&") == 3 + 5


def test_dimpo_table_matches_paper_by_ratio(rendered):
    root, _ = rendered
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
    fid = pd.read_csv(root / "summary" / "dimpo_fidelity.csv")
    mean = fid[(fid["objective"] == "kl") & (fid["d_prime"] == 16)]["kl"].mean()
    assert table_line(tex, "KL & ours").split("&")[2].strip() == f"{mean:.3g}"


def test_dimpo_table_optional_setting_column(tmp_path):
    summary = tmp_path / "summary"
    reporting.summarize_fidelity(write_fidelity_csvs(tmp_path, setting="k=64,lambda=1"), summary / "dimpo_fidelity.csv")
    tex = reporting.render_dimpo_fidelity_table(
        reporting._read_summary(summary / "dimpo_fidelity.csv"), REFERENCE, tmp_path / "t.tex"
    ).read_text()
    assert "DimPO ($k{=}64$, $\\lambda{=}1$) & ours" in tex
    figure = reporting.render_dimpo(summary, REFERENCE, tmp_path / "tables", tmp_path / "figures")[1]
    assert figure.stat().st_size > 20_000


def test_dar_window_sweep_rows_get_no_paper_number(tmp_path):
    """Table 1 is at one window; a DAR run at another window must not borrow its number."""
    paths = write_eval_jsons(tmp_path, corpora=("shakespeare",))
    record = json.loads(next(p for p in paths if run_name("dar", 32) in p.name).read_text())
    record.update(run="tiny_dar_w0_d32", window=0, ppl=66.0)
    sweep_path = tmp_path / "w0.json"
    sweep_path.write_text(json.dumps(record))
    summary = tmp_path / "summary"
    reporting.summarize_perplexity(paths + [sweep_path], summary / "dar_perplexity.csv")
    reporting.render_dar(summary, REFERENCE, tmp_path / "tables", tmp_path / "figures")
    tex = (tmp_path / "tables" / "dar_perplexity.tex").read_text()
    assert table_line(tex, "& DAR & 0 &", "& 110.00 &").rstrip(" \\").endswith("--")
    assert table_line(tex, "& DAR & 32 & 32 &").rstrip(" \\").endswith("99.61")
    assert "windows other than w = 32" in tex


def test_latex_escaping(tmp_path):
    assert reporting.latex_escape("a_b 50% #1 & $x$ {y} ~^\\") == (
        r"a\_b 50\% \#1 \& \$x\$ \{y\} \textasciitilde{}\textasciicircum{}\textbackslash{}"
    )
    assert reporting.latex_escape(reporting.Tex(r"$\lambda$")) == r"$\lambda$"
    # A corpus and run names with specials reach the table escaped.
    paths = write_eval_jsons(tmp_path, corpora=("shakespeare",))
    for path in paths:
        record = json.loads(path.read_text())
        record["corpus"] = "web_text 10%"
        path.write_text(json.dumps(record))
    summary = tmp_path / "summary"
    reporting.summarize_perplexity(paths, summary / "dar_perplexity.csv")
    reporting.render_dar(summary, REFERENCE, tmp_path / "tables", tmp_path / "figures")
    tex = (tmp_path / "tables" / "dar_perplexity.tex").read_text()
    assert r"web\_text 10\%" in tex
    body = [line for line in tex.splitlines() if line.endswith(r"\\")]
    assert not any(re.search(r"(?<!\\)[_%]", line) for line in body)


def test_small_numbers_formatted_as_powers_of_ten():
    assert reporting._fmt_sig(0.000123) == r"$1.23\times10^{-4}$"
    assert reporting._fmt_sig(0.0123) == "0.0123"
    assert reporting._fmt_sig(12.345) == "12.3"
    assert reporting._fmt_sig(float("nan")) == "--"


# ----------------------------------------------------------------------------- errors


def test_render_all_empty_dir_says_what_to_run(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        reporting.render_all(tmp_path, REFERENCE, tmp_path / "tables", tmp_path / "figures")
    message = str(err.value)
    for name in reporting.SUMMARY_FILES.values():
        assert name in message
    assert "run the workflow" in message
    assert not (tmp_path / "tables").exists()


def test_render_all_renders_only_present_groups(tmp_path):
    summary = tmp_path / "summary"
    reporting.summarize_fidelity(write_fidelity_csvs(tmp_path), summary / "dimpo_fidelity.csv")
    written = reporting.render_all(summary, REFERENCE, tmp_path / "tables", tmp_path / "figures")
    assert sorted(p.name for p in written) == ["dimpo_fidelity.png", "dimpo_fidelity.tex"]
    with pytest.raises(FileNotFoundError, match="dar_perplexity.csv"):
        reporting.render_dar(summary, REFERENCE, tmp_path / "tables", tmp_path / "figures")


def test_failed_write_keeps_previous_file(tmp_path):
    target = tmp_path / "table.tex"
    target.write_text("old")

    def crash(tmp):
        Path(tmp).write_text("half a tab")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        reporting._atomic_write(target, crash)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["table.tex"]
