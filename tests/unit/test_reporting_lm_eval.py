"""dimattn.reporting.lm_eval: the lm-evaluation-harness table."""

from reporting_fixtures import REFERENCE, table_line, write_summaries

from dimattn.reporting import outputs


def test_lm_eval_table(tmp_path):
    summary = write_summaries(tmp_path)
    tex = outputs.render(["tables/lm_eval.tex"], summary, REFERENCE, tmp_path)[0].read_text()
    assert r"\multicolumn{5}{c}{lambada\_openai}" not in tex  # 2 metrics there, 3 under wikitext
    assert r"\multicolumn{2}{c}{lambada\_openai}" in tex and r"\multicolumn{3}{c}{wikitext}" in tex
    row = table_line(tex, r"tiny\_vanilla\_d128")
    assert r"0.1200 {\scriptsize$\pm$0.0045}" in row
    assert row.count("&") == 3 + 5
