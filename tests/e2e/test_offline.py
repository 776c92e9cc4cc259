"""Compute jobs offline: the workflow sets HF_HUB_OFFLINE, HF_DATASETS_OFFLINE and
TRANSFORMERS_OFFLINE for every job it runs, the download rules are exactly its localrules (run on
the login node) and only their scripts take the user's own settings back; prefetch fetches only
the files from_pretrained reads."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub.utils import filter_repo_objects

from dimattn.workflow import resources
from dimattn.evaluation.projected import HUB_MODEL_FILES, HUB_MODEL_SKIP

REPO = Path(__file__).resolve().parents[2]

# The workflow as Snakemake parses it (in a fresh process: parsing sets the environment).
PARSE = """
import json, os, sys
from pathlib import Path
from snakemake.api import SnakemakeApi
from snakemake.settings.types import ConfigSettings, OutputSettings, ResourceSettings

with SnakemakeApi(OutputSettings()) as api:
    workflow = api.workflow(resource_settings=ResourceSettings(), snakefile=Path(sys.argv[1]), workdir=Path.cwd(),
                            config_settings=ConfigSettings(configfiles=[Path(p) for p in sys.argv[2:]]))._workflow
    print(json.dumps({"localrules": sorted(workflow._localrules), "env": dict(os.environ)}))
