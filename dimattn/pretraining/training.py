"""Pretraining loop in the nanoGPT manner: random windows from a token memmap, AdamW, linear
warm-up then cosine decay, gradient clipping, and a metrics CSV (step, tokens, lr, train_loss,
val_loss).

- ``batch_size`` is the global batch: sequences per optimizer step over all processes. Each
  process runs ``micro_batch_size`` sequences a forward pass and accumulates gradients over
  ``batch_size // (micro_batch_size * world_size)`` of them.
- The windows of step s are drawn from a generator seeded by (seed, s) alone, so the global
  batch is the same whatever the world size or micro-batch, and resuming needs no RNG state.
- Launched by ``torchrun`` (WORLD_SIZE > 1) it trains with DistributedDataParallel; only rank 0
  writes metrics, checkpoints and the exported model.
- A run killed at any moment resumes from its last checkpoint, which holds the metrics rows so
  far and the configuration it was trained with; on CPU the resumed run ends bitwise equal to an
  uninterrupted one, in float32 and in bfloat16.
- ``precision``: "bf16" autocasts the matmuls to bfloat16 (weights, gradients and AdamW state
  stay float32; the loss is float32); "auto" (the default) takes bf16 where the device runs it
  natively (dimattn.pretraining.precision: CUDA with bf16, a CPU with AMX-BF16 or AVX512-BF16), else fp32.

Command line (what torchrun launches): ``python -m dimattn.pretraining.training --spec spec.json ...``.
"""

import argparse
import contextlib
import csv
import ctypes
import io
import json
import math
import os
import pickle
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from dimattn.model.atomic import atomic_dir, atomic_file
from dimattn.model.configuration_dimattn import DimAttnConfig
from dimattn.data.corpora import load_loss_mask, load_tokens, save_tokenizer
from dimattn.model.modeling_dimattn import DimAttnForCausalLM
from dimattn.pretraining.precision import PRECISIONS, autocast, resolve_precision
from dimattn.workflow.schema import defaults_at
from dimattn.workflow.settings import from_mapping

METRICS_COLUMNS = ["step", "tokens", "lr", "train_loss", "val_loss"]
CHECKPOINT_FORMAT = 2
# Keys that change how a step is computed, not what it computes: a resumed run may change them
# (e.g. a retry on another number of GPUs needs another micro-batch).
RESUMABLE_KEYS = ("micro_batch_size", "compile", "checkpoint_interval")
# Step seeds are seed * STEP_SEED_STRIDE + step: distinct for every (seed, step) in practice.
STEP_SEED_STRIDE = 1_000_003


class TrainingError(RuntimeError):
    pass


# a scale's training recipe: every default and description is the schema's (pretraining.scales.*.training)
_DEFAULTS = defaults_at("pretraining", "scales", "*", "training")


