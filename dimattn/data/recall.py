"""Synthetic multi-query associative recall (MQAR, Zoology: Arora et al. 2023) at CPU scale.

A probe of whether *distant* tokens need full dimensionality: key-value pairs come first,
and each key is asked for again much later, further back than any attention window we sweep,
so the model can only answer by reading the far (bottlenecked) keys and values.

Vocabulary (token ids)::

    0 <|endoftext|>   1 <|bos|>   2 <|pad|>             same ids as dimattn.data.corpora
    3 <|unk|>         4 <|query|>  (the marker of ``query_marker``)
    5 ...                      keys    k0 .. k{n_keys-1}
    5 + n_keys ...             values  v0 .. v{n_values-1}
    5 + n_keys + n_values ...  filler  f0 .. f{n_filler-1}  (noise)
    then, with fused_pairs,    pairs   k{i}v{j}, id fused_start + i * n_values + j

With ``fused_pairs`` each pair is a single token ``k{i}v{j}`` at position 1 + i (ids after
the filler), so a query's key finds its answer in one attention hop: the probe then measures
how well distant tokens keep key and value through the bottleneck, without the two-layer
induction circuit that adjacent pairs need (which tiny models form too slowly for a CPU run).

One example is exactly ``seq_len`` tokens (P = n_pairs, Q = n_queries, L = seq_len)::

    position  0            <|bos|>
              1 + 2i       key_i     i < P, P distinct keys drawn without replacement
              2 + 2i       value_i   drawn with replacement
              2P+1 .. L-2  filler, except Q queries: at position q the key of a pair (each
                           pair asked at most once), at q + 1 its value (the target)
              L - 1        <|endoftext|>

Query positions q lie in [min_query_pos, L-3] and never overlap (q_{j+1} >= q_j + 2), so the
distance from a query to its key, q - (1 + 2i), is at least min_query_pos - (2P - 1)
(``RecallSettings.min_distance``; with fused pairs the pair block is 1 .. P). Only the
prediction made *at* a query position (of the token at q + 1) is scored. With ``answer_loss``
(the default) the corpus also writes ``{split}.targets.bin``, a uint8 mask that is 1 at the
answers, and the trainer computes the loss there only, as Zoology does; without it the loss
covers the whole sequence, where pair tokens and filler are unpredictable noise.

Two options of the adjacent layout, for studying the two-layer circuit it needs:

- ``query_marker``: each query is ``key <|query|> value``, scored at the marker. The marker
  tells a query from a pair by the current token alone; without the mask this is what lets a
  whole-sequence loss learn recall at all (a first-occurrence key is followed by a random value,
  so copying from context is penalised there unless the model can tell the two apart).
- ``sorted_keys``: the pair keys in increasing id order. Predicting the next pair key then
  needs the previous one, which rewards the previous-token head of the induction circuit
  directly; it also leaks a rough position of each key, so it is off by default.

Queries are recomputed from the tokens and the layout in the meta (any key id after the pair
block is a query), and evaluation checks each target against its pair: a corrupted corpus is
refused rather than scored. Splits use independent random streams of one seed
(``SeedSequence([seed, split_index])``). The files are those of ``dimattn.data.corpora``: a flat
uint16 memmap per split with a JSON sidecar, plus ``meta["example_len"] = seq_len`` so a trainer
can cut windows at example boundaries, and a WordLevel tokenizer directory.
"""

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from dimattn.workflow.schema import dataset_defaults
from dimattn.model.atomic import atomic_dir
from dimattn.data.corpora import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, SPLITS, DataError, load_tokens

UNK_TOKEN, QUERY_TOKEN = "<|unk|>", "<|query|>"
RECALL_SPECIALS = [EOS_TOKEN, BOS_TOKEN, PAD_TOKEN, UNK_TOKEN, QUERY_TOKEN]  # ids 0 .. 4
EOS_ID, BOS_ID, PAD_ID, QUERY_ID = 0, 1, 2, 4
SOURCE = "synthetic_recall"
MAX_VOCAB = 1 << 16  # uint16 tokens


