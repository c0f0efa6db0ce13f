"""PYTORCH_CUDA_ALLOC_CONF, read as PyTorch reads it: the options the caching allocator model follows.

Why it exists: the allocator model (allocator.py) is told how the training process configures CUDA's
caching allocator, by the same text the process gets (`"expandable_segments:True,max_split_size_mb:128"`).
Parsing that text is its own idea, and it follows `AcceleratorAllocatorConfig::parseArgs` in
c10/core/AllocatorConfig.cpp: options the model follows become `AllocatorSettings` fields, options that
change nothing modelled are accepted (IGNORED_OPTIONS), and options that change allocation in ways the
model does not follow are refused (UNMODELLED_OPTIONS). Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "IGNORED_OPTIONS",
    "LARGE_BUFFER_BYTES",
    "MIB",
    "ROUNDUP_INTERVALS",
    "UNMODELLED_OPTIONS",
    "DEFAULT_SETTINGS",
    "AllocatorSettings",
]

MIB = 2**20
LARGE_BUFFER_BYTES = 20 * MIB
"""kLargeBuffer: the shared segment of large requests under 10 MiB, the large pool's expandable page size,
the smallest `max_split_size_mb` the config accepts and the default `max_non_split_rounding_mb`."""
ROUNDUP_INTERVALS = 16
"""kRoundUpPowerOfTwoIntervals: `roundup_power2_divisions` has one entry per power of two from 1 MiB
([1 MiB, 2 MiB) is interval 0, everything below falls in it too) to 32 GiB and up (interval 15)."""

IGNORED_OPTIONS = {
    "backend": "`native` is the allocator modelled here (cudaMallocAsync is refused)",
    "release_lock_on_cudamalloc": "only changes which thread waits on cudaMalloc",
    "pinned_use_cuda_host_register": "configures the pinned host allocator",
    "pinned_num_register_threads": "configures the pinned host allocator",
    "pinned_use_background_threads": "configures the pinned host allocator",
    "pinned_reserve_segment_size_mb": "configures the pinned host allocator",
    "pinned_free_catch_all": "configures the pinned host allocator",
    "graph_capture_record_stream_reuse": "applies to CUDA graph capture",
    "garbage_collection_threshold": "acts only under a per-process memory fraction",
}
"""PYTORCH_CUDA_ALLOC_CONF options that `from_conf` accepts and that change nothing modelled here (why)."""
UNMODELLED_OPTIONS = {
    "per_process_memory_fraction": "pass capacity_bytes = fraction x device memory instead",
    "large_segment_size_mb": "the model uses the default 20 MiB large segment",
    "throw_on_cudamalloc_oom": "the model always frees cached blocks and retries before an OOM",
}
"""Options that change allocation in ways the model does not follow: `from_conf` refuses them (why)."""


@dataclass(frozen=True)
class AllocatorSettings:
    """The PYTORCH_CUDA_ALLOC_CONF options the model follows; defaults are PyTorch's."""

    expandable_segments: bool = False
    """Grow one segment per pool by mapping pages instead of cudaMalloc-ing a segment per miss."""
    max_split_size_bytes: int | None = None
    """`max_split_size_mb`: cached blocks this large or larger are never split. None: unlimited."""
    max_non_split_rounding_bytes: int = LARGE_BUFFER_BYTES
    """`max_non_split_rounding_mb`: how much larger than a request at or above max_split_size a cached
    block may be and still serve it whole."""
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    """`roundup_power2_divisions`: per size interval (see ROUNDUP_INTERVALS), how many steps each power of
    two is divided into when rounding requests; 0 or 1 rounds to 512 B only."""

    def __post_init__(self) -> None:
        if self.max_split_size_bytes is not None and self.max_split_size_bytes < LARGE_BUFFER_BYTES:
            raise ValueError(
                f"max_split_size_bytes={self.max_split_size_bytes} is below {LARGE_BUFFER_BYTES} (20 MiB), "
                "the least PyTorch accepts; pass None for no limit"
            )
        if self.max_non_split_rounding_bytes < LARGE_BUFFER_BYTES:
            raise ValueError(
                f"max_non_split_rounding_bytes={self.max_non_split_rounding_bytes} is below "
                f"{LARGE_BUFFER_BYTES} (20 MiB), the least PyTorch accepts"
            )
        divisions = self.roundup_power2_divisions
        if len(divisions) != ROUNDUP_INTERVALS or any(not _is_power_of_two_or_zero(d) for d in divisions):
            raise ValueError(
                f"roundup_power2_divisions={divisions!r} must hold {ROUNDUP_INTERVALS} entries, each 0 or a "
                "power of two; parse the option's text with AllocatorSettings.from_conf"
            )

    def to_conf(self) -> str:
        """These settings as PYTORCH_CUDA_ALLOC_CONF text ("" for PyTorch's defaults); `from_conf`
        reads it back to equal settings."""
        options = []
        if self.expandable_segments:
            options.append("expandable_segments:True")
        if self.max_split_size_bytes is not None:
            options.append(f"max_split_size_mb:{self.max_split_size_bytes // MIB}")
        if self.max_non_split_rounding_bytes != LARGE_BUFFER_BYTES:
            options.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_bytes // MIB}")
        if any(self.roundup_power2_divisions):
            intervals = enumerate(self.roundup_power2_divisions)
            table = ",".join(f"{2**index}:{divisions}" for index, divisions in intervals)
            options.append(f"roundup_power2_divisions:[{table}]")
        return ",".join(options)

    @classmethod
    def from_conf(cls, text: str) -> AllocatorSettings:
        """Settings from a PYTORCH_CUDA_ALLOC_CONF value such as
        "expandable_segments:True,max_split_size_mb:128", parsed as `AcceleratorAllocatorConfig::parseArgs`
        does (a later repeat of an option wins).

        Raises ValueError naming the offending option for a malformed value, an unknown option or an
        option that changes allocation in a way this model does not follow; options in
        IGNORED_OPTIONS are accepted and change nothing."""
        fields: dict[str, Any] = {}
        for key, value in _conf_options(text):
            parser = _OPTION_PARSERS.get(key)
            try:
                if parser is not None:
                    fields.update(parser(value))
                elif key in UNMODELLED_OPTIONS:
                    raise ValueError(f"is not modelled ({UNMODELLED_OPTIONS[key]})")
                elif key not in IGNORED_OPTIONS:
                    known = sorted({*_OPTION_PARSERS, *IGNORED_OPTIONS})
                    raise ValueError(f"is not an allocator option; known options: {', '.join(known)}")
            except ValueError as error:
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF={text!r}: option {key!r} {error}") from error
        return cls(**fields)


