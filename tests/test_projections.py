"""Capture, fitting and attention fidelity of the DimPO stage (dimattn.projections)."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from dimattn import DimAttnConfig, DimAttnForCausalLM
from dimattn.objectives import kl_loss, random_projection
from dimattn.projections import (
    attention_fidelity,
    capture_qkv,
    fit_layer,
    fit_projections,
    load_capture,
    load_projections,
    objective_loss,
    sample_instances,
    save_capture,
    save_projections,
)


def low_rank_capture(n=2, heads=4, kv_heads=2, seq_len=48, d=16, rank=4, seed=0):
    """Queries and keys living mostly in one rank-4 subspace of R^16; values full rank."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):  # float32, like a real capture, whatever the default dtype
        return torch.randn(*shape, generator=g, dtype=torch.float32)

    basis = torch.linalg.qr(randn(d, rank))[0]

    def vectors(h):
        return randn(n, h, seq_len, rank) @ basis.T * 2 + 0.1 * randn(n, h, seq_len, d)

    return {0: {"q": vectors(heads), "k": vectors(kv_heads), "v": randn(n, kv_heads, seq_len, d)}}


@pytest.fixture(scope="module")
def capture():
    return low_rank_capture()


FAST = dict(steps=100, n_instances=512, batch_size=64, lr=1e-2)


