"""Cross-references of a config, checked before any job starts (dimattn.workflow.sweeps.plan
calls check_references once the runs are expanded): every dataset, scale, run, objective, task,
length and width one section names must exist in another and fit it, each error naming its
config key. No torch; lm-eval's task registry is read from its task files, not imported.
"""

from __future__ import annotations

import functools
from pathlib import Path

from dimattn.workflow.schema import dimpo_presets
from dimattn.workflow.settings import key_list_length, resolve_top_k
from dimattn.workflow.vocabulary import (
    CAPTURE_FIELDS,
    HEAD_OBJECTIVES,
    LONGCTX_SOURCE,
    MAIN_STUDY,
    NO_KV,
    PROJECTABLE,
    RULER_MIN_LENGTH,
    RULER_TASKS,
    SUITE_SUBTASKS,
    ConfigError,
    setting_name,
)

# p: a dimattn.workflow.sweeps.Plan (annotations only: the plan imports these checks)

@functools.cache
def _lm_eval_task_files() -> dict[Path, str] | None:
    """lm-eval's task YAMLs, and the extensionless bases they include (cruxeval_common_yaml), read
    without importing lm-eval (planning stays light); None where lm-eval is not installed."""
    import importlib.util

    found = importlib.util.find_spec("lm_eval")
    if found is None or not found.submodule_search_locations:
        return None
    root = Path(next(iter(found.submodule_search_locations))) / "tasks"
    return {p.resolve(): p.read_text(errors="replace") for p in root.rglob("*")
            if p.is_file() and (p.suffix == ".yaml" or ("yaml" in p.name and not p.suffix))}


def lm_eval_task_names() -> frozenset[str] | None:
    """Every task, group and tag name lm-eval's task files define (what its TaskManager
    resolves); None where lm-eval is not installed."""
    import re

    files = _lm_eval_task_files()
    if files is None:
        return None
    return frozenset(name for text in files.values()
                     for name in re.findall(r"^(?:task|group|tag):\s*['\"]?([\w.-]+)", text, re.M))


def unsafe_lm_eval_tasks() -> frozenset[str]:
    """lm-eval's tasks whose YAML, or a file it includes, says ``unsafe_code: true`` (MBPP,
    HumanEval: they execute the model's code), read from lm-eval's task files without importing
    it (planning stays light); empty where lm-eval is not installed."""
    import re

    files = _lm_eval_task_files()
    if files is None:
        return frozenset()

    def unsafe(path, seen=()):
        text = files.get(path, "")
        if re.search(r"^unsafe_code:\s*true\b", text, re.M):
            return True
        included = ((path.parent / inc).resolve() for inc in re.findall(r"^include:\s*['\"]?([^'\"\s]+)", text, re.M))
        return any(unsafe(inc, (*seen, path)) for inc in included if inc not in seen)

    return frozenset(name for path, text in files.items() if "unsafe_code" in text or "include:" in text
                     for name in re.findall(r"^task:\s*['\"]?([\w.-]+)", text, re.M)
                     if name != "null" and unsafe(path))


def need_dataset(p, key: str, name: str) -> None:
    if name not in p.config["datasets"]:
        raise ConfigError(key, f"unknown dataset {name!r}; known: {sorted(p.config['datasets'])}")


def check_splits(p) -> None:
    """Every Hugging Face corpus's split ranges, as dimattn.data.corpora reads them (the schema's
    defaults filled: start 0, stop null for the end): complete, and no two overlapping."""
    from dimattn.workflow.splits import range_errors

    for name, spec in p.config["datasets"].items():
        if spec["source"] == "huggingface":
            for ours, message in range_errors(spec["splits"])[:1]:
                raise ConfigError(f"datasets.{name}.splits" + (f".{ours}" if ours else ""), message)


