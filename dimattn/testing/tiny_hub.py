"""The rehearsal's Hub (configs/rehearsal.yaml): every repository that configs/paper.yaml
downloads, at a size two CPUs run, in the Hub's layout (dimattn.testing.hub_server serves it).

- models: the paper's hub ids as tiny random checkpoints of the same transformers classes
  (Llama with grouped-query attention, Qwen2, Qwen3), saved with save_pretrained beside one
  tokenizer (a byte-level BPE of TOKENIZER_VOCAB tokens with a chat template: RULER's generators
  loop or divide by zero with a few hundred); Llama's also an ``original/`` folder, which the
  prefetch must not download; EleutherAI/pythia-70m's tokenizer;
- datasets: the Pile (parquet, as EleutherAI/the_pile_deduplicated has it) and BOOKSUM (parquet)
  of random words; each lm-eval task's dataset in its own columns, splits and configs (a README
  with ``configs:``, as datasets reads a Hub repo without a script); RULER's essays
  (baber/paul_graham_essays), SQuAD and HotpotQA JSON in their formats;
- spaces: evaluate's code_eval metric (MBPP), a minimal module of the same interface.

    python -m dimattn.testing.tiny_hub ROOT
"""

import json
import random
import sys
from pathlib import Path

TOKENIZER_VOCAB = 4096
# transformers class of each hub model of configs/paper.yaml, and its tiny shape
MODELS = {
    "meta-llama/Llama-3.1-8B-Instruct": "llama",
    "meta-llama/Llama-3.2-3B-Instruct": "llama",
    "Qwen/Qwen3-4B-Instruct-2507": "qwen3",
    "Qwen/Qwen2.5-7B-Instruct": "qwen2",
}
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=16384)
PYTHIA = "EleutherAI/pythia-70m"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]


def _words() -> list[str]:
    """English words (wonderwords' lists, a dependency of lm-eval's RULER)."""
    from importlib.resources import files

    assets = files("wonderwords") / "assets"
    return sorted({w.strip().lower() for name in ("nounlist.txt", "adjectivelist.txt", "verblist.txt")
                   for w in (assets / name).read_text().splitlines() if w.strip().isalpha()})


