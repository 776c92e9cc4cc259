"""dimattn.data.longctx, the RULER-style suite: hand-written examples per subtask, every generated
answer recovered from its context by a naive solver written from the subtask's definition, the
refusals, the corpus files, greedy generation through the cache, and lm-eval's metric on
hand-made predictions."""

import dataclasses
import json
from collections import Counter

import numpy as np
import pytest
import torch

from dimattn.data.corpora import DataError, load_loss_mask, load_tokens
from dimattn.data.longctx import SUBTASKS, LongContextSettings, find_answers, generate_examples, score_predictions
from dimattn.data.longctx import needle_depths, needle_scores, score_suite, vocabulary, write_longctx_corpus

SMALL = dict(n_keys=12, n_values=12, n_words=16, n_train=16, n_validation=16, n_test=16)


def ids(settings, text: str) -> list[int]:
    vocab = vocabulary(settings)
    return [vocab[name] for name in text.split()]


def solve(settings, x) -> list[int]:
    """The answer of example ``x`` from its context alone, by the subtask's definition, written
    without the generator's structure: parse "a = b" triples, count words, follow chains."""
    names = {i: n for n, i in vocabulary(settings).items()}
    tokens = [names[int(t)] for t in x]
    task = next(t[2:-2] for t in tokens if t[2:-2] in SUBTASKS)
    start = tokens.index(f"<|{task}|>")
    context = tokens[1:start]
    if settings.question_first:  # <|task|> <|query|> arguments answer
        args = tokens[start + 2 : start + 1 + settings.question_len(task)]
    else:  # <|task|> arguments <|query|> answer
        args = tokens[start + 1 : tokens.index("<|query|>")]
    def statements(tokens):
        """The statements (a, b) of a stretch of context, in order."""
        if settings.needles == "fused":  # one pair token each: a03_05 is k03 = v05, c03_05 k03 = k05, f03_05 w03 = v05
            sides = {"a": ("k", "v"), "c": ("k", "k"), "f": ("w", "v")}
            pairs = [(t[0], *t[1:].split("_")) for t in tokens if t[0] in sides and "_" in t]
            return [(sides[kind][0] + a, sides[kind][1] + b) for kind, a, b in pairs]
        return [(tokens[i - 1], tokens[i + 1]) for i in range(1, len(tokens) - 1) if tokens[i] == "="]

    triples = statements(context)
    vocab = vocabulary(settings)
    if task in ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"):
        answer = [b for key in args for a, b in triples if a == key]
    elif task == "vt":
        chain, found = {args[0]}, []
        for a, b in triples:  # assignments in context order
            if b in chain:
                chain.add(a)
                found.append(a)
        answer = found
    elif task == "cwe":
        counts = Counter(context)
        top = sorted(counts.values(), reverse=True)[settings.cwe_words - 1]
        answer = list(dict.fromkeys(w for w in context if counts[w] >= top))
    elif task == "fwe":
        answer = [w for w, _ in Counter(context).most_common(settings.fwe_words)]
    else:  # qa: the document whose title is asked, its fact on the asked attribute
        title, attribute = args
        doc = context[context.index(title) - 1 :]
        doc = doc[: doc.index("<|doc|>", 1)] if "<|doc|>" in doc[1:] else doc
        answer = [b for a, b in statements(doc) if a == attribute]
    return [vocab[a] for a in answer]


