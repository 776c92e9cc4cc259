"""Capture, settings, instances, fitting and attention fidelity of the DimPO stage (dimattn.dimpo.projections)."""

import math
from dataclasses import fields

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from dimattn import DimAttnConfig, DimAttnForCausalLM
from dimattn.model.affine import Affine, load_projections, projected_logits, save_projections
from dimattn.dimpo.capture import capture_qkv
from dimattn.dimpo.objectives import OBJECTIVES, kl_loss, pca_projection, random_projection
from dimattn.dimpo.capture_files import load_capture, save_capture
from dimattn.dimpo.fidelity import attention_fidelity
from dimattn.dimpo.fit_settings import PRESETS, FitSettings, resolve_settings
from dimattn.dimpo.projections import (
    build_instances,
    build_pairs,
    fit_layer,
    fit_layers,
    fit_projections,
    initial_projection,
    objective_loss,
    pca_data,
)


def low_rank_capture(n=2, heads=4, kv_heads=2, seq_len=48, d=16, rank=4, seed=0):
    """Queries and keys living mostly in one rank-4 subspace of R^16; values full rank."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):  # float32, like a real capture, whatever the default dtype
        return torch.randn(*shape, generator=g, dtype=torch.float32)

    basis = torch.linalg.qr(randn(d, rank))[0]

    def vectors(h):
        return randn(n, h, seq_len, rank) @ basis.T * 2 + 0.1 * randn(n, h, seq_len, d)

    return {0: {"q": vectors(heads), "k": vectors(kv_heads), "v": randn(n, kv_heads, seq_len, d)}}


@pytest.fixture(scope="module")
def capture():
    return low_rank_capture()


# CPU-scale overrides of the paper settings: every position, a subset, short Adam runs.
FAST = dict(query_stride=1, n_instances=256, steps=60, batch_size=16, lr=1e-2)


def some_affine(d=16, d_prime=4, seed=3):
    g = torch.Generator().manual_seed(seed)
    return Affine(torch.randn(d_prime, d, generator=g) * 0.4, torch.randn(d_prime, generator=g))


def naive_fidelity(layer, proj, causal=False, scale="d_prime", mse_head_chunk=0):
    """The authors' KL and MSE with one loop iteration per (sequence, head, query position)."""
    q, k, v = layer["q"].double(), layer["k"].double(), layer["v"].double()
    W, b = proj.W.double(), proj.b.double()
    n, heads, seq_len, d = q.shape
    groups = heads // k.shape[1]
    first = mse_head_chunk * ((heads - 1) // mse_head_chunk) if mse_head_chunk else 0
    low = 1 / math.sqrt(W.shape[0] if scale == "d_prime" else d)
    kl = mse = 0.0
    for i in range(n):
        for h in range(heads):
            keys, values = k[i, h // groups], v[i, h // groups]
            for t in range(seq_len):
                width = t + 1 if causal else seq_len
                psi = torch.softmax(keys[:width] @ q[i, h, t] / math.sqrt(d), 0)
                pi = torch.softmax((keys[:width] @ W.T + b) @ (W @ q[i, h, t] + b) * low, 0)
                kl += float((psi * (psi.log() - (pi + 1e-9).log())).sum())
                if h >= first:
                    mse += float(((psi - pi) @ values[:width]).pow(2).sum())
    return kl / (n * heads * seq_len), mse / (n * (heads - first) * seq_len * d)


# ---- fidelity --------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [5, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale,mse_head_chunk", [("d_prime", 0), ("d", 3), ("d_prime", 4)])
def test_fidelity_matches_naive_loop(chunk_size, causal, scale, mse_head_chunk):
    layer = low_rank_capture(seq_len=11)[0]
    proj = some_affine()
    (row,) = attention_fidelity(
        {0: layer}, {0: proj}, causal=causal, scale=scale, mse_head_chunk=mse_head_chunk, chunk_size=chunk_size
    )
    kl, mse = naive_fidelity(layer, proj, causal, scale, mse_head_chunk)
    assert row["layer"] == 0
    assert row["kl"] == pytest.approx(kl, rel=1e-4)
    assert row["mse"] == pytest.approx(mse, rel=1e-4)


def naive_topk_recall(layer, proj, k, causal=False):
    """Of each (sequence, head, query)'s k keys of highest psi, the share among the k of highest
    pi, k at most the keys the query sees: one loop iteration each, sets compared as Python sets."""
    q, keys_all = layer["q"].double(), layer["k"].double()
    W, b = proj.W.double(), proj.b.double()
    n, heads, seq_len, d = q.shape
    groups = heads // keys_all.shape[1]
    total = 0.0
    for i in range(n):
        for h in range(heads):
            keys = keys_all[i, h // groups]
            for t in range(seq_len):
                width = t + 1 if causal else seq_len
                full = keys[:width] @ q[i, h, t]
                low = (keys[:width] @ W.T + b) @ (W @ q[i, h, t] + b)
                kk = min(k, width)
                top_full = set(torch.argsort(full, descending=True)[:kk].tolist())
                top_low = set(torch.argsort(low, descending=True)[:kk].tolist())
                total += len(top_full & top_low) / kk
    return total / (n * heads * seq_len)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("k", [1, 3, 11])
def test_topk_recall_matches_naive_loop(causal, k):
    """Causal queries before position k see fewer than k keys: only those count; k = all keys
    (11) recalls everything non-causally."""
    layer = low_rank_capture(seq_len=11)[0]
    proj = some_affine()
    (row,) = attention_fidelity({0: layer}, {0: proj}, causal=causal, chunk_size=4, top_k=k)
    assert row["topk_recall"] == pytest.approx(naive_topk_recall(layer, proj, k, causal), rel=1e-6)
    if k == 11 and not causal:
        assert row["topk_recall"] == pytest.approx(1.0)
    (identity,) = attention_fidelity({0: layer}, {0: torch.eye(16, dtype=torch.float32)}, causal=causal, top_k=k)
    assert identity["topk_recall"] == pytest.approx(1.0)
    assert "topk_recall" not in attention_fidelity({0: layer}, {0: proj})[0]  # asked for only


def test_identity_projection_is_lossless(capture):
    (row,) = attention_fidelity(capture, {0: torch.eye(16, dtype=torch.float32)})
    assert abs(row["kl"]) < 1e-5 and row["mse"] < 1e-10


def test_projected_logits_are_the_affine_attention_up_to_a_constant(capture):
    proj = some_affine()
    q, keys = capture[0]["q"][0, :3, 5], capture[0]["k"][0, :1, :20].expand(3, -1, -1)
    direct = torch.einsum("bd,bld->bl", proj(q), proj(keys)) / 2.0  # 1/sqrt(d'), d' = 4
    fast = projected_logits(proj, q, keys)
    assert torch.allclose(torch.softmax(fast, -1), torch.softmax(direct, -1), atol=1e-6)
    assert torch.allclose(fast - direct, (fast - direct)[:, :1].expand_as(fast), atol=1e-4)


# ---- settings ------------------------------------------------------------------------------------

OBJECTIVE_FIELDS = {"beta", "gamma", "k", "k_share", "lam", "kl_weight", "margin", "lr", "batch_size"}


def test_presets_pin_every_field_but_the_per_objective_ones():
    names = {f.name for f in fields(FitSettings)}
    for preset in PRESETS.values():
        assert set(preset) == names - OBJECTIVE_FIELDS
        FitSettings(**preset)  # valid choices
    differ = {n for n in PRESETS["ours"] if PRESETS["ours"][n] != PRESETS["authors"][n]}
    assert differ == {"preset", "pca_fit", "inference_scale", "shuffle", "mse_head_chunk"}
    assert PRESETS["authors"]["pca_fit"] == "last" and PRESETS["authors"]["inference_scale"] == "d"


def test_resolve_settings_precedence():
    st = resolve_settings("simpo", {"preset": "authors"})
    assert (st.preset, st.lr, st.batch_size, st.gamma, st.pca_fit, st.shuffle) == (
        "authors",
        1e-3,
        32,
        1.0,
        "last",
        False,
    )
    st = resolve_settings("dimpo", {"lr": 0.5, "k": 8, "per_objective": {"dimpo": {"k": 3}, "kl": {"k": 1}}})
    assert (st.preset, st.lr, st.k, st.lam, st.gamma, st.pca_fit) == ("ours", 0.5, 3, 1.0, 1e-4, "all")
    assert resolve_settings("dimpo_list").k == 0 and resolve_settings(None).k == 64
    assert resolve_settings("kl", st) is st
    with pytest.raises(ValueError, match="learning_rate"):
        resolve_settings("kl", {"learning_rate": 1.0})
    with pytest.raises(ValueError, match="preset"):
        resolve_settings("kl", {"preset": "mine"})
    with pytest.raises(ValueError, match="cosine"):
        resolve_settings("kl", {"per_objective": {"cosine": {}}})
    with pytest.raises(ValueError, match="init"):
        resolve_settings("kl", {"init": "xavier"})
    with pytest.raises(ValueError, match="causal"):
        resolve_settings("kl", {"num_sampled_keys": 4, "causal": True})


def test_a_study_setting_applies_last_and_may_switch_the_preset():
    """dimpo.ablations settings: over hparams and per_objective, their preset replacing the base one."""
    hparams = {"preset": "ours", "n_instances": 64, "per_objective": {"dimpo": {"lr": 1e-3, "max_preferred": 64}}}
    st = resolve_settings("dimpo", hparams | {"setting": {"preset": "authors", "max_preferred": None}})
    assert (st.preset, st.pca_fit, st.shuffle, st.inference_scale) == ("authors", "last", False, "d")
    assert (st.n_instances, st.lr, st.max_preferred) == (64, 1e-3, None)  # hparams kept, the setting last
    st = resolve_settings("dimpo", hparams | {"setting": {"k": 8, "lam": 2}})
    assert (st.preset, st.k, st.lam, st.max_preferred) == ("ours", 8, 2, 64)
    assert resolve_settings("dimpo", hparams | {"setting": {}}) == resolve_settings("dimpo", hparams)


def naive_top_k(share, n_keys):
    """The k in 1..n_keys nearest share x n_keys, a tie to the larger (round half up)."""
    target = share * n_keys
    return min(range(1, n_keys + 1), key=lambda j: (abs(j - target), -j))


@pytest.mark.parametrize("n_keys", [2, 3, 48, 64, 100, 256, 4096])
def test_k_share_resolves_to_the_nearest_k_of_the_key_list(n_keys):
    from dimattn.workflow.settings import resolve_top_k

    for share in (1 / 128, 1 / 64, 0.01, 1 / 32, 0.1, 0.25, 0.5, 0.7, 0.99):
        assert resolve_top_k(64, share, n_keys) == naive_top_k(share, n_keys), share
    assert resolve_top_k(64, 1 / 64, 4096) == 64  # the paper's k
    assert resolve_top_k(7, None, n_keys) == 7


def test_k_share_follows_the_merge_order_and_a_later_k_clears_it():
    st = resolve_settings("dimpo")  # the objective's default: the paper's share
    assert (st.k_share, st.lam) == (1 / 64, 1.0)
    assert resolve_settings("dimpo", {"setting": {"k": 0, "lam": 0}}).k_share is None  # Table 6's k = 0 row
    st = resolve_settings("dimpo", {"k": 8, "per_objective": {"dimpo": {"k_share": 0.25}}})
    assert (st.k, st.k_share) == (8, 0.25)  # the share, later, is what the fit resolves
    assert resolve_settings("dimpo_list").k_share is None
    with pytest.raises(ValueError, match="k_share"):
        resolve_settings("dimpo", {"k_share": 1.0})


def test_a_head_term_over_every_key_is_refused_at_its_boundary(capture):
    from dimattn.dimpo.fit_settings import with_top_k

    n_keys = capture[0]["k"].shape[2]  # 48
    fast = {**FAST, "steps": 2}
    with pytest.raises(ValueError, match=r"k=48 reaches the 48 keys"):
        fit_layer(capture[0], "dimpo", 4, fast | {"k": n_keys}, progress=False)
    fit_layer(capture[0], "dimpo", 4, fast | {"k": n_keys - 1}, progress=False)
    with pytest.raises(ValueError, match=r"k_share=0\.99 \(k=48\)"):
        fit_layer(capture[0], "dimpo", 4, fast | {"k_share": 0.99}, progress=False)
    assert with_top_k(resolve_settings("dimpo", {"k": 48, "lam": 0}), 48).k == 48  # no head term: allowed
    assert with_top_k(resolve_settings("dimpo"), 48).k == 1
    with pytest.raises(ValueError, match="8 keys"):  # Appendix B's sampled keys are the list
        fit_layer(capture[0], "dimpo", 4, fast | {"k": 8, "num_sampled_keys": 8}, progress=False)
    fit_layer(capture[0], "kl", 4, fast | {"k": n_keys}, progress=False)  # KL reads no k


def test_dimpo_differs_from_kl_once_k_is_a_share_of_the_list(capture):
    """With k = every key, DimPO's head is -sum psi log p, KL plus a constant: the same gradient
    (the listwise term is ~1e-6 of it), so the two fit the same projection. The paper's share
    keeps the head on the top keys, and the fits part."""
    st = resolve_settings("kl", {"query_stride": 1})
    batch = build_instances(capture[0], st, torch.Generator().manual_seed(0)).batch(torch.arange(64))
    proj = Affine(some_affine().W.requires_grad_(), some_affine().b)

    def grad(objective, hparams=None):
        logits = projected_logits(proj, batch["query"], batch["keys"], 0.5)
        loss = OBJECTIVES[objective](logits, batch["psi"], batch["mask"], hparams=hparams)
        return torch.autograd.grad(loss, proj.W)[0].flatten()

    every = F.cosine_similarity(grad("dimpo", {"k": 48}), grad("kl"), dim=0)
    share = F.cosine_similarity(grad("dimpo", {"k": 1}), grad("kl"), dim=0)
    assert every > 0.999 and share < 0.99, (every, share)
    hp = {**FAST, "steps": 30}
    fits = {o: fit_layer(capture[0], o, 4, hp, seed=3, progress=False)[0] for o in ("kl", "dimpo")}
    same = fit_layer(capture[0], "dimpo", 4, hp | {"k": 47}, seed=3, progress=False)[0]
    gap = lambda a, b: float((a.W - b.W).norm() / b.W.norm())  # noqa: E731
    assert gap(fits["dimpo"], fits["kl"]) > 10 * gap(same, fits["kl"]), (
        gap(fits["dimpo"], fits["kl"]),
        gap(same, fits["kl"]),
    )


# ---- instances and pairs --------------------------------------------------------------------------


def test_instances_every_heads_th_position_in_order_with_all_keys(capture):
    layer = capture[0]
    inst = build_instances(layer, resolve_settings("dimpo"), torch.Generator().manual_seed(0))
    assert len(inst) == 2 * 4 * 12  # positions 0, 4, ..., 44 of 2 sequences and 4 heads
    triples = list(zip(inst.seq.tolist(), inst.head.tolist(), inst.pos.tolist()))
    assert triples == [(s, h, p) for s in range(2) for h in range(4) for p in range(0, 48, 4)]
    b = inst.batch(torch.arange(10, 30))
    for r, i in enumerate(range(10, 30)):
        s, h, p = triples[i]
        assert torch.equal(b["query"][r], layer["q"][s, h, p])
        assert torch.equal(b["keys"][r], layer["k"][s, h // 2])  # all 48 keys, future ones too
        assert b["mask"][r].all()
        want = torch.softmax(layer["k"][s, h // 2] @ layer["q"][s, h, p] / 4.0, 0)
        assert torch.allclose(b["psi"][r], want, atol=1e-6)


def test_causal_subset_instances(capture):
    layer = capture[0]
    st = resolve_settings("kl", {"causal": True, "query_stride": 1, "n_instances": 50})
    inst = build_instances(layer, st, torch.Generator().manual_seed(0))
    keys = list(zip(inst.seq.tolist(), inst.head.tolist(), inst.pos.tolist()))
    assert len(inst) == 50 and keys == sorted(keys)
    b = inst.batch()
    for r, (s, h, p) in enumerate(keys):
        assert b["mask"][r].sum() == p + 1
        want = torch.softmax(layer["k"][s, h // 2, : p + 1] @ layer["q"][s, h, p] / 4.0, 0)
        assert torch.allclose(b["psi"][r, : p + 1], want, atol=1e-6) and torch.all(b["psi"][r, p + 1 :] == 0)


def test_sampled_keys_are_shared_by_a_key_value_head(capture):
    layer = capture[0]
    inst = build_instances(layer, resolve_settings("dimpo", {"num_sampled_keys": 5}), torch.Generator().manual_seed(0))
    b = inst.batch()
    assert b["keys"].shape[1] == 5
    for r in range(len(inst)):
        s, kvh = int(inst.seq[r]), int(inst.head[r]) // 2
        assert torch.equal(b["positions"][r], inst.key_subset[s, kvh])
        assert torch.equal(b["keys"][r], layer["k"][s, kvh, inst.key_subset[s, kvh]])
        assert b["psi"][r].sum().item() == pytest.approx(1.0, abs=1e-6)


def test_extreme_pairs_are_argmax_and_argmin_of_raw_scores(capture):
    layer = capture[0]
    st = resolve_settings("simpo")
    inst = build_instances(layer, st, torch.Generator().manual_seed(0))
    pairs = build_pairs(inst, st, torch.Generator().manual_seed(0))
    assert len(pairs) == len(inst)
    q, k_w, k_l = pairs.vectors(inst, torch.arange(len(pairs)))
    for r in range(len(pairs)):
        s, h, p = int(inst.seq[r]), int(inst.head[r]), int(inst.pos[r])
        raw = layer["k"][s, h // 2] @ layer["q"][s, h, p]
        assert torch.equal(q[r], layer["q"][s, h, p])
        assert torch.equal(k_w[r], layer["k"][s, h // 2, raw.argmax()])
        assert torch.equal(k_l[r], layer["k"][s, h // 2, raw.argmin()])


@pytest.mark.parametrize(
    "hparams,per_instance",
    [({"pair_mode": "all", "num_sampled_keys": 4}, 6), ({"pair_mode": "halves", "num_pairs": 3}, 3),
     ({"pair_mode": "distance", "pair_distance": 8}, 1)],
)
def test_appendix_b_pair_modes_train(capture, hparams, per_instance):
    st = resolve_settings("orpo", {**hparams, "n_instances": 40})
    inst = build_instances(capture[0], st, torch.Generator().manual_seed(0))
    assert len(build_pairs(inst, st, torch.Generator().manual_seed(0))) == 40 * per_instance
    proj, history = fit_layer(capture[0], "orpo", 4, {**FAST, **hparams, "steps": 5}, progress=False)
    assert proj.W.shape == (4, 16) and len(history) == 5 and all(math.isfinite(x) for _, x in history)


# ---- fitting -------------------------------------------------------------------------------------------


def test_every_objective_fits_and_beats_random(capture):
    kl = {}
    for objective in OBJECTIVES:
        proj = fit_projections(capture, objective, 4, FAST, seed=0, progress=False)[0]
        assert proj.W.shape == (4, 16)
        assert (proj.b is None) == (objective == "random") and torch.isfinite(proj.W).all()
        (kl[objective],) = [row["kl"] for row in attention_fidelity(capture, {0: proj})]
    assert all(kl[o] < kl["random"] for o in kl if o != "random"), kl


@pytest.mark.parametrize("objective", ["kl", "dimpo", "dimpo_list", "dimpo_kl"])
@pytest.mark.parametrize("init", ["pca", "default"])
def test_fitting_reduces_own_loss(capture, objective, init):
    hp = {**FAST, "init": init, "steps": 40}
    proj, history = fit_layer(capture[0], objective, 4, hp, seed=1, progress=False)
    assert [step for step, _ in history] == list(range(40)) and all(math.isfinite(x) for _, x in history)
    st = resolve_settings(objective, hp)
    held_out = build_instances(capture[0], st, torch.Generator().manual_seed(99))
    start = initial_projection(capture[0], 4, st, torch.Generator().manual_seed(1))
    assert objective_loss(held_out, objective, proj, hp) < objective_loss(held_out, objective, start, hp)


def test_pca_pools_the_keys_a_layer_scores():
    """pca_data on a layer with far keys: a DAR layer (window > 0) scores near and far keys, so
    both are pooled; a uniform layer (window 0) scores far keys only, so its near ones are not."""
    g = torch.Generator().manual_seed(0)
    q, k, far = (torch.randn(2, 2, 6, 4, generator=g) for _ in range(3))
    settings = resolve_settings("pca", {"pca_fit": "all"})
    for window, scored in ((1, torch.cat([k, far], dim=2)), (0, far)):
        queries, keys = pca_data({"q": q, "k": k, "k_far": far, "window": window}, settings)
        torch.testing.assert_close(keys, scored)
        torch.testing.assert_close(queries, q[:, :, :: settings.query_stride or 2])


def test_fit_is_deterministic_and_closed_forms_follow_the_settings(capture):
    a, _ = fit_layer(capture[0], "dimpo", 4, {**FAST, "steps": 5}, seed=7, progress=False)
    b, _ = fit_layer(capture[0], "dimpo", 4, {**FAST, "steps": 5}, seed=7, progress=False)
    assert torch.equal(a.W, b.W) and torch.equal(a.b, b.b)
    rand, history = fit_layer(capture[0], "random", 4, seed=7)
    assert history == [] and rand.b is None
    layer = capture[0]
    pca, _ = fit_layer(layer, "pca", 4)  # ours: every sequence, queries every 4th position
    W, bias = pca_projection(layer["q"][:, :, ::4], layer["k"], 4)
    assert torch.allclose(pca.W, W) and torch.allclose(pca.b, bias)
    last, _ = fit_layer(layer, "pca", 4, {"preset": "authors"})  # the authors: the last sequence only
    W, bias = pca_projection(layer["q"][-1:, :, ::4], layer["k"][-1:], 4)
    assert torch.allclose(last.W, W) and torch.allclose(last.b, bias) and not torch.allclose(last.W, pca.W)


def test_default_init_is_nn_linear_law_and_bias_is_optional(capture):
    st = resolve_settings("kl")
    start = initial_projection(capture[0], 8, st, torch.Generator().manual_seed(0))
    assert start.W.shape == (8, 16) and start.b.shape == (8,)
    assert start.W.abs().max() <= 0.25 and start.b.abs().max() <= 0.25  # U(-1/sqrt(d), 1/sqrt(d)), d = 16
    proj, _ = fit_layer(capture[0], "kl", 4, {**FAST, "steps": 3, "bias": False}, progress=False)
    assert proj.b is None


def test_fit_rejects_unknown_names_and_list_pair_modes(capture):
    with pytest.raises(ValueError, match="cosine"):
        fit_layer(capture[0], "cosine", 4)
    with pytest.raises(ValueError, match="learning_rate"):
        fit_layer(capture[0], "kl", 4, {"learning_rate": 1.0})
    with pytest.raises(ValueError, match="num_sampled_keys"):
        fit_layer(capture[0], "dimpo", 4, {**FAST, "pair_mode": "halves"})
    # "all" is what a list objective does anyway: the same fit as the default "extreme".
    same = [fit_layer(capture[0], "dimpo_list", 4, {**FAST, "pair_mode": mode, "num_sampled_keys": 6}, seed=1,
                      progress=False) for mode in ("extreme", "all")]
    assert torch.equal(same[0][0].W, same[1][0].W)  # (projection, history)


def test_training_kl_is_the_fidelity_kl_at_those_queries(capture):
    # The training loss (psi floored at 1e-6) and the metric (log(pi + 1e-9)) differ only by
    # their guards, on all positions, non-causal.
    st = resolve_settings("kl", {"query_stride": 1})
    inst = build_instances(capture[0], st, torch.Generator().manual_seed(0))
    proj = some_affine()
    b = inst.batch()
    train_kl = kl_loss(projected_logits(proj, b["query"], b["keys"]), b["psi"], b["mask"]).item()
    assert train_kl == pytest.approx(attention_fidelity(capture, {0: proj})[0]["kl"], rel=1e-2)


def test_capture_and_projection_files_round_trip(capture, tmp_path):
    save_capture(capture, tmp_path / "c.safetensors", {"model": "synthetic"})
    loaded, meta = load_capture(tmp_path / "c.safetensors")
    assert meta == {
        "model": "synthetic",
        "head_dim": 16,
        "heads": 4,
        "kv_heads": 2,
        "seq_len": 48,
        "n_sequences": 2,
        "layers": [0],
    }
    assert all(torch.equal(loaded[0][x], capture[0][x]) for x in "qkv")
    with pytest.raises(ValueError, match="head_dim"):
        save_capture(capture, tmp_path / "bad.safetensors", {"head_dim": 8})

    projections = {0: some_affine(), 3: some_affine(seed=4)}
    save_projections(projections, tmp_path / "w.safetensors", {"objective": "kl", "settings": {"lr": 0.01}})
    back, meta = load_projections(tmp_path / "w.safetensors")
    assert list(back) == [0, 3] and all(torch.equal(projections[l].W, back[l].W) for l in back)
    assert all(torch.equal(projections[l].b, back[l].b) for l in back)
    assert meta["objective"] == "kl" and meta["d_prime"] == 4 and meta["bias"] and meta["settings"] == {"lr": 0.01}
    W, _ = random_projection(16, 4)
    save_projections({0: W}, tmp_path / "r.safetensors")
    back, meta = load_projections(tmp_path / "r.safetensors")
    assert back[0].b is None and not meta["bias"] and torch.equal(back[0].W, W)


# ---- capture from real models ---------------------------------------------------------------


def dimattn_model():
    torch.manual_seed(0)
    cfg = DimAttnConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        attention="vanilla",
        max_position_embeddings=64,
        initializer_range=0.2,
    )
    return DimAttnForCausalLM(cfg).eval(), lambda m, l: m.gpt_neox.layers[l].attention.dense


def hf_model(config_class, model_class):
    torch.manual_seed(0)
    cfg = config_class(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return model_class(cfg).eval(), lambda m, l: m.model.layers[l].self_attn.o_proj


@pytest.mark.parametrize(
    "build",
    [
        dimattn_model,
        lambda: hf_model(LlamaConfig, LlamaForCausalLM),
        lambda: hf_model(Qwen2Config, Qwen2ForCausalLM),
    ],
    ids=["dimattn", "llama", "qwen2"],
)
def test_capture_reproduces_model_attention(build):
    model, out_proj = build()
    ids = torch.randint(0, 100, (3, 17), generator=torch.Generator().manual_seed(0))
    layers = model.config.num_hidden_layers
    seen = {l: [] for l in range(layers)}  # attention outputs (B, T, H d): input of the output projection
    hooks = [
        out_proj(model, l).register_forward_pre_hook(lambda mod, a, l=l: seen[l].append(a[0].clone()))
        for l in range(layers)
    ]

    def collect():
        out = {l: torch.cat(parts) for l, parts in seen.items()}
        for parts in seen.values():
            parts.clear()
        return out

    with torch.no_grad():
        logits = model(ids).logits
        plain = collect()
        capture = capture_qkv(model, ids, batch_size=2)  # two forward passes: 2 + 1 sequences
        during = collect()
        after = model(ids).logits
    for h in hooks:
        h.remove()

    assert model.config._attn_implementation == "sdpa"  # restored
    assert torch.equal(after, logits)
    heads = model.config.num_attention_heads
    kv_heads = getattr(model.config, "num_key_value_heads", heads)
    assert sorted(capture) == list(range(layers))
    for l, layer in capture.items():
        q, k, v = layer["q"], layer["k"], layer["v"]
        d = q.shape[-1]
        assert q.shape == (3, heads, 17, d) and k.shape == v.shape == (3, kv_heads, 17, d)
        assert q.dtype == torch.float32
        assert torch.allclose(during[l], plain[l], atol=1e-6)  # capturing changes nothing
        # softmax(q k^T / sqrt d) with a causal mask, times v: the model's own attention output.
        k_rep, v_rep = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
        scores = (q @ k_rep.transpose(-1, -2) / math.sqrt(d)).masked_fill(
            torch.ones(17, 17, dtype=torch.bool).triu(1), float("-inf")
        )
        out = (torch.softmax(scores, -1) @ v_rep).transpose(1, 2).reshape(3, 17, heads * d)
        assert torch.allclose(out, plain[l].float(), atol=1e-5)
        assert torch.allclose(
            F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True),
            out.view(3, 17, heads, d).transpose(1, 2),
            atol=1e-5,
        )


def test_capture_selected_layers_and_fit_on_it():
    model, _ = dimattn_model()
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(1))
    capture = capture_qkv(model, ids, layers=[1])
    assert list(capture) == [1]
    W = fit_projections(capture, "kl", 4, {**FAST, "steps": 20, "n_instances": 128}, progress=False)
    ((row),) = attention_fidelity(capture, W)
    assert row["layer"] == 1 and math.isfinite(row["kl"]) and math.isfinite(row["mse"])


def test_file_steps_end_to_end(tmp_path):
    from dimattn.data.corpora import train_tokenizer, write_documents
    from dimattn.dimpo.capture import capture_to_file
    from dimattn.dimpo.projections import fidelity_to_file, fit_to_file

    words = "to be or not that is the question whether tis nobler in mind suffer".split()
    g = torch.Generator().manual_seed(0)
    docs = [
        {"id": f"d{i}", "text": " ".join(words[j] for j in torch.randint(0, len(words), (120,), generator=g))}
        for i in range(3)
    ]
    write_documents(docs, tmp_path / "docs.jsonl")
    tokenizer = train_tokenizer(tmp_path / "docs.jsonl", vocab_size=300, out_dir=tmp_path / "model")
    model, _ = dimattn_model()
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(tmp_path / "model")

    # 3 documents, 5 sequences: first windows of all three, then second windows.
    hparams = {"preset": "authors", "query_stride": 2, "steps": 10, "batch_size": 4, "seed": 3,
               "per_objective": {"kl": {"lr": 1e-2}}}
    meta = capture_to_file(
        tmp_path / "model",
        tmp_path / "docs.jsonl",
        seq_len=32,
        n_sequences=5,
        out_path=tmp_path / "capture.safetensors",
        model_name="tiny",
        device="cpu",
        hparams=hparams,
    )
    assert meta["n_sequences"] == 5 and meta["seq_len"] == 32 and meta["model"] == "tiny"
    assert meta["capture_dtype"] == "float32" and meta["special_tokens"] is False
    fit_to_file(tmp_path / "capture.safetensors", "kl", 4, hparams, tmp_path / "W.safetensors")
    projections, wmeta = load_projections(tmp_path / "W.safetensors")
    assert wmeta["seed"] == 3 and wmeta["preset"] == "authors" and wmeta["bias"]
    assert wmeta["settings"]["lr"] == 1e-2 and wmeta["settings"]["steps"] == 10 and len(wmeta["history"]["0"]) == 10
    assert projections[0].b.shape == (4,)
    rows = fidelity_to_file(
        tmp_path / "capture.safetensors", tmp_path / "W.safetensors", tmp_path / "f.csv", "tiny", "kl", 4,
        setting="k=4,lam=0.5",
    )
    text = (tmp_path / "f.csv").read_text().splitlines()
    assert (
        text[0]
        == "model,objective,setting,d_prime,head_dim,seed,layer,kl,mse,kl_inference,mse_inference,top_k,topk_recall"
    )
    assert len(text) == 3 and all(line.startswith('tiny,kl,"k=4,lam=0.5",4,8,3,') for line in text[1:])
    assert [r["top_k"] for r in rows] == [1, 1]  # 1/64 of the capture's keys, at least 1
    assert [r["layer"] for r in rows] == [0, 1] and rows[0]["head_dim"] == 8
    capture, _ = load_capture(tmp_path / "capture.safetensors")
    # Table 1's columns at the train scale (1/sqrt(d')), the inference columns at the authors'
    # inference scale (1/sqrt(d)): the preset's mismatch, measured.
    train = attention_fidelity(capture, projections, causal=False, scale="d_prime", mse_head_chunk=4)
    inference = attention_fidelity(capture, projections, causal=False, scale="d", mse_head_chunk=4)
    assert [r["kl"] for r in rows] == pytest.approx([r["kl"] for r in train])
    assert [r["mse"] for r in rows] == pytest.approx([r["mse"] for r in train])
    assert [r["kl_inference"] for r in rows] == pytest.approx([r["kl"] for r in inference])
    assert [r["mse_inference"] for r in rows] == pytest.approx([r["mse"] for r in inference])
    assert all(r["kl_inference"] != pytest.approx(r["kl"]) for r in rows)
    with pytest.raises(ValueError, match="windows"):
        capture_to_file(
            tmp_path / "model",
            tmp_path / "docs.jsonl",
            seq_len=32,
            n_sequences=500,
            out_path=tmp_path / "x.safetensors",
            model_name="tiny",
            device="cpu",
        )


def two_layer_capture():
    first, second = low_rank_capture(seed=0)[0], low_rank_capture(seed=5)[0]
    return {0: first, 1: second}


@pytest.mark.parametrize(
    "objective,hparams",
    [("kl", {}), ("dimpo", {}), ("dimpo", {"causal": True, "shuffle": False}), ("orpo", {}), ("triplet", {}),
     ("dimpo_list", {"num_sampled_keys": 6, "bias": False})],
)
def test_lockstep_fit_is_each_layer_fitted_alone(objective, hparams):
    """fit_layers steps two layers together (one loss pass, backward and Adam step); each layer's
    map and history are those of fit_layer on that layer alone with its seed. The causal case
    pads each step's lists to the longer layer's, which the mask hides."""
    capture = two_layer_capture()
    hp = {**FAST, "steps": 12, "batch_size": 4, **hparams}
    together = fit_layers(capture, objective, 4, hp, {0: 3, 1: 4}, progress=False)
    for layer, seed in ((0, 3), (1, 4)):
        alone, history = fit_layer(capture[layer], objective, 4, hp, seed=seed, progress=False)
        torch.testing.assert_close(together[layer][0].W, alone.W, rtol=1e-5, atol=1e-6)
        if alone.b is not None:
            torch.testing.assert_close(together[layer][0].b, alone.b, rtol=1e-5, atol=1e-6)
        assert [s for s, _ in together[layer][1]] == [s for s, _ in history]
        assert [x for _, x in together[layer][1]] == pytest.approx([x for _, x in history], rel=1e-5)
    assert not torch.allclose(together[0][0].W, together[1][0].W)


def test_lockstep_fit_skips_a_layers_non_finite_step_alone():
    """A step whose loss is not finite is skipped by that layer only (no gradient, no Adam step
    or state), as a fit of it alone skips it; the other layer's steps go on."""
    capture = two_layer_capture()
    broken = dict(capture[1])
    broken["q"] = capture[1]["q"].clone()
    broken["q"][0] = float("nan")  # every instance of sequence 0: about half the steps
    capture = {0: capture[0], 1: broken}
    hp = {**FAST, "steps": 10, "batch_size": 1, "n_instances": 64}
    together = fit_layers(capture, "kl", 4, hp, {0: 0, 1: 1}, progress=False)
    for layer, seed in ((0, 0), (1, 1)):
        alone, history = fit_layer(capture[layer], "kl", 4, hp, seed=seed, progress=False)
        torch.testing.assert_close(together[layer][0].W, alone.W, rtol=1e-5, atol=1e-6)
        assert [x for _, x in together[layer][1]] == pytest.approx([x for _, x in history], rel=1e-5, nan_ok=True)
    losses = [x for _, x in together[1][1]]
    assert any(math.isnan(x) for x in losses) and not all(math.isnan(x) for x in losses)
    assert torch.isfinite(together[1][0].W).all()


def test_fit_projections_groups_layers_within_the_lockstep_budget(monkeypatch):
    """fit_projections fits as many layers together as FIT_LOCKSTEP_BYTES holds: the same maps
    with every layer in one group as with one layer a group."""
    from dimattn.workflow import resources

    capture = two_layer_capture()
    hp = {**FAST, "steps": 8}
    grouped = fit_projections(capture, "dimpo", 4, hp, seed=2, progress=False)
    monkeypatch.setattr(resources, "FIT_LOCKSTEP_BYTES", 1)
    assert resources.fit_group(10**6, 2) == 1
    single = fit_projections(capture, "dimpo", 4, hp, seed=2, progress=False)
    for layer in capture:
        torch.testing.assert_close(grouped[layer].W, single[layer].W, rtol=1e-5, atol=1e-6)


def test_fit_benchmark_compares_lockstep_with_one_layer_at_a_time(tmp_path, capsys):
    """benchmarks/fit.py on a random capture: one line an objective, the two fits' maps the same
    and the budget restored afterwards."""
    import importlib.util
    import json
    from pathlib import Path

    from dimattn.workflow import resources

    spec = importlib.util.spec_from_file_location("bench_fit", Path(__file__).parents[2] / "benchmarks" / "fit.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    budget = resources.FIT_LOCKSTEP_BYTES
    bench.main(["--capture", str(tmp_path / "none.safetensors"), "--objectives", "kl", "orpo", "--steps", "4",
                "--layers", "2", "--sequences", "2", "--seq-len", "16", "--head-dim", "8", "--repeats", "1"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["name"] for r in lines] == [f"fit_{o}_lockstep_over_one_layer_at_a_time" for o in ("kl", "orpo")]
    for r in lines:
        assert r["capture"] == "random" and r["layers"] == 2 and r["group"] == 2 and r["ratio"] > 0
        assert r["max_abs_W_difference"] < 1e-5
    assert resources.FIT_LOCKSTEP_BYTES == budget


def test_fit_seeds_to_files_fits_each_seed_as_its_own_job_did_and_a_retry_refits_only_what_is_missing(
        capture, tmp_path, monkeypatch):
    """fit_projection's job fits every dimpo.seeds seed in one process: each seed's files are those
    fit_to_file and fidelity_to_file write for that seed alone. A seed kept from a failed attempt
    is copied, not refitted; one kept under other hparams or captures is refitted."""
    from dimattn.dimpo import projections as P

    save_capture(capture, tmp_path / "fit.safetensors", {"model": "synthetic"})
    save_capture(capture, tmp_path / "eval.safetensors", {"model": "synthetic"})
    hp = {**FAST, "steps": 8}
    seeds = [0, 5]
    outs = [tmp_path / "out" / f"s{s}.safetensors" for s in seeds]
    csvs = [tmp_path / "out" / f"s{s}.csv" for s in seeds]
    partial = tmp_path / "partial"
    args = (tmp_path / "fit.safetensors", tmp_path / "eval.safetensors", "kl", 4)

    P.fit_seeds_to_files(*args, hp, seeds, outs, csvs, partial, "synthetic", setting="default", device="cpu")
    assert not partial.exists()  # removed once every output is written
    for seed, out, csv_path in zip(seeds, outs, csvs):
        P.fit_to_file(tmp_path / "fit.safetensors", "kl", 4, {**hp, "seed": seed}, tmp_path / "alone.safetensors")
        alone, meta = load_projections(tmp_path / "alone.safetensors")
        bundled, bmeta = load_projections(out)
        assert bmeta["seed"] == meta["seed"] == seed
        assert torch.equal(bundled[0].W, alone[0].W) and torch.equal(bundled[0].b, alone[0].b)
        P.fidelity_to_file(tmp_path / "eval.safetensors", tmp_path / "alone.safetensors", tmp_path / "alone.csv",
                           "synthetic", "kl", 4)
        assert csv_path.read_text() == (tmp_path / "alone.csv").read_text()
    assert load_projections(outs[0])[0][0].W.ne(load_projections(outs[1])[0][0].W).any()  # seeds differ

    # A retry after a failure at seed 5: seed 0 is kept, and only seed 5 is fitted.
    fitted, fail = [], {5}
    real_fit = P.fit_to_file

    def counting_fit(capture_path, objective, d_prime, hparams, out_path, device="cpu"):
        fitted.append(hparams["seed"])
        if hparams["seed"] in fail:
            raise RuntimeError("killed")
        return real_fit(capture_path, objective, d_prime, hparams, out_path, device=device)

    monkeypatch.setattr(P, "fit_to_file", counting_fit)
    first = outs[0].read_bytes()
    for attempt_hp in (hp, {**hp, "lr": 2e-2}):  # the second: other hparams, so seed 0 is refitted
        with pytest.raises(RuntimeError, match="killed"):
            P.fit_seeds_to_files(*args, attempt_hp, seeds, outs, csvs, partial, "synthetic", device="cpu")
        assert (partial / "s0" / "spec.json").is_file() and not (partial / "s5" / "spec.json").exists()
    assert fitted == [0, 5, 0, 5]
    fail.clear()
    for out in outs:
        out.unlink()  # Snakemake deletes a failed job's outputs
    P.fit_seeds_to_files(*args, hp, seeds, outs, csvs, partial, "synthetic", device="cpu")
    assert fitted == [0, 5, 0, 5, 0, 5]  # seed 0 kept under lr 2e-2 is not taken for lr 1e-2
    assert outs[0].read_bytes() == first and not partial.exists()
    with pytest.raises(RuntimeError, match="killed"):
        fail.add(5)
        P.fit_seeds_to_files(*args, hp, seeds, outs, csvs, partial, "synthetic", device="cpu")
    fail.clear()
    P.fit_seeds_to_files(*args, hp, seeds, outs, csvs, partial, "synthetic", device="cpu")
    assert fitted[-3:] == [0, 5, 5]  # the retry fits seed 5 alone
    assert outs[0].read_bytes() == first
    with pytest.raises(ValueError, match="2 seeds for 1 projection"):
        P.fit_seeds_to_files(*args, hp, seeds, outs[:1], csvs, partial, "synthetic", device="cpu")
