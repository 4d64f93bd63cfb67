"""Numeric settings read from NPLLM_* environment variables: one reader, so that each is checked the same way when
it is read (finite, > 0, at most a stated maximum) and a bad value is one error naming the variable, its value and
the range, rather than a limit that fails every use later (NPLLM_TEMPLATE_TIMEOUT=1e300 overflowed the template
worker's alarm; NPLLM_TEMPLATE_MEMORY_MIB=1e20 its address-space limit).

    setting_from_env(variable, default, most, whole=False)   the variable's number, `default` when unset or blank
    check_setting(what, value, most, whole=False)            the same check for a value given in code
"""

from __future__ import annotations

import math
import numbers
import os

from .errors import SettingError


def allowed(most: float, whole: bool) -> str:
    """The range in words, for error messages: "a whole number from 1 to 1,048,576", "a number > 0 and <= 3,600"."""
    return f"a whole number from 1 to {most:,}" if whole else f"a number > 0 and <= {most:,g}"


def in_range(value, most: float, whole: bool) -> bool:
    """Whether `value` is a finite number in (0, most], and a whole one where `whole` (NaN fails every test)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= most:
        return False
    return not whole or (math.isfinite(value) and value == int(value))


def check_setting(what: str, value, most: float, whole: bool = False):
    """`value` itself if it is in range (see in_range), else SettingError naming `what`, the value and the range."""
    if not in_range(value, most, whole):
        raise SettingError(f"{what} must be {allowed(most, whole)}, got {value!r}")
    return int(value) if whole else float(value)


def setting_from_env(variable: str, default, most: float, whole: bool = False):
    """The number environment variable `variable` holds (int where `whole`, else float); `default` where it is
    unset or blank; SettingError for text that is no number or a number outside (0, most]."""
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    try:
        value = int(text) if whole else float(text)
    except ValueError:  # "abc"; "1.5" or "1e3" for a whole number; more digits than int() reads
        value = None
    if value is None or not in_range(value, most, whole):
        raise SettingError(f"{variable} must be {allowed(most, whole)}, got {text!r}")
    return value