# One hand-written example a subtask and the settings it needs; seq_len is its length.
HAND = {
    "niah_single": (dict(), "<|bos|> w00 w03 k04 = v07 w01 <|niah_single|> k04 <|query|> v07 <|endoftext|>"),
    "niah_multikey": (
        dict(multikey_needles=2),
        "<|bos|> k01 = v02 w05 w05 k03 = v04 w00 w09 w02 <|niah_multikey|> k03 <|query|> v04 <|endoftext|>",
    ),
    "niah_multivalue": (
        dict(multivalue_values=2),
        "<|bos|> w01 k05 = v01 w02 k05 = v09 w03 <|niah_multivalue|> k05 <|query|> v01 v09 <|endoftext|>",
    ),
    "niah_multiquery": (
        dict(multiquery_queries=2),
        "<|bos|> k00 = v03 w01 k07 = v03 w02 <|niah_multiquery|> k07 k00 <|query|> v03 v03 <|endoftext|>",
    ),
    "vt": (
        dict(vt_chains=2, vt_hops=1),
        "<|bos|> k01 = v04 k02 = v05 w00 k03 = k02 k04 = k01 w07 <|vt|> v05 <|query|> k02 k03 <|endoftext|>",
    ),
    "cwe": (
        dict(cwe_words=2, cwe_ratio=2, n_words=4),
        "<|bos|> w2 w0 w2 w3 w0 w2 w0 w2 w1 w0 <|cwe|> <|query|> w2 w0 <|endoftext|>",
    ),
    "fwe": (dict(fwe_words=1, n_words=4), "<|bos|> w3 w3 w1 w3 w3 w0 w3 w2 w3 <|fwe|> <|query|> w3 <|endoftext|>"),
    "qa": (
        dict(qa_docs=2),
        "<|bos|> <|doc|> k01 w03 = v02 w00 <|doc|> k05 w00 w03 = v06 w01 <|qa|> k05 w03 <|query|> v06 <|endoftext|>",
    ),
}


@pytest.mark.parametrize("task", SUBTASKS)
def test_a_hand_written_example_of_each_subtask(task):
    changes, text = HAND[task]
    s = LongContextSettings(**{**SMALL, **changes, "seq_len": len(text.split()), "subtasks": (task,)})
    x = np.array(ids(s, text))
    ((found, prompt),) = find_answers(x[None], s.layout())
    answer = text.split("<|query|>")[1].split()[:-1]
    assert found == task and list(x[prompt:-1]) == ids(s, " ".join(answer))
    assert solve(s, x) == list(x[prompt:-1])


@pytest.mark.parametrize("task", SUBTASKS)
@pytest.mark.parametrize("seq_len", [96, 192])
def test_every_generated_answer_is_recovered_from_its_context(task, seq_len):
    s = LongContextSettings(**SMALL, seq_len=seq_len, subtasks=(task,))
    x = generate_examples(s, 40, np.random.default_rng(seq_len))
    assert x.shape == (40, seq_len) and x.max() < s.vocab_size
    for row, (found, prompt) in zip(x, find_answers(x, s.layout())):
        assert found == task and prompt == s.prompt_len(task)
        assert solve(s, row) == list(row[prompt:-1])


KEY_ASKED = dict(needles="fused", question_first=True)  # the layout small models learn (module docstring)

# The same, hand-written in the key-asked layout: one pair token a statement, the question after <|query|>.
HAND_KEY_ASKED = {
    "niah_multikey": (
        dict(multikey_needles=2),
        "<|bos|> a01_02 w05 a03_04 w00 <|niah_multikey|> <|query|> k03 v04 <|endoftext|>",
    ),
    "niah_multiquery": (
        dict(multiquery_queries=2),
        "<|bos|> a00_03 w01 a07_05 w02 <|niah_multiquery|> <|query|> k07 k00 v05 v03 <|endoftext|>",
    ),
    "vt": (
        dict(vt_chains=2, vt_hops=1),
        "<|bos|> a01_04 a02_05 w00 c03_02 c04_01 w07 <|vt|> <|query|> v05 k02 k03 <|endoftext|>",
    ),
    "qa": (
        dict(qa_docs=2),
        "<|bos|> <|doc|> k01 f03_02 w00 <|doc|> k05 w00 f03_06 <|qa|> <|query|> k05 w03 v06 <|endoftext|>",
    ),
    "cwe": (dict(cwe_words=1, cwe_ratio=2, n_words=3), "<|bos|> w2 w0 w2 w1 w2 w2 <|cwe|> <|query|> w2 <|endoftext|>"),
}


