"""Fixtures for checking the planner, shipped with it as `torch.testing` ships with torch.

Why it exists: the tests, the service tests, the benches and the notebooks share things that are not
the planner itself: the real models it must plan unedited (`zoo_real`, which builds Hugging Face models
and so needs the `dev` extra's `transformers`), the DAG-shaped models (`zoo_dag`), every hand method
we can run, built one way for tests and benches (`hand_methods`), a net of odd sizes for the byte
counting (`odd_sizes`), activation graphs built without torch and the brute-force oracle over their
schedules (`synthetic_graphs`, which the service's tests and its container smoke test use where torch
is absent), the one-training-step comparison that checks a changed module against the original
(`steps`), and the spawned ranks of a real gloo process group that data-parallel plans are measured in
(`ranks`).

The last stage of planner/'s packages (docs/layout.md): it may import anything of the planner, and
nothing in the planner imports it.
"""
