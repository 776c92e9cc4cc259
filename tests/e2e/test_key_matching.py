"""benchmarks/key_matching.py: its examples against answers read back from the tokens by a naive
scan, and a short run that prints every subtask."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

spec = importlib.util.spec_from_file_location(
    "key_matching", Path(__file__).parents[2] / "benchmarks" / "key_matching.py"
)
km = importlib.util.module_from_spec(spec)
spec.loader.exec_module(km)
V = km.V


def _facts(context, needles):
    """[(name, value or name, is a value)] of the context's needles and statements, in order."""
    facts, i = [], 0
    while i < len(context):
        t = int(context[i])
        if needles == "single" and V.kv0 <= t < V.kk0:
            facts.append((V.key0 + (t - V.kv0) // km.N, V.value0 + (t - V.kv0) % km.N))
        elif needles == "single" and t >= V.kk0:
            facts.append((V.key0 + (t - V.kk0) // km.N, V.key0 + (t - V.kk0) % km.N))
        elif needles == "tokens" and i + 2 < len(context) and context[i + 1] == km.ASSIGN:
            facts.append((t, int(context[i + 2])))
            i += 2
        i += 1
    return facts


def _answer(task, question, facts):
    is_value = lambda t: V.value0 <= t < V.word0  # noqa: E731
    if task in ("niah_single", "niah_multikey", "niah_multiquery"):
        return [next(v for k, v in facts if k == q) for q in question]
    if task == "niah_multivalue":
        return [v for k, v in facts if k == question[0]]
    chain = [next(k for k, v in facts if v == question[0] and is_value(v))]
    while any(v == chain[-1] for _, v in facts):
        chain.append(next(k for k, v in facts if v == chain[-1]))
    return chain


@pytest.mark.parametrize("needles", ["tokens", "single"])
@pytest.mark.parametrize("question_first", [False, True])
def test_every_answer_is_the_one_the_context_gives(needles, question_first):
    rng = np.random.default_rng(0)
    for task in km.TASKS:
        for _ in range(20):
            row, n_answer = km.mix_example(task, needles, question_first, rng)
            assert len(row) == km.SEQ_LEN and row[0] == km.BOS and row[-1] == km.EOS
            answer = row[km.SEQ_LEN - 1 - n_answer : km.SEQ_LEN - 1]
            n_question = km.QUESTION.get(task, 1)
            prompt = row[km.SEQ_LEN - 1 - n_answer - n_question - 2 : km.SEQ_LEN - 1 - n_answer]
            assert prompt[0] == V.task0 + km.TASKS.index(task)
            question = prompt[2:] if question_first else prompt[1:-1]
            assert (prompt[1] if question_first else prompt[-1]) == km.QUERY
            context = row[1 : km.SEQ_LEN - 1 - n_answer - n_question - 2]
            assert _answer(task, question, _facts(context, needles)) == answer, (task, row)


@pytest.mark.parametrize("asked", ["key", "marker"])
@pytest.mark.parametrize("directions", [1, 3])
def test_each_drill_target_is_its_asked_pair(asked, directions):
    rng = np.random.default_rng(1)
    for pairs in ("fixed", "random"):
        for _ in range(20):
            row, targets = km.drill_example(pairs, asked, directions, rng)
            assert len(row) == km.SEQ_LEN and targets
            facts = _facts(row[1 : 1 + km.DRILL_CONTEXT], "single")
            assert len(facts) == km.DRILL_PAIRS
            if pairs == "fixed":
                assert all(t >= V.kv0 for t in row[1 : 1 + km.DRILL_PAIRS])
            for t in targets:
                ask = row[t - (1 if asked == "key" else 2)]
                if asked == "marker":
                    assert row[t - 1] == km.QUERY
                # the one fact holding the asked token on the side the lookup reads
                found = [k for k, v in facts if v == ask] + [
                    v for k, v in facts if k == ask and V.value0 <= v < V.word0
                ]
                assert row[t] in found


def test_a_short_run_prints_every_subtask(capsys):
    km.main(["mix", "--needles", "single", "--question-first", "--drill", "0.25", "--steps", "2", "--eval-every", "1",
             "--layers", "1", "--hidden", "16", "--batch", "8", "--test-examples", "10"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    assert set(lines[-1]["exact"]) == set(km.TASKS)
    assert all(0 <= v <= 100 for v in lines[-1]["exact"].values())


def test_an_answer_counts_whole_and_a_drill_query_by_query():
    tokens = np.array([[1, 7, 8, 9, 0], [1, 7, 8, 9, 0], [1, 7, 8, 9, 0]])
    mask = np.array([[0, 0, 1, 1, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 0]])
    pred = np.zeros_like(tokens)
    pred[:, 1:3] = [8, 9]  # every target right
    pred[1, 2] = 5  # the second row's last target wrong
    tasks = ["niah_multivalue", "niah_multivalue", "drill"]
    pred[2, 1] = 5  # the drill's first query wrong, its second right
    assert km.score(pred, tokens, mask, tasks) == {"niah_multivalue": 50.0, "drill": 50.0}


def test_the_drill_alone_is_scored(capsys):
    km.main(["drill", "--asked", "marker", "--steps", "1", "--layers", "1", "--hidden", "16", "--batch", "4",
             "--test-examples", "4"])
    (line,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert set(line["exact"]) == {"drill"} and 0 <= line["exact"]["drill"] <= 100
