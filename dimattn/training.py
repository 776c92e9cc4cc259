"""Pretraining loop in the nanoGPT manner: random windows from a uint16 token memmap, AdamW,
linear warm-up then cosine decay, gradient clipping, atomic checkpoints that a restarted job
resumes from, and a metrics CSV (step, tokens, lr, train_loss, val_loss).
"""

import csv
import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from .atomic import atomic_dir, atomic_file
from .configuration_dimattn import DimAttnConfig
from .data import load_tokens
from .modeling_dimattn import DimAttnForCausalLM
from .settings import from_mapping

METRICS_COLUMNS = ["step", "tokens", "lr", "train_loss", "val_loss"]


class TrainingError(RuntimeError):
    pass


@dataclass
class TrainConfig:
    seq_len: int = 256
    batch_size: int = 8  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    max_steps: int = 200
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_frac: float = 0.01
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    eval_interval: int = 50
    eval_batches: int = 4
    checkpoint_interval: int = 50
    seed: int = 0

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        return from_mapping(cls, d, "training keys")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.seq_len


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over warmup_frac of the steps, then cosine from lr down to min_lr."""
    warmup = max(1, round(cfg.warmup_frac * cfg.max_steps))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.max_steps - warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def sample_batch(tokens: np.ndarray, batch_size: int, seq_len: int, generator: torch.Generator):
    starts = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=generator).tolist()
    return torch.from_numpy(np.stack([tokens[s : s + seq_len].astype(np.int64) for s in starts]))


def fixed_windows(tokens: np.ndarray, n: int, seq_len: int) -> torch.Tensor:
    """n evenly spaced windows: the same validation batch at every evaluation."""
    starts = np.linspace(0, len(tokens) - seq_len - 1, n).astype(np.int64)
    return torch.from_numpy(np.stack([tokens[s : s + seq_len].astype(np.int64) for s in starts]))


def build_model(model_spec: dict, tokenizer, seq_len: int) -> DimAttnForCausalLM:
    config = DimAttnConfig(
        **model_spec,
        vocab_size=len(tokenizer),
        max_position_embeddings=seq_len,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return DimAttnForCausalLM(config)


def configure_optimizer(model, cfg: TrainConfig):
    """AdamW with weight decay on matrices only (not biases, norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


@torch.no_grad()
def evaluate_loss(model, batches: torch.Tensor, batch_size: int) -> float:
    model.eval()
    losses = [model(x, labels=x).loss.item() for x in batches.split(batch_size)]
    model.train()
    return float(np.mean(losses))


def _atomic_torch_save(obj, path: Path) -> None:
    with atomic_file(path) as tmp:
        torch.save(obj, tmp)


def _load_checkpoint(path: Path):
    # Our own checkpoint; weights_only refuses anything but tensors and plain containers.
    return torch.load(path, map_location="cpu", weights_only=True)


def pretrain(
    model_spec: dict,
    train_cfg: TrainConfig,
    train_bin: Path,
    val_bin: Path,
    tokenizer_dir: Path,
    out_dir: Path,
    checkpoint_dir: Path,
    device: str = "cpu",
) -> Path:
    """Train one run; write a save_pretrained directory with the tokenizer and metrics.csv."""
    out_dir, checkpoint_dir = Path(out_dir), Path(checkpoint_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    train_tokens, _ = load_tokens(train_bin)
    val_tokens, _ = load_tokens(val_bin)
    for name, toks in (("train", train_tokens), ("validation", val_tokens)):
        if len(toks) <= train_cfg.seq_len + 1:
            raise TrainingError(f"{name} split has {len(toks)} tokens, fewer than seq_len={train_cfg.seq_len}")

    torch.manual_seed(train_cfg.seed)
    model = build_model(model_spec, tokenizer, train_cfg.seq_len).to(device)
    optimizer = configure_optimizer(model, train_cfg)
    generator = torch.Generator().manual_seed(train_cfg.seed)
    val_batches = fixed_windows(val_tokens, train_cfg.eval_batches * train_cfg.batch_size, train_cfg.seq_len)

    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = checkpoint_dir / "checkpoint.pt"
    metrics_path = checkpoint_dir / "metrics.csv"
    step = 0
    if ckpt_path.exists():  # resume a killed job from its last checkpoint
        state = _load_checkpoint(ckpt_path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        step = int(state["step"])
        _truncate_metrics(metrics_path, step)
    else:
        with open(metrics_path, "w", newline="") as f:
            csv.writer(f).writerow(METRICS_COLUMNS)

    model.train()
    bar = tqdm(total=train_cfg.max_steps, initial=step, desc=out_dir.name, mininterval=5)
    while step < train_cfg.max_steps:
        lr = lr_at(step, train_cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        train_loss = 0.0
        for _ in range(train_cfg.grad_accum):
            x = sample_batch(train_tokens, train_cfg.batch_size, train_cfg.seq_len, generator).to(device)
            loss = model(x, labels=x).loss / train_cfg.grad_accum
            loss.backward()
            train_loss += loss.item()
        if not math.isfinite(train_loss):
            raise TrainingError(f"{out_dir.name}: loss became {train_loss} at step {step}")
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        val_loss = ""
        if step % train_cfg.eval_interval == 0 or step == train_cfg.max_steps:
            val_loss = evaluate_loss(model, val_batches.to(device), train_cfg.batch_size)
        with open(metrics_path, "a", newline="") as f:
            csv.writer(f).writerow([step, step * train_cfg.tokens_per_step, lr, train_loss, val_loss])
        bar.update(1)
        bar.set_postfix(loss=f"{train_loss:.3f}", refresh=False)

        if step % train_cfg.checkpoint_interval == 0 or step == train_cfg.max_steps:
            _atomic_torch_save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "generator": generator.get_state(),
                    "torch_rng": torch.get_rng_state(),
                    "step": step,
                },
                ckpt_path,
            )
    bar.close()
    _export(model, tokenizer, train_cfg, metrics_path, out_dir)
    return out_dir


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop rows logged after the checkpoint we resume from, so no step appears twice."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    kept = [rows[0]] + [r for r in rows[1:] if r and int(r[0]) <= step]
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(kept)


def _export(model, tokenizer, train_cfg: TrainConfig, metrics_path: Path, out_dir: Path) -> None:
    """save_pretrained into a temp sibling, then rename: the run directory appears whole or not at all."""
    model.config.register_for_auto_class()
    model.register_for_auto_class("AutoModelForCausalLM")
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        shutil.copy(metrics_path, tmp / "metrics.csv")
        (tmp / "training.json").write_text(json.dumps(asdict(train_cfg), indent=2))

