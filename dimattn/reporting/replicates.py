"""Replicates: runs that agree on ``variants.SETTING_FIELDS`` and differ only in their training
seed (``seed: [0, 1, 2]`` in a sweep). Comparisons between tiny models are findings only where
they exceed the seed-to-seed spread, so every table and figure goes through here:

* :func:`relative` divides a value by a baseline's replicate by replicate: by the baseline's
  replicate with the same seed, or, where the baseline lacks that seed, by the mean of its
  replicates (``rel_to_vanilla`` of the summaries, seed 000 Table 4);
* :func:`settings` (and :func:`aggregate` for other keys, DimPO's fits) gives one row per
  setting: each value column holds the mean over seeds, and ``<value>_spread`` a :class:`Spread`
  (min, max, n and the replicates' values) for the cells and error bars;
* :meth:`Spread.overlaps` is the one comparison the tables mark, "within the seed spread": both
  sides trained with n > 1 seeds and, paired by seed where they share two or more seeds, the
  per-seed differences take both signs (or one is 0); unpaired, their min-max ranges overlap.
  Pairing matters: a seed fixes the initialisation and the order of the data for every variant,
  so much of the spread between seeds is shared, and a difference of the same sign at every
  seed is a finding even where the two ranges overlap.

A summary without a ``seed`` column (DimPO fidelity, for now) has one replicate per setting.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pandas as pd

from dimattn.model import variants

SUFFIX = "_spread"


@dataclass(frozen=True)
class Spread:
    """A setting's values over its replicates (NaN left out), and the seed of each where known."""

    values: tuple[float, ...]
    seeds: tuple[int, ...] = ()

    @classmethod
    def of(cls, values: Iterable, seeds: Iterable | None = None) -> Spread:
        values = list(values)
        seeds = list(seeds) if seeds is not None else [None] * len(values)
        kept = [(float(v), s) for v, s in zip(values, seeds) if not variants.missing(v)]
        known = all(s is not None and not variants.missing(s) for _, s in kept)
        return cls(tuple(v for v, _ in kept), tuple(int(s) for _, s in kept) if known and kept else ())

    def by_seed(self) -> dict[int, float]:
        return dict(zip(self.seeds, self.values)) if len(self.seeds) == len(self.values) else {}

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return math.fsum(self.values) / self.n if self.values else math.nan

    @property
    def min(self) -> float:
        return min(self.values, default=math.nan)

    @property
    def max(self) -> float:
        return max(self.values, default=math.nan)

    def overlaps(self, other: Spread | None) -> bool:
        """Within the seed spread: both have n > 1 seeds, and the differences at the seeds they
        share (two or more) do not all have one sign; without such pairs, the min-max ranges
        overlap."""
        if other is None or self.n < 2 or other.n < 2:
            return False
        mine, theirs = self.by_seed(), other.by_seed()
        shared = sorted(set(mine) & set(theirs))
        if len(shared) >= 2:
            diffs = [mine[s] - theirs[s] for s in shared]
            return min(diffs) <= 0 <= max(diffs)
        return self.min <= other.max and other.min <= self.max


def spread(row, value: str) -> Spread:
    """The Spread of ``value`` in a row of :func:`aggregate` (a Series or a dict)."""
    found = row.get(value + SUFFIX)
    return found if isinstance(found, Spread) else Spread.of([row.get(value)])


def rel_to_vanilla(row) -> Spread:
    """A row's ``rel_to_vanilla``; Vanilla's own is 100 by construction (each replicate over
    itself), one number rather than a range of 100s."""
    found = spread(row, "rel_to_vanilla")
    return Spread((found.mean,)) if row.get("attention") == "vanilla" and found.n else found


def aggregate(df: pd.DataFrame, values: Sequence[str], by: Sequence[str]) -> pd.DataFrame:
    """One row per group of ``by``, in the order the groups first appear: the row of its lowest
    seed (its ``run`` names the setting), each of ``values`` replaced by the mean over the group,
    with ``<value>_spread`` (a :class:`Spread`), ``seeds`` and ``runs`` (tuples) beside."""
    by = list(by)
    group = df.groupby(by, sort=False, dropna=False).ngroup()
    seed = df["seed"] if "seed" in df.columns else 0
    ordered = df.assign(_group=group.values, _seed=seed).sort_values(["_group", "_seed"], kind="stable")
    grouped = ordered.groupby("_group", sort=True)
    out = ordered.drop_duplicates("_group").set_index("_group")
    # each group's values as lists, one column at a time: a frame sliced a group took 0.77 s on
    # cpu-full's dimpo_fidelity summary (3,456 rows), this 0.17 s, the same spreads
    seeds = grouped["_seed"].agg(list) if "seed" in df.columns else None
    for value in values:
        lists = grouped[value].agg(list)
        spreads = pd.Series({g: Spread.of(v, seeds[g] if seeds is not None else None) for g, v in lists.items()},
                            dtype=object)
        out[value + SUFFIX] = spreads
        # One replicate keeps its value as it is (bit for bit); several give their mean.
        out[value] = [s.mean if s.n > 1 else out.at[g, value] for g, s in spreads.items()]
    out["seeds"] = grouped["_seed"].agg(tuple) if "seed" in df.columns else [()] * len(out)
    out["runs"] = grouped["run"].agg(tuple) if "run" in df.columns else [()] * len(out)
    return out.drop(columns="_seed").reset_index(drop=True)


