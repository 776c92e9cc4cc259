"""A projected model directory (dimattn.model.modeling_projected, seed 003 Section 4) without the model:
its config (``ProjectedConfig``), the checks of l and of KV compression, and the writer
(``save_projected_model``). The project_model job imports only this (torch, and transformers'
config and tokenizer), not transformers' modeling stack that loading the model needs.
"""

import shutil
from pathlib import Path

from transformers import AutoTokenizer, PretrainedConfig

from .affine import load_projections
from .atomic import atomic_dir
from .hf import is_dimattn_directory
from .kv_compression import KIVISettings, SnapKVSettings

PROJECTIONS_FILE = "projections.safetensors"
MODELING = Path(__file__).with_name("modeling_projected.py")  # the loader a directory carries


def projected_layers(n_layers: int, num_projected: int) -> list[int]:
    """The last ``num_projected`` layers, N-l .. N-1, as the authors project them."""
    if not 0 <= num_projected <= n_layers:
        raise ValueError(f"cannot project {num_projected} of {n_layers} layers")
    return list(range(n_layers - num_projected, n_layers))


def check_kv(kv: dict | None) -> dict:
    """``kv`` as a dict, checked: {}, {"kivi": {...}} or {"snapkv": {...}} with valid settings."""
    kv = dict(kv or {})
    if set(kv) - {"kivi", "snapkv"} or len(kv) > 1:
        raise ValueError(f"kv={kv!r}: one of {{'kivi': {{...}}}}, {{'snapkv': {{...}}}} or None")
    for name, cls in (("kivi", KIVISettings), ("snapkv", SnapKVSettings)):
        if name in kv:
            cls(**kv[name])  # a bad setting fails here, naming its field
    return kv


class ProjectedConfig(PretrainedConfig):
    """A projected model: the base model, which layers are projected and at which scale."""

    model_type = "dimattn_projected"

    def __init__(self, base_model: str = "", num_projected: int = 0, scale: str = "d_prime",
                 projections: str = PROJECTIONS_FILE, base_trust_remote_code: bool = False, kv: dict | None = None,
                 **kwargs):
        super().__init__(**kwargs)
        self.kv = kv
        self.base_model = base_model
        self.num_projected = num_projected
        self.scale = scale
        self.projections = projections
        self.base_trust_remote_code = base_trust_remote_code


def save_projected_model(out_dir, base_model: str, projections_path, num_projected: int, scale: str,
                         kv: dict | None = None, meta: dict | None = None) -> Path:
    """Write a projected model directory at ``out_dir`` (atomically): config, projections,
    tokenizer, and the loader (dimattn.model.modeling_projected and what it imports). ``base_model``: our run directory or a hub name; the base
    weights are referenced, not copied. ``projections_path`` None: the base model itself
    (num_projected 0), with ``kv`` compression if any."""
    if projections_path is None and num_projected:
        raise ValueError(f"num_projected={num_projected} needs a projections file")
    pmeta = load_projections(projections_path)[1] if projections_path is not None else {}
    n_layers = _base_layers(base_model)
    projected_layers(n_layers, num_projected)  # a clear error for l > N
    kv = check_kv(kv)
    ours = is_dimattn_directory(base_model)
    config = ProjectedConfig(
        base_model=str(Path(base_model).resolve()) if ours or Path(base_model).exists() else base_model,
        num_projected=num_projected, scale=scale, base_trust_remote_code=ours, kv=kv,
    )
    config.auto_map = {
        "AutoConfig": "configuration_projected.ProjectedConfig",
        "AutoModelForCausalLM": "modeling_projected.ProjectedForCausalLM",
    }
    config.dimattn_fit = {k: pmeta.get(k) for k in ("model", "objective", "seed", "preset", "d_prime")} | {
        "n_layers": n_layers, **(meta or {})}
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        config.save_pretrained(tmp)
        if projections_path is not None:
            shutil.copyfile(projections_path, tmp / PROJECTIONS_FILE)
        AutoTokenizer.from_pretrained(base_model).save_pretrained(tmp)
        _copy_loader(tmp)
    return out_dir


def _copy_loader(directory: Path) -> None:
    """The loader module and the modules it imports relatively (this one included), as
    transformers' remote-code loader finds them, beside the config."""
    from transformers.dynamic_module_utils import get_relative_import_files

    for path in [MODELING, *get_relative_import_files(MODELING)]:
        shutil.copyfile(path, directory / Path(path).name)


def _base_layers(base_model: str) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base_model, trust_remote_code=is_dimattn_directory(base_model))
    return int(config.num_hidden_layers)
