"""The transformers model: save/load in a fresh process, generation, Pythia parameter counts, the
training loss computed without logits, the fused rotary embedding."""


import pytest
import torch
import torch.nn.functional as F

from dimattn import DimAttnConfig, DimAttnForCausalLM
from dimattn.model import modeling_dimattn as modeling
from dimattn.model.modeling_dimattn import (
    DimAttnCache,
    Rope,
    RotaryEmbedding,
    apply_rotary,
    kv_cache_nbytes,
    lm_head_loss,
)


def tiny(attention="dar", window=3, d_down=8, **kw):
    cfg = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, attention=attention, window=window, d_down=d_down)
    cfg.update(kw)
    torch.manual_seed(0)
    return DimAttnForCausalLM(DimAttnConfig(**cfg)).eval()


def bottleneck_grads(model, T):
    x = torch.randint(0, 97, (2, T))
    model.train()
    model(x, labels=x).loss.backward()
    return [p.grad for n, p in model.named_parameters() if "bottleneck" in n]


def test_bottleneck_trained_only_through_far_keys():
    # window >= T: no key is ever far, so W_down and W_up receive exactly zero gradient
    assert all(g is None or (g == 0).all() for g in bottleneck_grads(tiny(window=16), T=16))
    assert all(g is not None and g.abs().sum() > 0 for g in bottleneck_grads(tiny(window=4), T=16))


def test_dar_at_window_0_is_uniform():
    """w = 0: every key is far, so DAR is Uniform at the same d_down, weights and all: the window
    sweeps take their w = 0 point from the Uniform run (``reporting.dar``) rather than train it twice."""
    dar, uniform = tiny(window=0, d_down=8), tiny(attention="uniform", window=None, d_down=8)
    want = uniform.state_dict()
    got = dar.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=0, rtol=0, msg=k)
    x = torch.randint(0, 97, (2, 20))
    torch.testing.assert_close(dar(x).logits, uniform(x).logits, atol=1e-6, rtol=1e-5)
    # the Uniform layer differs from a DAR layer with a window: the check above can fail
    assert not torch.allclose(tiny(window=3, d_down=8)(x).logits, uniform(x).logits, atol=1e-3)


def test_no_bottleneck_control_starts_as_vanilla():
    """d_down = d: W_up W_down = I at initialisation, so the control differs from vanilla only
    in what training makes of the bottleneck; a narrower one starts as a projection."""
    dar = tiny(window=2, d_down=32)
    vanilla = tiny(attention="vanilla", d_down=None)
    vanilla.load_state_dict({k: v for k, v in dar.state_dict().items() if "bottleneck" not in k})
    x = torch.randint(0, 97, (2, 20))
    torch.testing.assert_close(dar(x).logits, vanilla(x).logits, atol=1e-5, rtol=1e-4)
    narrow = tiny(d_down=8).gpt_neox.layers[0].attention.bottleneck
    torch.testing.assert_close(narrow.down.weight @ narrow.down.weight.T, torch.eye(8), atol=1e-5, rtol=0)
    torch.testing.assert_close(narrow.up.weight, narrow.down.weight.T)


def test_dar_with_covering_window_equals_vanilla_with_same_weights():
    dar, vanilla = tiny(window=64), tiny(attention="vanilla", d_down=None)
    vanilla.load_state_dict({k: v for k, v in dar.state_dict().items() if "bottleneck" not in k})
    x = torch.randint(0, 97, (2, 20))
    torch.testing.assert_close(dar(x).logits, vanilla(x).logits)


