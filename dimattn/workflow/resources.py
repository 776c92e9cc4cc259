"""What every job gets: the memory and runtime it asks for, computed from its work (the one home
of the formulas; rules/common.smk hands them to Snakemake, the profiles only pick the executor),
and an offline environment unless it is a download rule (:func:`go_offline`, :func:`online`).

Attempts. Attempt ``a`` (1, then 2, 3 on the profile's retries) asks

    mem_mb(a)  = min(a * mem_mb(1),  cluster.node_mem_mb)
    runtime(a) = min(a * runtime(1), cluster.node_runtime_min)

so that a job killed for memory or for time gets more of both on its retry, and never more than
a node has. A first attempt already beyond the node is refused at planning, naming the config key
(:func:`check_node`).

First attempts. Where the work is known from the config, the estimate; the configured value
(``pretraining.scales.<s>.resources``, ``dimpo.resources``) is a floor: a site's minimum, or
what a job needs beyond what the formula counts. ``cluster.throughput_tflops[device]`` is the
sustained rate of one device (one GPU, or the job's CPU cores); ``cluster.margin`` multiplies
every compute estimate (data loading, evaluation passes, checkpoints, a slower node).

pretrain, P parameters, D = max_steps x batch_size x seq_len tokens, L layers, d width, T seq_len,
V vocabulary, n = nproc processes a node, N nodes:

    P       = 12 L d^2 + 2 V d                       GPT-NeoX: QKV and output 4 d^2, MLP 8 d^2; untied embeddings
    FLOPs   = 6 P D + 6 L T d D                      6PD (Kaplan et al. 2020) + causal attention (12 L T d, halved)
    runtime = margin * FLOPs / (throughput * n * N) / 60 + startup_min
    mem_mb  = n * (16 P + 34 m T d L) / 2^20 + n * overhead_mb     host memory a node
              16 P: fp32 weights, gradients, two AdamW moments (on cuda: the host copy a checkpoint takes);
              34 m T d L: activations of m = micro_batch_size sequences (Korthikanti et al. 2022), cpu only

capture_qkv, on N sequences of T tokens, L layers, H query and H_kv key/value heads of head_dim h,
P parameters at b bytes (4 for capture_dtype float32, else 2):

    captured = L * N * T * (H + 2 H_kv [+ 2 H_kv for a DAR model's far keys]) * h * 4   fp32 on the host
    mem_mb   = (captured + P b) / 2^20 + overhead_mb  the capture streams into one preallocated copy (dimattn.dimpo.capture)
    runtime  = margin * (2 P N T + 4 L N T^2 H h) / throughput / 60 + startup_min

fit_projection, one projection a layer of a model whose capture has L layers, H query heads and
H_kv key/value heads of head_dim h (d_v = h), N_fit and N_eval sequences of T tokens, at width d';
the fit reads the fit capture, then scores fidelity on the eval capture, a layer at a time
(dimattn.model.affine.LayerFile). A layer's fit takes S = E * ceil(I / B) optimizer steps (E
``dimpo.hparams.epochs``, B ``batch_size``, 1 by default as the authors') over I instances
(``n_instances``, or every query_stride-th query, stride H by default: N_fit * T), each against
its T keys, with a listwise term over P preferred keys (``max_preferred``, or all T) at most:

    layer    = max(N_fit, N_eval) * T * (H + 2 H_kv [+ 2 H_kv far]) * h * 4   one layer's q, k, v, fp32
    G        = min(L, max(1, FIT_LOCKSTEP_BYTES // layer))   layers fitted in lockstep (fit_group), one step
                                                 serving them all: every layer of a small capture, one of a large
    mem_mb   = 3 * G * layer / 2^20 + overhead_mb    (FIT_LAYER_COPIES) the layers, their gathered keys and the
                                                 work (measured 2.3x a layer, tests/e2e/test_streamed_layers.py)
    FLOPs    = L * (E * I * (6 T (h d' + h + d') + 4 T P) + N_eval * H * T^2 * 2 (3 h + d'))
               fit: F(q) F(K)^T beside q K^T, forward and backward, and the pairs; fidelity: psi, pi, psi V - pi V
    runtime  = margin * (FLOPs / throughput + ceil(L / G) * S * step_ms / 1000) / 60 + startup_min
               step_ms (``cluster.step_ms``): a step's fixed cost, which at batch 1 outweighs its FLOPs

score_text, perplexity, score_projected: a model of P parameters at b bytes (the task's dtype),
vocabulary V, scoring C perplexity tokens (``max_tokens`` a corpus) and lm-eval tasks. A task of
D documents (``limit`` at most), R requests a document (its choices; 1 for a generation),
c0 + shots * c1 context tokens a request and G tokens generated (TASK_WORK; RULER: each
``max_seq_lengths`` L, 500 samples, its tokens_to_generate), at batch B:

    FLOPs    = 2 P (C + sum D R (c0 + shots c1) + sum D G)        a forward per token
    steps    = sum D G / B                                         decoding steps, memory-bound
    runtime  = margin * (FLOPs / throughput + steps * (P b / memory_gbs + step_ms)) / 60 + startup_min
    mem_mb   = (P b + 2 b B c V) / 2^20 + overhead_mb              weights, and lm-eval's logits and
                                                                   log-softmax of a batch of its longest c

A hub model's shape is read from its config.json in the local Hugging Face cache, which the
``prefetch`` rule fills on the login node; before that (a dry run on a fresh clone) the capture
asks its configured ``dimpo.resources``.

Checked against measured runs in tests/e2e/test_resources.py (the smoke runs' benchmark TSVs).
"""