# every default the schema gives (its one home: dimattn.workflow.schema)
_DEFAULTS = dataset_defaults("synthetic_recall")


@dataclass(frozen=True)
class RecallSettings:
    """Generator settings; every field is checked, and an error names the field."""

    seq_len: int  # tokens per example, bos and eos included (the schema requires it)
    n_pairs: int = _DEFAULTS["n_pairs"]  # key-value pairs at the start of each example
    n_keys: int = _DEFAULTS["n_keys"]  # key vocabulary (>= n_pairs: keys in an example are distinct)
    n_values: int = _DEFAULTS["n_values"]  # value vocabulary
    n_filler: int = _DEFAULTS["n_filler"]  # noise vocabulary for the positions between pairs and queries
    min_query_pos: int = _DEFAULTS["min_query_pos"]  # queries sit at positions >= this
    n_queries: int | None = _DEFAULTS["n_queries"]  # queries per example; None: one per pair
    sorted_keys: bool = _DEFAULTS["sorted_keys"]  # pair keys in increasing id order (see the module docstring)
    query_marker: bool = _DEFAULTS["query_marker"]  # each query is key, <|query|>, value (see the module docstring)
    fused_pairs: bool = _DEFAULTS["fused_pairs"]  # each pair is one token k{i}v{j}: recall in one attention hop
    answer_loss: bool = _DEFAULTS["answer_loss"]  # train on the answers only (meta "loss_mask"), as Zoology does
    n_train: int = _DEFAULTS["n_train"]  # examples per split
    n_validation: int = _DEFAULTS["n_validation"]
    n_test: int = _DEFAULTS["n_test"]
    seed: int = _DEFAULTS["seed"]

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "n_queries" and value is None:
                continue
            if f.name in ("sorted_keys", "query_marker", "fused_pairs", "answer_loss"):
                if type(value) is not bool:
                    raise DataError(f"recall setting {f.name} must be true or false, got {value!r}")
                continue
            if type(value) is not int:
                raise DataError(f"recall setting {f.name} must be an int, got {value!r}")
        self._check("seed", self.seed >= 0, ">= 0")
        for name in ("n_pairs", "n_keys", "n_values", "n_filler", "n_train", "n_validation", "n_test"):
            self._check(name, getattr(self, name) >= 1, ">= 1")
        self._check(
            "n_keys", self.n_keys >= self.n_pairs, f">= n_pairs={self.n_pairs} (keys in an example are distinct)"
        )
        self._check("n_queries", 1 <= self.queries <= self.n_pairs, f"between 1 and n_pairs={self.n_pairs}")
        self._check(
            "n_keys + n_values + n_filler",
            self.vocab_size <= MAX_VOCAB,
            f"<= {MAX_VOCAB} (uint16 tokens): lower n_keys, n_values or n_filler",
        )
        pair_end = 1 + self.pair_stride * self.n_pairs  # first position after the pair block
        self._check(
            "min_query_pos",
            self.min_query_pos >= pair_end,
            f">= {pair_end}, the first position after bos and {self.n_pairs} pairs",
        )
        room = self.seq_len - 1 - self.min_query_pos  # positions min_query_pos .. seq_len - 2
        self._check(
            "seq_len",
            room >= self.query_span * self.queries,
            f">= min_query_pos + {self.query_span} * n_queries + 1 = "
            f"{self.min_query_pos + self.query_span * self.queries + 1} (room for {self.queries} queries and eos)",
        )

    def _check(self, name, ok, need):
        if not ok:
            raise DataError(f"recall setting {name} must be {need}; settings: {self.describe()}")

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))

    @classmethod
    def from_spec(cls, spec: dict) -> "RecallSettings":
        """From a config dataset entry: the fields above plus ``source: synthetic_recall``."""
        if not isinstance(spec, dict):
            raise DataError(f"recall dataset spec must be a mapping, got {type(spec).__name__}")
        spec = dict(spec)
        source = spec.pop("source", SOURCE)
        if source != SOURCE:
            raise DataError(f"recall dataset spec has source {source!r}, expected {SOURCE!r}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(spec) - set(known))
        if unknown:
            raise DataError(f"unknown recall settings {unknown}; known: {known}")
        return cls(**spec)

    @property
    def queries(self) -> int:
        return self.n_pairs if self.n_queries is None else self.n_queries

    @property
    def query_span(self) -> int:
        """Tokens per query: key and value, with the marker between them if there is one."""
        return 3 if self.query_marker else 2

    @property
    def key_start(self) -> int:
        return len(RECALL_SPECIALS)

    @property
    def value_start(self) -> int:
        return self.key_start + self.n_keys

    @property
    def filler_start(self) -> int:
        return self.value_start + self.n_values

    @property
    def fused_start(self) -> int:
        return self.filler_start + self.n_filler

    @property
    def pair_stride(self) -> int:
        """Tokens a pair takes in the pair block: key and value, or one fused token."""
        return 1 if self.fused_pairs else 2

    @property
    def vocab_size(self) -> int:
        return self.fused_start + (self.n_keys * self.n_values if self.fused_pairs else 0)

    @property
    def min_distance(self) -> int:
        """The shortest distance from a scored position to its pair's key: the last pair's key to
        the first query slot."""
        return self.min_query_pos + self.query_span - 2 - (self.pair_stride * (self.n_pairs - 1) + 1)

    @property
    def max_distance(self) -> int:
        """The longest: the first pair's key (position 1) to the last scored position (L - 3)."""
        return self.seq_len - 4

    def n_examples(self, split: str) -> int:
        return getattr(self, f"n_{split}")

    def layout(self) -> dict:
        """What the meta records so that queries can be found again from the tokens."""
        return {
            "seq_len": self.seq_len,
            "n_pairs": self.n_pairs,
            "n_queries": self.queries,
            "min_query_pos": self.min_query_pos,
            "query_marker": self.query_marker,
            "query_id": QUERY_ID,
            "key_ids": [self.key_start, self.value_start],
            "value_ids": [self.value_start, self.filler_start],
            "filler_ids": [self.filler_start, self.fused_start],
            "fused_pairs": self.fused_pairs,
            "fused_ids": [self.fused_start, self.vocab_size],
            "min_distance": self.min_distance,
        }


def vocabulary(settings: RecallSettings) -> dict[str, int]:
    names = list(RECALL_SPECIALS)
    names += [f"k{i}" for i in range(settings.n_keys)]
    names += [f"v{i}" for i in range(settings.n_values)]
    names += [f"f{i}" for i in range(settings.n_filler)]
    if settings.fused_pairs:
        names += [f"k{i}v{j}" for i in range(settings.n_keys) for j in range(settings.n_values)]
    return {name: i for i, name in enumerate(names)}


def generate_examples(settings: RecallSettings, n: int, rng: np.random.Generator) -> np.ndarray:
    """(n, seq_len) int64 examples in the layout of the module docstring."""
    s, P, Q, L = settings, settings.n_pairs, settings.queries, settings.seq_len
    x = np.empty((n, L), dtype=np.int64)
    x[:, 0] = BOS_ID
    x[:, -1] = EOS_ID
    x[:, 1:-1] = s.filler_start + rng.integers(0, s.n_filler, size=(n, L - 2))
    keys = np.argsort(rng.random((n, s.n_keys)), axis=1)[:, :P]  # distinct within an example
    if s.sorted_keys:
        keys = np.sort(keys, axis=1)
    values = rng.integers(0, s.n_values, size=(n, P))
    if s.fused_pairs:  # token k{key}v{value}: the query's key matches it in one hop
        x[:, 1 : 1 + P] = s.fused_start + keys * s.n_values + values
    else:
        x[:, 1 : 1 + 2 * P : 2] = s.key_start + keys
        x[:, 2 : 2 + 2 * P : 2] = s.value_start + values
    # Q non-overlapping spans of S tokens in [min_query_pos, L-2]: sorted distinct offsets in
    # [0, room - (S-1) Q), the j-th shifted by (S-1) j, so consecutive queries are >= S apart.
    S, room = s.query_span, L - 1 - s.min_query_pos
    offsets = np.sort(np.argsort(rng.random((n, room - (S - 1) * Q)), axis=1)[:, :Q], axis=1)
    qpos = s.min_query_pos + offsets + (S - 1) * np.arange(Q)
    asked = np.argsort(rng.random((n, P)), axis=1)[:, :Q]  # which pair each query asks for
    rows = np.arange(n)[:, None]
    x[rows, qpos] = s.key_start + np.take_along_axis(keys, asked, axis=1)
    if s.query_marker:
        x[rows, qpos + 1] = QUERY_ID
    x[rows, qpos + S - 1] = s.value_start + np.take_along_axis(values, asked, axis=1)
    return x


def split_rng(seed: int, split: str) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, SPLITS.index(split)]))


