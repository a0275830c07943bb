"""The EAGLE-3 drafter itself: the model (SGLang's LlamaForCausalLMEagle3 numerics), the attention caches its
step reads through (TTT in training, KV at inference), its config contract
(DrafterConfig, every key an engine reads, what particular values do), drafter directories on disk with the
drafter <-> target compatibility check, the draft vocabulary and its mapping, the lm_head remap to a new
vocabulary, the image-row embedding convention, and the drafter training starts from (initial.py).
"""
