"""The train stage: accelerate training loop over captured hidden states (entry: train/run.py)."""
