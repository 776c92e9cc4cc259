"""A long-context suite in the mould of RULER (Hsieh et al. 2024, "RULER: What's the Real Context
Size of Your Long-Context Language Models?"; lm-eval's ``ruler`` tasks, seed 003's Tables 2-6),
generated here at CPU scale from a seeded RNG and a small vocabulary: no download.

Subtasks (``SUBTASKS``; the lm-eval task each stands for in ``dimattn.workflow.vocabulary.RULER_TASK``)::

    niah_single      one needle "k = v" in a haystack of words; asked k, answer v
    niah_multikey    m needles of distinct keys; one is asked
    niah_multivalue  m needles of one key with distinct values; answer all m, in context order
    niah_multiquery  m needles of distinct keys; all m asked (shuffled), their values in that order
    vt               variable tracking: chains "x0 = v", "x1 = x0", ... interleaved in the
                     haystack; asked v, answer the asked chain's variables in assignment order
    cwe              common words: the context is a list of words, cwe_words of them cwe_ratio
                     times as frequent as any other; answer them in order of first appearance
    fwe              frequent words: the context is drawn with Zipf counts (rank^-fwe_alpha,
                     RULER's zeta distribution); answer the fwe_words most frequent, most first
    qa               QA-like retrieval: qa_docs documents "<|doc|> title ... a = v ...", each
                     with a fact on the same attribute a; asked (title, a), answer that doc's v

One example is exactly ``seq_len`` tokens: ``<|bos|> context question <|query|> answer
<|endoftext|>`` (see Layouts), the question a task token and the subtask's arguments (above). The context takes
what the question and the answer leave, so a subtask's prompt length is fixed at a given
seq_len and a batch needs no padding. Examples cycle through the subtasks (example i is subtask
i mod S). With ``answer_loss`` the corpus writes the answers' target mask, as dimattn.data.recall
does. Needles sit at uniform random places (niah_single at ``needle_depth`` of the context
when it is set), and :func:`score_suite` scores niah_single and niah_multikey by the asked
needle's depth as well (the needle heat map: depth against context length). niah_single's
needle holds the context's only value, so copying any value answers it (as RULER's one number
in a haystack of sentences); niah_multikey's asked needle sits among distractor needles, so
it needs the key matched: that row of the heat map is the informative one.

Layouts. RULER's (the default) restates the question and then marks where the answer starts, so
the first answer token is predicted one or more tokens after the asked key: the model must carry
the key forward (a previous-token step) before it can match it. Small models trained here did
not form that composition (README, "The long-context suite"; benchmarks/key_matching.py), so
three settings give a layout they learn, which departs from RULER:

- ``needles: fused``: each statement ``x = y`` (needle, chain assignment, fact) is one pair token
  (the recall probe's fused pairs), so a key's value is read off one token;
- ``question_first``: ``<|task|> <|query|> question answer``, the answer predicted at the asked
  key itself (one lookup), where RULER's is ``<|task|> question <|query|> answer``;
- ``drill``: that share of the train split is a drill of many lookups asked at the key
  (:func:`drill_example`); the validation and test splits hold the suite alone.

Vocabulary (token ids)::

    0 .. 4   dimattn.data.recall's specials (<|endoftext|> <|bos|> <|pad|> <|unk|> <|query|>),
             <|query|> marking where the answer starts
    5        =          needle, assignment and fact
    6        <|doc|>    start of a qa document
    7 ..     one task token a subtask, <|niah_single|> ...
    then     keys k00 .., values v00 .., words w00 .. (n_keys, n_values, n_words)
    then     with needles "fused", the pair tokens: a00_00 .. (key = value), c00_00 .. (key = key),
             f00_00 .. (word = value)

Names have a fixed width within a group and a letter of their own, so one name is a substring of
a decoded prediction only where that token is in it: lm-eval's string matching on the decoded
text is then token matching.

Scoring (:func:`score_suite`): the prompt (through <|query|>) is prefilled into the model's KV
cache, so SnapKV's observation window holds the question, and the answer is generated greedily
through it, as many tokens as it has (lm-eval's RULER: up to max_gen_toks, ``until: []``); each
generation is scored with lm-eval's RULER metrics (the share of the answer's names found in the
prediction: ``string_match_all``; for qa ``string_match_part``, on one example the same share),
the mean per subtask, beside the exact match of the whole answer.

Settings a model cannot answer are refused when the settings are made, naming the setting: a
needle depth outside the context, a seq_len beyond ``max_positions`` (the model's, where one is
given), more distinct keys, values or words than the vocabulary holds, or a context too short
for its needles, chains, documents or word counts.
"""

