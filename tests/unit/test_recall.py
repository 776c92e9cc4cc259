"""The synthetic recall corpus: layout invariants, the answer-only loss mask, scoring at exactly
the query positions, and the trainer reading the mask."""

import json
import types

import numpy as np
import pytest
import torch

from dimattn.data.corpora import DataError, load_loss_mask, load_tokens
from dimattn.data.recall import (
    RecallSettings,
    find_queries,
    generate_examples,
    predict_at_queries,
    score_queries,
    split_rng,
    write_recall_corpus,
)
from dimattn.pretraining.training import evaluate_loss, labels_for

SMALL = dict(seq_len=48, n_pairs=4, n_keys=8, n_values=8, n_filler=4, min_query_pos=24, n_train=64,
             n_validation=16, n_test=16)


@pytest.fixture(params=[False, True], ids=["adjacent", "fused"])
def settings(request):
    return RecallSettings(**SMALL, fused_pairs=request.param)


def test_every_query_asks_for_a_pair_beyond_the_window(settings):
    x = generate_examples(settings, 200, split_rng(0, "train"))
    q = find_queries(x, settings.layout())
    assert len(q) == 200 * settings.queries
    ex, pos, key_pos, target = q.T
    assert (pos >= settings.min_query_pos).all()
    assert (pos - key_pos >= settings.min_distance).all()
    stride = 1 if settings.fused_pairs else 2
    assert ((key_pos - 1) % stride == 0).all() and (key_pos < 1 + stride * settings.n_pairs).all()
    assert (x[ex, pos] >= settings.key_start).all() and (x[ex, pos] < settings.value_start).all()
    assert (target == x[ex, pos + 1]).all()  # the answer is the token after the query
    if settings.fused_pairs:  # the pair token k{i}v{j} holds the query's key and its answer
        pair = x[ex, key_pos] - settings.fused_start
        assert (pair // settings.n_values == x[ex, pos] - settings.key_start).all()
        assert (pair % settings.n_values == target - settings.value_start).all()
    else:
        assert (x[ex, key_pos] == x[ex, pos]).all() and (x[ex, key_pos + 1] == target).all()


def test_fused_vocabulary_is_disjoint_and_complete():
    s = RecallSettings(**SMALL, fused_pairs=True)
    assert s.fused_start == s.filler_start + s.n_filler
    assert s.vocab_size == s.fused_start + s.n_keys * s.n_values
    x = generate_examples(s, 50, split_rng(0, "test"))
    block = x[:, 1 : 1 + s.n_pairs]
    assert ((block >= s.fused_start) & (block < s.vocab_size)).all()
    assert (x[:, 1 + s.n_pairs : s.min_query_pos] >= s.filler_start).all()  # filler until the queries


def test_corrupted_pair_block_is_refused():
    s = RecallSettings(**SMALL, fused_pairs=True)
    x = generate_examples(s, 4, split_rng(0, "test"))
    x[2, 1] = s.filler_start  # a pair token replaced by noise
    with pytest.raises(DataError, match="break the recall layout"):
        find_queries(x, s.layout())


def test_corpus_writes_an_answer_mask_that_load_tokens_pairs_with(tmp_path):
    s = RecallSettings(**SMALL, fused_pairs=True)
    write_recall_corpus(s, tmp_path / "recall")
    tokens, meta = load_tokens(tmp_path / "recall/tokens/train.bin")
    mask = load_loss_mask(tmp_path / "recall/tokens/train.bin", meta)
    x = np.asarray(tokens).reshape(-1, s.seq_len)
    q = find_queries(x, meta["recall"])
    expected = np.zeros(x.shape, dtype=np.uint8)
    expected[q[:, 0], q[:, 1] + 1] = 1
    assert np.array_equal(np.asarray(mask).reshape(x.shape), expected)  # answers, and nothing else
    assert meta["example_len"] == s.seq_len and meta["vocab_size"] == s.vocab_size
    # a truncated mask is refused with its name
    path = tmp_path / "recall/tokens" / meta["loss_mask"]
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(DataError, match="loss mask"):
        load_loss_mask(tmp_path / "recall/tokens/train.bin", meta)


def test_no_mask_without_answer_loss(tmp_path):
    write_recall_corpus(RecallSettings(**SMALL, answer_loss=False), tmp_path / "r")
    _, meta = load_tokens(tmp_path / "r/tokens/train.bin")
    assert "loss_mask" not in meta and load_loss_mask(tmp_path / "r/tokens/train.bin", meta) is None


def test_bad_setting_names_the_field():
    with pytest.raises(DataError, match="fused_pairs"):
        RecallSettings(**SMALL, fused_pairs="yes")
    with pytest.raises(DataError, match="min_query_pos"):
        RecallSettings(**{**SMALL, "min_query_pos": 3})


def test_labels_keep_only_marked_targets():
    x = torch.arange(12).view(2, 6)
    mask = torch.zeros_like(x)
    mask[0, 3] = mask[1, 5] = 1
    labels = labels_for(x, mask)
    assert labels[0, 3] == 3 and labels[1, 5] == 11 and (labels == -100).sum() == 10
    assert labels_for(x, None) is x


class Oracle(torch.nn.Module):
    """Logits that put all mass on the token that comes next: a model that always recalls."""

    def __init__(self, vocab, wrong_at=None):
        super().__init__()
        self.vocab, self.wrong_at = vocab, wrong_at
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def forward(self, x=None, labels=None, input_ids=None, **kwargs):  # kwargs: return_logits, as transformers take
        x = input_ids if x is None else x
        nxt = torch.roll(x, -1, dims=1)
        if self.wrong_at is not None:
            nxt[:, self.wrong_at] = 0
        logits = torch.nn.functional.one_hot(nxt, self.vocab).float() * 10
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                     ignore_index=-100)
        # no cache: it holds no bytes (what the recall record's cache_bytes_per_token reads)
        return types.SimpleNamespace(logits=logits, loss=loss, past_key_values=types.SimpleNamespace(nbytes=lambda: 0))


