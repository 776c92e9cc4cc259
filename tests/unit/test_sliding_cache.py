"""The generation cache of SWA and dilated layers (LayerwiseCache): an SWA layer keeps only the
last window - 1 tokens, a dilated layer those and the strided set beyond them (every r-th
absolute position), and decoding through it reproduces the full forward, with or without left
padding."""

import pytest
import torch

from dimattn import DimAttnConfig, DimAttnForCausalLM
from dimattn.model.modeling_dimattn import (
    CompactSlidingWindowLayer,
    DilatedLayer,
    LayerwiseCache,
    kv_cache_nbytes,
    new_cache,
)

MODELS = {
    "swa": dict(attention="swa", window=5),
    "swa+full": dict(attention="swa", window=4, full_attention_every=2),  # layers 0, 2 SWA; 1 vanilla
    "swa-w1": dict(attention="swa", window=1),  # its own token only: nothing cached
    "dilated": dict(attention="dilated", window=5, dilation=3),
    "dilated+full": dict(attention="dilated", window=4, dilation=4, full_attention_every=2),
    "dilated-w1": dict(attention="dilated", window=1, dilation=2),  # the strided set alone
}
LAYERS = {"swa": CompactSlidingWindowLayer, "dilated": DilatedLayer}


def tiny(attention="swa", **kw):
    cfg = dict(vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, rotary_pct=0.5,
               max_position_embeddings=128, initializer_range=0.2, attention=attention, d_down=None,
               eos_token_id=None, bos_token_id=None)
    cfg.update(kw)
    torch.manual_seed(0)
    return DimAttnForCausalLM(DimAttnConfig(**cfg)).eval()


def kept(config, seen: int) -> list[int]:
    """Tokens each layer's cache should hold after ``seen`` tokens, from the patterns' definitions:
    the next query (at ``seen``) reads j when seen - j < window, and a dilated layer also every j
    with j % dilation == 0 beyond the window."""
    def one(attention):
        near = {j for j in range(seen) if seen - j < config.window}
        if attention == "swa":
            return len(near)
        if attention == "dilated":
            return len(near | {j for j in range(seen) if j % config.dilation == 0})
        return seen

    return [one(config.layer_attention(i)) for i in range(config.num_hidden_layers)]


def decode(model, x, chunks, attention_mask=None):
    """Logits of x fed through one cache in chunks of the given sizes, (B, T, V), and the cache."""
    cache, logits, start = None, [], 0
    for size in chunks:
        mask = None if attention_mask is None else attention_mask[:, : start + size]
        out = model(x[:, start : start + size], attention_mask=mask, cache=cache, use_cache=True)
        cache, start = out.cache, start + size
        logits.append(out.logits)
    assert start == x.shape[1]
    return torch.cat(logits, dim=1), cache


# prefill 13, one token at a time, a chunk of 7 once the window is full, one at a time to 40
CHUNKS = [13] + [1] * 10 + [7] + [1] * 10


def check_cache(cache, config, batch: int, seen: int):
    """Each layer holds exactly what it can read again, in tensors of exactly that size."""
    assert isinstance(cache, LayerwiseCache) and cache.get_seq_length() == seen
    heads, hs = config.num_attention_heads, config.head_dim
    for i, (layer, n) in enumerate(zip(cache.layers, kept(config, seen), strict=True)):
        assert type(layer) is LAYERS.get(config.layer_attention(i), type(layer))
        assert isinstance(layer, tuple(LAYERS.values())) == (config.layer_attention(i) in LAYERS)
        for t in (layer.keys, layer.values):
            assert t.shape == (batch, heads, n, hs)
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()  # no view pins a prompt
    want = sum(2 * batch * heads * n * hs * 4 for n in kept(config, seen))  # float32
    assert kv_cache_nbytes(cache) == want


