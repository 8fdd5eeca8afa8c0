"""A serving loop, timed whole: paged prefill of a ragged batch, then decode steps, each planned on
the host and replayed as one CUDA graph (every layer + per-row top-k/top-p sampling).

    python benchmarks/bench_serving.py [--batch 64] [--context 2048] [--layers 4] [--steps 64]
        [--rounds 3] [--use-tensor-cores] [--libraries aotinfer,torch] [--flashinfer DIR] [--greedy-tokens 1024]
        [--out PREFIX]

Model: a Llama-3-8B-shaped decoder with random bf16 weights (hidden 4096, 32 query / 8 KV heads,
head_dim 128, MLP 14336, vocab 128256), page_size 16, no position encoding (the same for every
library). The prompts are 1/4..1 of ``--context`` tokens (ragged), each request's pages scattered
at random in the pool. Libraries:

* aotinfer: its paged prefill and decode wrappers (decode with ``use_cuda_graph=True`` and host
  int32 tables, as a server plans), rmsnorm / fused_add_rmsnorm / silu_and_mul, append_paged_kv_cache
  and top_k_top_p_sampling_from_probs with per-row top_k/top_p and tensor seed/offset.
* flashinfer (``--flashinfer DIR``, modules built by benchmarks/flashinfer_jit.py, and FlashInfer's
  Python package importable): FlashInfer's own paged prefill (``fa2``) and decode wrappers in place
  of aotinfer's, planned and run the same way; the other ops stay aotinfer's (only its attention
  modules are built), so the difference is the attention and its plans. With ``--overlay FAMILIES``
  every one of its calls goes through ``import flashinfer`` with aotinfer's overlay installed for
  those families (``all``: the column is aotinfer through the overlay; ``sampling,norm,activation,
  page``: FlashInfer's attention with aotinfer's other ops, as a server gets with that setting).
* torch: the same loop in torch ops (scaled_dot_product_attention over pages gathered by an index
  made at plan time, torch sampling); the reference of the greedy check.

A prompt batch of more than ``--prefill-tokens`` is prefilled a group of requests at a time (a
synchronize between groups; docs/design/serving.md says why). The tables of a step are prepared on
the host in pinned memory and handed to plan without a
blocking copy, as a server with async scheduling does. Each round runs every library once, the
order alternating between rounds; the table gives the median and the spread (min..max) over
rounds of: prefill ms, graph replay us (GPU, CUDA events), wall us per step (plan + replay, the
host not waiting between steps), tokens/s, eager step us (op by op, no graph), plan us (host), and
the GPU split of an eager step by family (profiler). The greedy check: top_k=1 with a float32 LM
head, each library fed torch's tokens, its tokens against torch's (agreement >= 95%). Figures:
docs/design/serving.md.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HIDDEN, QO_HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, PAGE = 4096, 32, 8, 128, 14336, 128256, 16
EPS = 1e-5
MLP_TOKENS = 1 << 16


# ---- the shared state: weights, prompts, page tables ------------------------------------------


class Model:
    def __init__(self, layers, device, seed=0):
        g = torch.Generator(device=device).manual_seed(seed)

        def w(*shape, scale):
            return (torch.randn(*shape, generator=g, device=device) * scale).to(torch.bfloat16)

        self.embed = w(VOCAB, HIDDEN, scale=1.0)
        self.layers = [
            dict(
                ln1=1 + w(HIDDEN, scale=0.1), ln2=1 + w(HIDDEN, scale=0.1),
                qkv=w(HIDDEN, (QO_HEADS + 2 * KV_HEADS) * HEAD_DIM, scale=HIDDEN**-0.5),
                o=w(QO_HEADS * HEAD_DIM, HIDDEN, scale=(QO_HEADS * HEAD_DIM) ** -0.5),
                gate_up=w(HIDDEN, 2 * MLP, scale=HIDDEN**-0.5), down=w(MLP, HIDDEN, scale=MLP**-0.5),
            )  # fmt: skip
            for _ in range(layers)
        ]
        self.final_ln = 1 + w(HIDDEN, scale=0.1)
        self.lm_head = w(HIDDEN, VOCAB, scale=HIDDEN**-0.5)
        self.lm_head_f32 = None  # made for the greedy check only


class Batch:
    """Prompt lengths, each request's pages (scattered), and the host tables of a step."""

    def __init__(self, batch, context, steps, device, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.batch = batch
        self.prompt = torch.randint(max(context // 4, 1), context + 1, (batch,), generator=g)
        self.max_pages = -(-(self.prompt + steps + 1) // PAGE)
        total = int(self.max_pages.sum())
        self.pool_pages = total + total // 4  # room to scatter the pages; the caches are most of the memory
        pool = torch.randperm(self.pool_pages, generator=g)[:total].to(torch.int32)
        self.page_begin = torch.cat([torch.zeros(1, dtype=torch.long), self.max_pages.cumsum(0)[:-1]])
        self.all_pages = pool  # request b owns all_pages[page_begin[b] : page_begin[b] + max_pages[b]]
        self.tokens = torch.randint(0, VOCAB, (int(self.prompt.sum()),), generator=g).to(device)
        self.device = device

    def tables(self, kv_len, first=0):
        """Pinned int32 host tables (indptr, indices, last_page_len) of requests first.. with these lengths."""
        pages = -(-kv_len // PAGE)
        indptr = torch.zeros(len(kv_len) + 1, dtype=torch.int32)
        indptr[1:] = pages.cumsum(0)
        begins = self.page_begin[first : first + len(kv_len)].tolist()
        take = torch.cat([self.all_pages[begin : begin + p] for begin, p in zip(begins, pages.tolist())])
        last = (kv_len - (pages - 1) * PAGE).to(torch.int32)
        return indptr.pin_memory(), take.pin_memory(), last.pin_memory()


# ---- the libraries ----------------------------------------------------------------------------


class Library:
    """One library's ops over its own KV cache; ``attention`` and the plans differ per library."""

    name = ""

    def __init__(self, model, batch, use_tensor_cores):
        self.model, self.b = model, batch
        device = model.embed.device
        shape = (batch.pool_pages, PAGE, KV_HEADS, HEAD_DIM)
        self.caches = [(torch.zeros(shape, dtype=torch.bfloat16, device=device),
                        torch.zeros(shape, dtype=torch.bfloat16, device=device)) for _ in model.layers]  # fmt: skip
        self.use_tensor_cores = use_tensor_cores
        self.device = device

    # the small ops: aotinfer's unless a library says otherwise (``ops``: the module that has them
    # under FlashInfer's names)
    @property
    def ops(self):
        import aotinfer

        return aotinfer

    def rmsnorm(self, x, w):
        return self.ops.rmsnorm(x, w, EPS)

    def add_rmsnorm(self, x, residual, w):
        self.ops.fused_add_rmsnorm(x, residual, w, EPS)
        return x

    def silu_mul(self, x):
        return self.ops.silu_and_mul(x)

    def sample(self, probs, top_k, top_p, seed, offset):
        return self.ops.top_k_top_p_sampling_from_probs(probs, top_k, top_p, seed=seed, offset=offset)

    def append(self, layer, k, v, step):
        self.ops.append_paged_kv_cache(k, v, step["batch_indices"], step["positions"], self.caches[layer],
                                       step["indices"], step["indptr"], step["last"], "NHD")  # fmt: skip

    def forward(self, x, step, attention):
        """Hidden states [tokens, HIDDEN] through every layer; the final norm's output."""
        residual = x.clone()
        h = self.rmsnorm(x, self.model.layers[0]["ln1"])
        for i, layer in enumerate(self.model.layers):
            qkv = h @ layer["qkv"]
            q, k, v = qkv.split([QO_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
            q = q.reshape(-1, QO_HEADS, HEAD_DIM)
            k, v = k.reshape(-1, KV_HEADS, HEAD_DIM).contiguous(), v.reshape(-1, KV_HEADS, HEAD_DIM).contiguous()
            self.append(i, k, v, step)
            o = attention(i, q.contiguous()).reshape(-1, QO_HEADS * HEAD_DIM) @ layer["o"]
            h = self.add_rmsnorm(o, residual, layer["ln2"])
            # A long prefill's MLP a slice of tokens at a time (its activations would not fit):
            # the same for every library.
            parts = [self.silu_mul(part @ layer["gate_up"]) @ layer["down"] for part in h.split(MLP_TOKENS)]
            d = parts[0] if len(parts) == 1 else torch.cat(parts)
            nxt = self.model.layers[i + 1]["ln1"] if i + 1 < len(self.model.layers) else self.model.final_ln
            h = self.add_rmsnorm(d, residual, nxt)
        return h

    def logits(self, h, greedy):
        if greedy:
            return h.float() @ self.model.lm_head_f32
        return (h @ self.model.lm_head).float()


class AotinferLibrary(Library):
    name = "aotinfer"

    def __init__(self, model, batch, use_tensor_cores):
        super().__init__(model, batch, use_tensor_cores)
        import aotinfer

        b = batch.batch
        pages = int(batch.max_pages.sum())
        self.buffers = dict(
            paged_kv_indptr_buffer=torch.zeros(b + 1, dtype=torch.int32, device=self.device),
            paged_kv_indices_buffer=torch.zeros(pages, dtype=torch.int32, device=self.device),
            paged_kv_last_page_len_buffer=torch.zeros(b, dtype=torch.int32, device=self.device),
        )
        self.decode = aotinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(256 << 20, dtype=torch.uint8, device=self.device), "NHD", use_cuda_graph=True,
            use_tensor_cores=use_tensor_cores, **self.buffers,
        )  # fmt: skip
        self.prefill = aotinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device=self.device), "NHD")

    def plan_prefill(self, qo_indptr, indptr, indices, last):
        self.prefill.plan(qo_indptr, indptr, indices, last, QO_HEADS, KV_HEADS, HEAD_DIM, PAGE, causal=True, q_data_type=torch.bfloat16)

    def prefill_attention(self, layer, q):
        return self.prefill.run(q, self.caches[layer])

    def plan_decode(self, indptr, indices, last):
        self.decode.plan(indptr, indices, last, QO_HEADS, KV_HEADS, HEAD_DIM, PAGE, q_data_type=torch.bfloat16)

    def device_tables(self):
        return self.buffers["paged_kv_indptr_buffer"], self.buffers["paged_kv_indices_buffer"], self.buffers["paged_kv_last_page_len_buffer"]

    def decode_attention(self, layer, q):
        return self.decode.run(q, self.caches[layer])


class FlashInferLibrary(AotinferLibrary):
    """FlashInfer's own paged prefill (``fa2``) and decode wrappers, planned and run as for
    aotinfer, its JIT handed the modules built into ``--flashinfer DIR``; the other ops aotinfer's
    (only FlashInfer's attention modules are built)."""

    name = "flashinfer"

    def __init__(self, model, batch, use_tensor_cores, directory, overlay=None):
        if overlay is not None:  # every op through ``import flashinfer``: these families aotinfer's
            from aotinfer import overlay as aotinfer_overlay

            aotinfer_overlay.install(aotinfer_overlay.parse_families(overlay))  # "all", or family names
        try:
            import flashinfer
        except ImportError as error:
            raise SystemExit(f"--flashinfer needs FlashInfer's Python package importable ({error})")
        from flashinfer_jit import serve_prebuilt

        self.flashinfer = flashinfer if overlay is not None else None

        if use_tensor_cores:
            raise SystemExit("--flashinfer with --use-tensor-cores: only FlashInfer's CUDA-core decode module is built")
        for name in ("decode_d128", "prefill_fa2_d128"):
            if not os.path.exists(os.path.join(directory, name + ".so")):
                raise SystemExit(f"no FlashInfer module {name} in {directory} (benchmarks/flashinfer_jit.py build DIR)")
        serve_prebuilt(directory)
        Library.__init__(self, model, batch, use_tensor_cores)
        b, pages = batch.batch, int(batch.max_pages.sum())
        self.buffers = dict(
            paged_kv_indptr_buffer=torch.zeros(b + 1, dtype=torch.int32, device=self.device),
            paged_kv_indices_buffer=torch.zeros(pages, dtype=torch.int32, device=self.device),
            paged_kv_last_page_len_buffer=torch.zeros(b, dtype=torch.int32, device=self.device),
        )
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(256 << 20, dtype=torch.uint8, device=self.device), "NHD", use_cuda_graph=True, **self.buffers)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            torch.empty(256 << 20, dtype=torch.uint8, device=self.device), "NHD", backend="fa2")

    @property
    def ops(self):
        return self.flashinfer or super().ops

    def plan_prefill(self, qo_indptr, indptr, indices, last):
        self.prefill.plan(qo_indptr, indptr, indices, last, QO_HEADS, KV_HEADS, HEAD_DIM, PAGE, causal=True,
                          q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)  # fmt: skip

    def plan_decode(self, indptr, indices, last):
        self.decode.plan(indptr, indices, last, QO_HEADS, KV_HEADS, HEAD_DIM, PAGE, q_data_type=torch.bfloat16,
                         kv_data_type=torch.bfloat16)  # fmt: skip


class TorchLibrary(Library):
    name = "torch"

    def rmsnorm(self, x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)

    def add_rmsnorm(self, x, residual, w):
        residual.add_(x)
        return self.rmsnorm(residual, w)

    def silu_mul(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def sample(self, probs, top_k, top_p, seed, offset):
        # Per-row top-k then top-p over sorted probabilities, then one draw a row (exponential race).
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(probs.shape[-1], device=probs.device)
        keep = ranks < top_k[:, None]
        kept = sorted_probs * keep
        cum = kept.cumsum(-1) - kept
        keep &= cum < top_p[:, None] * kept.sum(-1, keepdim=True)
        kept = sorted_probs * keep
        noise = torch.empty_like(kept).exponential_()
        return order.gather(-1, (kept / noise).argmax(-1, keepdim=True)).squeeze(-1).to(torch.int32)

    def append(self, layer, k, v, step):
        slots = step["slots"]
        kc, vc = self.caches[layer]
        kc.view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, slots, k)
        vc.view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, slots, v)

    def _gather_index(self, indptr, indices, kv_len):
        """[batch, longest] token slots of each request's keys (0 past its length) and the mask."""
        longest = int(kv_len.max())
        pos = torch.arange(longest)
        page = pos // PAGE
        rows = []
        for b in range(len(kv_len)):
            own = indices[int(indptr[b]) : int(indptr[b + 1])].long()
            row = torch.zeros(longest, dtype=torch.long)
            n = int(kv_len[b])
            row[:n] = own[page[:n]] * PAGE + pos[:n] % PAGE
            rows.append(row)
        mask = pos[None, :] < kv_len[:, None]
        return torch.stack(rows).to(self.device, non_blocking=True), mask.to(self.device, non_blocking=True)

    def plan_prefill(self, qo_indptr, indptr, indices, last):
        self.prefill_spans = qo_indptr.tolist()
        kv_len = ((indptr[1:] - indptr[:-1] - 1) * PAGE + last).long()
        self.prefill_index, _ = self._gather_index(indptr, indices, kv_len)

    def prefill_attention(self, layer, q):
        kc, vc = self.caches[layer]
        out = torch.empty_like(q)
        for b in range(len(self.prefill_spans) - 1):
            s, e = self.prefill_spans[b], self.prefill_spans[b + 1]
            idx = self.prefill_index[b, : e - s]
            # KV heads repeated for the query heads: SDPA's flash kernel then serves a long prompt
            # (its GQA form falls back to materializing the scores).
            k = kc.view(-1, KV_HEADS, HEAD_DIM)[idx].transpose(0, 1).repeat_interleave(QO_HEADS // KV_HEADS, 0)
            v = vc.view(-1, KV_HEADS, HEAD_DIM)[idx].transpose(0, 1).repeat_interleave(QO_HEADS // KV_HEADS, 0)
            o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k, v, is_causal=True)
            out[s:e] = o.transpose(0, 1)
        return out

    def plan_decode(self, indptr, indices, last):
        kv_len = ((indptr[1:] - indptr[:-1] - 1) * PAGE + last).long()
        self.decode_index, self.decode_mask = self._gather_index(indptr, indices, kv_len)

    def decode_attention(self, layer, q):
        kc, vc = self.caches[layer]
        k = kc.view(-1, KV_HEADS, HEAD_DIM)[self.decode_index].permute(0, 2, 1, 3)  # [b, heads, len, dim]
        v = vc.view(-1, KV_HEADS, HEAD_DIM)[self.decode_index].permute(0, 2, 1, 3)
        mask = self.decode_mask[:, None, None, :]
        o = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, enable_gqa=True)
        return o[:, :, 0]


# ---- one library's run: prefill, then decode steps -------------------------------------------


def step_inputs(batch, kv_len, device):
    """The device tensors a decode step reads (updated in place before each replay)."""
    pages = -(-kv_len // PAGE)
    return dict(
        batch_indices=torch.arange(batch.batch, dtype=torch.int32, device=device),
        positions=(kv_len - 1).to(torch.int32).to(device),
        slots=torch.zeros(batch.batch, dtype=torch.long, device=device),
        pages=pages,
    )


def slots_of(batch, indptr, indices, kv_len):
    """The cache slot (page * PAGE + offset) of each request's newest token."""
    pos = kv_len - 1
    page = indices[indptr[:-1].long() + pos // PAGE].long()
    return page * PAGE + pos % PAGE


def request_groups(prompt, most_tokens):
    """Consecutive requests (first, end) whose prompts together hold at most ``most_tokens`` (a
    longer prompt alone)."""
    groups, first, tokens = [], 0, 0
    for i, n in enumerate(prompt.tolist()):
        if i > first and tokens + n > most_tokens:
            groups.append((first, i))
            first, tokens = i, 0
        tokens += n
    return groups + [(first, len(prompt))]


def prefill_group(batch, first, end, device):
    """The prefill inputs of requests first..end-1: their tables, tokens and cache slots."""
    prompt = batch.prompt[first:end]
    indptr, indices, last = batch.tables(prompt, first)
    qo_indptr = torch.zeros(end - first + 1, dtype=torch.int32)
    qo_indptr[1:] = prompt.cumsum(0)
    token_batch = torch.repeat_interleave(torch.arange(end - first, dtype=torch.int32), prompt)
    token_pos = torch.arange(int(prompt.sum())) - torch.repeat_interleave(qo_indptr[:-1].long(), prompt)
    slots = indices[indptr[:-1].long()[token_batch.long()] + token_pos // PAGE].long() * PAGE + token_pos % PAGE
    step = dict(batch_indices=token_batch.to(device), positions=token_pos.to(torch.int32).to(device),
                indices=indices.to(device), indptr=indptr.to(device), last=last.to(device), slots=slots.to(device))  # fmt: skip
    q0 = int(batch.prompt[:first].sum())
    return dict(tables=(qo_indptr, indptr, indices, last), step=step, tokens=batch.tokens[q0 : q0 + int(prompt.sum())],
                last_rows=qo_indptr[1:].long().to(device) - 1)  # fmt: skip


def run_library(lib, model, batch, args, greedy_tokens=None):
    """Prefill, then ``args.steps`` decode steps; returns the measurements (and the tokens)."""
    device = lib.device
    b = batch.batch
    result = {}

    # ---- prefill: every prompt token through the layers, keys and values into the cache, a group
    # of requests at a time (a server's chunked prefill; one group unless --prefill-tokens is exceeded)
    kv_len = batch.prompt.clone()
    groups = [prefill_group(batch, first, end, device) for first, end in request_groups(batch.prompt, args.prefill_tokens)]
    times = []
    for _ in range(2):  # the second is timed (the first loads and plans kernels)
        torch.cuda.synchronize()
        begin = time.perf_counter()
        rows = []
        for group in groups:
            lib.plan_prefill(*group["tables"])
            h = lib.forward(model.embed[group["tokens"]], group["step"], lib.prefill_attention)
            rows.append(h[group["last_rows"]])
            # FlashInfer's prefill plan rewrites its one pinned table buffer while the copy of the
            # group before may still wait in the stream: its tables would be the next group's.
            torch.cuda.synchronize()
        last_rows = torch.cat(rows)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - begin) * 1e3)
    result["prefill ms"] = times[-1]

    # ---- decode: the step as one function of fixed buffers
    greedy = greedy_tokens is not None
    top_k = torch.full((b,), 1 if greedy else 50, dtype=torch.int32, device=device)
    top_p = torch.full((b,), 1.0 if greedy else 0.9, dtype=torch.float32, device=device)
    top_k[::3] = 1 if greedy else 20
    seed = torch.full((1,), 1234, dtype=torch.int64, device=device)
    offset = torch.zeros(1, dtype=torch.int64, device=device)
    tokens = torch.zeros(b, dtype=torch.int32, device=device)
    tokens.copy_(lib.sample(torch.softmax(lib.logits(last_rows, greedy), -1), top_k, top_p, seed, offset))
    if greedy:
        tokens.copy_(greedy_tokens[0])

    kv_len = kv_len + 1
    step = step_inputs(batch, kv_len, device)
    lib.plan_decode(*batch.tables(kv_len))
    step["indptr"], step["indices"], step["last"] = (lib.device_tables() if hasattr(lib, "device_tables") else (None,) * 3)
    out_tokens = torch.zeros(b, dtype=torch.int32, device=device)

    def decode_step():
        h = lib.forward(model.embed[tokens.long()], step, lib.decode_attention)
        probs = torch.softmax(lib.logits(h, greedy), -1)
        out_tokens.copy_(lib.sample(probs, top_k, top_p, seed, offset))
        offset.add_(1)

    def prepare(kv_len):
        """Host tables for this step, then plan; the per-step device inputs copied without a wait."""
        indptr, indices, last = batch.tables(kv_len)
        step["positions"].copy_((kv_len - 1).to(torch.int32).pin_memory(), non_blocking=True)
        step["slots"].copy_(slots_of(batch, indptr, indices, kv_len).pin_memory(), non_blocking=True)
        begin = time.perf_counter()
        lib.plan_decode(indptr, indices, last)
        return time.perf_counter() - begin

    prepare(kv_len)
    decode_step()  # warm up: kernels loaded, workspaces sized
    torch.cuda.synchronize()

    # eager steps (op by op)
    eager = []
    for _ in range(5):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        decode_step()
        torch.cuda.synchronize()
        eager.append((time.perf_counter() - begin) * 1e6)
    result["eager step us"] = statistics.median(eager)
    result["split"] = gpu_split(decode_step)

    use_graph = lib.name != "torch"  # torch's step gathers by a host-made index of changing shape
    if use_graph:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            decode_step()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            decode_step()
        replay = graph.replay
    else:
        replay = decode_step

    plan_times, produced = [], []
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(args.steps)]
    torch.cuda.synchronize()
    wall_begin = time.perf_counter()
    for s in range(args.steps):
        kv_len = kv_len + 1
        plan_times.append(prepare(kv_len))
        if greedy:
            tokens.copy_(greedy_tokens[s + 1], non_blocking=True)
        events[s][0].record()
        replay()
        events[s][1].record()
        produced.append(out_tokens.clone())
        if not greedy:
            tokens.copy_(out_tokens)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - wall_begin) / args.steps
    result["replay us"] = statistics.median(start.elapsed_time(end) * 1e3 for start, end in events)
    result["wall us/step"] = wall * 1e6
    result["tokens/s"] = b / wall
    result["plan us"] = statistics.median(plan_times) * 1e6
    result["tokens"] = torch.stack(produced).cpu()
    return result


