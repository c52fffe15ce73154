"""The figures that the Hugging Face test programs (tests/programs/hf_*.py) print, read and
compared with one process's: ``LOSS i``, ``CHECKSUM``, ``MISSING``, ``UNEXPECTED`` and
``RELOADED`` lines, equal within 1e-5, and ``TOKENS`` (generated token ids), equal."""
from __future__ import annotations

import math
import re

from subjob import Result


def figures(output: str, index: str | None = None) -> dict[str, str]:
    """``LOSS i``, ``CHECKSUM``, ``MISSING``, ``UNEXPECTED``, ``RELOADED`` and ``TOKENS`` lines, by name (those
    marked ``@index`` when ``index`` is given: a reload's figures for its ``index``-th folder)."""
    # a line may follow a progress bar that tqdm ends with its newline only later (ranks'
    # stdout and stderr share the pipe): "100%|...| 3/3 [00:00<00:00, 33.88it/s]LOSS 0 4.19"
    found = re.finditer(r"^(?:[^\n]*it/s\])?((?:LOSS \d+)|CHECKSUM|MISSING|UNEXPECTED|RELOADED|TOKENS)(?:@(\d+))? (\S+)",
                        output, re.M)
    return {m.group(1): m.group(3) for m in found if m.group(2) == index}


def compare(name: str, got: dict[str, str], want: dict[str, str], count: int, log: str) -> list[str]:
    """What differs between figures ``got`` and one process's ``want`` (``count`` figures expected)."""
    if len(want) != count or got.keys() != want.keys():
        return [f"{name}: figures {got} against {want}:\n{log}"]
    def same(k: str) -> bool:
        return got[k] == want[k] if k == "TOKENS" else math.isclose(float(got[k]), float(want[k]), rel_tol=1e-5,
                                                                     abs_tol=1e-5)
    return [f"{name} {k}: {got[k]} != {want[k]}" for k in want if not same(k)]


def differences(name: str, ran: Result, alone: Result, count: int) -> list[str]:
    """What differs between ``ran``'s figures and one process's (``count`` figures expected)."""
    log = f"{ran.output[-2500:]}\n--- one process:\n{alone.output[-1000:]}"
    if alone.returncode != 0 or ran.returncode != 0:
        return [f"{name}: exit {ran.returncode} (one process {alone.returncode}):\n{log}"]
    return compare(name, figures(ran.output), figures(alone.output), count, log)
