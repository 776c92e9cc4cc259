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


def cells(line: str) -> list[str]:
    """The cells of a table row, stripped."""
    return [c.strip() for c in line.rstrip(" \\").split("&")]


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
    # No recall runs, window sweep, d_down = d run or seed 001 variant: those outputs are left out.
    assert names == sorted(
        [
            "dar_perplexity.tex",
            "dar_perplexity.png",
            "dar_scales.tex",
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


def test_dar_window_sweep_rows_stay_out_of_table1(tmp_path):
    """Table 1 is at one window; a DAR run at another window goes to the window sweep instead."""
    paths = write_eval_jsons(tmp_path, corpora=("shakespeare",))
    record = json.loads(next(p for p in paths if run_name("dar", 32) in p.name).read_text())
    record.update(run="tiny_dar_w0_d32", window=0, ppl=66.0)
    sweep_path = tmp_path / "w0.json"
    sweep_path.write_text(json.dumps(record))
    summary = tmp_path / "summary"
    reporting.summarize_perplexity(paths + [sweep_path], summary / "dar_perplexity.csv")
    written = reporting.render_dar(summary, REFERENCE, tmp_path / "tables", tmp_path / "figures")
    tex = (tmp_path / "tables" / "dar_perplexity.tex").read_text()
    assert "& 110.00 &" not in tex
    assert table_line(tex, "& DAR & 32 & 32 &").rstrip(" \\").endswith("99.61")
    assert "dar\\_window.tex" in tex
    window = (tmp_path / "tables" / "dar_window.tex").read_text()
    assert cells(table_line(window, "w = 0"))[1] == "110.00"
    assert cells(table_line(window, "w = 32"))[1] == "100.50"
    assert {p.name for p in written} >= {"dar_window.tex", "dar_window.png"}


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


# ----------------------------------------------------------------------------- the full sweep
#
# The shape of the default config: a text scale "tiny" (d = 128) with seed 000's d_down sweep
# (d_down = d is the no-bottleneck control), a window sweep at d_down = 32 and the seed 001
# variants; a second text scale "micro" (d = 64) for Table 2; a recall scale (d = 64 too, on the
# synthetic corpus) with its own sweeps. Nothing below reads run names: only the run fields.

TEXT = "shakespeare"
RECALL = "mqar"
BINS = [(17, 43), (44, 70), (71, 97), (98, 124)]
CHANCE = 1 / 64


def spec(
    scale,
    variant,
    d_model,
    d_down=None,
    window=None,
    dilation=None,
    bottleneck="linear",
    full_every=None,
    layers=None,
    rel=100.0,
    acc=None,
    far=None,
):
    name = f"{scale}-{variant}"
    name += f"-w{window}" if window is not None else ""
    name += f"-r{dilation}" if dilation is not None else ""
    name += f"-d{d_down}" if d_down is not None else ""
    name += f"-{bottleneck}" if bottleneck != "linear" else ""
    name += f"-full{full_every}" if full_every else ""
    name += "-layers" + ".".join(map(str, layers)) if layers else ""
    return {
        "run": name,
        "scale": scale,
        "variant": variant,
        "d_model": d_model,
        "d_down": d_down,
        "window": window,
        "dilation": dilation,
        "bottleneck": bottleneck,
        "full_every": full_every,
        "layers": layers,
        "rel": rel,
        "acc": acc,
        "far": far,
    }


FULL = [
    spec("tiny", "vanilla", 128),
    spec("tiny", "dar", 128, 16, 32, rel=104.0),
    spec("tiny", "dar", 128, 32, 32, rel=99.5),
    spec("tiny", "dar", 128, 64, 32, rel=98.5),
    spec("tiny", "dar", 128, 128, 32, rel=99.0),
    spec("tiny", "uniform", 128, 16, rel=112.0),
    spec("tiny", "uniform", 128, 32, rel=106.5),
    spec("tiny", "uniform", 128, 64, rel=102.5),
    *[spec("tiny", "dar", 128, 32, w, rel=r) for w, r in ((0, 107.0), (1, 101.5), (4, 100.2), (16, 99.8), (64, 99.4))],
    spec("tiny", "swa", 128, window=32, rel=103.25),
    spec("tiny", "dilated", 128, window=32, dilation=4, rel=101.75),
    spec("tiny", "swa", 128, window=32, full_every=2, rel=100.75),
    spec("tiny", "dar", 128, 32, 32, bottleneck="sigmoid", rel=99.75),
    spec("tiny", "dar", 128, 32, 32, layers=[2, 3], rel=99.25),
    spec("micro", "vanilla", 64),
    spec("micro", "dar", 64, 16, 32, rel=100.25),
    spec("recall", "vanilla", 64, acc=0.9),
    *[spec("recall", "dar", 64, d, 16, acc=a) for d, a in ((2, 0.12), (4, 0.35), (8, 0.7), (16, 0.85))],
    *[spec("recall", "uniform", 64, d, acc=a) for d, a in ((2, 0.05), (4, 0.2), (8, 0.5))],
    *[spec("recall", "dar", 64, 8, w, acc=a) for w, a in ((0, 0.45), (1, 0.6), (4, 0.65))],
    spec("recall", "swa", 64, window=16, acc=0.25, far=0.0),
    spec("recall", "dilated", 64, window=16, dilation=4, acc=0.4),
    spec("recall", "swa", 64, window=16, full_every=2, acc=0.8),
]
VANILLA_TEXT_PPL = {128: 200.0, 64: 260.0}
DATASETS = {s["run"]: RECALL if s["scale"] == "recall" else TEXT for s in FULL}
FULL_BY_RUN = {s["run"]: s for s in FULL}


def metadata(s):
    """What dimattn.evaluation.run_metadata writes for such a run."""
    bottlenecked = s["variant"] in ("dar", "uniform")
    patterned = s["variant"] != "vanilla"
    return {
        "run": s["run"],
        "variant": s["variant"],
        "d_model": s["d_model"],
        "d_down": s["d_down"] if bottlenecked else None,
        "window": s["window"] if s["variant"] in ("dar", "swa", "dilated") else None,
        "dilation": s["dilation"] if s["variant"] == "dilated" else None,
        "bottleneck": s["bottleneck"] if bottlenecked else None,
        "full_every": s["full_every"] if patterned else None,
        "layers": ".".join(map(str, s["layers"])) if s["layers"] and patterned else None,
    }


def bin_accuracies(s):
    """Near bins above the overall accuracy, far ones below; the far value when given."""
    acc = s["acc"]
    near = min(1.0, acc + 0.1)
    far = s["far"] if s["far"] is not None else max(0.0, acc - 0.1)
    return [near, acc, acc, far]


def write_full(root: Path) -> dict[str, list[Path]]:
    out = {"ppl": [], "recall": [], "models": [], "lm": []}
    for s in FULL:
        meta = metadata(s)
        run_dir = root / "eval" / s["run"]
        run_dir.mkdir(parents=True)
        if s["scale"] == "recall":
            ppl = 3.0 * (1.5 - s["acc"])
            rec = {
                **meta,
                "corpus": RECALL,
                "split": "test",
                "accuracy": s["acc"],
                "n_queries": 4096,
                "by_distance": [
                    {"min_distance": lo, "max_distance": hi, "accuracy": a, "n": 1024}
                    for (lo, hi), a in zip(BINS, bin_accuracies(s))
                ],
                "chance": CHANCE,
            }
            (run_dir / f"recall_{RECALL}.json").write_text(json.dumps(rec))
            out["recall"].append(run_dir / f"recall_{RECALL}.json")
            corpus = RECALL
        else:
            ppl = VANILLA_TEXT_PPL[s["d_model"]] * s["rel"] / 100
            corpus = TEXT
            # Downstream: accuracy follows the bottleneck like seed 000 Table 4; bits per byte the perplexity.
            ratio = (s["d_down"] or s["d_model"]) / s["d_model"]
            acc = 0.25 * {1: 1.0, 0.5: 1.02, 0.25: 1.04, 0.125: 0.9}.get(ratio, 1.0)
            lm = {
                **meta,
                "results": {
                    "dimattn_next_line": {"acc,none": acc, "acc_stderr,none": 0.02},
                    "dimattn_heldout": {
                        "bits_per_byte,none": 2.5 * s["rel"] / 100,
                        "bits_per_byte_stderr,none": "N/A",
                        "word_perplexity,none": 900.0,
                    },
                },
            }
            (run_dir / "lm_eval.json").write_text(json.dumps(lm))
            out["lm"].append(run_dir / "lm_eval.json")
        record = {**meta, "corpus": corpus, "split": "test", "n_tokens": 1000, "loss": math.log(ppl), "ppl": ppl}
        (run_dir / f"perplexity_{corpus}.json").write_text(json.dumps(record))
        out["ppl"].append(run_dir / f"perplexity_{corpus}.json")

        model = root / "models" / s["run"]
        model.mkdir(parents=True)
        config = {
            "attention": s["variant"],
            "hidden_size": s["d_model"],
            "d_down": s["d_down"],
            "window": s["window"] if s["window"] is not None else 128,
            "dilation": s["dilation"] or 4,
            "bottleneck_activation": s["bottleneck"],
            "full_attention_every": s["full_every"],
            "attention_layers": s["layers"],
            "num_hidden_layers": 4,
        }
        (model / "config.json").write_text(json.dumps(config))
        final = math.log(s["rel"] / 100) if s["scale"] != "recall" else 0.5 - s["acc"] / 2
        base = 5.0 if s["scale"] != "recall" else 2.0
        lines = ["step,tokens,lr,train_loss,val_loss"]
        for step in range(0, 201, 25):
            gap = 0.0 if s["variant"] == "vanilla" else final + 0.05 * math.exp(-step / 60)
            lines.append(f"{step},{step * 2048},0.001,{base + 1:.4f},{base + math.exp(-step / 80) + gap:.6f}")
        (model / "metrics.csv").write_text("\n".join(lines) + "\n")
        out["models"].append(model)
    return out


def write_full_summaries(root: Path, raw=None) -> Path:
    raw = raw or write_full(root)
    summary = root / "summary"
    reporting.summarize_perplexity(raw["ppl"], summary / "dar_perplexity.csv", synthetic=[RECALL])
    reporting.summarize_trajectory(raw["models"], summary / "dar_trajectory.csv", datasets=DATASETS)
    reporting.summarize_lm_eval(raw["lm"], summary / "lm_eval.csv")
    reporting.summarize_recall(raw["recall"], summary / "recall.csv")
    return summary


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    root = tmp_path_factory.mktemp("full")
    raw = write_full(root)
    summary = write_full_summaries(root, raw)
    written = reporting.render_dar(summary, REFERENCE, root / "tables", root / "figures")
    return root, raw, written


def check_tabulars(tex: str) -> None:
    """Every body row of every tabular has as many cells as its column spec (multicolumns counted)."""
    assert tex.count("{") - tex.count(r"\{") == tex.count("}") - tex.count(r"\}")
    blocks = re.findall(r"\\begin\{tabular\}\{([^}]*)\}(.*?)\\end\{tabular\}", tex, re.S)
    assert blocks, "no tabular"
    for spec_, body in blocks:
        n = len(re.findall(r"[lrc]", spec_))
        for line in body.splitlines():
            if not line.rstrip().endswith(r"\\"):
                continue
            spans = sum(int(k) - 1 for k in re.findall(r"\\multicolumn\{(\d+)\}", line))
            amps = len(re.findall(r"(?<!\\)&", line))
            assert amps + 1 + spans == n, (spec_, line)


def test_full_writes_every_dar_output(full):
    root, _, written = full
    assert sorted(p.name for p in written) == sorted(reporting.DAR_OUTPUTS)
    for path in written:
        if path.suffix == ".png":
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000, path
        else:
            tex = path.read_text()
            assert "Not run in this configuration" not in tex, path
            check_tabulars(tex)
            assert not re.search(r"(?<!\\)[_%#]", "\n".join(l for l in tex.splitlines() if l.endswith(r"\\")))


def test_summarize_perplexity_keeps_every_run_field(full):
    root, _, _ = full
    df = reporting._read_summary(root / "summary" / "dar_perplexity.csv")
    assert list(df.columns) == reporting.PERPLEXITY_COLUMNS + reporting.PERPLEXITY_EXTRA
    rows = df.set_index("run")
    swa, dilated, hybrid = rows.loc["tiny-swa-w32"], rows.loc["tiny-dilated-w32-r4"], rows.loc["tiny-swa-w32-full2"]
    assert swa["window"] == 32 and pd.isna(swa["d_down"]) and pd.isna(swa["bottleneck"]) and pd.isna(swa["dilation"])
    assert dilated["dilation"] == 4 and dilated["window"] == 32
    assert hybrid["full_every"] == 2
    assert rows.loc["tiny-dar-w32-d32-layers2.3", "layers"] == "2.3"  # a string, not the number 2.3
    assert rows.loc["tiny-dar-w32-d32-sigmoid", "bottleneck"] == "sigmoid"
    assert rows.loc["tiny-dar-w32-d32", "bottleneck"] == "linear"
    assert pd.isna(rows.loc["tiny-uniform-d32", "window"])
    assert rows.loc["tiny-swa-w32", "rel_to_vanilla"] == pytest.approx(103.25)
    assert rows.loc["micro-dar-w32-d16", "rel_to_vanilla"] == pytest.approx(100.25)  # against micro's vanilla
    assert (rows.loc[rows["corpus"] == RECALL, "corpus_kind"] == "synthetic").all()
    assert (rows.loc[rows["corpus"] == TEXT, "corpus_kind"] == "text").all()


def test_summarize_perplexity_scale_without_vanilla_has_no_rel(tmp_path):
    """Seed 000 Table 4's d = 2048 scale trains DAR only: no Rel., and no error."""
    paths = write_eval_jsons(tmp_path, corpora=("shakespeare",))
    record = json.loads(paths[1].read_text()) | {"run": "big-dar", "d_model": 2048, "d_down": 2048}
    extra = tmp_path / "big.json"
    extra.write_text(json.dumps(record))
    df = reporting.summarize_perplexity(paths + [extra], tmp_path / "ppl.csv")
    assert pd.isna(df.set_index("run").loc["big-dar", "rel_to_vanilla"])
    tex = reporting.render_dar_perplexity_table(df, REFERENCE, tmp_path / "t.tex").read_text()
    assert "big-dar" not in tex and "2048" not in tex.split(r"\begin{tabular}")[1]
    assert "Widths without a Vanilla run (d = 2048)" in tex


def test_summarize_recall_tidy(full):
    root, raw, _ = full
    df = pd.read_csv(root / "summary" / "recall.csv")
    assert list(df.columns) == reporting.RECALL_COLUMNS
    runs = [s for s in FULL if s["scale"] == "recall"]
    assert len(df) == len(runs) * (1 + len(BINS))
    swa = df[df["run"] == "recall-swa-w16"]
    overall = swa[swa["scope"] == "overall"].iloc[0]
    assert overall["accuracy"] == pytest.approx(0.25) and overall["n"] == 4096 and pd.isna(overall["bin"])
    assert (overall["min_distance"], overall["max_distance"]) == (17, 124)
    dist = swa[swa["scope"] == "distance"].sort_values("bin")
    assert list(dist["bin"]) == [0, 1, 2, 3] and list(dist["min_distance"]) == [lo for lo, _ in BINS]
    assert dist["accuracy"].iloc[-1] == 0.0 and (dist["chance"] == CHANCE).all()
    assert df.loc[df["run"] == "recall-swa-w16", "window"].eq(16).all()
    assert df.loc[df["run"] == "recall-uniform-d8", "window"].isna().all()


def test_summarize_recall_errors(tmp_path):
    good = write_full(tmp_path)["recall"][0]
    record = json.loads(good.read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({k: v for k, v in record.items() if k != "chance"}))
    with pytest.raises(ValueError, match="chance"):
        reporting.summarize_recall([bad], tmp_path / "r.csv")
    bad.write_text(json.dumps(record | {"by_distance": [{"min_distance": 1, "max_distance": 2, "n": 3}]}))
    with pytest.raises(ValueError, match=r"by_distance\[0\].*accuracy"):
        reporting.summarize_recall([bad], tmp_path / "r.csv")
    with pytest.raises(ValueError, match="appears twice"):
        reporting.summarize_recall([good, good], tmp_path / "r.csv")
    bad.write_text(json.dumps(record | {"variant": "dar", "d_down": None, "window": 16}))
    with pytest.raises(ValueError, match=r"lacks \['d_down'\]"):
        reporting.summarize_recall([bad], tmp_path / "r.csv")
    empty = dict(record, by_distance=[{"min_distance": 1, "max_distance": 2, "accuracy": None, "n": 0}])
    bad.write_text(json.dumps(empty))
    df = reporting.summarize_recall([bad], tmp_path / "r.csv")
    assert pd.isna(df.loc[df["scope"] == "distance", "accuracy"]).all()  # a bin without queries
    assert not (tmp_path / "nothing.csv").exists()
    with pytest.raises(ValueError, match="no recall JSON"):
        reporting.summarize_recall([], tmp_path / "nothing.csv")


def test_summarize_trajectory_per_dataset(full):
    root, raw, _ = full
    df = reporting._read_summary(root / "summary" / "dar_trajectory.csv")
    assert list(df.columns) == reporting.TRAJECTORY_COLUMNS
    # micro and recall both have d = 64: each run is measured against its own dataset's vanilla.
    assert np.allclose(df.loc[df["variant"] == "vanilla", "rel_to_vanilla"], 100.0)
    last = df[df["step"] == 200].set_index("run")
    assert last.loc["micro-dar-w32-d16", "rel_to_vanilla"] == pytest.approx(
        100.25 * math.exp(0.05 * math.exp(-200 / 60)), rel=1e-5
    )
    assert last.loc["recall-swa-w16", "dataset"] == RECALL and last.loc["tiny-swa-w32", "window"] == 32
    assert last.loc["tiny-dar-w32-d32-layers2.3", "layers"] == "2.3"
    assert last.loc["tiny-swa-w32-full2", "full_every"] == 2
    with pytest.raises(ValueError, match="more than one vanilla"):
        reporting.summarize_trajectory(raw["models"], root / "t.csv")  # without datasets, two d = 64 vanillas


def test_table1_only_plain_runs_at_main_window(full):
    root, _, _ = full
    tex = (root / "tables" / "dar_perplexity.tex").read_text()
    # The d_down sweep at w = 32, with the paper's number at the same ratio; the no-bottleneck control has none.
    assert cells(table_line(tex, "& DAR & 32 & 32 &"))[-2:] == ["99.50", "99.61"]
    assert cells(table_line(tex, "& DAR & 32 & 128 &"))[-2:] == ["99.00", "--"]
    assert cells(table_line(tex, "& Uniform &", "& 1/8 &"))[-2:] == ["112.00", "111.30"]
    body = tex.split(r"\begin{tabular}")[1]
    for absent in ("& DAR & 0 &", "& DAR & 1 &", "& DAR & 64 &", "SWA", "Dilated", "sigmoid", "99.75", "99.25"):
        assert absent not in body
    # Two widths on one corpus: each gets its own labelled group; the recall corpus is not here.
    assert table_line(tex, "shakespeare (test), d = 64 & Vanilla")
    assert "shakespeare (test), d = 128 & Vanilla" in tex
    assert RECALL not in body
    assert "recall.tex" in tex and "baselines.tex" in tex


def test_table2_each_width_beside_paper(full):
    root, _, _ = full
    tex = (root / "tables" / "dar_scales.tex").read_text()
    # Ours d = 64, 128 paired by rank with the paper's 512 (70M), 768 (160M); 410M has no partner.
    assert cells(table_line(tex, "& 64 & 16 & 32 &")) == [
        "shakespeare (test)",
        "64",
        "16",
        "32",
        "260.65",
        "260.00",
        "100.25",
        "pythia-70m",
        "512",
        "128",
        "99.61",
    ]
    assert cells(table_line(tex, "& 128 & 32 & 32 &"))[-5:] == ["99.50", "pythia-160m", "768", "192", "100.88"]
    assert cells(table_line(tex, "pythia-410m"))[1:4] == ["--", "--", "--"]
    assert "i-th smallest" in tex


def test_table3_window_sweep_with_recall(full):
    root, _, _ = full
    tex = (root / "tables" / "dar_window.tex").read_text()
    # Columns: shakespeare d = 128 (d_down = 32), then recall d = 64 (d_down = 8); micro has no sweep.
    assert cells(table_line(tex, "w = 0"))[1:] == ["107.00", "45.0"]
    assert cells(table_line(tex, "w = 16"))[1:] == ["99.80", "70.0"]  # recall's main window is 16
    assert cells(table_line(tex, "w = 32"))[1:] == ["99.50", "--"]
    assert cells(table_line(tex, "w = 64"))[1:] == ["99.40", "--"]
    assert cells(table_line(tex, "Vanilla &"))[1:] == ["100.00", "90.0"]
    assert cells(table_line(tex, "Uniform, same"))[1:] == ["106.50", "50.0"]
    assert cells(table_line(tex, "Chance"))[1:] == ["", "1.6"]
    assert "stays close to Vanilla for w >= 4" in tex  # the paper's finding, quoted
    assert r"d\textsubscript{down} = 8" in tex and r"d\textsubscript{down} = 32" in tex


def test_table4_relative_to_no_bottleneck(full):
    root, _, _ = full
    tex = (root / "tables" / "dar_downstream.tex").read_text()
    # acc is 1.02x / 1.04x / 0.9x the d_down = d run at d/2, d/4, d/8; paper 101.09, 102.19, 98.68.
    half = cells(table_line(tex, "& 1/2 &"))
    assert half[:3] == ["64", "1/2", "1024"] and half[-2:] == ["102.00", "101.09"]
    assert cells(table_line(tex, "& 1/4 &"))[-2:] == ["104.00", "102.19"]
    assert cells(table_line(tex, "& 1/8 &"))[-2:] == ["90.00", "98.68"]
    assert cells(table_line(tex, "& 1 & 2048"))[-2:] == ["100.00", "100.00"]
    # bits_per_byte (lower is better) is shown but not averaged: d/4 has 99.5 % of the reference's.
    assert cells(table_line(tex, "& 1/4 &"))[3] == f"{100 * 99.5 / 99.0:.2f}"
    assert r"$\downarrow$" in tex and "score at d" in tex
    assert "micro" not in tex  # micro has no d_down = d run


def test_baselines_table(full):
    root, _, _ = full
    tex = (root / "tables" / "baselines.tex").read_text()
    row = cells(table_line(tex, "SWA &"))
    assert row == ["SWA", "w=32", "103.25", "w=16", "25.0", "0.0"]
    assert cells(table_line(tex, "SWA + full every 2nd layer"))[1:] == ["w=32", "100.75", "w=16", "80.0", "70.0"]
    assert cells(table_line(tex, "Dilated"))[1:] == ["w=32, r=4", "101.75", "w=16, r=4", "40.0", "30.0"]
    # DAR at the d_down most DAR runs share (32 on text, 8 on recall), at the main window.
    dar = cells(table_line(tex, r"DAR & w=32, d\textsubscript{down}=32"))
    assert dar[2] == "99.50" and dar[3:6] == [r"w=16, d\textsubscript{down}=8", "70.0", "60.0"]
    assert (
        cells(table_line(tex, "DAR, sigmoid bottleneck"))[1:]
        == [r"w=32, d\textsubscript{down}=32", "99.75"] + ["--"] * 3
    )
    assert cells(table_line(tex, "DAR on layers 2, 3 only"))[2] == "99.25"
    assert cells(table_line(tex, "Vanilla &"))[1:] == ["--", "100.00", "--", "90.0", "80.0"]
    assert r"d $\geq$ 98" in tex
    # Seed 001's ordering: Vanilla, SWA, Dilated, hybrid, then DAR.
    order = [tex.index(s) for s in ("\nVanilla &", "\nSWA &", "\nDilated &", "\nSWA + full", "\nDAR &")]
    assert order == sorted(order)


def test_recall_table(full):
    root, _, _ = full
    tex = (root / "tables" / "recall.tex").read_text()
    assert "17--43" in tex and "98--124" in tex
    assert cells(table_line(tex, "Chance &"))[3:] == ["1.6"] * 5
    assert cells(table_line(tex, r"DAR & w=16, d\textsubscript{down}=8")) == [
        "DAR",
        r"w=16, d\textsubscript{down}=8",
        "1/8",
        "70.0",
        "80.0",
        "70.0",
        "70.0",
        "60.0",
    ]
    assert cells(table_line(tex, r"DAR & w=0, d\textsubscript{down}=8"))[3] == "45.0"
    assert cells(table_line(tex, r"Uniform & d\textsubscript{down}=2"))[2:4] == ["1/32", "5.0"]
    assert cells(table_line(tex, "SWA &"))[-1] == "0.0"
    assert "4096 test queries" in tex


def test_full_figures_are_pngs(full):
    root, _, written = full
    for name in ("dar_perplexity.png", "dar_window.png", "recall.png", "dar_trajectory.png"):
        path = root / "figures" / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 30_000, name


def test_trajectory_keeps_table1_runs_only(full):
    root, _, _ = full
    traj = reporting._prepare(reporting._read_summary(root / "summary" / "dar_trajectory.csv"), "trajectory")
    kept = set(reporting._trajectory_runs(traj)["run"])
    assert "tiny-dar-w32-d64" in kept and "tiny-uniform-d16" in kept and "recall-dar-w16-d2" in kept
    assert not kept & {"tiny-dar-w0-d32", "tiny-swa-w32", "tiny-dar-w32-d32-sigmoid", "recall-dar-w0-d8"}


# ----------------------------------------------------------------------------- absent sweeps


def test_rule_outputs_without_their_runs_are_placeholders(rendered, tmp_path):
    """A rule that lists an output whose runs are absent still gets a valid file."""
    root, _ = rendered
    names = ["dar_window.tex", "dar_window.png", "dar_downstream.tex", "baselines.tex"]
    written = reporting.render_dar(root / "summary", REFERENCE, tmp_path / "t", tmp_path / "f", only=names)
    assert sorted(p.name for p in written) == sorted(names)
    for path in written:
        if path.suffix == ".tex":
            tex = path.read_text()
            assert "Not run in this configuration" in tex and r"\label{tab:" in tex
        else:
            assert path.stat().st_size > 5_000
    with pytest.raises(FileNotFoundError, match="recall.csv"):
        reporting.render_dar(root / "summary", REFERENCE, tmp_path / "t", tmp_path / "f", only=["recall.tex"])
    with pytest.raises(ValueError, match="unknown DAR output"):
        reporting.render_dar(root / "summary", REFERENCE, tmp_path / "t", tmp_path / "f", only=["nope.tex"])


def test_recall_only_and_text_only_sweeps(tmp_path):
    """Only a recall scale has a window sweep and variants; no text scale has a d/4 run."""
    raw = write_full(tmp_path)
    keep = [p for p in raw["ppl"] if "recall-" in str(p) or p.parent.name in ("tiny-vanilla", "tiny-dar-w32-d64")]
    summary = tmp_path / "summary"
    reporting.summarize_perplexity(keep, summary / "dar_perplexity.csv", synthetic=[RECALL])
    reporting.summarize_recall(raw["recall"], summary / "recall.csv")
    written = {p.name for p in reporting.render_dar(summary, REFERENCE, tmp_path / "t", tmp_path / "f")}
    assert written == {
        "dar_perplexity.tex",
        "dar_perplexity.png",
        "dar_window.tex",
        "dar_window.png",
        "baselines.tex",
        "recall.tex",
        "recall.png",
    }
    window = (tmp_path / "t" / "dar_window.tex").read_text()
    assert "shakespeare" not in window and cells(table_line(window, "w = 0"))[1:] == ["45.0"]
    baselines = (tmp_path / "t" / "baselines.tex").read_text()
    assert "Rel." not in baselines.split(r"\midrule")[0].split("Attention")[-1]
    check_tabulars(window)
    check_tabulars(baselines)
    # No recall summary at all: recall-dependent outputs are simply not rendered.
    (summary / "recall.csv").unlink()
    written = {p.name for p in reporting.render_dar(summary, REFERENCE, tmp_path / "t2", tmp_path / "f2")}
    assert written == {"dar_perplexity.tex", "dar_perplexity.png"}


def test_old_summaries_without_pattern_columns_still_render(tmp_path):
    """Summaries written before the run fields grew (no dilation, bottleneck, ...) hold plain runs."""
    summary = tmp_path / "summary"
    reporting.summarize_perplexity(write_eval_jsons(tmp_path), summary / "dar_perplexity.csv")
    path = summary / "dar_perplexity.csv"
    pd.read_csv(path).drop(columns=reporting.PATTERN_COLUMNS + ["corpus_kind"]).to_csv(path, index=False)
    written = reporting.render_dar(summary, REFERENCE, tmp_path / "t", tmp_path / "f")
    assert "dar_perplexity.tex" in {p.name for p in written}
    assert "99.61" in (tmp_path / "t" / "dar_perplexity.tex").read_text()


@pytest.mark.parametrize(
    "kind, column, render",
    [
        ("perplexity", "rel_to_vanilla", lambda df, p: reporting.render_dar_perplexity_table(df, REFERENCE, p)),
        ("perplexity", "window", lambda df, p: reporting.render_dar_window_table(df, None, REFERENCE, p)),
        ("recall", "scope", lambda df, p: reporting.render_recall_table(df, p)),
        ("recall", "accuracy", lambda df, p: reporting.render_baselines_table(None, df, REFERENCE, p)),
        ("lm_eval", "metric", lambda df, p: reporting.render_dar_downstream_table(df, REFERENCE, p)),
        ("trajectory", "step", lambda df, p: reporting.render_dar_trajectory_figure(df, p)),
    ],
)
def test_malformed_summary_names_the_column(full, tmp_path, kind, column, render):
    root, _, _ = full
    df = reporting._read_summary(root / "summary" / reporting.SUMMARY_FILES[kind]).drop(columns=column)
    with pytest.raises(ValueError, match=rf"missing column\(s\) \['{column}'\]"):
        render(df, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_render_dar_names_the_malformed_file(full, tmp_path):
    root, _, _ = full
    summary = tmp_path / "summary"
    summary.mkdir()
    pd.read_csv(root / "summary" / "recall.csv").drop(columns="chance").to_csv(summary / "recall.csv", index=False)
    with pytest.raises(ValueError, match=r"recall.csv: missing column\(s\) \['chance'\]"):
        reporting.render_dar(summary, REFERENCE, tmp_path / "t", tmp_path / "f")


def test_summarize_trajectory_needs_no_torch(tmp_path):
    """summarize_trajectory runs in the report conda env, which has no torch."""
    import subprocess
    import sys

    dirs = write_model_dirs(tmp_path)
    code = (
        "import sys\n"
        "class NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'transformers'):\n"
        "            raise ImportError(f'{name} is not in the report environment')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "from pathlib import Path\n"
        "from dimattn import reporting\n"
        f"reporting.summarize_trajectory([Path(p) for p in {[str(d) for d in dirs]!r}], Path({str(tmp_path / 't.csv')!r}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1]
    )
    assert result.returncode == 0, result.stderr[-2000:]
