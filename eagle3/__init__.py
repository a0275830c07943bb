"""EAGLE-3 drafter fine-tuning: core library (model, math, stores) importable with torch alone."""
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
__version__ = "0.1.0"
