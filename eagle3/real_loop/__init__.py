"""A real speculative-decoding loop: the target (transformers) verifies the drafter's drafts with real
forward passes, greedy, batch 1, and the check that it is lossless and agrees with the replay.

Used by the eval stage (eval/stage.py) and the study; imports torch, transformers (through the
target model) and eagle3 core only.

  chain.py  greedy decode (the baseline) and chain speculative decode (topk = 1)
  tree.py   tree speculative decode (topk > 1): SGLang's draft tree verified by one tree-masked forward
  check.py  real_vs_simulated: the real loop against the replay (eagle3/replay) and the cost model
"""
