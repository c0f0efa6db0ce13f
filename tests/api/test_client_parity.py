"""`PlannerClient.optimize` is `planner.optimize` with the solve done by a real `planner serve`
(uvicorn on 127.0.0.1, a subprocess): the same arguments, the same errors, the same plan, on every
zoo family (a Hugging Face model captured by torch.export, an FX model, a model planned by its
submodules, keyword inputs).

Measured node times move between profiling runs, so the plans are compared on one profile (the
solve is what differs between the two paths), and the end-to-end calls use the analytic cost model,
whose times are the same in every run.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest

import planner
from planner import zoo
from planner.client import PlannerClient
from planner.testing.steps import assert_same_step, one_step
from planner.testing.zoo_real import HUGGING_FACE, REAL_ZOO, build_call
from tests.api.service_helpers import free_port, running_server

FAMILIES = ["hf_gpt2", "resnet", "branching_root", "keyword_dataclass"]
HAS_TRANSFORMERS = importlib.util.find_spec(HUGGING_FACE) is not None


def families(names: list[str]) -> list[object]:
    skip = pytest.mark.skip(reason="needs transformers (pip install -e '.[dev]')")
    return [
        pytest.param(name, marks=[skip] if REAL_ZOO[name].requires and not HAS_TRANSFORMERS else [])
        for name in names
    ]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    with running_server(tmp_path_factory.mktemp("service") / "jobs.sqlite3", port=port, workers=2):
        yield f"http://127.0.0.1:{port}"


def _middle(profile: planner.Profile) -> int:
    frontier = profile.pareto(points=2, solver="dp")
    return (frontier.min_peak_bytes + frontier.baseline_peak_bytes) // 2


@pytest.mark.parametrize("name", families(FAMILIES))
def test_the_client_plans_every_family_as_optimize_does(service: str, name: str) -> None:
    call = build_call(name)
    by_graph = REAL_ZOO[name].capture != "module"
    # The module level needs measured times; the others are compared end to end on analytic ones.
    options = {"cost_model": "analytic", "device": "cpu"} if by_graph else {}
    profile = planner.profile(call.model, call.args, example_kwargs=call.kwargs, **options)
    budget = _middle(profile)
    local = profile.plan(budget_bytes=budget, solver="dp")
    with PlannerClient(service) as client:
        remote = client.plan_profile(profile, budget_bytes=budget, solver="dp")
        with pytest.raises(planner.InfeasibleBudget) as remote_error:
            client.plan_profile(profile, budget_bytes=local.min_peak_bytes - 1, solver="dp")
        if by_graph:
            end_to_end = client.optimize(
                call.model, call.args, example_kwargs=call.kwargs, budget_bytes=budget, solver="dp", **options
            )
            assert end_to_end.graph == local.graph and end_to_end.schedule == local.schedule
    assert remote.schedule == local.schedule and remote.schedule.checkpointed
    assert remote.module is not None and remote.profile is profile
    assert remote_error.value.min_peak_bytes == local.min_peak_bytes
    expected = one_step(call.model, call.args, kwargs=call.kwargs)
    assert_same_step(expected, one_step(remote.module, call.args, kwargs=call.kwargs))


def test_the_module_level_and_the_training_step_go_through_the_client(service: str) -> None:
    call = build_call("branching_root")
    step = planner.TrainingStep(accumulation_steps=2, max_grad_norm=1.0)
    with PlannerClient(service) as client:
        plan = client.optimize(call.model, call.args, budget_gb=1, step=step, world_size=2, sharding="ddp")
    assert plan.capture == "module" and plan.graph.step == step and plan.module is not None
    assert plan.graph.static.resident_gradient_bytes > 0, "accumulation keeps gradients alive"


def test_bad_arguments_fail_as_in_optimize_before_anything_is_sent(tmp_path: Path) -> None:
    call = build_call("resnet")
    nowhere = PlannerClient("http://127.0.0.1:9", retries=0)
    with pytest.raises(ValueError, match="positive, got -1"):
        nowhere.optimize(call.model, call.args, budget_gb=-1)
    with pytest.raises(ValueError, match="solver='magic'"):
        nowhere.optimize(call.model, call.args, budget_gb=1, solver="magic")
    with pytest.raises(ValueError, match="sharding='zero'"):
        nowhere.optimize(call.model, call.args, budget_gb=1, sharding="zero")
    with pytest.raises(TypeError, match="example_inputs"):
        nowhere.optimize(call.model, {"x": call.args[0]}, budget_gb=1)


def test_client_optimize_takes_exactly_optimizes_arguments() -> None:
    client_parameters = list(inspect.signature(PlannerClient.optimize).parameters.values())[1:]
    assert client_parameters == list(inspect.signature(planner.optimize).parameters.values())


def test_the_client_refuses_tensor_parallel_planning_before_profiling() -> None:
    client = PlannerClient("http://127.0.0.1:9")  # never reached: the refusal comes first
    model, inputs = zoo.build_model("seed000_mlp")
    with pytest.raises(ValueError, match="tensor_parallel=mesh.*in every rank"):
        client.optimize(model, inputs, budget_gb=1, tensor_parallel=object())  # type: ignore[arg-type]


def test_the_client_refuses_compiled_planning_before_profiling() -> None:
    client = PlannerClient("http://127.0.0.1:9")  # never reached: the refusal comes first
    model, inputs = zoo.build_model("seed000_mlp")
    with pytest.raises(ValueError, match=r"compile=True\) is not supported.*planner\.optimize"):
        client.optimize(model, inputs, budget_gb=1, compile=True)