import functools
import importlib.util
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from dimattn.workflow.schema import dataset_defaults
from dimattn.data.corpora import DataError
from dimattn.data.recall import BOS_ID, EOS_ID, MAX_VOCAB, QUERY_ID, RECALL_SPECIALS, cache_bytes_per_token
from dimattn.data.recall import decode_through_cache, load_synthetic_examples, split_rng
from dimattn.data.recall import word_level_tokenizer, write_synthetic_corpus
from dimattn.workflow.sweeps import RULER_TASK  # there, torch-free: the reports read it

SOURCE = "synthetic_longctx"
SUBTASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa")
# lm-eval 0.4.13's RULER metric per subtask: process_results (string_match_all), and for its qa
# tasks process_results_part (string_match_part), each on one example, then the mean.
PART_SCORED = ("qa",)
ASSIGN_ID, DOC_ID, TASK_START = 5, 6, 7
NEEDLE = 3  # tokens of a needle, an assignment or a fact: "x = y" (needles "tokens")
NEEDLE_KINDS = ("tokens", "fused")


class SettingError(DataError):
    """A setting no model could answer, or of the wrong type; ``setting`` names it."""

    def __init__(self, setting: str, message: str):
        super().__init__(message)
        self.setting = setting.split(" ")[0]  # "n_keys + n_values + n_words": the first


# every default the schema gives (its one home: dimattn.workflow.schema)
_DEFAULTS = dataset_defaults("synthetic_longctx")


