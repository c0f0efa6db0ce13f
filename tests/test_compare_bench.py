"""bench/compare.py's verdicts and tables (bench/compare_report.py), its compiled-step measurement
(bench/compare_measurement.py), and the prediction verdicts it shares with bench/compiled_check.py.

The benchmark itself runs for minutes and asserts nothing; these check what its tables say (the
done-when verdict of each of our rows, the list of misses, the JSON round trip) and that the
allocator-event count it uses for compiled steps agrees with `planner.measure` on an eager step and
does see compiled code running.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import math
import random
from dataclasses import asdict
from typing import Any

import pytest
import torch
from torch import nn

import planner
from bench import compare, compiled_check, peers
from bench import compare_measurement as measurement
from bench import compare_report as report
from bench import prediction_verdicts as verdicts
from planner.profiler.measurement import default_loss
from planner.testing.steps import StepRecord, gradient_mismatch, one_step, with_run_to_run_noise
from planner.testing.zoo_real import ExampleCall
from planner.testing.zoo_sized import SIZED_ZOO

MIB = 2**20


def fake_result() -> Any:
    """One model: no checkpointing, a peer, ours within budget and faster, ours over budget and slower."""
    row, mode, family = report.Row, report.Mode.EAGER, report.Family
    rows = [
        row(method=report.NO_CHECKPOINTING, mode=mode, family=family.BASELINE, peak_bytes=40 * MIB,
            time_ratio_vs_none=1.0, round_ratios_vs_none=[1.0, 1.0, 1.0], gradients_equal=True),
        row(method="every block", mode=mode, family=family.PEER, peak_bytes=30 * MIB, time_ratio_vs_none=1.3,
            round_ratios_vs_none=[1.3, 1.2, 1.4], gradients_equal=True),
        row(method="ours", mode=mode, family=family.OURS, peer="every block", solver="dp",
            budget_bytes=30 * MIB, peak_bytes=29 * MIB, within_budget=True, time_ratio_vs_none=1.1,
            round_ratios_vs_none=[1.1, 1.08, 1.5], gradients_equal=True),
        row(method="ours", mode=mode, family=family.OURS, peer="every block", solver="ilp",
            budget_bytes=30 * MIB, peak_bytes=31 * MIB, within_budget=False, time_ratio_vs_none=1.43,
            round_ratios_vs_none=[1.43, 1.32, 1.54], gradients_equal=False,
            gradient_mismatch="gradient 3 differs"),
        row(method="sqrt(n) segments", mode=mode, family=family.PEER, not_applicable="no block container"),
    ]  # fmt: skip
    return report.ModelResult(name="tiny", device="cpu", rows=rows)


def context() -> dict[str, object]:
    return {
        "device": "cpu",
        "quick": True,
        "rounds": 3,
        "total_s": 60.0,
        "command": ["python", "-m", "bench.compare", "--quick"],
        "machine": {
            "processor": "x86_64",
            "cpu_count": 2,
            "torch_version": torch.__version__,
            "load_average_1_5_15_min": [1.0, 1.0, 1.0],
        },
    }


def test_ours_matches_a_peer_only_within_its_budget_and_no_slower() -> None:
    result = fake_result()
    dp, ilp = result.rows[2], result.rows[3]
    assert report.time_vs_peer(dp, result.rows) == pytest.approx(1.08 / 1.2), "the median of per-round ratios"
    assert report.matches_peer(dp, result.rows) is True
    assert report.time_vs_peer(ilp, result.rows) == pytest.approx(1.1)
    assert report.matches_peer(ilp, result.rows) is False
    assert report.spread_text(dp, result.rows) == "rounds 0.85-1.07"
    assert report.spread_text(ilp, result.rows) == "rounds 1.10-1.10"
    assert report.matches_peer(result.rows[1], result.rows) is None, "a peer is not judged against itself"


def test_a_plan_that_trains_otherwise_matches_no_peer_and_is_tallied_for_it() -> None:
    result = fake_result()
    dp = result.rows[2]
    dp.gradients_equal = False
    assert report.matches_peer(dp, result.rows) is False, "within the peak and faster, but wrong"
    counts = report.tally([result], report.Mode.EAGER, "dp")
    assert (counts.matched, counts.ours_trains_otherwise, counts.slower, counts.over_peak) == (0, 1, 0, 0)
    dp.gradients_equal, dp.buffers_equal = True, False
    assert report.matches_peer(dp, result.rows) is False, "BatchNorm statistics updated twice"
    assert report.tally([result], report.Mode.EAGER, "dp").ours_trains_otherwise == 1


def test_a_median_above_the_peer_is_slower_only_when_its_interval_is() -> None:
    result = fake_result()
    dp, peer = result.rows[2], result.rows[1]
    dp.within_budget = True
    peer.round_ratios_vs_none = [1.0] * 15
    dp.round_ratios_vs_none = [0.97, 0.98, 0.99, 1.0, 1.01, 1.01, 1.02, 1.02, 1.02, 1.03, 1.03, 1.04, 1.05]
    dp.round_ratios_vs_none += [1.06, 1.08]
    assert report.time_vs_peer(dp, result.rows) == pytest.approx(1.02)
    assert peers.median_interval(dp.round_ratios_vs_none) == (1.0, 1.04), "ranks 4 and 12 of 15"
    assert report.spread_text(dp, result.rows) == "95 % interval 1.000-1.040 over 15 rounds"
    assert report.matches_peer(dp, result.rows) is True, "within the noise"
    dp.round_ratios_vs_none = [ratio + 0.01 for ratio in dp.round_ratios_vs_none]
    assert report.matches_peer(dp, result.rows) is False, "the whole interval is above the peer"
    counts = report.tally([result], report.Mode.EAGER, "dp")
    assert (counts.matched, counts.slower) == (0, 1)


def test_the_median_interval_holds_its_confidence() -> None:
    assert peers.median_interval([1.0] * 5) is None, "five values cannot give 95 %"
    assert peers.median_interval([float(value) for value in range(1, 7)]) == (1.0, 6.0)
    assert peers.median_interval([float(value) for value in range(1, 102)]) == (41.0, 61.0)
    generator = random.Random(0)
    trials, covered = 2000, 0
    for _ in range(trials):
        interval = peers.median_interval([generator.gauss(0.0, 1.0) for _ in range(25)])
        assert interval is not None
        covered += interval[0] <= 0.0 <= interval[1]
    exact = 1 - 2 * sum(math.comb(25, below) for below in range(8)) / 2**25  # ranks 8 and 18 of 25
    assert exact >= 0.95
    tolerance = 4 * math.sqrt(exact * (1 - exact) / trials)
    assert abs(covered / trials - exact) < tolerance, (covered / trials, exact)


def test_the_table_shows_every_row_and_the_misses_name_the_losing_one() -> None:
    table = report.markdown([fake_result()], context())
    lines = table.splitlines()
    dp_line = next(line for line in lines if "| ours dp @ every block |" in line)
    ilp_line = next(line for line in lines if "| ours ilp @ every block |" in line)
    assert "0.900x peer's time (rounds 0.85-1.07); matches peer: yes" in dp_line, dp_line
    assert "| 31.00 | **no** |" in ilp_line and "matches peer: **no**" in ilp_line, ilp_line
    assert any("sqrt(n) segments | not applicable: no block container" in line for line in lines)
    misses = table[table.index("## Where ours does not match") :]
    assert "tiny (eager) ours ilp @ every block: peak 31.00 MiB against budget 30.00 MiB" in misses
    assert "step time 1.100x the peer's (rounds 1.10-1.10)" in misses
    assert "gradients differ from the unmodified eager model's: gradient 3 differs" in misses
    assert "ours dp" not in misses, misses
    assert "cpu, compiled" in table, "each mode has its own table, even when empty"


def test_the_summary_gives_each_peer_one_line_with_both_solvers() -> None:
    lines = report.summary_table([fake_result()])
    assert lines[2:] == [
        "| tiny | eager | every block | 30.00 / 1.30 | 29.00 / 1.10 | 31.00 / 1.43 | dp yes, ilp **no** |"
    ], "the not-applicable peer has no line"


def test_the_tally_counts_matches_and_each_miss_by_its_first_reason() -> None:
    result = fake_result()
    dp = report.tally([result], report.Mode.EAGER, "dp")
    assert (dp.comparisons, dp.matched, dp.matched_by_median) == (1, 1, 1)
    ilp = report.tally([result], report.Mode.EAGER, "ilp")
    assert (ilp.comparisons, ilp.matched, ilp.ours_trains_otherwise, ilp.over_peak) == (1, 0, 1, 0), (
        "wrong first"
    )
    result.rows[3].gradients_equal = True
    assert (report.tally([result], report.Mode.EAGER, "ilp").over_peak, ilp.slower) == (1, 0)
    result.rows[1].gradients_equal = False
    result.rows[3].peak_bytes, result.rows[3].within_budget = 29 * MIB, True
    ilp = report.tally([result], report.Mode.EAGER, "ilp")
    assert (ilp.over_peak, ilp.slower, ilp.misses_against_other_training) == (0, 1, 1)
    result.rows[1].gradients_equal, result.rows[1].buffers_equal = True, False
    ilp = report.tally([result], report.Mode.EAGER, "ilp")
    assert ilp.misses_against_other_training == 1, "a peer that updates BatchNorm twice trains otherwise"
    del result.rows[3]
    assert report.tally([result], report.Mode.EAGER, "ilp").no_plan == 1
    assert report.tally([result], report.Mode.COMPILED, "ilp").comparisons == 0
    table = report.markdown([result], context())
    assert "| eager | dp | 1 of 1 | 1 | 0 | 0 | 0 | 0 | 0 |" in table
    assert "| eager | ilp | 0 of 1 | 0 | 1 | 0 | 0 | 0 | 1 |" in table


def test_a_result_survives_the_json_between_worker_and_parent() -> None:
    result = fake_result()
    result.tracker_check = report.TrackerCheck(
        eager_tracker_peak_bytes=1,
        eager_allocator_peak_bytes=2,
        compiled_allocator_peak_bytes=3,
        compiled_tracker_peak_bytes=4,
        ran_compiled_after_tracker=False,
    )
    loaded = report.result_from_dict(json.loads(json.dumps(asdict(result))))
    assert loaded == result
    assert loaded.rows[0].mode is report.Mode.EAGER


def test_interleaved_rounds_put_every_variant_in_every_position() -> None:
    runners = ["a", "b", "c", "d"]
    orders = [peers.round_order(runners, index) for index in range(2 * len(runners))]
    assert all(sorted(order) == runners for order in orders)
    for position in range(len(runners)):
        assert {order[position] for order in orders[: len(runners)]} == set(runners)
    assert orders[len(runners)] == list(reversed(orders[0])), "the second pass runs the other way round"


class TinyMLP(nn.Module):
    """A forward of its own: dynamo keeps compiled code per code object; none is shared with other tests.
    No dropout, so compiled and eager steps see the same function (NOTE [compiled gradients])."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def tiny_call() -> ExampleCall:
    torch.manual_seed(0)
    return ExampleCall(TinyMLP(), (torch.randn(128, 64),))


