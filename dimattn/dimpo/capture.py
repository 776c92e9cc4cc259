"""DimPO's capture (seed 003, Section 3.3): run a frozen causal LM once and record post-RoPE
queries, keys and values of its attention layers, saved by dimattn.dimpo.capture_files.save_capture.

A DAR or uniform layer of our models (seed 000) also gives its far keys and values, those of the
bottlenecked states, and its window: query i reads key j near when 0 <= i - j < window, far
otherwise (dimattn.dimpo.capture_files.near_mask).

Its own module because it needs transformers (about 3 s to import), which the many fit jobs
(dimattn.dimpo.projections) do not.
"""

import math
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from dimattn.model.affine import read_metadata
from dimattn.model.hf import is_dimattn_directory, switch_attention
from dimattn.dimpo.fit_settings import resolve_settings
from dimattn.dimpo.capture_files import save_capture

CAPTURE_IMPLEMENTATION = "dimattn_capture"

# Filled by _capture_attention while capture_qkv runs: {layer: {"q": (N, H, T, d), "k": ..., "v": ...}},
# plus "k_far", "v_far" and the "window" (an int) on DAR and uniform layers. Each tensor is allocated
# whole (N sequences) when its layer first runs and every batch is copied into its rows at
# _capture_rows: lists of batches joined by torch.cat at the end held two copies at once (1.9x the
# capture, about 61 GiB for Llama-3.1-8B); this way the host holds one.
_capture_store: dict[int, dict[str, torch.Tensor | int]] | None = None
_capture_layers: set[int] | None = None
_capture_rows: tuple[int, int] = (0, 0)  # (first row of the batch, N)


def _capture_attention(module, query, key, value, attention_mask, *, far_key=None, far_value=None, window=None,
                       attend=None, **kwargs):
    """Record (q, k, v) of ``module.layer_idx``, and (k_far, v_far) and the window of a DAR or
    uniform layer, then attend exactly as the model would: ``sdpa``, or the layer's own kernels
    (``attend``, dimattn.model.modeling_dimattn.CausalSelfAttention._attention)."""
    layer = module.layer_idx
    if _capture_store is not None and (_capture_layers is None or layer in _capture_layers):
        q = query.detach().float()
        scaling = kwargs.get("scaling")
        if scaling is not None and abs(scaling * math.sqrt(q.shape[-1]) - 1.0) > 1e-6:
            # psi is defined with 1/sqrt(d); fold any other model scaling into the queries.
            q = q * (scaling * math.sqrt(q.shape[-1]))
        parts = {"q": q, "k": key, "v": value}
        if far_key is not None:
            parts |= {"k_far": far_key, "v_far": far_value}
        entry = _capture_store.setdefault(layer, {})
        start, n = _capture_rows
        for name, t in parts.items():
            if name not in entry:
                entry[name] = torch.empty((n, *t.shape[1:]), dtype=torch.float32)
            entry[name][start : start + len(t)].copy_(t.detach())  # to float32 on the host, in place
        if far_key is not None:
            entry["window"] = window
    if attend is not None:
        return attend(query, (key, value), (far_key, far_value)), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(CAPTURE_IMPLEMENTATION, _capture_attention)
# Models that build their masks through transformers build the same ones as for sdpa.
AttentionMaskInterface.register(CAPTURE_IMPLEMENTATION, sdpa_mask)


@torch.no_grad()
def capture_qkv(model, input_ids: torch.LongTensor, *, layers=None, batch_size: int | None = None):
    """Post-RoPE queries, keys and values of every (or the listed) attention layer.

    input_ids: (N, T), unpadded. Returns {layer: {"q": (N, H, T, d), "k": (N, H_kv, T, d),
    "v": (N, H_kv, T, d)}}, float32 on CPU; a DAR or uniform layer adds "k_far", "v_far" (shaped
    as k, v) and "window" (an int; 0 on a uniform layer). The model runs in eval mode without a
    KV cache, ``batch_size`` sequences at a time; its outputs are unchanged and its attention
    implementation and train/eval mode are restored afterwards.
    """
    global _capture_store, _capture_layers, _capture_rows
    previous, was_training = model.config._attn_implementation, model.training
    device = next(model.parameters()).device
    _capture_store, _capture_layers = {}, None if layers is None else set(layers)
    try:
        model.eval()
        switch_attention(model, CAPTURE_IMPLEMENTATION)
        start = 0
        for batch in input_ids.split(batch_size or len(input_ids)):
            _capture_rows = (start, len(input_ids))
            # logits of the last position only: the (T, vocab) logits were most of the capture's
            # peak (a 2-layer Llama, vocab 128,256, T 1,024, CPU: 663 -> 137 MiB over the weights)
            model(input_ids=batch.to(device), use_cache=False, logits_to_keep=1)
            start += len(batch)
        store = _capture_store
    finally:
        _capture_store, _capture_layers, _capture_rows = None, None, (0, 0)
        switch_attention(model, previous)
        model.train(was_training)
    missing = sorted(set(layers) - set(store)) if layers is not None else []
    if not store or missing:
        raise RuntimeError(
            f"no capture for layer(s) {missing or 'any'} of {type(model).__name__}: a layer index out of range, "
            f"or attention that does not call ALL_ATTENTION_FUNCTIONS[config._attn_implementation]"
        )
    return {layer: store[layer] for layer in sorted(store)}


