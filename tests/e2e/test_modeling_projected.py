"""dimattn.model.modeling_projected: projections applied to the last l layers of Llama, Qwen2, Qwen3 and
our own models, against a naive reference written from seed 003's equation; the KV cache holding
F(k); and the projected model directory that AutoModelForCausalLM (and lm-eval) loads."""

import math
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.modeling_utils import AttentionInterface

from dimattn import DimAttnConfig, DimAttnForCausalLM
from dimattn.model.affine import Affine, save_projections
from dimattn.model.configuration_projected import save_projected_model
from dimattn.model.modeling_projected import (
    ProjectedCache,
    attach_projections,
    attention_modules,
)

D_PRIME = 4
REPO = Path(__file__).resolve().parents[2]


def llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))


def qwen2():
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))


def qwen3():
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=128))


def ours():
    return DimAttnForCausalLM(DimAttnConfig(vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                            attention="vanilla", max_position_embeddings=128, initializer_range=0.2))


MODELS = {"llama": llama, "qwen2": qwen2, "qwen3": qwen3, "ours": ours}


def build(name, seed=0):
    torch.manual_seed(seed)
    return MODELS[name]().eval()


def head_dim(model):
    return next(iter(attention_modules(model).values())).head_dim


def random_projections(model, d_prime=D_PRIME, seed=1):
    g = torch.Generator().manual_seed(seed)
    d = head_dim(model)
    return {
        layer: Affine(torch.randn(d_prime, d, generator=g) / math.sqrt(d), 0.1 * torch.randn(d_prime, generator=g))
        for layer in attention_modules(model)
    }


def ids(n=2, t=12, seed=3):
    return torch.randint(0, 300, (n, t), generator=torch.Generator().manual_seed(seed))


# ---- the naive reference: seed 003's projected attention, head by head -----------------------------


