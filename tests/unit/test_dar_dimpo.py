"""DimPO on DAR models, both reductions composed: the capture of DAR and uniform layers (near and
far keys, seed 000 Eq. 1-3), the near/far rule of every key gather of the fits and the fidelity,
and the projected DAR model, against naive references written from the seeds' equations."""

import math

import pytest
import torch

from dimattn import DimAttnConfig, DimAttnForCausalLM
from dimattn.model.affine import Affine, DamagedFileError
from dimattn.dimpo.capture import capture_qkv
from dimattn.model.modeling_dimattn import DimAttnCache
from dimattn.model.modeling_projected import attach_projections
from dimattn.dimpo.capture_files import load_capture, save_capture
from dimattn.dimpo.fidelity import attention_fidelity
from dimattn.dimpo.fit_settings import resolve_settings
from dimattn.dimpo.projections import build_instances, build_pairs, fit_projections

WINDOW, D_DOWN, HEAD_DIM, T = 3, 8, 8, 12
LAYOUTS = {
    "dar": dict(attention="dar"),
    "uniform": dict(attention="uniform"),
    "dar-on-layer-1": dict(attention="dar", attention_layers=[1]),  # layer 0 vanilla
}


def tiny(attention="dar", vocab_size=97, **kw):
    cfg = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, attention=attention, window=WINDOW, d_down=D_DOWN,
               initializer_range=0.2, eos_token_id=None, bos_token_id=None)
    cfg.update(kw)
    torch.manual_seed(0)
    return DimAttnForCausalLM(DimAttnConfig(**cfg)).eval()


def ids(n=2, t=T, seed=1):
    return torch.randint(0, 97, (n, t), generator=torch.Generator().manual_seed(seed))


def far_window(model, layer):
    """The w of seed 000 a layer reads its keys by: 0 on uniform layers (every key far), None on vanilla ones."""
    variant = model.config.layer_attention(layer)
    return {"dar": model.config.window, "uniform": 0}.get(variant)


def naive_key(layer, seq, head, i, j):
    """(key, value) that query position i scores at key position j: near when 0 <= i - j < w."""
    near = 0 <= i - j < layer["window"]
    key, value = (layer["k"], layer["v"]) if near else (layer["k_far"], layer["v_far"])
    return key[seq, head, j], value[seq, head, j]


@pytest.fixture(scope="module")
def dar_capture():
    model = tiny()
    return model, capture_qkv(model, ids())


def random_affine(d_prime=4, seed=2):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d_prime, HEAD_DIM, generator=g) / math.sqrt(HEAD_DIM)
    return Affine(W, 0.1 * torch.randn(d_prime, generator=g))


# ---- (i) the capture -------------------------------------------------------------------------------


