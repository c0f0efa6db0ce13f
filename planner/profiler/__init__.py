"""The profiler: a captured fx graph run for one training step and turned into an ActivationGraph.

Stage 3 of planner/'s packages (docs/layout.md). It owns what the solvers plan on: the profiling
interpreter that runs the captured graph node by node and builds the activation graph (`interpreter`),
the calibration of its measured peaks into workspaces (`calibration`), its per-node records (`records`),
the calls it splits at their submodules (`split_calls`), counting bytes as the device counts them, in one
counting per graph (`counting`), measuring a real training step (`measurement`), the parameters,
gradients and optimizer state around the activations (`static_memory`), the analytic cost model and named
cards (`cost_model`), attention as a GPU's fused kernels run it on the meta device (`attention`), the
price of selective keeps (`selective_cost`), a graph sharded per rank (`sharding`), what a rank under DDP
or FSDP2 holds as the measurement counts it (`rank_memory`) and a measured memory snapshot (`snapshots`).

It may import the contract (planner.ir, planner.errors), planner.simulation (calibration turns measured
peaks into workspaces against the simulator) and planner.capture, and torch; the solvers never import it,
and the rewrite, the report and the planning of a model import it.

It is `profiler`, not `profile`: `planner.profile` is a public function, and a package of that name would
replace it on the `planner` module once imported (tests/test_layout.py).
"""
