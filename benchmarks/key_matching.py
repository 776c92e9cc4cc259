"""Which layouts of the long-context suite let a small model learn key matching (README, "The
long-context suite"): the ``long`` scale's architecture (configs/cpu-full.yaml) trained from
scratch on a mix of needle subtasks, one JSON line every --eval-every steps with each subtask's
exact match (the answers teacher-forced) and the drill's accuracy per query.

    python benchmarks/key_matching.py drill --pairs random --asked key      # the drill alone
    python benchmarks/key_matching.py drill --pairs random --asked marker
    python benchmarks/key_matching.py mix                                   # the suite's layout
    python benchmarks/key_matching.py mix --needles single --question-first --drill 0.25

These are the experiments that decided dimattn.data.longctx's layout settings: the generator now
writes the layout that works (``needles: fused``, ``question_first``, ``drill``; the suite's
eight subtasks, configs/cpu-full.yaml). This script keeps the five-subtask mix and its
teacher-forced scoring, to rerun the comparisons quickly.

- ``--needles tokens``: a needle is ``k = v``, three tokens, as dimattn.data.longctx writes it;
  ``single``: one token ``k{i}v{j}`` a needle (the recall probe's fused pairs), and vt's
  ``x{a} = x{b}`` one token ``k{a}k{b}``.
- ``--question-first``: ``<|task|> <|query|> question answer``, so the first answer token is
  predicted at the question's last token (the asked key); otherwise ``<|task|> question
  <|query|> answer``, as dimattn.data.longctx and RULER (an answer after the key, a previous-token
  step first).
- ``--drill S``: a share S of each batch is the drill: 8 single-token pairs at random places
  among 64 words (or at positions 1-8: ``--pairs fixed``), then as many queries as fit, each
  asked at the key (``k v``) or at a marker after it (``k <|query|> v``: ``--asked marker``);
  ``--directions 3`` also asks value to key and, over name pairs ``a = b``, ``b`` to ``a``
  (vt's lookups). ``drill`` trains on the drill alone and scores it.

The subtasks (a five-subtask subset of dimattn.data.longctx's, 16 keys, values and words, 128-token
examples): niah_single (one needle), niah_multikey (4 needles, one asked), niah_multivalue (4
values of one key, all in context order), niah_multiquery (4 needles, all asked, shuffled),
vt (2 chains of 5 names, a value asked, its chain's names in order).

The host line (benchmarks/_host.py, on stderr) comes first; every line carries the host's
one-thread bf16 matmul peak, ``host_bf16_peak_gflops``, beside its seconds.
"""

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dimattn.data.longctx import ASSIGN_ID as ASSIGN  # noqa: E402
from dimattn.data.longctx import _insert  # noqa: E402  (needles written apart, in order, at uniform places)
from dimattn.data.recall import BOS_ID as BOS  # noqa: E402
from dimattn.data.recall import EOS_ID as EOS  # noqa: E402
from dimattn.data.recall import QUERY_ID as QUERY  # noqa: E402

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt")
N = 16  # keys, values and words each
SEQ_LEN, DRILL_CONTEXT, DRILL_PAIRS = 128, 64, 8
ANSWER = {"niah_single": 1, "niah_multikey": 1, "niah_multivalue": 4, "niah_multiquery": 4, "vt": 5}
QUESTION = {"niah_multiquery": 4}  # arguments after the task token; 1 for the others
NEEDLES = {"niah_single": 1, "niah_multikey": 4, "niah_multiquery": 4}


@dataclass(frozen=True)
class Vocab:
    """Token ids: specials 0-5, a task token a subtask, keys, values, words, then the
    single-token pairs k{i}v{j} and k{a}k{b}."""

    task0: int = 6
    key0: int = 6 + len(TASKS)
    value0: int = key0 + N
    word0: int = value0 + N
    kv0: int = word0 + N
    kk0: int = kv0 + N * N
    size: int = kk0 + N * N

    def kv(self, k, v):
        return self.kv0 + int(k) * N + int(v)

    def kk(self, a, b):
        return self.kk0 + int(a) * N + int(b)