def _nudged(record: StepRecord, name: str, by: float) -> StepRecord:
    gradients = dict(record.gradients)
    gradient = gradients[name]
    assert gradient is not None
    gradients[name] = gradient + by
    return dataclasses.replace(record, gradients=gradients)


def test_a_gradient_may_differ_by_twice_the_references_own_run_to_run_noise_and_no_more() -> None:
    """NOTE [run-to-run noise]: a bias whose gradient is ~0 differs between two runs of one GPU step."""
    call = tiny_call()
    record = one_step(call.model, call.args)
    name = "down.bias"
    scale = record.gradients[name].abs().max().item()  # type: ignore[union-attr]
    noise = 1e-3 * scale
    noisy = with_run_to_run_noise(record, _nudged(record, name, noise))
    assert noisy.gradient_noise[name] == pytest.approx(noise, rel=1e-3)
    assert with_run_to_run_noise(record, one_step(call.model, call.args)).gradient_noise[name] == 0.0
    within, beyond = _nudged(record, name, 1.9 * noise), _nudged(record, name, 2.1 * noise)
    assert gradient_mismatch(noisy, within, rtol=peers.GRADIENT_RTOL) is None
    assert gradient_mismatch(record, within, rtol=peers.GRADIENT_RTOL) is not None
    assert name in str(gradient_mismatch(noisy, beyond, rtol=peers.GRADIENT_RTOL))


