"""The report: a solved plan explained in text, pictures and code, and hand checkpoints beside it.

Stage 6 of planner/'s packages (docs/layout.md). It owns what people read about a plan: the summary
(`summary`), the levers to pull when checkpointing cannot help, estimated (`levers`), a compiled plan
beside an eager one (`comparison`), pictures of memory over the step and of the frontier (`plots`,
matplotlib loaded on a call), the plan as Hugging Face kwargs or a `torch.utils.checkpoint` snippet
(`export`), a run of nodes in the model's module names (`naming`), the model's stack of repeated blocks
(`blocks`), and the checkpointing people apply by hand, predicted by the same simulator
(`hand_checkpoints`).

It may import the contract (planner.ir, planner.errors), planner.simulation and planner.solvers: it
reads a `SolvedPlan`, never `Plan`, so the plan's presentation methods import it and not the reverse.
Nothing here imports torch at import time, so the service can render a posted graph's plan.
"""
