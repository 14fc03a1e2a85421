"""The building blocks the families share: the dense decoder (decoder.py), RoPE (rope.py) and
the mixture-of-experts block (moe.py). What is one family's own lives in its folder
(ridge/models/<family>/), and no string here names a family (tests/test_registry.py)."""
