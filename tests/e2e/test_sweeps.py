"""dimattn.workflow.sweeps: config -> runs, in-process. Every bad config is refused with the key that
holds the culprit; the schema is the only home of defaults."""

import copy
import math
from pathlib import Path

import pytest
import yaml

from dimattn.workflow import checks, sweeps

from dimattn.model import variants

REPO = Path(__file__).resolve().parents[2]
DEFAULT = yaml.safe_load((REPO / "config.yaml").read_text())
SMOKE = yaml.safe_load((REPO / "configs/smoke.yaml").read_text())


def plan_of(config):
    return sweeps.plan(sweeps.validate(config))


def text_branch(config):
    """The default without its suite study (the long model, its corpus, scale, sweep and KV
    settings), tiny-vanilla projected downstream at d' = 4 on 2 and 4 layers as cpu-full does: the
    base every bad-config case mutates, so that each adds the suite where it tests the suite."""
    c = copy.deepcopy(config)
    c["dimpo"]["models"] = [{k: v for k, v in m.items() if k != "num_projected"}
                            for m in c["dimpo"]["models"] if m["run"] != "long-vanilla"]
    for name in ("longctx", "longctx_x2"):
        c["datasets"].pop(name)
    c["pretraining"]["scales"].pop("long")
    c["pretraining"]["sweeps"] = [s for s in c["pretraining"]["sweeps"] if s["scale"] != "long"]
    c["evaluation"].pop("longctx")
    c["dimpo"]["downstream"] = {**c["dimpo"]["downstream"], "d_prime": [4], "num_projected": [2, 4], "kv": []}
    return c


TEXT = text_branch(DEFAULT)


def mutated(mutate):
    config = copy.deepcopy(TEXT)
    mutate(config)
    return config


def add_sweep(sweep):
    return lambda c: c["pretraining"]["sweeps"].append(sweep)


NEXT = f"pretraining.sweeps[{len(TEXT['pretraining']['sweeps'])}]"


def test_default_plan():
    plan = plan_of(DEFAULT)
    as_list = lambda v: v if isinstance(v, list) else [v]  # noqa: E731
    assert len(plan.runs) == sum(
        math.prod(len(as_list(s[k])) for k in (*variants.SWEPT_KEYS, "seed") if k in s)
        for s in DEFAULT["pretraining"]["sweeps"]
    )
    run = plan.runs["tiny-dar-w32-d16"]
    assert run.model["attention"] == "dar" and run.model["window"] == 32 and run.model["d_down"] == 16
    assert run.model["hidden_size"] == 128 and run.dataset == "shakespeare" and not run.synthetic
    assert plan.runs["recall-vanilla"].synthetic and "recall-vanilla" in plan.recall_runs
    # synthetic runs get the recall probe, never a perplexity
    assert plan.perplexity_targets("recall-vanilla") == []
    assert plan.perplexity_targets("tiny-vanilla") == ["shakespeare"]
    assert set(plan.lm_eval_runs) == set(plan.text_runs)
    assert run.fields["scale"] == "tiny" and run.fields["attention"] == "dar"


def test_schema_defaults_fill_every_section():
    bare = {k: v for k, v in DEFAULT.items() if k != "dimpo"}
    bare["evaluation"] = {"perplexity": {"datasets": ["shakespeare"]}}
    config = sweeps.validate(bare)
    assert config["dimpo"]["models"] == [] and config["dimpo"]["resources"]["mem_mb"] == 8000
    assert config["evaluation"]["perplexity"]["max_tokens"] is None
    assert config["evaluation"]["lm_eval"]["tasks"] == [] and config["evaluation"]["recall"]["batch_size"] == 32
    assert config["pretraining"]["scales"]["tiny"]["training"]["weight_decay"] == 0.1
    assert config["datasets"]["shakespeare"]["min_tokens"] == 0
    assert "streaming" not in config["datasets"]["shakespeare"]  # a huggingface default stays there
    assert not sweeps.plan(config).dimpo_enabled


def test_recall_defaults_are_the_generator_defaults():
    from dataclasses import fields

    from dimattn.data.recall import RecallSettings

    schema = yaml.safe_load((REPO / "schemas/config.schema.yaml").read_text())
    branches = schema["properties"]["datasets"]["additionalProperties"]["allOf"]
    recall = next(b["then"] for b in branches if b["if"]["properties"]["source"]["const"] == "synthetic_recall")
    defaults = {k: v["default"] for k, v in recall["properties"].items() if "default" in v}
    assert defaults == {f.name: f.default for f in fields(RecallSettings) if f.name in defaults}
    assert set(defaults) == {f.name for f in fields(RecallSettings)} - {"seq_len"}


def test_no_two_sections_share_one_default_object():
    # Snakemake's validator fills every absent `resources` with the schema's one {} object
    config = copy.deepcopy(DEFAULT)
    for spec in config["pretraining"]["scales"].values():
        spec.pop("resources")
    plan = plan_of(config)
    tiny, micro = plan.runs["tiny-vanilla"], plan.runs["micro-vanilla"]
    assert tiny.resources == micro.resources and tiny.resources is not micro.resources
    tiny.resources["mem_mb"] = 1
    assert micro.resources["mem_mb"] != 1
    scales = plan.config["pretraining"]["scales"]
    assert scales["tiny"]["resources"] is not scales["micro"]["resources"]


def test_dimpo_resources_come_from_the_schema_alone():
    """The capture's 8000 MB fallback in the rules was never used: the schema filled 4000 first."""
    plan = plan_of(DEFAULT)
    assert plan.dimpo["resources"] == {"runtime": 30, "mem_mb": 8000, "threads": 1}
    rules = (REPO / "rules/dimpo.smk").read_text()
    assert "8000" not in rules and "4000" not in rules


RECALL_MODEL = {"name": "recall-vanilla", "run": "recall-vanilla", "capture": {"seq_len": 64}, "num_projected": [1, 2]}


def downstream(config, **changes):
    """A valid dimpo.downstream of the default config, with ``changes``."""
    config["dimpo"]["downstream"] = {"objectives": ["kl"], "d_prime": [4], "num_projected": [2], **changes}


PAPER = yaml.safe_load((REPO / "configs/paper.yaml").read_text())


def hf_dataset(splits):
    """Adds BOOKSUM (as configs/paper.yaml reads it) with ``splits``, unused by any run."""
    return lambda c: c["datasets"].update(booksum=PAPER["datasets"]["booksum"] | {"splits": splits})


