"""The generation cache of SWA layers (LayerwiseCache): each keeps only the last window - 1
tokens, and decoding through it reproduces the full forward, with or without left padding."""

import pytest
import torch

from dimattn import DimAttnConfig, DimAttnForCausalLM
from dimattn.modeling_dimattn import CompactSlidingWindowLayer, LayerwiseCache, kv_cache_nbytes, new_cache

MODELS = {
    "swa": dict(attention="swa", window=5),
    "swa+full": dict(attention="swa", window=4, full_attention_every=2),  # layers 0, 2 SWA; 1 vanilla
    "swa-w1": dict(attention="swa", window=1),  # its own token only: nothing cached
}


def tiny(attention="swa", **kw):
    cfg = dict(vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, rotary_pct=0.5,
               max_position_embeddings=128, initializer_range=0.2, attention=attention, d_down=None,
               eos_token_id=None, bos_token_id=None)  # fmt: skip
    cfg.update(kw)
    torch.manual_seed(0)
    return DimAttnForCausalLM(DimAttnConfig(**cfg)).eval()


def kept(config, seen: int) -> list[int]:
    """Tokens each layer's cache should hold after ``seen`` tokens."""
    return [min(seen, config.window - 1) if config.layer_attention(i) == "swa" else seen
            for i in range(config.num_hidden_layers)]  # fmt: skip


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
        assert isinstance(layer, CompactSlidingWindowLayer) == (config.layer_attention(i) == "swa")
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
                         pad_token_id=0, return_dict_in_generate=True)  # fmt: skip
    seq = x
    with torch.no_grad():
        for _ in range(20):
            seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out.sequences, seq)
    check_cache(out.cache, model.config, 2, 10 + 19)  # the last token is never fed back


def test_new_cache_only_slides_swa_layers():
    for attention in ("vanilla", "dilated"):
        cache = new_cache(tiny(attention=attention, window=4).config)
        assert not any(isinstance(layer, CompactSlidingWindowLayer) for layer in cache.layers)
    hybrid = new_cache(tiny(**MODELS["swa+full"]).config)
    assert [isinstance(layer, CompactSlidingWindowLayer) for layer in hybrid.layers] == [True, False, True]
