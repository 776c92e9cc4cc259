"""benchmarks/key_matching.py: its batches are the generator's (dimattn.data.longctx, whose
examples tests/unit/test_longctx.py checks against naive readings), its scoring, and short runs
that print every subtask."""

import argparse
import importlib.util
import json
from pathlib import Path

import numpy as np

from dimattn.data.longctx import drill_example, find_answers, generate_split

spec = importlib.util.spec_from_file_location(
    "key_matching", Path(__file__).parents[2] / "benchmarks" / "key_matching.py"
)
km = importlib.util.module_from_spec(spec)
spec.loader.exec_module(km)


def _args(mode, **kw):
    return argparse.Namespace(**{"mode": mode, "needles": "tokens", "question_first": False, "drill": 0.0, **kw})


def test_a_batch_is_the_generators_split_with_each_rows_subtask():
    s = km.settings(_args("mix", needles="fused", question_first=True, drill=0.25))
    assert (s.needles, s.question_first, s.drill, s.seq_len, s.subtasks) == ("fused", True, 0.25, 128, km.TASKS)
    x, mask, tasks = km.batch(s, "mix", "train", 16, np.random.default_rng(3))
    gx, gmask = generate_split(s, "train", 16, np.random.default_rng(3))
    assert (x == gx).all() and (mask == gmask).all()
    assert tasks.count("drill") == 4
    suite = [i for i, t in enumerate(tasks) if t != "drill"]
    assert [t for t, _ in find_answers(x[suite], s.layout())] == [tasks[i] for i in suite]
    _, _, test_tasks = km.batch(s, "mix", "test", 10, np.random.default_rng(4))
    assert "drill" not in test_tasks and set(test_tasks) == set(km.TASKS)  # the drill trains only


def test_the_drill_alone_is_the_generators_drill():
    s = km.settings(_args("drill"))
    assert s.needles == "fused"
    x, mask, tasks = km.batch(s, "drill", "train", 3, np.random.default_rng(5))
    rng = np.random.default_rng(5)
    for i in range(3):
        row, targets = drill_example(s, rng)
        assert (x[i] == row).all() and np.flatnonzero(mask[i]).tolist() == targets
    assert tasks == ["drill"] * 3


def test_an_answer_counts_whole_and_a_drill_query_by_query():
    tokens = np.array([[1, 7, 8, 9, 0], [1, 7, 8, 9, 0], [1, 7, 8, 9, 0]])
    mask = np.array([[0, 0, 1, 1, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 0]])
    pred = np.zeros_like(tokens)
    pred[:, 1:3] = [8, 9]  # every target right
    pred[1, 2] = 5  # the second row's last target wrong
    tasks = ["niah_multivalue", "niah_multivalue", "drill"]
    pred[2, 1] = 5  # the drill's first query wrong, its second right
    assert km.score(pred, tokens, mask, tasks) == {"niah_multivalue": 50.0, "drill": 50.0}


def test_a_short_run_prints_every_subtask(capsys):
    km.main(["mix", "--needles", "fused", "--question-first", "--drill", "0.25", "--steps", "2", "--eval-every", "1",
             "--layers", "1", "--hidden", "16", "--batch", "8", "--test-examples", "10"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    assert set(lines[-1]["exact"]) == set(km.TASKS)
    assert all(0 <= v <= 100 for v in lines[-1]["exact"].values())


def test_the_drill_alone_is_scored(capsys):
    km.main(["drill", "--steps", "1", "--layers", "1", "--hidden", "16", "--batch", "4", "--test-examples", "4"])
    (line,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert set(line["exact"]) == {"drill"} and 0 <= line["exact"]["drill"] <= 100
