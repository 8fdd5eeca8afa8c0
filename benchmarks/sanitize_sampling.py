"""A small call of every sampling kernel, for compute-sanitizer (memcheck, racecheck): split rows
(the searched samplers' shared candidates too), unsplit rows, the multi-pass path, misaligned rows,
16-bit logits and top-k renorm rows, softmax held in registers (both block sizes) and read twice (misaligned), draws by
rejection (top-p's dense bins, min-p's large kept sets), top-p's verified draws and their misses,
the top-p renormalization of peaked rows and its window, top-k first from logits in one kernel, the
plain draw by chunk masses."""
import torch

import aotinfer

torch.manual_seed(0)
for rows, vocab in ((2, 1001), (200, 4099)):
    probs = torch.softmax(torch.randn(rows, vocab, device="cuda") * 2, -1)
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
    aotinfer.top_k_top_p_sampling_from_probs(probs, 20, 0.8)
    aotinfer.top_k_top_p_sampling_from_probs(probs, 20, 0.8, filter_apply_order="joint")
    aotinfer.top_p_sampling_from_probs(probs[:, 1:], 0.5)
    aotinfer.top_p_sampling_from_probs(probs, 0.5)  # verified draws
    aotinfer.top_p_sampling_from_probs(probs, 0.1)
    aotinfer.min_p_sampling_from_probs(probs, 0.1)
    aotinfer.sampling_from_probs(probs[:, :1000].contiguous())  # by the chunks' masses (rows of 4000 bytes: aligned)
    aotinfer.sampling_from_logits(logits)
    aotinfer.top_k_renorm_probs(probs, 7)
    aotinfer.top_k_renorm_probs(probs.half(), 7)  # 16-bit rows in their dtype
    aotinfer.top_k_renorm_probs(probs.bfloat16()[:, 1:], 7)
    aotinfer.top_p_renorm_probs(probs, 0.7)
    aotinfer.top_k_mask_logits(logits, 9)
    aotinfer.softmax(logits, 0.7)
    aotinfer.softmax(logits[:, 1:], 0.7)
    aotinfer.top_k_sampling_from_probs(probs, 30)
    aotinfer.top_k_top_p_sampling_from_probs(probs, torch.full((rows,), 40, device="cuda", dtype=torch.int32), 0.6)
aotinfer.softmax(torch.randn(600, 4099, device="cuda"))  # enough blocks for the 1024-thread blocks
flat = torch.full((2, 20000), 1 / 20000, device="cuda")
aotinfer.top_k_top_p_sampling_from_probs(flat, 15000, 0.5)
aotinfer.top_k_top_p_sampling_from_probs(flat, 50, 0.5)  # the k-th largest's bin too full to gather: more passes
aotinfer.top_p_sampling_from_probs(flat, 0.2)  # a dense bin: the draw by rejection
aotinfer.top_p_sampling_from_probs(flat, torch.full((2,), 0.2, device="cuda"))  # the same in the draws' kernel
aotinfer.top_p_sampling_from_probs(flat, 0.9)  # verified draws over a split row
missed = torch.full((64, 70000), 0.7 / 69997, device="cuda")
missed[:, :3] = torch.tensor([0.15, 0.1, 0.05], device="cuda")
aotinfer.top_p_sampling_from_probs(missed, 0.27)  # draws that miss, then the histogram path
aotinfer.min_p_sampling_from_probs(flat, 0.1)  # a large kept set: the draw by rejection
aotinfer.min_p_sampling_from_probs(flat[:, 1:], 0.1)
peaked = torch.softmax(torch.randn(2, 20000, device="cuda") * 3, -1)
aotinfer.min_p_sampling_from_probs(peaked, 0.1)  # few accepted proposals: the race in a second pass
aotinfer.top_k_top_p_sampling_from_probs(peaked, 50, 0.9)  # the samplers' floor from 16384: it holds
aotinfer.top_k_top_p_sampling_from_probs(peaked, 50, 0.9, filter_apply_order="joint")
aotinfer.min_p_sampling_from_probs(peaked[:, None].expand(2, 2000, 20000).reshape(4000, 20000), 0.1)  # gathered
aotinfer.top_p_renorm_probs(peaked, 0.9)  # a peaked row's threshold bin gathered, split rows
aotinfer.top_p_renorm_probs(peaked[:, None].expand(2, 200, 20000).reshape(400, 20000), 0.9)  # and whole
# Rows beyond the L2: top-k's candidates gathered above a sampled floor, and rows where it misses.
wide = torch.softmax(torch.randn(2, 65536, device="cuda") * 3, -1)
wide[1] = 1 / 65536  # equal values: the floor gathers the whole row, too many to hold
wide = wide[:, None].expand(2, 128, 65536).reshape(256, 65536)
aotinfer.top_k_top_p_sampling_from_probs(wide, 50, 0.9)
aotinfer.top_k_top_p_sampling_from_probs(wide, 50, 0.9, filter_apply_order="joint")
# More rows than SMs through indices: each block prefetches the row its SM likely takes next.
# From logits in one kernel: the floor (split rows and whole ones), the probabilities written in
# the kernel where top-k keeps the row or the floor gathers too many, a NaN row.
wide_logits = torch.log(wide)
wide_logits[128, 5] = float("nan")
aotinfer.top_k_top_p_sampling_from_logits(wide_logits[::128], 50, 0.9)
aotinfer.top_k_top_p_sampling_from_logits(wide_logits, 50, 0.9)
aotinfer.top_k_top_p_sampling_from_logits(wide_logits[::128], 65536, 0.9)
two_rows = torch.arange(300, device="cuda", dtype=torch.int32) % 2
aotinfer.top_k_top_p_sampling_from_probs(wide[::128], 50, 0.9, indices=two_rows)
aotinfer.top_k_renorm_probs(wide, 50)
aotinfer.top_k_renorm_probs(wide.bfloat16(), 50)
aotinfer.top_k_mask_logits(torch.log(wide), 50)
# The top-p renormalization of rows beyond the L2: the window gathered in the first pass, where it
# holds the threshold's bin (peaked rows) and where it overflows (the equal values), whole and split.
beyond = torch.cuda.get_device_properties(0).L2_cache_size // (65536 * 4) // 2 + 1
aotinfer.top_p_renorm_probs(wide[::128].repeat(beyond, 1), 0.9)
spread = torch.softmax(torch.randn(2, 262144, device="cuda"), -1)
aotinfer.top_p_renorm_probs(spread.repeat(beyond // 4 + 1, 1), 0.9)
torch.cuda.synchronize()
print("sanitize_sampling: done")
