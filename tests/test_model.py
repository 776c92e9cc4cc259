"""The transformers model: save/load in a fresh process, generation, Pythia parameter counts."""

import json
import subprocess
import sys

import pytest
import torch

from dimattn import DimAttnConfig, DimAttnForCausalLM
from dimattn.modeling_dimattn import DimAttnCache, kv_cache_nbytes


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


def test_save_and_load_in_fresh_process(tmp_path):
    model = tiny()
    model.config.register_for_auto_class()
    model.register_for_auto_class("AutoModelForCausalLM")
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"]
    x = torch.randint(0, 97, (1, 12))
    expected = model(x).logits[0, -1].tolist()
    code = (
        "import sys, json, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, trust_remote_code=True).eval()\n"
        f"print(json.dumps(m(torch.tensor({x.tolist()})).logits[0, -1].tolist()))\n"
    )
    # a fresh interpreter: the modeling code comes from the saved directory (auto_map)
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"HF_HUB_OFFLINE": "1", "PATH": ""})
    assert out.returncode == 0, out.stderr
    torch.testing.assert_close(torch.tensor(json.loads(out.stdout.strip().splitlines()[-1])), torch.tensor(expected))


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
