"""aotinfer.sampling: argument errors (CPU), then on the GPU the distributions drawn (chi-square
against the exact renormalized distribution over >= 100k draws and many seeds), the kept sets at
vocab 128k and on the multi-pass path, renorm / mask / softmax against float64 references,
determinism, the generator, CUDA graphs with seed/offset tensors, per-row parameters, indices and
edge cases."""

import math

import pytest
import torch

import aotinfer
from aotinfer import sampling

gpu = pytest.mark.gpu

# ---- argument errors (the bindings check before refusing CPU tensors) -------------------------------


def test_scalar_parameters_are_checked():
    probs = torch.rand(4, 10)
    for top_p in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"Expected top_p to be in \(0, 1\]"):
            aotinfer.top_p_sampling_from_probs(probs, top_p)
        with pytest.raises(ValueError, match=r"Expected top_p to be in \(0, 1\]"):
            aotinfer.top_p_renorm_probs(probs, top_p)
    for top_k in (0, -3):
        with pytest.raises(ValueError, match="Expected top_k to be at least 1"):
            aotinfer.top_k_sampling_from_probs(probs, top_k)
    with pytest.raises(TypeError, match="Expected top_k to be an integer, got float"):
        aotinfer.top_k_renorm_probs(probs, 2.5)
    with pytest.raises(ValueError, match=r"Expected min_p to be in \[0, 1\]"):
        aotinfer.min_p_sampling_from_probs(probs, 1.5)
    with pytest.raises(ValueError, match="Expected filter_apply_order to be 'top_k_first' or 'joint'"):
        aotinfer.top_k_top_p_sampling_from_probs(probs, 3, 0.5, filter_apply_order="both")
    with pytest.raises(ValueError, match="Expected temperature to be positive"):
        aotinfer.softmax(probs, 0.0)
    with pytest.raises(TypeError, match="Expected generator to be a torch.Generator, got str"):
        aotinfer.sampling_from_probs(probs, generator="cuda")
    with pytest.raises(TypeError, match="Expected seed to be an integer, got float"):
        aotinfer.sampling_from_probs(probs, seed=1.5, offset=0)
    with pytest.raises(TypeError, match="Expected check_nan to be a bool"):
        aotinfer.sampling_from_probs(probs, check_nan=1)
    with pytest.raises(TypeError, match="Expected return_valid to be a bool"):
        aotinfer.top_k_sampling_from_probs(probs, 3, return_valid=1)
    with pytest.raises(TypeError, match="Expected enable_pdl to be None, True or False"):
        aotinfer.softmax(probs, enable_pdl="no")


def test_tensors_are_checked_by_name():
    probs = torch.rand(4, 10)
    with pytest.raises(TypeError, match="Expected probs to have dtype float32, got float64"):
        aotinfer.sampling_from_probs(probs.double())
    with pytest.raises(ValueError, match="Expected probs to have 2 dimensions"):
        aotinfer.top_k_sampling_from_probs(probs[0], 3)
    with pytest.raises(TypeError, match="Expected indices to have dtype int32 or int64"):
        aotinfer.sampling_from_probs(probs, indices=torch.zeros(3))
    # Per-row parameters: FlashInfer's messages (its tests match them), the argument named first.
    with pytest.raises(ValueError, match="top_p: Sampling parameter tensor batch size mismatch: expected length 4"):
        aotinfer.top_p_sampling_from_probs(probs, torch.full((5,), 0.5))
    with pytest.raises(ValueError, match="top_k: Sampling parameter tensor batch size mismatch: expected length 2"):
        aotinfer.top_k_sampling_from_probs(probs, torch.full((4,), 3), indices=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"min_p: Expected a 1D tensor or scalar .* got a 2D tensor"):
        aotinfer.min_p_sampling_from_probs(probs, torch.full((4, 1), 0.5))
    with pytest.raises(ValueError, match=r"top_k: Expected a 1D tensor of shape \(batch_size,\) or scalar .* "
                                         r"got a 0-dimensional tensor"):
        aotinfer.top_k_renorm_probs(probs, torch.tensor(3))
    with pytest.raises(TypeError, match="Expected seed to have dtype int64 or uint64, got int32"):
        aotinfer.sampling_from_probs(probs, seed=torch.zeros(1, dtype=torch.int32), offset=0)
    with pytest.raises(ValueError, match=r"Expected offset to have shape \[1\] or \[4\]"):
        aotinfer.sampling_from_probs(probs, seed=0, offset=torch.zeros(3, dtype=torch.int64))
    none, no_state = torch.empty(0), torch.empty(0, dtype=torch.int64)
    for valid, error, message in ((torch.empty(4, dtype=torch.int32), TypeError, "Expected valid to have dtype bool"),
                                  (torch.empty(3, dtype=torch.bool), ValueError, r"Expected valid to have shape \[4\]")):
        with pytest.raises(error, match=message):  # the binding's own check of return_valid's tensor
            aotinfer.sampling._sample(torch.empty(4, dtype=torch.int32), valid, none, probs, none, none, none,
                                         none, no_state, no_state, "none", False, 0, 0.0, 0.0, 0, 0, -1)
    # From logits with a filter: the binding's checks of its filter and scratch rows.
    logits, out4, no_valid = torch.rand(4, 16), torch.empty(4, dtype=torch.int32), torch.empty(0, dtype=torch.bool)
    for scratch, filter, message in ((torch.empty(4, 16), "top_k_last", "Expected filter to be none, top_k, top_p, "
                                      "min_p, top_k_first or joint, got 'top_k_last'"),
                                     (torch.empty(3, 16), "joint", r"Expected scratch to have shape \[4, >= 16\]"),
                                     (torch.empty(4, 17)[:, 1:], "top_k_first", "Expected scratch rows to start 16-byte")):
        with pytest.raises(ValueError, match=message):
            aotinfer.sampling._sample(out4, no_valid, scratch, logits, none, none, none, none, no_state, no_state,
                                         filter, True, 5, 0.5, 0.0, 0, 0, -1)
    with pytest.raises(ValueError, match="Expected the last dimension of probs to be contiguous"):
        aotinfer.top_p_renorm_probs(probs.t(), 0.5)
    with pytest.raises(TypeError, match="Expected logits to have dtype float32, float16 or bfloat16"):
        aotinfer.top_k_mask_logits(probs.to(torch.int32), 3)
    with pytest.raises(ValueError, match="Expected probs to be a CUDA tensor, got a tensor on cpu"):
        aotinfer.top_k_top_p_sampling_from_probs(probs, 3, 0.5)
    with pytest.raises(TypeError, match="Expected probs to be a torch.Tensor, got list"):
        aotinfer.sampling_from_probs([[0.5, 0.5]], skip_check=True)


# ---- references -----------------------------------------------------------------------------------


def kept_mask(probs, top_k=None, top_p=None, min_p=None, order="top_k_first"):
    """The tokens each filter keeps, in float64 with a full sort (ties with the threshold kept)."""
    p = probs.double().clamp(min=0)
    rows = p.shape[0]

    def per_row(v, dtype):
        return torch.as_tensor(v, dtype=dtype, device=p.device).expand(rows)

    keep = p > 0
    if min_p is not None:
        keep &= p >= per_row(min_p, torch.float64)[:, None] * p.max(-1, keepdim=True).values
    if top_k is not None:
        k = per_row(top_k, torch.int64)
        values = p.sort(-1, descending=True).values
        kth = values.gather(-1, (k.clamp(1, p.shape[1]) - 1)[:, None])
        keep_k = (p >= kth) | ((k <= 0) | (k >= p.shape[1]))[:, None]
    else:
        keep_k = torch.ones_like(keep)
    if top_p is not None:
        base = torch.where(keep_k, p, 0.0) if order == "top_k_first" else p
        values = base.sort(-1, descending=True).values
        cumulative = values.cumsum(-1)
        target = per_row(top_p, torch.float64)[:, None] * cumulative[:, -1:]
        first = (cumulative < target).sum(-1, keepdim=True).clamp(max=p.shape[1] - 1)
        keep_p = base >= values.gather(-1, first)
        keep_p |= (per_row(top_p, torch.float64) >= 1)[:, None]
    else:
        keep_p = torch.ones_like(keep)
    return keep & keep_k & keep_p


