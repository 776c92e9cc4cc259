"""A saved run and a projected model load back through AutoModelForCausalLM with
trust_remote_code in a fresh interpreter, the code saved beside the weights running there (as
under lm-eval), one of them in a process that cannot import dimattn. End to end: each starts a
Python process (their helpers: the unit tests' tiny models). And the DAR trajectory summary runs
where torch and transformers cannot be imported (the report env)."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from reporting_fixtures import write_model_dirs
from test_dar_dimpo import ids, random_affine
from test_dar_dimpo import tiny as tiny_dar
from test_model import tiny

from dimattn.model.affine import save_projections
from dimattn.model.configuration_projected import save_projected_model
from dimattn.model.modeling_projected import attach_projections


def test_save_and_load_in_fresh_process(tmp_path):
    model = tiny()
    model.config.register_for_auto_class()
    model.register_for_auto_class("AutoModelForCausalLM")
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"]
    x = torch.randint(0, 97, (1, 12))
    expected = model(x).logits[0, -1].tolist()
    # dimattn/model/ is self-contained: its modules, and only they, travel with the checkpoint
    copied = sorted(p.name for p in tmp_path.glob("*.py"))
    assert copied == ["attention.py", "blocked.py", "configuration_dimattn.py", "modeling_dimattn.py", "variants.py"]
    code = (
        "import sys, json, torch\n"
        "sys.modules['dimattn'] = None  # a process that cannot import dimattn\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, trust_remote_code=True).eval()\n"
        f"print(json.dumps(m(torch.tensor({x.tolist()})).logits[0, -1].tolist()))\n"
    )
    # a fresh interpreter: the modeling code comes from the saved directory (auto_map)
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"HF_HUB_OFFLINE": "1", "PATH": ""})
    assert out.returncode == 0, out.stderr
    torch.testing.assert_close(torch.tensor(json.loads(out.stdout.strip().splitlines()[-1])), torch.tensor(expected))


def test_projected_dar_directory_loads_with_auto_model(tmp_path):
    """A DAR run directory as training writes it (its own modeling code), projected and loaded
    back through AutoModelForCausalLM with trust_remote_code, here and in a fresh interpreter,
    where the code saved beside the weights runs (as under lm-eval)."""
    from transformers import AutoModelForCausalLM

    from dimattn.data.corpora import train_tokenizer, write_documents

    words = "to be or not that is the question whether tis nobler".split()
    write_documents([{"id": "d0", "text": " ".join(words * 8)}], tmp_path / "docs.jsonl")
    tokenizer = train_tokenizer(tmp_path / "docs.jsonl", vocab_size=300, out_dir=tmp_path / "run")
    model = tiny_dar(vocab_size=len(tokenizer))
    model.config.register_for_auto_class()
    model.register_for_auto_class("AutoModelForCausalLM")
    model.save_pretrained(tmp_path / "run")
    proj = random_affine()
    save_projections({0: random_affine(seed=5), 1: proj}, tmp_path / "p.safetensors", {"objective": "kl", "seed": 0})
    save_projected_model(tmp_path / "projected", str(tmp_path / "run"), tmp_path / "p.safetensors", num_projected=1, scale="d_prime")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "projected", trust_remote_code=True).eval()
    reference = attach_projections(model, {1: proj}, 1)
    x = ids()
    expected = reference(x).logits
    torch.testing.assert_close(loaded(x).logits, expected)
    assert type(loaded).__name__.startswith("Projected")
    code = (
        "import json, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'projected')!r}, trust_remote_code=True).eval()\n"
        "assert m.__class__.__mro__[2].__module__.startswith('transformers_modules'), m.__class__.__mro__\n"
        f"print(json.dumps(m(torch.tensor({x.tolist()})).logits[:, -1].tolist()))\n"
    )
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"HF_HUB_OFFLINE": "1", "PATH": "", "HF_HOME": str(tmp_path / "hf")})
    assert out.returncode == 0, out.stderr
    got = torch.tensor(json.loads(out.stdout.strip().splitlines()[-1]))
    torch.testing.assert_close(got, expected[:, -1], atol=1e-5, rtol=1e-4)


def test_summarize_trajectory_needs_no_torch(tmp_path):
    """summarize_trajectory runs in the report conda env, which has no torch."""
    dirs = write_model_dirs(tmp_path)
    code = (
        "import sys\n"
        "class NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'transformers'):\n"
        "            raise ImportError(f'{name} is not in the report environment')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "from pathlib import Path\n"
        "from dimattn.reporting import summaries\n"
        f"summaries.summarize_trajectory([Path(p) for p in {[str(d) for d in dirs]!r}], Path({str(tmp_path / 't.csv')!r}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2]
    )
    assert result.returncode == 0, result.stderr[-2000:]
