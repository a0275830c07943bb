"""A drafter replayed on stored target sequences (no target forward): teacher-forced accuracy per
TTT step and SGLang's accept length, drafting chains and trees from a hidden-state store.

Shared by the eval stage (eval/stage.py), training's periodic validation (train/validate.py) and
the study; imports only torch and eagle3 core modules.

  drafter_session.py  the real drafter behind accept_sim's StepDrafter protocol, one sequence
  tree_batch.py       SGLang's draft trees of every cycle start of a sequence in one batch
  evaluate.py         evaluate_drafter / simulate_accept_length / teacher_forced_accuracy
  accept_sim.py       SGLang-convention accept-length replay (chain + tree); ngram.py the model-free baseline
  cost_model.py       speed-up prediction from accept length and step costs (a server's Latencies and presets:
                      eagle3/engines/serve_costs.py); cost_fit.py the split fitted from a server's timings;
                      knob_grid.py the knob settings a search prices
"""
