"""Shared by the workflow scripts: send output to the rule's log, make `dimattn` importable.

Snakemake puts this folder on sys.path; the repository root above it holds `dimattn`, which a
conda environment built from envs/ does not install.
"""

import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@contextlib.contextmanager
def logged(snakemake):
    """Redirect stdout and stderr (tqdm, warnings, tracebacks) to the first log file."""
    # No torch.set_num_threads here: Snakemake runs the script with OMP_NUM_THREADS and
    # MKL_NUM_THREADS set to the job's threads, which torch takes as its own (the same count), and
    # importing torch for it cost every job that needs none (summaries, figures, data) ~1.3 s.
    with open(snakemake.log[0], "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
            yield
        except Exception:
            import traceback

            traceback.print_exc()
            raise
