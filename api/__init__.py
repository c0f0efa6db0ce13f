"""The planner's REST service: solve posted activation graphs (`planner.graph/v1`) into plans.

`main.create_app` builds the FastAPI app. The modules below it keep to one job each: `settings`
(environment variables), `schemas` (the wire format), `jobs` (the SQLite job store) and `worker` (the
bounded solver pool), `limits`, `metrics` and `errors` (cross-cutting HTTP concerns), `deps` (dependency
aliases) and `routers/` (one router per resource). `jobs` and `worker` do not import FastAPI, so they
can be tested and reused without a web stack. Nothing here imports torch.
"""
