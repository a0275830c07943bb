"""EAGLE-3 drafter fine-tuning: core library (model, math, stores) importable with torch alone.

Subpackages, by concern: drafter/ (the model, its config contract and files, vocab), ttt/ (training numerics),
formats/ (store, manifests, checkpoints, export layout, release format), engines/ (what SGLang / vLLM read and
say), target_model/ (the target model and its images), replay/ (what a served drafter would do, without a server),
real_loop/ (the real speculative loop), config/ (Hydra plumbing, schemas, choices). errors, hooks, world,
media_tokens (Kimi-K2.5's image tokens) and cpu_threads are the cross-cutting rest.
"""
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
__version__ = "0.1.0"