V = Vocab()


def mix_example(task, needles, question_first, rng):
    """(tokens of one SEQ_LEN example, answer length): bos, context, the question, the answer, eos."""
    q_len, a_len = QUESTION.get(task, 1), ANSWER[task]
    context = V.word0 + rng.integers(0, N, size=SEQ_LEN - 4 - q_len - a_len)  # bos, task, query, eos

    def needle(k, v):
        return [V.kv(k, v)] if needles == "single" else [V.key0 + k, ASSIGN, V.value0 + v]

    if task in NEEDLES:
        m = NEEDLES[task]
        keys, values = rng.choice(N, m, replace=False), rng.integers(0, N, m)
        _insert(context, rng, [needle(k, v) for k, v in zip(keys, values)])
        asked = rng.permutation(m) if task == "niah_multiquery" else [int(rng.integers(m))]
        question, answer = [V.key0 + keys[i] for i in asked], [V.value0 + values[i] for i in asked]
    elif task == "niah_multivalue":
        k, values = int(rng.integers(N)), rng.choice(N, 4, replace=False)
        _insert(context, rng, [needle(k, v) for v in values])
        question, answer = [V.key0 + k], [V.value0 + v for v in values]
    else:  # vt: x0 = value, x1 = x0, ... for two chains, interleaved, each in order
        names, values = rng.choice(N, 10, replace=False).reshape(2, 5), rng.choice(N, 2, replace=False)
        statements, step = [], [0, 0]
        for chain in rng.permutation(np.repeat([0, 1], 5)):
            j = step[chain]
            if j == 0:
                statements.append(needle(names[chain, 0], values[chain]))
            elif needles == "single":
                statements.append([V.kk(names[chain, j], names[chain, j - 1])])
            else:
                statements.append([V.key0 + names[chain, j], ASSIGN, V.key0 + names[chain, j - 1]])
            step[chain] += 1
        _insert(context, rng, statements)
        chain = int(rng.integers(2))
        question, answer = [V.value0 + values[chain]], [V.key0 + n for n in names[chain]]
    task_id = V.task0 + TASKS.index(task)
    prompt = [task_id, QUERY, *question] if question_first else [task_id, *question, QUERY]
    return [BOS, *context, *prompt, *answer, EOS], a_len


