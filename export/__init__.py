"""The export stage and `make check`: a trained drafter checkpoint -> the directories SGLang and vLLM serve
(export/stage.py, entry export/run.py), one module per serving format behind the ExportFormat table
(export/formats.py), and the drafter-vs-target check the export and a training run's init rely on
(export/run_check.py)."""
