"""The eval stage (accuracy, simulated and real accept length, cost model, plots) and bench-serve (live servers measured)."""
