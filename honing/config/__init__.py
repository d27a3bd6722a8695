"""One typed config tree, resolved from defaults < YAML < environment < command line.

Fields whose meaning is not plain from the name carry a comment; ``Field`` metadata carries
the allowed choices or range so that validation can say exactly what is wrong. Bad input
raises ``ConfigError`` with one line naming the key and what is allowed (the CLI turns it
into exit status 2).
"""

from honing.config.guide import from_guide_shape
from honing.config.sources import (
    build_config,
    dump_yaml,
    env_overrides,
    load_yaml,
    parse_overrides,
    resolve_config,
    to_dict,
)
from honing.config.tree import (
    ENV_KEYS,
    SECTIONS,
    AlgorithmConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    MemoryConfig,
    ModelConfig,
    MonitorConfig,
    PipelineConfig,
    RewardConfig,
    RolloutConfig,
    ScheduleConfig,
    TrainerConfig,
    all_keys,
)

__all__ = [
    "ENV_KEYS",
    "SECTIONS",
    "AlgorithmConfig",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "MemoryConfig",
    "ModelConfig",
    "MonitorConfig",
    "PipelineConfig",
    "RewardConfig",
    "RolloutConfig",
    "ScheduleConfig",
    "TrainerConfig",
    "all_keys",
    "build_config",
    "dump_yaml",
    "env_overrides",
    "from_guide_shape",
    "load_yaml",
    "parse_overrides",
    "resolve_config",
    "to_dict",
]