LAYOUTS = {
    "vanilla": dict(attention="vanilla", d_down=None),
    "dar": dict(attention="dar"),
    "dar-sigmoid": dict(attention="dar", bottleneck_activation="sigmoid"),
    "dar-w1": dict(attention="dar", window=1),
    "dar-w0": dict(attention="dar", window=0),
    "uniform": dict(attention="uniform"),
    "swa": dict(attention="swa", d_down=None),
    "dilated": dict(attention="dilated", dilation=2, d_down=None),
    "swa+full": dict(attention="swa", full_attention_every=2, d_down=None),
    "dar-on-layer-1": dict(attention="dar", attention_layers=[1]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cached_generation_equals_uncached(layout):
    model = tiny(**LAYOUTS[layout], eos_token_id=None, bos_token_id=None)  # never stop early
    x = torch.randint(1, 97, (2, 6))
    kw = dict(max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(x), pad_token_id=0)
    with_cache = model.generate(x, use_cache=True, **kw)
    without = model.generate(x, use_cache=False, **kw)
    assert torch.equal(with_cache, without)
    # the cached path really feeds one token at a time: the last logits match a full forward
    full = model(with_cache[:, :-1]).logits[:, -1]
    assert torch.equal(full.argmax(-1), with_cache[:, -1])


@pytest.mark.parametrize("layout", ["dar", "dar-w1", "uniform", "dar-on-layer-1"])
def test_dar_cache_holds_latents_and_generates_like_no_cache(layout):
    """Greedy generation of a left-padded batch through DimAttnCache equals generation without a
    cache; the cache keeps full K/V for only the last window - 1 slots of DAR layers."""
    model = tiny(**LAYOUTS[layout], eos_token_id=None, bos_token_id=None)
    x = torch.randint(3, 97, (2, 9))
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    kw = dict(max_new_tokens=15, do_sample=False, attention_mask=mask, pad_token_id=0)
    out = model.generate(x, use_cache=True, return_dict_in_generate=True, **kw)
    assert isinstance(out.cache, DimAttnCache)
    assert torch.equal(out.sequences, model.generate(x, use_cache=False, **kw))
    cfg = model.config
    for i, layer in out.cache.latent_layers.items():
        assert layer.latent.shape == (2, 9 + 14, cfg.d_down)  # the last token is never fed back
        near = 0 if cfg.layer_attention(i) == "uniform" else max(cfg.window - 1, 0)
        assert (layer.near_k is None and near == 0) or layer.near_k.shape[-2] == near


def test_dar_cache_bytes_against_vanilla():
    """Per token and DAR layer: d_down latent floats instead of 2 d of keys and values."""
    dar, vanilla = tiny(attention="dar", window=3, d_down=8), tiny(attention="vanilla", d_down=None)
    x = torch.randint(3, 97, (1, 40))
    dar_cache, vanilla_cache = dar(x, use_cache=True).cache, vanilla(x, use_cache=True).cache
    assert isinstance(dar_cache, DimAttnCache) and not isinstance(vanilla_cache, DimAttnCache)
    layers, d = 2, 32
    assert kv_cache_nbytes(vanilla_cache) == layers * 40 * 2 * d * 4
    expected = layers * (40 * 8 + 2 * 2 * d) * 4 + 40 * 4  # latents + last w - 1 K/V + int32 positions
    assert kv_cache_nbytes(dar_cache) == expected


def test_layer_patterns_pick_each_layers_variant():
    hybrid = DimAttnConfig(hidden_size=32, num_hidden_layers=8, num_attention_heads=4, attention="swa",
                           window=4, full_attention_every=4)
    assert [hybrid.layer_attention(i) for i in range(8)] == ["swa"] * 3 + ["vanilla"] + ["swa"] * 3 + ["vanilla"]
    subset = tiny(attention="dar", attention_layers=[1])
    assert subset.gpt_neox.layers[0].attention.bottleneck is None
    assert subset.gpt_neox.layers[1].attention.bottleneck is not None
    assert subset.config.uses_bottleneck and not tiny(**LAYOUTS["swa"]).config.uses_bottleneck


def test_sigmoid_bottleneck_changes_only_the_far_path():
    linear, sigmoid = tiny(attention="dar", window=4), tiny(attention="dar", window=4, bottleneck_activation="sigmoid")
    sigmoid.load_state_dict(linear.state_dict())
    h = torch.randn(2, 5, 32)
    bottleneck = sigmoid.gpt_neox.layers[0].attention.bottleneck
    torch.testing.assert_close(bottleneck(h), bottleneck.up(torch.sigmoid(bottleneck.down(h))))
    x = torch.randint(0, 97, (1, 12))
    torch.testing.assert_close(linear(x[:, :4]).logits, sigmoid(x[:, :4]).logits)  # no far key yet
    assert not torch.allclose(linear(x).logits, sigmoid(x).logits)


@pytest.mark.parametrize("layout", ["dar", "swa", "dilated", "dar-w0"])
def test_training_kernel_matches_dense_reference(layout):
    """Training on CPU takes the blocked kernel; its loss and gradients equal the dense path's."""
    blocked = tiny(**LAYOUTS[layout], attention_kernel="blocked")
    dense = tiny(**LAYOUTS[layout], attention_kernel="dense")
    dense.load_state_dict(blocked.state_dict())
    x = torch.randint(0, 97, (2, 40))
    losses = []
    for model in (blocked, dense):
        model.train()
        loss = model(x, labels=x).loss
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1])
    for (name, a), b in zip(blocked.named_parameters(), dense.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_left_padded_batch_matches_single_rows():
    model = tiny()
    a, b = torch.randint(1, 97, (1, 9)), torch.randint(1, 97, (1, 5))
    batch = torch.cat([a, torch.cat([torch.zeros(1, 4, dtype=torch.long), b], 1)])
    mask = torch.cat([torch.ones(1, 9), torch.cat([torch.zeros(1, 4), torch.ones(1, 5)], 1)]).long()
    logits = model(batch, attention_mask=mask).logits
    torch.testing.assert_close(logits[0], model(a).logits[0])
    torch.testing.assert_close(logits[1, 4:], model(b).logits[0])


@pytest.mark.parametrize("layers,d,heads,expected", [
    (6, 512, 8, 70_426_624), (12, 768, 12, 162_322_944), (24, 1024, 16, 405_334_016)])
def test_vanilla_parameter_count_matches_pythia(layers, d, heads, expected):
    cfg = DimAttnConfig(vocab_size=50304, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads)
    with torch.device("meta"):
        model = DimAttnForCausalLM(cfg)
    assert sum(p.numel() for p in model.parameters()) == expected


@pytest.mark.parametrize("kwargs,match", [
    (dict(attention="sparse"), "not a known variant"),
    (dict(attention="dar", d_down=None), "d_down"),
    (dict(attention="dar", d_down=600), "d_down"),
    (dict(attention="dar", d_down=64, window=-1), "window"),
    (dict(attention="swa", window=0), "window"),
    (dict(attention="dar", d_down=64, bottleneck_activation="relu"), "bottleneck_activation"),
    (dict(attention="dilated", dilation=0), "dilation"),
    (dict(attention="swa", full_attention_every=0), "full_attention_every"),
    (dict(attention="dar", d_down=64, attention_layers=[6]), "attention_layers"),
    (dict(attention="dar", d_down=64, attention_layers=[1, 1]), "attention_layers"),
    (dict(attention_kernel="triton"), "attention_kernel"),
])
def test_bad_config_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DimAttnConfig(hidden_size=512, **kwargs)


# --- the training loss without logits, the fused rotary ------------------------------------------


@pytest.mark.parametrize("chunk,group", [(1 << 20, 512), (64, 128), (50, 3)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lm_head_loss_equals_cross_entropy(monkeypatch, chunk, group, dtype):
    """Chunks of rows (here 64 / 50 logits: a row or a few), gradient groups of several chunks,
    ignored rows (-100), a last chunk cut short: loss and gradients as F.cross_entropy's."""
    monkeypatch.setattr(modeling, "LOSS_CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(modeling, "LOSS_GRAD_ROWS", group)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, dtype=dtype).requires_grad_(True)
    w = torch.randn(23, 16, generator=g, dtype=dtype).requires_grad_(True)
    labels = torch.randint(0, 23, (37,), generator=g)
    labels[::4] = -100
    loss = lm_head_loss(h, w, labels)
    ref = F.cross_entropy(h @ w.T, labels, ignore_index=-100)
    torch.testing.assert_close(loss, ref)
    got, want = torch.autograd.grad(loss * 0.3, (h, w)), torch.autograd.grad(ref * 0.3, (h, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_lm_head_loss_on_answers_only():
    """An answer-only corpus (1 labelled row in 8, the head computed on those rows alone): loss
    and gradients as F.cross_entropy's, the unlabelled rows' gradient exactly zero; no labelled
    row at all gives nan, as F.cross_entropy does."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(64, 16, generator=g, dtype=torch.float64).requires_grad_(True)
    w = torch.randn(29, 16, generator=g, dtype=torch.float64).requires_grad_(True)
    labels = torch.full((64,), -100)
    labels[7::8] = torch.randint(0, 29, (8,), generator=g)
    loss = lm_head_loss(h, w, labels)
    ref = F.cross_entropy(h @ w.T, labels, ignore_index=-100)
    torch.testing.assert_close(loss, ref)
    got, want = torch.autograd.grad(loss, (h, w)), torch.autograd.grad(ref, (h, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert not got[0][labels == -100].any()
    with torch.no_grad():
        assert lm_head_loss(h, w, torch.full((64,), -100)).isnan()


def test_lm_head_loss_is_exact_where_the_softmax_underflows():
    h = torch.zeros(3, 4)
    h[1, 0] = 100.0  # row 1: its label's probability is exp(-300), 0 in float32
    w, labels = torch.eye(4) * 3, torch.tensor([1, 1, 2])
    h.requires_grad_(True)
    loss = lm_head_loss(h, w, labels)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, F.cross_entropy(h @ w.T, labels))


def test_lm_head_loss_under_bf16_autocast():
    """Matmuls in bfloat16, softmax and loss in float32: within bf16 rounding of fp32 autocast's."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(300, 64, generator=g).requires_grad_(True)
    w = (torch.randn(1000, 64, generator=g) * 0.1).requires_grad_(True)
    labels = torch.randint(0, 1000, (300,), generator=g)
    with torch.autocast("cpu", torch.bfloat16):
        loss = lm_head_loss(h, w, labels)
        ref = F.cross_entropy((h @ w.T).float(), labels)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, atol=1e-3, rtol=1e-3)
    for a, b in zip(torch.autograd.grad(loss, (h, w)), torch.autograd.grad(ref, (h, w))):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=2e-2 * b.abs().max().item(), rtol=0)


@pytest.mark.parametrize("chunk,group", [(1 << 20, 512), (2000, 60), (1000, 3)])
def test_lm_head_loss_bf16_gradient_in_place(monkeypatch, chunk, group):
    """With gradients under bf16 the softmax is written, 16-bit, into the gradient buffer: over
    chunks, groups, ignored rows and a short last chunk, the gradients are F.cross_entropy's on
    the same bf16 logits (to bf16 rounding), the loss within 2e-3 nats; without gradients
    (validation) the probabilities stay float32 and the loss matches to float32 rounding."""
    monkeypatch.setattr(modeling, "LOSS_CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(modeling, "LOSS_GRAD_ROWS", group)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(203, 32, generator=g).requires_grad_(True)
    w = (torch.randn(500, 32, generator=g) * 0.2).requires_grad_(True)
    labels = torch.randint(0, 500, (203,), generator=g)
    labels[::5] = -100
    with torch.autocast("cpu", torch.bfloat16):
        loss = lm_head_loss(h, w, labels)
        ref = F.cross_entropy((h @ w.T).float(), labels, ignore_index=-100)
        with torch.no_grad():
            exact = lm_head_loss(h, w, labels)
    assert abs(loss.item() - ref.item()) < 2e-3
    torch.testing.assert_close(exact, ref.detach(), atol=1e-5, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(loss, (h, w)), torch.autograd.grad(ref, (h, w))):
        torch.testing.assert_close(a, b, atol=1e-2 * b.abs().max().item(), rtol=0)


@pytest.mark.parametrize("layout", ["vanilla", "dar", "swa"])
def test_training_loss_skips_the_logits_and_matches_them(layout):
    """With labels and return_logits=False on CPU the loss comes from lm_head_loss (logits None),
    in training and in evaluation; its loss and gradients are those of F.cross_entropy over the
    logits. Without return_logits=False a caller gets logits and the same loss."""
    model = tiny(**LAYOUTS[layout]).train()
    x = torch.randint(0, 97, (2, 20))
    labels = x.clone()
    labels[0, :5] = -100
    out = model(x, labels=labels, return_logits=False)
    assert out.logits is None
    out.loss.backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    logits = model(x).logits
    ref = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    torch.testing.assert_close(out.loss, ref)
    ref.backward()
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(fused[n], p.grad, atol=1e-6, rtol=1e-4, msg=n)
    with torch.no_grad():  # evaluation: the loss alone, no gradient work
        evaluated = model.eval()(x, labels=labels, return_logits=False)
        usual = model(x, labels=labels)
    assert evaluated.logits is None and evaluated.loss.grad_fn is None
    torch.testing.assert_close(evaluated.loss, ref)
    torch.testing.assert_close(usual.loss, ref)
    torch.testing.assert_close(usual.logits, logits)
    torch.testing.assert_close(model(x).logits, logits)  # without labels, the logits


@pytest.mark.parametrize("rotary_pct", [0.0, 0.25, 1.0])
def test_rope_tables_rotate_q_and_k_like_apply_rotary(rotary_pct):
    """Rope rotates the fused (B, T, H, 3, hs) projection: q and k as apply_rotary, v untouched."""
    config = DimAttnConfig(hidden_size=32, num_attention_heads=2, rotary_pct=rotary_pct)
    rotary = RotaryEmbedding(config)
    positions = torch.arange(3, 12).expand(2, 9)
    cos, sin = rotary(positions)
    x = torch.randn(2, 9, 2, 3, 16)
    got = Rope(cos, sin, 16)(x)
    for row in (0, 1):
        want = apply_rotary(x[..., row, :].transpose(1, 2), cos, sin).transpose(1, 2)
        torch.testing.assert_close(got[..., row, :], want)
    torch.testing.assert_close(got[..., 2, :], x[..., 2, :])
    torch.testing.assert_close(Rope(cos, sin, 16)(x[..., 1:, :], rows=slice(1, 3)), got[..., 1:, :])


# ----------------------------------------------------------------------------- shapes where rotary matters
#
# head_dim 32 with rotary_pct 0.5: 16 rotary channels, 8 frequencies (the tiny models above have
# one), and weights large enough that attention is far from uniform, so each frequency shows.


def wide(attention="vanilla", **kw):
    cfg = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, rotary_pct=0.5,
               max_position_embeddings=128, initializer_range=0.2, attention=attention)
    cfg.update(kw)
    torch.manual_seed(0)
    return DimAttnForCausalLM(DimAttnConfig(**cfg)).eval()


def test_rotary_frequencies_follow_gpt_neox():
    """Channel pair i of n rotary channels turns by position * base^(-2i / n), as GPT-NeoX's."""
    config = DimAttnConfig(hidden_size=64, num_attention_heads=2, rotary_pct=0.5)
    cos, sin = RotaryEmbedding(config)(torch.arange(50).expand(1, 50))
    n = 16
    assert cos.shape == (1, 1, 50, n)
    for p in (1, 7, 49):
        for i in range(n // 2):
            angle = torch.tensor(p * config.rotary_emb_base ** (-2 * i / n), dtype=torch.float64)
            for channel in (i, i + n // 2):  # rotate_half pairs channel i with i + n/2
                torch.testing.assert_close(cos[0, 0, p, channel].double(), angle.cos(), atol=1e-5, rtol=0)
                torch.testing.assert_close(sin[0, 0, p, channel].double(), angle.sin(), atol=1e-5, rtol=0)


def test_vanilla_equals_transformers_gpt_neox_with_the_same_weights():
    """A vanilla model is GPT-NeoX: transformers' own GPTNeoXForCausalLM, given our state dict
    (its names, the head aside), computes the same logits."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    ours = wide()
    c = ours.config
    theirs = GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, intermediate_size=c.intermediate_size, hidden_act=c.hidden_act,
        rotary_pct=c.rotary_pct, rotary_emb_base=c.rotary_emb_base, max_position_embeddings=c.max_position_embeddings,
        layer_norm_eps=c.layer_norm_eps, use_parallel_residual=c.use_parallel_residual, tie_word_embeddings=False,
        attention_bias=True,
    )).eval()
    state = {("lm_head.weight" if k == "embed_out.weight" else k): v for k, v in ours.state_dict().items()}
    theirs.load_state_dict(state, strict=True)
    x = torch.randint(0, 97, (2, 100))
    with torch.no_grad():
        want = theirs(x).logits
        got = ours(x).logits
    assert want.std() > 1  # logits far from uniform: attention, and so rotary, matter
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", ["vanilla", "dar", "dar-w1", "uniform", "swa", "dilated"])
def test_cached_logits_equal_uncached_logits(layout):
    """Each decoding step's logits through the cache (DimAttnCache's latents for DAR and Uniform)
    within a tolerance of a full forward over the same tokens: far keys keep their rotary."""
    model = wide(**{"window": 4, "d_down": 8} | LAYOUTS[layout], eos_token_id=None, bos_token_id=None)
    x = torch.randint(1, 97, (2, 30))
    kw = dict(max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(x), pad_token_id=0)
    out = model.generate(x, use_cache=True, output_logits=True, return_dict_in_generate=True, **kw)
    with torch.no_grad():
        full = model(out.sequences).logits
    steps = torch.stack(out.logits, dim=1)  # (B, new, V)
    assert full.std() > 1
    torch.testing.assert_close(steps, full[:, x.shape[1] - 1 : -1], atol=1e-4, rtol=1e-4)
