"""The split ranges of a Hugging Face corpus (``datasets.<name>.splits``), checked alike where
the plan is made (dimattn.workflow.sweeps, naming the config key) and where the corpus is read
(dimattn.data.corpora). No imports beyond the split names, so planning stays light."""

import itertools

from dimattn.workflow.paths import SPLITS


def range_errors(splits) -> list[tuple[str, str]]:
    """(our split, message) for each bad range of an hf corpus's ``splits``: each is a
    [start, stop) range of a dataset split (stop None: to the end, the schema's default), and
    two ranges of one dataset split must not overlap. dimattn.workflow.sweeps refuses these at planning."""
    if not isinstance(splits, dict) or not splits:
        return [("", f"hf corpus 'splits' must be a non-empty mapping, got {splits!r}")]
    errors = []
    for ours, r in splits.items():
        if ours not in SPLITS:
            errors.append((ours, f"unknown split {ours!r} in hf corpus spec; expected one of {SPLITS}"))
            continue
        missing = [k for k in ("split", "start", "stop") if not isinstance(r, dict) or k not in r]
        if missing:
            have = sorted(r) if isinstance(r, dict) else type(r).__name__
            errors.append((ours, f"hf corpus split {ours!r} spec is missing {missing}; it has {have}"))
            continue
        start, stop = r["start"], r["stop"]
        if not (type(start) is int and start >= 0 and (stop is None or (type(stop) is int and start < stop))):
            errors.append((ours, f"split {ours!r}: need ints 0 <= start < stop (stop null: the end), "
                                 f"got [{start!r}, {stop!r})"))
    if errors:
        return errors
    for (a, ra), (b, rb) in itertools.combinations(splits.items(), 2):
        same = ra["split"] == rb["split"]
        end_a, end_b = (float("inf") if r["stop"] is None else r["stop"] for r in (ra, rb))
        if same and ra["start"] < end_b and rb["start"] < end_a:
            errors.append((b, f"splits {a!r} and {b!r} overlap in dataset split {ra['split']!r}"))
    return errors
