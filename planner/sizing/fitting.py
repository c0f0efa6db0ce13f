"""The torch-free half of `planner.capacity`: searching sizes, and weighing the ways to a global batch.

Why it exists: "how far can I go on this card?" is two questions. The first, the largest batch or
sequence whose training step fits, is a search over sizes on the predicted peaks (`largest_fitting`).
The second, whether checkpointing, gradient accumulation or bf16 autocast is the cheapest way to a
global batch that does not fit as it is, is a comparison of predicted step times (`weigh`). Both work
on numbers that search.py gets from profiled graphs, so both are plain functions here, testable
without a model.

NOTE [monotone peaks]: the search takes the peak without checkpointing and the lowest achievable peak
to be non-decreasing in the size, so the sizes that fit are a prefix of the sorted candidates and
bisection finds its end with about log2(candidates) probes. That holds when every activation grows with
the size. It does not hold where the data decides the shapes: a mixture-of-experts layer routes tokens
to experts by their values, so its experts' activations at one size depend on the example inputs; nor
where a model pads or buckets a size (a sequence rounded up to a multiple of 64), nor where a capture is
specialised to one size (a dimension of size 1 that a view squeezes away). `check_monotone` flags any
inversion among the probed sizes, and `scan=True` probes every candidate instead of bisecting.

NOTE [weighing options]: for a global batch G on a budget B, per precision (the model as built and,
where it can be planned, under bf16 autocast), the options are: the batch of G as it is; checkpointing
a batch of G (one micro-batch, the least-recompute plan that fits); accumulating k micro-batches of
G/k with nothing checkpointed, at the largest G/k that fits; and both, k micro-batches of m each
checkpointed, for every divisor m of G between that micro-batch and G. With accumulation every
parameter's gradient is alive through each micro-batch after the first (NOTE [accumulated gradients] in
simulation/micro_batches.py), so its micro-batch is planned for that step: it may fit less, or need more
recompute, than the same micro-batch alone. One optimizer step is predicted to take k x (forward + backward of
a micro-batch + its plan's recompute), from the graph's per-node times (measured or analytic); samples/s
is G over that. The optimizer step itself runs once per global batch in every option and is left out,
as are data loading and communication.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from planner.errors import format_bytes

__all__ = [
    "Option",
    "Price",
    "Priced",
    "SizeRow",
    "Weighing",
    "check_monotone",
    "divisors",
    "largest_fitting",
    "render_rows",
    "render_weighing",
    "weigh",
]


def largest_fitting(
    candidates: Sequence[int], fits: Callable[[int], bool], *, scan: bool = False
) -> int | None:
    """The largest of the sorted `candidates` for which `fits` holds, or None when none does.

    Bisection assumes `fits` holds on a prefix of the candidates (NOTE [monotone peaks]); `scan` asks
    every candidate instead. Bisection asks the smallest and the largest first, then halves.
    """
    if scan:
        fitting = [size for size in candidates if fits(size)]
        return fitting[-1] if fitting else None
    if not candidates or not fits(candidates[0]):
        return None
    if fits(candidates[-1]):
        return candidates[-1]
    low, high = 0, len(candidates) - 1  # fits(candidates[low]) and not fits(candidates[high])
    while high - low > 1:
        middle = (low + high) // 2
        if fits(candidates[middle]):
            low = middle
        else:
            high = middle
    return candidates[low]


@dataclass(frozen=True)
class SizeRow:
    """Predicted peaks of the training step at one size (a batch size or a sequence length)."""

    size: int
    baseline_peak_bytes: int
    """Without checkpointing."""
    min_peak_bytes: int
    """The lowest peak any plan reaches."""
    step_ms: float
    """Forward and backward of one micro-batch without checkpointing (measured or analytic times)."""
    source: str
    """"captured" (profiled at this size) or "rescaled" (from captures at other sizes, rescale.py)."""


def check_monotone(rows: Sequence[SizeRow], dimension: str) -> str | None:
    """None when both peaks grow with the size over `rows`; else the first inversion, in words."""
    ordered = sorted(rows, key=lambda row: row.size)
    for smaller, larger in zip(ordered, ordered[1:], strict=False):
        for label, attribute in (
            ("peak without checkpointing", "baseline_peak_bytes"),
            ("lowest peak", "min_peak_bytes"),
        ):
            before, after = getattr(smaller, attribute), getattr(larger, attribute)
            if after < before:
                return (
                    f"the {label} falls from {format_bytes(before)} at {dimension} {smaller.size} to "
                    f"{format_bytes(after)} at {larger.size}: the search assumes peaks grow with the "
                    f"{dimension} (NOTE [monotone peaks] in planner/sizing/fitting.py); rerun with "
                    "search='scan'"
                )
    return None


def render_rows(rows: Sequence[SizeRow], *, dimension: str, budget_bytes: int) -> list[str]:
    """The table of probed sizes: peaks, whether each fits without and with checkpointing."""
    columns = ("peak, no checkpointing", "lowest achievable peak", "fits without", "fits with")
    lines = [f"{dimension:>10}  {columns[0]:>22}  {columns[1]:>22}  {columns[2]:>12}  {columns[3]:>9}  graph"]
    for row in sorted(rows, key=lambda row: row.size):
        without = _yes(row.baseline_peak_bytes <= budget_bytes)
        with_plan = _yes(row.min_peak_bytes <= budget_bytes)
        lines.append(
            f"{row.size:>10}  {format_bytes(row.baseline_peak_bytes):>22}  "
            f"{format_bytes(row.min_peak_bytes):>22}  {without:>12}  {with_plan:>9}  {row.source}"
        )
    return lines


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def divisors(number: int) -> list[int]:
    """Every positive divisor of `number`, ascending."""
    return [candidate for candidate in range(1, number + 1) if number % candidate == 0]


@dataclass(frozen=True)
class Priced:
    """What the cost model predicts for one micro-batch size under one training step and budget."""

    peak_bytes: int
    """The option's predicted peak: without checkpointing, or the plan's; the lowest achievable peak
    when no plan fits."""
    fits: bool
    micro_batch_ms: float
    """Forward and backward of one micro-batch, without recompute."""
    recompute_ms: float
    """Recompute of the plan, per micro-batch (0 without checkpointing)."""


Price = Callable[[int, int, bool], Priced]
"""(micro-batch, accumulation steps, checkpointing) -> Priced, for one precision and budget."""


@dataclass(frozen=True)
class Option:
    """One way to train a global batch: k micro-batches of m, checkpointed or not, in one precision."""

    micro_batch: int
    accumulation_steps: int
    checkpointing: bool
    precision: str
    """"" for the model as built, else e.g. "bf16 autocast"."""
    priced: Priced

    @property
    def step_ms(self) -> float:
        """Predicted forward, backward and recompute of one optimizer step (every micro-batch)."""
        return self.accumulation_steps * (self.priced.micro_batch_ms + self.priced.recompute_ms)

    @property
    def samples_per_s(self) -> float:
        return self.micro_batch * self.accumulation_steps / self.step_ms * 1e3 if self.step_ms > 0 else 0.0

    @property
    def overhead(self) -> float:
        """Recompute as a fraction of the micro-batch's forward and backward."""
        return (
            self.priced.recompute_ms / self.priced.micro_batch_ms if self.priced.micro_batch_ms > 0 else 0.0
        )

    @property
    def kind(self) -> tuple[bool, bool, str]:
        return (self.accumulation_steps > 1, self.checkpointing, self.precision)

    def describe(self) -> str:
        if self.accumulation_steps == 1:
            text = (
                f"checkpointing a batch of {self.micro_batch}"
                if self.checkpointing
                else (f"a batch of {self.micro_batch} as it is")
            )
        else:
            text = f"accumulating {self.accumulation_steps} micro-batches of {self.micro_batch}"
            if self.checkpointing:
                text += " with checkpointing"
        return f"{text} under {self.precision}" if self.precision else text