@pytest.mark.parametrize("task", sorted(HAND_KEY_ASKED))
def test_a_hand_written_example_in_the_key_asked_layout(task):
    changes, text = HAND_KEY_ASKED[task]
    s = LongContextSettings(**{**SMALL, **changes, **KEY_ASKED, "seq_len": len(text.split()), "subtasks": (task,)})
    x = np.array(ids(s, text))
    ((found, prompt),) = find_answers(x[None], s.layout())
    question = s.question_len(task) - 1
    answer = text.split("<|query|>")[1].split()[question:-1]
    assert found == task and list(x[prompt:-1]) == ids(s, " ".join(answer))
    assert solve(s, x) == list(x[prompt:-1])
    ruler = dataclasses.replace(s, question_first=False).layout()  # the question before <|query|>
    if s.question_len(task) > 1:  # read with the other layout, an example with arguments is refused
        with pytest.raises(DataError, match="break the long-context layout"):
            find_answers(x[None], ruler)
    else:  # cwe and fwe have none: both layouts are one
        assert find_answers(x[None], ruler) == [(task, prompt)]


@pytest.mark.parametrize("task", SUBTASKS)
@pytest.mark.parametrize("question_first", [False, True])
def test_every_answer_of_the_fused_layouts_is_recovered_from_its_context(task, question_first):
    s = LongContextSettings(**SMALL, seq_len=96, subtasks=(task,), needles="fused", question_first=question_first)
    x = generate_examples(s, 40, np.random.default_rng(7))
    assert x.max() < s.vocab_size
    for row, (found, prompt) in zip(x, find_answers(x, s.layout())):
        assert found == task and prompt == s.prompt_len(task)
        assert solve(s, row) == list(row[prompt:-1])
        if task not in ("cwe", "fwe"):
            assert 5 not in row  # no "=": every statement is one pair token


def test_the_drill_asks_each_pair_at_its_key_and_only_the_train_split_holds_it(tmp_path):
    s = LongContextSettings(**{**SMALL, **KEY_ASKED, "seq_len": 64, "n_train": 40, "drill": 0.25, "drill_pairs": 6})
    metas = write_longctx_corpus(s, tmp_path / "suite")
    names = {i: n for n, i in vocabulary(s).items()}
    tokens, meta = load_tokens(tmp_path / "suite/tokens/train.bin")
    x = np.asarray(tokens).reshape(40, 64)
    mask = np.asarray(load_loss_mask(tmp_path / "suite/tokens/train.bin", meta)).reshape(x.shape)
    drill = [i for i, row in enumerate(x) if not set(row) & set(meta["longctx"]["task_ids"].values())]
    assert len(drill) == 10 and drill == [3, 7, 11, 15, 19, 23, 27, 31, 35, 39]  # a quarter, spread evenly
    suite = [i for i in range(40) if i not in drill]
    assert [t for t, _ in find_answers(x[suite], meta["longctx"])] == [s.subtasks[i % 8] for i in range(30)]
    for i, (_, prompt) in zip(suite, find_answers(x[suite], meta["longctx"])):
        assert np.flatnonzero(mask[i]).tolist() == list(range(prompt, 63))
    for i in drill:  # naive: each query is a key; its target the value of that key's pair in the first half
        row = [names[int(t)] for t in x[i]]
        pairs = {"k" + t[1:].split("_")[0]: "v" + t.split("_")[1] for t in row[1:33] if t.startswith("a")}
        assert len(pairs) == 6 and all(t.startswith("w") or t.startswith("a") for t in row[1:33])
        targets = np.flatnonzero(mask[i]).tolist()
        assert targets == list(range(34, 64, 2)) and all(row[t] == pairs[row[t - 1]] for t in targets)
        assert row[63] == "<|endoftext|>"
    for split in ("validation", "test"):  # the suite alone
        assert metas[split]["n_examples"] == 16
        find_answers(
            np.asarray(load_tokens(tmp_path / f"suite/tokens/{split}.bin")[0]).reshape(16, 64), meta["longctx"]
        )
    # without the drill, the train split is the suite's examples as generate_examples draws them
    plain = LongContextSettings(**{**SMALL, **KEY_ASKED, "seq_len": 64, "n_train": 40})
    from dimattn.data.longctx import generate_split
    from dimattn.data.recall import split_rng

    x0, m0 = generate_split(plain, "train", 40, split_rng(0, "train"))
    assert np.array_equal(x0, generate_examples(plain, 40, split_rng(0, "train"))) and m0.sum() > 0


