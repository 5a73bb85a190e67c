"""A backend's config parameters (`parameters { key: ... value: { string_value: ... } }`)
read as Triton's backends read them: booleans as "true"/"false", "1"/"0", "on"/"off"
(any case), integers in decimal. A value that is neither is a ConfigError naming the
parameter, so a typo never silently leaves a default in force."""
from __future__ import annotations

from ..errors import ConfigError

_TRUE, _FALSE = ("true", "1", "on"), ("false", "0", "off")


def of(cfg) -> dict[str, str]:
    """A ModelConfig's parameters as {key: string value} (what ModelSpec.parameters holds)."""
    return {k: v.string_value for k, v in cfg.parameters.items()}


def flag(params: dict, key: str, default: bool, where: str) -> bool:
    if key not in params:
        return default
    value = params[key].strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f'{where}: parameters "{key}" must be "true" or "false" (or 1/0, on/off), '
                      f"got {params[key]!r}")


def integer(params: dict, key: str, default: int, where: str, minimum: int | None = None,
            choices: tuple[int, ...] | None = None) -> int:
    if key not in params:
        return default
    try:
        value = int(params[key].strip())
    except ValueError:
        raise ConfigError(f'{where}: parameters "{key}" must be an integer, got '
                          f"{params[key]!r}") from None
    if minimum is not None and value < minimum:
        raise ConfigError(f'{where}: parameters "{key}" must be >= {minimum}, got {value}')
    if choices is not None and value not in choices:
        raise ConfigError(f'{where}: parameters "{key}" must be one of '
                          f"{', '.join(map(str, choices))}, got {value}")
    return value
