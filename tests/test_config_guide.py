"""The deployment guide's configuration shape loads onto honing's sections; keys honing cannot
honour are errors that say so."""

import pytest

from honing.config import build_config, load_yaml
from honing.errors import ConfigError

GUIDE = """
schedule_mode: "async"
modules:
  rollout:
    engine: sglang
    mtp_enabled: false
    batch_size: 4
  inference:
    models:
      - name: policy
        url: http://10.0.0.5:30000
      - name: policy
        url: http://10.0.0.6:30000
  training:
    update_strategy: full
memory_management:
  dynamic_offload: false
  offload_trigger_threshold: 0.8
trainer:
  total_steps: 7
"""


def load(tmp_path, text):
    path = tmp_path / "guide.yaml"
    path.write_text(text)
    return build_config(load_yaml(path))


def test_the_guide_shape_maps_onto_honings_sections(tmp_path):
    config = load(tmp_path, GUIDE)
    assert config.schedule.mode == "async"
    assert config.rollout.engine == "openai" and config.rollout.batch_size == 4
    assert config.rollout.endpoints == "http://10.0.0.5:30000,http://10.0.0.6:30000"
    assert config.rollout.model_name == "policy"
    assert config.trainer.total_steps == 7
    assert config.model.lora_rank == 0  # update_strategy: full
    assert not config.memory.dynamic_offload and config.memory.offload_trigger_threshold == 0.8


def test_lora_and_dynamic_offload_map_too(tmp_path):
    text = GUIDE.replace("update_strategy: full", "update_strategy: lora")
    text = text.replace("dynamic_offload: false", "dynamic_offload: true")
    config = load(tmp_path, text)
    assert config.model.lora_rank == 16 and config.memory.dynamic_offload
    assert config.rollout.speculative == "off"  # mtp_enabled: false
    mtp = load(tmp_path, text.replace("mtp_enabled: false", "mtp_enabled: true"))
    assert mtp.rollout.speculative == "mtp"
    ranked = load(tmp_path, text.replace("trainer:", "model:\n  lora_rank: 4\ntrainer:"))
    assert ranked.model.lora_rank == 4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("update_strategy: full", "update_strategy: qlora"), "update_strategy='qlora' is not"),
        (("trainer:", "model:\n  lora_rank: 8\ntrainer:"), "model.lora_rank is 8 but"),
        (("engine: sglang", "engine: tensorrt"), "modules.rollout.engine: 'tensorrt' is not"),
        (("mtp_enabled: false", "mtp: false"), "unknown config key modules.rollout.mtp"),
        (('schedule_mode: "async"', 'schedule_mode: "fast"'), "schedule.mode: 'fast' is not"),
        (("trainer:", "schedule:\n  mode: sync\ntrainer:"), "schedule.mode is 'sync' but"),
    ],
)
def test_what_honing_cannot_honour_is_an_error_that_says_so(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, GUIDE.replace(*change))