def check_scales(p) -> None:
    datasets = p.config["datasets"]
    for scale, spec in p.config["pretraining"]["scales"].items():
        key = f"pretraining.scales.{scale}"
        arch = spec["architecture"]
        if arch["hidden_size"] % arch["num_attention_heads"]:
            raise ConfigError(f"{key}.architecture.hidden_size",
                              f"{arch['hidden_size']} is not divisible by num_attention_heads="
                              f"{arch['num_attention_heads']}")
        if spec.get("dataset") is not None:
            need_dataset(p, f"{key}.dataset", spec["dataset"])
        dataset = p.scale_dataset(scale)
        if dataset in datasets and p.is_synthetic(dataset):
            example_len = datasets[dataset]["seq_len"]
            if spec["training"]["seq_len"] != example_len:
                raise ConfigError(f"{key}.training.seq_len",
                                  f"{spec['training']['seq_len']} must equal datasets.{dataset}.seq_len="
                                  f"{example_len}: windows are whole examples")


def check_references(p) -> None:
    """Every dataset, scale, run and objective one section names must exist in another, and
    the folder of the papers' numbers must exist (relative to the working directory)."""
    from dimattn.workflow.reference import missing

    reference = Path(p.config["reference_dir"])
    if not reference.is_dir():
        raise ConfigError("reference_dir", f"no folder {reference} in {Path.cwd()}: the papers' numbers live there")
    if missing(reference):
        raise ConfigError("reference_dir", f"{reference} lacks {', '.join(str(m) for m in missing(reference))}; "
                                            "restore it from the repository's reference/")
    tok = p.config["tokenizer"]
    if bool(tok.get("train_on")) == bool(tok.get("hub")):
        raise ConfigError("tokenizer", "set exactly one of tokenizer.train_on and tokenizer.hub")
    if tok.get("train_on"):
        need_dataset(p, "tokenizer.train_on", tok["train_on"])
    for name in p.perplexity_datasets:
        need_dataset(p, "evaluation.perplexity.datasets", name)
        if p.is_synthetic(name):
            raise ConfigError("evaluation.perplexity.datasets",
                              f"{name!r} is synthetic; the recall probe scores synthetic runs")
    scales = p.config["pretraining"]["scales"]
    for scale in p.lm_eval["scales"] or []:
        if scale not in scales:
            raise ConfigError("evaluation.lm_eval.scales", f"unknown scale {scale!r}; known: {sorted(scales)}")
    _check_unsafe_tasks(p)
    if p.lm_eval["write_tasks_from"]:
        need_dataset(p, "evaluation.lm_eval.write_tasks_from", p.lm_eval["write_tasks_from"])
        if p.is_synthetic(p.lm_eval["write_tasks_from"]):
            raise ConfigError("evaluation.lm_eval.write_tasks_from",
                              f"{p.lm_eval['write_tasks_from']!r} is synthetic: it has no text to make tasks of")
    _check_longctx(p)
    if not p.dimpo_enabled:
        return
    for key in ("dataset", "objectives", "d_prime"):
        if not p.dimpo.get(key):
            raise ConfigError(f"dimpo.{key}", "required when dimpo.models names a model")
    need_dataset(p, "dimpo.dataset", p.dimpo["dataset"])
    for i, spec in enumerate(p.dimpo["models"]):
        if "run" not in spec:
            deep = [l for l in p.num_projected(spec["name"]) if spec.get("num_hidden_layers", l) < l]
            if deep and p.downstream["objectives"]:
                where = (
                    f"dimpo.models[{i}].num_projected" if "num_projected" in spec else "dimpo.downstream.num_projected"
                )
                raise ConfigError(where, f"l={deep[0]} exceeds the {spec['num_hidden_layers']} layers of "
                                         f"{spec['hub']!r} (dimpo.models[{i}].num_hidden_layers)")
            continue
        if "num_hidden_layers" in spec:
            raise ConfigError(f"dimpo.models[{i}].num_hidden_layers",
                              f"run {spec['run']!r} has its own layers (its scale's architecture)")
        key = f"dimpo.models[{i}].run"
        if spec["run"] not in p.runs:
            raise ConfigError(key, f"unknown run {spec['run']!r}; known: {sorted(p.runs)}")
        run = p.runs[spec["run"]]
        if run.model["attention"] not in PROJECTABLE:
            raise ConfigError(key, f"DimPO projects a frozen {', '.join(PROJECTABLE)} model, not "
                                   f"{run.model['attention']!r}")
        head_dim = run.model["hidden_size"] // run.model["num_attention_heads"]
        depth = [l for l in p.num_projected(spec["name"]) if l > run.model["num_hidden_layers"]]
        if depth and p.downstream["objectives"]:
            where = f"dimpo.models[{i}].num_projected" if "num_projected" in spec else "dimpo.downstream.num_projected"
            raise ConfigError(
                where, f"l={depth[0]} exceeds the {run.model['num_hidden_layers']} layers of run {spec['run']!r}"
            )
        if run.synthetic:  # the recall corpus or the long-context suite: captured on its own examples
            _check_recall_capture(p, i, spec, run)
        elif p.dimpo_capture(spec["name"])["seq_len"] > run.training["seq_len"]:
            # our model's positions stop at its training length (max_position_embeddings)
            raise ConfigError(f"dimpo.models[{i}].capture.seq_len" if "seq_len" in spec.get("capture", {})
                              else "dimpo.capture.seq_len",
                              f"{p.dimpo_capture(spec['name'])['seq_len']} is beyond the "
                              f"{run.training['seq_len']}-token context of run {spec['run']!r}")
        own = f"dimpo.models[{i}].d_prime" if "d_prime" in spec else "dimpo.d_prime"
        widths = {own: p.grid(spec["name"], "d_prime")} | {
            f"dimpo.ablations.{study}.d_prime": a["d_prime"] for study, a in p.dimpo["ablations"].items()
            if spec["name"] in p.study_models(study)
        }
        for width_key, d_primes in widths.items():
            too_wide = [d for d in d_primes if d > head_dim]
            if too_wide:
                raise ConfigError(width_key,
                                  f"{too_wide[0]} exceeds the head dimension {head_dim} of run {spec['run']!r}")
    for study, spec in p.dimpo["ablations"].items():  # before the downstream studies read them
        stray = [m for m in spec.get("models", []) if m not in p.dimpo_models]
        if stray:
            raise ConfigError(f"dimpo.ablations.{study}.models", f"{stray[0]!r} is not in dimpo.models "
                                                                 f"({list(p.dimpo_models)})")
    _check_downstream(p)
    _check_top_k(p)
    studies = {"dimpo": p.dimpo} | {f"dimpo.ablations.{s}": a for s, a in p.dimpo["ablations"].items()}
    for prefix, spec in studies.items():
        seen = {}
        for i, overrides in enumerate(spec["settings"]):
            key = f"{prefix}.settings[{i}]"
            capture = [f for f in CAPTURE_FIELDS if f in overrides]
            if capture:
                raise ConfigError(key, f"{capture[0]} is a capture setting, shared by every fit of a model: "
                                       "set it in dimpo.hparams")
            name = setting_name(overrides)
            if name in seen:
                raise ConfigError(key, f"repeats settings[{seen[name]}] ({name})")
            seen[name] = i


