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
    mem_mb   = (captured + P b) / 2^20 + overhead_mb  the capture streams into one preallocated copy (dimattn.capture)
    runtime  = margin * (2 P N T + 4 L N T^2 H h) / throughput / 60 + startup_min

fit_projection, one projection a layer of a model whose capture has L layers, H query heads and
H_kv key/value heads of head_dim h (d_v = h), N_fit and N_eval sequences of T tokens, at width d';
the fit reads the fit capture, then scores fidelity on the eval capture, a layer at a time
(dimattn.affine.LayerFile). A layer's fit takes S = E * ceil(I / B) optimizer steps (E
``dimpo.hparams.epochs``, B ``batch_size``, 1 by default as the authors') over I instances
(``n_instances``, or every query_stride-th query, stride H by default: N_fit * T), each against
its T keys, with a listwise term over P preferred keys (``max_preferred``, or all T) at most:

    layer    = max(N_fit, N_eval) * T * (H + 2 H_kv [+ 2 H_kv far]) * h * 4   one layer's q, k, v, fp32
    mem_mb   = 3 * layer / 2^20 + overhead_mb    (FIT_LAYER_COPIES) the layer, its gathered keys and the work (measured
                                                 2.3x a layer, tests/test_streamed_layers.py)
    FLOPs    = L * (E * I * (6 T (h d' + h + d') + 4 T P) + N_eval * H * T^2 * 2 (3 h + d'))
               fit: F(q) F(K)^T beside q K^T, forward and backward, and the pairs; fidelity: psi, pi, psi V - pi V
    runtime  = margin * (FLOPs / throughput + L * S * step_ms / 1000) / 60 + startup_min
               step_ms (``cluster.step_ms``): a step's fixed cost, which at batch 1 outweighs its FLOPs

A hub model's shape is read from its config.json in the local Hugging Face cache, which the
``prefetch`` rule fills on the login node; before that (a dry run on a fresh clone) the capture
asks its configured ``dimpo.resources``.

Checked against measured runs in tests/test_resources.py (the smoke runs' benchmark TSVs).
"""

import json
import math
import os

MIB = 2**20
FIT_LAYER_COPIES = 3  # a fit job's host memory, in layers of its capture (see fit_projection below)

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
    node_key = {"mem_mb": "node_mem_mb", "runtime": "node_runtime_min"}[resource]
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
    return dict(layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim, params=params)


def run_shape(model: dict, vocab_size: int) -> dict:
    """The capture shape of one of our runs (GPT-NeoX layout, H_kv = H)."""
    d, layers, heads = model["hidden_size"], model["num_hidden_layers"], model["num_attention_heads"]
    far = model.get("attention") in ("dar", "uniform")
    return dict(layers=layers, heads=heads, kv_heads=heads, head_dim=d // heads, far=far,
                params=gpt_neox_parameters(d, layers, vocab_size))  # fmt: skip


def capture(shape: dict | None, n_sequences: int, seq_len: int, capture_dtype: str, resources: dict,
            device: str, cluster: dict) -> dict:  # fmt: skip
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
        resources: dict, device: str, cluster: dict) -> dict:  # fmt: skip
    """First-attempt {mem_mb, runtime} of a fit_projection job (module docstring), an upper bound
    over the objectives (every hparams.per_objective entry); configured floors kept, and the
    configured values alone when the shape is unknown."""
    floor = {"mem_mb": resources["mem_mb"], "runtime": resources["runtime"]}
    if shape is None:
        return floor
    layers, heads, kv, h = (shape[k] for k in ("layers", "heads", "kv_heads", "head_dim"))
    kv_parts = 4 * kv if shape.get("far") else 2 * kv
    layer = max(n_fit, n_eval) * seq_len * (heads + kv_parts) * h * 4
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
        seconds = max(seconds, compute + layers * steps * cluster["step_ms"][device] / 1000)
    return {
        "mem_mb": max(floor["mem_mb"], math.ceil(FIT_LAYER_COPIES * layer / MIB + cluster["overhead_mb"][device])),
        "runtime": max(floor["runtime"], math.ceil(cluster["margin"] * seconds / 60 + cluster["startup_min"])),
    }


def _vocab(config: dict) -> int:
    """Our tokenizer's size; a hub tokenizer's is not known at planning: the schema's largest
    vocabulary, 65,536, an upper bound (Pythia's is 50,277)."""
    tokenizer = config["tokenizer"]
    return tokenizer["vocab_size"] if tokenizer.get("hub") is None else 65536


def first_attempts(plan) -> dict:
    """{"pretrain": {run: {mem_mb, runtime}}, "capture": {model: {mem_mb, runtime}}, "fit":
    {model: function of d' -> {mem_mb, runtime}}} of a dimattn.sweeps plan, every one checked
    against the node (ResourceError naming the key; a fit at its widest, d' = head_dim)."""
    config, cluster = plan.config, plan.config["cluster"]
    device, vocab = config["device"], _vocab(config)
    out = {"pretrain": {}, "capture": {}, "fit": {}}
    for name, run in plan.runs.items():
        asks = pretrain(run.model, run.training, run.resources, vocab, device, cluster)
        for resource, value in asks.items():
            check_node(f"pretraining.scales.{run.scale}.resources.{resource}", resource, value, cluster)
        out["pretrain"][name] = asks
    capture_dtype = plan.dimpo["hparams"].get("capture_dtype", "float32")
    for model, spec in plan.dimpo_models.items():
        shape = run_shape(plan.runs[spec["run"]].model, vocab) if "run" in spec else hub_shape(spec["hub"])
        cfg = plan.dimpo_capture(model)
        n = max(cfg["fit_sequences"], cfg["eval_sequences"])
        asks = capture(shape, n, cfg["seq_len"], capture_dtype, plan.dimpo["resources"], device, cluster)
        for resource, value in asks.items():
            check_node(f"dimpo.resources.{resource} (the capture of {model})", resource, value, cluster)
        out["capture"][model] = asks

        def fit_asks(d_prime, shape=shape, cfg=cfg):
            return fit(shape, cfg["fit_sequences"], cfg["eval_sequences"], cfg["seq_len"], int(d_prime),
                       plan.dimpo["hparams"], plan.dimpo["resources"], device, cluster)  # fmt: skip

        widest = fit_asks(shape["head_dim"]) if shape else fit_asks(1)
        for resource, value in widest.items():
            check_node(f"dimpo.resources.{resource} (the fits of {model})", resource, value, cluster)
        out["fit"][model] = fit_asks
    for resource in ("mem_mb", "runtime"):  # the other DimPO jobs ask the configured values
        check_node(f"dimpo.resources.{resource}", resource, plan.dimpo["resources"][resource], cluster)
    return out
