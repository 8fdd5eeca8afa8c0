"""Trace templates of aotinfer.sampling (torch is imported when a reference runs).

References filter with a full sort (what the kernels avoid) and draw with torch.multinomial. Every
filter keeps the elements at or above one threshold value (ties with it are kept). Test inputs of
the sampling ops put all of a row's mass on one token, so that any correct sampler returns it."""

from ..template import Const, Scalar, Tensor, TraceTemplate, Var

_ROWS = ["batch_size", "vocab_size"]
_AXES = {"batch_size": Var(), "vocab_size": Const(abbrev="v")}


def _one_hot_probs(shape, device, dtype):
    """Rows with all their mass on one random token."""
    import torch

    probs = torch.zeros(shape, device=device, dtype=dtype)
    hot = torch.randint(0, shape[-1], shape[:-1] + [1], device=device)
    return probs.scatter_(-1, hot, 1.0)


def _some_tokens(shape, device):
    """Token ids 0 and 1 (in any vocabulary): with one-hot rows, each draft token passes or not."""
    import torch

    return torch.randint(0, 2, shape, device=device, dtype=torch.int32)


def _peaked_logits(shape, device, dtype):
    """Random logits with one token per row 1000 above the rest (its probability rounds to 1)."""
    import torch

    return (_one_hot_probs(shape, device, torch.float32) * 1000 + torch.randn(shape, device=device)).to(dtype)


def _softmax_probs(shape, device, dtype):
    import torch

    return torch.softmax(torch.randn(shape, device=device) * 2, dim=-1).to(dtype)


# ---- references -------------------------------------------------------------------------------------


def _top_k_threshold(probs, top_k):
    """The k-th largest value of each row (keep values >= it); -inf where k is 0 or covers the row."""
    import torch

    k = torch.as_tensor(top_k, device=probs.device).expand(probs.shape[0]).long()
    values = probs.sort(dim=-1, descending=True).values
    kth = values.gather(-1, (k.clamp(1, probs.shape[-1]) - 1)[:, None])[:, 0]
    return torch.where((k > 0) & (k < probs.shape[-1]), kth, torch.full_like(kth, float("-inf")))


def _top_p_threshold(probs, top_p):
    """The value at which the sorted row's cumulative mass first reaches top_p of its total."""
    import torch

    p = torch.as_tensor(top_p, device=probs.device, dtype=torch.float64).expand(probs.shape[0])
    values = probs.double().clamp(min=0).sort(dim=-1, descending=True).values
    cumulative = values.cumsum(-1)
    target = p[:, None] * cumulative[:, -1:]
    first = (cumulative < target).sum(-1, keepdim=True).clamp(max=probs.shape[-1] - 1)
    threshold = values.gather(-1, first)[:, 0].to(probs.dtype)
    return torch.where(p < 1, threshold, torch.full_like(threshold, float("-inf")))


def _draw(probs, keep):
    import torch

    return torch.multinomial(torch.where(keep, probs.float().clamp(min=0), 0.0), 1)[:, 0].to(torch.int32)


def _sampling_from_probs_reference(probs):
    import torch

    return _draw(probs, torch.ones_like(probs, dtype=torch.bool))


def _sampling_from_logits_reference(logits):
    import torch

    return _draw(torch.softmax(logits.float(), dim=-1), torch.ones_like(logits, dtype=torch.bool))


def _top_k_sampling_reference(probs, top_k):
    return _draw(probs, probs >= _top_k_threshold(probs, top_k)[:, None])


def _top_p_sampling_reference(probs, top_p):
    return _draw(probs, probs >= _top_p_threshold(probs, top_p)[:, None])


def _min_p_sampling_reference(probs, min_p):
    return _draw(probs, probs >= probs.max(dim=-1, keepdim=True).values * min_p)


def _top_k_top_p_sampling_reference(probs, top_k, top_p):
    """Top-k first (the default order): top-p over the renormalized top-k set."""
    import torch

    kept = torch.where(probs >= _top_k_threshold(probs, top_k)[:, None], probs, 0.0)
    return _draw(kept, kept >= _top_p_threshold(kept, top_p)[:, None])


def _top_k_top_p_sampling_from_logits_reference(logits, top_k, top_p):
    import torch

    return _top_k_top_p_sampling_reference(torch.softmax(logits.float(), dim=-1), top_k, top_p)


