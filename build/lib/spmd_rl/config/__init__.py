"""Configuration: schema, loading with overrides, cross-field rules, layouts and estimates."""

from spmd_rl.config.errors import ConfigError, Violation
from spmd_rl.config.loader import load_config
from spmd_rl.config.schema import Config

__all__ = ["Config", "ConfigError", "Violation", "load_config"]