@dataclass(frozen=True)
class Weighing:
    """The options for one global batch, the fastest that fits, and the recommendation in words."""

    global_batch: int
    budget_bytes: int
    options: tuple[Option, ...]
    best: Option | None
    recommendation: str
    notes: tuple[str, ...] = ()


def _options_in_precision(global_batch: int, precision: str, price: Price) -> list[Option]:
    """Every option of NOTE [weighing options] in one precision (evaluated lazily: few probes)."""

    priced: dict[tuple[int, bool], Option] = {}

    def option(micro_batch: int, checkpointing: bool) -> Option:
        if (micro_batch, checkpointing) not in priced:
            steps = global_batch // micro_batch
            cost = price(micro_batch, steps, checkpointing)
            priced[micro_batch, checkpointing] = Option(micro_batch, steps, checkpointing, precision, cost)
        return priced[micro_batch, checkpointing]

    whole = option(global_batch, False)
    if whole.priced.fits:
        return [whole]
    options = [whole, option(global_batch, True)]
    smaller = [size for size in divisors(global_batch) if size < global_batch]
    largest = largest_fitting(smaller, lambda size: option(size, False).priced.fits)
    if largest is not None:
        options.append(option(largest, False))
    options += [option(size, True) for size in smaller if size > (largest or 0)]
    return options