def build_tokenizer(settings: RecallSettings):
    """A WordLevel tokenizer over the vocabulary (whitespace separated names), eos/bos/pad set."""
    return word_level_tokenizer(vocabulary(settings), settings.seq_len)


def word_level_tokenizer(vocab: dict[str, int], max_length: int):
    """A WordLevel tokenizer over ``vocab`` (whitespace separated names, the specials of
    RECALL_SPECIALS among them), eos/bos/pad set: the synthetic corpora's tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    word_level = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    word_level.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=word_level,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )


def write_synthetic_corpus(out_dir, make_split, tokenizer, meta: dict) -> dict:
    """Write out_dir/tokens/{train,validation,test}.{bin,json} and out_dir/tokenizer/ of a
    synthetic corpus: ``make_split(split)`` gives its (n, example_len) examples and a uint8
    training-target mask of the same shape, or None (the loss then covers every token); ``meta``
    (source, vocab_size, the layout, the settings) goes into every split's sidecar.

    out_dir is replaced as a whole (it appears complete or not at all). Returns the metas.
    """
    out_dir, metas = Path(out_dir), {}
    with atomic_dir(out_dir) as tmp:
        (tmp / "tokens").mkdir()
        for split in SPLITS:
            examples, mask = make_split(split)
            bin_path = tmp / "tokens" / f"{split}.bin"
            examples.astype(np.uint16).tofile(bin_path)
            mask_name = None
            if mask is not None:  # 1 where the token is an answer: the only training targets
                mask_name = f"{split}.targets.bin"
                mask.astype(np.uint8).tofile(tmp / "tokens" / mask_name)
            metas[split] = {
                "dtype": "uint16",
                "n_tokens": int(examples.size),
                "eos_token_id": EOS_ID,
                "bos_token_id": BOS_ID,
                "pad_token_id": PAD_ID,
                "split": split,
                "example_len": int(examples.shape[1]),
                "n_examples": int(len(examples)),
                **({"loss_mask": mask_name} if mask_name else {}),
                **meta,
            }
            bin_path.with_suffix(".json").write_text(json.dumps(metas[split], indent=2))
        tokenizer.save_pretrained(tmp / "tokenizer")
    return metas


def write_recall_corpus(settings: RecallSettings, out_dir) -> dict:
    """Write out_dir/tokens/{train,validation,test}.{bin,json} and out_dir/tokenizer/.

    out_dir is replaced as a whole (it appears complete or not at all). Returns the metas.
    """
    if not isinstance(settings, RecallSettings):
        settings = RecallSettings.from_spec(settings)

    def make_split(split):
        examples = generate_examples(settings, settings.n_examples(split), split_rng(settings.seed, split))
        if not settings.answer_loss:
            return examples, None
        queries = find_queries(examples, settings.layout())
        mask = np.zeros(examples.shape, dtype=np.uint8)
        mask[queries[:, 0], queries[:, 1] + 1] = 1
        return examples, mask

    meta = {
        "vocab_size": settings.vocab_size,
        "source": SOURCE,
        "recall": settings.layout(),
        "settings": asdict(settings),
    }
    return write_synthetic_corpus(out_dir, make_split, build_tokenizer(settings), meta)


# ---------------------------------------------------------------------------------------------
# Scoring


def load_synthetic_examples(tokens_bin, source: str, layout: str) -> tuple[np.ndarray, dict]:
    """The (n_examples, example_len) token matrix and meta of a split written by
    :func:`write_synthetic_corpus`; a file of another source or layout, or whose length disagrees
    with its meta, is refused naming it."""
    tokens, meta = load_tokens(tokens_bin)
    if meta.get("source") != source or layout not in meta:
        raise DataError(f"{tokens_bin} is not a {source} corpus (its meta has no {layout!r} layout)")
    L, n = meta["example_len"], meta["n_examples"]
    if n * L != len(tokens):
        raise DataError(f"{tokens_bin}: {len(tokens)} tokens, but meta says {n} examples of {L}")
    return np.asarray(tokens).reshape(n, L), meta


def load_examples(tokens_bin) -> tuple[np.ndarray, dict]:
    """The (n_examples, example_len) token matrix and meta of a recall split, checked."""
    return load_synthetic_examples(tokens_bin, SOURCE, "recall")


def find_queries(examples: np.ndarray, layout: dict) -> np.ndarray:
    """(n_queries, 4) int64 rows (example, scored position, pair key position, target id).

    The model's output at the scored position (the query's key, or its marker) must be the
    target, the token after it. Raises DataError when the examples do not follow the layout.
    """
    examples = np.asarray(examples, dtype=np.int64)
    n, L = examples.shape
    P, Q, start = layout["n_pairs"], layout["n_queries"], layout["min_query_pos"]
    (k0, k1), (v0, v1) = layout["key_ids"], layout["value_ids"]
    if L != layout["seq_len"]:
        raise DataError(f"examples have length {L}, the layout says {layout['seq_len']}")
    fused = layout["fused_pairs"]
    stride = 1 if fused else 2
    if fused:  # back from k{i}v{j} to the key and value ids the queries use
        f0, f1 = layout["fused_ids"]
        n_values = v1 - v0
        block = examples[:, 1 : 1 + P]
        bad_fused = ~((block >= f0) & (block < f1)).all(1)
        pair_keys, pair_values = k0 + (block - f0) // n_values, v0 + (block - f0) % n_values
    else:
        bad_fused = np.zeros(n, dtype=bool)
        pair_keys, pair_values = examples[:, 1 : 1 + 2 * P : 2], examples[:, 2 : 2 + 2 * P : 2]
    bad = ~((examples[:, 0] == BOS_ID) & (examples[:, -1] == EOS_ID)) | bad_fused
    bad |= ~(((pair_keys >= k0) & (pair_keys < k1)).all(1) & ((pair_values >= v0) & (pair_values < v1)).all(1))
    is_key = (examples >= k0) & (examples < k1)
    is_key[:, : 1 + stride * P] = False
    bad |= is_key[:, :start].any(1) | (is_key.sum(1) != Q)
    ex, qpos = np.nonzero(is_key)
    marker = layout["query_marker"]
    if marker:  # the key, then the marker; a key at L-2 has no room for either
        is_marker = examples == layout["query_id"]
        bad |= is_marker.sum(1) != Q
        bad[ex[qpos > L - 4]] = True
        ex, qpos = ex[qpos <= L - 4], qpos[qpos <= L - 4]
        bad[ex[~is_marker[ex, qpos + 1]]] = True
        qpos = qpos + 1  # scored at the marker
    match = pair_keys[ex] == examples[ex, qpos - int(marker)][:, None]  # (N, P)
    bad[ex[match.sum(1) != 1]] = True
    slot = match.argmax(1)
    target = examples[ex, qpos + 1]
    bad[ex[target != pair_values[ex, slot]]] = True
    if bad.any():
        raise DataError(
            f"{int(bad.sum())} of {n} examples break the recall layout (first: example {int(np.argmax(bad))})"
        )
    return np.stack([ex, qpos, 1 + stride * slot, target], axis=1)


def default_distance_bins(layout: dict, n_bins: int = 4) -> list[int]:
    """n_bins equal-width bins over every possible query distance."""
    lo, hi = layout["min_distance"], layout["seq_len"] - 4  # as RecallSettings.max_distance
    return sorted({int(round(e)) for e in np.linspace(lo, hi + 1, n_bins + 1)})


def score_queries(predictions: np.ndarray, queries: np.ndarray, bins: list[int]) -> dict:
    """Accuracy of predictions (one per query row) overall and by distance bin [lo, hi)."""
    correct = predictions == queries[:, 3]
    distance = queries[:, 1] - queries[:, 2]
    by_distance = []
    for lo, hi in zip(bins[:-1], bins[1:]):
        sel = (distance >= lo) & (distance < hi)
        by_distance.append({
            "min_distance": int(lo),
            "max_distance": int(hi - 1),
            "accuracy": float(correct[sel].mean()) if sel.any() else None,
            "n": int(sel.sum()),
        })
    return {"accuracy": float(correct.mean()), "n_queries": int(len(correct)), "by_distance": by_distance}


def _predict(examples: np.ndarray, queries: np.ndarray, batch_size: int, device, argmax) -> np.ndarray:
    """``argmax`` (a (b, L) token batch -> the (b, >= L - 1) argmax at each position) at each
    query position, ``batch_size`` examples at a time."""
    import torch

    predictions = np.empty(len(queries), dtype=np.int64)
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            stop = min(start + batch_size, len(examples))
            x = torch.from_numpy(np.ascontiguousarray(examples[start:stop], dtype=np.int64)).to(device)
            found = argmax(x).cpu().numpy()
            sel = (queries[:, 0] >= start) & (queries[:, 0] < stop)
            predictions[sel] = found[queries[sel, 0] - start, queries[sel, 1]]
    return predictions


def predict_at_queries(model, examples: np.ndarray, queries: np.ndarray, batch_size: int) -> np.ndarray:
    """The model's argmax (over the whole vocabulary) at each query position."""
    device = next(model.parameters()).device
    return _predict(examples, queries, batch_size, device, lambda x: model(x).logits.argmax(-1))


