"""The target model: its text config and single tensors read straight from its checkpoint, loading it with hooks
on the aux hidden states, and its image path (Kimi-K2.5's preprocessing, the vision tower's fused input rows; the media tokens are
eagle3/media_tokens.py's).
"""