def naive_fidelity(layer, W):
    """KL and MSE with one loop iteration per (sequence, head, query position)."""
    q, k, v = layer["q"].double(), layer["k"].double(), layer["v"].double()
    n, heads, seq_len, d = q.shape
    groups = heads // k.shape[1]
    W = W.double()
    kl = mse = 0.0
    for i in range(n):
        for h in range(heads):
            keys, values = k[i, h // groups], v[i, h // groups]
            for t in range(seq_len):
                psi = torch.softmax(keys[: t + 1] @ q[i, h, t] / math.sqrt(d), 0)
                pi = torch.softmax((keys[: t + 1] @ W.T) @ (W @ q[i, h, t]) / math.sqrt(W.shape[0]), 0)
                kl += float((psi * (psi.log() - pi.log())).sum())
                mse += float(((psi - pi) @ values[: t + 1]).pow(2).sum())
    return kl / (n * heads * seq_len), mse / (n * heads * seq_len * d)


@pytest.mark.parametrize("chunk_size", [5, 256])
def test_fidelity_matches_naive_loop(chunk_size):
    layer = low_rank_capture(seq_len=11)[0]
    W = random_projection(16, 4, seed=3) * 1.7
    (row,) = attention_fidelity({0: layer}, {0: W}, chunk_size=chunk_size)
    kl, mse = naive_fidelity(layer, W)
    assert row["layer"] == 0
    assert row["kl"] == pytest.approx(kl, rel=1e-4)
    assert row["mse"] == pytest.approx(mse, rel=1e-4)


def test_identity_projection_is_lossless(capture):
    (row,) = attention_fidelity(capture, {0: torch.eye(16, dtype=torch.float32)})
    assert abs(row["kl"]) < 1e-5 and row["mse"] < 1e-10


def test_sample_instances_gqa_keys_and_psi(capture):
    layer = capture[0]
    inst = sample_instances(layer, 300, torch.Generator().manual_seed(0), min_position=3)
    triples = set(zip(inst.seq.tolist(), inst.head.tolist(), inst.pos.tolist()))
    assert len(triples) == 300 and min(inst.pos) >= 3
    b = inst.batch(torch.arange(20))
    for r in range(20):
        s, h, p = inst.seq[r], inst.head[r], int(inst.pos[r])
        assert torch.equal(b["query"][r], layer["q"][s, h, p])
        assert torch.equal(b["keys"][r, : p + 1], layer["k"][s, h // 2, : p + 1])  # 2 query heads per kv head
        assert b["mask"][r].sum() == p + 1
        want = torch.softmax(layer["k"][s, h // 2, : p + 1] @ layer["q"][s, h, p] / 4.0, 0)
        assert torch.allclose(b["psi"][r, : p + 1], want, atol=1e-6)
        assert torch.all(b["psi"][r, p + 1 :] == 0)
    everything = sample_instances(layer, 10**9, torch.Generator().manual_seed(0))
    assert len(everything) == 2 * 4 * 47


def test_trained_and_pca_beat_random(capture):
    kl = {}
    for objective, hparams in [
        ("random", {}),
        ("pca", {}),
        ("kl", FAST),
        ("dimpo", {**FAST, "k": 8, "lam": 1.0}),
    ]:
        W = fit_projections(capture, objective, 4, hparams, seed=0, progress=False)
        assert W[0].shape == (4, 16)
        (kl[objective],) = [row["kl"] for row in attention_fidelity(capture, W)]
    assert kl["pca"] < kl["random"]
    assert kl["kl"] < kl["pca"] and kl["dimpo"] < kl["random"]


@pytest.mark.parametrize(
    "objective,hparams", [("kl", {}), ("dimpo", {}), ("dimpo", {"gamma": 0.5, "k": 4, "lam": 1.0})]
)
@pytest.mark.parametrize("init", ["pca", "random"])
def test_fitting_reduces_own_loss(capture, objective, hparams, init):
    hp = {**FAST, "steps": 40, **hparams, "init": init}
    W, history = fit_layer(capture[0], objective, 4, hp, seed=1, progress=False)
    assert [step for step, _ in history] == list(range(40)) and all(math.isfinite(x) for _, x in history)
    held_out = sample_instances(capture[0], 512, torch.Generator().manual_seed(99))
    W0 = fit_layer(capture[0], init, 4, seed=1)[0]  # the start: the pca solution or the seed's random W
    assert objective_loss(held_out, objective, W, hp) < objective_loss(held_out, objective, W0, hp)


def test_fit_is_deterministic_and_closed_form_has_no_history(capture):
    a, _ = fit_layer(capture[0], "kl", 4, {**FAST, "steps": 5}, seed=7, progress=False)
    b, _ = fit_layer(capture[0], "kl", 4, {**FAST, "steps": 5}, seed=7, progress=False)
    assert torch.equal(a, b)
    W, history = fit_layer(capture[0], "pca", 4, seed=7)
    assert history == [] and torch.allclose(W @ W.T, torch.eye(4, dtype=W.dtype), atol=1e-5)


def test_fit_rejects_unknown_names(capture):
    with pytest.raises(ValueError, match="triplet"):
        fit_layer(capture[0], "triplet", 4)
    with pytest.raises(ValueError, match="learning_rate"):
        fit_layer(capture[0], "kl", 4, {"learning_rate": 1.0})


def test_kl_objective_on_instances_equals_fidelity_kl_at_those_queries(capture):
    # The training loss and the fidelity metric are the same KL, on a subset vs all positions.
    inst = sample_instances(capture[0], 10**9, torch.Generator().manual_seed(0), min_position=0)
    W = random_projection(16, 4, seed=0)
    b = inst.batch()
    from dimattn.projections import projected_logits

    train_kl = kl_loss(projected_logits(W, b["query"], b["keys"]), b["psi"], b["mask"]).item()
    assert train_kl == pytest.approx(attention_fidelity(capture, {0: W})[0]["kl"], rel=1e-4)


def test_capture_and_projection_files_round_trip(capture, tmp_path):
    save_capture(capture, tmp_path / "c.safetensors", {"model": "synthetic"})
    loaded, meta = load_capture(tmp_path / "c.safetensors")
    assert meta == {
        "model": "synthetic",
        "head_dim": 16,
        "heads": 4,
        "kv_heads": 2,
        "seq_len": 48,
        "n_sequences": 2,
        "layers": [0],
    }
    assert all(torch.equal(loaded[0][x], capture[0][x]) for x in "qkv")
    with pytest.raises(ValueError, match="head_dim"):
        save_capture(capture, tmp_path / "bad.safetensors", {"head_dim": 8})

    W = {0: random_projection(16, 4), 3: random_projection(16, 4, seed=1)}
    save_projections(W, tmp_path / "w.safetensors", {"objective": "random", "hparams": {"lr": 0.01}})
    W2, meta = load_projections(tmp_path / "w.safetensors")
    assert list(W2) == [0, 3] and all(torch.equal(W[l], W2[l]) for l in W)
    assert meta["objective"] == "random" and meta["d_prime"] == 4 and meta["hparams"] == {"lr": 0.01}


# ---- capture from real models ---------------------------------------------------------------


def dimattn_model():
    torch.manual_seed(0)
    cfg = DimAttnConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        attention="vanilla",
        max_position_embeddings=64,
        initializer_range=0.2,
    )
    return DimAttnForCausalLM(cfg).eval(), lambda m, l: m.gpt_neox.layers[l].attention.dense


def hf_model(config_class, model_class):
    torch.manual_seed(0)
    cfg = config_class(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return model_class(cfg).eval(), lambda m, l: m.model.layers[l].self_attn.o_proj


@pytest.mark.parametrize(
    "build",
    [
        dimattn_model,
        lambda: hf_model(LlamaConfig, LlamaForCausalLM),
        lambda: hf_model(Qwen2Config, Qwen2ForCausalLM),
    ],
    ids=["dimattn", "llama", "qwen2"],
)
def test_capture_reproduces_model_attention(build):
    model, out_proj = build()
    ids = torch.randint(0, 100, (3, 17), generator=torch.Generator().manual_seed(0))
    layers = model.config.num_hidden_layers
    seen = {l: [] for l in range(layers)}  # attention outputs (B, T, H d): input of the output projection
    hooks = [
        out_proj(model, l).register_forward_pre_hook(lambda mod, a, l=l: seen[l].append(a[0].clone()))
        for l in range(layers)
    ]

    def collect():
        out = {l: torch.cat(parts) for l, parts in seen.items()}
        for parts in seen.values():
            parts.clear()
        return out

    with torch.no_grad():
        logits = model(ids).logits
        plain = collect()
        capture = capture_qkv(model, ids, batch_size=2)  # two forward passes: 2 + 1 sequences
        during = collect()
        after = model(ids).logits
    for h in hooks:
        h.remove()

    assert model.config._attn_implementation == "sdpa"  # restored
    assert torch.equal(after, logits)
    heads = model.config.num_attention_heads
    kv_heads = getattr(model.config, "num_key_value_heads", heads)
    assert sorted(capture) == list(range(layers))
    for l, layer in capture.items():
        q, k, v = layer["q"], layer["k"], layer["v"]
        d = q.shape[-1]
        assert q.shape == (3, heads, 17, d) and k.shape == v.shape == (3, kv_heads, 17, d)
        assert q.dtype == torch.float32
        assert torch.allclose(during[l], plain[l], atol=1e-6)  # capturing changes nothing
        # softmax(q k^T / sqrt d) with a causal mask, times v: the model's own attention output.
        k_rep, v_rep = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
        scores = (q @ k_rep.transpose(-1, -2) / math.sqrt(d)).masked_fill(
            torch.ones(17, 17, dtype=torch.bool).triu(1), float("-inf")
        )
        out = (torch.softmax(scores, -1) @ v_rep).transpose(1, 2).reshape(3, 17, heads * d)
        assert torch.allclose(out, plain[l].float(), atol=1e-5)
        assert torch.allclose(
            F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True),
            out.view(3, 17, heads, d).transpose(1, 2),
            atol=1e-5,
        )


def test_capture_selected_layers_and_fit_on_it():
    model, _ = dimattn_model()
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(1))
    capture = capture_qkv(model, ids, layers=[1])
    assert list(capture) == [1]
    W = fit_projections(capture, "kl", 4, {**FAST, "steps": 20, "n_instances": 128}, progress=False)
    ((row),) = attention_fidelity(capture, W)
    assert row["layer"] == 1 and math.isfinite(row["kl"]) and math.isfinite(row["mse"])


def test_file_steps_end_to_end(tmp_path):
    from dimattn.data import train_tokenizer, write_documents
    from dimattn.projections import capture_to_file, fidelity_to_file, fit_to_file

    words = "to be or not that is the question whether tis nobler in mind suffer".split()
    g = torch.Generator().manual_seed(0)
    docs = [
        {"id": f"d{i}", "text": " ".join(words[j] for j in torch.randint(0, len(words), (120,), generator=g))}
        for i in range(3)
    ]
    write_documents(docs, tmp_path / "docs.jsonl")
    tokenizer = train_tokenizer(tmp_path / "docs.jsonl", vocab_size=300, out_dir=tmp_path / "model")
    model, _ = dimattn_model()
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(tmp_path / "model")

    # 3 documents, 5 sequences: first windows of all three, then second windows.
    meta = capture_to_file(
        tmp_path / "model",
        tmp_path / "docs.jsonl",
        seq_len=32,
        n_sequences=5,
        out_path=tmp_path / "capture.safetensors",
        model_name="tiny",
    )
    assert meta["n_sequences"] == 5 and meta["seq_len"] == 32 and meta["model"] == "tiny"
    fit_to_file(
        tmp_path / "capture.safetensors",
        "kl",
        4,
        {**FAST, "steps": 10, "n_instances": 64, "seed": 3},
        tmp_path / "W.safetensors",
    )
    W, wmeta = load_projections(tmp_path / "W.safetensors")
    assert wmeta["seed"] == 3 and wmeta["hparams"]["steps"] == 10 and len(wmeta["history"]["0"]) == 10
    rows = fidelity_to_file(
        tmp_path / "capture.safetensors", tmp_path / "W.safetensors", tmp_path / "f.csv", "tiny", "kl", 4
    )
    text = (tmp_path / "f.csv").read_text().splitlines()
    assert text[0] == "model,objective,d_prime,head_dim,layer,kl,mse" and len(text) == 3
    assert [r["layer"] for r in rows] == [0, 1] and rows[0]["head_dim"] == 8
    with pytest.raises(ValueError, match="windows"):
        capture_to_file(
            tmp_path / "model",
            tmp_path / "docs.jsonl",
            seq_len=32,
            n_sequences=500,
            out_path=tmp_path / "x.safetensors",
            model_name="tiny",
        )
