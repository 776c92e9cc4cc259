"""The synthetic recall corpus: layout invariants, the answer-only loss mask, scoring at exactly
the query positions, and the trainer reading the mask."""

import json
import types

import numpy as np
import pytest
import torch

from dimattn.data import DataError, load_loss_mask, load_tokens
from dimattn.recall import (
    RecallSettings,
    find_queries,
    generate_examples,
    predict_at_queries,
    score_queries,
    split_rng,
    write_recall_corpus,
)
from dimattn.training import evaluate_loss, labels_for

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

    def forward(self, x, labels=None):
        nxt = torch.roll(x, -1, dims=1)
        if self.wrong_at is not None:
            nxt[:, self.wrong_at] = 0
        logits = torch.nn.functional.one_hot(nxt, self.vocab).float() * 10
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                     ignore_index=-100)
        return types.SimpleNamespace(logits=logits, loss=loss)


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
