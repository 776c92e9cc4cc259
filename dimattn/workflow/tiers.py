"""One tier a working directory: which config owns its outputs, and the record of its runs.

Two configs in one working directory would share ``results/`` paths whose content differs (the
default's and cpu-full's ``longctx`` corpora have different lengths): the second run would rebuild
the first's data and every model after it. So each config names its tier (config ``tier``), the
first run in a directory stamps ``results/tier.json`` with it, and a config of another tier is
refused there before any job starts. Each tier runs in a directory of its own (the Makefile's
``full`` target: ``tiers/cpu-full``), as Snakemake's ``--directory`` allows.

The stamp is also the run record the published manifest reads (dimattn.reporting.published): the
merged config's digest, the CPU, and each invocation's start and end; a new digest starts a new
record, so the jobs counted are those of the config that is published. No torch.
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import datetime
from pathlib import Path

from dimattn.workflow import paths
from dimattn.model.atomic import atomic_file


class TierError(ValueError):
    """A working directory's outputs belong to another tier."""


# Keys that choose what to render, not what is computed.
UNDIGESTED = ("figures_from",)


def config_sha256(config: dict) -> str:
    """The merged config's digest (schema defaults applied), key order aside."""
    computed = {k: v for k, v in config.items() if k not in UNDIGESTED}
    return hashlib.sha256(json.dumps(computed, sort_keys=True, default=str).encode()).hexdigest()


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def read(stamp: str | Path = paths.TIER_STAMP) -> dict | None:
    """The run record, or None where no run of any tier has started here."""
    stamp = Path(stamp)
    if not stamp.exists():
        return None
    try:
        record = json.loads(stamp.read_text())
        record["tier"]
    except (ValueError, KeyError, TypeError) as e:
        raise TierError(f"{stamp} is not a tier record ({e}); delete it if this directory's results "
                        "are of the config you run") from None
    return record


def check(tier: str, stamp: str | Path = paths.TIER_STAMP) -> None:
    """Refuse a config whose tier is not the one this directory's outputs were made by."""
    record = read(stamp)
    if record is not None and record["tier"] != tier:
        raise TierError(
            f"{stamp}: this directory's results are tier {record['tier']!r}, the config asks for tier {tier!r}; "
            f"running it here would rebuild the other tier's data and models. Run each tier in its own "
            f"directory (make full: snakemake --directory tiers/cpu-full --configfile configs/cpu-full.yaml), "
            f"or `make clean` first"
        )


def start(config: dict, stamp: str | Path = paths.TIER_STAMP, now: float | None = None,
          logs: list[str] | None = None) -> dict:
    """Snakemake's onstart: append an invocation (a new record where the config's digest changed).
    ``logs``: Snakemake's log files of this invocation (onstart's ``log``); where the last
    invocation was killed before its onsuccess or onerror ran, it is closed from them."""
    stamp = Path(stamp)
    digest = config_sha256(config)
    record = read(stamp)
    if record is None or record.get("config_sha256") != digest:
        record = {"tier": config["tier"], "config_sha256": digest, "cpu_model": cpu_model(), "invocations": []}
    last = record["invocations"][-1] if record["invocations"] else None
    if last is not None and "finished" not in last and logs:
        ended = killed_at(last["started"], Path(logs[0]).parent)
        if ended is not None:
            last.update(finished=ended, ok=False, closed_from_log=True)
    record["invocations"].append({"started": time.time() if now is None else now})
    _write(record, stamp)
    return record


def finish(ok: bool, stamp: str | Path = paths.TIER_STAMP, now: float | None = None) -> dict:
    """Snakemake's onsuccess (ok) and onerror: close the last invocation."""
    stamp = Path(stamp)
    record = read(stamp)
    last = record["invocations"][-1]
    last["finished"] = time.time() if now is None else now
    last["ok"] = ok
    _write(record, stamp)
    return record


def killed_at(started: float, log_dir: Path) -> float | None:
    """When an invocation that started at ``started`` last wrote its Snakemake log: its end, where
    it was killed (SIGKILL, a lost machine or session) and no onerror closed it, so that a resumed
    run's wall time counts the hours before the kill. Snakemake names a log by the time it opens
    it, just before onstart: the invocation's own is the newest opened at or before ``started``."""
    opened = {}
    for log in log_dir.glob("*.snakemake.log"):
        try:
            at = datetime.strptime(log.name.removesuffix(".snakemake.log"), "%Y-%m-%dT%H%M%S.%f").timestamp()
        except ValueError:
            continue
        if at <= started:
            opened[at] = log
    if not opened:
        return None
    last_write = opened[max(opened)].stat().st_mtime
    # a log last written before the invocation began is an earlier invocation's
    return last_write if last_write >= started else None


def wall_seconds(record: dict) -> float:
    """The invocations' wall time, summed (a resumed run's pauses not counted)."""
    return sum(i["finished"] - i["started"] for i in record["invocations"] if "finished" in i)


def complete(record: dict | None) -> bool:
    """Whether the last invocation of this record finished without error."""
    return bool(record and record["invocations"] and record["invocations"][-1].get("ok"))


def _write(record: dict, stamp: Path) -> None:
    stamp.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(stamp) as tmp:
        Path(tmp).write_text(json.dumps(record, indent=1) + "\n")