class Text:
    """Random sentences of real words, reproducible."""

    def __init__(self, seed: int = 0):
        self.rng, self.words = random.Random(seed), _words()

    def sentence(self, n: int = 12) -> str:
        return " ".join(self.rng.choice(self.words) for _ in range(n)).capitalize() + "."

    def paragraph(self, words: int) -> str:
        return " ".join(self.sentence() for _ in range(max(1, words // 12)))

    def choice(self, seq):
        return self.rng.choice(seq)


def _tokenizer(text: Text):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [
        " ".join(text.words[i : i + 50]) + " 0123456789 " + text.paragraph(60) for i in range(0, len(text.words), 50)
    ]
    bpe.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _model(kind: str, vocab: int, seed: int):
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[kind]
    config = cls(
        vocab_size=vocab, bos_token_id=0, eos_token_id=[0, 1], pad_token_id=0, tie_word_embeddings=False, **SHAPE
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=[0, 1], do_sample=False)
    return model


def build_models(root: Path, text: Text) -> None:
    tok = _tokenizer(text)
    for i, (repo, kind) in enumerate(MODELS.items()):
        out = root / "models" / repo
        _model(kind, len(tok), seed=i).save_pretrained(out)
        tok.save_pretrained(out)
        if kind == "llama":  # the consolidated checkpoint the hub repo also has; from_pretrained reads none of it
            (out / "original").mkdir(exist_ok=True)
            (out / "original" / "consolidated.00.pth").write_bytes(b"\0" * 1024)
            (out / "original" / "params.json").write_text("{}")
    out = root / "models" / PYTHIA
    tok.save_pretrained(out)
    (out / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}))


# --- datasets ---------------------------------------------------------------------------------


def _parquet(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def _dataset(root: Path, repo: str, configs: dict[str | None, dict[str, list[dict]]]) -> None:
    """A parquet dataset repo: {config (None: the default): {split: rows}}, a README declaring
    each config's data files (datasets' ``configs:`` card metadata)."""
    import yaml

    folder = root / "datasets" / repo
    card = []
    for config, splits in configs.items():
        name = config or "default"
        files = []
        for split, rows in splits.items():
            rel = f"{name}/{split}-00000-of-00001.parquet"
            _parquet(rows, folder / rel)
            files.append({"split": split, "path": rel})
        card.append({"config_name": name, "data_files": files})
    (folder / "README.md").write_text("---\n" + yaml.safe_dump({"configs": card}, sort_keys=False) + "---\n")


def _splits(names, n, row):
    return {s: [row(i) for i in range(n)] for s in names}


def build_datasets(root: Path, text: Text, n: int = 8) -> None:
    t = text
    letters = "ABCDE"
    # the Pile: 1 parquet split "train" (configs/paper.yaml slices it), BOOKSUM's chapters
    _dataset(
        root, "EleutherAI/the_pile_deduplicated", {None: {"train": [{"text": t.paragraph(300)} for _ in range(300)]}}
    )
    _dataset(root, "kmfoda/booksum", {None: {s: [{"bid": i, "chapter": t.paragraph(1500), "summary_text": t.sentence()}
                                                  for i in range(12)] for s in ("train", "validation", "test")}})
    _dataset(root, "Rowan/hellaswag", {None: _splits(["train", "validation", "test"], n, lambda i: {
        "ind": i, "activity_label": t.sentence(2), "ctx_a": t.sentence(), "ctx_b": t.sentence(4), "ctx": t.sentence(),
        "endings": [t.sentence(6) for _ in range(4)], "source_id": str(i), "split": "val", "split_type": "indomain",
        "label": str(i % 4)})})
    arc = lambda i: {"id": str(i), "question": t.sentence(), "answerKey": letters[i % 4],  # noqa: E731
                     "choices": {"text": [t.sentence(3) for _ in range(4)], "label": list(letters[:4])}}
    _dataset(
        root,
        "allenai/ai2_arc",
        {c: _splits(["train", "validation", "test"], n, arc) for c in ("ARC-Challenge", "ARC-Easy")},
    )
    mmlu = lambda i: {
        "question": t.sentence(),
        "subject": "x",
        "choices": [t.sentence(3) for _ in range(4)],
        "answer": i % 4,
    }  # noqa: E731
    _dataset(root, "cais/mmlu", {s: _splits(["test", "validation", "dev"], 5, mmlu) for s in mmlu_subjects()})
    tqa = lambda i: {
        "question": t.sentence(),
        "mc1_targets": {"choices": [t.sentence(4) for _ in range(4)], "labels": [1, 0, 0, 0]},  # noqa: E731
        "mc2_targets": {"choices": [t.sentence(4) for _ in range(4)], "labels": [1, 1, 0, 0]},
    }
    _dataset(root, "truthfulqa/truthful_qa", {"multiple_choice": {"validation": [tqa(i) for i in range(n)]}})
    wino = lambda i: {"sentence": f"{t.sentence(5)[:-1]} _ {t.sentence(4)}", "option1": t.choice(t.words),  # noqa: E731
                      "option2": t.choice(t.words), "answer": str(1 + i % 2)}
    _dataset(root, "allenai/winogrande", {"winogrande_xl": _splits(["train", "validation", "test"], n, wino)})
    csqa = lambda i: {
        "id": str(i),
        "question": t.sentence(),
        "question_concept": t.choice(t.words),  # noqa: E731
        "choices": {"label": list(letters), "text": [t.choice(t.words) for _ in letters]},
        "answerKey": letters[i % 5],
    }
    _dataset(root, "tau/commonsense_qa", {None: _splits(["train", "validation", "test"], n, csqa)})
    gsm = lambda i: {"question": t.sentence(20), "answer": f"{t.sentence()}\n#### {i * 7}"}  # noqa: E731
    _dataset(root, "openai/gsm8k", {"main": _splits(["train", "test"], n, gsm)})
    mbpp = lambda i: {"task_id": i, "text": t.sentence(), "code": f"def f{i}(x):\n    return x + {i}",  # noqa: E731
                      "test_list": [f"assert f{i}({k}) == {k + i}" for k in range(3)], "test_setup_code": "",
                      "challenge_test_list": []}
    _dataset(
        root, "google-research-datasets/mbpp", {"full": _splits(["train", "test", "validation", "prompt"], n, mbpp)}
    )
    news = lambda i: {
        "input": "",
        "context": t.paragraph(400),
        "answers": [t.paragraph(40)],
        "length": 400,  # noqa: E731
        "dataset": "multi_news",
        "language": "en",
        "all_classes": None,
        "_id": str(i),
    }
    _dataset(root, "Xnhyacinth/LongBench", {"multi_news": {"test": [news(i) for i in range(n)]}})
    # RULER: the haystack essays, SQuAD v2 and HotpotQA (distractor) in their JSON layouts
    _dataset(root, "baber/paul_graham_essays", {None: {"train": [{"text": t.paragraph(3000)} for _ in range(4)]}})
    for repo, (name, data) in ruler_qa_files(t).items():
        path = root / "datasets" / repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))