"""


def parse(workdir, *configfiles, env=None):
    """The workflow parsed in ``workdir`` (the tier_dir fixture: a run in the checkout's results/
    would refuse another tier's config)."""
    out = subprocess.run([sys.executable, "-c", PARSE, str(REPO / "Snakefile"), *configfiles], capture_output=True,
                         text=True, cwd=workdir, env=env, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def script_rules() -> dict[str, str]:
    """{rule: its workflow_scripts/ script's text}."""
    rules = {}
    for smk in (REPO / "rules").glob("*.smk"):
        for name, script in re.findall(r"^rule (\w+):\n(?:(?: {4}.*)?\n)*? {8}\"\.\./workflow_scripts/(\w+\.py)\"",
                                       smk.read_text(), re.M):
            rules[name] = (REPO / "workflow_scripts" / script).read_text()
    return rules


DOWNLOADS = {"download_sdist", "prefetch", "prepare_documents"}


@pytest.mark.parametrize("configfiles, downloads", [
    ((), DOWNLOADS),  # config.yaml trains its tokenizer: a compute job
    (("configs/paper.yaml",), DOWNLOADS | {"train_tokenizer"}),  # the Pythia tokenizer from the hub
])
def test_the_localrules_are_exactly_the_download_rules_and_jobs_are_offline(configfiles, downloads, tier_dir):
    user = {k: v for k, v in os.environ.items() if k not in resources.OFFLINE and k != "DIMATTN_USER_HF_ENV"}
    parsed = parse(tier_dir, *configfiles, env=user)
    assert set(parsed["localrules"]) == downloads
    assert {key: parsed["env"].get(key) for key in resources.OFFLINE} == resources.OFFLINE
    # The user had none of them set: the download rules' scripts run online.
    assert json.loads(parsed["env"]["DIMATTN_USER_HF_ENV"]) == dict.fromkeys(resources.OFFLINE)


def test_only_the_download_rules_scripts_go_online():
    rules = script_rules()
    assert len(rules) > 20
    assert {name for name, text in rules.items() if "online()" in text} == DOWNLOADS | {"train_tokenizer"}
    # train_tokenizer goes online only when it fetches a hub tokenizer, the case it is a localrule.
    assert re.search(r"if cfg\[\"hub\"\]:\n\s+online\(\)", rules["train_tokenizer"])


def test_online_gives_back_the_user_s_settings_and_a_job_keeps_the_record():
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/bin"}  # a user (or a test) who is offline already
    resources.go_offline(env)
    assert all(env[key] == "1" for key in resources.OFFLINE)
    job = dict(env)
    resources.go_offline(job)  # a cluster job parses the workflow again, with the exported environment
    assert job == env
    resources.online(job)
    assert job == {"HF_HUB_OFFLINE": "1", "PATH": "/bin", "DIMATTN_USER_HF_ENV": env["DIMATTN_USER_HF_ENV"]}


LLAMA_REPO = [  # meta-llama/Llama-3.1-8B-Instruct's files
    ".gitattributes", "LICENSE", "README.md", "USE_POLICY.md", "config.json", "generation_config.json",
    "model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors", "model-00003-of-00004.safetensors",
    "model-00004-of-00004.safetensors", "model.safetensors.index.json", "original/consolidated.00.pth",
    "original/params.json", "original/tokenizer.model", "special_tokens_map.json", "tokenizer.json",
    "tokenizer_config.json",
]


def test_prefetch_takes_the_safetensors_and_configs_not_the_original_checkpoint():
    kept = set(filter_repo_objects(LLAMA_REPO, allow_patterns=HUB_MODEL_FILES, ignore_patterns=HUB_MODEL_SKIP))
    weights = {f for f in LLAMA_REPO if f.endswith(".safetensors")}
    assert kept == {"config.json", "generation_config.json", "model.safetensors.index.json", "special_tokens_map.json",
                    "tokenizer.json", "tokenizer_config.json", *weights}


def test_the_prefetched_files_are_enough_for_from_pretrained(tmp_path):
    """A tiny Llama and its tokenizer saved in the hub's layout, copied through the prefetch's
    patterns, load with transformers' own classes."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    vocab = {f"t{i}": i for i in range(31)} | {"<unk>": 31}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    full, fetched = tmp_path / "repo", tmp_path / "fetched"
    model.save_pretrained(full)
    tokenizer.save_pretrained(full)
    (full / "original").mkdir()
    (full / "original" / "consolidated.00.pth").write_bytes(b"not read")
    files = [str(p.relative_to(full)) for p in full.rglob("*") if p.is_file()]
    for name in filter_repo_objects(files, allow_patterns=HUB_MODEL_FILES, ignore_patterns=HUB_MODEL_SKIP):
        (fetched / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(full / name, fetched / name)
    assert not (fetched / "original").exists()
    loaded = AutoModelForCausalLM.from_pretrained(fetched)
    torch.testing.assert_close(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
    again = AutoTokenizer.from_pretrained(fetched)
    assert again("t1 t2")["input_ids"] == tokenizer("t1 t2")["input_ids"]
    assert again.chat_template == tokenizer.chat_template


# ---- RULER QA from the prefetched files (dimattn/evaluation/lm_eval_tasks/ruler_qa.py) ---------------------

LM_EVAL_RULER = Path(__import__("lm_eval").__file__).parent / "tasks" / "ruler"


@pytest.mark.parametrize("ours, theirs", [("ruler_qa_squad", "qa_squad"), ("ruler_qa_hotpot", "qa_hotpot")])
def test_the_ruler_qa_overrides_are_lm_eval_s_tasks_but_for_the_dataset_reader(ours, theirs):
    from lm_eval.tasks._yaml_loader import load_yaml

    from dimattn.evaluation.scoring import TASKS_DIR

    mine = load_yaml(TASKS_DIR / f"{ours}.yaml", resolve_func=False)
    lm_eval_s = load_yaml(LM_EVAL_RULER / f"{theirs}.yaml", resolve_func=False)

    def without_functions(cfg):  # !function paths differ by folder only: compare their names
        text = json.dumps(cfg, sort_keys=True)
        return json.loads(re.sub(r'"/[^"]*/(\w+\.\w+)"', lambda m: json.dumps(m.group(1).split(".")[1]), text))

    assert without_functions(mine) == without_functions(lm_eval_s)
    assert mine["custom_dataset"].endswith("lm_eval_tasks/ruler_qa." + lm_eval_s["custom_dataset"].rsplit(".")[-1])


def fake_squad(n_questions=500, n_paragraphs=60) -> dict:
    """SQuAD v2's dev-set layout: data[].paragraphs[].{context, qas[].{question, answers, is_impossible}}."""
    paragraphs = [{"context": f"t{p % 30} " * 40, "qas": []} for p in range(n_paragraphs)]
    for q in range(n_questions):
        paragraphs[q % n_paragraphs]["qas"].append(
            {"question": f"t{q % 30} t1", "answers": [{"text": f"t{q % 30}"}], "is_impossible": False})
    return {"data": [{"paragraphs": paragraphs[i : i + 10]} for i in range(0, n_paragraphs, 10)]}


class FakeResponse:
    def __init__(self, content: bytes):
        self.content = content

    def raise_for_status(self):
        pass


def test_ruler_qa_reads_what_prefetch_saved_and_never_the_network(tmp_path, monkeypatch):
    import huggingface_hub.constants
    import requests
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from dimattn.evaluation.lm_eval_tasks import ruler_qa

    monkeypatch.setattr(huggingface_hub.constants, "HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(FileNotFoundError, match="run the prefetch rule"):
        ruler_qa.read_local(ruler_qa.URLS["squad"])
    payload = {ruler_qa.URLS["squad"]: fake_squad(), ruler_qa.URLS["hotpotqa"]: []}
    asked = []
    def get(url, timeout):
        asked.append(url)
        return FakeResponse(json.dumps(payload[url]).encode())

    monkeypatch.setattr(requests, "get", get)
    files = ruler_qa.fetch()  # the prefetch rule, on the login node
    assert sorted(asked) == sorted(payload) and all(Path(p).is_file() for p in files.values())
    ruler_qa.fetch()
    assert len(asked) == 2  # kept: not fetched again

    def offline(*args, **kwargs):
        raise requests.ConnectionError("a compute node has no network")

    monkeypatch.setattr(requests, "get", offline)
    vocab = {f"t{i}": i for i in range(30)} | {"<unk>": 30}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(tmp_path / "tok")
    dataset = ruler_qa.get_squad(tokenizer=str(tmp_path / "tok"), max_seq_lengths=[4096])["test"]
    assert len(dataset) == 500 and all(row["max_length"] == 4096 for row in dataset)
    assert "t1" in dataset[0]["input"] and dataset[0]["outputs"] == ["t0"]
