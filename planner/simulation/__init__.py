"""The torch-free model of a training step's memory: the simulator and CUDA's caching allocator.

Stage 1 of planner/'s packages (docs/layout.md). It owns what a schedule costs on an activation graph
without running anything: `step` replays a schedule (live bytes, recompute time, the peak and its phase,
NOTE [selective keeps]), pricing each checkpointed region's replay in backward with `replay`, on the graph
of the micro-batch that `micro_batches` makes of a profiled one (NOTE [accumulated gradients]), recording
its allocations in order in an `allocation_log`; `allocator` replays a step's allocations through a model of
PyTorch's caching allocator (reserved bytes, fragmentation) under the options of `allocator_conf`
(PYTORCH_CUDA_ALLOC_CONF), and `reserved` puts the two together: a schedule's allocations in the simulator's
order, through the allocator model, for its reserved peak and its predicted memory snapshot. `pipeline`
walks one stage of a pipeline schedule, its micro-batches in flight and the schedule's buffers, over
`step`'s replays (NOTE [stage memory]).

It may import planner.ir and planner.errors, and nothing else of the planner: the profiler calibrates
against it, the solvers search with it, the report explains with it and the service runs it, so it never
imports torch, fx or a later stage.
"""