def test_scoring_reads_exactly_the_query_positions(settings):
    x = generate_examples(settings, 32, split_rng(0, "test"))
    q = find_queries(x, settings.layout())
    bins = [settings.min_distance, settings.max_distance + 1]
    perfect = score_queries(predict_at_queries(Oracle(settings.vocab_size), x, q, batch_size=5), q, bins)
    assert perfect["accuracy"] == 1.0 and perfect["n_queries"] == len(q)
    # wrong everywhere except at the query positions: still perfect, so nothing else is read
    others = np.setdiff1d(np.arange(settings.seq_len), np.unique(q[:, 1]))
    assert score_queries(predict_at_queries(Oracle(settings.vocab_size, others), x, q, 7), q, bins)["accuracy"] == 1
    # wrong at one query slot: exactly that slot's share is lost
    slot = int(q[0, 1])
    lost = (q[:, 1] == slot).mean()
    got = score_queries(predict_at_queries(Oracle(settings.vocab_size, [slot]), x, q, 8), q, bins)["accuracy"]
    assert got == pytest.approx(1 - lost)


def test_validation_loss_counts_only_the_answers():
    """evaluate_loss takes (tokens, targets) pairs: an oracle that is right only at the
    answers has ~0 loss with the mask and a large one without."""
    s = RecallSettings(**SMALL, fused_pairs=True)
    x = torch.from_numpy(generate_examples(s, 8, split_rng(0, "validation")))
    q = find_queries(x.numpy(), s.layout())
    mask = torch.zeros_like(x)
    mask[q[:, 0], q[:, 1] + 1] = 1
    right_at_answers = np.setdiff1d(np.arange(s.seq_len), q[:, 1])
    model = Oracle(s.vocab_size, wrong_at=right_at_answers)
    masked = evaluate_loss(model, torch.stack([x, labels_for(x, mask)], 1), micro_batch_size=4)
    unmasked = evaluate_loss(model, x, micro_batch_size=4)
    assert masked < 0.05 < 1.0 < unmasked
    assert json.dumps(s.layout())  # the layout the meta records is plain JSON


# --- corpus files, tokenizer, layouts, evaluate_recall end to end ----------------------------