# The suite's generator settings a model's vocabulary and layout depend on (dimattn.data.longctx.vocabulary:
# every subtask's task token is in it whatever the corpus asks): corpora scored together share them.
LONGCTX_VOCABULARY = ("n_keys", "n_values", "n_words", "needles", "question_first")


def _check_longctx(p) -> None:
    """evaluation.longctx.datasets are suite corpora; each is scored by every long-context run, so
    their vocabulary must be the runs' (the settings of LONGCTX_VOCABULARY alike). The generator's
    own refusals (dimattn.data.longctx.check_datasets) need numpy: rules/common.smk runs them after
    the plan, still before any job."""
    datasets = p.config["datasets"]
    for i, name in enumerate(p.config["evaluation"]["longctx"]["datasets"]):
        key = f"evaluation.longctx.datasets[{i}]"
        need_dataset(p, key, name)
        if not p.is_longctx(name):
            raise ConfigError(key, f"{name!r} is not a {LONGCTX_SOURCE} corpus")
        for run in p.longctx_runs:
            own = datasets[p.runs[run].dataset]
            differ = [f for f in LONGCTX_VOCABULARY if datasets[name].get(f) != own.get(f)]
            if differ:
                raise ConfigError(
                    f"datasets.{name}.{differ[0]}",
                    f"{datasets[name].get(differ[0])!r} differs from {p.runs[run].dataset!r}'s "
                    f"{own.get(differ[0])!r}, on which run {run!r} is trained: its vocabulary or layout differs",
                )
            # a subtask the run never saw asked of it: its task token was never trained
            unseen = [t for t in datasets[name].get("subtasks", SUITE_SUBTASKS)
                      if t not in own.get("subtasks", SUITE_SUBTASKS)]
            if unseen:
                raise ConfigError(f"datasets.{name}.subtasks",
                                  f"asks {unseen}, which run {run!r} never trains on ({p.runs[run].dataset!r} "
                                  f"holds {own.get('subtasks', SUITE_SUBTASKS)})")