@dataclass
class TrainConfig:
    seq_len: int
    batch_size: int  # global: sequences per optimizer step, summed over all processes
    max_steps: int
    micro_batch_size: int | None = _DEFAULTS["micro_batch_size"]  # per forward pass per process
    lr: float = _DEFAULTS["lr"]
    min_lr: float = _DEFAULTS["min_lr"]
    warmup_frac: float = _DEFAULTS["warmup_frac"]
    weight_decay: float = _DEFAULTS["weight_decay"]
    beta1: float = _DEFAULTS["beta1"]
    beta2: float = _DEFAULTS["beta2"]
    eps: float = _DEFAULTS["eps"]
    grad_clip: float = _DEFAULTS["grad_clip"]
    eval_interval: int = _DEFAULTS["eval_interval"]
    eval_batches: int = _DEFAULTS["eval_batches"]
    checkpoint_interval: int = _DEFAULTS["checkpoint_interval"]
    seed: int = _DEFAULTS["seed"]
    precision: str = _DEFAULTS["precision"]
    compile: bool = _DEFAULTS["compile"]  # CUDA only, ignored on CPU
    data_order: str = _DEFAULTS["data_order"]

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise TrainingError(f"training.precision must be one of {list(PRECISIONS)}, got {self.precision!r}")
        if self.data_order not in ("random", "sequential"):
            raise TrainingError(f"training.data_order must be random or sequential, got {self.data_order!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        return from_mapping(cls, d, "training keys")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def micro_batches(self, world_size: int) -> tuple[int, int]:
        """(micro_batch_size, grad_accum) for this many processes; the global batch is fixed."""
        micro = self.micro_batch_size
        if micro is None:
            if self.batch_size % world_size:
                raise TrainingError(
                    f"training.batch_size={self.batch_size} is not divisible by the world size "
                    f"{world_size}; set training.micro_batch_size"
                )
            micro = self.batch_size // world_size
        if micro < 1 or self.batch_size % (micro * world_size):
            raise TrainingError(
                f"training.batch_size={self.batch_size} is not a multiple of "
                f"training.micro_batch_size={micro} x world size {world_size}"
            )
        return micro, self.batch_size // (micro * world_size)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over warmup_frac of the steps, then cosine from lr down to min_lr."""
    warmup = max(1, round(cfg.warmup_frac * cfg.max_steps))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.max_steps - warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


# ---------------------------------------------------------------------------------------------
# Data


def _example_len(meta: dict, seq_len: int, name: str, n_tokens: int) -> int | None:
    """The example length of a corpus of fixed-length examples (meta "example_len"), else None."""
    example_len = meta.get("example_len")
    if example_len is None:
        return None
    if example_len != seq_len:
        raise TrainingError(
            f"{name} split holds examples of {example_len} tokens (meta example_len): "
            f"training.seq_len must be {example_len}, got {seq_len}"
        )
    if n_tokens % example_len or n_tokens == 0:
        raise TrainingError(f"{name} split has {n_tokens} tokens, not a whole number of {example_len}-token examples")
    return example_len


def batch_starts(n_tokens: int, cfg: TrainConfig, step: int, example_len: int | None = None) -> torch.Tensor:
    """Start offsets of the global batch of step: a function of (seed, step) only. "random":
    windows drawn with replacement; "sequential": the corpus cut into consecutive windows, read in
    its order, batch after batch (Pythia's loader), from the start again once all are read."""
    if cfg.data_order == "sequential":
        width = example_len or cfg.seq_len
        return torch.arange(step * cfg.batch_size, (step + 1) * cfg.batch_size) % (n_tokens // width) * width
    generator = torch.Generator().manual_seed(cfg.seed * STEP_SEED_STRIDE + step)
    if example_len:  # whole examples only: a window never straddles two
        return torch.randint(0, n_tokens // example_len, (cfg.batch_size,), generator=generator) * example_len
    return torch.randint(0, n_tokens - cfg.seq_len, (cfg.batch_size,), generator=generator)


def windows(tokens: np.ndarray, starts, seq_len: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([tokens[s : s + seq_len].astype(np.int64) for s in np.asarray(starts)]))


def fixed_windows(tokens: np.ndarray, n: int, seq_len: int, example_len: int | None = None) -> torch.Tensor:
    """n evenly spaced windows (whole examples if example_len): the same batch every evaluation."""
    if example_len:
        starts = np.linspace(0, len(tokens) // example_len - 1, n).astype(np.int64) * example_len
    else:
        starts = np.linspace(0, len(tokens) - seq_len - 1, n).astype(np.int64)
    return windows(tokens, starts, seq_len)


# ---------------------------------------------------------------------------------------------
# Model, optimizer, processes


def build_model(model_spec: dict, tokenizer, seq_len: int) -> DimAttnForCausalLM:
    spec = dict(model_spec)
    # GPT-NeoX pads the embedding and LM head to a multiple of rows (Pythia: 128, so 50,277 -> 50,304)
    multiple = spec.pop("make_vocab_size_divisible_by", 1)
    config = DimAttnConfig(
        **spec,
        vocab_size=-(-len(tokenizer) // multiple) * multiple,
        max_position_embeddings=seq_len,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return DimAttnForCausalLM(config)


def configure_optimizer(model, cfg: TrainConfig):
    """AdamW with weight decay on matrices only (not biases, norms); the fused kernel on CPU and
    CUDA (one pass over each parameter instead of a dozen: 5x faster on CPU)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = all(p.device.type in ("cpu", "cuda") for p in model.parameters()) or None
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)


def keep_freed_memory() -> None:
    """Keep freed memory in the process (glibc): by default blocks are returned to the kernel
    and every step of a CPU run faults the same pages in again (~10% of a step's time).
    Allocations up to 32 MiB (glibc's largest mmap threshold) come from the heap, which is no
    longer trimmed; memory stays at the run's peak."""
    if not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_trim_threshold, 1 << 30)


@dataclass(frozen=True)
class Processes:
    """Where this process stands among those torchrun started (one, without torchrun)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            torch.distributed.barrier()

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of value over processes (gloo has no AVG: sum, then divide)."""
        if self.distributed:
            value = value.clone()
            torch.distributed.all_reduce(value)
            value /= self.world_size
        return value

    def shard(self, items):
        """This process's contiguous share of items (a multiple of world_size long)."""
        per_rank = len(items) // self.world_size
        return items[self.rank * per_rank : (self.rank + 1) * per_rank]


def _start_processes(device: str) -> tuple[Processes, str]:
    """Join torchrun's process group when WORLD_SIZE > 1; the device this process uses."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return Processes(), device
    procs = Processes(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), world_size)
    if torch.device(device).type == "cuda":
        device = f"cuda:{procs.local_rank}"
        torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl", device_id=torch.device(device))
    else:
        torch.distributed.init_process_group("gloo")
    return procs, device


@torch.no_grad()
def evaluate_loss(
    model,
    batches: torch.Tensor,
    micro_batch_size: int,
    device: str = "cpu",
    precision: str = "fp32",
    procs: Processes = Processes(),
) -> float:
    """Mean loss over the batches, each process taking its share (all shares equal in size)."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    mine = procs.shard(batches).split(micro_batch_size)
    for x in mine:
        x = x.to(device)
        x, labels = (x[:, 0], x[:, 1]) if x.dim() == 3 else (x, x)  # (tokens, targets) pairs
        with autocast(device, precision):
            total += model(x, labels=labels, return_logits=False).loss.double()
    model.train()
    return procs.mean(total / len(mine)).item()


# ---------------------------------------------------------------------------------------------
# Checkpoints and metrics


def _atomic_torch_save(obj, path: Path) -> None:
    # Through a file object: torch.save names the zip's records after a path it is given (here
    # the random temp name), so equal checkpoints would differ in bytes.
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        torch.save(obj, f)


_CHECKPOINT_KEYS = ("format", "identity", "step", "model", "optimizer", "metrics")


def _damaged(path: Path, what: str) -> TrainingError:
    return TrainingError(
        f"checkpoint {path} {what}; delete {path.parent} to start this run over (nothing else is lost)"
    )


def _load_checkpoint(path: Path):
    """Our own checkpoint; weights_only refuses anything but tensors and plain containers. A
    truncated or corrupt file, or one without our keys, is refused naming the file."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        refused = "holds objects that torch.load(weights_only=True) refuses: not a checkpoint of ours"
        raise _damaged(path, refused) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        # torch's first sentence says what failed; the rest is advice about other files
        reason = " ".join(str(e).split()).split(". ")[0] or type(e).__name__
        raise _damaged(path, f"is truncated or corrupt ({reason[:200]})") from None
    if not isinstance(state, dict):
        raise _damaged(path, f"is not a checkpoint (it holds a {type(state).__name__})")
    return state


def _restore(state: dict, model, optimizer, max_steps: int, ckpt_path: Path) -> tuple[int, list]:
    """Load a checkpoint that _check_resumable accepted into model and optimizer; (step, metrics
    rows). Every inconsistency is found here, before the first step."""
    step, rows = state["step"], state["metrics"]
    if type(step) is not int or not 0 < step <= max_steps:
        raise _damaged(ckpt_path, f"holds step {step!r}, not one of 1..{max_steps}")
    if not isinstance(rows, list) or len(rows) != step or any(len(r) != len(METRICS_COLUMNS) for r in rows):
        raise _damaged(ckpt_path, f"holds {len(rows) if isinstance(rows, list) else rows!r} metrics rows "
                                  f"of {len(METRICS_COLUMNS)} fields for step {step}")
    try:
        model.load_state_dict(state["model"])
    except (RuntimeError, KeyError, TypeError, AttributeError) as e:
        reason = " ".join(str(e).split())[:1000]
        raise _damaged(ckpt_path, f"holds weights that do not fit this model: {reason}") from None
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError, TypeError, IndexError) as e:
        reason = " ".join(str(e).split())[:500]
        raise _damaged(ckpt_path, f"holds optimizer state that does not fit this model: {reason}") from None
    for i, (param, moments) in enumerate(optimizer.state.items()):
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in moments or moments[key].shape != param.shape:
                got = tuple(moments[key].shape) if key in moments else "nothing"
                raise _damaged(ckpt_path, f"holds optimizer state {key} of shape {got} for a parameter of "
                                          f"shape {tuple(param.shape)} (parameter {i})")
    return step, [list(r) for r in rows]


def _identity(model_spec: dict, train_cfg: TrainConfig, vocab_size: int, precision: str) -> dict:
    """What a checkpoint must have been trained with for this run to resume from it. The
    precision is the resolved one: "auto" resumes an fp32 checkpoint where it means fp32, and
    refuses to continue a bf16 run in fp32 on a device without bf16."""
    training = {k: v for k, v in asdict(train_cfg).items() if k not in RESUMABLE_KEYS}
    training["precision"] = precision
    return {"model": dict(model_spec), "training": training, "tokenizer": {"vocab_size": vocab_size}}


def _identity_changes(saved: dict, current: dict) -> list[str]:
    changes = []
    for section in current:
        old, new = saved.get(section, {}), current[section]
        for key in sorted(set(old) | set(new)):
            if old.get(key, "<unset>") != new.get(key, "<unset>"):
                changes.append(f"{section}.{key}: {old.get(key, '<unset>')!r} -> {new.get(key, '<unset>')!r}")
    return changes


def _check_resumable(state: dict, identity: dict, ckpt_path: Path) -> None:
    if state.get("format") != CHECKPOINT_FORMAT:
        changes = [f"checkpoint format {state.get('format', 1)!r}, expected {CHECKPOINT_FORMAT}"]
    elif not set(_CHECKPOINT_KEYS) <= set(state):
        raise _damaged(ckpt_path, f"lacks {sorted(set(_CHECKPOINT_KEYS) - set(state))} (it has {sorted(state)})")
    elif not (isinstance(state["identity"], dict) and all(isinstance(v, dict) for v in state["identity"].values())):
        raise _damaged(ckpt_path, f"has a malformed identity {state['identity']!r:.200}")
    else:
        changes = _identity_changes(state["identity"], identity)
    if changes:
        raise TrainingError(
            f"{ckpt_path} is from another configuration ({'; '.join(changes)}); "
            f"delete {ckpt_path.parent} to start this run over, or restore the configuration"
        )


def _csv_line(row) -> str:
    buf = io.StringIO()
    csv.writer(buf).writerow(row)
    return buf.getvalue()


def _write_metrics(path: Path, rows: list) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text("".join(_csv_line(r) for r in [METRICS_COLUMNS, *rows]))


def _remove_stale_temps(*dests: Path) -> None:
    """Temp siblings (atomic.py) that a killed write left behind: only this run writes them."""
    for dest in dests:
        for tmp in dest.parent.glob(f".{dest.name}.*.tmp"):
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Training


def _load_split(path: Path, name: str, seq_len: int) -> tuple[np.ndarray, int | None, np.ndarray | None]:
    tokens, meta = load_tokens(path)
    example_len = _example_len(meta, seq_len, name, len(tokens))
    if example_len is None and len(tokens) <= seq_len + 1:
        raise TrainingError(f"{name} split has {len(tokens)} tokens, fewer than seq_len={seq_len}")
    return tokens, example_len, load_loss_mask(path, meta)


def labels_for(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Next-token targets: every token, or only those the corpus's loss mask marks."""
    return x if mask is None else x.masked_fill(mask == 0, -100)


def pretrain(
    model_spec: dict,
    train_cfg: TrainConfig,
    train_bin: Path,
    val_bin: Path,
    tokenizer_dir: Path,
    out_dir: Path,
    checkpoint_dir: Path,
    device: str,
) -> Path:
    """Train one run; write a save_pretrained directory with the tokenizer and metrics.csv.

    Under torchrun every process calls this; the process group lives for the call.
    """
    procs, device = _start_processes(device)
    try:
        paths = (Path(p) for p in (train_bin, val_bin, tokenizer_dir, out_dir, checkpoint_dir))
        _train(model_spec, train_cfg, *paths, device, procs)
    finally:
        if procs.distributed:
            torch.distributed.destroy_process_group()
    return Path(out_dir)


def _train(
    model_spec: dict,
    cfg: TrainConfig,
    train_bin: Path,
    val_bin: Path,
    tokenizer_dir: Path,
    out_dir: Path,
    checkpoint_dir: Path,
    device: str,
    procs: Processes,
) -> None:
    run = out_dir.name
    micro, accum = cfg.micro_batches(procs.world_size)
    precision = resolve_precision(cfg.precision, device)
    if cfg.precision == "auto" and procs.main:
        print(f"{run}: training.precision auto -> {precision} on {device}", file=sys.stderr)
    if torch.device(device).type == "cpu":
        keep_freed_memory()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    train_tokens, train_example_len, train_mask = _load_split(train_bin, "train", cfg.seq_len)
    val_tokens, val_example_len, val_mask = _load_split(val_bin, "validation", cfg.seq_len)
    val_batches = fixed_windows(val_tokens, cfg.eval_batches * cfg.batch_size, cfg.seq_len, val_example_len)
    if val_mask is not None:  # the targets ride along as labels
        val_batches = torch.stack([val_batches, labels_for(
            val_batches, fixed_windows(val_mask, cfg.eval_batches * cfg.batch_size, cfg.seq_len, val_example_len))], 1)

    torch.manual_seed(cfg.seed)  # the same initial weights on every process
    model = build_model(model_spec, tokenizer, cfg.seq_len).to(device)
    optimizer = configure_optimizer(model, cfg)
    identity = _identity(model_spec, cfg, len(tokenizer), precision)

    ckpt_path = checkpoint_dir / "checkpoint.pt"
    metrics_path = checkpoint_dir / "metrics.csv"
    step, rows = 0, []
    if ckpt_path.exists():  # resume a killed job from its last checkpoint
        state = _load_checkpoint(ckpt_path)
        _check_resumable(state, identity, ckpt_path)
        step, rows = _restore(state, model, optimizer, cfg.max_steps, ckpt_path)
    if procs.main:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(ckpt_path, metrics_path, out_dir)
        # Rows after the checkpoint (or half a row a kill cut short) are recomputed, identically.
        _write_metrics(metrics_path, rows)

    # Parameters are shared: the optimizer, checkpoints and export keep using the plain model.
    compiled = model
    if cfg.compile:
        if torch.device(device).type == "cuda":
            compiled = torch.compile(model)
        else:
            print(f"{run}: training.compile ignored on {device} (CUDA only)", file=sys.stderr)
    forward = compiled
    if procs.distributed:
        from torch.nn.parallel import DistributedDataParallel

        cuda = torch.device(device).type == "cuda"
        forward = DistributedDataParallel(compiled, device_ids=[procs.local_rank] if cuda else None)

    model.train()
    bar = tqdm(total=cfg.max_steps, initial=step, desc=run, mininterval=5, disable=not procs.main)
    while step < cfg.max_steps:
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = procs.shard(batch_starts(len(train_tokens), cfg, step, train_example_len))
        loss_sum = torch.zeros((), device=device)
        for m in range(accum):
            batch_starts_m = starts[m * micro : (m + 1) * micro]
            x = windows(train_tokens, batch_starts_m, cfg.seq_len).to(device)
            mask = windows(train_mask, batch_starts_m, cfg.seq_len).to(device) if train_mask is not None else None
            # Gradients are all-reduced once a step, on the last micro-batch's backward.
            last = m == accum - 1
            sync = forward.no_sync() if procs.distributed and not last else contextlib.nullcontext()
            with sync:
                with autocast(device, precision):
                    loss = forward(x, labels=labels_for(x, mask), return_logits=False).loss / accum
                loss.backward()
            loss_sum += loss.detach()
        train_loss = procs.mean(loss_sum).item()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
        for what, value in (("loss", train_loss), ("gradient norm", grad_norm)):
            if not math.isfinite(value):
                raise TrainingError(f"{run}: {what} became {value} at step {step + 1} of {cfg.max_steps}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        val_loss = ""
        if step % cfg.eval_interval == 0 or step == cfg.max_steps:
            # Not through DDP: its forward would expect the matching backward.
            val_loss = evaluate_loss(compiled, val_batches, micro, device, precision, procs)
        row = [step, step * cfg.tokens_per_step, lr, train_loss, val_loss]
        rows.append(row)
        if procs.main:
            with open(metrics_path, "a", newline="") as f:
                f.write(_csv_line(row))
        bar.update(1)
        bar.set_postfix(loss=f"{train_loss:.3f}", refresh=False)

        if procs.main and (step % cfg.checkpoint_interval == 0 or step == cfg.max_steps):
            state = {
                "format": CHECKPOINT_FORMAT,
                "identity": identity,
                "step": step,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "metrics": rows,
            }
            _atomic_torch_save(state, ckpt_path)
    bar.close()
    if procs.main:
        _export(model, tokenizer, cfg, rows, out_dir, precision)
    procs.barrier()  # no process leaves (and tears the group down) before the export is whole


def _export(model, tokenizer, train_cfg: TrainConfig, rows: list, out_dir: Path, precision: str) -> None:
    """save_pretrained into a temp sibling, then rename: the run directory appears whole or not at all."""
    model.config.register_for_auto_class()
    model.register_for_auto_class("AutoModelForCausalLM")
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        save_tokenizer(tokenizer, tmp)  # without the flags of this run's loading
        _write_metrics(tmp / "metrics.csv", rows)
        (tmp / "training.json").write_text(json.dumps({**asdict(train_cfg), "resolved_precision": precision}, indent=2))


# ---------------------------------------------------------------------------------------------
# Launch on several processes


def launch_command(
    cli_args: list[str],
    nproc: int,
    nodes: int,
    *,
    rdzv_host: str | None = None,
    rdzv_id: str = "dimattn",
    rdzv_port: int = 29500,
    cpus_per_node: int | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The command running ``python -m dimattn.pretraining.training cli_args`` as nodes x nproc processes.

    One node: torchrun --standalone (a free local port). Several (SLURM, from inside the job's
    allocation): srun starts one torchrun a node; they meet at rdzv_host, which must be one of
    the nodes (the batch host is) since torchrun hosts the rendezvous store there.
    """
    if nproc < 1 or nodes < 1:
        raise TrainingError(f"need nproc >= 1 and nodes >= 1, got nproc={nproc}, nodes={nodes}")
    module = ["-m", "dimattn.pretraining.training", *cli_args]
    torchrun = [python, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nodes == 1:
        return [*torchrun, "--standalone", *module]
    if not rdzv_host:
        raise TrainingError(f"nodes={nodes} needs a rendezvous host (the first node of the job)")
    srun = ["srun", f"--nodes={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if cpus_per_node:  # srun does not inherit sbatch's --cpus-per-task
        srun.append(f"--cpus-per-task={cpus_per_node}")
    rendezvous = [f"--nnodes={nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_host}:{rdzv_port}",
                  f"--rdzv-id={rdzv_id}"]
    return [*srun, *torchrun, *rendezvous, *module]


# ---------------------------------------------------------------------------------------------
# Command line: what torchrun launches, one process per rank


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dimattn.pretraining.training", description=__doc__.split("\n\n")[0]
    )
    spec_help = 'JSON {"model": {architecture and attention keys}, "training": {TrainConfig keys}}'
    parser.add_argument("--spec", type=Path, required=True, help=spec_help)
    parser.add_argument("--train", type=Path, required=True, help="train token file (.bin beside its .json meta)")
    parser.add_argument("--validation", type=Path, required=True, help="validation token file")
    parser.add_argument("--tokenizer", type=Path, required=True, help="tokenizer directory")
    parser.add_argument("--out", type=Path, required=True, help="model directory to write")
    parser.add_argument("--checkpoint-dir", type=Path, required=True, help="checkpoint.pt and metrics.csv live here")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (each rank takes cuda:LOCAL_RANK)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads per process")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = json.loads(args.spec.read_text())
    pretrain(
        model_spec=spec["model"],
        train_cfg=TrainConfig.from_dict(spec["training"]),
        train_bin=args.train,
        val_bin=args.validation,
        tokenizer_dir=args.tokenizer,
        out_dir=args.out,
        checkpoint_dir=args.checkpoint_dir,
        device=args.device,
    )


if __name__ == "__main__":
    main()