def test_allocator_events_count_an_eager_step_as_the_live_storage_tracker_does() -> None:
    call = tiny_call()
    tracked = planner.measure(copy.deepcopy(call.model), call.args).peak_bytes
    counted = measurement.allocator_step_memory(copy.deepcopy(call.model), call)
    assert counted.peak_bytes == tracked
    assert counted.ran_compiled is False


def test_compiled_steps_run_compiled_code_and_match_the_eager_gradients() -> None:
    call = tiny_call()
    eager = one_step(call.model, call.args)
    with measurement.compiler_settings():
        none = compare.fraction_candidate(call, 1.0)
        compiled_reference = measurement.measure_candidate(none, call, eager)
        least = compare.fraction_candidate(call, 0.0)
        measurement.measure_candidate(least, call, compiled_reference)
    for row in (none.row, least.row):
        assert row.ran_compiled is True, f"{row.method}: the allocator count must come from a compiled step"
        assert row.gradients_equal is True, f"{row.method}: {row.gradient_mismatch}"
        assert row.peak_bytes is not None and row.peak_bytes > measurement.static_bytes(call.model, call)
    assert none.row.kept_after_forward_bytes is not None and least.row.kept_after_forward_bytes is not None
    assert least.row.kept_after_forward_bytes < none.row.kept_after_forward_bytes, (
        "activation_memory_budget=0 keeps less for backward than the default partition"
    )