def _bytes(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_corpus_is_deterministic_from_the_seed_and_splits_differ(tmp_path):
    s = RecallSettings(**SMALL)
    write_recall_corpus(s, tmp_path / "a")
    write_recall_corpus(s, tmp_path / "b")
    write_recall_corpus(RecallSettings(**{**SMALL, "seed": 1}), tmp_path / "c")
    a, b, c = _bytes(tmp_path / "a"), _bytes(tmp_path / "b"), _bytes(tmp_path / "c")
    assert a == b  # same settings: the same files, byte for byte
    assert a["tokens/train.bin"] != c["tokens/train.bin"]
    splits = {n: np.asarray(load_tokens(tmp_path / f"a/tokens/{n}.bin")[0]).reshape(-1, s.seq_len) for n in
              ("train", "validation", "test")}
    # independent streams: the held-out splits are not a prefix of train, nor of each other
    assert not np.array_equal(splits["validation"], splits["train"][: s.n_validation])
    assert not np.array_equal(splits["test"], splits["validation"][: s.n_test])
    assert [len(v) for v in splits.values()] == [s.n_train, s.n_validation, s.n_test]
    assert not list((tmp_path).glob(".*.tmp"))  # nothing left over from the atomic writes


def test_load_tokens_reads_the_split_and_refuses_a_truncated_bin(tmp_path):
    s = RecallSettings(**SMALL)
    write_recall_corpus(s, tmp_path / "r")
    tokens, meta = load_tokens(tmp_path / "r/tokens/test.bin")
    assert tokens.dtype == np.uint16 and meta["n_tokens"] == s.n_test * s.seq_len == len(tokens)
    assert meta["example_len"] == s.seq_len and meta["split"] == "test"
    assert (meta["eos_token_id"], meta["bos_token_id"], meta["pad_token_id"]) == (0, 1, 2)
    path = tmp_path / "r/tokens/test.bin"
    path.write_bytes(path.read_bytes()[:-2])  # one token short
    with pytest.raises(DataError, match="bytes"):
        load_tokens(path)


def test_tokenizer_round_trip_and_special_ids(tmp_path):
    from transformers import AutoTokenizer

    from dimattn.data.corpora import SPECIAL_TOKENS
    from dimattn.data.recall import vocabulary

    s = RecallSettings(**SMALL)
    write_recall_corpus(s, tmp_path / "r")
    tok = AutoTokenizer.from_pretrained(tmp_path / "r/tokenizer")
    assert len(tok) == s.vocab_size == len(vocabulary(s))
    # the special tokens of dimattn.data.corpora, at the same ids
    assert [tok.convert_ids_to_tokens(i) for i in range(3)] == SPECIAL_TOKENS
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (0, 1, 2)
    x = np.asarray(load_tokens(tmp_path / "r/tokens/train.bin")[0][: s.seq_len]).tolist()
    text = tok.decode(x)
    assert text.split()[:3] == ["<|bos|>", tok.convert_ids_to_tokens(x[1]), tok.convert_ids_to_tokens(x[2])]
    assert tok(text, add_special_tokens=False)["input_ids"] == x


def test_id_ranges_are_disjoint():
    s = RecallSettings(**SMALL)
    ranges = [range(0, s.key_start), range(s.key_start, s.value_start), range(s.value_start, s.filler_start),
              range(s.filler_start, s.vocab_size)]
    assert [len(r) for r in ranges[1:]] == [s.n_keys, s.n_values, s.n_filler]
    assert sum(map(len, ranges)) == s.vocab_size  # a partition of the vocabulary
    x = generate_examples(s, 100, split_rng(0, "train"))
    q = find_queries(x, s.layout())
    assert np.isin(x[:, 2 : 1 + 2 * s.n_pairs : 2], ranges[2]).all()  # pair values are values
    filler = np.ones(x.shape, dtype=bool)
    filler[:, : 1 + 2 * s.n_pairs] = filler[:, -1] = False
    filler[q[:, 0], q[:, 1]] = filler[q[:, 0], q[:, 1] + 1] = False
    assert np.isin(x[filler], ranges[3]).all()  # everything else between is filler


@pytest.mark.parametrize("sorted_keys", [False, True])
def test_marker_queries_are_scored_at_the_marker(sorted_keys):
    from dimattn.data.recall import QUERY_ID

    s = RecallSettings(**SMALL, query_marker=True, sorted_keys=sorted_keys)
    x = generate_examples(s, 100, split_rng(0, "test"))
    ex, pos, key_pos, target = find_queries(x, s.layout()).T
    assert (x[ex, pos] == QUERY_ID).all() and (x[ex, pos - 1] == x[ex, key_pos]).all()
    assert (x[ex, key_pos + 1] == target).all() and (x[ex, pos + 1] == target).all()
    assert (pos - key_pos >= s.min_distance).all() and (pos - key_pos).max() <= s.max_distance
    keys = x[:, 1 : 1 + 2 * s.n_pairs : 2]
    assert (np.diff(keys, axis=1) > 0).all() == sorted_keys


def test_bad_settings_name_their_field():
    for field, bad in [("n_pairs", 0), ("n_keys", 2), ("seq_len", 30), ("n_queries", 9), ("seed", -1),
                       ("n_values", 1.5), ("query_marker", 1)]:
        with pytest.raises(DataError, match=field):
            RecallSettings(**{**SMALL, field: bad})
    with pytest.raises(DataError, match="unknown recall settings"):
        RecallSettings.from_spec({"source": "synthetic_recall", **SMALL, "n_pair": 3})
    with pytest.raises(DataError, match="source"):
        RecallSettings.from_spec({"source": "pypi_sdist", **SMALL})
    assert RecallSettings.from_spec({"source": "synthetic_recall", **SMALL}) == RecallSettings(**SMALL)


def _saved_tiny_model(path, vocab_size, seq_len):
    from dimattn import DimAttnConfig, DimAttnForCausalLM

    torch.manual_seed(0)
    model = DimAttnForCausalLM(DimAttnConfig(vocab_size=vocab_size, hidden_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, max_position_embeddings=seq_len,
                                             attention="dar", window=4, d_down=4))
    model.config.register_for_auto_class()
    model.register_for_auto_class("AutoModelForCausalLM")
    model.save_pretrained(path)
    return model


class Constant(torch.nn.Module):
    """Always predicts one token."""

    def __init__(self, vocab, token):
        super().__init__()
        self.vocab, self.token = vocab, token
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def forward(self, x=None, input_ids=None, **kwargs):
        x = input_ids if x is None else x
        logits = torch.zeros(*x.shape, self.vocab)
        logits[..., self.token] = 1.0
        return types.SimpleNamespace(logits=logits, past_key_values=types.SimpleNamespace(nbytes=lambda: 0))


def test_evaluate_recall_writes_the_summary(tmp_path, monkeypatch):
    import dimattn.evaluation.scoring
    from dimattn.evaluation.scoring import evaluate_recall
    from dimattn.data.recall import load_examples

    s = RecallSettings(**SMALL)
    write_recall_corpus(s, tmp_path / "r")
    test_bin = tmp_path / "r/tokens/test.bin"
    model_dir = tmp_path / "recall-dar-w4-d4"
    _saved_tiny_model(model_dir, s.vocab_size, s.seq_len)
    result = evaluate_recall(model_dir, test_bin, tmp_path / "out.json", batch_size=5, device="cpu", corpus="recall")
    assert json.loads((tmp_path / "out.json").read_text()) == result
    assert result["run"] == "recall-dar-w4-d4" and result["attention"] == "dar"
    assert result["d_down"] == 4 and result["window"] == 4
    assert result["corpus"] == "recall" and result["split"] == "test"
    assert result["n_queries"] == s.n_test * s.queries and 0 <= result["accuracy"] <= 1
    assert result["chance"] == 1 / s.n_values
    # DimAttnCache over a 48-token example: the d_down = 4 latent of every slot, full keys and
    # values (16 dims) of the last w - 1 = 3, and each slot's int32 position
    assert result["cache_bytes_per_token"] == pytest.approx(((4 * 48 + 2 * 16 * 3) * 4 + 48 * 4) / 48)
    bins = result["by_distance"]
    assert sum(b["n"] for b in bins) == result["n_queries"]
    assert bins[0]["min_distance"] == s.min_distance and bins[-1]["max_distance"] == s.max_distance
    assert all(a["max_distance"] + 1 == b["min_distance"] for a, b in zip(bins, bins[1:]))

    # an oracle (the next token, everywhere) recalls everything, in every bin
    def stand_in(model):
        model.config = types.SimpleNamespace(vocab_size=s.vocab_size)  # what evaluate_recall checks
        return lambda d, device: model

    monkeypatch.setattr(dimattn.evaluation.scoring, "load_model", stand_in(Oracle(s.vocab_size)))
    perfect = evaluate_recall(model_dir, test_bin, tmp_path / "oracle.json", batch_size=3, device="cpu",
                              distance_bins=[s.min_distance, 20, s.max_distance + 1])
    assert perfect["accuracy"] == 1.0 and [b["accuracy"] for b in perfect["by_distance"]] == [1.0, 1.0]
    # a constant model scores the share of answers that happen to be its token
    examples, meta = load_examples(test_bin)
    targets = find_queries(examples, meta["recall"])[:, 3]
    v = int(np.bincount(targets).argmax())
    monkeypatch.setattr(dimattn.evaluation.scoring, "load_model", stand_in(Constant(s.vocab_size, v)))
    const = evaluate_recall(model_dir, test_bin, tmp_path / "const.json", batch_size=4, device="cpu")
    assert const["accuracy"] == pytest.approx((targets == v).mean()) and const["accuracy"] < 1


def test_evaluate_recall_refuses_a_corpus_that_breaks_the_layout(tmp_path):
    from dimattn.evaluation.scoring import evaluate_recall

    s = RecallSettings(**SMALL)
    write_recall_corpus(s, tmp_path / "r")
    path = tmp_path / "r/tokens/test.bin"
    x = np.fromfile(path, dtype=np.uint16).reshape(-1, s.seq_len)
    q = find_queries(x.astype(np.int64), s.layout())
    x[q[0, 0], q[0, 1] + 1] = s.value_start + (x[q[0, 0], q[0, 1] + 1] - s.value_start + 1) % s.n_values
    x.tofile(path)  # one answer no longer matches its pair
    _saved_tiny_model(tmp_path / "m", s.vocab_size, s.seq_len)
    with pytest.raises(DataError, match="break the recall layout"):
        evaluate_recall(tmp_path / "m", path, tmp_path / "out.json", batch_size=4, device="cpu")
    assert not (tmp_path / "out.json").exists()


# --- the probe through the KV cache (projected models, KV compression: seed 003 Table 5) --------


def _probe_model(vocab_size, layers=1, heads=1, seed=0):
    from dimattn import DimAttnConfig, DimAttnForCausalLM

    torch.manual_seed(seed)
    config = DimAttnConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=layers, num_attention_heads=heads,
                           attention="vanilla", max_position_embeddings=128, initializer_range=0.3)
    return DimAttnForCausalLM(config).eval()


