"""Plain dataclasses of settings filled from config mappings, refusing keys they do not know,
and the arithmetic of fit settings that planning (torch-free) and fitting share."""

import math
from dataclasses import fields


def from_mapping(cls, mapping, what: str):
    """cls(**mapping), or a ValueError that lists the unknown keys of ``what`` and the known ones."""
    mapping = dict(mapping or {})
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(mapping) - set(known))
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; known: {known}")
    return cls(**mapping)


def key_list_length(seq_len: int, num_sampled_keys: int | None = None) -> int:
    """Keys in one instance's list: the capture's sequence length (every key, the authors'
    non-causal lists; a causal list is at most that long), or Appendix B's sampled keys."""
    return seq_len if num_sampled_keys is None else min(int(num_sampled_keys), seq_len)


def resolve_top_k(k: int, k_share: float | None, n_keys: int) -> int:
    """DimPO's top-k on a list of ``n_keys``: ``k`` as given, or ``k_share`` of the list rounded
    half up and at least 1 (the paper's 64 of 4,096 keys is k_share 1/64: 4 of a 256-key list)."""
    if k_share is None:
        return int(k)
    return max(1, math.floor(k_share * n_keys + 0.5))


def downstream_tasks(tasks: list[dict], d_prime: int) -> list[dict]:
    """The dimpo.downstream.tasks a projected model of width ``d_prime`` is scored on: those
    whose ``d_prime`` lists it (or that give none); the base model (d' 0) takes every task."""
    return [t for t in tasks if not d_prime or d_prime in t.get("d_prime", [d_prime])]