def document_windows(tokenizer, texts, seq_len: int, n_sequences: int, add_special_tokens: bool = False):
    """(n_sequences, seq_len) token windows: the first seq_len tokens of each document, as in
    seed 003 section 3.3 (first 4096 tokens of each chapter long enough), then the next
    non-overlapping window of each document in turn if there are fewer documents than
    sequences. Documents shorter than seq_len are skipped. The authors tokenise without
    special tokens (``add_special_tokens=False``).
    """
    per_document = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        windows = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
        if windows:
            per_document.append(windows)
    rounds = max((len(w) for w in per_document), default=0)
    picked = [w[r] for r in range(rounds) for w in per_document if r < len(w)][:n_sequences]
    if len(picked) < n_sequences:
        raise ValueError(
            f"the documents hold only {len(picked)} windows of {seq_len} tokens, need {n_sequences}"
        )
    return torch.tensor(picked, dtype=torch.long)


def token_windows(tokens_bin, seq_len: int, n_sequences: int):
    """(n_sequences, seq_len) windows of a token corpus (dimattn.data.corpora), from its start. A corpus of
    fixed-length examples (meta ``example_len``, the recall probe's) is cut at its examples, so
    seq_len must be that length."""
    from dimattn.data.corpora import DataError, load_tokens

    tokens, meta = load_tokens(tokens_bin)
    example_len = meta.get("example_len")
    if example_len is not None and seq_len != example_len:
        raise DataError(f"{tokens_bin} holds examples of {example_len} tokens; capture at seq_len {example_len}, "
                        f"not {seq_len}")
    if len(tokens) < seq_len * n_sequences:
        raise DataError(f"{tokens_bin} holds {len(tokens)} tokens, fewer than {n_sequences} windows of {seq_len}")
    return torch.from_numpy(tokens[: seq_len * n_sequences].astype("int64").reshape(n_sequences, seq_len))


def capture_to_file(source, documents, seq_len: int, n_sequences: int, out_path, model_name: str, *,
                    device: str, hparams=None) -> dict:
    """Load the frozen model and tokenizer at ``source`` (our run directory or a hub name),
    capture q/k/v on windows of the jsonl ``documents`` (or of a token corpus ``.bin``, see
    :func:`token_windows`) and save them; returns the metadata.

    ``hparams`` (the fit hparams, with ``preset``) give ``capture_dtype`` and ``special_tokens``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dimattn.data.corpora import read_documents

    settings = resolve_settings(None, hparams)
    # Remote code only for our own run directories; a hub model loads with transformers' own
    # classes (Llama, Qwen2, ...) and never runs code from the hub.
    ours = is_dimattn_directory(source)
    dtype = torch.float32 if settings.capture_dtype == "float32" else torch.bfloat16
    if Path(documents).suffix == ".bin":  # a token corpus of our own (the synthetic recall probe's)
        ids = token_windows(documents, seq_len, n_sequences)
    else:
        texts = (doc["text"] for doc in read_documents(documents))
        ids = document_windows(AutoTokenizer.from_pretrained(source), texts, seq_len, n_sequences,
                               settings.special_tokens)
    model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=ours, dtype=dtype).to(device).eval()
    capture = capture_qkv(model, ids, batch_size=1)  # one sequence a forward: the least memory, same outputs
    meta = {
        "model": model_name, "source": str(source), "documents": str(documents),
        "capture_dtype": settings.capture_dtype, "special_tokens": settings.special_tokens,
    }
    save_capture(capture, out_path, meta)
    return read_metadata(out_path)
