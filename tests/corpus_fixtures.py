"""A small tokenised corpus for tests that train or read token files."""

import random
from pathlib import Path

from dimattn.data import corpora as data

WORDS = "the king queen sword crown night day love death fool heart blood ghost storm sea ship lord".split()


def token_corpus(root: Path, train_docs: int, validation_docs: int, words_per_doc: int) -> Path:
    """Random-word documents, a byte-level BPE (vocab 300) trained on them, and train/validation
    token files (``<split>.bin`` + ``.json``) under ``root``."""
    rng = random.Random(0)
    for split, n_docs in (("train", train_docs), ("validation", validation_docs)):
        docs = [{"id": f"{split}{i}", "text": " ".join(rng.choice(WORDS) for _ in range(words_per_doc)) + "."}
                for i in range(n_docs)]
        data.write_documents(docs, root / f"{split}.jsonl")
    data.train_tokenizer(root / "train.jsonl", vocab_size=300, out_dir=root / "tokenizer")
    for split in ("train", "validation"):
        data.tokenize_documents(root / f"{split}.jsonl", root / "tokenizer", root / f"{split}.bin", 0)
    return root
