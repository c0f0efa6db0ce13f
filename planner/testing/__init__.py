"""Fixtures for checking the planner, shipped with it as `torch.testing` ships with torch.

Why it exists: the tests, the service tests, the benches and the notebooks share two things that are
not the planner itself: the real models it must plan unedited (`zoo_real`, which builds Hugging Face
models and so needs the `dev` extra's `transformers`) and the one-training-step comparison that
checks a changed module against the original (`steps`). The library never imports this package.
"""