def renormalized(probs, keep):
    p = torch.where(keep, probs.double().clamp(min=0), 0.0)
    return p / p.sum(-1, keepdim=True)


CHI2_Z = 3.719  # upper 1e-4 quantile of the standard normal: each test fails by chance once in 10^4


def assert_draws_match(samples, expected):
    """samples: token ids drawn from the distribution `expected` (float64 [vocab]); no token outside
    its support, and a chi-square test over the support (cells with expected count >= 5)."""
    vocab = expected.numel()
    counts = torch.bincount(samples.long().flatten(), minlength=vocab).double()
    assert counts.numel() == vocab, "a token id outside the vocabulary"
    outside = counts[expected == 0].sum().item()
    assert outside == 0, f"{outside} draws of filtered tokens: {torch.nonzero(counts * (expected == 0)).flatten().tolist()}"
    n = counts.sum()
    want = expected * n
    big = want >= 5
    cells = torch.cat([counts[big], counts[~big].sum().reshape(1)]), torch.cat([want[big], want[~big].sum().reshape(1)])
    observed, wanted = cells if cells[1][-1] >= 5 else (counts[big], want[big])
    chi2 = ((observed - wanted) ** 2 / wanted).sum().item()
    df = max(observed.numel() - 1, 1)
    limit = df * (1 - 2 / (9 * df) + CHI2_Z * math.sqrt(2 / (9 * df))) ** 3  # Wilson-Hilferty
    assert chi2 < limit, f"chi-square {chi2:.1f} over {df} degrees of freedom (limit {limit:.1f})"


def small_distribution(vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=g, dtype=torch.float64) * 1.5
    return torch.softmax(logits, 0).float()


DRAWS = 200_000  # per case, over SEEDS calls with generators seeded apart
SEEDS = 8


def draw_many(op, probs, *args, **kwargs):
    """DRAWS tokens from row 0 of probs: indices repeat it, each call with its own seed."""
    per_call = DRAWS // SEEDS
    indices = torch.zeros(per_call, dtype=torch.int32, device=probs.device)
    out = []
    for s in range(SEEDS):
        generator = torch.Generator(device=probs.device).manual_seed(1000 + s)
        out.append(op(probs, *args, indices=indices, generator=generator, **kwargs))
    return torch.cat(out)


# (name, op, args, filter for kept_mask, per-row tensor form)
FILTER_CASES = [
    ("none", aotinfer.sampling_from_probs, (), {}),
    ("top_k", aotinfer.top_k_sampling_from_probs, (10,), dict(top_k=10)),
    ("top_k=1", aotinfer.top_k_sampling_from_probs, (1,), dict(top_k=1)),
    ("top_p", aotinfer.top_p_sampling_from_probs, (0.7,), dict(top_p=0.7)),
    ("min_p", aotinfer.min_p_sampling_from_probs, (0.1,), dict(min_p=0.1)),
    ("top_k_first", lambda p, k, q, **kw: aotinfer.top_k_top_p_sampling_from_probs(p, k, q, filter_apply_order="top_k_first", **kw),
     (10, 0.7), dict(top_k=10, top_p=0.7, order="top_k_first")),
    ("joint", lambda p, k, q, **kw: aotinfer.top_k_top_p_sampling_from_probs(p, k, q, filter_apply_order="joint", **kw),
     (10, 0.7), dict(top_k=10, top_p=0.7, order="joint")),
    ("joint, k binds", lambda p, k, q, **kw: aotinfer.top_k_top_p_sampling_from_probs(p, k, q, filter_apply_order="joint", **kw),
     (4, 0.9), dict(top_k=4, top_p=0.9, order="joint")),
]


@gpu
@pytest.mark.parametrize("name, op, args, filters", FILTER_CASES, ids=[c[0] for c in FILTER_CASES])
@pytest.mark.parametrize("form", ["scalar", "tensor"])
def test_distribution_small_vocab(name, op, args, filters, form):
    probs = small_distribution().cuda()[None]
    if form == "tensor":
        per_call = DRAWS // SEEDS
        args = tuple(torch.full((per_call,), a, device="cuda", dtype=torch.int32 if isinstance(a, int) else torch.float32)
                     for a in args)
    samples = draw_many(op, probs, *args)
    expected = renormalized(probs, kept_mask(probs, **filters))[0]
    assert_draws_match(samples, expected)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("order", ["top_k_first", "joint"])
def test_distribution_from_logits(order, dtype):
    """Rows too short for the one-kernel path (and 16-bit logits): the binding's softmax first."""
    logits = (torch.log(small_distribution(seed=1)).cuda()[None] * 0.8 + 0.3).to(dtype)
    probs = torch.softmax(logits.double(), -1).float()
    assert_draws_match(draw_many(aotinfer.sampling_from_logits, logits), probs[0].double())
    samples = draw_many(lambda x, **kw: aotinfer.top_k_top_p_sampling_from_logits(x, 12, 0.8, filter_apply_order=order, **kw),
                        logits)
    assert_draws_match(samples, renormalized(probs, kept_mask(probs, top_k=12, top_p=0.8, order=order))[0])


@gpu
def test_top_k_top_p_from_logits_in_one_kernel():
    """Top-k first from float32 logits of 16384 or more runs in one kernel (the floor gathers the top
    logits). Its draws must follow the softmax's kept set, renormalized, on each of its paths: the
    floor (a peaked row), top-k keeping the whole row (k = vocab: the row's probabilities written
    in the kernel, then the probabilities' path), and a floor that gathers too many to hold (equal
    logits); a row with a NaN draws nothing, as the softmax's NaN row does."""
    vocab = 20000
    g = torch.Generator(device="cuda").manual_seed(11)
    logits = torch.randn(4, vocab, device="cuda", generator=g) * 3.0
    logits[2] = 0.25  # equal logits: every token kept by top-k (ties), top-p keeps them all too
    logits[3, 123] = float("nan")
    probs = torch.softmax(logits.double(), -1)
    per_call = DRAWS // SEEDS
    for row, k, top_p in ((0, 50, 0.9), (0, 7, 0.5), (1, vocab, 0.8), (2, 50, 0.9)):
        k_rows = torch.full((per_call,), k, device="cuda", dtype=torch.int32)
        p_rows = torch.full((per_call,), top_p, device="cuda")
        samples = draw_many(lambda x, **kw: aotinfer.top_k_top_p_sampling_from_logits(x, k_rows, p_rows, **kw),
                            logits[row:row + 1])
        expected = renormalized(probs[row:row + 1], kept_mask(probs[row:row + 1], top_k=k, top_p=top_p))[0]
        assert_draws_match(samples, expected)
    tokens, valid = aotinfer.top_k_top_p_sampling_from_logits(logits, 50, 0.9, seed=3, offset=0, return_valid=True)
    assert valid.tolist() == [True, True, True, False] and tokens[3].item() == 0
    tokens, valid = aotinfer.top_k_top_p_sampling_from_logits(logits, vocab, 0.9, seed=3, offset=0, return_valid=True)
    assert valid.tolist() == [True, True, True, False] and tokens[3].item() == 0


