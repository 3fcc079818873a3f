"""The paper's heterogeneity levels HL1..HL8: the one definition, for emulation,
simulation and the benchmarks.

Tyagi & Sharma (TPDS 2025) run four workers with these CPU core counts; at level HLk
the fastest worker has k times the slowest one's cores. A worker's relative speed is
its cores over 12, so every level has total speed 4.0 (as four 12-core workers).

>>> level_speeds("HL4")
(0.75, 0.75, 0.5, 2.0)
>>> level_speeds("hl8", ranks=5)
(0.5, 0.5, 0.3333333333333333, 2.6666666666666665, 0.5)
"""
from typing import Optional, Tuple

from ..errors import ConfigError

__all__ = ["LEVEL_CORES", "CORES_PER_UNIT", "LEVELS", "DYNAMIC_LEVELS", "level_speeds"]

LEVEL_CORES = {
    "HL1": (12, 12, 12, 12),
    "HL2": (12, 12, 8, 16),
    "HL4": (9, 9, 6, 24),
    "HL8": (6, 6, 4, 32),
}
CORES_PER_UNIT = 12.0   # 12 cores = relative speed 1.0
LEVELS = {name: tuple(c / CORES_PER_UNIT for c in cores) for name, cores in LEVEL_CORES.items()}
# The paper's dynamic schedule: up to HL8 and back, one level per phase.
DYNAMIC_LEVELS = ("HL1", "HL2", "HL4", "HL8", "HL4", "HL2", "HL1")


def level_speeds(name: str, ranks: Optional[int] = None) -> Tuple[float, ...]:
    """Relative speeds (cores / 12) of a level, given case-insensitively.

    Args:
        name: ``"HL1"``, ``"HL2"``, ``"HL4"`` or ``"HL8"`` (any case).
        ranks: tile the four workers' speeds over this many ranks (rank i gets worker
            ``i % 4``'s speed); None: the four speeds.

    Returns:
        One float per worker (or rank).

    Raises:
        ConfigError: ``name`` is not a known level, or ``ranks`` is not an int >= 1.
    """
    key = name.strip().upper() if isinstance(name, str) else None
    if key not in LEVELS:
        raise ConfigError("unknown heterogeneity level %r; choose one of %s"
                          % (name, ", ".join(LEVELS)))
    speeds = LEVELS[key]
    if ranks is None:
        return speeds
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ConfigError("ranks must be an int >= 1, got %r" % (ranks,))
    return tuple(speeds[i % len(speeds)] for i in range(ranks))