def _top_k_renorm_reference(probs, top_k):
    import torch

    x = probs.float()
    kept = torch.where(x >= _top_k_threshold(x, top_k)[:, None], x, 0.0)
    return (kept / kept.sum(-1, keepdim=True)).to(probs.dtype)


def _top_p_renorm_reference(probs, top_p):
    import torch

    kept = torch.where(probs >= _top_p_threshold(probs, top_p)[:, None], probs, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def _top_k_mask_logits_reference(logits, top_k):
    import torch

    x = logits.float()
    return torch.where(x >= _top_k_threshold(x, top_k)[:, None], x, float("-inf")).to(logits.dtype)


def _chain_speculative_sampling_reference(draft_probs, draft_token_ids, target_probs):
    """Each request's draft tokens tested in order with float64 uniforms, the first rejected (or the
    bonus) position drawn with torch.multinomial from max(0, target - draft) (the target row where
    that is zero), in a plain loop."""
    import torch

    batch, n = draft_token_ids.shape
    vocab = draft_probs.shape[-1]
    out = torch.full((batch, n + 1), -1, dtype=torch.int32)
    accepted = torch.zeros(batch, dtype=torch.int32)
    emitted = torch.zeros(batch, dtype=torch.int32)
    draft, target, ids = draft_probs.double().cpu(), target_probs.double().cpu(), draft_token_ids.long().cpu()
    for b in range(batch):
        drawn_at = n
        for i in range(n):
            d = int(ids[b, i])
            passes = 0 <= d < vocab and float(torch.rand((), dtype=torch.float64)) * draft[b, i, d] < target[b, i, d]
            accepted[b] += int(passes)
            if drawn_at == n:
                if passes:
                    out[b, i] = d
                else:
                    drawn_at = i
        row = target[b, drawn_at]
        if drawn_at < n and bool(((row - draft[b, drawn_at]).clamp(min=0) > 0).any()):
            row = (row - draft[b, drawn_at]).clamp(min=0)
        out[b, drawn_at] = int(torch.multinomial(row.clamp(min=0), 1)) if bool((row > 0).any()) else 0
        emitted[b] = drawn_at
    device = draft_probs.device
    return out.to(device), accepted.to(device), emitted.to(device)


def _softmax_reference(logits, temperature):
    import torch

    return torch.softmax(logits.float() / temperature, dim=-1)


# ---- templates ---------------------------------------------------------------------------------------

_PROBS = Tensor(_ROWS, dtype="float32", example=_one_hot_probs, description="Probabilities per row (need not sum to 1).")
_LOGITS = Tensor(_ROWS, example=_peaked_logits, description="Logits per row.")
_TOP_K = Scalar("int32", example=3, description="Keep the k largest (a Python int or int32 [batch_size]).")
_TOP_P = Scalar("float32", example=0.5, description="Keep the smallest top set holding top_p of the mass, in (0, 1].")
_MIN_P = Scalar("float32", example=0.5, description="Keep probabilities >= min_p * the row's largest.")
_SAMPLES = {"samples": Tensor(["batch_size"], dtype="int32", description="Token ids (indices' dtype with indices).")}
_TAGS = ["status:verified", "sampling"]


def _template(name, description, inputs, outputs, reference, op_type="sampling"):
    return TraceTemplate(op_type=op_type, name_prefix=name, description=description, axes=dict(_AXES),
                         inputs=inputs, outputs=outputs, tags=_TAGS, reference=reference)


sampling_from_probs_trace = _template(
    "sampling_from_probs", "Draw one token per row with probability proportional to probs.",
    {"probs": _PROBS}, _SAMPLES, _sampling_from_probs_reference)
sampling_from_logits_trace = _template(
    "sampling_from_logits", "Draw one token per row from softmax(logits).",
    {"logits": _LOGITS}, _SAMPLES, _sampling_from_logits_reference)
top_k_sampling_trace = _template(
    "top_k_sampling_from_probs", "Draw from the k most probable tokens, renormalized.",
    {"probs": _PROBS, "top_k": _TOP_K}, _SAMPLES, _top_k_sampling_reference)
top_p_sampling_trace = _template(
    "top_p_sampling_from_probs", "Draw from the smallest set of most probable tokens holding top_p of the mass.",
    {"probs": _PROBS, "top_p": _TOP_P}, _SAMPLES, _top_p_sampling_reference)
min_p_sampling_trace = _template(
    "min_p_sampling_from_probs", "Draw from the tokens with probability >= min_p * the largest.",
    {"probs": _PROBS, "min_p": _MIN_P}, _SAMPLES, _min_p_sampling_reference)
top_k_top_p_sampling_trace = _template(
    "top_k_top_p_sampling_from_probs", "Top-k, then top-p over the renormalized top-k set (the default order), then draw.",
    {"probs": _PROBS, "top_k": _TOP_K, "top_p": _TOP_P}, _SAMPLES, _top_k_top_p_sampling_reference)
top_k_top_p_sampling_from_logits_trace = _template(
    "top_k_top_p_sampling_from_logits", "softmax(logits), then top-k, top-p and a draw as from probs.",
    {"logits": _LOGITS, "top_k": _TOP_K, "top_p": _TOP_P}, _SAMPLES, _top_k_top_p_sampling_from_logits_reference)
top_k_renorm_probs_trace = _template(
    "top_k_renorm_probs", "Zero all but the k largest probabilities of each row and renormalize.",
    {"probs": Tensor(_ROWS, example=_softmax_probs), "top_k": _TOP_K},
    {"renorm_probs": Tensor(_ROWS, dtype_from="probs")}, _top_k_renorm_reference, op_type="sampling_renorm")
top_p_renorm_probs_trace = _template(
    "top_p_renorm_probs", "Zero the probabilities outside the top-p set of each row and renormalize.",
    {"probs": Tensor(_ROWS, dtype="float32", example=_softmax_probs), "top_p": _TOP_P},
    {"renorm_probs": Tensor(_ROWS, dtype="float32")}, _top_p_renorm_reference, op_type="sampling_renorm")
top_k_mask_logits_trace = _template(
    "top_k_mask_logits", "Set all but the k largest logits of each row to -inf.",
    {"logits": Tensor(_ROWS), "top_k": _TOP_K},
    {"masked_logits": Tensor(_ROWS, dtype_from="logits")}, _top_k_mask_logits_reference, op_type="sampling_renorm")
chain_speculative_sampling_trace = TraceTemplate(
    op_type="speculative_sampling", name_prefix="chain_speculative_sampling",
    description="Accept draft tokens while u * draft < target, draw the first rejected (or bonus) position from "
                "max(0, target - draft).",
    axes={"batch_size": Var(), "num_speculate_tokens": Const(abbrev="n"), "vocab_size": Const(abbrev="v"),
          "num_positions": Const(derive=lambda sizes: sizes["num_speculate_tokens"] + 1)},
    inputs={
        "draft_probs": Tensor(["batch_size", "num_speculate_tokens", "vocab_size"], dtype="float32", example=_one_hot_probs,
                              description="The draft model's distribution at each position."),
        "draft_token_ids": Tensor(["batch_size", "num_speculate_tokens"], dtype="int32",
                                  example=lambda shape, device, dtype: _some_tokens(shape, device),
                                  description="The draft tokens."),
        "target_probs": Tensor(["batch_size", "num_positions", "vocab_size"], dtype="float32", example=_one_hot_probs,
                               description="The target model's distribution at each position and the bonus one."),
    },
    outputs={
        "output_token_ids": Tensor(["batch_size", "num_positions"], dtype="int32",
                                   description="The accepted draft tokens, the drawn token, then -1."),
        "output_accepted_token_num": Tensor(["batch_size"], dtype="int32",
                                            description="Draft tokens whose test passes, each on its own."),
        "output_emitted_draft_token_num": Tensor(["batch_size"], dtype="int32", description="Draft tokens emitted."),
    },
    tags=_TAGS, reference=_chain_speculative_sampling_reference)
softmax_trace = _template(
    "softmax", "softmax(logits / temperature) over each row, in float32.",
    {"logits": Tensor(_ROWS), "temperature": Scalar("float32", description="A Python float or float32 [batch_size].")},
    {"probs": Tensor(_ROWS, dtype="float32")}, _softmax_reference, op_type="softmax")