def drill_example(pairs, asked, directions, rng):
    """(tokens, target positions): DRILL_PAIRS single-token pairs among DRILL_CONTEXT words, then
    queries asked at the key or at a marker after it, in one of ``directions`` lookups."""
    kind = int(rng.integers(directions))  # 0 key -> value, 1 value -> key, 2 b -> a over a = b
    context = V.word0 + rng.integers(0, N, size=DRILL_CONTEXT)
    a = rng.choice(N, DRILL_PAIRS, replace=False)
    b = rng.choice(N, DRILL_PAIRS, replace=False) if kind else rng.integers(0, N, DRILL_PAIRS)
    tokens = [V.kk(x, y) for x, y in zip(a, b)] if kind == 2 else [V.kv(x, y) for x, y in zip(a, b)]
    # "fixed": the recall probe's places, right after bos (positions 1-8 of the row)
    places = (
        np.arange(DRILL_PAIRS) if pairs == "fixed" else np.sort(rng.choice(DRILL_CONTEXT, DRILL_PAIRS, replace=False))
    )
    context[places] = tokens
    row, targets = [BOS, *context], []
    per = 2 if asked == "key" else 3
    for j in rng.integers(0, DRILL_PAIRS, (SEQ_LEN - len(row) - 1) // per):
        ask, give = [
            (V.key0 + a[j], V.value0 + b[j]),
            (V.value0 + b[j], V.key0 + a[j]),
            (V.key0 + b[j], V.key0 + a[j]),
        ][kind]
        row += [ask, give] if asked == "key" else [ask, QUERY, give]
        targets.append(len(row) - 1)
    return row + [EOS] * (SEQ_LEN - len(row)), targets


def batch(args, n, rng, start=0):
    """(tokens, target mask, subtask of each row): rows cycle through the subtasks; the drill's
    rows (its share of n) come last."""
    drill = n if args.mode == "drill" else int(round(n * args.drill))
    x, mask, tasks = np.empty((n, SEQ_LEN), np.int64), np.zeros((n, SEQ_LEN), np.int64), []
    for i in range(n):
        if i >= n - drill:
            row, targets = drill_example(args.pairs, args.asked, args.directions, rng)
            tasks.append("drill")
        else:
            task = TASKS[(start + i) % len(TASKS)]
            row, n_answer = mix_example(task, args.needles, args.question_first, rng)
            targets = range(SEQ_LEN - 1 - n_answer, SEQ_LEN - 1)
            tasks.append(task)
        x[i], mask[i, list(targets)] = row, 1
    return x, mask, tasks


def score(pred, tokens, mask, tasks) -> dict:
    """{subtask: %}: pred[i, t] is the prediction of tokens[i, t + 1]; a subtask's example counts
    when every target of its answer is right (exact match), the drill's queries one by one."""
    right = [pred[i, np.flatnonzero(m) - 1] == tokens[i, np.flatnonzero(m)] for i, m in enumerate(mask)]
    hit = [r if t == "drill" else [bool(r.all())] for r, t in zip(right, tasks)]
    return {t: round(100 * float(np.mean(np.concatenate([h for h, u in zip(hit, tasks) if u == t]))), 1)
            for t in dict.fromkeys(tasks)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("mix", "drill"))
    parser.add_argument("--needles", choices=("tokens", "single"), default="tokens")
    parser.add_argument("--question-first", action="store_true")
    parser.add_argument("--drill", type=float, default=0.0, help="share of each batch the drill (mix)")
    parser.add_argument("--pairs", choices=("random", "fixed"), default="random")
    parser.add_argument("--asked", choices=("key", "marker"), default="key")
    parser.add_argument("--directions", type=int, choices=(1, 3), default=1)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--test-examples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch

    from benchmarks._host import announce, stamp
    from dimattn import DimAttnConfig, DimAttnForCausalLM
    from dimattn.pretraining.precision import autocast
    from dimattn.pretraining.training import TrainConfig, configure_optimizer, keep_freed_memory, lr_at

    torch.set_num_threads(1)
    keep_freed_memory()
    announce()
    torch.manual_seed(args.seed)
    cfg = TrainConfig(seq_len=SEQ_LEN, batch_size=args.batch, max_steps=args.steps, lr=args.lr, min_lr=args.lr / 10,
                      warmup_frac=0.05)
    model = DimAttnForCausalLM(
        DimAttnConfig(
            vocab_size=V.size,
            max_position_embeddings=SEQ_LEN,
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=2,
        )
    )
    optimizer = configure_optimizer(model, cfg)
    test = argparse.Namespace(**{**vars(args), "drill": 0.0})  # the test split: the subtasks (or the drill alone)
    tx, tmask, ttasks = batch(test, args.test_examples, np.random.default_rng([args.seed, 1]))
    rng, t0 = np.random.default_rng([args.seed, 0]), time.perf_counter()

    def exact_match() -> dict:
        model.eval()
        with torch.no_grad():
            pred = torch.cat([model(torch.from_numpy(tx[i : i + 128])).logits.argmax(-1)
                              for i in range(0, len(tx), 128)]).numpy()
        model.train()
        return score(pred, tx, tmask, ttasks)

    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, mask, _ = batch(args, args.batch, rng, step * args.batch)
        x = torch.from_numpy(x)
        with autocast("cpu", "bf16"):
            loss = model(x, labels=x.masked_fill(torch.from_numpy(mask) == 0, -100), return_logits=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            print(json.dumps(stamp({"step": step + 1, "exact": exact_match(), "loss": round(loss.item(), 3),
                                    "seconds": round(time.perf_counter() - t0)})), flush=True)


if __name__ == "__main__":
    main()