def predict_through_cache(model, examples: np.ndarray, queries: np.ndarray, prefill: int,
                          batch_size: int) -> np.ndarray:
    """The model's argmax at each query position when the first ``prefill`` tokens of an
    example are one prompt and the rest are fed a token at a time through the model's KV cache
    (teacher forced): the context is prefilled and cached, the questions are decoded against
    that cache, which is where KV-cache compression acts (SnapKV evicts from the prompt's cache
    once, after the prefill; KIVI quantises tokens as they age). Positions are passed
    explicitly, since an evicting cache is shorter than the sequence it has seen. Without
    compression the predictions are those of :func:`predict_at_queries`."""
    length = examples.shape[1]
    if not 1 <= prefill < length:
        raise ValueError(f"prefill must be in 1..{length - 1}, got {prefill}")
    device = next(model.parameters()).device
    # the last token predicts nothing scored
    return _predict(
        examples, queries, batch_size, device, lambda x: decode_through_cache(model, x, prefill, length - 1)
    )


def decode_through_cache(model, x, prefill: int, stop: int, greedy: bool = False, return_cache: bool = False):
    """(b, stop) argmax of ``model`` at positions 0 .. stop - 1 of the token batch ``x``: the
    first ``prefill`` tokens one prompt, then a token at a time through the model's KV cache
    (where KV compression acts), positions passed explicitly (an evicting cache is shorter than
    what it has seen). Position t >= prefill reads token x[:, t] (teacher forced) or, ``greedy``,
    the argmax at t - 1: greedy generation of stop - prefill tokens after the prompt."""
    import torch

    positions = torch.arange(stop, device=x.device).expand(len(x), stop)
    out = model(input_ids=x[:, :prefill], position_ids=positions[:, :prefill], use_cache=True)
    steps = [out.logits.argmax(-1)]
    for t in range(prefill, stop):
        token = steps[-1][:, -1:] if greedy else x[:, t : t + 1]
        out = model(input_ids=token, position_ids=positions[:, t : t + 1], cache=out.past_key_values, use_cache=True)
        steps.append(out.logits.argmax(-1))
    found = torch.cat(steps, dim=1)
    return (found, out.past_key_values) if return_cache else found