def test_the_needle_depth_of_a_fused_needle_is_its_pair_token():
    s = LongContextSettings(**{**SMALL, **KEY_ASKED, "seq_len": 96})
    x = generate_examples(s, 40, np.random.default_rng(3))
    answers = find_answers(x, s.layout())
    depths = needle_depths(x, answers, s.layout())
    assert sorted(depths) == sorted([*range(0, 40, 8), *range(1, 40, 8)])
    names = {i: n for n, i in vocabulary(s).items()}
    for i, depth in depths.items():  # the pair token at that depth holds the asked key and the answer
        c = s.context_len(answers[i][0])
        pair = names[int(x[i, 1 + round(depth * (c - 1))])]
        assert pair == f"a{names[int(x[i, -3])][1:]}_{names[int(x[i, -2])][1:]}"
    for depth in (0.0, 1.0):
        d = LongContextSettings(
            **{**SMALL, **KEY_ASKED, "seq_len": 96, "subtasks": ("niah_single",), "needle_depth": depth}
        )
        rows = generate_examples(d, 3, np.random.default_rng(1))
        assert needle_depths(rows, find_answers(rows, d.layout()), d.layout()) == {0: depth, 1: depth, 2: depth}


def test_a_pair_token_predicted_matches_no_answer_name():
    s = LongContextSettings(seq_len=256, **SMALL, **KEY_ASKED)
    names = list(vocabulary(s))
    v = {n: i for i, n in enumerate(names)}
    assert len(names) == s.vocab_size == len(set(names))
    result = score_predictions(["niah_single"] * 2, [[v["a01_02"]], [v["v02"]]], [[v["v02"]]] * 2, names)
    assert result["subtasks"]["niah_single"] == {"score": 50.0, "exact": 50.0, "n": 2}


def test_examples_cycle_through_the_subtasks_and_depth_places_the_needle():
    s = LongContextSettings(**SMALL, seq_len=128)
    x = generate_examples(s, 2 * len(SUBTASKS), np.random.default_rng(0))
    assert [t for t, _ in find_answers(x, s.layout())] == list(SUBTASKS) * 2
    for depth in (0.0, 0.5, 1.0):
        d = LongContextSettings(**SMALL, seq_len=128, subtasks=("niah_single",), needle_depth=depth)
        rows = generate_examples(d, 5, np.random.default_rng(1))
        c = d.context_len("niah_single")
        assert all(row[1 + round(depth * (c - 3)) + 1] == 5 for row in rows)  # "=" of the needle
        found = needle_depths(rows, find_answers(rows, d.layout()), d.layout())
        assert found == {i: pytest.approx(round(depth * (c - 3)) / (c - 3)) for i in range(5)}


def test_the_needle_map_bins_the_asked_needle_by_depth():
    s = LongContextSettings(**SMALL, seq_len=96)
    x = generate_examples(s, 80, np.random.default_rng(2))
    depths = needle_depths(x, find_answers(x, s.layout()), s.layout())
    assert sorted(depths) == sorted([*range(0, 80, len(SUBTASKS)), *range(1, 80, len(SUBTASKS))])  # the two tasks
    for i, depth in depths.items():  # the asked key sits at that depth, followed by "=" and the answer
        c = s.context_len(SUBTASKS[i % len(SUBTASKS)])
        at = 1 + round(depth * (c - 3))
        assert x[i, at] == x[i, -4] and x[i, at + 1] == 5 and x[i, at + 2] == x[i, -2]
    rows = needle_scores({0: 0.0, 1: 0.1, 2: 0.5, 3: 1.0, 4: 0.99}, {0: 1.0, 1: 0.0, 2: 1.0, 3: 1.0, 4: 0.0}, bins=4)
    assert rows == [{"depth_lo": 0.0, "depth_hi": 0.25, "score": 50.0, "n": 2},
                    {"depth_lo": 0.5, "depth_hi": 0.75, "score": 100.0, "n": 1},
                    {"depth_lo": 0.75, "depth_hi": 1.0, "score": 50.0, "n": 2}]