@dataclass(frozen=True)
class LongContextSettings:
    """Generator settings; every field is checked, and an error names the field."""

    seq_len: int  # tokens per example, bos and eos included (the schema requires it)
    subtasks: tuple[str, ...] = tuple(_DEFAULTS["subtasks"])
    n_keys: int = _DEFAULTS["n_keys"]  # needle keys, variable names and document titles
    n_values: int = _DEFAULTS["n_values"]  # needle values, chain values and facts
    n_words: int = _DEFAULTS["n_words"]  # haystack, common and frequent words, qa attributes
    multikey_needles: int = _DEFAULTS["multikey_needles"]  # RULER niah_multikey_1: 4 keys
    multivalue_values: int = _DEFAULTS["multivalue_values"]  # RULER: 4 values
    multiquery_queries: int = _DEFAULTS["multiquery_queries"]  # RULER: 4 queries
    vt_chains: int = _DEFAULTS["vt_chains"]  # RULER (lm-eval): 1 chain of 4 hops; a second chain makes the value matter
    vt_hops: int = _DEFAULTS["vt_hops"]
    cwe_words: int = _DEFAULTS["cwe_words"]  # RULER: 10 common words of 30 occurrences among words of 3
    cwe_ratio: int = _DEFAULTS["cwe_ratio"]  # a common word is at least this many times as frequent as any other
    fwe_words: int = _DEFAULTS["fwe_words"]  # RULER: the 3 most frequent
    fwe_alpha: float = _DEFAULTS["fwe_alpha"]  # RULER's zeta exponent
    qa_docs: int = _DEFAULTS["qa_docs"]
    # niah_single's needle at this share of the context; None: uniform
    needle_depth: float | None = _DEFAULTS["needle_depth"]
    # The layout (module docstring, "Layouts"): RULER's by default.
    # "tokens": a statement is "x = y"; "fused": one pair token (the recall probe's)
    needles: str = _DEFAULTS["needles"]
    # <|query|> before the question, so the answer follows the asked key
    question_first: bool = _DEFAULTS["question_first"]
    drill: float = _DEFAULTS["drill"]  # share of the train split that is the key-asked drill (needles "fused")
    drill_pairs: int = _DEFAULTS["drill_pairs"]  # pairs of a drill example, in the first half of it
    max_positions: int | None = _DEFAULTS["max_positions"]  # the model's positions, where it has a limit
    answer_loss: bool = _DEFAULTS["answer_loss"]  # train on the answers only (meta "loss_mask")
    n_train: int = _DEFAULTS["n_train"]  # examples per split, cycling through the subtasks
    n_validation: int = _DEFAULTS["n_validation"]
    n_test: int = _DEFAULTS["n_test"]
    seed: int = _DEFAULTS["seed"]

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("needle_depth", "max_positions") and value is None:
                continue
            if f.name in ("subtasks", "needles"):
                continue
            kind = {"answer_loss": bool, "question_first": bool, "fwe_alpha": (int, float),
                    "needle_depth": (int, float), "drill": (int, float)}.get(f.name, int)
            if type(value) is bool and kind is not bool or not isinstance(value, kind):
                raise SettingError(f.name, f"long-context setting {f.name} must be "
                                           f"{getattr(kind, '__name__', 'a number')}, got {value!r}")
        if isinstance(self.subtasks, list):
            object.__setattr__(self, "subtasks", tuple(self.subtasks))
        unknown = [t for t in self.subtasks if t not in SUBTASKS]
        self._check("subtasks", bool(self.subtasks) and not unknown and len(set(self.subtasks)) == len(self.subtasks),
                    f"a non-empty list of distinct subtasks of {SUBTASKS}")
        self._check("seed", self.seed >= 0, ">= 0")
        self._check("needles", self.needles in NEEDLE_KINDS, f"one of {NEEDLE_KINDS}")
        self._check("drill", 0 <= self.drill < 1, "in [0, 1): a share of the train split")
        if self.drill:
            self._check("needles", self.needles == "fused", "'fused' for a drill (its pairs are the fused tokens)")
            self._check("drill_pairs", 1 <= self.drill_pairs <= min(self.n_keys, self.drill_context),
                        f"in [1, {min(self.n_keys, self.drill_context)}]: distinct keys placed in the drill's "
                        f"context of {self.drill_context}")
            self._check("seq_len", self.seq_len - 2 - self.drill_context >= 2, ">= 7: a drill query after its context")
        for name in ("n_keys", "n_values", "n_words", "multikey_needles", "multivalue_values", "multiquery_queries",
                     "vt_chains", "vt_hops", "cwe_words", "cwe_ratio", "fwe_words", "qa_docs", "n_train",
                     "n_validation", "n_test"):
            self._check(name, getattr(self, name) >= 1, ">= 1")
        self._check("fwe_alpha", self.fwe_alpha > 0, "> 0")
        if self.needle_depth is not None:
            self._check("needle_depth", 0 <= self.needle_depth <= 1, "in [0, 1]: a share of the context (beyond it "
                                                                     "no needle can be placed)")
        if self.max_positions is not None:
            self._check("seq_len", self.seq_len <= self.max_positions,
                        f"<= max_positions={self.max_positions}, the positions the model holds")
        # distinct draws from a group need a group at least that large
        need = {
            "niah_multikey": ("n_keys", self.multikey_needles),
            "niah_multiquery": ("n_keys", self.multiquery_queries),
            "niah_multivalue": ("n_values", self.multivalue_values),
            "vt": ("n_keys", self.vt_chains * (self.vt_hops + 1)),
            "cwe": ("n_words", self.cwe_words + 1),
            "fwe": ("n_words", self.fwe_words + 1),
            "qa": ("n_keys", self.qa_docs),
        }
        for task, (group, count) in need.items():
            if task in self.subtasks:
                self._check(group, getattr(self, group) >= count, f">= {count}: {task} draws {count} distinct of them")
        if "vt" in self.subtasks:
            self._check(
                "n_values", self.n_values >= self.vt_chains, f">= vt_chains={self.vt_chains} (distinct chain values)"
            )
        if "qa" in self.subtasks:
            self._check("n_values", self.n_values >= self.qa_docs, f">= qa_docs={self.qa_docs} (distinct facts)")
        self._check("n_keys + n_values + n_words", self.vocab_size <= MAX_VOCAB, f"<= {MAX_VOCAB} (uint16 tokens, "
                    f"the pair tokens of needles 'fused' included)")
        for task in self.subtasks:
            c, items = self.context_len(task), self._items(task)
            self._check("seq_len", c >= items, f"long enough for {task}'s {items} item tokens in its context of {c}")
        if "cwe" in self.subtasks:
            self._check("seq_len", self.cwe_counts() is not None,
                        f"long enough for {self.cwe_words} common words cwe_ratio={self.cwe_ratio} times as frequent "
                        f"as the other {self.n_words - self.cwe_words} (or more n_words)")
        if "fwe" in self.subtasks:
            counts = self.fwe_counts()
            self._check("seq_len", all(counts[i] > counts[i + 1] for i in range(self.fwe_words)),
                        f"long enough for distinct counts of the top {self.fwe_words + 1} words under fwe_alpha="
                        f"{self.fwe_alpha} (counts {counts[: self.fwe_words + 1].tolist()})")

    def _check(self, name, ok, need):
        if not ok:
            raise SettingError(name, f"long-context setting {name} must be {need}; settings: {self.describe()}")

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))

    @classmethod
    def from_spec(cls, spec: dict) -> "LongContextSettings":
        """From a config dataset entry: the fields above plus ``source: synthetic_longctx``."""
        spec = dict(spec)
        source = spec.pop("source", SOURCE)
        if source != SOURCE:
            raise DataError(f"long-context dataset spec has source {source!r}, expected {SOURCE!r}")
        unknown = sorted(set(spec) - {f.name for f in fields(cls)})
        if unknown:
            raise DataError(f"unknown long-context settings {unknown}; known: {[f.name for f in fields(cls)]}")
        return cls(**spec)

    # -- vocabulary --
    @property
    def key_start(self) -> int:
        return TASK_START + len(SUBTASKS)

    @property
    def value_start(self) -> int:
        return self.key_start + self.n_keys

    @property
    def word_start(self) -> int:
        return self.value_start + self.n_values

    @property
    def pair_start(self) -> int:
        """The fused pair tokens (needles "fused"): key-value, then key-key, then word-value."""
        return self.word_start + self.n_words

    @property
    def vocab_size(self) -> int:
        pairs = self.n_keys * self.n_values + self.n_keys * self.n_keys + self.n_words * self.n_values
        return self.pair_start + (pairs if self.needles == "fused" else 0)

    def statement(self, a: int, b: int) -> list[int]:
        """The statement "a = b" (token ids; a: a key or a word, b: a value or a key): three
        tokens, or with needles "fused" one pair token."""
        if self.needles == "tokens":
            return [a, ASSIGN_ID, b]
        kv, kk = self.n_keys * self.n_values, self.n_keys * self.n_keys
        if self.key_start <= a < self.value_start and self.value_start <= b < self.word_start:
            return [self.pair_start + (a - self.key_start) * self.n_values + b - self.value_start]
        if self.key_start <= a < self.value_start and self.key_start <= b < self.value_start:
            return [self.pair_start + kv + (a - self.key_start) * self.n_keys + b - self.key_start]
        return [self.pair_start + kv + kk + (a - self.word_start) * self.n_values + b - self.value_start]

    @property
    def statement_len(self) -> int:
        return NEEDLE if self.needles == "tokens" else 1

    @property
    def drill_context(self) -> int:
        """Words (and pairs) before a drill example's queries: the first half of the example."""
        return self.seq_len // 2

    # -- layout --
    def question_len(self, task: str) -> int:
        """The task token and its arguments (the <|query|> marker not counted)."""
        return {"niah_multiquery": 1 + self.multiquery_queries, "cwe": 1, "fwe": 1, "qa": 3}.get(task, 2)

    def answer_len(self, task: str) -> int:
        return {"niah_multivalue": self.multivalue_values, "niah_multiquery": self.multiquery_queries,
                "vt": self.vt_hops + 1, "cwe": self.cwe_words, "fwe": self.fwe_words}.get(task, 1)

    def context_len(self, task: str) -> int:
        return self.seq_len - 3 - self.question_len(task) - self.answer_len(task)

    def prompt_len(self, task: str) -> int:
        """Tokens before the answer: through the <|query|> marker, or with question_first
        through the question's last argument."""
        return self.seq_len - 1 - self.answer_len(task)

    def _items(self, task: str) -> int:
        """Context tokens a subtask's needles, statements or documents take (at least)."""
        n = self.statement_len
        return {"niah_single": n, "niah_multikey": n * self.multikey_needles,
                "niah_multivalue": n * self.multivalue_values, "niah_multiquery": n * self.multiquery_queries,
                "vt": n * self.vt_chains * (self.vt_hops + 1), "cwe": 1, "fwe": 1, "qa": (2 + n) * self.qa_docs}[task]

    def cwe_counts(self) -> tuple[int, int] | None:
        """(occurrences of each common word, most occurrences of any other): the least common
        count that is cwe_ratio times the others' once they fill the rest; None if none fits."""
        c, others = self.context_len("cwe"), self.n_words - self.cwe_words
        for common in range(1, c // self.cwe_words + 1):
            rare = math.ceil((c - common * self.cwe_words) / others)
            if common >= self.cwe_ratio * max(rare, 1):
                return common, rare
        return None

    def fwe_counts(self) -> np.ndarray:
        """Occurrences by frequency rank: floor(c p_r), p_r proportional to r^-fwe_alpha, the
        remainder one each to the rarest ranks (so the top ranks keep their order)."""
        c = self.context_len("fwe")
        p = np.arange(1, self.n_words + 1, dtype=np.float64) ** -float(self.fwe_alpha)
        counts = np.floor(c * p / p.sum()).astype(np.int64)
        counts[len(counts) - (c - counts.sum()):] += 1
        return counts

    def layout(self) -> dict:
        """What the meta records, so that answers can be found again from the tokens."""
        return {
            "seq_len": self.seq_len,
            "subtasks": list(self.subtasks),
            "task_ids": {task: TASK_START + SUBTASKS.index(task) for task in self.subtasks},
            "prompt_lengths": {task: self.prompt_len(task) for task in self.subtasks},
            "question_lengths": {task: self.question_len(task) for task in self.subtasks},
            "answer_lengths": {task: self.answer_len(task) for task in self.subtasks},
            "query_id": QUERY_ID,
            "question_first": self.question_first,
            "needles": self.needles,
            "drill": self.drill,
            "key_ids": [self.key_start, self.value_start],
            "value_ids": [self.value_start, self.word_start],
            "word_ids": [self.word_start, self.pair_start],
            "pair_ids": [self.pair_start, self.vocab_size],
            "ruler_tasks": {task: RULER_TASK[task] for task in self.subtasks},
            "metric": {
                task: "string_match_part" if task in PART_SCORED else "string_match_all" for task in self.subtasks
            },
        }


def check_datasets(plan) -> None:
    """Every suite corpus of a plan (dimattn.workflow.sweeps.Plan) as its generator would refuse it, at
    planning: a dimattn.workflow.vocabulary.ConfigError naming ``datasets.<name>.<setting>``."""
    from dimattn.workflow.sweeps import ConfigError

    for name in plan.longctx_datasets:
        try:
            LongContextSettings.from_spec(plan.config["datasets"][name])
        except SettingError as err:
            raise ConfigError(f"datasets.{name}.{err.setting}", str(err)) from None


def vocabulary(settings: LongContextSettings) -> dict[str, int]:
    """Token names by id (see the module docstring)."""

    def group(letter, n):
        width = len(str(n - 1))
        return [f"{letter}{i:0{width}d}" for i in range(n)]

    names = [*RECALL_SPECIALS, "=", "<|doc|>", *(f"<|{task}|>" for task in SUBTASKS)]
    keys, values, words = group("k", settings.n_keys), group("v", settings.n_values), group("w", settings.n_words)
    names += keys + values + words
    if settings.needles == "fused":
        # Pair tokens named without the letters k, v, w: no answer name is a substring of one.
        for letter, left, right in (("a", keys, values), ("c", keys, keys), ("f", words, values)):
            names += [f"{letter}{a[1:]}_{b[1:]}" for a in left for b in right]
    return {name: i for i, name in enumerate(names)}


# ---- generation -----------------------------------------------------------------------------


def _starts(rng, context: int, lengths, first=None) -> np.ndarray:
    """Start positions of items of ``lengths`` kept in order and apart, uniform over the
    context (sorted gaps), or the first at ``first``."""
    lengths = np.asarray(lengths)
    free = context - int(lengths.sum())
    if first is not None:
        gaps = np.sort(rng.integers(0, free - first + 1, size=len(lengths) - 1)) + first
        gaps = np.concatenate([[first], gaps])
    else:
        gaps = np.sort(rng.integers(0, free + 1, size=len(lengths)))
    return gaps + np.concatenate([[0], np.cumsum(lengths)[:-1]])


def _insert(context: np.ndarray, rng, items: list, first=None) -> None:
    """Write ``items`` (token lists, in this order) over the context at :func:`_starts`."""
    for start, item in zip(_starts(rng, len(context), [len(i) for i in items], first), items):
        context[start : start + len(item)] = item


def _example(s: LongContextSettings, task: str, rng) -> tuple[list, list, np.ndarray]:
    """(question arguments, answer, context) of one example of ``task``, as token ids."""
    c = s.context_len(task)
    choose = lambda n, k: rng.choice(n, size=k, replace=False)  # noqa: E731 - distinct draws
    key, value, word = (
        (lambda i: s.key_start + int(i)),
        (lambda i: s.value_start + int(i)),
        (lambda i: s.word_start + int(i)),
    )
    context = s.word_start + rng.integers(0, s.n_words, size=c)  # the haystack
    if task in ("niah_single", "niah_multikey", "niah_multiquery"):
        m = {"niah_single": 1, "niah_multikey": s.multikey_needles, "niah_multiquery": s.multiquery_queries}[task]
        keys, values = choose(s.n_keys, m), rng.integers(0, s.n_values, size=m)
        first = None
        if task == "niah_single" and s.needle_depth is not None:
            first = int(round(s.needle_depth * (c - s.statement_len)))
        _insert(context, rng, [s.statement(key(k), value(v)) for k, v in zip(keys, values)], first)
        asked = rng.permutation(m) if task == "niah_multiquery" else [int(rng.integers(m))]
        return [key(keys[i]) for i in asked], [value(values[i]) for i in asked], context
    if task == "niah_multivalue":
        k, values = key(rng.integers(s.n_keys)), choose(s.n_values, s.multivalue_values)
        _insert(context, rng, [s.statement(k, value(v)) for v in values])
        return [k], [value(v) for v in values], context
    if task == "vt":
        hops = s.vt_hops + 1
        names = choose(s.n_keys, s.vt_chains * hops).reshape(s.vt_chains, hops)
        values = choose(s.n_values, s.vt_chains)
        order = rng.permutation(np.repeat(np.arange(s.vt_chains), hops))  # chains interleaved, each in order
        step = [0] * s.vt_chains
        statements = []
        for chain in order:
            j = step[chain]
            source = value(values[chain]) if j == 0 else key(names[chain, j - 1])
            statements.append(s.statement(key(names[chain, j]), source))
            step[chain] += 1
        _insert(context, rng, statements)
        chain = int(rng.integers(s.vt_chains))
        return [value(values[chain])], [key(n) for n in names[chain]], context
    if task == "cwe":
        common, rare = s.cwe_counts()
        picks = rng.permutation(s.n_words)
        top, others = picks[: s.cwe_words], picks[s.cwe_words :]
        rest = c - common * s.cwe_words
        counts = np.full(len(others), rest // len(others))
        counts[choose(len(others), rest % len(others))] += 1
        context = rng.permutation(np.concatenate([np.repeat(top, common), np.repeat(others, counts)])) + s.word_start
        seen = list(dict.fromkeys(int(t) for t in context if t - s.word_start in set(top.tolist())))
        return [], seen, context
    if task == "fwe":
        ranked = rng.permutation(s.n_words)
        context = rng.permutation(np.repeat(ranked, s.fwe_counts())) + s.word_start
        return [], [word(w) for w in ranked[: s.fwe_words]], context
    # qa: documents of (nearly) equal length, each "<|doc|> title" then words holding one fact
    titles, values = choose(s.n_keys, s.qa_docs), choose(s.n_values, s.qa_docs)
    attribute = word(rng.integers(s.n_words))
    sizes = np.full(s.qa_docs, c // s.qa_docs)
    sizes[: c % s.qa_docs] += 1
    start = 0
    for title, v, size in zip(titles, values, sizes):
        doc = context[start : start + size]
        doc[:2] = DOC_ID, key(title)
        _insert(doc[2:], rng, [s.statement(attribute, value(v))])
        start += size
    asked = int(rng.integers(s.qa_docs))
    return [key(titles[asked]), attribute], [value(values[asked])], context


def generate_examples(settings: LongContextSettings, n: int, rng: np.random.Generator) -> np.ndarray:
    """(n, seq_len) int64 examples; example i is subtask i mod S (the module docstring's layout)."""
    s = settings
    x = np.empty((n, s.seq_len), dtype=np.int64)
    for i in range(n):
        task = s.subtasks[i % len(s.subtasks)]
        question, answer, context = _example(s, task, rng)
        task_id = TASK_START + SUBTASKS.index(task)
        prompt = [task_id, QUERY_ID, *question] if s.question_first else [task_id, *question, QUERY_ID]
        x[i] = [BOS_ID, *context, *prompt, *answer, EOS_ID]
    return x


def drill_example(settings: LongContextSettings, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """(tokens, target positions) of one drill example: ``drill_pairs`` pair tokens (distinct
    keys) at random places among ``drill_context`` words after <|bos|>, then queries ``k v`` (a
    pair's key, its value: the answer predicted at the key, as question_first asks it) as many as
    fit, <|endoftext|> after. The targets are the values."""
    s = settings
    context = s.word_start + rng.integers(0, s.n_words, size=s.drill_context)
    keys, values = rng.choice(s.n_keys, size=s.drill_pairs, replace=False), rng.integers(0, s.n_values, s.drill_pairs)
    places = np.sort(rng.choice(s.drill_context, size=s.drill_pairs, replace=False))
    context[places] = [s.statement(s.key_start + int(k), s.value_start + int(v))[0] for k, v in zip(keys, values)]
    row, targets = [BOS_ID, *context.tolist()], []
    for j in rng.integers(0, s.drill_pairs, size=(s.seq_len - 1 - len(row)) // 2):
        row += [s.key_start + int(keys[j]), s.value_start + int(values[j])]
        targets.append(len(row) - 1)
    return row + [EOS_ID] * (s.seq_len - len(row)), targets


def is_drill(i: int, share: float) -> bool:
    """Whether row i of a train split is a drill example: floor(i * share) steps up at row i, so
    the drill rows are spread evenly, about ``share`` of any stretch of rows."""
    return share > 0 and math.floor((i + 1) * share) > math.floor(i * share)


def generate_split(settings: LongContextSettings, split: str, n: int, rng) -> tuple[np.ndarray, np.ndarray | None]:
    """(examples, answer mask or None) of a split: the suite's examples, and in the train split
    the drill's rows among them (:func:`is_drill`; the suite's rows still cycle through the
    subtasks in order)."""
    s = settings
    drill = s.drill if split == "train" else 0.0
    rows = [is_drill(i, drill) for i in range(n)]
    suite = generate_examples(s, n - sum(rows), rng)
    x, mask = np.empty((n, s.seq_len), dtype=np.int64), np.zeros((n, s.seq_len), dtype=np.uint8)
    suite_rows = zip(suite, find_answers(suite, s.layout()))
    for i, drilled in enumerate(rows):
        if drilled:
            x[i], targets = drill_example(s, rng)
            mask[i, targets] = 1
        else:
            x[i], (_, prompt) = next(suite_rows)
            mask[i, prompt : s.seq_len - 1] = 1
    return x, mask if s.answer_loss else None


def find_answers(examples: np.ndarray, layout: dict) -> list[tuple[str, int]]:
    """(subtask, prompt length) of each example; the answer is examples[i, prompt : seq_len - 1].
    An example holds one task token, its question's arguments and the one <|query|> marker (after
    the arguments, or with question_first right after the task token); raises DataError when the
    examples do not follow the layout."""
    examples = np.asarray(examples)
    n, length = examples.shape
    if length != layout["seq_len"]:
        raise DataError(f"examples have length {length}, the layout says {layout['seq_len']}")
    by_id = {tid: task for task, tid in layout["task_ids"].items()}
    is_task, is_mark = np.isin(examples, list(by_id)), examples == layout["query_id"]
    ok = (is_task.sum(1) == 1) & (is_mark.sum(1) == 1) & (examples[:, 0] == BOS_ID) & (examples[:, -1] == EOS_ID)
    task_pos, mark_pos = is_task.argmax(1), is_mark.argmax(1)
    first = layout["question_first"]
    out = []
    for i in range(n):
        task = by_id.get(int(examples[i, task_pos[i]]))
        q_len = layout["question_lengths"].get(task, 0)
        prompt = int(task_pos[i]) + q_len + 1
        if task is None or prompt != layout["prompt_lengths"][task] \
                or mark_pos[i] != (task_pos[i] + 1 if first else task_pos[i] + q_len):
            ok[i] = False
        out.append((task, prompt))
    if not ok.all():
        raise DataError(f"{int((~ok).sum())} of {n} examples break the long-context layout "
                        f"(first: example {int(np.argmin(ok))})")
    return out


def write_longctx_corpus(settings: LongContextSettings, out_dir) -> dict:
    """Write out_dir/tokens/{train,validation,test}.{bin,json} and out_dir/tokenizer/, as
    dimattn.data.recall's corpus (same files, the layout under meta["longctx"]). Returns the metas."""
    if not isinstance(settings, LongContextSettings):
        settings = LongContextSettings.from_spec(settings)
    layout = settings.layout()

    def make_split(split):
        return generate_split(settings, split, getattr(settings, f"n_{split}"), split_rng(settings.seed, split))

    stored = asdict(settings) | {"subtasks": list(settings.subtasks)}  # as JSON holds it
    meta = {"vocab_size": settings.vocab_size, "source": SOURCE, "longctx": layout, "settings": stored}
    tokenizer = word_level_tokenizer(vocabulary(settings), settings.seq_len)
    return write_synthetic_corpus(out_dir, make_split, tokenizer, meta)


# ---- scoring --------------------------------------------------------------------------------


@functools.cache
def _ruler_metrics():
    """lm-eval's ``lm_eval/tasks/ruler/common_utils.py``, loaded from its file: imported as a module it
    first runs ``lm_eval.tasks``' ``__init__`` (the task registry), 4-5 s of a scoring job's start."""
    import lm_eval

    path = Path(lm_eval.__file__).parent / "tasks" / "ruler" / "common_utils.py"
    spec = importlib.util.spec_from_file_location("_ruler_common_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def example_score(task: str, prediction: str, references: list[str]) -> float:
    """lm-eval's RULER score of one example (``lm_eval.tasks.ruler.common_utils``): the share of its
    references found (case-insensitive substring) in the prediction."""
    metrics = _ruler_metrics()
    metric = metrics.string_match_part if task in PART_SCORED else metrics.string_match_all
    return float(metric([prediction], [references]))


def score_predictions(subtasks: list[str], predictions: list[list[int]], answers: list[list[int]], names) -> dict:
    """Per subtask: ``score`` (100 x the mean of :func:`example_score`, the decoded prediction
    against the answer's names), ``exact`` (100 x the share of predictions equal to the answer)
    and ``n``; ``average``: the mean score over subtasks (RULER's average)."""
    out = {}
    for task in dict.fromkeys(subtasks):
        rows = [i for i, t in enumerate(subtasks) if t == task]
        scores = [example_score(task, " ".join(names[t] for t in predictions[i]), [names[t] for t in answers[i]])
                  for i in rows]
        exact = np.mean([list(predictions[i]) == list(answers[i]) for i in rows])
        out[task] = {"score": float(100 * np.mean(scores)), "exact": float(100 * exact), "n": len(rows)}
    return {"subtasks": out, "average": float(np.mean([v["score"] for v in out.values()]))}


def generate_answers(model, examples: np.ndarray, answers: list[tuple[str, int]], batch_size: int) -> list[list[int]]:
    """The model's greedy continuation of each prompt, as many tokens as its answer, the prompt
    prefilled into the KV cache (dimattn.data.recall.decode_through_cache); one subtask a batch, so
    prompts share a length."""
    import torch

    device = next(model.parameters()).device
    length = examples.shape[1]
    out = [None] * len(examples)
    for task in dict.fromkeys(t for t, _ in answers):
        rows = [i for i, (t, _) in enumerate(answers) if t == task]
        prompt = answers[rows[0]][1]
        n_answer = length - 1 - prompt
        with torch.no_grad():
            for start in range(0, len(rows), batch_size):
                chunk = rows[start : start + batch_size]
                x = torch.from_numpy(np.ascontiguousarray(examples[chunk, :prompt], dtype=np.int64)).to(device)
                found = decode_through_cache(model, x, prompt, prompt + n_answer - 1, greedy=True)
                for i, row in zip(chunk, found[:, prompt - 1 :].cpu().numpy()):
                    out[i] = row.tolist()
    return out


NEEDLE_BINS = 5  # needle-depth bins of the heat map: 0-20 % of the context, ... 80-100 %
NEEDLE_TASKS = ("niah_single", "niah_multikey")  # one asked needle; multikey's among distractor needles


def needle_depths(examples: np.ndarray, answers: list[tuple[str, int]], layout: dict) -> dict[int, float]:
    """The asked needle's depth per example of NEEDLE_TASKS (row -> its start as a share of the
    places a needle could start, 0 .. 1, as ``needle_depth`` places it): the asked key, which
    only its needle holds in the context."""
    out, fused = {}, layout["needles"] == "fused"
    (k0, _), (v0, v1) = layout["key_ids"], layout["value_ids"]
    for i, (task, prompt) in enumerate(answers):
        if task not in NEEDLE_TASKS:
            continue
        q_len = layout["question_lengths"][task]
        # the question's key: <|task|> k <|query|>, or <|task|> <|query|> k
        key = examples[i, prompt - q_len + int(layout["question_first"])]
        context = examples[i, 1 : prompt - 1 - q_len]
        if fused:  # the needle is the pair token of that key (LongContextSettings.statement)
            first = layout["pair_ids"][0] + (key - k0) * (v1 - v0)
            at = np.flatnonzero((context >= first) & (context < first + v1 - v0))
        else:
            at = np.flatnonzero(context == key)
        out[i] = float(at[0] / (len(context) - (1 if fused else NEEDLE)))
    return out


def needle_scores(depths: dict[int, float], scores: dict[int, float], bins: int = NEEDLE_BINS) -> list[dict]:
    """The heat map's row of one corpus: per depth bin [lo, hi) (the last bin closed), the mean
    example score in % and the examples in it (bins without examples left out)."""
    rows = []
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        inside = [scores[i] for i, d in depths.items() if lo <= d < hi or b == bins - 1 and d == 1.0]
        if inside:
            rows.append({"depth_lo": lo, "depth_hi": hi, "score": float(100 * np.mean(inside)), "n": len(inside)})
    return rows


def load_suite(tokens_bin) -> tuple[np.ndarray, dict]:
    """(examples: n x example_len tokens, meta) of a suite corpus; a file that is none, or whose
    length disagrees with its meta, is refused naming it."""
    return load_synthetic_examples(tokens_bin, SOURCE, "longctx")


def score_suite(model, tokens_bin, batch_size: int, max_examples: int | None = None) -> dict:
    """The suite's scores (:func:`score_predictions`) of a loaded model on a split, by greedy
    generation through the KV cache (:func:`generate_answers`); ``needle``: per subtask of
    NEEDLE_TASKS its score by the asked needle's depth (:func:`needle_scores`, the needle heat
    map's column at this length); ``cache_bytes_per_token``: the model's cache over its first
    example (dimattn.data.recall.cache_bytes_per_token)."""
    if type(batch_size) is not int or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    examples, meta = load_suite(tokens_bin)
    examples = examples[:max_examples]
    length = meta["example_len"]
    if model.config.vocab_size < meta["vocab_size"]:
        raise ValueError(f"model vocab_size {model.config.vocab_size} < corpus vocab_size {meta['vocab_size']}")
    layout = meta["longctx"]
    answers = find_answers(examples, layout)
    predictions = generate_answers(model, examples, answers, batch_size)
    names = list(vocabulary(LongContextSettings(**_settings_fields(meta["settings"]))))
    gold = [examples[i, prompt : length - 1].tolist() for i, (_, prompt) in enumerate(answers)]
    result = score_predictions([t for t, _ in answers], predictions, gold, names)
    depths = needle_depths(examples, answers, layout)
    scores = {i: example_score(answers[i][0], " ".join(names[t] for t in predictions[i]), [names[t] for t in gold[i]])
              for i in depths}
    needle = {task: needle_scores({i: d for i, d in depths.items() if answers[i][0] == task}, scores)
              for task in NEEDLE_TASKS if task in layout["subtasks"]}
    cache = cache_bytes_per_token(model, examples[:1], answers[0][1])  # its prompt prefilled, its answer decoded
    return {"split": meta.get("split", "test"), "seq_len": length, **result, "needle": needle,
            "cache_bytes_per_token": cache}


def _settings_fields(stored: dict) -> dict:
    return {**stored, "subtasks": tuple(stored["subtasks"])}