FAMILIES = [("attention", ("decode", "prefill", "attention", "fmha", "sdpa", "flash")), ("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "ampere")),
            ("norm", ("norm",)), ("activation", ("silu", "act")), ("sampling", ("sampl", "topk", "top_k", "sort", "radix", "exponential", "argmax")),
            ("cache append", ("append", "index_copy", "scatter"))]  # fmt: skip


def gpu_split(step, repeat=3):
    """GPU us per step by kernel family (profiler, eager steps)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            step()
        torch.cuda.synchronize()
    split = {}
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if not total or event.key.startswith("ProfilerStep"):
            continue
        name = event.key.lower()
        family = next((f for f, keys in FAMILIES if any(k in name for k in keys)), "other")
        split[family] = split.get(family, 0.0) + total / repeat
    return split


# ---- rounds, the table and the chart ---------------------------------------------------------

COLUMNS = ["prefill ms", "replay us", "wall us/step", "tokens/s", "eager step us", "plan us"]


def spread(values):
    values = [v for v in values if v == v]
    if not values:
        return "-"
    med = statistics.median(values)
    fmt = (lambda v: f"{v:,.0f}") if med >= 100 else (lambda v: f"{v:.1f}")
    return f"{fmt(med)} ({fmt(min(values))}..{fmt(max(values))})" if len(values) > 1 else fmt(med)


def greedy_agreement(libraries, model, batch, args):
    """Each library's greedy tokens (top_k=1, float32 LM head, fed torch's tokens) against torch's."""
    model.lm_head_f32 = model.lm_head.float()
    steps_backup = args.steps
    args.steps = args.greedy_steps
    feed = torch.randint(0, VOCAB, (args.greedy_steps + 1, args.batch), device=model.embed.device, dtype=torch.int32)
    torch_library = libraries.get("torch") or TorchLibrary(model, batch, False)  # its caches: one set is enough
    reference = run_library(torch_library, model, batch, args, greedy_tokens=feed)["tokens"]
    agreement = {}
    for name, library in libraries.items():
        if name != "torch":
            got = run_library(library, model, batch, args, greedy_tokens=feed)["tokens"]
            agreement[name] = float((got == reference).float().mean())
    args.steps = steps_backup
    model.lm_head_f32 = None
    return agreement


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048, help="the longest prompt (prompts: 1/4..1 of it)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--use-tensor-cores", action="store_true")
    parser.add_argument("--libraries", default="aotinfer,torch")
    parser.add_argument("--flashinfer", metavar="DIR", help="FlashInfer's modules (flashinfer_jit.py build): adds 'flashinfer'")
    parser.add_argument("--overlay", metavar="FAMILIES",
                        help="with --flashinfer: its column makes every call through `import flashinfer` with aotinfer's "
                             "overlay serving these families (all: every one; e.g. sampling,norm,activation,page: "
                             "FlashInfer's attention with aotinfer's other ops)")  # fmt: skip
    parser.add_argument("--prefill-tokens", type=int, default=1 << 17, help="the most prompt tokens prefilled at once")
    parser.add_argument("--greedy-tokens", type=int, default=1024, help="tokens compared (steps x batch); 0: no check")
    parser.add_argument("--out", default="bench_serving", help="PREFIX.md and PREFIX.png")
    args = parser.parse_args()

    device = torch.device("cuda")
    names = args.libraries.split(",")
    if args.flashinfer and "flashinfer" not in names:
        names.insert(1, "flashinfer")
    model = Model(args.layers, device)
    args.greedy_steps = -(-args.greedy_tokens // args.batch)
    batch = Batch(args.batch, args.context, max(args.steps, args.greedy_steps) + 2, device)

    def make(name):
        if name == "aotinfer":
            return AotinferLibrary(model, batch, args.use_tensor_cores)
        if name == "flashinfer":
            return FlashInferLibrary(model, batch, args.use_tensor_cores, args.flashinfer, args.overlay)
        if name == "torch":
            return TorchLibrary(model, batch, args.use_tensor_cores)
        raise SystemExit(f"unknown library {name!r}")

    libraries = {name: make(name) for name in names}
    results = {name: [] for name in names}
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            res = run_library(libraries[name], model, batch, args)
            results[name].append(res)
            print(f"round {r} {name}: " + ", ".join(f"{c} {res[c]:.1f}" for c in COLUMNS), flush=True)

    # greedy check: top_k=1, float32 LM head, every library fed torch's tokens (--greedy-tokens 0: none)
    agreement = {}
    if args.greedy_steps > 0:
        agreement = greedy_agreement(libraries, model, batch, args)

    title = (f"Serving loop: batch {args.batch}, prompts {args.context // 4}..{args.context} tokens "
             f"({int(batch.prompt.sum()):,} in the prefill), {args.layers} layers, {args.steps} decode steps, "
             f"{args.rounds} rounds, use_tensor_cores={args.use_tensor_cores}, {torch.cuda.get_device_name()}"
             + (f"; the flashinfer column through `import flashinfer`, aotinfer's overlay serving {args.overlay}"
                if args.overlay else ""))  # fmt: skip
    lines = [f"# {title}", "", "Median (min..max) over rounds.", "",
             "| library | " + " | ".join(COLUMNS) + " | greedy agreement |", "|---" * (len(COLUMNS) + 2) + "|"]  # fmt: skip
    for name in names:
        cells = [spread([res[c] for res in results[name]]) for c in COLUMNS]
        cells.append(f"{agreement[name]:.1%}" if name in agreement else "(reference)" if agreement and name == "torch" else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    families = sorted({f for name in names for res in results[name] for f in res["split"]})
    lines += ["", "GPU us per eager step by family (median over rounds):", "",
              "| library | " + " | ".join(families) + " |", "|---" * (len(families) + 1) + "|"]  # fmt: skip
    for name in names:
        lines.append(f"| {name} | " + " | ".join(
            f"{statistics.median([res['split'].get(f, 0.0) for res in results[name]]):.0f}" for f in families) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out + ".md", "w") as f:
        f.write(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no chart)")
    else:
        fig, axes = plt.subplots(1, 4, figsize=(16, 4))
        for ax, column in zip(axes, ["tokens/s", "replay us", "plan us", "prefill ms"]):
            values = [statistics.median([res[column] for res in results[n]]) for n in names]
            ax.bar(names, values, color=["tab:blue", "tab:orange", "tab:gray", "tab:green"][: len(names)])
            ax.set_title(column)
        fig.suptitle(title, fontsize=8)
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=120)
        print(f"wrote {args.out}.md and {args.out}.png")
    failed = {n: a for n, a in agreement.items() if a < 0.95}
    if failed:
        sys.exit(f"greedy agreement with torch below 95%: {failed}")


if __name__ == "__main__":
    main()