REFUSED = {
    "needle beyond the context": (dict(needle_depth=1.5), "needle_depth"),
    "length beyond the model's positions": (dict(seq_len=256, max_positions=128), "seq_len must be <= max_positions"),
    "more keys than the vocabulary": (dict(multikey_needles=13), "n_keys must be >= 13"),
    "chains beyond the keys": (dict(vt_chains=3, vt_hops=4), "n_keys must be >= 15"),
    "more common words than words": (dict(cwe_words=16), "n_words must be >= 17"),
    "a context too short for its needles": (
        dict(seq_len=20, subtasks=("niah_multikey",), multikey_needles=6),
        "seq_len must be long enough for niah_multikey",
    ),
    "common words that cannot stand out": (
        dict(seq_len=400, subtasks=("cwe",), n_words=6, cwe_words=5, cwe_ratio=200),
        "seq_len must be long enough for 5 common words",
    ),
    "unknown subtask": (dict(subtasks=("niah_single", "passkey")), "subtasks"),
    "a float count": (dict(n_keys=12.0), "n_keys must be int"),
    "an unknown needle kind": (dict(needles="words"), "needles must be one of"),
    "a drill without pair tokens": (dict(drill=0.25), "needles must be 'fused' for a drill"),
    "a drill of every example": (dict(needles="fused", drill=1.0), "drill must be in \\[0, 1\\)"),
    "more drill pairs than keys": (
        dict(needles="fused", drill=0.25, drill_pairs=13),
        "drill_pairs must be in \\[1, 12\\]",
    ),
    "pair tokens beyond uint16": (dict(needles="fused", n_keys=150, n_values=150, n_words=150), "uint16 tokens"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_an_unanswerable_setting_is_refused_naming_it(case):
    changes, message = REFUSED[case]
    with pytest.raises(DataError, match=message):
        LongContextSettings(**{**SMALL, "seq_len": 128, **changes})
    LongContextSettings(**{**SMALL, "seq_len": 128, "max_positions": 128})  # at the boundary: allowed


def test_the_corpus_files_follow_the_recall_corpus(tmp_path):
    s = LongContextSettings(**SMALL, seq_len=64)
    metas = write_longctx_corpus(s, tmp_path / "suite")
    tokens, meta = load_tokens(tmp_path / "suite/tokens/test.bin")
    x = np.asarray(tokens).reshape(meta["n_examples"], 64)
    mask = np.asarray(load_loss_mask(tmp_path / "suite/tokens/test.bin", meta)).reshape(x.shape)
    for row, m, (_, prompt) in zip(x, mask, find_answers(x, meta["longctx"])):
        assert np.flatnonzero(m).tolist() == list(range(prompt, 63))  # the answers, and only they
    assert meta == metas["test"] and meta["example_len"] == 64 and meta["vocab_size"] == s.vocab_size
    train = np.asarray(load_tokens(tmp_path / "suite/tokens/train.bin")[0])
    assert not np.array_equal(train.reshape(-1, 64)[:16], x)  # independent splits
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "suite/tokenizer")
    assert tok(tok.decode(x[0]), add_special_tokens=False)["input_ids"] == x[0].tolist()
    x = x.copy()
    x[3, -1] = 7  # a second task token: refused, not scored
    with pytest.raises(DataError, match="1 of 16 examples break the long-context layout"):
        find_answers(x, meta["longctx"])


def test_greedy_generation_through_the_cache_is_naive_greedy(tmp_path):
    from dimattn import DimAttnConfig, DimAttnForCausalLM
    from dimattn.data.longctx import generate_answers

    s = LongContextSettings(**SMALL, seq_len=48, subtasks=("niah_multivalue", "vt", "cwe"))
    x = generate_examples(s, 6, np.random.default_rng(0))
    answers = find_answers(x, s.layout())
    torch.manual_seed(0)
    config = DimAttnConfig(vocab_size=s.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           attention="vanilla", max_position_embeddings=64, initializer_range=0.3)
    model = DimAttnForCausalLM(config).eval()
    got = generate_answers(model, x, answers, batch_size=4)
    for row, (_, prompt), generated in zip(x, answers, got):
        seq = list(row[:prompt])
        with torch.no_grad():
            for _ in range(s.seq_len - 1 - prompt):  # recompute the whole sequence each step
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert generated == seq[prompt:]
    assert len({tuple(g) for g in got}) > 1  # the model's own tokens, not a constant
    write_longctx_corpus(s, tmp_path / "suite")
    result = score_suite(model, tmp_path / "suite/tokens/test.bin", batch_size=8)
    assert set(result["subtasks"]) == set(s.subtasks) and result["seq_len"] == 48
    assert all(v["n"] == 16 // 3 + (i < 16 % 3) for i, v in enumerate(result["subtasks"].values()))

    # the workflow's steps: the JSON of a saved run, then the tidy summary
    from dimattn.evaluation.scoring import evaluate_longctx
    from dimattn.reporting.summaries import summarize_longctx

    model.config.register_for_auto_class()
    model.register_for_auto_class("AutoModelForCausalLM")
    model.save_pretrained(tmp_path / "long-vanilla")
    record = evaluate_longctx(tmp_path / "long-vanilla", tmp_path / "suite/tokens/test.bin", tmp_path / "s.json", 8,
                              "cpu", corpus="suite")
    assert record["subtasks"] == result["subtasks"] and record["run"] == "long-vanilla" and record["corpus"] == "suite"
    df = summarize_longctx([tmp_path / "s.json"], tmp_path / "longctx.csv")
    assert list(df["subtask"]) == [*s.subtasks, "average"] and (df["seq_len"] == 48).all()
    assert df.set_index("subtask").loc["average", "score"] == pytest.approx(result["average"])
    assert df.set_index("subtask").loc["average", "n"] == 16


def test_the_scorer_is_lm_evals_string_match_on_hand_made_predictions():
    names = list(vocabulary(LongContextSettings(seq_len=256)))  # names of two digits
    v = {n: i for i, n in enumerate(names)}
    gold = [[v["v01"], v["v02"], v["v03"], v["v04"]], [v["v01"], v["v02"], v["v03"], v["v04"]], [v["k02"]], [v["k02"]],
            [v["w01"], v["w02"]]]
    predictions = [gold[0],  # all found, exact
                   [v["v04"], v["v03"], v["v01"], v["v09"]],  # 3 of 4 found, out of order
                   [v["k02"]], [v["k12"]],  # k02 is no substring of "k12": the names of a group are one width
                   [v["w02"], v["w01"]]]
    tasks = ["niah_multivalue", "niah_multivalue", "niah_single", "niah_single", "cwe"]
    gold, predictions, tasks = gold + [[v["v05"]]] * 2, predictions + [[v["v05"]], [v["v50"]]], tasks + ["qa"] * 2
    result = score_predictions(tasks, predictions, gold, names)["subtasks"]
    assert result["qa"] == {"score": 50.0, "exact": 50.0, "n": 2}  # string_match_part, one example at a time
    assert result["niah_multivalue"] == {"score": pytest.approx(100 * (1 + 3 / 4) / 2), "exact": 50.0, "n": 2}
    assert result["niah_single"] == {"score": 50.0, "exact": 50.0, "n": 2}
    assert result["cwe"] == {"score": 100.0, "exact": 0.0, "n": 1}  # any order: lm-eval's substring match
    assert score_predictions(tasks, predictions, gold, names)["average"] == pytest.approx((87.5 + 50 + 100 + 50) / 4)


def test_an_unanswerable_corpus_is_refused_at_planning_naming_its_key():
    import copy

    import yaml

    from dimattn.workflow import sweeps
    from dimattn.data.longctx import check_datasets

    config = yaml.safe_load(open(sweeps.SCHEMA.parents[1] / "config.yaml"))
    config["datasets"]["suite"] = {"source": "synthetic_longctx", "seq_len": 64, "needle_depth": 1.5}
    with pytest.raises(sweeps.ConfigError, match=r"config key datasets\.suite\.needle_depth: long-context setting"):
        check_datasets(sweeps.plan(sweeps.validate(config)))
    fine = copy.deepcopy(config)
    fine["datasets"]["suite"]["needle_depth"] = 1.0  # the end of the context: answerable
    check_datasets(sweeps.plan(sweeps.validate(fine)))
    config["datasets"]["suite"] |= {"needle_depth": None, "n_keys": 3}  # 4 distinct multi-key needles
    with pytest.raises(sweeps.ConfigError, match=r"datasets\.suite\.n_keys"):
        check_datasets(sweeps.plan(sweeps.validate(config)))


def test_score_projected_scores_the_suite_through_a_projected_directory(tmp_path):
    """DimPO downstream on the suite (issue 18): score_projected on a projected suite model
    (l = 1 of 2, SnapKV keeping half of each prompt) gives score_suite's record of that same
    directory, at each length it is given; the downstream summary's rows are its average and
    subtasks as fractions; a corpus that is no suite is refused before the model loads."""
    from transformers import AutoTokenizer

    from dimattn import DimAttnConfig, DimAttnForCausalLM
    from dimattn.model.affine import Affine, save_projections
    from dimattn.model.configuration_projected import save_projected_model
    from dimattn.evaluation.projected import score_projected
    from dimattn.evaluation.scoring import load_model
    from dimattn.reporting.summaries import summarize_downstream

    suites = {}
    for seq_len in (48, 96):  # the 1x and 2x lengths
        s = LongContextSettings(**SMALL, seq_len=seq_len, subtasks=("niah_single", "niah_multikey", "vt", "qa"))
        write_longctx_corpus(s, tmp_path / f"suite{seq_len}")
        suites[f"suite{seq_len}"] = tmp_path / f"suite{seq_len}/tokens/test.bin"
    torch.manual_seed(0)
    base = DimAttnForCausalLM(DimAttnConfig(vocab_size=s.vocab_size, hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=2, attention="vanilla", max_position_embeddings=128,
                                            initializer_range=0.3))
    base.config.register_for_auto_class()
    base.register_for_auto_class("AutoModelForCausalLM")
    base.save_pretrained(tmp_path / "run")
    AutoTokenizer.from_pretrained(tmp_path / "suite48/tokenizer").save_pretrained(tmp_path / "run")
    g = torch.Generator().manual_seed(1)
    save_projections({i: Affine(torch.randn(8, 16, generator=g), torch.zeros(8)) for i in range(2)},
                     tmp_path / "p.safetensors", {"objective": "kl", "d_prime": 8})
    model_dir = save_projected_model(tmp_path / "projected", str(tmp_path / "run"), tmp_path / "p.safetensors",
                                     num_projected=1, scale="d_prime", kv={"snapkv": {"budget": 16, "window": 4, "kernel": 3}})
    fields = {"model": "long-vanilla", "objective": "kl", "setting": "default", "d_prime": 8, "num_projected": 1,
              "n_layers": 2, "scale": "long", "kv": "snapkv16", "kv_method": "snapkv", "kv_level": 16, "seed": 0}
    kw = dict(tokens={}, seq_len=48, batch_size=4, max_tokens=None, tasks=[], limit=None, device="cpu", precision="fp32")
    record = score_projected(model_dir, fields, **kw, out_json=tmp_path / "out.json", suite=suites)
    for corpus, path in suites.items():
        assert record["longctx"][corpus] == score_suite(load_model(model_dir, "cpu"), path, batch_size=4)
    assert [record["longctx"][c]["seq_len"] for c in suites] == [48, 96]
    plain = score_suite(load_model(tmp_path / "run", "cpu"), suites["suite96"], batch_size=4)
    assert plain["subtasks"] != record["longctx"]["suite96"]["subtasks"]  # projection and SnapKV act
    # and hold fewer bytes: keys d' = 8 of 16 wide on the projected layer, SnapKV's 16 prompt tokens kept
    assert record["longctx"]["suite96"]["cache_bytes_per_token"] < plain["cache_bytes_per_token"]

    df = summarize_downstream([tmp_path / "out.json"], tmp_path / "downstream.csv").set_index(["task", "metric"])
    suite = record["longctx"]["suite48"]
    assert df.loc[("longctx:suite48", "score"), "value"] == pytest.approx(suite["average"] / 100)
    assert df.loc[("longctx:suite48", "score,vt"), "value"] == pytest.approx(suite["subtasks"]["vt"]["score"] / 100)
    assert len(df.loc["longctx:suite96"]) == 1 + 4

    (tmp_path / "bad.bin").write_bytes(suites["suite48"].read_bytes())
    meta = json.loads(suites["suite48"].with_suffix(".json").read_text())
    (tmp_path / "bad.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "longctx"}))
    with pytest.raises(DataError, match="bad.bin is not a synthetic_longctx corpus"):
        score_projected(tmp_path / "missing-model", fields, **kw, out_json=tmp_path / "never.json",
                        suite={"suite48": tmp_path / "bad.bin"})
    assert not (tmp_path / "never.json").exists()