def naive_rope(x, model):
    """GPT-NeoX partial rotary of x (B, H, T, hs) at positions 0..T-1: the first n channels rotate."""
    cfg, t = model.config, x.shape[-2]
    n = int(cfg.head_dim * cfg.rotary_pct)
    angles = torch.arange(t)[:, None].float() / cfg.rotary_emb_base ** (torch.arange(0, n, 2).float() / n)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x1, x2 = x[..., : n // 2], x[..., n // 2 : n]
    return torch.cat([x[..., :n] * cos + torch.cat([-x2, x1], -1) * sin, x[..., n:]], -1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_capture_holds_near_and_far_keys_of_the_layer_weights(layout, tmp_path):
    """q, k, v and k~ = RoPE(W_K h' + b), v~ = W_V h' + b with h' = h W_down W_up (seed 000, Eq.
    1-3), recomputed from the layer's weights; the model's outputs are unchanged while capturing;
    the file carries the windows, and a vanilla layer nothing new."""
    model = tiny(**LAYOUTS[layout])
    x = ids()
    inputs, logits = {}, []
    hooks = [block.attention.register_forward_pre_hook(lambda m, a, l=l: inputs.__setitem__(l, a[0].clone()))
             for l, block in enumerate(model.gpt_neox.layers)]
    hooks.append(model.embed_out.register_forward_hook(lambda m, a, out: logits.append(out.clone())))
    with torch.no_grad():
        plain = model(x).logits
        capture = capture_qkv(model, x)
    for hook in hooks:
        hook.remove()
    # The capture's forward gives the model's own logits, of the last position (it needs no
    # other; the LM head's one-row matmul rounds apart from the whole one): DAR and uniform layers
    # run their own kernels under it, a vanilla layer transformers' SDPA.
    torch.testing.assert_close(logits[-1], plain[:, -1:], atol=1e-6, rtol=1e-5)

    heads, hs = model.config.num_attention_heads, HEAD_DIM
    for layer, parts in capture.items():
        attn = model.gpt_neox.layers[layer].attention
        w = attn.query_key_value.weight.view(heads, 3, hs, -1)
        b = attn.query_key_value.bias.view(heads, 3, hs)

        def project(h, row):  # (B, T, d) -> (B, H, T, hs)
            return torch.einsum("btd,hed->bhte", h, w[:, row]) + b[:, row, None, :]

        h = inputs[layer]
        with torch.no_grad():
            torch.testing.assert_close(parts["q"], naive_rope(project(h, 0), model))
            torch.testing.assert_close(parts["k"], naive_rope(project(h, 1), model))
            torch.testing.assert_close(parts["v"], project(h, 2))
            window = far_window(model, layer)
            if window is None:
                assert set(parts) == {"q", "k", "v"}
                continue
            bottleneck = attn.bottleneck
            h_prime = h @ bottleneck.down.weight.T @ bottleneck.up.weight.T
            torch.testing.assert_close(parts["k_far"], naive_rope(project(h_prime, 1), model), atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(parts["v_far"], project(h_prime, 2), atol=1e-5, rtol=1e-4)
            assert parts["window"] == window

    save_capture(capture, tmp_path / "c.safetensors", {"model": "tiny"})
    loaded, meta = load_capture(tmp_path / "c.safetensors")
    far_layers = {str(l): far_window(model, l) for l in capture if far_window(model, l) is not None}
    assert meta["windows"] == far_layers
    for layer, parts in capture.items():
        assert loaded[layer].keys() == parts.keys()
        assert all(torch.equal(loaded[layer][n], t) for n, t in parts.items() if n != "window")
        assert loaded[layer].get("window") == parts.get("window")


def test_vanilla_capture_is_unchanged_and_a_far_layer_needs_its_window(tmp_path):
    capture = capture_qkv(tiny("vanilla", d_down=None), ids())
    save_capture(capture, tmp_path / "v.safetensors")
    assert "windows" not in load_capture(tmp_path / "v.safetensors")[1]
    assert all(set(parts) == {"q", "k", "v"} for parts in capture.values())

    from safetensors.torch import load_file, save_file

    from dimattn.model.affine import encode_metadata, read_metadata

    capture = capture_qkv(tiny(), ids())
    save_capture(capture, tmp_path / "d.safetensors")
    tensors, meta = load_file(str(tmp_path / "d.safetensors")), read_metadata(tmp_path / "d.safetensors")
    meta["windows"].pop("1")
    save_file(tensors, str(tmp_path / "bad.safetensors"), metadata=encode_metadata(meta))
    with pytest.raises(DamagedFileError, match=r"windows of layers \[0\], the tensors hold far keys of layers \[0, 1"):
        load_capture(tmp_path / "bad.safetensors")


# ---- (ii) the near/far rule of the key gathers --------------------------------------------------------


@pytest.mark.parametrize("hparams", [{}, {"causal": True}, {"num_sampled_keys": 5}], ids=["all", "causal", "sampled"])
def test_instances_and_pairs_gather_near_or_far_keys(dar_capture, hparams):
    _, capture = dar_capture
    layer = capture[1]
    st = resolve_settings("kl", {"query_stride": 1, **hparams})
    inst = build_instances(layer, st, torch.Generator().manual_seed(0))
    batch = inst.batch()
    groups = inst.groups
    for row in range(len(inst)):
        seq, head, pos = int(inst.seq[row]), int(inst.head[row]), int(inst.pos[row])
        for col, j in enumerate(batch["positions"][row].tolist()):
            key, _ = naive_key(layer, seq, head // groups, pos, j)
            assert torch.equal(batch["keys"][row, col], key), (row, j)
    # psi over the gathered keys: q.k_ij / sqrt(d), softmax over the valid ones
    scores = torch.einsum("bd,bld->bl", batch["query"], batch["keys"]) / math.sqrt(HEAD_DIM)
    torch.testing.assert_close(batch["psi"], torch.softmax(scores.masked_fill(~batch["mask"], -math.inf), -1))

    pairs = build_pairs(inst, st, torch.Generator().manual_seed(0))
    q, chosen, rejected = pairs.vectors(inst, torch.arange(len(pairs)))
    for p in range(len(pairs)):
        row = int(pairs.inst[p])
        seq, kv_head, pos = int(inst.seq[row]), int(inst.head[row]) // groups, int(inst.pos[row])
        assert torch.equal(chosen[p], naive_key(layer, seq, kv_head, pos, int(pairs.chosen[p]))[0])
        assert torch.equal(rejected[p], naive_key(layer, seq, kv_head, pos, int(pairs.rejected[p]))[0])
        assert torch.equal(q[p], layer["q"][seq, int(inst.head[row]), pos])


# ---- (iii) fidelity and the teacher psi -----------------------------------------------------------


def naive_dar_fidelity(layer, proj, causal, scale):
    """Table 1's KL and MSE with psi_ij = softmax_j(q_i . k_ij / sqrt(d)), k_ij near or far by
    seed 000's rule, one loop iteration per (sequence, head, query i, key j); also the
    attention outputs sum_j psi_ij v_ij (N, H, T, d)."""
    q = layer["q"].double()
    W, b = proj.W.double(), proj.b.double()
    n, heads, t, d = q.shape
    low = 1 / math.sqrt(W.shape[0] if scale == "d_prime" else d)
    kl = mse = 0.0
    outputs = torch.zeros(n, heads, t, layer["v"].shape[-1], dtype=torch.float64)
    for s in range(n):
        for h in range(heads):
            for i in range(t):
                keys, values = zip(*(naive_key(layer, s, h, i, j) for j in range(i + 1 if causal else t)))
                keys, values = torch.stack(keys).double(), torch.stack(values).double()
                psi = torch.softmax(keys @ q[s, h, i] / math.sqrt(d), 0)
                pi = torch.softmax((keys @ W.T + b) @ (W @ q[s, h, i] + b) * low, 0)
                kl += float((psi * (psi.log() - (pi + 1e-9).log())).sum())
                mse += float(((psi - pi) @ values).pow(2).sum())
                outputs[s, h, i] = psi @ values
    return kl / (n * heads * t), mse / (n * heads * t * d), outputs


@pytest.mark.parametrize("layout", ["dar", "uniform"])
def test_fidelity_follows_the_dar_teacher(layout):
    """The naive DAR teacher reproduces the layer's own attention output; attention_fidelity
    matches the naive loop on it (causal or not, either scale); W = I at d' = d is lossless."""
    model = tiny(**LAYOUTS[layout])
    seen = []
    dense = model.gpt_neox.layers[1].attention.dense
    hook = dense.register_forward_pre_hook(lambda m, a: seen.append(a[0].clone()))
    capture = capture_qkv(model, ids(t=10), layers=[1])
    hook.remove()
    layer = capture[1]
    proj = random_affine()
    for causal, scale in [(True, "d_prime"), (False, "d")]:
        kl, mse, outputs = naive_dar_fidelity(layer, proj, causal, scale)
        (row,) = attention_fidelity(capture, {1: proj}, causal=causal, scale=scale, chunk_size=4)
        assert row["kl"] == pytest.approx(kl, rel=1e-4) and row["mse"] == pytest.approx(mse, rel=1e-4)
        if causal:  # the model's attention is causal: psi V is its output, head by head
            torch.testing.assert_close(outputs.float(), seen[0].view(2, 10, 4, HEAD_DIM).transpose(1, 2),
                                       atol=1e-5, rtol=1e-4)
    for causal in (False, True):
        (row,) = attention_fidelity(capture, {1: Affine(torch.eye(HEAD_DIM), torch.zeros(HEAD_DIM))}, causal=causal)
        assert abs(row["kl"]) < 1e-5 and row["mse"] < 1e-10


# ---- (iv) the projected DAR model ---------------------------------------------------------------------


def naive_projected_dar(layer, proj, scale):
    """Softmax_j(F(q_i) . F(k_ij) * s) v_ij over j <= i, k_ij, v_ij near or far: (N, H, T, d)."""
    n, heads, t, d = layer["q"].shape
    out = torch.zeros(n, heads, t, d)
    for s in range(n):
        for h in range(heads):
            for i in range(t):
                keys, values = (torch.stack(x) for x in zip(*(naive_key(layer, s, h, i, j) for j in range(i + 1))))
                out[s, h, i] = torch.softmax(proj(keys) @ proj(layer["q"][s, h, i]) * scale, 0) @ values
    return out


@pytest.mark.parametrize("layout", ["dar", "uniform"])
def test_identity_projection_gives_the_base_model_with_and_without_cache(layout):
    base = tiny(**LAYOUTS[layout])
    model = attach_projections(tiny(**LAYOUTS[layout]), {l: Affine(torch.eye(HEAD_DIM), torch.zeros(HEAD_DIM))
                                                         for l in range(2)}, 2)
    x = ids()
    torch.testing.assert_close(model(x).logits, base(x).logits, atol=1e-6, rtol=1e-5)
    prompt = ids(n=1, t=5)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    generated = model.generate(prompt, **kw)
    assert torch.equal(generated, base.generate(prompt, **kw))
    assert isinstance(model(prompt, use_cache=True).cache, DimAttnCache)  # latents, projected at attention time


@pytest.mark.parametrize("scale", ["d_prime", "d"])
def test_projected_dar_layer_matches_the_naive_reference_and_caches_alike(dar_capture, scale):
    """The last layer projected: its attention output is Softmax(F(q_i) F(k_ij)^T s) v_ij from the
    base model's capture (earlier layers are unchanged); greedy decoding through DimAttnCache
    equals decoding without a cache."""
    _, capture = dar_capture
    proj = random_affine()
    model = attach_projections(tiny(), {1: proj}, 1, scale)
    seen = []
    hook = model.gpt_neox.layers[1].attention.dense.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        model(ids())
    hook.remove()
    s = 1 / math.sqrt(4 if scale == "d_prime" else HEAD_DIM)
    want = naive_projected_dar(capture[1], proj, s)
    torch.testing.assert_close(seen[0].view(2, T, 4, HEAD_DIM).transpose(1, 2), want, atol=2e-5, rtol=1e-4)
    prompt, kw = ids(n=2, t=5), dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, use_cache=True, **kw), model.generate(prompt, use_cache=False, **kw))
    with pytest.raises(ValueError, match="KV compression needs a plain KV cache"):
        attach_projections(tiny(), {1: proj}, 1, kv={"snapkv": {"budget": 64, "window": 32, "kernel": 5}})


# ---- (v) fits on a DAR capture ------------------------------------------------------------------------


def test_dimpo_and_kl_fit_on_a_dar_capture_and_beat_random():
    capture = capture_qkv(tiny(), ids(n=2, t=32), layers=[1])
    fast = dict(query_stride=1, steps=60, batch_size=16, lr=1e-2)
    (random,) = attention_fidelity(capture, fit_projections(capture, "random", 4, progress=False))
    for objective in ("dimpo", "kl"):
        (row,) = attention_fidelity(capture, fit_projections(capture, objective, 4, fast, progress=False))
        assert row["kl"] < random["kl"], (objective, row, random)