@pytest.mark.parametrize("name", MODELS)
def test_chunked_decoding_equals_full_forward(name):
    model = tiny(**MODELS[name])
    x = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        full = model(x).logits
        got, cache = decode(model, x, CHUNKS)
        check_cache(decode(model, x[:, :13], CHUNKS[:1])[1], model.config, 2, 13)  # right after the prefill
    assert full.std() > 1  # logits far from uniform: attention matters
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)
    check_cache(cache, model.config, 2, 40)


@pytest.mark.parametrize("name", ["dilated", "dilated+full"])
def test_left_padded_dilated_decoding_equals_the_padded_forward(name):
    """A dilated layer's strided set is by absolute position, pads counted (as in the uncached
    forward), so a left-padded example is compared with the padded batch's full forward."""
    model = tiny(**MODELS[name])
    chunks = [15] + [1] * 6 + [4] + [1] * 6
    x = torch.randint(1, 97, (2, sum(chunks)))
    mask = torch.ones_like(x)
    mask[1, :13] = 0
    with torch.no_grad():
        got, cache = decode(model, x, chunks, attention_mask=mask)
        full = model(x, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], full[real], atol=1e-5, rtol=1e-5)
    check_cache(cache, model.config, 2, sum(chunks))


@pytest.mark.parametrize("name", ["swa", "swa+full"])
def test_left_padded_batch_equals_each_example_alone(name):
    """Example 1's 2-token prompt is left-padded to example 0's 15, so pads stay among the keys
    its SWA layers keep; both continue for 16 tokens."""
    model = tiny(**MODELS[name])
    prompt, chunks = 15, [15] + [1] * 6 + [4] + [1] * 6
    x = torch.randint(1, 97, (2, sum(chunks)))
    mask = torch.ones_like(x)
    mask[1, : prompt - 2] = 0
    with torch.no_grad():
        got, cache = decode(model, x, chunks, attention_mask=mask)
        for row in range(2):
            real = mask[row].bool()
            alone = model(x[row : row + 1, real]).logits[0]
            torch.testing.assert_close(got[row, real], alone, atol=1e-5, rtol=1e-5)
    check_cache(cache, model.config, 2, sum(chunks))


def test_greedy_generate_uses_the_sliding_cache_and_equals_full_forwards():
    model = tiny(**MODELS["swa"])
    x = torch.randint(1, 97, (2, 10))
    out = model.generate(x, max_new_tokens=20, do_sample=False, attention_mask=torch.ones_like(x),
                         pad_token_id=0, return_dict_in_generate=True)
    seq = x
    with torch.no_grad():
        for _ in range(20):
            seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out.sequences, seq)
    check_cache(out.cache, model.config, 2, 10 + 19)  # the last token is never fed back


def test_new_cache_only_slides_swa_layers():
    cache = new_cache(tiny(attention="vanilla").config)
    assert not any(isinstance(layer, tuple(LAYERS.values())) for layer in cache.layers)
    hybrid = new_cache(tiny(**MODELS["swa+full"]).config)
    assert [isinstance(layer, CompactSlidingWindowLayer) for layer in hybrid.layers] == [True, False, True]
    dilated = new_cache(tiny(**MODELS["dilated+full"]).config)
    assert [type(layer).__name__ for layer in dilated.layers] == ["DilatedLayer", "DynamicLayer", "DilatedLayer"]


def test_a_dilated_cache_holds_the_strided_set_not_every_key():
    """After 40 tokens at w = 5, r = 3: keys 0, 3, ..., 39 and 36-39, 16 of 40, at their positions."""
    model = tiny(**MODELS["dilated"])
    with torch.no_grad():
        _, cache = decode(model, torch.randint(0, 97, (1, 40)), CHUNKS)
    layer = cache.layers[0]
    assert layer.positions.tolist() == sorted(set(range(0, 40, 3)) | set(range(36, 40)))
    assert kv_cache_nbytes(cache) == 3 * 2 * 2 * 16 * model.config.head_dim * 4  # layers, k+v, heads, keys