def _check_top_k(p) -> None:
    """A DimPO fit whose head term keeps every key of its list (k >= keys: KL plus a constant) is
    refused, naming the k or k_share that made it so. The layers merge as
    dimattn.dimpo.fit_settings.resolve_settings merges them (hparams < per_objective < setting; a k
    given alone clears an earlier share); a fit the config gives no k keeps its objective's
    default (dimpo: the paper's share, 1/64; dimpo_list: k = 0). The list is the capture's
    sequence length, or Appendix B's sampled keys."""
    hp, presets = p.dimpo["hparams"], dimpo_presets()
    base = {name: value for name, value in hp.items() if name not in ("preset", "per_objective", "setting")}
    for model in p.dimpo_models:
        seq_len = p.dimpo_capture(model)["seq_len"]
        for fit in p.model_fits(model):
            if fit.objective not in HEAD_OBJECTIVES:
                continue
            main = fit.study == MAIN_STUDY
            prefix, study = (
                ("dimpo", p.dimpo) if main else (f"dimpo.ablations.{fit.study}", p.dimpo["ablations"][fit.study])
            )
            per = (hp.get("per_objective") or {}).get(fit.objective) or {}
            layers = [("dimpo.hparams", base), (f"dimpo.hparams.per_objective.{fit.objective}", per),
                      (f"{prefix}.settings[{fit.order}]", study["settings"][fit.order])]
            values, source = {}, None
            for key, layer in layers:
                if layer.get("k") is not None and layer.get("k_share") is not None:
                    raise ConfigError(
                        f"{key}.k_share", f"set k ({layer['k']}) or k_share ({layer['k_share']}), not both"
                    )
                for name in ("k", "k_share"):
                    if layer.get(name) is not None:
                        values |= {"k": None, "k_share": None, name: layer[name]}
                        source = f"{key}.{name}"
                values |= {name: layer[name] for name in ("lam", "num_sampled_keys") if name in layer}
            own = presets["defaults"] | presets["objectives"].get(fit.objective, {})
            if source is None or values.get("lam", own["lam"]) == 0:
                continue
            n_keys = key_list_length(seq_len, values.get("num_sampled_keys"))
            k = resolve_top_k(values["k"], values["k_share"], n_keys)
            if k >= n_keys:
                raise ConfigError(source, f"k={k} reaches the {n_keys} keys of {model!r}'s lists (capture seq_len "
                                          f"{seq_len}): DimPO's head term would keep every key, KL plus a constant; "
                                          "choose k < the keys, or k_share (the paper's 64 of 4,096: 0.015625)")


