"""A fit job reads its captures a lockstep group of layers at a time (dimattn.model.affine.LayerFile,
dimattn.workflow.resources.fit_group): its peak host memory is one group's q, k and v, not the file's, as
dimattn.workflow.resources.fit asks.

Measured side by side, each in a process of its own: the peak resident memory of fit_to_file then
fidelity_to_file (the fit_projection job) on a capture of one layer, and on one of four layers
of the same shape. With a lockstep budget of one layer (a paper-scale layer is over the budget)
the two peaks differ by under one layer (measured: 5 MiB, a tenth of a layer); read whole, the
four-layer file adds over three layers (measured: 159 MiB). With the default budget the four
layers go as one group, within what dimattn.workflow.resources.fit asks for one.
"""

import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from dimattn.workflow import resources  # noqa: E402
from dimattn.dimpo.capture_files import save_capture  # noqa: E402

N, H, T, D = 32, 8, 256, 64  # one layer: q, k, v of 16 MiB each in fp32
LAYER_BYTES = 3 * N * H * T * D * 4
LAYERS = 4

JOB = """
import json, sys
from dimattn.workflow import resources
from dimattn.dimpo.projections import fidelity_to_file, fit_to_file
def status(key):
    return int(next(line for line in open("/proc/self/status") if line.startswith(key)).split()[1])
base = status("VmRSS:")  # imports done, no work yet
capture, out = sys.argv[1], sys.argv[2]
if sys.argv[3] != "default":
    resources.FIT_LOCKSTEP_BYTES = int(sys.argv[3])
fit_to_file(capture, "pca", 4, {}, out + "/W.safetensors")
fidelity_to_file(capture, out + "/W.safetensors", out + "/f.csv", "m", "pca", 4)
# VmHWM, this process image's peak: ru_maxrss would keep the forking parent's from before exec
print(json.dumps({"peak_kib": status("VmHWM:"), "base_kib": base}))
"""


def peak_mib(tmp_path: Path, layers: int, budget="default") -> tuple[float, float]:
    """(peak, resident memory after the imports) of a fit job on a capture of ``layers`` layers,
    MiB, with a lockstep budget of ``budget`` bytes (resources.FIT_LOCKSTEP_BYTES)."""
    g = torch.Generator().manual_seed(layers)
    out = tmp_path / f"l{layers}_{budget}"
    out.mkdir()
    if not (tmp_path / f"l{layers}.safetensors").exists():
        capture = {layer: {part: torch.randn(N, H, T, D, generator=g) for part in "qkv"} for layer in range(layers)}
        save_capture(capture, tmp_path / f"l{layers}.safetensors", {"model": "m"})
        del capture
    run = subprocess.run(
        [sys.executable, "-c", JOB, str(tmp_path / f"l{layers}.safetensors"), str(out), str(budget)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert len((out / "f.csv").read_text().splitlines()) == layers + 1
    record = json.loads(run.stdout.splitlines()[-1])
    return record["peak_kib"] / 1024, record["base_kib"] / 1024


def test_a_fit_job_holds_one_lockstep_group_of_its_capture_at_a_time(tmp_path):
    (one, base), (many, _) = peak_mib(tmp_path, 1, LAYER_BYTES), peak_mib(tmp_path, LAYERS, LAYER_BYTES)
    layer = LAYER_BYTES / 2**20
    assert (
        many - one < layer
    ), f"peak {many:.0f} MiB over {LAYERS} layers, {one:.0f} MiB over 1 ({layer:.0f} MiB a layer)"
    # what dimattn.workflow.resources.fit asks beyond a process's overhead_mb covers the work measured here
    assert many - base <= resources.FIT_LAYER_COPIES * layer, (many, base, layer)
    group = resources.fit_group(LAYER_BYTES, LAYERS)
    assert group == LAYERS  # the default budget holds this capture whole
    together, base = peak_mib(tmp_path, LAYERS)
    assert together - base <= resources.FIT_LAYER_COPIES * group * layer, (together, base, group, layer)