def settings(df: pd.DataFrame, values: Sequence[str], keys: Sequence[str] = ()) -> pd.DataFrame:
    """:func:`aggregate` over the replicates of each setting and ``keys`` (corpus, step, ...).

    ``run`` names the setting by its lowest seed's run in all of ``df``, so that it is the same
    at every key (a trajectory's steps, a recall run's distance bins). Two runs of one setting
    with the same seed (two scales that differ only in their recipe) are an error naming them."""
    by = variants.SETTING_FIELDS + list(keys)
    if "seed" in df.columns:
        twins = df[df.duplicated(by + ["seed"], keep=False)]
        if not twins.empty:
            raise ValueError(
                f"runs {sorted(twins['run'].unique())} agree on every field of variants.SETTING_FIELDS and on "
                "their seed: replicates of one setting must differ in their seed"
            )
    out = aggregate(df, values, by)
    if "seed" in df.columns and not df.empty:
        ordered = df.sort_values("seed", kind="stable")
        names = ordered.groupby(variants.SETTING_FIELDS, sort=False, dropna=False)["run"].transform("first")
        name_of = dict(zip(ordered["run"], names))
        out["run"] = [name_of[runs[0]] for runs in out["runs"]]
    return out


def count_seeds(spreads: Iterable[Spread | None]) -> Counter:
    """How many of ``spreads`` have each n > 1 (the tables' and figures' notes on replicates)."""
    return Counter(s.n for s in spreads if isinstance(s, Spread) and s.n > 1)


def seed_counts(*frames: pd.DataFrame | None) -> Counter:
    """:func:`count_seeds` over every Spread of aggregated frames."""
    frames = [f for f in frames if f is not None]
    return count_seeds(s for f in frames for c in f.columns if str(c).endswith(SUFFIX) for s in f[c])


def seeds_text(counts: Counter) -> str:
    """"3 seeds", "2 to 3 seeds"."""
    ns = sorted(counts)
    return f"{ns[0]} seeds" if len(ns) == 1 else f"{ns[0]} to {ns[-1]} seeds"


def relative(
    df: pd.DataFrame, value: str, baseline, keys: Sequence[str], scope: Sequence[str]
) -> tuple[pd.Series, pd.Series]:
    """(100 * value / the baseline's value at the same ``keys``, the baseline's seed used).

    ``baseline``: a boolean mask of ``df``'s baseline rows. A row is paired with the baseline
    replicate of its own seed when the baseline has that seed within ``scope`` (a subset of
    ``keys``: a trajectory's step may be missing from the paired run, and then stays NaN);
    otherwise divided by the mean over the baseline's replicates, and its seed is empty. A row
    without a baseline at its keys stays NaN. The caller checks that the baseline has one row
    per keys and seed.
    """
    keys, scope = list(keys), list(scope)
    seed = df["seed"] if "seed" in df.columns else pd.Series(0, index=df.index)
    rows = df[keys].assign(_seed=seed.values)
    base = df.loc[baseline, keys + [value]].assign(_seed=seed[baseline].values)
    paired = rows.merge(base.rename(columns={value: "_paired"}), on=keys + ["_seed"], how="left")
    mean = base.groupby(keys, dropna=False)[value].mean().rename("_mean").reset_index()
    pooled = rows.merge(mean, on=keys, how="left")
    seeds_of = set(map(tuple, base[scope + ["_seed"]].values.tolist()))
    has_seed = pd.Series([tuple(r) in seeds_of for r in rows[scope + ["_seed"]].values.tolist()], dtype=bool)
    denominator = paired["_paired"].where(has_seed, pooled["_mean"]).astype(float)
    ratio = 100.0 * df[value].astype(float).values / denominator.values
    ratio = pd.Series(ratio, index=df.index).where(lambda r: ~r.isin([math.inf, -math.inf]))
    used = pd.Series(seed.values, index=df.index).where(has_seed.values & ratio.notna().values)
    return ratio, used.astype("Int64")