def _check_unsafe_tasks(p) -> None:
    """A task that runs the model's code needs evaluation.lm_eval.allow_unsafe_code; the
    projected models' scoring (dimpo.downstream.tasks) never opts in."""
    lm_tasks, ds_tasks = p.lm_eval["tasks"] if p.lm_eval_runs else [], p.downstream["tasks"] if p.dimpo_enabled else []
    # our task folder (dimattn.evaluation.lm_eval_tasks, read as files: planning imports no stage)
    own = {f.stem for f in (Path(__file__).parents[1] / "evaluation" / "lm_eval_tasks").glob("*.yaml")}  # never unsafe
    if all(t["name"] in own for t in [*lm_tasks, *ds_tasks]):
        return
    known = lm_eval_task_names()
    for key, tasks in (("evaluation.lm_eval.tasks", lm_tasks), ("dimpo.downstream.tasks", ds_tasks)):
        for i, task in enumerate(tasks):
            if known is not None and task["name"] not in own and task["name"] not in known:
                raise ConfigError(
                    f"{key}[{i}].name",
                    f"{task['name']!r} is neither a task of dimattn/evaluation/lm_eval_tasks ({sorted(own)}) "
                    "nor one lm-eval's task registry holds",
                )
    unsafe = unsafe_lm_eval_tasks()
    for i, task in enumerate(lm_tasks):
        if task["name"] in unsafe and not p.lm_eval["allow_unsafe_code"]:
            raise ConfigError("evaluation.lm_eval.allow_unsafe_code",
                              f"evaluation.lm_eval.tasks[{i}] {task['name']!r} executes the model's code (lm-eval "
                              "unsafe_code): set allow_unsafe_code: true to opt in, or drop the task")
    for i, task in enumerate(ds_tasks):
        if task["name"] in unsafe:
            raise ConfigError(f"dimpo.downstream.tasks[{i}].name",
                              f"{task['name']!r} executes the model's code (lm-eval unsafe_code); only "
                              "evaluation.lm_eval opts in to that (allow_unsafe_code)")


def _check_recall_capture(p, i: int, spec: dict, run) -> None:
    """A recall or suite run is captured on its own corpus: whole examples, as many as its splits hold."""
    # the schema fills the recall corpus' defaults (seq_len, n_validation, n_test)
    data, capture = p.config["datasets"][run.dataset], p.dimpo_capture(spec["name"])
    if capture["seq_len"] != data["seq_len"]:
        raise ConfigError(f"dimpo.models[{i}].capture.seq_len",
                          f"{capture['seq_len']} is not the example length {data['seq_len']} of {run.dataset!r}, "
                          f"which run {spec['run']!r} is captured on")
    for purpose, split in (("fit_sequences", p.capture_split("fit")), ("eval_sequences", "test")):
        if capture[purpose] > data[f"n_{split}"]:
            raise ConfigError(f"dimpo.models[{i}].capture.{purpose}",
                              f"{capture[purpose]} exceeds the {data[f'n_{split}']} {split} examples of "
                              f"{run.dataset!r}")


