"""The deployment guide's configuration shape (top-level ``schedule_mode``, ``modules``,
``memory_management``), mapped onto honing's sections."""

from __future__ import annotations

from typing import Any

from honing.errors import ConfigError

# The deployment guide's configuration shape (top-level schedule_mode, modules,
# memory_management), mapped onto honing's sections. Keys honing cannot honour are errors.
GUIDE_ENGINES = {
    "transformers": "transformers",
    "vllm": "openai",
    "sglang": "openai",
    "openai": "openai",
}
GUIDE_UPDATE_STRATEGIES = ("full", "lora")  # every parameter, or LoRA adapters
GUIDE_LORA_RANK = 16  # update_strategy: lora without model.lora_rank


def from_guide_shape(tree: dict[str, Any], source: str = "config") -> dict[str, Any]:
    """``tree`` with the guide's keys turned into honing's sections (see docs/deployment.md):

    schedule_mode -> schedule.mode; modules.rollout.engine (transformers | vllm | sglang |
    openai) -> rollout.engine; modules.rollout.batch_size -> rollout.batch_size;
    modules.inference.models (URLs, or mappings with url/endpoint and name) ->
    rollout.endpoints and rollout.model_name; modules.training.update_strategy full ->
    model.lora_rank 0, lora -> model.lora_rank (16 unless set);
    modules.rollout.mtp_enabled -> rollout.speculative (mtp, or off);
    memory_management.{dynamic_offload, offload_trigger_threshold} -> memory.*. A key both
    here and in honing's sections must agree.
    """
    tree = dict(tree)
    mapped: dict[str, Any] = {}

    def unknown(where: str, keys) -> None:
        if keys:
            raise ConfigError(f"{source}: unknown config key {where}.{sorted(keys)[0]}")

    def not_yet(key: str, why: str) -> None:
        raise ConfigError(f"{source}: {key} is not supported by honing yet ({why})")

    if "schedule_mode" in tree:
        mapped["schedule.mode"] = tree.pop("schedule_mode")
    modules = tree.pop("modules", None) or {}
    if not isinstance(modules, dict):
        raise ConfigError(f"{source}: modules: expected a mapping")
    unknown("modules", set(modules) - {"rollout", "inference", "training"})
    rollout = modules.get("rollout") or {}
    unknown("modules.rollout", set(rollout) - {"engine", "mtp_enabled", "batch_size"})
    if "engine" in rollout:
        engine = str(rollout["engine"]).lower()
        if engine not in GUIDE_ENGINES:
            raise ConfigError(
                f"{source}: modules.rollout.engine: {rollout['engine']!r} is not allowed; "
                f"choose one of: {', '.join(GUIDE_ENGINES)}"
            )
        mapped["rollout.engine"] = GUIDE_ENGINES[engine]
    if "batch_size" in rollout:
        mapped["rollout.batch_size"] = rollout["batch_size"]
    if "mtp_enabled" in rollout:  # MTP self-speculative decoding (off: no speculation)
        mapped["rollout.speculative"] = "mtp" if rollout["mtp_enabled"] else "off"
    inference = modules.get("inference") or {}
    unknown("modules.inference", set(inference) - {"models"})
    if inference.get("models"):
        urls, names = [], []
        for entry in inference["models"]:
            if isinstance(entry, str):
                urls.append(entry)
            elif isinstance(entry, dict) and (entry.get("url") or entry.get("endpoint")):
                urls.append(str(entry.get("url") or entry.get("endpoint")))
                names += [str(entry["name"])] if entry.get("name") else []
            else:
                raise ConfigError(
                    f"{source}: modules.inference.models: expected server URLs or mappings "
                    f"with url (and name), got {entry!r}"
                )
        if len(set(names)) > 1:
            not_yet("modules.inference.models with several model names", "one policy")
        mapped["rollout.endpoints"] = ",".join(urls)
        if names:
            mapped["rollout.model_name"] = names[0]
    training = modules.get("training") or {}
    unknown("modules.training", set(training) - {"update_strategy"})
    strategy = training.get("update_strategy")
    if strategy is not None and strategy not in GUIDE_UPDATE_STRATEGIES:
        not_yet(
            f"modules.training.update_strategy={strategy!r}",
            f"choose one of: {', '.join(GUIDE_UPDATE_STRATEGIES)}",
        )
    if strategy == "full":
        mapped["model.lora_rank"] = 0
    elif strategy == "lora":
        given = (
            (tree.get("model") or {}).get("lora_rank")
            if isinstance(tree.get("model"), dict)
            else None
        )
        mapped["model.lora_rank"] = given if given else GUIDE_LORA_RANK
    memory = tree.pop("memory_management", None) or {}
    unknown("memory_management", set(memory) - {"dynamic_offload", "offload_trigger_threshold"})
    for name in ("dynamic_offload", "offload_trigger_threshold"):
        if name in memory:
            mapped[f"memory.{name}"] = memory[name]
    for key, value in mapped.items():
        section, _, name = key.partition(".")
        here = tree.setdefault(section, {})
        if not isinstance(here, dict):
            raise ConfigError(f"{source}: {section}: expected a mapping")
        if name in here and here[name] != value:
            raise ConfigError(
                f"{source}: {key} is {here[name]!r} but the guide's key says {value!r}"
            )
        here[name] = value
    return tree