def _is_power_of_two_or_zero(value: int) -> bool:
    return value >= 0 and value & (value - 1) == 0


def _tokenize_conf(text: str) -> list[str]:
    """The tokens of `ConfigTokenizer`: ',', ':', '[' and ']' alone, words between them, no whitespace."""
    tokens: list[str] = []
    word = ""
    for char in text:
        if char in ",:[]":
            if word:
                tokens.append(word)
                word = ""
            tokens.append(char)
        elif not char.isspace():
            word += char
    if word:
        tokens.append(word)
    return tokens


def _conf_options(text: str) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(key, value tokens) per option of `text`; a list value `[a:b,c:d]` comes as its inner tokens."""
    tokens = _tokenize_conf(text)
    position = 0
    while position < len(tokens):
        key = tokens[position]
        if key in ",:[]" or tokens[position + 1 : position + 2] != [":"] or position + 2 >= len(tokens):
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF={text!r}: expected `option:value` at {key!r}")
        position += 2
        if tokens[position] == "[":
            if "]" not in tokens[position:]:
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF={text!r}: option {key!r} has no closing ']'")
            closing = tokens.index("]", position)
            yield key, tuple(tokens[position + 1 : closing])
            position = closing + 1
        else:
            yield key, (tokens[position],)
            position += 1
        if position < len(tokens):
            if tokens[position] != ",":
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF={text!r}: expected ',' after option {key!r}")
            position += 1


def _single_value(value: tuple[str, ...]) -> str:
    if len(value) != 1:
        raise ValueError(f"takes one value, not the list {list(value)}")
    return value[0]


def _parse_bool(value: tuple[str, ...]) -> bool:
    word = _single_value(value)
    if word not in ("True", "False"):
        raise ValueError(f"expects True or False (capitalised, as PyTorch does), not {word!r}")
    return word == "True"


def _parse_int(word: str) -> int:
    if not word.isdigit():
        raise ValueError(f"expects a non-negative integer, not {word!r}")
    return int(word)


def _parse_megabytes(value: tuple[str, ...]) -> int:
    megabytes = _parse_int(_single_value(value))
    if megabytes * MIB < LARGE_BUFFER_BYTES:
        raise ValueError(f"is {megabytes} MB, below the least PyTorch accepts ({LARGE_BUFFER_BYTES // MIB})")
    return megabytes * MIB


def _parse_expandable_segments(value: tuple[str, ...]) -> dict[str, Any]:
    return {"expandable_segments": _parse_bool(value)}


def _parse_max_split_size(value: tuple[str, ...]) -> dict[str, Any]:
    return {"max_split_size_bytes": _parse_megabytes(value)}


def _parse_max_non_split_rounding(value: tuple[str, ...]) -> dict[str, Any]:
    return {"max_non_split_rounding_bytes": _parse_megabytes(value)}


def _parse_backend(value: tuple[str, ...]) -> dict[str, Any]:
    backend = _single_value(value)
    if backend != "native":
        raise ValueError(f"is {backend!r}: only the native caching allocator is modelled")
    return {}


def _parse_roundup_power2_divisions(value: tuple[str, ...]) -> dict[str, Any]:
    """`parseRoundUpPower2Divisions`: one power of two for every interval, or `[boundary_mb:divisions,
    ..., >:divisions]`, where the first entry also covers the intervals below its boundary and `>` the
    intervals after the last boundary."""
    if len(value) == 1:
        divisions = _parse_int(value[0])
        if divisions == 0 or not _is_power_of_two_or_zero(divisions):
            raise ValueError(f"expects a power of two, not {divisions}")
        return {"roundup_power2_divisions": (divisions,) * ROUNDUP_INTERVALS}
    table = [0] * ROUNDUP_INTERVALS
    last_index = -1
    for position in range(0, len(value), 4):
        entry = value[position : position + 4]
        if entry[1:2] != (":",) or len(entry) < 3 or entry[3:] not in ((), (",",)):
            raise ValueError(f"expects `[boundary_mb:divisions, ...]`, not {''.join(value)!r}")
        boundary, divisions = entry[0], _parse_int(entry[2])
        if not _is_power_of_two_or_zero(divisions):
            raise ValueError(f"expects divisions that are 0 or a power of two, not {divisions}")
        if boundary == ">":
            table[last_index + 1 :] = [divisions] * (ROUNDUP_INTERVALS - last_index - 1)
            continue
        boundary_mb = _parse_int(boundary)
        if boundary_mb == 0 or not _is_power_of_two_or_zero(boundary_mb):
            raise ValueError(f"expects interval boundaries that are powers of two, not {boundary_mb}")
        index = min(boundary_mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if last_index < 0:
            table[:index] = [divisions] * index
        table[index] = divisions
        last_index = index
    return {"roundup_power2_divisions": tuple(table)}


_OPTION_PARSERS = {
    "expandable_segments": _parse_expandable_segments,
    "max_split_size_mb": _parse_max_split_size,
    "max_non_split_rounding_mb": _parse_max_non_split_rounding,
    "roundup_power2_divisions": _parse_roundup_power2_divisions,
    "backend": _parse_backend,
}


DEFAULT_SETTINGS = AllocatorSettings()
"""PyTorch's defaults: no PYTORCH_CUDA_ALLOC_CONF."""