THREE = {"train": {"split": "train"}, "validation": {"split": "validation"}, "test": {"split": "test"}}

TABLE6 = {"objectives": ["dimpo"], "d_prime": [4]}
LONG_SCALE = {
    "dataset": "longctx",
    "architecture": {"hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 2},
    "training": {"seq_len": 128, "batch_size": 8, "max_steps": 10},
}


def with_long(c, x2=True):
    """The long-context suite at 128 tokens (and 256, scored only), a 6-layer scale trained on it."""
    c["datasets"]["longctx"] = {"source": "synthetic_longctx", "seq_len": 128}
    c["pretraining"]["scales"]["long"] = copy.deepcopy(LONG_SCALE)
    c["pretraining"]["sweeps"].append({"scale": "long", "attention": "vanilla"})
    if x2:
        c["datasets"]["longctx_x2"] = {"source": "synthetic_longctx", "seq_len": 256, "n_train": 16}
        c["evaluation"]["longctx"] = {"datasets": ["longctx_x2"]}
    return c

BAD = {
    # a Hugging Face corpus's split ranges, as dimattn.data.corpora reads them
    "hf splits overlap": (
        hf_dataset(THREE | {"test": {"split": "train", "start": 100, "stop": 200}}),
        "datasets.booksum.splits.test: splits 'train' and 'test' overlap",
    ),
    "hf split empty range": (
        hf_dataset(THREE | {"test": {"split": "test", "start": 5, "stop": 5}}),
        "datasets.booksum.splits.test: split 'test': need ints 0 <= start < stop",
    ),
    # lm-eval tasks that execute the model's code need the explicit opt-in
    "unsafe lm_eval task": (
        lambda c: c["evaluation"]["lm_eval"]["tasks"].append({"name": "mbpp", "num_fewshot": 3}),
        "config key evaluation.lm_eval.allow_unsafe_code: evaluation.lm_eval.tasks[2] 'mbpp'",
    ),
    "unsafe downstream task": (
        lambda c: downstream(c, tasks=[{"name": "humaneval"}]),
        "dimpo.downstream.tasks[0].name",
    ),
    # a task neither our task folder nor lm-eval's registry holds
    "unknown lm_eval task": (
        lambda c: c["evaluation"]["lm_eval"]["tasks"].append({"name": "hellaswagg"}),
        "evaluation.lm_eval.tasks[2].name: 'hellaswagg' is neither a task of dimattn/evaluation/lm_eval_tasks",
    ),
    "unknown downstream task": (
        lambda c: downstream(c, tasks=[{"name": "no_such_task"}]),
        "dimpo.downstream.tasks[0].name: 'no_such_task' is neither",
    ),
    # a capture longer than the frozen model's context
    "capture beyond the context": (
        lambda c: c["dimpo"]["capture"].update(seq_len=100000),
        "capture.seq_len: 100000 is beyond the",
    ),
    "hf split missing": (hf_dataset({"train": {"split": "train"}, "test": {"split": "test"}}), "validation"),
    # schema: types, ranges, unknown keys, required keys
    "unknown variant": (add_sweep({"scale": "tiny", "attention": "sparse"}), "sparse"),
    "unknown objective": (lambda c: c["dimpo"]["objectives"].append("cosine"), "cosine"),
    "missing sha256": (lambda c: c["datasets"]["shakespeare"].pop("sha256"), "sha256"),
    "missing member_glob": (lambda c: c["datasets"]["shakespeare"].pop("member_glob"), "member_glob"),
    "negative window": (add_sweep({"scale": "tiny", "attention": "dar", "window": -4, "d_down": 32}), "-4"),
    "dar without window": (add_sweep({"scale": "tiny", "attention": "dar", "d_down": 32}), "window"),
    "dilated without window": (add_sweep({"scale": "tiny", "attention": "dilated", "dilation": 4}), "window"),
    "dilated without dilation": (add_sweep({"scale": "tiny", "attention": "dilated", "window": 8}), "dilation"),
    "string steps": (lambda c: c["pretraining"]["scales"]["tiny"]["training"].update(max_steps="many"), "many"),
    "unknown training key": (lambda c: c["pretraining"]["scales"]["tiny"]["training"].update(lr_decay=1), "lr_decay"),
    "unknown top-level key": (lambda c: c.update(extra=1), "extra"),
    "unknown source": (lambda c: c["datasets"]["shakespeare"].update(source="ftp"), "ftp"),
    # dimattn.workflow.sweeps: the key named in full
    "swa with d_down": (add_sweep({"scale": "tiny", "attention": "swa", "window": 8, "d_down": 32}), f"{NEXT}.d_down"),
    "vanilla with window": (add_sweep({"scale": "tiny", "attention": "vanilla", "window": 8}), f"{NEXT}.window"),
    "d_down > hidden_size": (add_sweep({"scale": "tiny", "attention": "uniform", "d_down": 256}), f"{NEXT}.d_down"),
    "swa with window 0": (add_sweep({"scale": "tiny", "attention": "swa", "window": 0}), f"{NEXT}.window"),
    "layer out of range": (
        add_sweep({"scale": "tiny", "attention": "dar", "window": 8, "d_down": 32, "attention_layers": [7]}),
        f"{NEXT}.attention_layers",
    ),
    "duplicate run": (add_sweep({"scale": "tiny", "attention": "vanilla"}), "already defined"),
    "unknown dataset": (lambda c: c["pretraining"].update(dataset="pile"), "pretraining.dataset"),
    "unknown scale dataset": (
        lambda c: c["pretraining"]["scales"]["tiny"].update(dataset="pile"),
        "pretraining.scales.tiny.dataset",
    ),
    "unknown scale": (add_sweep({"scale": "huge", "attention": "vanilla"}), f"{NEXT}.scale"),
    "heads do not divide": (
        lambda c: c["pretraining"]["scales"]["tiny"]["architecture"].update(num_attention_heads=3),
        "pretraining.scales.tiny.architecture.hidden_size",
    ),
    "recall seq_len mismatch": (
        lambda c: c["pretraining"]["scales"]["recall"]["training"].update(seq_len=32),
        "pretraining.scales.recall.training.seq_len",
    ),
    "synthetic perplexity": (
        lambda c: c["evaluation"]["perplexity"]["datasets"].append("recall"),
        "evaluation.perplexity.datasets",
    ),
    "unknown lm_eval scale": (
        lambda c: c["evaluation"]["lm_eval"].update(scales=["huge"]),
        "evaluation.lm_eval.scales",
    ),
    "synthetic lm_eval tasks": (
        lambda c: c["evaluation"]["lm_eval"].update(write_tasks_from="recall"),
        "evaluation.lm_eval.write_tasks_from",
    ),
    "two tokenizers": (lambda c: c["tokenizer"].update(hub="EleutherAI/pythia-70m"), "tokenizer"),
    "unknown tokenizer corpus": (lambda c: c["tokenizer"].update(train_on="pile"), "tokenizer.train_on"),
    "dimpo unknown run": (
        lambda c: c["dimpo"]["models"].append({"name": "x", "run": "tiny-nope"}),
        "dimpo.models[1].run",
    ),
    "dimpo of a sliding-window run": (
        lambda c: c["dimpo"]["models"].append({"name": "x", "run": "tiny-swa-w32"}),
        "dimpo.models[1].run: DimPO projects a frozen vanilla, dar, uniform model",
    ),
    "dimpo d_prime > head_dim": (lambda c: c["dimpo"].update(d_prime=[2, 64]), "dimpo.d_prime"),
    "dimpo unknown dataset": (lambda c: c["dimpo"].update(dataset="pile"), "dimpo.dataset"),
    "dimpo without d_prime": (lambda c: c["dimpo"].update(d_prime=[]), "dimpo.d_prime"),
    "dimpo unknown fit setting": (lambda c: c["dimpo"]["hparams"].update(temperature=2), "temperature"),
    "dimpo setting of the wrong type": (lambda c: c["dimpo"]["hparams"].update(lr="fast"), "fast"),
    "ablation unknown study": (
        lambda c: c["dimpo"]["ablations"].update(table7=c["dimpo"]["ablations"]["quirks"]),
        "table7",
    ),
    "ablation unknown setting": (lambda c: c["dimpo"]["ablations"]["quirks"]["settings"].append({"tau": 1}), "tau"),
    "ablation unknown preset": (
        lambda c: c["dimpo"]["ablations"]["quirks"]["settings"].append({"preset": "mine"}),
        "mine",
    ),
    "ablation without settings": (lambda c: c["dimpo"]["ablations"]["quirks"].pop("settings"), "settings"),
    "ablation capture setting": (
        lambda c: c["dimpo"]["ablations"]["quirks"]["settings"].append({"capture_dtype": "bfloat16"}),
        "dimpo.ablations.quirks.settings[12]",
    ),
    "ablation repeated setting": (
        lambda c: c["dimpo"]["ablations"]["quirks"]["settings"].append({"preset": "authors", "causal": True}),
        "dimpo.ablations.quirks.settings[12]: repeats settings[1]",
    ),
    "ablation d_prime > head_dim": (
        lambda c: c["dimpo"]["ablations"]["quirks"].update(d_prime=[64]),
        "dimpo.ablations.quirks.d_prime",
    ),
    "table 1 repeated setting": (lambda c: c["dimpo"].update(settings=[{}, {}]), "dimpo.settings[1]"),
    "reference_dir missing": (lambda c: c.update(reference_dir="no/such/folder"), "config key reference_dir"),
    "downstream objective not fitted": (lambda c: downstream(c, objectives=["orpo"]), "dimpo.downstream.objectives"),
    "downstream d_prime not fitted": (lambda c: downstream(c, d_prime=[3]), "dimpo.downstream.d_prime"),
    "downstream without layers": (lambda c: downstream(c, num_projected=[]), "dimpo.downstream.num_projected"),
    "downstream l > layers": (lambda c: downstream(c, num_projected=[2, 5]), "dimpo.downstream.num_projected"),
    "downstream l = 0": (lambda c: downstream(c, num_projected=[0]), "num_projected"),
    "a model's l > its layers": (
        lambda c: c["dimpo"]["models"].append(RECALL_MODEL | {"num_projected": [3]}),
        "dimpo.models[1].num_projected",
    ),
    "recall capture off its examples": (
        lambda c: c["dimpo"]["models"].append(RECALL_MODEL | {"capture": {"seq_len": 128}}),
        "dimpo.models[1].capture.seq_len: 128 is not the example length 64",
    ),
    "recall capture beyond its split": (
        lambda c: c["dimpo"]["models"].append(RECALL_MODEL | {"capture": {"seq_len": 64, "fit_sequences": 257}}),
        "dimpo.models[1].capture.fit_sequences: 257 exceeds the 256 validation examples",
    ),
    "downstream RULER one below its minimum length": (
        lambda c: downstream(
            c, tasks=[{"name": "ruler_vt"}], metadata={"max_seq_lengths": [sweeps.RULER_MIN_LENGTH - 1]}
        ),
        "dimpo.downstream.metadata.max_seq_lengths: RULER tasks (ruler_vt, ...) need lengths of at least 2048",
    ),
    "downstream objective not fitted for a model": (
        lambda c: (
            downstream(c, objectives=["kl"], num_projected=[1]),
            c["dimpo"]["models"].append(RECALL_MODEL | {"objectives": ["pca"]}),
        ),
        "dimpo.downstream.objectives: 'kl' is not fitted for 'recall-vanilla' (dimpo.models[1].objectives",
    ),
    "a model's d_prime > its head_dim": (
        lambda c: c["dimpo"]["models"].append(RECALL_MODEL | {"d_prime": [33]}),
        "dimpo.models[1].d_prime: 33 exceeds the head dimension 32",
    ),
    "hub model l > its layers": (
        lambda c: (
            downstream(c),
            c["dimpo"]["models"].append(
                {
                    "name": "llama",
                    "hub": "meta-llama/Llama-3.2-3B-Instruct",
                    "num_hidden_layers": 28,
                    "num_projected": [2, 32],
                }
            ),
        ),
        "dimpo.models[1].num_projected: l=32 exceeds the 28 layers of 'meta-llama/Llama-3.2-3B-Instruct'",
    ),
    "hub model default l > its layers": (
        lambda c: (
            downstream(c, num_projected=[2, 6]),
            c["dimpo"]["models"].__setitem__(
                0, {"name": "llama", "hub": "meta-llama/Llama-3.2-3B-Instruct", "num_hidden_layers": 4}
            ),
        ),
        "dimpo.downstream.num_projected: l=6 exceeds the 4 layers",
    ),
    "layers of one of our runs": (
        lambda c: c["dimpo"]["models"][0].update(num_hidden_layers=4),
        "dimpo.models[0].num_hidden_layers",
    ),
    "a model's downstream d' not fitted for it": (
        lambda c: (
            downstream(c, num_projected=[1]),
            c["dimpo"]["models"].append(RECALL_MODEL | {"downstream_d_prime": [3]}),
        ),
        "dimpo.models[1].downstream_d_prime: 3 is not fitted for 'recall-vanilla'",
    ),
    "downstream task d_prime not made": (
        lambda c: downstream(c, tasks=[{"name": "dimattn_heldout", "d_prime": [8]}]),
        "dimpo.downstream.tasks[0].d_prime: 8 is not among dimpo.downstream.d_prime",
    ),
    "kv of an unknown model": (
        lambda c: downstream(c, kv=[{"name": "q", "kivi": {"bits": 2}, "models": ["gpt"]}]),
        "dimpo.downstream.kv[0].models",
    ),
    "kv d_prime not made": (
        lambda c: downstream(c, kv=[{"name": "q", "kivi": {"bits": 2}, "d_prime": [2]}]),
        "dimpo.downstream.kv[0].d_prime",
    ),
    "table1 study objective not fitted": (
        lambda c: downstream(c, studies=[{"study": "table1", "objectives": ["dimpo_kl"], "num_projected": [2]}]),
        "dimpo.downstream.studies[0].objectives: 'dimpo_kl' is not fitted for 'tiny-vanilla'",
    ),
    "table1 study d_prime not fitted": (
        lambda c: downstream(c, studies=[{"study": "table1", "d_prime": [3], "num_projected": [2]}]),
        "dimpo.downstream.studies[0].d_prime",
    ),
    "ablation study choosing objectives": (
        lambda c: downstream(c, studies=[{"study": "quirks", "objectives": ["kl"], "num_projected": [2]}]),
        "dimpo.downstream.studies[0].objectives: only a table1 entry",
    ),
    "a downstream study of an ablation whose model is not fitted": (
        lambda c: (
            c["dimpo"]["ablations"]["quirks"].update(models=["gone"]),
            downstream(c, num_projected=[1], studies=[{"study": "quirks", "num_projected": [1]}]),
        ),
        "dimpo.ablations.quirks.models: 'gone' is not in dimpo.models",
    ),
    "downstream study unknown": (
        lambda c: downstream(c, studies=[{"study": "table7", "num_projected": [2]}]),
        "dimpo.downstream.studies[0].study",
    ),
    "downstream study too deep": (
        lambda c: downstream(c, studies=[{"study": "quirks", "num_projected": [9]}]),
        "dimpo.downstream.studies[0].num_projected: l=9 exceeds the 4 layers",
    ),
    "downstream study of a model it does not fit": (
        lambda c: (
            c["dimpo"]["models"].append(RECALL_MODEL),
            c["dimpo"]["ablations"]["quirks"].update(models=["tiny-vanilla"]),
            downstream(
                c, num_projected=[1], studies=[{"study": "quirks", "num_projected": [1], "models": ["recall-vanilla"]}]
            ),
        ),
        "dimpo.downstream.studies[0].models: 'recall-vanilla' is not fitted in 'quirks'",
    ),
    "ablation of an unknown model": (
        lambda c: c["dimpo"]["ablations"]["quirks"].update(models=["gpt"]),
        "dimpo.ablations.quirks.models",
    ),
    "downstream unknown scale": (lambda c: downstream(c, scale="sqrt"), "sqrt"),
    "downstream kv taken name": (
        lambda c: downstream(c, kv=[{"name": "none", "kivi": {"bits": 2}}]),
        "dimpo.downstream.kv[0].name",
    ),
    "downstream kv repeated name": (
        lambda c: downstream(c, kv=[{"name": "q", "kivi": {"bits": 2}}, {"name": "q", "kivi": {"bits": 4}}]),
        "dimpo.downstream.kv[1].name",
    ),
    "downstream kivi 3 bits": (lambda c: downstream(c, kv=[{"name": "q", "kivi": {"bits": 3}}]), "3"),
    "downstream kivi residual": (
        lambda c: downstream(c, kv=[{"name": "q", "kivi": {"bits": 2, "residual": 100}}]),
        "dimpo.downstream.kv[0].kivi.residual",
    ),
    "downstream snapkv budget": (
        lambda c: downstream(c, kv=[{"name": "s", "snapkv": {"budget": 16}}]),
        "dimpo.downstream.kv[0].snapkv.budget",
    ),
    # At the boundary: a budget of the window's size keeps no token besides the window.
    "downstream snapkv budget = window": (
        lambda c: downstream(c, kv=[{"name": "s", "snapkv": {"budget": 32, "window": 32}}]),
        "dimpo.downstream.kv[0].snapkv.budget",
    ),
    # DimPO's head over every key of the list is KL plus a constant (tiny-vanilla: 256 keys)
    "table6 k = every key": (
        lambda c: c["dimpo"]["ablations"].update(table6=TABLE6 | {"settings": [{"k": 256, "lam": 1}]}),
        "dimpo.ablations.table6.settings[0].k: k=256 reaches the 256 keys of 'tiny-vanilla'",
    ),
    "k_share rounding to every key": (
        lambda c: c["dimpo"]["hparams"]["per_objective"]["dimpo"].update(k_share=0.999),
        "dimpo.hparams.per_objective.dimpo.k_share: k=256 reaches the 256 keys",
    ),
    "k of a recall capture": (
        lambda c: (
            c["dimpo"]["models"].append(RECALL_MODEL),
            c["dimpo"]["ablations"].update(table6=TABLE6 | {"settings": [{"k": 64, "lam": 1}]}),
        ),
        "dimpo.ablations.table6.settings[0].k: k=64 reaches the 64 keys of 'recall-vanilla'",
    ),
    "k and k_share at once": (
        lambda c: c["dimpo"]["ablations"].update(table6=TABLE6 | {"settings": [{"k": 4, "k_share": 0.25}]}),
        "dimpo.ablations.table6.settings[0].k_share",
    ),
    "k_share of 1": (lambda c: c["dimpo"]["hparams"].update(k_share=1), "k_share"),
    # the long-context suite
    "suite scored on a recall corpus": (
        lambda c: (with_long(c), c["evaluation"]["longctx"].update(datasets=["recall"])),
        "evaluation.longctx.datasets[0]: 'recall' is not a synthetic_longctx corpus",
    ),
    "suite scored in another vocabulary": (
        lambda c: (with_long(c), c["datasets"]["longctx_x2"].update(n_keys=32)),
        "datasets.longctx_x2.n_keys: 32 differs from 'longctx'",
    ),
    "suite scored in another layout": (
        lambda c: (with_long(c), c["datasets"]["longctx"].update(question_first=True)),
        "datasets.longctx_x2.question_first: False differs from 'longctx''s True",
    ),
    "a drill of the whole train split": (
        lambda c: (with_long(c), c["datasets"]["longctx"].update(drill=1.0)),
        "On instance['datasets']['longctx']['drill']",
    ),
    "suite run captured off its examples": (
        lambda c: (with_long(c), c["dimpo"]["models"].append({"name": "x", "run": "long-vanilla"})),
        "dimpo.models[1].capture.seq_len: 256 is not the example length 128 of 'longctx'",
    ),
    "suite training off its examples": (
        lambda c: (with_long(c), c["pretraining"]["scales"]["long"]["training"].update(seq_len=256)),
        "pretraining.scales.long.training.seq_len: 256 must equal datasets.longctx.seq_len=128",
    ),
    "suite unknown subtask": (
        lambda c: (with_long(c), c["datasets"]["longctx"].update(subtasks=["passkey"])),
        "passkey",
    ),
    "suite scored on subtasks never trained": (
        lambda c: (with_long(c), c["datasets"]["longctx"].update(subtasks=["niah_single", "niah_multikey"])),
        "datasets.longctx_x2.subtasks: asks ['niah_multivalue', 'niah_multiquery', 'vt', 'cwe', 'fwe', 'qa'], which "
        "run 'long-vanilla' never trains on",
    ),
    "downstream kv both methods": (
        lambda c: downstream(c, kv=[{"name": "s", "snapkv": {"budget": 64}, "kivi": {"bits": 2}}]),
        "oneOf",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_is_refused_naming_the_key(case):
    mutate, culprit = BAD[case]
    with pytest.raises(Exception) as err:
        plan_of(mutated(mutate))
    assert culprit in str(err.value), str(err.value)[-2000:]
    assert not isinstance(err.value, (KeyError, TypeError, AttributeError)), repr(err.value)


def test_a_head_term_one_key_short_of_the_list_is_planned():
    """The boundary of "table6 k = every key": k = keys - 1 is DimPO, not KL."""
    table6 = TABLE6 | {"settings": [{"k": 255, "lam": 1}, {"k_share": 0.015625, "lam": 1}, {"k": 256, "lam": 0}]}
    plan = plan_of(mutated(lambda c: c["dimpo"]["ablations"].update(table6=table6)))
    assert [f.setting for f in plan.dimpo_fits if f.study == "table6"] == [
        "k=255,lam=1", "k_share=0.015625,lam=1", "k=256,lam=0"]
    # the objective's default needs no config k: the paper's share, 4 of tiny-vanilla's 256 keys
    assert "k" not in DEFAULT["dimpo"]["hparams"]["per_objective"]["dimpo"]


def test_a_long_context_run_is_scored_on_the_suite_alone():
    plan = plan_of(mutated(with_long))
    assert plan.longctx_runs == ["long-vanilla"] and plan.longctx_datasets == ["longctx", "longctx_x2"]
    assert "long-vanilla" not in plan.recall_runs + plan.text_runs + plan.lm_eval_runs + plan.reported_runs
    assert plan.perplexity_targets("long-vanilla") == [] and plan.longctx_targets("long-vanilla") == [
        "longctx",
        "longctx_x2",
    ]
    assert plan.runs["long-vanilla"].synthetic and plan.is_synthetic("longctx_x2")
    assert plan_of(mutated(lambda c: with_long(c, x2=False))).longctx_targets("long-vanilla") == ["longctx"]
    text = plan_of(TEXT)
    assert text.longctx_runs == [] and text.reported_runs == list(text.runs)
    default = plan_of(DEFAULT)  # the default's suite study: its one long-context run
    assert default.longctx_runs == ["long-vanilla"] and default.longctx_datasets == ["longctx", "longctx_x2"]
    assert default.reported_runs == [r for r in default.runs if r != "long-vanilla"]


def test_long_context_defaults_are_the_generator_defaults():
    from dataclasses import fields

    from dimattn.data.longctx import SUBTASKS, LongContextSettings

    schema = yaml.safe_load((REPO / "schemas/config.schema.yaml").read_text())
    branches = schema["properties"]["datasets"]["additionalProperties"]["allOf"]
    suite = next(b["then"] for b in branches if b["if"]["properties"]["source"]["const"] == "synthetic_longctx")
    defaults = {k: v["default"] for k, v in suite["properties"].items() if "default" in v}
    generator = {
        f.name: list(f.default) if isinstance(f.default, tuple) else f.default for f in fields(LongContextSettings)
    }
    assert defaults == {k: v for k, v in generator.items() if k in defaults}
    assert set(defaults) == set(generator) - {"seq_len"}
    assert set(checks.LONGCTX_VOCABULARY) <= set(generator)
    assert sweeps.SUITE_SUBTASKS == SUBTASKS  # the planner's copy, torch- and numpy-free


def test_the_planned_head_objectives_are_those_reading_k():
    from dimattn.dimpo.objectives import OBJECTIVES

    assert set(sweeps.HEAD_OBJECTIVES) == {name for name, o in OBJECTIVES.items() if "k" in o.hparams}


def test_snapkv_budget_one_past_the_window_is_planned():
    """The other side of the boundary: budget = window + 1 keeps one token besides the window."""
    config = mutated(lambda c: downstream(c, kv=[{"name": "s", "snapkv": {"budget": 33, "window": 32}}]))
    plan_of(config)  # raises on a refused config


# The other side of BAD's boundaries: the largest value each check lets through.
AT_THE_LIMIT = {
    "d' = the head dimension": lambda c: c["dimpo"]["models"].append(RECALL_MODEL | {"d_prime": [4, 32]}),
    "RULER at its minimum length": lambda c: downstream(c, tasks=[{"name": "ruler_vt"}],
                                                        metadata={"max_seq_lengths": [sweeps.RULER_MIN_LENGTH]}),
    "recall capture of its whole split": lambda c: c["dimpo"]["models"].append(
        RECALL_MODEL | {"capture": {"seq_len": 64, "fit_sequences": 256}}),
}


@pytest.mark.parametrize("case", sorted(AT_THE_LIMIT))
def test_a_config_at_the_limit_is_planned(case):
    plan_of(mutated(AT_THE_LIMIT[case]))  # raises on a refused config


def test_seeds_expand_into_replicates():
    config = mutated(
        add_sweep({"scale": "micro", "attention": "dar", "window": 8, "d_down": [8, 16], "seed": [0, 1, 2]})
    )
    config["pretraining"]["sweeps"] = [s for s in config["pretraining"]["sweeps"] if s["scale"] != "micro"] + \
        [config["pretraining"]["sweeps"][-1], {"scale": "micro", "attention": "vanilla", "seed": [0, 1]}]
    plan = plan_of(config)
    micro = sorted(r for r in plan.runs if r.startswith("micro-"))
    assert micro == ["micro-dar-w8-d16", "micro-dar-w8-d16-s1", "micro-dar-w8-d16-s2", "micro-dar-w8-d8",
                     "micro-dar-w8-d8-s1", "micro-dar-w8-d8-s2", "micro-vanilla", "micro-vanilla-s1"]
    assert plan.runs["micro-dar-w8-d8-s2"].training["seed"] == 2 == plan.runs["micro-dar-w8-d8-s2"].fields["seed"]
    assert plan.runs["micro-dar-w8-d8"].training["seed"] == 0
    # the scale's own training dict is left as it was
    assert plan.config["pretraining"]["scales"]["micro"]["training"]["seed"] == 0
    with pytest.raises(sweeps.ConfigError, match=r"seed: \[1, 1\] repeats"):
        plan_of(mutated(add_sweep({"scale": "micro", "attention": "vanilla", "seed": [1, 1]})))


def test_hf_split_ranges_default_to_the_whole_split():
    """configs/paper.yaml gives BOOKSUM's splits by name alone: start 0 and stop null (the end)
    come from the schema, which dimattn.data.corpora reads; ranges of one split that touch do not overlap."""
    plan = plan_of(mutated(hf_dataset(THREE)))
    assert plan.config["datasets"]["booksum"]["splits"]["validation"] == {"split": "validation", "start": 0,
                                                                          "stop": None}
    pile = {"train": {"split": "train", "start": 20}, "validation": {"split": "train", "stop": 10},
            "test": {"split": "train", "start": 10, "stop": 20}}
    assert plan_of(mutated(hf_dataset(pile))).config["datasets"]["booksum"]["splits"]["train"]["stop"] is None


def test_unsafe_code_is_an_explicit_opt_in():
    """lm-eval's unsafe_code tasks are read off its task files (MBPP's include too); Table 4's MBPP
    plans once evaluation.lm_eval.allow_unsafe_code is set, as configs/paper.yaml does."""
    unsafe = checks.unsafe_lm_eval_tasks()
    assert {"mbpp", "mbpp_plus", "humaneval"} <= unsafe and not unsafe & {"hellaswag", "gsm8k", "commonsense_qa"}
    config = mutated(lambda c: c["evaluation"]["lm_eval"]["tasks"].append({"name": "mbpp", "num_fewshot": 3}))
    config["evaluation"]["lm_eval"]["allow_unsafe_code"] = True
    assert plan_of(config).lm_eval["allow_unsafe_code"] is True
    assert sweeps.validate(DEFAULT)["evaluation"]["lm_eval"]["allow_unsafe_code"] is False
    assert PAPER["evaluation"]["lm_eval"]["allow_unsafe_code"] is True


def test_dimpo_fits_on_the_configured_split():
    """Seed 003 (3.3) and lanzv/dimpo fit on the train split (configs/paper.yaml); the CPU
    default keeps validation, so its outputs mean what they did."""
    assert plan_of(DEFAULT).capture_split("fit") == "validation" and plan_of(DEFAULT).capture_split("eval") == "test"
    assert PAPER["dimpo"]["capture"]["fit_split"] == "train"
    config = mutated(lambda c: (c["dimpo"]["capture"].update(fit_split="train"), c["dimpo"]["models"].append(
        RECALL_MODEL | {"capture": {"seq_len": 64, "fit_sequences": 300}})))
    plan = plan_of(config)  # 300 of recall's 40,000 train examples, more than its 256 validation ones
    assert plan.capture_split("fit") == "train"
    config["dimpo"]["capture"]["fit_split"] = "validation"
    with pytest.raises(sweeps.ConfigError, match="300 exceeds the 256 validation examples"):
        plan_of(config)


def test_the_paper_grids_reach_every_layer_as_the_authors_ran_them():
    """configs/paper.yaml: each hub model's l to 100 % of its layers with Table 4's shares as
    lanzv/dimpo rounded them; harness tasks at d' 64, 16, 4, 1, RULER at 64; Table 5 on
    Llama-3.1-8B alone; Table 6's KL and DimPO + KL projected where its ablation is."""
    from dimattn.workflow.settings import downstream_tasks

    config = copy.deepcopy(DEFAULT)
    for key, value in PAPER.items():  # Snakemake's --configfile merge: mappings merge, the rest replaces
        config[key] = config[key] | value if isinstance(value, dict) and key != "dimpo" else value
    config["dimpo"] = DEFAULT["dimpo"] | PAPER["dimpo"]
    plan = plan_of(config)
    layers = {"llama-3.1-8b-instruct": 32, "qwen3-4b-instruct": 36, "llama-3.2-3b-instruct": 28,
              "qwen2.5-7b-instruct": 28}
    table4 = {32: {8, 12, 16}, 36: {9, 15, 18}, 28: {7, 12, 14}}
    for model, n in layers.items():
        grid = plan.num_projected(model)
        assert plan.dimpo_layers(model) == n and max(grid) == n and table4[n] <= set(grid), (model, grid)
        projected = plan.projected(model)
        assert {p.d_prime for p in projected if p.study == "table1" and p.kv == "none"} == {0, 64, 16, 4, 1}
        kvs = {p.kv for p in projected}
        assert kvs == ({"none", "snapkv1024", "snapkv2048", "kivi2", "kivi4"} if n == 32 else {"none"})
    l6 = {"llama-3.1-8b-instruct": 20, "qwen3-4b-instruct": 24}
    for model, l in l6.items():
        at = {(p.objective, p.study) for p in plan.projected(model) if p.num_projected == l and p.d_prime == 64}
        assert {("kl", "table1"), ("dimpo_kl", "table1"), ("dimpo", "table6")} <= at
    assert not any(p.objective == "dimpo_kl" for p in plan.projected("llama-3.2-3b-instruct"))
    tasks = plan.downstream["tasks"]
    assert [t["name"] for t in downstream_tasks(tasks, 4)] == ["hellaswag", "arc_challenge", "mmlu",
                                                               "truthfulqa_mc2", "winogrande"]
    assert downstream_tasks(tasks, 64) == tasks == downstream_tasks(tasks, 0)  # the base model: every task
    assert {t["dtype"] for t in tasks} == {"bfloat16"}
    assert all(t["batch_size"] == 1 and t["chat_template"] for t in tasks if t["name"] in sweeps.RULER_TASKS)


def test_paper_pretraining_follows_pythias_configs():
    """Pythia's padded vocabulary (GPT-NeoX's make_vocab_size_divisible_by 128) and fixed data
    order at every paper scale, neither at CPU scale; the d = 2048 model at Pythia-1B's lr 2.5e-4
    / 2.5e-5."""
    scales = PAPER["pretraining"]["scales"]
    assert {s["architecture"]["make_vocab_size_divisible_by"] for s in scales.values()} == {128}
    assert {s["training"]["data_order"] for s in scales.values()} == {"sequential"}
    assert {r.training["data_order"] for r in plan_of(DEFAULT).runs.values()} == {"random"}
    assert (scales["pythia-1b"]["training"]["lr"], scales["pythia-1b"]["training"]["min_lr"]) == (2.5e-4, 2.5e-5)
    assert {r.model["make_vocab_size_divisible_by"] for r in plan_of(DEFAULT).runs.values()} == {1}


def test_sweep_errors_carry_the_key():
    with pytest.raises(sweeps.ConfigError) as err:
        plan_of(mutated(add_sweep({"scale": "tiny", "attention": "swa", "window": 8, "dilation": 2})))
    assert err.value.key == f"{NEXT}.dilation"


def test_the_smoke_config_stands_alone():
    """configs/smoke.yaml replaces config.yaml whole: every stage, at the smallest size."""
    plan = plan_of(SMOKE)
    assert {r.scale for r in plan.runs.values()} == {"tiny", "recall"}
    assert plan.recall_runs and plan.text_runs and plan.lm_eval_runs and plan.dimpo_enabled
    attentions = {r.model["attention"] for r in plan.runs.values()}
    assert attentions == {"vanilla", "dar", "uniform", "swa"}


def test_dimpo_schema_names_every_fit_setting_and_objective():
    """The schema types every dimattn.dimpo.fit_settings.FitSettings field; the code is the authority."""
    from dataclasses import fields

    from dimattn.dimpo.objectives import OBJECTIVES
    from dimattn.dimpo.fit_settings import PRESETS, FitSettings

    schema = yaml.safe_load((REPO / "schemas/config.schema.yaml").read_text())
    hparams = schema["properties"]["dimpo"]["properties"]["hparams"]["properties"]
    names = {f.name for f in fields(FitSettings)}
    assert set(hparams) == {"preset", "per_objective"}  # fit seeds: dimpo.seeds
    assert set(schema["$defs"]["fit_fields"]["properties"]) == names - {"preset"}
    assert set(schema["$defs"]["setting"]["properties"]) == {"preset"}
    assert set(schema["$defs"]["objective"]["enum"]) == set(OBJECTIVES)
    assert set(hparams["preset"]["enum"]) == set(PRESETS)


@pytest.mark.parametrize("overrides", [{}, {"k": 64, "lam": 0.5}, {"preset": "authors", "causal": True},
                                       {"max_preferred": None, "pair_mode": "all", "num_sampled_keys": 8}])
def test_setting_names_round_trip(overrides):
    name = sweeps.setting_name(overrides)
    assert sweeps.parse_setting(name) == overrides and "/" not in name
    assert name == "default" if not overrides else "=" in name


def test_dimpo_fits_of_table1_and_the_studies():
    plan = plan_of(DEFAULT)
    fits = plan.dimpo_fits
    table1 = [f for f in fits if f.study == "table1"]
    assert len(table1) == len(DEFAULT["dimpo"]["objectives"]) * len(DEFAULT["dimpo"]["d_prime"])
    assert {f.setting for f in table1} == {"default"}
    quirks = [f for f in fits if f.study == "quirks"]
    assert [f.setting for f in quirks][:2] == ["preset=authors", "preset=authors,causal=true"]
    assert [f.order for f in quirks] == list(range(len(DEFAULT["dimpo"]["ablations"]["quirks"]["settings"])))
    # the default's downstream study is the suite model's: the long-context report, its KV frontier
    assert plan.dimpo_studies == ("table1", "quirks", "downstream", "long_context", "kv", "suite")
    assert plan_of(TEXT).dimpo_studies == ("table1", "quirks", "downstream")
    long = plan.projected("long")
    assert {p.num_projected for p in long} == {0, 2, 3, 6} and {p.seed for p in long} == {0, 1}
    assert {p.objective for p in long} == {"base", "pca", "kl", "dimpo"} and {p.d_prime for p in long} == {0, 16}
    assert {p.kv for p in long if p.num_projected == 6} == {"none", "kivi2", "snapkv16"}
    assert plan.projected("tiny-vanilla") == []  # fitted only (Table 1, the quirks)
    assert plan.dimpo_settings["preset=authors,max_preferred=null"] == {"preset": "authors", "max_preferred": None}
    both = plan_of(mutated(lambda c: c["dimpo"].update(settings=[{"preset": "ours"}, {"preset": "authors"}])))
    assert {f.setting for f in both.dimpo_fits if f.study == "table1"} == {"preset=ours", "preset=authors"}
    assert plan_of(mutated(lambda c: c["dimpo"].update(models=[]))).dimpo_studies == ()


def test_downstream_plan():
    config = mutated(lambda c: downstream(c, objectives=["kl", "dimpo"], num_projected=[2, 4],
                                          kv=[{"name": "kivi2", "kivi": {"bits": 2}}]))
    plan = plan_of(config)
    projected = plan.dimpo_projected
    # tiny-vanilla is scored on perplexity and loglikelihood tasks, which KV compression leaves
    # exact: no compressed models (the recall probe and hub models get them)
    assert projected[0] == sweeps.Projected("base", 0, 0, "none")
    assert len(projected) == 1 + 2 * 1 * 2 * len(TEXT["dimpo"]["seeds"])  # base, then objectives x d' x l x fit seed
    assert plan.kv_settings("kivi2") == {"kivi": {"bits": 2, "group_size": 32, "residual": 128}}  # schema defaults
    assert plan.kv_settings("none") == {} and "downstream" in plan.dimpo_studies


def test_a_missing_reference_csv_is_refused_before_any_job(tmp_path, monkeypatch):
    import shutil

    shutil.copytree(REPO / "reference", tmp_path / "reference")
    (tmp_path / "reference" / "dimpo_ablation.csv").unlink()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        sweeps.ConfigError, match=r"config key reference_dir: reference lacks reference/dimpo_ablation.csv"
    ):
        plan_of(DEFAULT)


def test_each_model_is_captured_and_scored_by_its_kind():
    def add_recall(c):
        downstream(c, objectives=["kl"], num_projected=[2, 4], kv=[{"name": "kivi2", "kivi": {"bits": 2}}])
        c["dimpo"]["models"].append(RECALL_MODEL | {"num_projected": [1, 2]})
        c["dimpo"]["ablations"]["quirks"]["models"] = ["tiny-vanilla"]

    plan = plan_of(mutated(add_recall))
    assert plan.dimpo_probe("tiny-vanilla") == "text" and plan.dimpo_probe("recall-vanilla") == "recall"
    assert plan.dimpo_capture("recall-vanilla") == plan.dimpo["capture"] | {"seq_len": 64}
    # KV compression only where there is generation to compress: the recall probe, not perplexity
    text = plan.projected("tiny-vanilla")
    assert {p.kv for p in text} == {"none"} and {p.num_projected for p in text} == {0, 2, 4}
    recall = plan.projected("recall-vanilla")
    assert {p.num_projected for p in recall} == {0, 1, 2} and {p.kv for p in recall} == {"none", "kivi2"}
    assert {"downstream", "long_context", "kv"} <= set(plan.dimpo_studies)
    assert plan.study_models("quirks") == ["tiny-vanilla"]
    assert plan.study_models("table1") == ["tiny-vanilla", "recall-vanilla"]
    # Table 1's grid of a model: its own objectives and d' where it sets them
    plan = plan_of(mutated(lambda c: (add_recall(c), c["dimpo"]["models"][1].update(objectives=["kl"], d_prime=[4]))))
    assert {(f.study, f.objective, f.d_prime) for f in plan.model_fits("recall-vanilla")} == {("table1", "kl", 4)}
    assert len(plan.model_fits("tiny-vanilla")) == len(plan.dimpo_fits)
    # text models alone: no long-context report
    assert "long_context" not in plan_of(mutated(lambda c: downstream(c))).dimpo_studies
    # a suite run: captured on its own examples, scored on the suite at each of its lengths
    plan = plan_of(mutated(lambda c: (with_long(c), downstream(c, num_projected=[2]), c["dimpo"]["models"].append(
        {"name": "long", "run": "long-vanilla", "capture": {"seq_len": 128}, "num_projected": [3, 6],
         "downstream_d_prime": [4]}))))
    assert plan.dimpo_probe("long") == "longctx" and plan.generative_probe("long")
    assert plan.longctx_targets("long-vanilla") == ["longctx", "longctx_x2"]
    assert {p.num_projected for p in plan.projected("long")} == {0, 3, 6} and "long_context" in plan.dimpo_studies
    # a model's own downstream d' (seed 003's d'/d = 1/2 at its head dimension) replaces the shared one
    plan = plan_of(mutated(lambda c: (add_recall(c), c["dimpo"]["models"][1].update(downstream_d_prime=[8, 16]))))
    assert {p.d_prime for p in plan.projected("recall-vanilla")} == {0, 8, 16}
    assert {p.d_prime for p in plan.projected("tiny-vanilla")} == {0, 4}


def test_a_dar_model_is_projected_without_kv_compression():
    def add_dar(c):
        downstream(c, objectives=["kl"], num_projected=[1, 2], kv=[{"name": "kivi2", "kivi": {"bits": 2}}])
        c["dimpo"]["models"] += [RECALL_MODEL, {"name": "recall-dar", "run": "recall-dar-w4-d8",
                                                "capture": {"seq_len": 64}}]

    plan = plan_of(mutated(add_dar))
    assert {p.kv for p in plan.projected("recall-vanilla")} == {"none", "kivi2"}
    # DAR keeps its latent cache (DimAttnCache): the projection composes, KV compression does not
    assert {p.kv for p in plan.projected("recall-dar")} == {"none"} and plan.dimpo_probe("recall-dar") == "recall"


def test_a_downstream_study_projects_each_of_its_settings():
    plan = plan_of(mutated(lambda c: downstream(c, studies=[{"study": "quirks", "num_projected": [4]}])))
    quirks = [p for p in plan.projected("tiny-vanilla") if p.study == "quirks"]
    settings = plan.dimpo["ablations"]["quirks"]["settings"]
    assert len(quirks) == len(settings) * len(TEXT["dimpo"]["seeds"]) and {p.num_projected for p in quirks} == {4}
    assert {p.setting for p in quirks} == {sweeps.setting_name(s) for s in settings}
    assert {p.kv for p in quirks} == {"none"} and all(p.objective == "dimpo" for p in quirks)
    main = [p for p in plan.projected("tiny-vanilla") if p.study == "table1" and p.objective != "base"]
    assert {p.setting for p in main} == {"default"}  # Table 1's first setting


def test_latency_is_measured_on_models_with_a_plain_kv_cache():
    def add(c):
        downstream(c, objectives=["kl", "dimpo"], num_projected=[1, 2])
        c["dimpo"]["latency"] = {"prompt": 64}
        c["dimpo"]["models"] += [RECALL_MODEL, {"name": "recall-dar", "run": "recall-dar-w4-d8",
                                                "capture": {"seq_len": 64}, "num_projected": [1, 2]}]
        c["dimpo"]["ablations"]["quirks"]["models"] = ["tiny-vanilla"]

    plan = plan_of(mutated(add))
    assert plan.latency_models == ["tiny-vanilla", "recall-vanilla"]  # DAR keeps its latent cache
    assert plan.latency == {"prompt": 64, "new": 32, "repeats": 3}  # with the defaults
    assert plan.latency_projection("tiny-vanilla") == ("dimpo", "default", 4, 0) and "latency" in plan.dimpo_studies
    assert plan_of(mutated(lambda c: downstream(c))).latency_models == []  # dimpo.latency null: not measured