def _probe_data(n=6):
    from dimattn.data.recall import find_queries, generate_examples

    s = RecallSettings(**SMALL)
    examples = generate_examples(s, n, np.random.default_rng(0))
    return s, examples, find_queries(examples, s.layout())


def test_the_probe_through_the_cache_equals_one_forward_without_compression():
    from dimattn.model.affine import Affine
    from dimattn.model.modeling_projected import attach_projections
    from dimattn.data.recall import predict_at_queries, predict_through_cache

    s, examples, queries = _probe_data()
    model = _probe_model(s.vocab_size, layers=2, heads=2)
    g = torch.Generator().manual_seed(1)
    projections = {i: Affine(torch.randn(4, 16, generator=g), torch.randn(4, generator=g)) for i in range(2)}
    for num_projected in (0, 1, 2):
        attach_projections(model, projections, num_projected)
        one_pass = predict_at_queries(model, examples, queries, batch_size=4)
        assert np.array_equal(predict_through_cache(model, examples, queries, s.min_query_pos, batch_size=4), one_pass)
    # a projection that changes attention changes predictions: the check above can fail
    assert not np.array_equal(one_pass, predict_at_queries(_probe_model(s.vocab_size, 2, 2), examples, queries, 4))
    with pytest.raises(ValueError, match="prefill must be in 1"):
        predict_through_cache(model, examples, queries, s.seq_len, batch_size=4)


