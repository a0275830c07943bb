"""The eval stage (accuracy, simulated and real accept length, cost model, plots) and the export stage."""