@gpu
@pytest.mark.parametrize("scale", [0.3, 2.0])
def test_top_p_and_min_p_distribution_over_their_paths(scale):
    """Top-p alone draws from the whole row and verifies the draw where top_p >= 0.25 (0.7, 0.95).
    Below, as where every draw misses, its histogram path draws from above its threshold's bin by
    picking a bin by mass, then an element of it: by rejection from random positions where the bin
    holds at least 1/64 of the row (every bin of the flat row, scale 0.3), by a race in the row's
    pass where it holds fewer (the peaked row's upper bins, scale 2.0); 0.1 and 0.2 take it, as a
    scalar and as a tensor (the draws' kernel). Min-p draws by rejection where its sample predicts
    many accepted proposals (the flat row of 20000, all of it kept) and races over the elements it
    gathered in its first pass where it does not (the peaked row: the draws' batch is too large for
    the L2, so it gathers). Each against the exact renormalized distribution."""
    g = torch.Generator().manual_seed(21)
    probs = torch.softmax(torch.randn(4096, generator=g, dtype=torch.float64) * scale, 0).float().cuda()[None]
    per_call = DRAWS // SEEDS
    for top_p in (0.7, 0.95, 0.1, 0.2, torch.full((per_call,), 0.2, device="cuda")):
        samples = draw_many(aotinfer.top_p_sampling_from_probs, probs, top_p)
        value = top_p if isinstance(top_p, float) else top_p[0].item()
        assert_draws_match(samples, renormalized(probs, kept_mask(probs, top_p=value))[0])
    probs = torch.softmax(torch.randn(20000, generator=g, dtype=torch.float64) * scale, 0).float().cuda()[None]
    samples = draw_many(aotinfer.min_p_sampling_from_probs, probs, 0.1)
    assert_draws_match(samples, renormalized(probs, kept_mask(probs, min_p=0.1))[0])