def weigh(
    global_batch: int,
    prices: Mapping[str, Price],
    *,
    budget_bytes: int,
    where: str,
    notes: Sequence[str] = (),
) -> Weighing:
    """The options of NOTE [weighing options] for each precision in `prices` ("" for the model as
    built), and the fastest that fits, recommended in words against the fastest of another kind.
    `where` ends the sentence: "on a100-40gb", "within 40.00 GiB"."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(
            f"global_batch must be a positive int (samples per optimizer step), got {global_batch!r}"
        )
    options = [
        option
        for precision, price in prices.items()
        for option in _options_in_precision(global_batch, precision, price)
    ]
    fitting = sorted(
        (option for option in options if option.priced.fits), key=lambda option: -option.samples_per_s
    )
    if fitting:
        recommendation = _recommend(fitting, options, global_batch=global_batch, where=where)
    else:
        lowest = min(options, key=lambda option: option.priced.peak_bytes)
        recommendation = (
            f"nothing fits {where} ({format_bytes(budget_bytes)}) for a global batch of {global_batch}: the "
            f"lowest predicted peak is {format_bytes(lowest.priced.peak_bytes)} ({lowest.describe()})"
        )
    return Weighing(
        global_batch=global_batch,
        budget_bytes=budget_bytes,
        options=tuple(options),
        best=fitting[0] if fitting else None,
        recommendation=recommendation,
        notes=tuple(notes),
    )


def _per_sample_ms(options: Sequence[Option], precision: str, global_batch: int) -> float | None:
    """Forward and backward time per sample of the whole global batch in one micro-batch, in `precision`."""
    for option in options:
        if option.precision == precision and option.micro_batch == global_batch:
            return option.priced.micro_batch_ms / global_batch
    return None


def _reasons(option: Option, options: Sequence[Option], global_batch: int) -> list[str]:
    """What costs `option` time against the global batch in one micro-batch, in the same precision."""
    reasons = []
    if option.checkpointing:
        reasons.append(f"{option.describe()} recomputes {option.overhead:.1%} of its forward and backward")
    whole = _per_sample_ms(options, option.precision, global_batch)
    if option.accumulation_steps > 1 and whole:
        change = option.priced.micro_batch_ms / option.micro_batch / whole - 1
        reasons.append(
            f"a micro-batch of {option.micro_batch} takes {change:+.1%} time per sample against one of "
            f"{global_batch}"
        )
    return reasons


def _recommend(fitting: list[Option], options: list[Option], *, global_batch: int, where: str) -> str:
    """The fastest option that fits, against the fastest that fits of another kind, and why."""
    best = fitting[0]
    rivals = [option for option in fitting if option.kind != best.kind]
    if not rivals:
        speed = f"{best.samples_per_s:.4g} samples/s predicted"
        return f"{best.describe()} is the only way that fits {where} ({speed})"
    rival = rivals[0]
    faster = best.samples_per_s / rival.samples_per_s - 1
    reasons = _reasons(best, options, global_batch) + _reasons(rival, options, global_batch)
    if best.precision != rival.precision:
        mine = _per_sample_ms(options, best.precision, global_batch)
        theirs = _per_sample_ms(options, rival.precision, global_batch)
        if mine and theirs:
            label = best.precision or "the model as built"
            reasons.append(f"{label} takes {mine / theirs - 1:+.1%} time per sample in forward and backward")
    sentence = (
        f"{best.describe()} is predicted {faster * 100:.0f} % faster than {rival.describe()} {where} "
        f"({best.samples_per_s:.4g} against {rival.samples_per_s:.4g} samples/s)"
    )
    checkpointed = [
        option
        for option in fitting
        if option.checkpointing and option.accumulation_steps == 1 and option not in (best, rival)
    ]
    if checkpointed:
        whole = checkpointed[0]
        sentence += (
            f", and {(best.samples_per_s / whole.samples_per_s - 1) * 100:.0f} % faster than "
            f"{whole.describe()} ({whole.samples_per_s:.4g})"
        )
        reasons += _reasons(whole, options, global_batch)
    return sentence + (f"; {'; '.join(reasons)}" if reasons else "")


def render_weighing(weighing: Weighing) -> list[str]:
    """The options table and the recommendation."""
    lines = [
        f"ways to a global batch of {weighing.global_batch} (predicted; the optimizer step, the same in "
        "each, is not in the times):",
        f"  {'option':<62}  {'peak':>11}  {'fits':>4}  {'recompute':>9}  {'samples/s':>10}",
    ]
    for option in weighing.options:
        marker = "*" if option is weighing.best else " "
        recompute = f"{option.overhead:.1%}" if option.priced.fits else "-"
        speed = f"{option.samples_per_s:.4g}" if option.priced.fits else "-"
        lines.append(
            f"{marker} {option.describe():<62}  {format_bytes(option.priced.peak_bytes):>11}  "
            f"{_yes(option.priced.fits):>4}  {recompute:>9}  {speed:>10}"
        )
    lines.append(f"recommendation: {weighing.recommendation}")
    lines += [f"note: {note}" for note in weighing.notes]
    return lines