def _check_downstream(p) -> None:
    ds = p.downstream
    if not ds["objectives"]:
        return
    if not ds["d_prime"]:
        raise ConfigError("dimpo.downstream.d_prime", "required when dimpo.downstream.objectives names one")
    bare = [m for m, spec in p.dimpo_models.items() if "num_projected" not in spec and not p.num_projected(m)]
    if bare:
        raise ConfigError("dimpo.downstream.num_projected", f"required when dimpo.downstream.objectives names one "
                                                            f"and a model sets none ({bare[0]!r})")
    for key in ("objectives", "d_prime"):
        for i, model in enumerate(p.dimpo_models):
            if not p.num_projected(model):
                continue  # fitted only
            asked, culprit = ds[key], f"dimpo.downstream.{key}"
            if key == "d_prime" and "downstream_d_prime" in p.dimpo_models[model]:
                asked, culprit = p.downstream_d_prime(model), f"dimpo.models[{i}].downstream_d_prime"
            unknown = [v for v in asked if v not in p.grid(model, key)]
            if unknown:
                where = f"dimpo.models[{i}].{key}" if key in p.dimpo_models[model] else f"dimpo.{key}"
                raise ConfigError(
                    culprit, f"{unknown[0]!r} is not fitted for {model!r} ({where}: {p.grid(model, key)})"
                )
    ruler = [t["name"] for t in ds["tasks"] if t["name"] in RULER_TASKS]
    short = [n for n in ds["metadata"].get("max_seq_lengths", []) if n < RULER_MIN_LENGTH]
    if ruler and (short or not ds["metadata"].get("max_seq_lengths")):
        raise ConfigError("dimpo.downstream.metadata.max_seq_lengths",
                          f"RULER tasks ({ruler[0]}, ...) need lengths of at least {RULER_MIN_LENGTH}, got "
                          f"{ds['metadata'].get('max_seq_lengths')}: shorter, ruler_vt never ends")
    for i, task in enumerate(ds["tasks"]):
        stray = [d for d in task.get("d_prime", []) if d not in ds["d_prime"]]
        if stray:
            raise ConfigError(f"dimpo.downstream.tasks[{i}].d_prime",
                              f"{stray[0]} is not among dimpo.downstream.d_prime {ds['d_prime']}: no projected model "
                              "of that width is made")
    for i, entry in enumerate(ds["studies"]):
        key = f"dimpo.downstream.studies[{i}]"
        if entry["study"] == MAIN_STUDY:
            for model in entry.get("models", p.dimpo_models):
                for name, known in (("objectives", p.grid(model, "objectives")), ("d_prime", p.grid(model, "d_prime"))):
                    stray = [v for v in entry.get(name, []) if v not in known]
                    if stray:
                        raise ConfigError(f"{key}.{name}", f"{stray[0]!r} is not fitted for {model!r} ({known})")
        elif entry["study"] not in p.dimpo["ablations"]:
            raise ConfigError(f"{key}.study", f"{entry['study']!r} is not a study of dimpo.ablations "
                                              f"({sorted(p.dimpo['ablations'])}) nor {MAIN_STUDY}")
        else:
            extra = [k for k in ("objectives", "d_prime") if k in entry]
            if extra:
                raise ConfigError(f"{key}.{extra[0]}", f"only a {MAIN_STUDY} entry chooses its {extra[0]}; "
                                                       f"{entry['study']!r} projects its own")
        fitted = list(p.dimpo_models) if entry["study"] == MAIN_STUDY else p.study_models(entry["study"])
        for model in entry.get("models", fitted):
            if model not in fitted:
                raise ConfigError(f"{key}.models", f"{model!r} is not fitted in {entry['study']!r} ({fitted})")
            layers = p.dimpo_layers(model)
            deep = [l for l in entry["num_projected"] if layers is not None and l > layers]
            if deep:
                raise ConfigError(f"{key}.num_projected", f"l={deep[0]} exceeds the {layers} layers of {model!r}")
    names = [k["name"] for k in ds["kv"]]
    for i, spec in enumerate(ds["kv"]):
        key = f"dimpo.downstream.kv[{i}]"
        depths = {l for model in p.dimpo_models for l in p.num_projected(model)}
        widths = list(dict.fromkeys(d for model in p.dimpo_models for d in p.downstream_d_prime(model)))
        for name, known in (("objectives", ds["objectives"]), ("num_projected", depths), ("d_prime", widths)):
            stray = [v for v in spec.get(name, []) if v not in known]
            if stray:
                raise ConfigError(f"{key}.{name}", f"{stray[0]!r} is not among the downstream {name} "
                                                   f"({sorted(known) if name == 'num_projected' else known})")
        stray = [m for m in spec.get("models", []) if m not in p.dimpo_models]
        if stray:
            raise ConfigError(f"{key}.models", f"{stray[0]!r} is not in dimpo.models ({list(p.dimpo_models)})")
        if spec["name"] in names[:i] or spec["name"] == NO_KV:
            raise ConfigError(f"{key}.name", f"{spec['name']!r} is taken")
        if "snapkv" in spec:
            window = spec["snapkv"]["window"]
            if spec["snapkv"]["budget"] <= window:
                raise ConfigError(
                    f"{key}.snapkv.budget", f"{spec['snapkv']['budget']} must exceed the window, {window}"
                )
        if "kivi" in spec:
            group, residual = spec["kivi"]["group_size"], spec["kivi"]["residual"]
            if residual % group:
                raise ConfigError(f"{key}.kivi.residual", f"{residual} is not a multiple of group_size {group}")