def test_the_probe_through_an_evicting_cache_matches_a_naive_replay(monkeypatch):
    """One layer and one head: after SnapKV evicts, each decoded token sees the kept prompt tokens
    and the decoded ones at their own positions; a forward of exactly those tokens (keys of a
    one-layer model depend on token and position only) gives the same prediction."""
    from dimattn.model import modeling_projected
    from dimattn.model.modeling_projected import attach_projections
    from dimattn.data.recall import predict_through_cache

    s, examples, queries = _probe_data(n=3)
    model = _probe_model(s.vocab_size)
    prefill = s.min_query_pos
    kept = []
    compress = modeling_projected.snapkv_compress

    def spy(queries_, keys, values, settings, scale):
        from dimattn.model.kv_compression import snapkv_indices

        kept.append(snapkv_indices(queries_, keys, settings, scale)[:, 0])  # (B, budget): one KV head
        return compress(queries_, keys, values, settings, scale)

    monkeypatch.setattr(modeling_projected, "snapkv_compress", spy)
    attach_projections(model, {}, 0, kv={"snapkv": {"budget": prefill // 2, "window": 4, "kernel": 3}})
    predictions = predict_through_cache(model, examples, queries, prefill, batch_size=3)
    assert len(kept) == 1 and kept[0].shape == (3, prefill // 2)
    attach_projections(model, {}, 0)
    x = torch.from_numpy(examples)
    replay = []
    with torch.no_grad():
        for ex, pos, _, _ in queries:
            seen = torch.cat([kept[0][ex], torch.arange(prefill, pos + 1)])
            logits = model(input_ids=x[ex, seen][None], position_ids=seen[None]).logits
            replay.append(int(logits[0, -1].argmax()))
    assert np.array_equal(predictions, np.array(replay))
    attach_projections(model, {}, 0)
    full = predict_through_cache(model, examples, queries, prefill, batch_size=3)
    assert not np.array_equal(predictions, full)  # the eviction mattered


def test_a_recall_corpus_is_captured_in_whole_examples(tmp_path):
    from dimattn.dimpo.capture import token_windows
    from dimattn.data.corpora import DataError
    from dimattn.data.recall import load_examples

    s = RecallSettings(**SMALL)
    write_recall_corpus(s, tmp_path / "r")
    bin_path = tmp_path / "r/tokens/validation.bin"
    windows = token_windows(bin_path, s.seq_len, 3)
    assert windows.tolist() == load_examples(bin_path)[0][:3].tolist()
    with pytest.raises(DataError, match=f"examples of {s.seq_len} tokens; capture at seq_len {s.seq_len}, not 16"):
        token_windows(bin_path, 16, 3)
    with pytest.raises(DataError, match="fewer than 1000 windows"):
        token_windows(bin_path, s.seq_len, 1000)


def test_score_projected_runs_the_probe_through_a_projected_directory(tmp_path):
    """The workflow's score_projected on a projected recall model (l = 1, SnapKV): the probe's
    record, as the prediction through the directory's own cache gives it."""
    from dimattn import DimAttnConfig, DimAttnForCausalLM
    from dimattn.model.affine import Affine, save_projections
    from dimattn.evaluation.projected import score_projected
    from dimattn.evaluation.scoring import load_model
    from dimattn.model.configuration_projected import save_projected_model
    from dimattn.data.recall import find_queries, load_examples, predict_through_cache

    s = RecallSettings(**SMALL)
    write_recall_corpus(s, tmp_path / "r")
    test_bin = tmp_path / "r/tokens/test.bin"
    torch.manual_seed(0)
    base = DimAttnForCausalLM(DimAttnConfig(vocab_size=s.vocab_size, hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=2, attention="vanilla", max_position_embeddings=128))
    base.config.register_for_auto_class()
    base.register_for_auto_class("AutoModelForCausalLM")
    base.save_pretrained(tmp_path / "run")
    (tmp_path / "r/tokenizer").rename(tmp_path / "tok")
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tmp_path / "tok").save_pretrained(tmp_path / "run")
    g = torch.Generator().manual_seed(1)
    save_projections({i: Affine(torch.randn(4, 16, generator=g), torch.zeros(4)) for i in range(2)},
                     tmp_path / "p.safetensors", {"objective": "kl", "d_prime": 4})
    kv = {"snapkv": {"budget": s.min_query_pos // 2, "window": 4, "kernel": 3}}
    model_dir = save_projected_model(tmp_path / "projected", str(tmp_path / "run"), tmp_path / "p.safetensors",
                                     num_projected=1, scale="d_prime", kv=kv)
    record = score_projected(model_dir, {"model": "r"}, tokens={}, seq_len=64, batch_size=4, max_tokens=None,
                             tasks=[], limit=None, out_json=tmp_path / "out.json", recall={"recall": test_bin},
                             device="cpu", precision="fp32")
    probe = record["recall"]["recall"]
    assert probe["prefill"] == s.min_query_pos and probe["n_queries"] == s.n_test * s.queries
    examples, meta = load_examples(test_bin)
    queries = find_queries(examples, meta["recall"])
    predictions = predict_through_cache(load_model(model_dir, "cpu"), examples, queries, s.min_query_pos, 4)
    assert probe["accuracy"] == pytest.approx(float((predictions == queries[:, 3]).mean()))
    assert json.loads((tmp_path / "out.json").read_text())["recall"] == record["recall"]
