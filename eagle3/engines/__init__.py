"""What the serving engines read, say and need, each fact in one home: which target hidden states a drafter's
layer ids mean under each engine's rule (aux_layers), what live SGLang / vLLM servers report of speculation,
vLLM's hidden-state extraction protocol, and the launch lines a drafter is served with.
"""