def cache_bytes_per_token(model, x, prefill: int | None = None) -> float:
    """KV-cache bytes per token, measured from the generation cache the model itself keeps
    (its nbytes: DimAttnCache's latents, a sliding layer's window, a ProjectedCache's d'-wide
    keys, KIVI's packed codes, SnapKV's kept tokens) after it has seen every token of ``x``
    (B, T token ids, an array or a tensor; one example suffices, as the bytes a token do not
    depend on the batch), over B x T. ``prefill``: the first ``prefill`` tokens one prompt and
    the rest decoded a token at a time, as the probes score (:func:`decode_through_cache`;
    SnapKV evicts from the prompt only); None: all of x one prompt, which any transformers model
    takes."""
    import torch

    from dimattn.model.modeling_dimattn import kv_cache_nbytes

    x = torch.as_tensor(np.asarray(x, dtype=np.int64), device=next(model.parameters()).device)
    with torch.no_grad():
        if prefill is None:
            cache = model(input_ids=x, use_cache=True).past_key_values
        else:
            _, cache = decode_through_cache(model, x, prefill, x.shape[1], return_cache=True)
    nbytes = cache.nbytes() if hasattr(cache, "nbytes") else kv_cache_nbytes(cache)
    return nbytes / x.numel()


def score_recall(model, tokens_bin, batch_size: int, distance_bins: list[int] | None = None,
                 max_examples: int | None = None, through_cache: bool = False) -> dict:
    """Recall accuracy of a loaded model on the examples of tokens_bin (or the first
    max_examples), overall and by distance bin, with the split and chance level.

    distance_bins: increasing edges; bin i holds distances in [edge_i, edge_{i+1}). Default:
    four equal-width bins over the possible distances. ``through_cache``: the context (every
    token before the first query slot, ``min_query_pos``) is prefilled and the rest decoded
    through the KV cache (:func:`predict_through_cache`); else one forward of each example.
    ``cache_bytes_per_token``: the model's cache over one example scored through it
    (:func:`cache_bytes_per_token`), whichever way the predictions were made.
    """
    if type(batch_size) is not int or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    examples, meta = load_examples(tokens_bin)
    if max_examples is not None:
        examples = examples[:max_examples]
    layout = meta["recall"]
    bins = default_distance_bins(layout) if distance_bins is None else [int(b) for b in distance_bins]
    if len(bins) < 2 or any(a >= b for a, b in zip(bins[:-1], bins[1:])):
        raise ValueError(f"distance_bins must be >= 2 increasing edges, got {distance_bins!r}")
    queries = find_queries(examples, layout)
    if model.config.vocab_size < meta["vocab_size"]:
        raise ValueError(f"model vocab_size {model.config.vocab_size} < corpus vocab_size {meta['vocab_size']}")
    if through_cache:
        predictions = predict_through_cache(model, examples, queries, layout["min_query_pos"], batch_size)
    else:
        predictions = predict_at_queries(model, examples, queries, batch_size)
    n_values = layout["value_ids"][1] - layout["value_ids"][0]
    result = {"split": meta.get("split", "test"), **score_queries(predictions, queries, bins)}
    result["chance"] = 1.0 / n_values
    result["cache_bytes_per_token"] = cache_bytes_per_token(model, examples[:1], layout["min_query_pos"])
    if through_cache:
        result["prefill"] = layout["min_query_pos"]
    return result
