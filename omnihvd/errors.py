"""Exception types. All are ``ValueError`` subclasses, so ``except ValueError`` works."""

__all__ = ["OmniHvdError", "ConfigError", "InfeasibleError", "RankMismatchError"]


class OmniHvdError(ValueError):
    """Base class of every error omnihvd raises for bad input or configuration."""


class ConfigError(OmniHvdError):
    """An option or argument is malformed; the message names the value and the fix."""


class InfeasibleError(OmniHvdError):
    """The constraints admit no split, e.g. ``n * min_batch_size > global_batch_size``."""


class RankMismatchError(OmniHvdError):
    """Ranks disagree on something that must be identical (configuration, model)."""
