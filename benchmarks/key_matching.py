"""Which layouts of the long-context suite let a small model learn key matching
(docs/long-context.md): the ``long`` scale's architecture (configs/cpu-full.yaml) trained from
scratch on a mix of needle subtasks, one JSON line every --eval-every steps with each subtask's
exact match (the answers teacher-forced) and the drill's accuracy per query.

    python benchmarks/key_matching.py mix                                   # RULER's layout
    python benchmarks/key_matching.py mix --needles fused --question-first --drill 0.25  # the suite's
    python benchmarks/key_matching.py drill                                 # the drill alone

The examples are the generator's own (dimattn.data.longctx: LongContextSettings, generate_split,
drill_example, find_answers), so what this measures is the layout the suite writes, switched by
its settings: ``--needles`` (``tokens``: a needle is ``k = v``; ``fused``: one pair token, the
recall probe's), ``--question-first`` (the answer predicted at the asked key rather than after
<|query|>), ``--drill`` (a share of each batch the key-asked drill). These are the comparisons
that decided the suite's layout; the drill variants it rejected (pairs at fixed places, queries
asked at a marker, vt's lookup directions) were the script's own examples and are in git history.

The subtasks: a five-subtask subset of the suite's (niah_single, niah_multikey, niah_multivalue,
niah_multiquery, vt) at 128 tokens with 16 keys, values and words, the generator's other
settings at their defaults (the schema's).

The host line (benchmarks/_host.py, on stderr) comes first; every line carries the host's
one-thread bf16 matmul peak, ``host_bf16_peak_gflops``, beside its seconds.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dimattn.data.longctx import LongContextSettings, drill_example, find_answers  # noqa: E402
from dimattn.data.longctx import generate_split, is_drill  # noqa: E402

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt")
SEQ_LEN, NAMES = 128, 16  # tokens an example; keys, values and words each


def settings(args) -> LongContextSettings:
    """The generator's settings of a run: the drill alone needs fused needles (its pairs are the
    pair tokens)."""
    drill = args.mode == "drill"
    return LongContextSettings(seq_len=SEQ_LEN, subtasks=TASKS, n_keys=NAMES, n_values=NAMES, n_words=NAMES,
                               needles="fused" if drill else args.needles, question_first=args.question_first,
                               drill=0.0 if drill else args.drill)


def batch(s: LongContextSettings, mode: str, split: str, n: int, rng):
    """(tokens, target mask, subtask of each row) of ``n`` rows of a split as the generator
    writes it (the train split's drill rows among the suite's), or of the drill alone."""
    if mode == "drill":
        x, mask = np.empty((n, s.seq_len), np.int64), np.zeros((n, s.seq_len), np.uint8)
        for i in range(n):
            x[i], targets = drill_example(s, rng)
            mask[i, targets] = 1
        return x, mask, ["drill"] * n
    x, mask = generate_split(s, split, n, rng)
    drilled = [split == "train" and is_drill(i, s.drill) for i in range(n)]
    suite = iter(find_answers(x[~np.array(drilled)], s.layout()))
    return x, mask, ["drill" if d else next(suite)[0] for d in drilled]


def score(pred, tokens, mask, tasks) -> dict:
    """{subtask: %}: pred[i, t] is the prediction of tokens[i, t + 1]; a subtask's example counts
    when every target of its answer is right (exact match), the drill's queries one by one."""
    right = [pred[i, np.flatnonzero(m) - 1] == tokens[i, np.flatnonzero(m)] for i, m in enumerate(mask)]
    hit = [r if t == "drill" else [bool(r.all())] for r, t in zip(right, tasks)]
    return {
        t: round(100 * float(np.mean(np.concatenate([h for h, u in zip(hit, tasks) if u == t]))), 1)
        for t in dict.fromkeys(tasks)
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("mix", "drill"))
    parser.add_argument("--needles", choices=("tokens", "fused"), default="tokens")
    parser.add_argument("--question-first", action="store_true")
    parser.add_argument("--drill", type=float, default=0.0, help="share of each batch the drill (mix)")
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
    s = settings(args)
    cfg = TrainConfig(seq_len=SEQ_LEN, batch_size=args.batch, max_steps=args.steps, lr=args.lr, min_lr=args.lr / 10,
                      warmup_frac=0.05)
    model = DimAttnForCausalLM(
        DimAttnConfig(
            vocab_size=s.vocab_size,
            max_position_embeddings=SEQ_LEN,
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=2,
        )
    )
    optimizer = configure_optimizer(model, cfg)
    # the test split: the subtasks (or the drill alone)
    tx, tmask, ttasks = batch(s, args.mode, "test", args.test_examples, np.random.default_rng([args.seed, 1]))
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
        x, mask, _ = batch(s, args.mode, "train", args.batch, rng)
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
