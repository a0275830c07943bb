"""File formats the stages write and read: the hidden-state store (format, writer, reader, fp8 rows), stage
manifests and the reuse check, the train checkpoint format (checkpoints.py; train/checkpointing.py writes and
resumes), and the Kimi-K2.5 release's own checkpoint format. What an exported drafter directory must
contain is export's alone (export/spec.py).
"""
