"""From a command line's overrides to validated settings: Hydra's composition, the schema's checks,
and every error as amp_lab's one line (amp_lab/errors.py)."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from amp_lab.config import CONF_DIR, AmpLabConfig, ConfigError, register
from amp_lab.errors import did_you_mean, null_group, one_line, schema_keys


def _unknown_keys(cfg: DictConfig) -> list[str]:
    """Keys the schema does not have, each with the nearest real one: `+scaler.init_scal=1`
    adds a key Hydra accepts and the schema would silently drop."""
    known = schema_keys()  # model/optim.kwargs are free-form dicts: their keys are not checked
    found = [group for group in map(str, cfg) if group not in known]
    found += [
        f"{group}.{key}"
        for group in map(str, cfg)
        if group in known and isinstance(cfg[group], DictConfig)
        for key in cfg[group]
        if f"{group}.{key}" not in known
    ]
    return [f"{key}{did_you_mean(key, known)}" for key in found]


def validate(cfg: DictConfig) -> AmpLabConfig:
    """Turn the composed config into typed objects, running every cross-field check once."""
    unknown = _unknown_keys(cfg)
    if unknown:
        raise ConfigError(
            f"unknown setting {', '.join(unknown)} (python -m amp_lab --help "
            "lists the groups; conf/ holds every key)"
        )
    try:
        settings = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:  # __post_init__ errors arrive wrapped
        cause = err.__cause__ if isinstance(err.__cause__, ConfigError) else None
        raise ConfigError(str(cause) if cause else str(err).splitlines()[0]) from err
    assert isinstance(settings, AmpLabConfig)
    return settings


def compose_settings(overrides: list[str]) -> AmpLabConfig:
    """The validated config `python -m amp_lab <overrides>` would run (ConfigError when bad)."""
    register()
    if line := null_group(overrides):
        raise ConfigError(line)
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return validate(compose(config_name="config", overrides=overrides))
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(f"{one_line(err)} (overrides: {' '.join(overrides)})") from err