@gpu
@pytest.mark.parametrize("vocab", [1000, 70000])
def test_top_p_draws_that_miss(vocab):
    """Top-p's draws from the whole row land in its kept set with probability its mass: here 0.3
    (three tokens of 0.15, 0.1 and 0.05 above a flat rest, top_p 0.27), so all four miss in about a
    quarter of the calls, which the histogram path then draws. The mixture must be the kept set's
    distribution, and no token of the rest drawn."""
    probs = torch.full((vocab,), 0.7 / (vocab - 3), dtype=torch.float64)
    probs[[vocab // 3, 7, vocab - 1]] = torch.tensor([0.15, 0.1, 0.05], dtype=torch.float64)
    probs = probs.float().cuda()[None]
    samples = draw_many(aotinfer.top_p_sampling_from_probs, probs, 0.27)
    expected = renormalized(probs, kept_mask(probs, top_p=0.27))[0]
    assert (expected > 0).sum() == 3
    assert_draws_match(samples, expected)


def llm_like(rows, vocab, seed=0, scale=3.0):
    """Peaked rows like a language model's: softmax of scaled Gumbel-ish logits."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.softmax(torch.randn(rows, vocab, device="cuda", generator=g) * scale, -1)


@gpu
@pytest.mark.parametrize("vocab", [128256, 151936])
def test_filtered_tokens_never_drawn_large_vocab(vocab):
    probs = llm_like(8, vocab, scale=2.0)
    indices = torch.arange(8, device="cuda", dtype=torch.int64).repeat_interleave(4096)
    cases = [
        (lambda **kw: aotinfer.top_k_sampling_from_probs(probs, 50, **kw), dict(top_k=50)),
        (lambda **kw: aotinfer.top_p_sampling_from_probs(probs, 0.9, **kw), dict(top_p=0.9)),
        (lambda **kw: aotinfer.min_p_sampling_from_probs(probs, 0.05, **kw), dict(min_p=0.05)),
        (lambda **kw: aotinfer.top_k_top_p_sampling_from_probs(probs, 50, 0.9, **kw), dict(top_k=50, top_p=0.9)),
        (lambda **kw: aotinfer.top_k_top_p_sampling_from_probs(probs, 50, 0.9, filter_apply_order="joint", **kw),
         dict(top_k=50, top_p=0.9, order="joint")),
    ]
    for op, filters in cases:
        keep = kept_mask(probs, **filters)
        samples = op(indices=indices)
        assert samples.dtype == torch.int64
        assert keep[indices, samples].all(), f"{filters}: a filtered token was drawn"
        # the kept set is not trivially one token: several distinct draws per row
        assert len(torch.unique(samples[:4096])) > 1 or keep[0].sum() == 1


def flat_rows(vocab):
    """Rows on the multi-pass path: mass spread so evenly that the threshold's bin overflows."""
    g = torch.Generator(device="cuda").manual_seed(3)
    nearly_flat = 1 + 1e-3 * torch.rand(2, vocab, device="cuda", generator=g)
    exactly_flat = torch.ones(1, vocab, device="cuda")
    rows = torch.cat([nearly_flat, exactly_flat, torch.rand(1, vocab, device="cuda", generator=g)])
    return rows / rows.sum(-1, keepdim=True)


@gpu
def test_multi_pass_thresholds():
    probs = flat_rows(262144)
    for top_k in (50, 20000, 200000):
        keep = kept_mask(probs, top_k=top_k)
        torch.testing.assert_close(aotinfer.top_k_renorm_probs(probs, top_k), renormalized(probs, keep).float(),
                                   rtol=1e-5, atol=1e-9)
    for top_p in (0.3, 0.9):
        keep = kept_mask(probs, top_p=top_p)
        torch.testing.assert_close(aotinfer.top_p_renorm_probs(probs, top_p), renormalized(probs, keep).float(),
                                   rtol=1e-5, atol=1e-9)
    indices = torch.arange(4, device="cuda").repeat_interleave(512)
    for top_k, top_p, order in ((20000, 0.5, "top_k_first"), (20000, 0.5, "joint"), (100, 0.9, "top_k_first")):
        keep = kept_mask(probs, top_k=top_k, top_p=top_p, order=order)
        samples = aotinfer.top_k_top_p_sampling_from_probs(probs, top_k, top_p, indices=indices, filter_apply_order=order)
        assert keep[indices, samples.long()].all(), (top_k, top_p, order)


# ---- renorm, mask, softmax against float64 ---------------------------------------------------------


@gpu
@pytest.mark.parametrize("vocab", [50, 1001, 32000, 128256])
def test_renorm(vocab):
    probs = llm_like(5, vocab, seed=vocab)
    for top_k in (1, 7, vocab // 3, vocab, torch.tensor([1, 3, 0, vocab, 40], device="cuda", dtype=torch.int32)):
        out = aotinfer.top_k_renorm_probs(probs, top_k)
        want = renormalized(probs, kept_mask(probs, top_k=top_k)).float()
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-9)
    for top_p in (1e-6, 0.5, 0.95, 1.0, torch.tensor([0.1, 0.5, 0.9, 1.0, 0.99], device="cuda")):
        out = aotinfer.top_p_renorm_probs(probs, top_p)
        want = renormalized(probs, kept_mask(probs, top_p=top_p)).float()
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(out.double().sum(-1), torch.ones(5, device="cuda", dtype=torch.float64), rtol=1e-5, atol=0)


@gpu
@pytest.mark.parametrize("vocab", [1000, 70000])  # 70000: top-k's sampled floor, split rows
def test_return_valid(vocab):
    """valid is False exactly where nothing can be drawn (a NaN, zero or -inf row: token 0) or an
    index names no row (token -1); the tokens are those of the same call without it."""
    probs = llm_like(6, vocab, seed=vocab)
    probs[1] = float("nan")
    probs[3] = 0.0
    logits = torch.log(probs)  # row 1 NaN, row 3 all -inf
    indices = torch.tensor([0, 1, 2, 3, 4, 5, 6, -1], device="cuda", dtype=torch.int32)
    want_valid = [True, False, True, False, True, True, False, False]
    cases = [
        lambda **kw: aotinfer.sampling_from_probs(probs, **kw),
        lambda **kw: aotinfer.sampling_from_logits(logits, **kw),
        lambda **kw: aotinfer.top_k_sampling_from_probs(probs, 5, **kw),
        lambda **kw: aotinfer.top_p_sampling_from_probs(probs, 0.9, **kw),
        lambda **kw: aotinfer.min_p_sampling_from_probs(probs, 0.1, **kw),
        lambda **kw: aotinfer.top_k_top_p_sampling_from_probs(probs, 50, 0.9, **kw),
        lambda **kw: aotinfer.top_k_top_p_sampling_from_probs(probs, 50, 0.9, filter_apply_order="joint", **kw),
        lambda **kw: aotinfer.top_k_top_p_sampling_from_logits(logits, 50, 0.9, **kw),
    ]
    for case, op in enumerate(cases):
        tokens, valid = op(indices=indices, seed=7, offset=case, return_valid=True)
        assert valid.dtype == torch.bool and valid.tolist() == want_valid, case
        assert tokens[[1, 3]].tolist() == [0, 0] and tokens[6:].tolist() == [-1, -1], case
        assert torch.equal(tokens, op(indices=indices, seed=7, offset=case)), case
    tokens, valid = aotinfer.top_k_sampling_from_probs(probs[:0], 5, return_valid=True)
    assert tokens.shape == valid.shape == (0,)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab", [50, 1001, 50000, 128256])  # 50000 and up: the sampled floor's path
def test_top_k_renorm_16_bit(dtype, vocab):
    """16-bit rows come back in their dtype (as FlashInfer's do): the kept set exactly the float64
    reference's on the same 16-bit values, each kept value within one rounding of p / kept mass."""
    # Rows of mass 1/2, not 1: a kept value is scaled up, so none underflows to 0 (nor leaves the kept set).
    probs = (llm_like(5, vocab, seed=vocab + 1) / 2).to(dtype)
    for top_k in (1, 7, vocab // 3, vocab, torch.tensor([1, 3, 0, vocab, 40], device="cuda", dtype=torch.int32)):
        out = aotinfer.top_k_renorm_probs(probs, top_k)
        assert out.dtype == dtype and out.shape == probs.shape
        keep = kept_mask(probs, top_k=top_k)
        assert torch.equal(out != 0, keep), f"top_k {top_k}: another kept set"
        want = renormalized(probs, keep)
        # Two roundings of the value; float16's subnormals (below 2^-14) round to steps of 2^-24.
        rounding, step = (2.0 ** -8, 2.0 ** -24) if dtype == torch.float16 else (2.0 ** -5, 0.0)
        torch.testing.assert_close(out.double(), want, rtol=rounding, atol=step)
    # top-p's renorm takes float32 rows (top_p_renorm_probs converts others, as FlashInfer does)
    with pytest.raises(TypeError, match="Expected probs to have dtype float32, got"):
        aotinfer.sampling._renorm(torch.empty_like(probs), probs, probs.new_empty(0), probs.new_empty(0).float(),
                                     "top_p", 0, 0.5, -1)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab", [50, 1001, 128256])
def test_top_k_mask_logits(dtype, vocab):
    logits = (torch.randn(4, vocab, device="cuda") * 4).to(dtype)
    for top_k in (1, 20, vocab, torch.tensor([1, 5, 0, 300], device="cuda", dtype=torch.int32)):
        out = aotinfer.top_k_mask_logits(logits, top_k)
        x = logits.double()
        keep = kept_mask(x - x.min() + 1, top_k=top_k)  # the same order on positive values
        torch.testing.assert_close(out, torch.where(keep, x, float("-inf")).to(dtype), rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab", [7, 1001, 128256])
def test_softmax(dtype, vocab):
    logits = (torch.randn(6, vocab, device="cuda") * 5).to(dtype)
    logits[1, : vocab // 2] = float("-inf")
    for temperature in (None, 0.7, torch.tensor([0.5, 1, 2, 0.1, 1.5, 3.0], device="cuda")):
        t = 1.0 if temperature is None else temperature
        t = t[:, None] if isinstance(t, torch.Tensor) else t
        want = torch.softmax(logits.double() / t, -1)
        out = torch.full_like(want, float("nan"), dtype=torch.float32)
        out = aotinfer.softmax(logits, temperature)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=1e-7)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1001, 50000, 128256])
def test_softmax_many_rows(dtype, vocab):
    """Many waves of blocks (16 rows an SM), the launches of large batches: float32 rows of 50000
    and 128256 take blocks with part of their slice in shared memory (one block a row, a cluster of
    2). Every row's own temperature, a row of -inf and a half -inf row among them, against float64."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = 16 * sms + 3
    g = torch.Generator(device="cuda").manual_seed(vocab)
    logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 5).to(dtype)
    logits[7] = float("-inf")
    logits[rows - 2, : vocab // 2] = float("-inf")
    temperature = torch.rand(rows, device="cuda", generator=g) * 2 + 0.1
    out = aotinfer.softmax(logits, temperature)
    want = torch.softmax(logits.double() / temperature.double()[:, None], -1).nan_to_num(0.0)
    assert out[7].eq(0).all()
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=1e-7)


# ---- randomness: determinism, the generator, CUDA graphs ---------------------------------------------


@gpu
def test_same_seed_same_tokens_and_generator_advances():
    probs = llm_like(64, 32000, scale=1.0)
    ops = [lambda **kw: aotinfer.top_k_top_p_sampling_from_probs(probs, 100, 0.9, **kw),
           lambda **kw: aotinfer.sampling_from_logits(torch.log(probs), **kw),
           lambda **kw: aotinfer.min_p_sampling_from_probs(probs, 0.01, **kw)]
    for op in ops:
        a, b = op(seed=7, offset=12), op(seed=7, offset=12)
        assert torch.equal(a, b)
        assert not torch.equal(a, op(seed=7, offset=16)) and not torch.equal(a, op(seed=8, offset=12))
        t = op(seed=torch.tensor([7], device="cuda"), offset=torch.tensor([12], device="cuda"))
        assert torch.equal(a, t)
        torch.manual_seed(5)
        first, second = op(), op()
        assert not torch.equal(first, second)  # the default generator moved on
        torch.manual_seed(5)
        assert torch.equal(op(), first) and torch.equal(op(), second)
    g = torch.Generator(device="cuda").manual_seed(11)
    before = g.get_offset()
    aotinfer.sampling_from_probs(probs, generator=g)
    assert g.get_offset() == before + sampling._PHILOX_OFFSETS_PER_CALL
    assert g.initial_seed() == 11


@gpu
def test_cuda_graph_with_seed_and_offset_tensors():
    probs = llm_like(32, 32000, scale=1.0)
    seed = torch.tensor([123], device="cuda")
    offset = torch.tensor([0], device="cuda")
    op = lambda: aotinfer.top_k_top_p_sampling_from_probs(probs, 50, 0.9, seed=seed, offset=offset)  # noqa: E731
    op()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op()
    drawn = []
    for step in range(3):
        offset.fill_(4 * step)
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, aotinfer.top_k_top_p_sampling_from_probs(probs, 50, 0.9, seed=123, offset=4 * step))
        drawn.append(out.clone())
    assert not torch.equal(drawn[0], drawn[1])
    per_row = torch.arange(32, device="cuda")  # per-row seeds
    a = aotinfer.sampling_from_probs(probs, seed=per_row, offset=torch.zeros(32, dtype=torch.int64, device="cuda"))
    assert a.shape == (32,)


# ---- parameters per row, indices, edge cases ----------------------------------------------------------


@gpu
def test_per_row_parameters_and_indices():
    probs = llm_like(6, 5000, scale=2.0)
    top_k = torch.tensor([1, 2, 10, 100, 0, 5000], device="cuda", dtype=torch.int32)
    top_p = torch.tensor([0.5, 0.9, 1.0, 0.2, 0.7, 0.01], device="cuda")
    rows = torch.arange(6, device="cuda").repeat(500)
    for order in ("top_k_first", "joint"):
        samples = aotinfer.top_k_top_p_sampling_from_probs(probs, top_k[rows], top_p[rows], indices=rows,
                                                           filter_apply_order=order)
        keep = kept_mask(probs[rows], top_k=top_k[rows], top_p=top_p[rows], order=order)
        assert keep[torch.arange(len(rows), device="cuda"), samples].all(), order
    samples = aotinfer.top_k_sampling_from_probs(probs, top_k[rows], indices=rows.int())
    assert samples.dtype == torch.int32 and (samples[rows == 0] == probs[0].argmax()).all()
    bad = aotinfer.sampling_from_probs(probs, indices=torch.tensor([0, 6, -1], device="cuda"))
    assert bad[1:].tolist() == [-1, -1]


@gpu
@pytest.mark.parametrize("vocab", [1, 3, 1001, 32003])
def test_edge_cases(vocab):
    probs = llm_like(4, vocab, scale=2.0)
    argmax = probs.argmax(-1).int()
    assert torch.equal(aotinfer.top_k_sampling_from_probs(probs, 1), argmax)
    assert torch.equal(aotinfer.top_p_sampling_from_probs(probs, 1e-7), argmax)
    assert torch.equal(aotinfer.min_p_sampling_from_probs(probs, 1.0), argmax)
    big_k = aotinfer.top_k_sampling_from_probs(probs, vocab + 5, seed=3, offset=0)
    assert torch.equal(big_k, aotinfer.sampling_from_probs(probs, seed=3, offset=0))
    assert torch.equal(aotinfer.top_p_sampling_from_probs(probs, 1.0, seed=3, offset=0), big_k)
    one_hot = torch.zeros_like(probs)
    hot = torch.randint(0, vocab, (4,), device="cuda")
    one_hot[torch.arange(4), hot] = 1
    for op in (aotinfer.sampling_from_probs, lambda p: aotinfer.top_p_sampling_from_probs(p, 0.9),
               lambda p: aotinfer.top_k_top_p_sampling_from_probs(p, 3, 0.5, filter_apply_order="joint")):
        assert torch.equal(op(one_hot), hot.int())
    # a row not 16-byte aligned: a slice one column in
    wide = torch.cat([torch.zeros(4, 1, device="cuda"), probs], 1)[:, 1:]
    assert torch.equal(aotinfer.top_k_sampling_from_probs(wide, 1), argmax)
    torch.testing.assert_close(aotinfer.top_k_renorm_probs(wide, 2), renormalized(probs, kept_mask(probs, top_k=2)).float())


@gpu
def test_batch_zero_and_nan():
    empty = torch.empty(0, 100, device="cuda")
    assert aotinfer.top_k_top_p_sampling_from_probs(empty, 5, 0.5).shape == (0,)
    assert aotinfer.sampling_from_probs(torch.rand(3, 100, device="cuda"), indices=torch.empty(0, dtype=torch.int64, device="cuda")).shape == (0,)
    assert aotinfer.top_p_renorm_probs(empty, 0.5).shape == (0, 100)
    assert aotinfer.softmax(empty).shape == (0, 100)
    probs = torch.rand(3, 100, device="cuda")
    probs[1, 7] = float("nan")
    with pytest.raises(ValueError, match="Input probs contains NaN"):
        aotinfer.top_p_sampling_from_probs(probs, 0.5, check_nan=True)
    with pytest.raises(ValueError, match="Input logits contains NaN"):
        aotinfer.top_k_top_p_sampling_from_logits(probs, 5, 0.5, check_nan=True)
    # without the check, NaN is never drawn
    samples = aotinfer.sampling_from_probs(probs, indices=torch.ones(4096, dtype=torch.int32, device="cuda"))
    assert (samples != 7).all()


@gpu
@pytest.mark.parametrize("scale", [0.3, 2.0])
def test_sampling_from_probs_by_chunk_masses(scale):
    """With no filter, rows 16-byte aligned draw one token by the row's chunk masses (the inverse of
    its cumulative mass) rather than by a race: against the exact distribution on a flat and a
    peaked row, unnormalized (samplers take any positive scale), with a third of the row zero,
    negative or NaN (never drawn); a row with no positive mass draws nothing, as the race does."""
    g = torch.Generator().manual_seed(31)
    probs = torch.softmax(torch.randn(4096, generator=g, dtype=torch.float64) * scale, 0).float() * 2.5
    probs[1::3] = torch.tensor([0.0, -1.0, float("nan")]).repeat(1366)[: probs[1::3].numel()]
    probs = probs.cuda()[None]
    assert_draws_match(draw_many(aotinfer.sampling_from_probs, probs), renormalized(probs, probs > 0)[0])
    rows = torch.rand(3, 4096, device="cuda")
    rows[1] = 0.0
    tokens, valid = aotinfer.sampling_from_probs(rows, seed=1, offset=0, return_valid=True)
    assert valid.tolist() == [True, False, True] and tokens[1].item() == 0


@gpu
@pytest.mark.parametrize("vocab", [32000, 128256])
def test_split_rows_draw_what_whole_rows_draw(vocab):
    """Small batches split a row over a cluster of blocks; the same rows in a large batch are not
    split. The tokens (same seed, offset and output row) must not depend on that."""
    g = torch.Generator(device="cuda").manual_seed(5)
    flat = torch.softmax(torch.randn(2, vocab, device="cuda", generator=g), -1)
    peaked = llm_like(2, vocab, seed=6, scale=3.0)
    for probs in (flat, peaked):
        big = probs.repeat(100, 1)  # rows 0 and 1 as in probs
        for op in (lambda p: aotinfer.sampling_from_probs(p, seed=9, offset=3),
                   lambda p: aotinfer.top_k_sampling_from_probs(p, 50, seed=9, offset=3),
                   lambda p: aotinfer.min_p_sampling_from_probs(p, 0.05, seed=9, offset=3),
                   lambda p: aotinfer.top_p_sampling_from_probs(p, 0.9, seed=9, offset=3),
                   lambda p: aotinfer.top_p_sampling_from_probs(p, 0.3, seed=9, offset=3),
                   lambda p: aotinfer.top_p_sampling_from_probs(p, torch.full((p.shape[0],), 0.2, device="cuda"),
                                                               seed=9, offset=3),
                   lambda p: aotinfer.top_k_top_p_sampling_from_probs(p, 50, 0.9, seed=9, offset=3),
                   lambda p: aotinfer.top_k_top_p_sampling_from_probs(p, 1000, 0.5, seed=9, offset=3),
                   lambda p: aotinfer.top_k_top_p_sampling_from_probs(p, 50, 0.9, filter_apply_order="joint",
                                                                      seed=9, offset=3),
                   # from logits in one kernel: the floor's path, and the probabilities written in the kernel
                   lambda p: aotinfer.top_k_top_p_sampling_from_logits(torch.log(p), 50, 0.9, seed=9, offset=3),
                   lambda p: aotinfer.top_k_top_p_sampling_from_logits(torch.log(p), p.shape[1], 0.9, seed=9,
                                                                       offset=3)):
            for step in range(4):  # other rows: the vocabulary rolled
                small = op(probs)
                assert torch.equal(small, op(big)[:2])
                probs, big = probs.roll(step + 1, -1), big.roll(step + 1, -1)


@gpu
@pytest.mark.parametrize("vocab", [32000, 128256])
def test_renorm_and_mask_split_and_whole_rows(vocab):
    """The renormalizations and the mask against float64 where rows are split over a cluster (small
    batch) and where they are not (large batch), on flat rows (the top-k gather, top-p's threshold
    bin of thousands) and peaked ones; the split must not change a bit of the output."""
    g = torch.Generator(device="cuda").manual_seed(11)
    flat = torch.softmax(torch.randn(2, vocab, device="cuda", generator=g), -1)
    peaked = llm_like(2, vocab, seed=12, scale=3.0)
    logits = torch.randn(2, vocab, device="cuda", generator=g) * 3
    for probs in (flat, peaked):
        big = probs.repeat(100, 1)
        for top_k in (1, 50, 3000):
            want = renormalized(probs, kept_mask(probs, top_k=top_k)).float()
            small = aotinfer.top_k_renorm_probs(probs, top_k)
            torch.testing.assert_close(small, want, rtol=1e-5, atol=1e-9)
            torch.testing.assert_close(aotinfer.top_k_renorm_probs(big, top_k)[198:], small, rtol=0, atol=0)
        for top_p in (0.3, 0.9):
            want = renormalized(probs, kept_mask(probs, top_p=top_p)).float()
            small = aotinfer.top_p_renorm_probs(probs, top_p)
            torch.testing.assert_close(small, want, rtol=1e-5, atol=1e-9)
            torch.testing.assert_close(aotinfer.top_p_renorm_probs(big, top_p)[198:], small, rtol=0, atol=0)
    big = logits.repeat(100, 1)
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        for top_k in (1, 50, 3000):
            keep = kept_mask(x.double() - x.double().min() + 1, top_k=top_k)
            small = aotinfer.top_k_mask_logits(x, top_k)
            torch.testing.assert_close(small, torch.where(keep, x.double(), float("-inf")).to(dtype), rtol=0, atol=0)
            torch.testing.assert_close(aotinfer.top_k_mask_logits(big.to(dtype), top_k)[198:], small, rtol=0, atol=0)


def check_top_p_renorm_batches(probs, copies, top_ps):
    """top_p_renorm_probs of `probs` against float64, and of `copies` copies of its rows (another
    split of the rows, or another path) bit for bit equal to it; each output's memory poisoned with
    NaN first, so that every element must be written."""
    rows = probs.repeat(copies, 1)
    for top_p in top_ps:
        want = renormalized(probs, kept_mask(probs, top_p=top_p)).float()
        torch.full_like(rows, float("nan"))  # freed at once: the allocator hands its block to the output
        big = aotinfer.top_p_renorm_probs(rows, top_p)
        torch.full_like(probs, float("nan"))
        small = aotinfer.top_p_renorm_probs(probs, top_p)
        torch.testing.assert_close(small, want, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(big.view(copies, *probs.shape), small.expand(copies, *probs.shape), rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("heavy", [1, 300, 8000, 8400, 20000])
def test_top_p_renorm_of_heavy_values_over_a_floor(heavy):
    """top_p_renorm_probs on rows of `heavy` large values (0.5 to 1.5 before normalizing: about 13
    of the histogram's level-0 bins) over a floor of tiny ones: the threshold's bin holds from one
    element to over a thousand, with up to 20000 above it. Split (batch 2) and whole (batch 200,
    beyond the L2: the sample's window) rows, split rows bit for bit equal to whole ones, against
    float64."""
    vocab = 128256
    g = torch.Generator(device="cuda").manual_seed(heavy)
    probs = torch.rand(2, vocab, device="cuda", generator=g) * 1e-9
    columns = torch.randperm(vocab, device="cuda", generator=g)[:heavy]
    probs[:, columns] = 0.5 + torch.rand(2, heavy, device="cuda", generator=g)
    probs /= probs.sum(-1, keepdim=True)
    check_top_p_renorm_batches(probs, 100, (0.5, 0.9, 0.999))


@gpu
@pytest.mark.parametrize("vocab, batch", [(128256, 300), (262144, 66)])  # whole rows; rows split over two blocks
def test_top_p_renorm_window_hits_misses_and_overflows(vocab, batch):
    """Where a batch's rows exceed the L2, the top-p renormalization's first pass gathers a window
    of bins that the sample predicts around the threshold; the result must not depend on whether
    the window holds the threshold's bin. Rows where it does (softmax(randn): the sample predicts
    the bin), where it cannot (the heavy values all off the sampled positions, so the sample sees
    only the floor), and where the window overflows (the unsampled elements all equal, in the one
    bin the sample puts its mass in but expects a twentieth of them in). The batch of 3 (no window)
    against float64, the large batch bit for bit equal to it, the output poisoned first."""
    g = torch.Generator(device="cuda").manual_seed(5)
    sampled = torch.zeros(vocab, dtype=torch.bool, device="cuda")
    sampled[sample_positions(vocab)] = True
    flat = torch.softmax(torch.randn(vocab, device="cuda", generator=g), -1)
    hidden = torch.rand(vocab, device="cuda", generator=g) * 1e-9
    heavy = (~sampled).nonzero()[:, 0]
    heavy = heavy[torch.randperm(len(heavy), device="cuda", generator=g)[:500]]
    hidden[heavy] = 0.5 + torch.rand(500, device="cuda", generator=g)
    crowded = torch.full((vocab,), 3e-6, device="cuda")  # 50 sampled ones predict a twentieth of this bin
    crowded[sample_positions(vocab)[50:]] = 1e-9
    probs = torch.stack([flat, hidden, crowded])
    probs /= probs.sum(-1, keepdim=True)
    assert batch * vocab * 4 > torch.cuda.get_device_properties(0).L2_cache_size
    check_top_p_renorm_batches(probs, batch // 3, (0.3, 0.9, 0.99))


def sample_positions(vocab):
    """The kernel's sample positions (SamplePosition): 128 runs of 8 adjacent elements, spread evenly."""
    spacing = vocab // 128 // 8 * 8
    t = torch.arange(1024, device="cuda")
    return (t // 8) * spacing + t % 8


def rows_around_the_floor(vocab, g):
    """Rows of `vocab` whose last column is 0, and the same without it (one column under the floor's
    minimum row length): dropping the column changes no kept set and no random number. Rows 0-1
    equal values (a floor gathers the whole row), 2-3 ten nonzero values (fewer than k above any
    floor), 4-5 the largest values at the kernel's sample positions (the floor above the k-th
    largest), the rest softmax(2 randn), where the floor holds."""
    rows = 256
    probs = torch.softmax(torch.randn(rows, vocab, device="cuda", generator=g) * 2, -1)
    probs[0:2] = 1.0 / vocab
    probs[2:4] = 0
    probs[2:4, torch.randperm(vocab - 1, device="cuda", generator=g)[:10]] = 0.1
    sampled = sample_positions(vocab)
    probs[4:6, sampled] = probs[4:6].max(-1, keepdim=True).values * (2 + torch.rand(2, 1024, device="cuda", generator=g))
    probs[:, -1] = 0
    probs /= probs.sum(-1, keepdim=True)
    return probs, probs[:, :-1].contiguous()


@gpu
def test_top_k_sampled_floor_and_its_misses():
    """On rows of 16384 or more the top-k samplers, of 40960 or more the top-k renorm and of 65536 or
    more the mask gather their candidates above a floor taken from a sample of the row (one pass, no
    histogram); shorter rows take the histogram path. So one column fewer (a 0 one, see
    rows_around_the_floor) must give the floor path's tokens and outputs exactly, at batch 256 and 8,
    on rows where the floor holds and on rows where it misses and falls back."""
    g = torch.Generator(device="cuda").manual_seed(21)
    probs, short = rows_around_the_floor(16384, g)
    ops = {
        "top_k": lambda p: aotinfer.top_k_sampling_from_probs(p, 50, seed=3, offset=1),
        "top_k_top_p": lambda p: aotinfer.top_k_top_p_sampling_from_probs(p, 50, 0.9, seed=3, offset=1),
        "joint": lambda p: aotinfer.top_k_top_p_sampling_from_probs(p, 100, 0.5, filter_apply_order="joint",
                                                                    seed=3, offset=1),
    }
    for name, op in ops.items():
        floor_path = op(probs)
        assert torch.equal(floor_path, op(short)), name
        assert torch.equal(floor_path[:8], op(probs[:8])), name
    keep = kept_mask(probs, top_k=50)
    assert keep.gather(-1, ops["top_k"](probs)[:, None].long()).all()

    probs, short = rows_around_the_floor(40960, g)
    for k in (1, 50, 300):
        floor_path = aotinfer.top_k_renorm_probs(probs, k)
        torch.testing.assert_close(floor_path[:, :-1], aotinfer.top_k_renorm_probs(short, k), rtol=0, atol=0)
        want = renormalized(probs[:8], kept_mask(probs[:8], top_k=k)).float()
        torch.testing.assert_close(floor_path[:8], want, rtol=1e-5, atol=1e-9)

    probs, _ = rows_around_the_floor(65536, g)
    logits = torch.log(probs.clamp(min=1e-30))  # the last column far below every top-k
    short_logits = logits[:, :-1].contiguous()
    for k in (1, 50, 700):
        masked = aotinfer.top_k_mask_logits(logits, k)
        torch.testing.assert_close(masked[:, :-1], aotinfer.top_k_mask_logits(short_logits, k), rtol=0, atol=0)
        keep = kept_mask(logits[:8].double() - logits[:8].double().min() + 1, top_k=k)
        torch.testing.assert_close(masked[:8], torch.where(keep, logits[:8], float("-inf")), rtol=0, atol=0)


# ---- chain speculative sampling -------------------------------------------------------------------


def test_chain_speculative_sampling_arguments():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with pytest.raises(ValueError, match="Expected draft_probs to be a CUDA tensor, got a tensor on cpu"):
        aotinfer.chain_speculative_sampling(torch.rand(2, 3, 8), torch.zeros(2, 3, dtype=torch.int32), torch.rand(2, 4, 8))
    with FakeTensorMode():  # checked while tracing (on stand-ins), as eagerly
        good = dict(draft_probs=torch.empty(2, 3, 8, device="cuda"),
                    draft_token_ids=torch.empty(2, 3, dtype=torch.int32, device="cuda"),
                    target_probs=torch.empty(2, 4, 8, device="cuda"))
        cases = [
            (dict(target_probs=torch.empty(2, 3, 8, device="cuda")), ValueError, r"Expected target_probs to have shape \[2, 4, 8\]"),
            (dict(draft_token_ids=torch.empty(2, 4, dtype=torch.int32, device="cuda")), ValueError,
             r"Expected draft_token_ids to have shape \[2, 3\]"),
            (dict(draft_token_ids=torch.empty(2, 3, device="cuda")), TypeError, "Expected draft_token_ids to have dtype int32 or int64"),
            (dict(draft_probs=torch.empty(2, 3, 8, dtype=torch.float16, device="cuda")), TypeError,
             "Expected draft_probs to have dtype float32"),
            (dict(maybe_output_accepted_token_num=torch.empty(2, dtype=torch.int64, device="cuda")), TypeError,
             "Expected maybe_output_accepted_token_num to have dtype int32"),
            (dict(maybe_output_emitted_draft_token_num=torch.empty(3, dtype=torch.int32, device="cuda")), ValueError,
             r"Expected maybe_output_emitted_draft_token_num to have shape \[2\]"),
            (dict(draft_probs=torch.empty(2, 3, device="cuda")), ValueError, "draft_probs"),
        ]
        for changed, error, message in cases:
            arguments = dict(good, **changed)
            with pytest.raises(error, match=message):
                aotinfer.chain_speculative_sampling(**arguments)
        with pytest.raises(TypeError, match="Expected deterministic to be a bool"):
            aotinfer.chain_speculative_sampling(**good, deterministic=None)
        out, accepted, emitted = aotinfer.chain_speculative_sampling(**good)
        assert out.shape == (2, 4) and out.dtype == torch.int32 and accepted.shape == emitted.shape == (2,)


def _speculative_case(batch, n, vocab, seed):
    """Random draft and target distributions (the same for every request, so that the draws pool),
    and draft tokens drawn from the draft distributions."""
    g = torch.Generator().manual_seed(seed)
    draft = torch.softmax(torch.randn(n, vocab, generator=g, dtype=torch.float64) * 1.2, -1)
    target = torch.softmax(torch.randn(n + 1, vocab, generator=g, dtype=torch.float64) * 1.2, -1)
    ids = torch.stack([torch.multinomial(draft[i].float(), batch, replacement=True, generator=g) for i in range(n)], 1)
    return draft, target, ids.int()


@gpu
def test_chain_speculative_sampling_follows_the_target():
    """Every emitted token follows the target model's distribution at its position (a chi-square
    test per position over the requests that emit it); the first position's acceptance rate is
    sum(min(draft, target)) (a binomial test at 5 sigma); the counters add to what was there and
    agree with the tokens."""
    batch, n, vocab = 100_000, 3, 12
    draft, target, ids = _speculative_case(batch, n, vocab, seed=5)
    draft_rows = draft.float().cuda().expand(batch, n, vocab).contiguous()
    target_rows = target.float().cuda().expand(batch, n + 1, vocab).contiguous()
    accepted0 = torch.full((batch,), 3, dtype=torch.int32, device="cuda")
    emitted0 = torch.full((batch,), 7, dtype=torch.int32, device="cuda")
    out, accepted, emitted = aotinfer.chain_speculative_sampling(
        draft_rows, ids.cuda(), target_rows, accepted0.clone(), emitted0.clone(), seed=11, offset=0)
    out, accepted, emitted = out.cpu(), (accepted - accepted0).cpu(), (emitted - emitted0).cpu()
    for position in range(n + 1):
        tokens = out[:, position]
        assert_draws_match(tokens[tokens >= 0], target[position])
    # The layout: the accepted prefix (the draft tokens), one drawn token, then -1.
    assert torch.equal(emitted + 1, (out >= 0).sum(1).int())
    positions = torch.arange(n + 1)
    assert bool(((out >= 0) == (positions[None] <= emitted[:, None])).all())
    assert bool((out[:, :n] == ids).logical_or(positions[None, :n] >= emitted[:, None]).all())
    assert bool((accepted >= emitted).all()) and bool((accepted <= n).all())
    rate = float(torch.minimum(draft[0], target[0]).sum())
    passed0 = float((emitted >= 1).double().mean())
    assert abs(passed0 - rate) < 5 * math.sqrt(rate * (1 - rate) / batch), (passed0, rate)
    # accepted counts every position's test: its mean is the sum of the positions' rates.
    rates = sum(float(torch.minimum(draft[i], target[i]).sum()) for i in range(n))
    assert abs(float(accepted.double().mean()) - rates) < 5 * math.sqrt(n / batch), (float(accepted.double().mean()), rates)


@gpu
def test_chain_speculative_sampling_decided_cases():
    """One-hot targets decide every token; a draft token the target gives nothing is rejected; ids
    of int64 and outside the vocabulary; the same seed and offset give the same tokens."""
    batch, n, vocab = 6, 4, 1000
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab, (batch, n), generator=g)
    hot = torch.randint(0, vocab, (batch, n + 1), generator=g)
    hot[:3, :n] = ids[:3]  # requests 0-2: the target agrees with every draft token
    hot[4, 1] = ids[4, 1]  # request 4 agrees at position 1 only (after its first rejection)
    ids[5, 0] = vocab + 3  # request 5: a draft token outside the vocabulary
    draft = torch.softmax(torch.randn(batch, n, vocab, generator=g), -1).cuda()
    target = torch.zeros(batch, n + 1, vocab).scatter_(2, hot[..., None], 1.0).cuda()
    out, accepted, emitted = aotinfer.chain_speculative_sampling(draft, ids.cuda(), target, seed=1, offset=4)
    want = torch.full((batch, n + 1), -1, dtype=torch.int32)
    want[:3] = hot[:3].int()  # all accepted, then the bonus token
    for row in range(3, batch):
        want[row, 0] = hot[row, 0]  # rejected at once: the target's token
    assert torch.equal(out.cpu(), want)
    assert accepted.tolist() == [n, n, n, 0, 1, 0] and emitted.tolist() == [n, n, n, 0, 0, 0]
    again = aotinfer.chain_speculative_sampling(draft, ids.cuda(), target, seed=1, offset=4)
    assert all(torch.equal(a, b) for a, b in zip(again, (out, accepted, emitted)))


@gpu
def test_chain_speculative_sampling_under_graph_replay():
    """seed and offset tensors are read when the kernel runs: a captured call draws anew after the
    offset changes, the tokens an eager call with that offset draws."""
    batch, n, vocab = 64, 3, 300
    draft, target, ids = _speculative_case(batch, n, vocab, seed=9)
    draft_rows = draft.float().cuda().expand(batch, n, vocab).contiguous()
    target_rows = target.float().cuda().expand(batch, n + 1, vocab).contiguous()
    ids = ids.cuda()
    seed = torch.tensor([5], dtype=torch.int64, device="cuda")
    offset = torch.tensor([0], dtype=torch.int64, device="cuda")
    aotinfer.chain_speculative_sampling(draft_rows, ids, target_rows, seed=seed, offset=offset)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = aotinfer.chain_speculative_sampling(draft_rows, ids, target_rows, seed=seed, offset=offset)
    outputs = []
    for step in (4, 8):
        offset.fill_(step)
        graph.replay()
        eager = aotinfer.chain_speculative_sampling(draft_rows, ids, target_rows, seed=5, offset=step)
        assert torch.equal(captured[0], eager[0])
        outputs.append(captured[0].clone())
    assert not torch.equal(outputs[0], outputs[1])


@gpu
def test_vllm_flashinfer_sample_calls():
    """vLLM's flashinfer_sample (v1/sample/ops/topk_topp_sampler.py), its three branches as it calls
    them: per-row k as int64 and p as float32 tensors, deterministic=True; every token drawn lies in
    the row's kept set, and each branch returns one token a row."""
    batch, vocab = 64, 32000
    g = torch.Generator(device="cuda").manual_seed(4)
    logits = torch.randn(batch, vocab, device="cuda", generator=g) * 4
    k = torch.randint(1, 200, (batch,), device="cuda", generator=g)  # int64, as vLLM holds it
    p = torch.rand(batch, device="cuda", generator=g) * 0.9 + 0.05
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    calls = {
        "top_p": (aotinfer.top_p_sampling_from_probs(probs, p, deterministic=True), dict(top_p=p)),
        "top_k": (aotinfer.top_k_sampling_from_probs(probs, k, deterministic=True), dict(top_k=k)),
        "top_k_top_p": (aotinfer.top_k_top_p_sampling_from_logits(logits, k, p, deterministic=True),
                        dict(top_k=k, top_p=p)),
    }
    for name, (tokens, filters) in calls.items():
        tokens = tokens.view(-1)
        assert tokens.shape == (batch,), name
        if "top_p" in filters:  # the boundary token's mass, computed in float32 by the kernel: a margin
            filters = dict(filters, top_p=(filters["top_p"] + 1e-4).clamp(max=1.0))
        keep = kept_mask(probs, **filters)
        assert bool(keep.gather(1, tokens.long()[:, None]).all()), f"{name}: a token outside its row's kept set"


@gpu
def test_sglang_sampler_calls():
    """SGLang's Sampler with the flashinfer backend (srt/layers/sampler.py, 0.5.23), as it calls it:
    top_k_top_p_sampling_from_probs(probs.contiguous(), top_ks, top_ps, filter_apply_order="joint")
    with int32 k (1 << 30 meaning no top-k) and float32 p, and min_p_sampling_from_probs(probs,
    min_ps) after its own renormalization; every token drawn lies in the row's kept set."""
    batch, vocab, no_top_k = 64, 32000, 1 << 30
    g = torch.Generator(device="cuda").manual_seed(6)
    probs = (torch.randn(batch, vocab, device="cuda", generator=g) * 4).softmax(-1)
    top_ks = torch.randint(1, 200, (batch,), device="cuda", generator=g).to(torch.int32)
    top_ks[::4] = no_top_k
    top_ps = torch.rand(batch, device="cuda", generator=g) * 0.9 + 0.05
    top_ps[1::4] = 1.0
    min_ps = torch.rand(batch, device="cuda", generator=g) * 0.3
    joint = aotinfer.top_k_top_p_sampling_from_probs(probs.contiguous(), top_ks, top_ps, filter_apply_order="joint")
    min_p = aotinfer.min_p_sampling_from_probs(probs, min_ps)
    calls = {
        "joint": (joint, dict(top_k=top_ks.long(), top_p=(top_ps + 1e-4).clamp(max=1.0), order="joint")),
        "min_p": (min_p, dict(min_p=min_ps * (1 - 1e-5))),  # the threshold computed in float32: a margin
    }
    for name, (tokens, filters) in calls.items():
        assert tokens.shape == (batch,) and tokens.dtype == torch.int32, name
        keep = kept_mask(probs, **filters)
        assert bool(keep.gather(1, tokens.long()[:, None]).all()), f"{name}: a token outside its row's kept set"
