"""Training numerics: the fast training-time-test (TTT) attention kernel (ttt_flash.py; the caches it matches
are the drafter's, eagle3/drafter/attention.py), the reference and fast unrolls and what they share, the kernels behind the fast path (fast_kernels, Triton),
weight gradients summed in fp32 (wgrad), the fused lm_head + soft cross-entropy and the training objective
(loss).
"""
