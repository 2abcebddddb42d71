"""Names inside checkpoints: a root of the native format (see docs/format.md), and the file names
the other formats read and write."""

from __future__ import annotations

import re

MANIFEST = "manifest.json"
LATEST = "latest"
# ASCII digits, no leading zero: one name per step (``\d`` also matches other scripts' digits,
# and "step-01" or "step-\u0661" would alias step 1)
_STEP = re.compile(r"step-(0|[1-9][0-9]*)")
# Every name this format writes in a step directory, also as a write's temporary name
# (``<name>.tmp-<8 hex>``, storage/io/_local.py): only such names are ever deleted
# ([Note: deleting only what is ours] in storage/format/_steps.py).
_OWN = re.compile(
    r"(?:rank\d{5,}-\d{3,}-(?P<object>[0-9a-f]{8})\.safetensors"
    r"|_done-(?P<done>[0-9a-f]{8})-rank\d{5,}\.json"
    r"|_abort-(?P<abort>[0-9a-f]{8})\.json"
    r"|manifest\.json)"
    r"(?P<tmp>\.tmp-[0-9a-f]{8})?"
)

HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"
HF_SHARD = re.compile(r"^model-\d+-of-\d+\.safetensors$")  # hf shards (need the index)
HF_VALUES_KEY = "ftsdp.values"  # safetensors __metadata__ key holding non-tensor values (JSON)
DCP_METADATA = ".metadata"  # DCP's commit: present <=> the checkpoint is complete


def check_step(step: object) -> int:
    """``step`` when it is an int >= 0 (a bool is not one); else ValueError."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step={step!r} must be a non-negative int")
    return step


def step_dir(step: int) -> str:
    return f"step-{check_step(step)}"


def parse_step(name: str) -> int | None:
    """The step of a ``step-<N>`` directory name, or None for any other name."""
    m = _STEP.fullmatch(name)
    return int(m.group(1)) if m else None


def manifest_path(step: int) -> str:
    return f"{step_dir(step)}/{MANIFEST}"


def object_name(rank: int, index: int, attempt: str) -> str:
    """A data object: rank, index among that rank's objects, and the save attempt's id."""
    return f"rank{rank:05d}-{index:03d}-{attempt}.safetensors"


def done_marker(step: int, attempt: str, rank: int) -> str:
    """Written by rank ``rank`` (> 0) when its objects are durable: sizes and checksums (JSON)."""
    return f"{step_dir(step)}/_done-{attempt}-rank{rank:05d}.json"


def abort_marker(step: int, attempt: str) -> str:
    """Written by rank 0 when an attempt fails, so the other ranks stop waiting for the commit."""
    return f"{step_dir(step)}/_abort-{attempt}.json"


def is_own_name(name: str) -> bool:
    """Whether ``name``, inside a step directory, is a name this format writes there: a data
    object, a done or abort marker, the manifest, or the temporary name of one of those."""
    return _OWN.fullmatch(name) is not None


def attempt_of(name: str) -> str | None:
    """The save attempt a data object or marker name belongs to (None for other names)."""
    m = _OWN.fullmatch(name)
    return (m.group("object") or m.group("done") or m.group("abort")) if m else None
