"""docs/findings.md's verdicts (dimattn.reporting.findings) against hand-built rows, every claim
of reference/claims.yaml against the summaries' columns, and the committed page against what the
findings rule writes from published/."""

from pathlib import Path

import pandas as pd
import pytest

from dimattn.reporting import findings, summaries

REPO = Path(__file__).resolve().parents[2]
CLAIM = {"id": "t", "seed": "000", "where": "Table 1", "claim": "A beats B", "summary": "dar_perplexity",
         "value": "ppl", "better": "lower", "a": {"attention": "dar"}, "b": {"attention": "uniform"},
         "match": ["corpus"]}


def rows(spec: dict[tuple[str, str], list[float]]) -> pd.DataFrame:
    """{(attention, corpus): [value of seed 0, seed 1, ...]} as summary rows (strings, as read)."""
    out = [{"attention": att, "corpus": corpus, "seed": str(s), "ppl": str(v), "window": ""}
           for (att, corpus), values in spec.items() for s, v in enumerate(values)]
    return pd.DataFrame(out)


@pytest.mark.parametrize("spec, kind, expected", [
    ({("dar", "x"): [10, 11], ("uniform", "x"): [12, 13]}, "better", findings.HOLDS),
    ({("dar", "x"): [10, 14], ("uniform", "x"): [12, 13]}, "better", findings.WITHIN),  # mean favours, one seed not
    ({("dar", "x"): [10], ("uniform", "x"): [12]}, "better", findings.WITHIN),  # one seed: no spread to beat
    ({("dar", "x"): [13, 14], ("uniform", "x"): [12, 13]}, "better", findings.NOT_HELD),
    ({("dar", "x"): [10, 11], ("uniform", "x"): [12, 13], ("dar", "y"): [9, 9], ("uniform", "y"): [8, 8]},
     "better", "holds in 1 of 2 settings"),
    ({("dar", "x"): [10, 14], ("uniform", "x"): [12, 13]}, "equivalent", findings.EQUIVALENT),
    ({("dar", "x"): [10, 11], ("uniform", "x"): [12, 13]}, "equivalent", findings.NOT_EQUIVALENT),
    ({("dar", "x"): [10, 11]}, "better", findings.UNTESTED),  # no B rows
])
def test_the_verdict_follows_the_seeds(spec, kind, expected):
    result = findings.compare(rows(spec), {**CLAIM, "kind": kind})
    assert result["verdict"] == expected


def test_rows_pair_by_seed_and_average_the_rest():
    """Two rows of one seed in a cell (a fit's layers) are one value, their mean."""
    df = rows({("dar", "x"): [10, 20], ("uniform", "x"): [16, 16]})
    df.loc[1, "seed"] = "0"  # both dar rows are seed 0: mean 15 against 16
    result = findings.compare(df, CLAIM)
    (cell,) = result["cells"]
    assert list(cell["a"]) == [15.0] and list(cell["diffs"]) == [1.0]


def test_bounds_and_empty_fields_select_rows():
    df = rows({("dar", "x"): [10, 11], ("uniform", "x"): [12, 13]})
    df["share"] = ["0.5", "1.0", "0.5", "1.0"]
    kept = findings.compare(df, {**CLAIM, "only": {"share": ">0.5", "window": ""}})
    assert [len(c["diffs"]) for c in kept["cells"]] == [1]


def test_a_claim_naming_no_column_is_refused_by_name():
    with pytest.raises(findings.ClaimError, match="claim 't' .*no column 'ppx'"):
        findings.compare(rows({("dar", "x"): [1]}), {**CLAIM, "value": "ppx"})


def test_every_claim_names_columns_its_summary_has():
    claims = findings.load_claims(REPO / "reference" / findings.CLAIMS)
    assert {c["seed"] for c in claims} == {"000", "001", "003"}
    for claim in claims:
        columns = set(summaries.COLUMNS[claim["summary"]]) | {"seed"}
        named = {claim["value"], *claim.get("match", []), *claim.get("only", {}), *claim["a"], *claim["b"]}
        assert named <= columns, (claim["id"], sorted(named - columns))


def test_the_committed_findings_are_what_the_rule_writes():
    page = findings.render(REPO / "published", REPO / "reference")
    assert (REPO / "docs/findings.md").read_text() == page, "run make findings"


def test_a_seed_cut_is_read_on_the_subsets_of_the_seeds_run(tmp_path):
    """dimattn.reporting.sizing: a claim that holds on three seeds holds on each pair; once seed 2
    goes the other way, only the pair without it holds beyond the spread; the job-seconds split by
    replicate."""
    from dimattn.reporting import sizing

    df = rows({("dar", "x"): [10, 10, 12.5], ("uniform", "x"): [12, 12, 13]})
    result = sizing.subset_verdicts(df, CLAIM)
    assert result["seeds"] == ["0", "1", "2"] and result["all"] == findings.HOLDS
    assert result["subsets"] == {("0", "1"): findings.HOLDS, ("0", "2"): findings.HOLDS, ("1", "2"): findings.HOLDS}
    df.loc[2, "ppl"] = "13.5"  # seed 2 now goes the other way: the three-seed verdict is within the spread
    result = sizing.subset_verdicts(df, CLAIM)
    assert result["all"] == findings.WITHIN
    assert result["subsets"][("0", "1")] == findings.HOLDS and result["subsets"][("0", "2")] == findings.WITHIN
    for rule, job, seconds in (("pretrain", "tiny-dar-w32-d16", 10), ("pretrain", "tiny-dar-w32-d16-s2", 7),
                               ("score_projected", "score_tiny-s1_base_default_d0_l0_none_s0", 3)):
        (tmp_path / rule).mkdir(exist_ok=True)
        (tmp_path / rule / f"{job}.tsv").write_text(f"s\th:m:s\n{seconds}\t0:00:{seconds:02d}\n")
    assert sizing.seed_seconds(tmp_path) == {"training": {"0": 10.0, "2": 7.0, "1": 3.0}, "fit": 3.0}
