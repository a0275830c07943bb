"""The orchestrators that run several stages in one go: the demo (every stage on the mini world and the
K2-vs-K2.5 comparison), the study (seeds x inits, curves, knobs) and the learning-quality A/B. The one
folder allowed to import several stage folders (data/, train/, eval/, export/): it imports their run
functions directly, the same functions and typed configs their entry scripts use."""
