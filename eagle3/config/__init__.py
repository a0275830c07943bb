"""Config plumbing and defaults: Hydra composition and the stage-path resolver (conf.py), the typed schema of
every stage's config (schema/), every choice list once (choices.py), every `auto` resolved once (resolve.py), the spool's watermarks (watermarks.py)
and the one dtype table (dtypes.py).
"""
