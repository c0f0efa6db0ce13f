"""`compile=True`: the step `torch.compile` runs, planned inside inductor and compiled as planned.

Stage 8 of planner/'s packages (docs/layout.md). It owns planning the compiled step rather than the
eager one: `optimize_compiled` and `plan_compiled_step`, the partitioner hook that solves the joint
graph and installs the saved set (`optimize`), the ActivationGraph built from AOT autograd's joint graph
(`joint_graph`), the one pass that reads the joint graph's storages, saved values and kernel reads
(`joint_reader`), which values inductor stores as buffers (`fusion`), which operators form one node and
which a plan may checkpoint (`groups`), the order the backward runs its kernels in and what each node's
backward step holds in that order (`backward_order`), the scratch an extern kernel allocates inside a
call (`kernel_scratch`), a step dynamo splits, planned eagerly and compiled as planned (`split_step`),
and the example call compiled, run and measured (`step`).

It may import every earlier stage (the contract, planner.simulation, planner.capture, planner.profiler,
planner.solvers, planner.rewrite, planner.report, planner.planning) and torch; only the one-call entry
points (planner.one_call, for `optimize(..., compile=True)`) and later stages import it, so
`import planner` never loads it.
"""
