"""Training numerics: the training-time-test (TTT) attention over draft steps (attention.py, ttt_flash.py), the
reference and fast unrolls and what they share, the kernels behind the fast path (fast_kernels, Triton),
weight gradients summed in fp32 (wgrad), the fused lm_head + soft cross-entropy and the training objective
(loss).
"""
