"""dimattn.evaluation.latency (seed 003, Appendix H): the settings it times, and what it reports beside the
times (cache bytes, ratios), on a random tiny Llama with GQA; the summary and table of the
workflow's latency rows. Times themselves are never asserted (noisy machines): only their form."""

import json
import math

import pytest
import torch
from reporting_fixtures import REFERENCE, summary_path, table_line
from transformers import LlamaConfig, LlamaForCausalLM

from dimattn.model.affine import Affine
from dimattn.evaluation.latency import measure
from dimattn.reporting import outputs, summaries

D, D_PRIME, PROMPT, NEW = 16, 4, 40, 3


@pytest.fixture(scope="module")
def rows():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    g = torch.Generator().manual_seed(1)
    projections = {i: Affine(torch.randn(D_PRIME, D, generator=g), torch.zeros(D_PRIME)) for i in range(2)}
    return {r["setting"]: r for r in measure(model.eval(), projections, PROMPT, NEW, repeats=2)}


def test_settings_are_the_base_snapkv_and_the_projection(rows):
    assert list(rows) == ["base", "snapkv", "dimpo l=1", "dimpo l=2", "dimpo l=2 + snapkv"]
    assert [rows[s]["num_projected"] for s in rows] == [0, 0, 1, 2, 2]
    assert [rows[s]["kv"] for s in rows] == ["none", "snapkv", "none", "none", "snapkv"]


def test_cache_bytes_follow_the_projection_and_the_budget(rows):
    tokens, kv_heads, layers = PROMPT + NEW, 2, 2
    full = layers * 2 * kv_heads * tokens * D * 4  # keys and values, fp32
    assert rows["base"]["cache_bytes"] == full and rows["base"]["cache_ratio"] == 1
    # keys d' wide on every projected layer, values d
    assert rows["dimpo l=2"]["cache_ratio"] == pytest.approx((D_PRIME + D) / (2 * D))
    assert rows["dimpo l=1"]["cache_ratio"] == pytest.approx((1 + (D_PRIME + D) / (2 * D)) / 2)
    # SnapKV keeps a quarter of the prompt, then every decoded token
    kept = PROMPT // 4 + NEW
    assert rows["snapkv"]["cache_bytes"] == full * kept / tokens
    assert rows["dimpo l=2 + snapkv"]["cache_ratio"] == pytest.approx(kept / tokens * (D_PRIME + D) / (2 * D))


def test_times_come_with_ratios_and_tokens_per_second(rows):
    for r in rows.values():
        assert r["prefill_s"] > 0 and r["decode_s"] > 0 and r["tokens_per_s"] == pytest.approx(1 / r["decode_s"])
        assert all(math.isfinite(r[f"{k}_ratio"]) and r[f"{k}_ratio"] > 0 for k in ("prefill", "decode", "peak"))
        assert r["peak_kind"] == "weights_plus_cache" and r["peak_bytes"] > r["cache_bytes"]


def test_measure_refuses_nonsense():
    with pytest.raises(ValueError, match="repeats >= 1"):
        measure(None, {}, 16, 1, repeats=0)


def test_the_latency_table_is_drawn_from_the_summary(rows, tmp_path):
    path = tmp_path / "latency.json"
    path.write_text(json.dumps([{"model": "tiny-llama", "d_prime": D_PRIME, **r} for r in rows.values()]))
    summaries.summarize_latency([path], summary_path(tmp_path / "summary", "dimpo_latency"))
    asked = outputs.runs_in(tmp_path / "summary")
    assert "latency" in asked.dimpo and "tables/dimpo_latency.tex" in outputs.wanted([], False, asked.dimpo)
    (table,) = outputs.render(["tables/dimpo_latency.tex"], tmp_path / "summary", REFERENCE, tmp_path)
    line = table_line(table.read_text(), "tiny-llama (cpu, float32, 40 + 3 tokens, d' = 4): dimpo l=2 &")
    kib = rows["dimpo l=2"]["cache_bytes"] / 1024
    assert f"{kib:.1f} ({(D_PRIME + D) / (2 * D):.2f})" in line
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"model": "m"}]))
    with pytest.raises(ValueError, match="bad.json: latency record lacks"):
        summaries.summarize_latency([bad], tmp_path / "x.csv")


def test_latency_to_file_measures_a_run_directory_with_its_fitted_projections(tmp_path):
    """The workflow's latency job: one of our run directories (remote code, ours) and a fitted
    projections file, the rows written as JSON with the model's name and d'."""
    from dimattn import DimAttnConfig, DimAttnForCausalLM
    from dimattn.model.affine import save_projections
    from dimattn.evaluation.latency import latency_to_file

    torch.manual_seed(0)
    run = DimAttnForCausalLM(DimAttnConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                           attention="vanilla", max_position_embeddings=128))
    run.config.register_for_auto_class()
    run.register_for_auto_class("AutoModelForCausalLM")
    run.save_pretrained(tmp_path / "run")
    save_projections({i: Affine(torch.randn(D_PRIME, 16), torch.zeros(D_PRIME)) for i in range(2)},
                     tmp_path / "p.safetensors")
    rows = latency_to_file(str(tmp_path / "run"), tmp_path / "p.safetensors", tmp_path / "latency.json", "tiny",
                           prompt=32, new=2, repeats=1, device="cpu")
    assert json.loads((tmp_path / "latency.json").read_text()) == rows
    assert [r["setting"] for r in rows] == ["base", "snapkv", "dimpo l=1", "dimpo l=2", "dimpo l=2 + snapkv"]
    assert {r["model"] for r in rows} == {"tiny"} and {r["d_prime"] for r in rows} == {D_PRIME}
    assert rows[3]["cache_ratio"] == pytest.approx((D_PRIME + 16) / 32)
