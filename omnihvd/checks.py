"""The checks of user-given scalars, written once with one wording.

Every runtime module that takes an int, a flag, a choice or a non-negative number from
the user checks it here, so the messages read the same everywhere
(``"adjust_every must be an int >= 1, got 0"``) and a ``bool`` is never taken for an
int. Each raises :class:`~omnihvd.errors.ConfigError` naming the option and quoting
the value. Pure Python and numpy.

>>> check_int("adjust_every", 20, 1)
20
>>> check_int("adjust_every", True, 1)
Traceback (most recent call last):
...
omnihvd.errors.ConfigError: adjust_every must be an int >= 1, got True
>>> check_choice("policy", "pid", ("affine", "proportional"))
Traceback (most recent call last):
...
omnihvd.errors.ConfigError: policy must be one of affine, proportional, got 'pid'
"""
import math
from typing import Optional, Sequence

import numpy as np

from .errors import ConfigError

__all__ = ["check_int", "check_flag", "check_choice", "check_number", "is_int"]


def is_int(value) -> bool:
    """Whether ``value`` is a whole number type (an int or numpy integer, not a bool)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value, minimum: int, note: str = "", *,
              maximum: Optional[int] = None, where: str = "") -> int:
    """``value`` as an int, when it is one in ``minimum..maximum``.

    Args:
        name: the option, as the user wrote it.
        value: what the user passed.
        minimum: the smallest value allowed.
        note: said in parentheses after the bound (what the unit is, how to fix it).
        maximum: the largest value allowed (None: no limit).
        where: put before the message (``"worker rank 2: "``).

    Returns:
        int: ``value``.

    Raises:
        ConfigError: ``"<name> must be an int >= <minimum> (<note>), got <value>"``,
            or ``"... an int in <minimum>..<maximum> ..."`` with a ``maximum``.

    >>> check_int("exit_code", 0, 1, "non-zero", maximum=255)
    Traceback (most recent call last):
    ...
    omnihvd.errors.ConfigError: exit_code must be an int in 1..255 (non-zero), got 0
    """
    if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
        bound = ">= %d" % minimum if maximum is None else "in %d..%d" % (minimum, maximum)
        raise ConfigError("%s%s must be an int %s%s, got %r"
                          % (where, name, bound, " (%s)" % note if note else "", value))
    return int(value)


def check_flag(name: str, value) -> bool:
    """``value`` when it is True or False (a truthy string is a mistake, not a yes).

    Raises:
        ConfigError: ``"<name> must be True or False, got <value>"``.
    """
    if not isinstance(value, bool):
        raise ConfigError("%s must be True or False, got %r" % (name, value))
    return value


def check_choice(name: str, value, choices: Sequence[str]):
    """``value`` when it is one of ``choices``.

    Raises:
        ConfigError: ``"<name> must be one of <a, b>, got <value>"``.
    """
    if value not in choices:
        raise ConfigError("%s must be one of %s, got %r"
                          % (name, ", ".join(str(c) for c in choices), value))
    return value


def check_number(name: str, value, minimum: float = 0.0) -> float:
    """``value`` as a float, when it is a finite number >= ``minimum``.

    Raises:
        ConfigError: ``"<name> must be a number >= <minimum>, got <value>"`` (also for
            NaN, infinities and bools).
    """
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number))
            or not math.isfinite(value) or not value >= minimum):
        raise ConfigError("%s must be a number >= %g, got %r" % (name, minimum, value))
    return float(value)