import json
import math
import os

from dimattn.workflow.schema import dimpo_presets
from dimattn.workflow.settings import downstream_tasks

MIB = 2**20
NODE_KEYS = {"mem_mb": "node_mem_mb", "runtime": "node_runtime_min"}
FIT_LAYER_COPIES = 3  # a fit job's host memory, in layers of its capture (see fit_projection below)
# A fit steps the layers of a capture together (one optimizer step for all, their batches in one
# pass) as long as their q, k, v stay under this: at batch 1 a step's fixed cost outweighs its
# FLOPs, on CPU and GPU alike. A paper-scale layer (Llama-3.1-8B: 2.5 GiB) goes alone.
FIT_LOCKSTEP_BYTES = 1 << 28


def fit_group(layer_bytes: int, layers: int) -> int:
    """Layers a fit steps in lockstep (dimattn.dimpo.projections.fit_projections): as many of the
    capture's ``layers`` as fit in FIT_LOCKSTEP_BYTES, at least one."""
    return max(1, min(layers, FIT_LOCKSTEP_BYTES // max(1, layer_bytes)))

# What makes huggingface_hub, datasets and transformers read their caches only.
# evaluate (lm-eval's MBPP loads its code_eval) has its own switch: without it, it asks
# HF_ENDPOINT before its module cache.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1"}
_USER_ENV = "DIMATTN_USER_HF_ENV"  # the user's own values of OFFLINE's keys, for the download rules


def go_offline(environ=os.environ) -> None:
    """Every job offline (rules/common.smk, at each parse of the workflow). The first parse, in
    the main process, keeps the user's own values under DIMATTN_USER_HF_ENV; cluster jobs inherit
    the environment (sbatch --export=ALL) and keep that record."""
    if _USER_ENV not in environ:
        environ[_USER_ENV] = json.dumps({key: environ.get(key) for key in OFFLINE})
    environ.update(OFFLINE)


def online(environ=os.environ) -> None:
    """For the download rules' scripts, before they import huggingface_hub, datasets or
    transformers (which read these at import): the user's own values back (absent: online; a
    user's or a test's HF_HUB_OFFLINE=1 stays)."""
    for key, value in json.loads(environ.get(_USER_ENV, "{}")).items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value


class ResourceError(ValueError):
    def __init__(self, key: str, message: str):
        super().__init__(f"config key {key}: {message}")
        self.key = key


def attempt_scaled(first: int, attempt: int, cap: int) -> int:
    """The ask of attempt ``attempt``: ``attempt`` times the first, at most ``cap``."""
    return int(min(first * attempt, cap))


def check_node(key: str, resource: str, first: int, cluster: dict) -> None:
    """Refuse a first attempt beyond the node (``cluster.node_mem_mb`` / ``node_runtime_min``)."""
    node_key = NODE_KEYS[resource]
    if first > cluster[node_key]:
        raise ResourceError(
            key,
            f"the first attempt asks {resource}={first}, more than cluster.{node_key}={cluster[node_key]} "
            f"(the node size): lower the work, or raise cluster.{node_key} if your nodes are larger",
        )


def _minutes(flops: float, devices: int, device: str, cluster: dict) -> int:
    seconds = cluster["margin"] * flops / (cluster["throughput_tflops"][device] * 1e12 * devices)
    return math.ceil(seconds / 60 + cluster["startup_min"])


def gpt_neox_parameters(hidden_size: int, num_hidden_layers: int, vocab_size: int) -> int:
    """12 L d^2 + 2 V d (biases and norms left out: under 0.1 %)."""
    return 12 * num_hidden_layers * hidden_size**2 + 2 * vocab_size * hidden_size


def pretrain(model: dict, training: dict, resources: dict, vocab_size: int, device: str, cluster: dict) -> dict:
    """First-attempt {mem_mb, runtime} of a pretraining run (module docstring); configured floors kept."""
    d, layers, t = model["hidden_size"], model["num_hidden_layers"], training["seq_len"]
    params = gpt_neox_parameters(d, layers, vocab_size)
    tokens = training["max_steps"] * training["batch_size"] * t
    flops = 6 * params * tokens + 6 * layers * t * d * tokens
    nproc, nodes = resources["nproc"], resources["nodes"]
    micro = training.get("micro_batch_size") or training["batch_size"]
    activations = 34 * micro * t * d * layers if device == "cpu" else 0
    mem = nproc * ((16 * params + activations) / MIB + cluster["overhead_mb"][device])
    return {
        "mem_mb": max(resources["mem_mb"], math.ceil(mem)),
        "runtime": max(resources["runtime"], _minutes(flops, nproc * nodes, device, cluster)),
    }


def hub_shape(repo: str, cache_dir=None) -> dict | None:
    """{layers, heads, kv_heads, head_dim, params} from the cached config.json of a hub model, or
    None when it is not in the local cache (never the network)."""
    from huggingface_hub import try_to_load_from_cache

    path = try_to_load_from_cache(repo, "config.json", cache_dir=cache_dir)
    if not isinstance(path, str):
        return None
    with open(path) as f:
        c = json.load(f)
    c = c.get("text_config", c)
    d, layers, heads = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
    kv_heads, head_dim = c.get("num_key_value_heads", heads), c.get("head_dim") or d // heads
    attention = d * (heads + 2 * kv_heads) * head_dim + heads * head_dim * d
    embeddings = c["vocab_size"] * d * (1 if c.get("tie_word_embeddings") else 2)
    params = layers * (attention + 3 * d * c["intermediate_size"]) + embeddings
    return dict(layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim, params=params,
                vocab=c["vocab_size"], context=c.get("max_position_embeddings") or 4096)


def run_shape(model: dict, vocab_size: int, seq_len: int) -> dict:
    """The shape of one of our runs (GPT-NeoX layout, H_kv = H), its context its training length."""
    d, layers, heads = model["hidden_size"], model["num_hidden_layers"], model["num_attention_heads"]
    far = model.get("attention") in ("dar", "uniform")
    return dict(layers=layers, heads=heads, kv_heads=heads, head_dim=d // heads, far=far,
                params=gpt_neox_parameters(d, layers, vocab_size), vocab=vocab_size, context=seq_len)


def capture(shape: dict | None, n_sequences: int, seq_len: int, capture_dtype: str, resources: dict,
            device: str, cluster: dict) -> dict:
    """First-attempt {mem_mb, runtime} of a capture (module docstring); configured floors kept, and
    the configured values alone when the shape is unknown."""
    floor = {"mem_mb": resources["mem_mb"], "runtime": resources["runtime"]}
    if shape is None:
        return floor
    layers, heads, kv, h, params = (shape[k] for k in ("layers", "heads", "kv_heads", "head_dim", "params"))
    kv_parts = 4 * kv if shape.get("far") else 2 * kv
    captured = layers * n_sequences * seq_len * (heads + kv_parts) * h * 4
    model_bytes = params * (4 if capture_dtype == "float32" else 2)
    flops = 2 * params * n_sequences * seq_len + 4 * layers * n_sequences * seq_len**2 * heads * h
    return {
        "mem_mb": max(floor["mem_mb"], math.ceil((captured + model_bytes) / MIB + cluster["overhead_mb"][device])),
        "runtime": max(floor["runtime"], _minutes(flops, 1, device, cluster)),
    }


def fit(shape: dict | None, n_fit: int, n_eval: int, seq_len: int, d_prime: int, hparams: dict,
        resources: dict, device: str, cluster: dict, seeds: int = 1) -> dict:
    """First-attempt {mem_mb, runtime} of a fit_projection job (module docstring), an upper bound
    over the objectives (every hparams.per_objective entry); configured floors kept, and the
    configured values alone when the shape is unknown. ``seeds``: the fit seeds the job fits one
    after the other (dimpo.seeds): the compute once for each, the start-up once."""
    floor = {"mem_mb": resources["mem_mb"], "runtime": resources["runtime"]}
    if shape is None:
        return floor
    layers, heads, kv, h = (shape[k] for k in ("layers", "heads", "kv_heads", "head_dim"))
    kv_parts = 4 * kv if shape.get("far") else 2 * kv
    layer = max(n_fit, n_eval) * seq_len * (heads + kv_parts) * h * 4
    group = fit_group(layer, layers)
    seconds = 0.0
    for hp in [hparams, *(hparams | o for o in (hparams.get("per_objective") or {}).values())]:
        stride = hp.get("query_stride") or heads
        instances = hp.get("n_instances") or n_fit * heads * math.ceil(seq_len / stride)
        epochs, batch = hp.get("epochs") or 1, hp.get("batch_size") or 1
        steps = hp.get("steps") or epochs * math.ceil(instances / batch)
        preferred = min(hp.get("max_preferred") or seq_len, seq_len)
        per_instance = 6 * seq_len * (h * d_prime + h + d_prime) + 4 * seq_len * preferred
        flops = layers * (epochs * instances * per_instance + n_eval * heads * seq_len**2 * 2 * (3 * h + d_prime))
        compute = flops / (cluster["throughput_tflops"][device] * 1e12)
        seconds = max(seconds, compute + math.ceil(layers / group) * steps * cluster["step_ms"][device] / 1000)
    return {
        "mem_mb": max(floor["mem_mb"],
                      math.ceil(FIT_LAYER_COPIES * group * layer / MIB + cluster["overhead_mb"][device])),
        "runtime": max(floor["runtime"], math.ceil(cluster["margin"] * seeds * seconds / 60 + cluster["startup_min"])),
    }


# lm-eval's work per task: (documents of the split it scores, requests a document, context
# tokens of a request at 0 shots, more per shot, tokens generated). Documents: the datasets'
# cards (HellaSwag validation 10,042; ARC-Challenge test 1,172; MMLU test 14,042; TruthfulQA
# validation 817; WinoGrande validation 1,267; CommonsenseQA validation 1,221; GSM8K test 1,319;
# MBPP test 500; LongBench Multi-News 200). Generated: the task YAML's max_gen_toks, else HFLM's
# 256. Context tokens: estimates for a Llama-3-class tokenizer (question and choice lengths;
# TruthfulQA's fixed six-question prompt; Multi-News' 2,113 words, LongBench's Table 1). A task
# not listed (ours, or one added to the config) counts as UNKNOWN_TASK, with the model's whole
# context: an upper bound for our own tasks' few hundred documents.
TASK_WORK = {
    "hellaswag": (10042, 4, 100, 100, 0),
    "arc_challenge": (1172, 4, 60, 60, 0),
    "mmlu": (14042, 4, 150, 150, 0),
    "truthfulqa_mc2": (817, 8, 350, 0, 0),
    "winogrande": (1267, 2, 35, 35, 0),
    "commonsense_qa": (1221, 5, 45, 45, 0),
    "gsm8k": (1319, 1, 90, 150, 256),
    "mbpp": (500, 1, 200, 200, 256),
    "longbench_multi_news": (200, 1, 2800, 0, 512),
    # ours (dimattn.evaluation.scoring.build_lm_eval_data): documents from evaluation.lm_eval (score)
    "dimattn_heldout": ("heldout_docs", 1, None, 0, 0),  # rolling log-likelihood of a whole document
    "dimattn_next_line": ("next_line_docs", 4, 100, 0, 0),  # 4 choices after a few lines of verse
}
UNKNOWN_TASK = (1000, 4, None, 0, 0)  # None: the model's context length
RULER_SAMPLES = 500  # lm-eval's RULER generators' num_samples, each length
# lm-eval's RULER tasks: tokens_to_generate (lm_eval/tasks/ruler/*.yaml max_gen_toks)
RULER_GENERATED = {"niah": 128, "ruler_vt": 30, "ruler_cwe": 120, "ruler_fwe": 50, "ruler_qa": 32}
# What a scoring job asks at least (a model's loading, a site's minimum); score_projected's floor
# is dimpo.resources.
SCORE_FLOORS = {"score_text": {"mem_mb": 8000, "runtime": 60}, "perplexity": {"mem_mb": 4000, "runtime": 30}}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}


def _task_work(task: dict, context: int, ruler_lengths: list[int], own_docs: dict | None = None
               ) -> list[tuple[int, int, int, int]]:
    """[(documents, requests, context tokens, generated tokens), ...] of one task entry; our own
    tasks' documents from ``own_docs`` (evaluation.lm_eval's heldout_docs, next_line_docs)."""
    name = task["name"]
    prefix = next((p for p in RULER_GENERATED if name.startswith(p)), None)
    if prefix is not None:
        return [(RULER_SAMPLES, 1, length, RULER_GENERATED[prefix]) for length in ruler_lengths]
    docs, requests, c0, c1, generated = TASK_WORK.get(name, UNKNOWN_TASK)
    if isinstance(docs, str):
        docs = (own_docs or {}).get(docs, UNKNOWN_TASK[0])
    tokens = context if c0 is None else min(context, c0 + (task.get("num_fewshot") or 0) * c1)
    return [(docs, requests, tokens, generated)]


def score(shape: dict | None, corpus_tokens: int, tasks: list[dict], batch_size: int, limit: int | None,
          ruler_lengths: list[int], floor: dict, device: str, cluster: dict, own_docs: dict | None = None
          ) -> dict:
    """First-attempt {mem_mb, runtime} of a scoring job (module docstring); ``floor`` kept, and
    alone when the shape is unknown. ``tasks``: lm-eval task entries (name, num_fewshot,
    batch_size, dtype)."""
    floor = {"mem_mb": floor["mem_mb"], "runtime": floor["runtime"]}
    if shape is None:
        return floor
    params, vocab, context = shape["params"], shape["vocab"], shape["context"]
    flops, seconds, logits = 2 * params * corpus_tokens, 0.0, 0
    for task in tasks:
        b = DTYPE_BYTES[task.get("dtype") or "float32"]
        batch = task.get("batch_size") or batch_size
        for docs, requests, tokens, generated in _task_work(task, context, ruler_lengths, own_docs):
            docs = min(docs, limit) if limit else docs
            flops += 2 * params * docs * (requests * tokens + generated)
            decode_s = params * b / (cluster["memory_gbs"][device] * 1e9) + cluster["step_ms"][device] / 1000
            seconds += math.ceil(docs * generated / batch) * decode_s
            logits = max(logits, 2 * b * batch * tokens * vocab)
    seconds += flops / (cluster["throughput_tflops"][device] * 1e12)
    weights = params * max([DTYPE_BYTES[t.get("dtype") or "float32"] for t in tasks] or [4])
    return {
        "mem_mb": max(floor["mem_mb"], math.ceil((weights + logits) / MIB + cluster["overhead_mb"][device])),
        "runtime": max(floor["runtime"], math.ceil(cluster["margin"] * seconds / 60 + cluster["startup_min"])),
    }


def _vocab(config: dict) -> int:
    """Our tokenizer's size; a hub tokenizer's is not known at planning: the schema's largest
    vocabulary, 65,536, an upper bound (Pythia's is 50,277)."""
    tokenizer = config["tokenizer"]
    return tokenizer["vocab_size"] if tokenizer.get("hub") is None else 65536


def first_attempts(plan) -> dict:
    """{"pretrain": {run: {mem_mb, runtime}}, "capture": {model: {mem_mb, runtime}}, "fit":
    {model: function of d' -> {mem_mb, runtime}}} of a dimattn.workflow.sweeps plan, every one checked
    against the node (ResourceError naming the key; a fit at its widest, d' = head_dim)."""
    config, cluster = plan.config, plan.config["cluster"]
    device, vocab = config["device"], _vocab(config)
    out = {"pretrain": {}, "capture": {}, "fit": {}}
    for name, run in plan.runs.items():
        asks = pretrain(run.model, run.training, run.resources, vocab, device, cluster)
        for resource, value in asks.items():
            check_node(f"pretraining.scales.{run.scale}.resources.{resource}", resource, value, cluster)
        out["pretrain"][name] = asks
    capture_dtype = plan.dimpo["hparams"].get("capture_dtype", dimpo_presets()["defaults"]["capture_dtype"])
    for model, spec in plan.dimpo_models.items():
        shape = run_shape(run.model, vocab, run.training["seq_len"]) if (run := plan.runs.get(spec.get("run"))) else \
            hub_shape(spec["hub"])
        cfg = plan.dimpo_capture(model)
        n = max(cfg["fit_sequences"], cfg["eval_sequences"])
        asks = capture(shape, n, cfg["seq_len"], capture_dtype, plan.dimpo["resources"], device, cluster)
        for resource, value in asks.items():
            check_node(f"dimpo.resources.{resource} (the capture of {model})", resource, value, cluster)
        out["capture"][model] = asks

        def fit_asks(d_prime, shape=shape, cfg=cfg):
            return fit(shape, cfg["fit_sequences"], cfg["eval_sequences"], cfg["seq_len"], int(d_prime),
                       plan.dimpo["hparams"], plan.dimpo["resources"], device, cluster,
                       seeds=len(plan.dimpo["seeds"]))

        widest = fit_asks(shape["head_dim"]) if shape else fit_asks(1)
        for resource, value in widest.items():
            check_node(f"dimpo.resources.{resource} (the fits of {model})", resource, value, cluster)
        out["fit"][model] = fit_asks
    for resource in ("mem_mb", "runtime"):  # the other DimPO jobs ask the configured values
        check_node(f"dimpo.resources.{resource}", resource, plan.dimpo["resources"][resource], cluster)
    out |= scoring(plan, vocab, device, cluster)
    return out


def _checked(key: str, asks: dict, cluster: dict) -> dict:
    for resource, value in asks.items():
        check_node(key, resource, value, cluster)
    return asks


def scoring(plan, vocab: int, device: str, cluster: dict) -> dict:
    """{"score_text" | "perplexity": {run: asks}, "score_projected": {model: function of d' ->
    asks}}: each scoring job's first attempt (:func:`score`; a projected model of width d' scores
    the tasks that list it, dimattn.workflow.settings.downstream_tasks), checked against the node."""
    config = plan.config
    ppl = config["evaluation"]["perplexity"]
    corpus = (ppl["max_tokens"] or 0) * len(plan.perplexity_datasets)  # null: all, unknown here
    lm, down = plan.lm_eval, plan.downstream
    own_docs = {key: lm[key] for key in ("heldout_docs", "next_line_docs")}
    out = {"score_text": {}, "perplexity": {}, "score_projected": {}}
    for floor in SCORE_FLOORS.values():  # a rule's own minimum: only the node can be too small
        for resource, value in floor.items():
            check_node(f"cluster.{NODE_KEYS[resource]}", resource, value, cluster)
    for name in plan.text_runs:
        run = plan.runs[name]
        shape = run_shape(run.model, vocab, run.training["seq_len"])
        rule = "score_text" if name in plan.lm_eval_runs else "perplexity"
        tasks = lm["tasks"] if rule == "score_text" else []
        asks = score(shape, corpus, tasks, lm["batch_size"], lm.get("limit"), [], SCORE_FLOORS[rule], device, cluster,
                     own_docs)
        out[rule][name] = _checked(f"evaluation.perplexity.max_tokens or evaluation.lm_eval.tasks ({rule} of {name})",
                                   asks, cluster)
    ruler = (down.get("metadata") or {}).get("max_seq_lengths") or [4096]
    for model, spec in plan.dimpo_models.items():
        run = plan.runs.get(spec.get("run"))
        shape = run_shape(run.model, vocab, run.training["seq_len"]) if run else hub_shape(spec["hub"])
        probe = plan.dimpo_probe(model)
        tokens = (down.get("max_tokens") or 0) * len(plan.perplexity_datasets) if probe == "text" else 0

        def asks(d_prime, shape=shape, tokens=tokens, probe=probe):
            tasks = [] if probe == "recall" else downstream_tasks(down["tasks"], int(d_prime))
            return score(shape, tokens, tasks, ppl["batch_size"], down.get("limit"), ruler, plan.dimpo["resources"],
                         device, cluster, own_docs)

        _checked(f"dimpo.downstream (the scoring of {model})", asks(0), cluster)  # the base model: every task
        out["score_projected"][model] = asks
    return out