def test_our_predicted_peaks_are_judged_within_2_percent_an_upper_bound_or_low() -> None:
    assert verdicts.verdict(102, 100) == "within 2%"
    assert verdicts.verdict(110, 100) == "upper bound (+10.0%)"
    assert verdicts.verdict(97, 100) == "**low** (-3.0%)"
    assert verdicts.verdict(None, 100) == "—"
    result = fake_result()
    result.rows[2].predicted_peak_bytes = 29 * MIB  # dp measured 29 MiB: right
    result.rows[3].predicted_peak_bytes = 29 * MIB  # ilp measured 31 MiB: low
    section = report.markdown([result], context()).split("## Our predicted peaks")[1].split("\n## ")[0]
    assert "| eager | 2 | 1 | 0 | 1 |" in section, section
    assert "- tiny, ours ilp @ every block: **low** (-6.5%)" in section, section
    assert "ours dp" not in section, section


def test_the_compiled_check_calls_a_refusal_false_only_where_torch_compile_fits_with_its_gradients() -> None:
    row = compiled_check.CheckRow
    refused, right, wrong = (
        {"infeasible": "no plan fits"},
        {"peer_gradient_error": 0.0},
        {"peer_gradient_error": 0.3},
    )
    rows = [
        row("vit", False, "predicted range 0.5", 100 * MIB, 100 * MIB, 100 * MIB, 1, 3),
        row("vit", False, "predicted range 0", 90 * MIB, 90 * MIB, 95 * MIB, **refused),
        row("vit", True, "torch.compile budget 0", 94 * MIB, 90 * MIB, 95 * MIB, **refused, **right),
        row("vit", True, "torch.compile budget 0.5", 93 * MIB, 90 * MIB, 95 * MIB, **refused, **wrong),
        row("vit", True, "predicted range 1", 120 * MIB, 126 * MIB, 120 * MIB, 1, 0),
    ]  # fmt: skip
    verdict_of = [compiled_check.row_verdict(entry) for entry in rows]
    assert verdict_of == [
        "within 2%",
        "refused; predicted lowest **low** (-5.3%)",
        "**refused as impossible, but torch.compile fits**",
        "refused; torch.compile fits it with wrong gradients (error 3.0e-01)",
        "upper bound (+5.0%)",
    ]
    table = compiled_check.markdown(rows, {**context(), "revision": {"commit": "0123456789"}})
    assert (
        "| vit | False | predicted range 0.5 | 100.00 | 100.00 | 100.00 | +0.00% | within 2% | 1 |" in table
    )
    assert "1 of 5 rows within 2 %, 1 upper bounds, 2 low or falsely refused" in table, table


def test_the_sized_zoo_is_accepted_by_name_and_eager_only_excludes_compiled_only() -> None:
    arguments = compare.parse_arguments(["--models", "sized_qwen2,hf_gpt2", "--eager-only"])
    assert arguments.models == ["sized_qwen2", "hf_gpt2"]
    assert compare.settings_for(arguments).eager_only and not compare.settings_for(arguments).compiled_only
    with pytest.raises(SystemExit):
        compare.parse_arguments(["--models", "sized_nothing"])
    with pytest.raises(SystemExit):
        compare.parse_arguments(["--eager-only", "--compiled-only"])


@pytest.mark.parametrize("name", SIZED_ZOO)
def test_every_sized_model_builds_in_train_mode_or_names_the_package_it_needs(name: str) -> None:
    entry = SIZED_ZOO[name]
    if entry.requires is not None and importlib.util.find_spec(entry.requires) is None:
        with pytest.raises(ImportError, match=f"needs `{entry.requires}`"):
            entry.build()
        return
    call = entry.build()
    assert call.model.training
    with torch.no_grad():
        loss = default_loss(call.model(*call.args, **call.kwargs))
    assert torch.isfinite(loss) and loss != 0