def ruler_qa_files(t: Text, n: int = 600) -> dict[str, tuple[str, object]]:
    """{dataset repo: (file, JSON)} of SQuAD's dev-v2.0.json and HotpotQA's distractor dev set,
    small (lm-eval's generators draw 500 questions, beyond those it sets aside: ``n`` of each);
    configs/rehearsal.yaml points dimpo.downstream.ruler_qa_sources at them."""
    squad = {"version": "v2.0", "data": [{"title": f"t{j}", "paragraphs": [
        {"context": t.paragraph(24), "qas": [{"id": f"{j}-{k}", "question": t.sentence(8) + "?", "is_impossible": False,
                                              "answers": [{"text": t.choice(t.words), "answer_start": 0}]}]}
        for k in range(4)]} for j in range(n // 4)]}
    hotpot = [
        {
            "_id": str(i),
            "question": t.sentence(8) + "?",
            "answer": t.choice(t.words),
            "type": "bridge",
            "level": "easy",
            "supporting_facts": [],
            "context": [[f"title {i} {k}", [t.sentence(6)]] for k in range(2)],
        }
        for i in range(n)
    ]
    return {
        "rehearsal/squad": ("dev-v2.0.json", squad),
        "namlh2004/hotpotqa": ("hotpot_dev_distractor_v1.json", hotpot),
    }


def mmlu_subjects() -> list[str]:
    """The configs of cais/mmlu that lm-eval's mmlu group reads (its own task files)."""
    import lm_eval.tasks
    import yaml

    folder = Path(lm_eval.tasks.__file__).parent / "mmlu" / "default"
    subjects = []
    for p in sorted(folder.glob("mmlu_*.yaml")):
        subjects.append(yaml.safe_load(p.read_text())["dataset_name"])
    return subjects


# evaluate's code_eval, cut to what lm-eval's MBPP calls: pass@k of programs that run the tests.
CODE_EVAL = '''"""The rehearsal's code_eval (dimattn.testing.tiny_hub): evaluate's interface, pass@k by running each
candidate with its test in a subprocess with a timeout; HF_ALLOW_CODE_EVAL=1 required, as the real one."""
import os
import subprocess
import sys

import datasets
import evaluate


class CodeEval(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(description="pass@k", citation="", inputs_description="",
                                   features=datasets.Features({"predictions": datasets.Sequence(datasets.Value("string")),
                                                               "references": datasets.Value("string")}))

    def _compute(self, predictions, references, k=[1, 10, 100], num_workers=4, timeout=3.0):
        if os.getenv("HF_ALLOW_CODE_EVAL", 0) != "1":
            raise ValueError("set HF_ALLOW_CODE_EVAL=1 to run untrusted code")
        passed, results = [], {}
        for i, (candidates, test) in enumerate(zip(predictions, references)):
            ok = []
            for c in candidates:
                try:
                    ok.append(subprocess.run([sys.executable, "-c", c + "\\n" + test], capture_output=True,
                                             timeout=timeout).returncode == 0)
                except subprocess.TimeoutExpired:
                    ok.append(False)
            passed.append(ok)
            results[i] = [(j, {"passed": p}) for j, p in enumerate(ok)]
        scores = {f"pass@{n}": sum(any(p[:n]) for p in passed) / max(1, len(passed)) for n in k}
        return scores, results
'''


def build_nltk(root: Path) -> Path:
    """NLTK_DATA with punkt_tab's English files, empty (sentence breaks at full stops alone): what
    lm-eval's RULER downloads from GitHub, which this hub does not serve. On a cluster the
    prefetch's nltk.download puts the real ones in ~/nltk_data, which compute nodes must share."""
    folder = root / "nltk_data" / "tokenizers" / "punkt_tab" / "english"
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab"):
        (folder / name).write_text("")
    return root / "nltk_data"


def build_spaces(root: Path) -> None:
    out = root / "spaces" / "evaluate-metric" / "code_eval"
    out.mkdir(parents=True, exist_ok=True)
    (out / "code_eval.py").write_text(CODE_EVAL)


def build(root: Path) -> Path:
    """The whole Hub under ``root``; returns it."""
    root = Path(root)
    text = Text(0)
    build_models(root, text)
    build_datasets(root, text)
    build_spaces(root)
    build_nltk(root)
    return root


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