def naive_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """softmax(F(q_h) F(K_g)^T s + causal) V_g on projected layers, softmax(q K^T scaling + causal) V
    elsewhere; g = h // (H / H_kv). Loops over batch and heads; no cache (full keys)."""
    b, h, t, _ = query.shape
    group = h // key.shape[1]
    proj = getattr(module, "dimattn_projection", None)
    out = torch.zeros(b, h, t, value.shape[-1], dtype=query.dtype)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for i in range(b):
        for head in range(h):
            q, k, v = query[i, head], key[i, head // group], value[i, head // group]
            if proj is None:
                logits = q @ k.T * scaling
            else:
                fq, fk = q @ proj.W.T + proj.b, k @ proj.W.T + proj.b
                logits = fq @ fk.T * module.dimattn_scale
            logits = logits.masked_fill(~causal, float("-inf"))
            out[i, head] = torch.softmax(logits, dim=-1) @ v
    return out.transpose(1, 2), None


AttentionInterface.register("naive_projected", naive_attention)


def naive_logits(model, input_ids):
    previous = model.config._attn_implementation
    model.config._attn_implementation = "naive_projected"
    try:
        return model(input_ids, use_cache=False).logits
    finally:
        model.config._attn_implementation = previous


# ---- tests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("num_projected, scale", [(1, "d_prime"), (3, "d_prime"), (2, "d")])
def test_projected_logits_match_the_naive_reference(name, num_projected, scale):
    model = build(name)
    attach_projections(model, random_projections(model), num_projected, scale)
    x = ids()
    got = model(x).logits
    want = naive_logits(model, x)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    base = build(name)(x).logits
    assert not torch.allclose(got, base, atol=1e-3)  # the projection does change the model
    layers = [idx for idx, m in attention_modules(model).items() if m.dimattn_projection is not None]
    assert layers == list(range(3 - num_projected, 3))  # the last l layers
    d = head_dim(model)
    expected = 1 / math.sqrt(D_PRIME if scale == "d_prime" else d)
    assert all(attention_modules(model)[i].dimattn_scale == pytest.approx(expected) for i in layers)


@pytest.mark.parametrize("name", list(MODELS))
def test_identity_projection_and_zero_layers_give_the_base_model(name):
    x = ids()
    base = build(name)(x).logits
    model = build(name)
    d = head_dim(model)
    identity = {layer: Affine(torch.eye(d), torch.zeros(d)) for layer in attention_modules(model)}
    attach_projections(model, identity, 3, "d_prime")  # d' = d: 1/sqrt(d') is the model's own scale
    torch.testing.assert_close(model(x).logits, base, atol=1e-5, rtol=1e-5)
    model = build(name)
    attach_projections(model, random_projections(model), 0)
    # SDPA on every layer now (ours ran its own kernel): equal up to float rounding.
    torch.testing.assert_close(model(x).logits, base, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama", "qwen3", "ours"])
def test_generation_caches_projected_keys(name):
    """Keys are projected before the cache: d' numbers a key on projected layers, d elsewhere;
    greedy decoding with that cache equals decoding without one."""
    model = build(name)
    attach_projections(model, random_projections(model), 2)
    prompt = ids(n=1, t=6)
    out = model.generate(prompt, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                         pad_token_id=0)
    cache = out.past_key_values
    assert isinstance(cache, ProjectedCache)
    d = head_dim(model)
    assert [layer.keys.shape[-1] for layer in cache.layers] == [d, D_PRIME, D_PRIME]
    assert [layer.values.shape[-1] for layer in cache.layers] == [d, d, d]
    assert cache.layers[0].keys.shape[-2] == 11  # prompt + 5 decoded (the last token is not fed back)
    sequence = prompt
    for _ in range(6):  # no cache: the full sequence each step
        nxt = model(sequence, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        sequence = torch.cat([sequence, nxt], dim=1)
    assert torch.equal(out.sequences, sequence)
    kv_heads = cache.layers[0].keys.shape[1]
    assert cache.nbytes() == 4 * 11 * kv_heads * ((d + d) + 2 * (D_PRIME + d))  # fp32: one full layer, two projected


def test_attach_errors_name_the_problem():
    model = build("llama")
    with pytest.raises(ValueError, match="cannot project 4 of 3 layers"):
        attach_projections(model, random_projections(model), 4)
    partial = {2: random_projections(model)[2]}
    with pytest.raises(ValueError, match=r"no projection for layer\(s\) \[1\]"):
        attach_projections(model, partial, 2)


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    """A tiny Llama (a hub-style directory) and one of our runs, each with a tokenizer and a
    projections file, and a projected model directory of each."""
    from dimattn.data.corpora import train_tokenizer, write_documents

    root = tmp_path_factory.mktemp("projected")
    words = "to be or not that is the question whether tis nobler in the mind to suffer".split()
    g = torch.Generator().manual_seed(0)
    docs = [{"id": f"d{i}", "text": " ".join(words[j] for j in torch.randint(0, len(words), (80,), generator=g))}
            for i in range(3)]
    write_documents(docs, root / "docs.jsonl")
    out = {}
    for name in ("llama", "ours"):
        base_dir = root / f"{name}-base"
        tokenizer = train_tokenizer(root / "docs.jsonl", vocab_size=300, out_dir=base_dir)
        model = build(name)
        model.resize_token_embeddings(len(tokenizer))
        model.save_pretrained(base_dir)
        save_projections(random_projections(model), root / f"{name}.safetensors", {"objective": "kl", "seed": 0})
        projected = save_projected_model(root / f"{name}-projected", str(base_dir), root / f"{name}.safetensors",
                                         num_projected=2, scale="d_prime")
        out[name] = (base_dir, root / f"{name}.safetensors", projected)
    return out


@pytest.mark.parametrize("name", ["llama", "ours"])
def test_projected_directory_loads_with_auto_model(directories, name):
    from dimattn.model.affine import load_projections

    base_dir, projections_path, projected = directories[name]
    assert {"config.json", "projections.safetensors", "modeling_projected.py", "configuration_projected.py",
            "affine.py", "hf.py", "atomic.py", "tokenizer.json"} <= {p.name for p in projected.iterdir()}
    config = AutoConfig.from_pretrained(projected, trust_remote_code=True)
    loaded = AutoModelForCausalLM.from_pretrained(projected, trust_remote_code=True).eval()
    assert type(config).__name__ == "ProjectedConfig" and type(config).__module__.endswith(".configuration_projected")
    reference = AutoModelForCausalLM.from_pretrained(base_dir, trust_remote_code=name == "ours").eval()
    projections, _ = load_projections(projections_path)
    attach_projections(reference, projections, 2, "d_prime")
    x = ids(t=10)
    torch.testing.assert_close(loaded(x).logits, reference(x).logits)
    assert type(loaded).__name__.startswith("Projected")


def test_writing_a_projected_directory_needs_no_modeling_stack(directories, tmp_path):
    """project_model (a config, a tokenizer and files copied) imports neither transformers'
    modeling stack nor the loader: about 2 s of a 4.5 s job, before."""
    import subprocess
    import sys

    base_dir, projections_path, _ = directories["llama"]
    code = (
        "import sys; from dimattn.model.configuration_projected import save_projected_model; "
        f"save_projected_model({str(tmp_path / 'p')!r}, {str(base_dir)!r}, {str(projections_path)!r}, 2, 'd_prime'); "
        "heavy = [m for m in ('transformers.modeling_utils', 'dimattn.model.modeling_projected') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    assert (tmp_path / "p" / "modeling_projected.py").is_file()


def test_save_refuses_more_layers_than_the_model_has(directories, tmp_path):
    base_dir, projections_path, _ = directories["llama"]
    with pytest.raises(ValueError, match="cannot project 5 of 3 layers"):
        save_projected_model(tmp_path / "bad", str(base_dir), projections_path, num_projected=5, scale="d_prime")
    assert not (tmp_path / "bad").exists()


# ---- with KV-cache compression (seed 003, Table 5) ------------------------------------------------


def greedy(model, prompt, steps=6):
    out = model.generate(prompt, max_new_tokens=steps, do_sample=False, return_dict_in_generate=True,
                         pad_token_id=0)
    return out.sequences, out.past_key_values


def test_kivi_cache_quantises_projected_keys(monkeypatch):
    from dimattn.model import kv_compression
    from dimattn.model.kv_compression import KIVILayer, KIVISettings

    prompt = ids(n=1, t=20)
    model = build("llama")
    projections = random_projections(model)
    attach_projections(model, projections, 2)
    plain, _ = greedy(model, prompt)
    # A residual longer than the sequence keeps everything in full precision: nothing changes.
    attach_projections(model, projections, 2, kv={"kivi": {"bits": 2, "group_size": 4, "residual": 32}})
    same, cache = greedy(model, prompt)
    assert torch.equal(same, plain) and all(layer.kivi is not None for layer in cache.layers)
    # KIVI leaves the prefill's attention exact, so loglikelihoods (one forward) do not move.
    with torch.no_grad():
        attach_projections(model, projections, 2)
        exact = model(prompt, use_cache=True).logits
        attach_projections(model, projections, 2, kv={"kivi": {"bits": 2, "group_size": 4, "residual": 8}})
        torch.testing.assert_close(model(prompt, use_cache=True).logits, exact, rtol=0, atol=0)
    # R = 8: every layer's cache is KIVI's own layer fed that layer's (projected) keys step by step.
    calls = {}
    update = kv_compression.KIVILayer.update

    def spy(self, keys, values):
        calls.setdefault(id(self), []).append((keys.clone(), values.clone()))
        return update(self, keys, values)

    monkeypatch.setattr(kv_compression.KIVILayer, "update", spy)
    settings = {"bits": 2, "group_size": 4, "residual": 8}
    attach_projections(model, projections, 2, kv={"kivi": settings})
    _, cache = greedy(model, prompt)
    for layer, width in zip(cache.layers, [16, D_PRIME, D_PRIME]):
        steps = calls[id(layer.kivi)]
        assert [k.shape[-2] for k, _ in steps] == [20, 1, 1, 1, 1, 1] and steps[0][0].shape[-1] == width
        reference = KIVILayer(KIVISettings(**settings))
        for keys, values in steps:
            update(reference, keys, values)
        ref_keys, ref_values = reference.dequantized()
        assert torch.equal(layer.keys, ref_keys) and torch.equal(layer.values, ref_values)
        assert layer.nbytes() == reference.nbytes()
    fp32 = sum(4 * layer.keys.numel() + 4 * layer.values.numel() for layer in cache.layers)
    assert cache.nbytes() < fp32 / 2


def test_snapkv_keeps_its_budget_after_the_prefill(monkeypatch):
    from dimattn.model import modeling_projected
    from dimattn.model.kv_compression import snapkv_indices

    prompt = ids(n=1, t=24)
    model = build("llama")
    projections = random_projections(model)
    attach_projections(model, projections, 2)
    plain, _ = greedy(model, prompt, steps=4)
    with torch.no_grad():
        full = model(prompt, use_cache=True).past_key_values  # every prompt key, F(k) on projected layers
    calls = []
    compress = modeling_projected.snapkv_compress

    def spy(queries, keys, values, settings, scale):
        calls.append((queries, keys, settings, scale))
        return compress(queries, keys, values, settings, scale)

    monkeypatch.setattr(modeling_projected, "snapkv_compress", spy)
    attach_projections(model, projections, 2, kv={"snapkv": {"budget": 12, "window": 4, "kernel": 3}})
    sequences, cache = greedy(model, prompt, steps=4)
    assert sequences[0, 24] == plain[0, 24]  # the prefill attends to every key
    # budget kept after the prefill, then a key a decoded token (the last one is not fed back)
    assert [layer.keys.shape[-2] for layer in cache.layers] == [12 + 3] * 3
    assert len(calls) == 3  # once a layer, at the prefill
    for layer, before, (queries, keys, settings, scale), width in zip(cache.layers, full.layers, calls,
                                                                      [16, D_PRIME, D_PRIME]):
        assert queries.shape[-1] == keys.shape[-1] == width  # F(q), F(k) on projected layers
        assert scale == pytest.approx(1 / math.sqrt(width))
        torch.testing.assert_close(keys, before.keys)
        index = snapkv_indices(queries, before.keys, settings, scale)
        kept = before.keys.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, width))
        torch.testing.assert_close(layer.keys[:, :, :12], kept)


def test_lm_eval_cli_scores_a_projected_tiny_llama_on_our_task_and_ruler(tmp_path):
    """A projected directory of a random tiny Llama with GQA, through lm-eval's own CLI (`--model
    hf`): our next-line task, and RULER's niah_single_1 (it generates its data, no download) at
    2048 tokens, the shortest length we allow (dimattn.workflow.vocabulary.RULER_MIN_LENGTH)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from dimattn.workflow import paths
    from dimattn.evaluation.scoring import write_lm_eval_data

    base = tmp_path / "llama"
    words = ("the a of and to in is was he she it they on for with as at by from this that grass sky sun "
             "green blue yellow here there go come magic number key value special hidden remember what").split()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {w: i + 3 for i, w in enumerate(dict.fromkeys(words))}
    # Digits and punctuation, one token each, so that any RULER text tokenises.
    for ch in "0123456789.,:;?!'\"-()[]{}/":
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(True)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                        model_max_length=4096)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(base)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=4096, bos_token_id=1, eos_token_id=2))
    model.save_pretrained(base)
    save_projections(random_projections(model), tmp_path / "p.safetensors", {"objective": "kl", "seed": 0})
    projected = save_projected_model(tmp_path / "projected", str(base), tmp_path / "p.safetensors", num_projected=1,
                                     scale="d_prime")
    docs = tmp_path / "docs.jsonl"
    lines = "\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(8)) for i in range(60))
    docs.write_text(json.dumps({"id": "d0", "text": lines}) + "\n")
    # The task YAMLs read results/lm_eval_data/ of the directory lm-eval runs in.
    data = {name: tmp_path / paths.lm_eval_data(name) for name in ("dimattn_heldout", "dimattn_next_line")}
    write_lm_eval_data(docs, data, heldout_docs=1, next_line_docs=4, skip_lines=None, seed=0)

    # One CLI run for both tasks, as each run pays lm-eval's task index and RULER's word list (about
    # 10 s of CPU); the chat template (the text and a newline) and RULER's metadata reach our task too.
    out = subprocess.run(
        [
            str(Path(sys.executable).parent / "lm_eval"),
            "--model",
            "hf",
            "--model_args",
            f"pretrained={projected},trust_remote_code=True",
            "--tasks",
            "dimattn_next_line,niah_single_1",
            "--include_path",
            str(Path(__file__).parents[2] / "dimattn/evaluation/lm_eval_tasks"),
            "--limit",
            "2",
            "--batch_size",
            "1",
            "--apply_chat_template",
            "--metadata",
            json.dumps({"max_seq_lengths": [2048]}),
            "--output_path",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    assert "dimattn_next_line" in results and 0 <= results["dimattn_next_line"]["acc,none"] <= 1
    assert "niah_single_1" in results and "2048,none" in results["niah_single_1"]
