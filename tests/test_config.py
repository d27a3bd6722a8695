"""The config tree: layer precedence, validation messages, YAML errors, round trip."""

import dataclasses

import pytest

from honing.config import (
    SECTIONS,
    Config,
    build_config,
    dump_yaml,
    env_overrides,
    load_yaml,
    parse_overrides,
    resolve_config,
)
from honing.errors import ConfigError

# --- precedence: defaults < YAML < environment < command line --------------------------------


@pytest.fixture
def yaml_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model:\n"
        "  path: /from/yaml\n"
        "rollout:\n"
        "  group_size: 4\n"
        "  batch_size: 3\n"
        "  max_seq_len: 100\n"
        "trainer:\n"
        "  lr: 0.002\n"
    )
    return path


def test_defaults_without_any_layer():
    config = resolve_config(None, [], environ={})
    assert config == Config()
    assert config.rollout.group_size == 8
    assert config.model.path == "builtin:tiny"


def test_yaml_overrides_defaults(yaml_file):
    config = resolve_config(str(yaml_file), [], environ={})
    assert config.model.path == "/from/yaml"
    assert config.rollout.group_size == 4
    assert config.trainer.lr == 0.002
    assert config.trainer.seed == 0  # untouched by the file: still the default


def test_environment_overrides_yaml(yaml_file):
    environ = {
        "MODEL_PATH": "/from/env",
        "ROLLOUT_BATCH_SIZE": "5",
        "GROUP_SIZE": "6",
        "MAX_SEQ_LEN": "200",
        "VERIFIER_ENDPOINT": "http://verifier:8000",
        "UNRELATED": "ignored",
    }
    config = resolve_config(str(yaml_file), [], environ=environ)
    assert config.model.path == "/from/env"
    assert config.rollout.batch_size == 5
    assert config.rollout.group_size == 6
    assert config.rollout.max_seq_len == 200
    assert config.reward.endpoint == "http://verifier:8000"
    assert config.trainer.lr == 0.002  # no variable for it: the YAML value stays


def test_command_line_overrides_environment(yaml_file):
    environ = {"GROUP_SIZE": "6", "MODEL_PATH": "/from/env"}
    config = resolve_config(
        str(yaml_file), ["rollout.group_size=2", "trainer.lr=0.5"], environ=environ
    )
    assert config.rollout.group_size == 2
    assert config.trainer.lr == 0.5
    assert config.model.path == "/from/env"


def test_empty_environment_variable_is_ignored(yaml_file):
    config = resolve_config(str(yaml_file), [], environ={"GROUP_SIZE": ""})
    assert config.rollout.group_size == 4


def test_env_overrides_maps_deployment_names():
    assert env_overrides({"GROUP_SIZE": "3", "HOME": "/root"}) == {"rollout.group_size": "3"}


# --- unknown keys ----------------------------------------------------------------------------


def test_unknown_key_suggests_the_closest():
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'rollout.grup_size'; did you mean rollout.group_size\?",
    ):
        build_config({"rollout.grup_size": 4})


def test_unknown_section_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"did you mean trainer.lr\?"):
        build_config({"trainr.lr": 0.1})


def test_bare_key_suggests_its_section():
    with pytest.raises(ConfigError, match=r"unknown config key 'group_size'; did you mean "):
        build_config({"group_size": 4})
    with pytest.raises(ConfigError, match=r"rollout.group_size\?"):
        build_config({"group_size": 4})


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  grup_size: 4\n")
    with pytest.raises(ConfigError, match=r"did you mean rollout.group_size\?"):
        resolve_config(str(path), [], environ={})


# --- types, ranges, choices ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("rollout.group_size", "four", "rollout.group_size: expected int, got 'four'"),
        ("rollout.group_size", 2.5, "rollout.group_size: expected int, got 2.5"),
        ("rollout.group_size", True, "rollout.group_size: expected int, got True"),
        ("trainer.lr", "fast", "trainer.lr: expected float, got 'fast'"),
        ("monitor.console", "maybe", "monitor.console: expected bool, got 'maybe'"),
        ("model.path", ["a", "b"], "model.path: expected str, got \\['a', 'b'\\]"),
        ("trainer.betas", 0.9, "trainer.betas: expected list, got 0.9"),
    ],
)
def test_wrong_type_names_key_and_expected_type(key, value, message):
    with pytest.raises(ConfigError, match=message):
        build_config({key: value})


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("rollout.group_size", 0, "rollout.group_size: 0 is out of range; must be >= 1"),
        ("rollout.temperature", 0.0, "rollout.temperature: 0.0 is out of range; must be > 0.0"),
        ("rollout.top_p", 1.5, "rollout.top_p: 1.5 is out of range; must be <= 1.0"),
        ("data.max_digits", 10, "data.max_digits: 10 is out of range; must be <= 9"),
    ],
)
def test_out_of_range_names_key_and_bound(key, value, message):
    with pytest.raises(ConfigError, match=message):
        build_config({key: value})


def test_bounds_are_inclusive_where_they_say_so():
    config = build_config({"rollout.group_size": 1, "rollout.top_p": 1.0, "data.max_digits": 9})
    assert (config.rollout.group_size, config.rollout.top_p, config.data.max_digits) == (1, 1.0, 9)


def test_choices_list_the_allowed_values():
    with pytest.raises(
        ConfigError,
        match="model.dtype: 'float64' is not allowed; choose one of: float32, bfloat16, float16",
    ):
        build_config({"model.dtype": "float64"})
    assert build_config({"model.dtype": "bfloat16"}).model.dtype == "bfloat16"


def test_env_value_of_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match="rollout.batch_size: expected int, got 'many'"):
        resolve_config(None, [], environ={"ROLLOUT_BATCH_SIZE": "many"})


def test_numbers_from_strings():
    config = build_config({"rollout.group_size": "12", "trainer.lr": "3e-4", "trainer.seed": 7.0})
    assert config.rollout.group_size == 12 and isinstance(config.rollout.group_size, int)
    assert config.trainer.lr == pytest.approx(3e-4)
    assert config.trainer.seed == 7 and isinstance(config.trainer.seed, int)


# --- booleans and lists ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("true", True),
        ("TRUE", True),
        ("yes", True),
        ("1", True),
        ("false", False),
        ("No", False),
        ("0", False),
        (True, True),
        (False, False),
    ],
)
def test_bool_parsing(raw, expected):
    assert build_config({"monitor.console": raw}).monitor.console is expected


def test_bool_from_command_line():
    config = resolve_config(None, ["monitor.console=false", "data.shuffle=yes"], environ={})
    assert config.monitor.console is False
    assert config.data.shuffle is True


def test_list_from_command_line():
    config = resolve_config(None, ["trainer.betas=[0.9,0.95]"], environ={})
    assert config.trainer.betas == [0.9, 0.95]


def test_list_from_string_and_single_value():
    assert build_config({"trainer.betas": "[0.8, 0.9]"}).trainer.betas == [0.8, 0.9]
    # A bare string is a one-file list: data.train_files=train.jsonl.
    assert build_config({"data.train_files": "train.jsonl"}).data.train_files == ["train.jsonl"]


@pytest.mark.parametrize("betas", [[0.9], [0.9, 0.95, 0.99], ["a", "b"], [0.9, 1.5]])
def test_betas_must_be_two_numbers_in_the_unit_interval(betas):
    # Anything else reaches torch.optim.AdamW and fails there with a traceback.
    with pytest.raises(ConfigError, match=r"^trainer\.betas: "):
        build_config({"trainer.betas": betas})


def test_parse_overrides_yaml_scalars():
    assert parse_overrides(["a.b=3", "a.c=0.5", "a.d=text", "a.e=", "a.f=[1, 2]"]) == {
        "a.b": 3,
        "a.c": 0.5,
        "a.d": "text",
        "a.e": "",
        "a.f": [1, 2],
    }


def test_override_without_equals_sign():
    with pytest.raises(ConfigError, match="bad override 'trainer.lr': expected section.key=value"):
        parse_overrides(["trainer.lr"])


def test_list_defaults_are_not_shared():
    first, second = Config(), Config()
    assert first.trainer.betas == [0.9, 0.999]
    assert first.trainer.betas is not second.trainer.betas


# --- non-finite numbers ----------------------------------------------------------------------

FLOAT_KEYS = [
    f"{section}.{f.name}"
    for section, cls in SECTIONS.items()
    for f in dataclasses.fields(cls)
    if f.type == "float"
]


def test_every_float_key_is_checked():
    assert len(FLOAT_KEYS) > 20 and "trainer.lr" in FLOAT_KEYS
    assert "reward.format_weight" in FLOAT_KEYS  # no range of its own: finiteness still holds


@pytest.mark.parametrize("raw", ["inf", "-inf", "nan", ".inf", "1e999"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_every_float_key_refuses_non_finite_values(key, raw):
    with pytest.raises(ConfigError, match=rf"^{key}: .* expected a finite number$"):
        build_config(parse_overrides([f"{key}={raw}"]))


@pytest.mark.parametrize(
    "override",
    ["trainer.betas=[0.9, .nan]", "trainer.betas=[.inf, 0.9]", "reward.weights={format: .inf}"],
)
def test_float_items_of_lists_and_mappings_must_be_finite(override):
    with pytest.raises(ConfigError, match="expected a finite number"):
        build_config(parse_overrides([override]))


def test_large_finite_values_are_still_allowed():
    config = build_config({"trainer.lr": 1e30, "reward.format_weight": -1e30})
    assert config.trainer.lr == 1e30


# --- endpoints -------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["reward.endpoint", "rollout.endpoints", "monitor.webhook_url"])
@pytest.mark.parametrize("bad", ["not-a-url", "ftp://x", "http://", "http://h:99x", "h:8080"])
def test_endpoints_must_be_http_urls(key, bad):
    with pytest.raises(ConfigError, match=rf"^{key}: '.*' is not an http\(s\) URL"):
        build_config({key: bad})


def test_endpoint_from_the_environment_is_checked_with_the_config():
    with pytest.raises(ConfigError, match="reward.endpoint: 'not-a-url'"):
        resolve_config(None, [], environ={"VERIFIER_ENDPOINT": "not-a-url"})


def test_good_endpoints_pass():
    urls = "http://127.0.0.1:8080, https://verifier.internal/score,"
    assert build_config({"reward.endpoint": urls}).reward.endpoint == urls


# --- YAML files ------------------------------------------------------------------------------


def test_a_key_given_twice_in_yaml_is_an_error(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("trainer:\n  lr: 0.001\n  seed: 3\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=rf"^{path}:4: .*duplicate key 'lr' \(also at line 2\)"):
        load_yaml(path)


def test_a_section_given_twice_in_yaml_is_an_error(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("trainer:\n  lr: 0.001\nrollout:\n  top_k: 2\ntrainer:\n  seed: 3\n")
    with pytest.raises(ConfigError, match=rf"^{path}:5: .*duplicate key 'trainer'"):
        load_yaml(path)


@pytest.mark.parametrize("value", ["5", "[1, 2]", "fast"])
def test_a_section_that_is_not_a_mapping_says_so(tmp_path, value):
    path = tmp_path / "scalar.yaml"
    path.write_text(f"rollout: {value}\n")
    with pytest.raises(ConfigError, match=rf"^{path}: rollout: a section must be a mapping"):
        load_yaml(path)


def test_an_empty_section_is_the_defaults(tmp_path):
    path = tmp_path / "empty_section.yaml"
    path.write_text("rollout:\ntrainer:\n  seed: 4\n")
    assert resolve_config(str(path), [], environ={}).trainer.seed == 4


def test_a_section_on_the_command_line_names_its_keys():
    with pytest.raises(ConfigError, match="'rollout' is a section, not a key; set one of its"):
        build_config(parse_overrides(["rollout=5"]))


def test_a_config_file_that_is_not_text(tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe\x00trainer")
    with pytest.raises(ConfigError, match=rf"^{path}: "):
        load_yaml(path)


def test_bad_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    # Line 3 is indented deeper than `lr`: a mapping value where none is allowed.
    path.write_text("trainer:\n  lr: 0.001\n   seed: 3\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3: not valid YAML \(") as err:
        load_yaml(path)
    assert "\n" not in str(err.value)


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=f"config file not found: {missing}"):
        resolve_config(str(missing), [], environ={})


def test_yaml_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=f"{path}: expected a mapping of sections, got list"):
        load_yaml(path)


def test_empty_yaml_is_the_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert resolve_config(str(path), [], environ={}) == Config()


def test_resolved_config_round_trips_through_yaml(tmp_path, yaml_file):
    config = resolve_config(
        str(yaml_file),
        [
            "trainer.betas=[0.9,0.95]",
            "data.train_files=[a.jsonl,b.parquet]",
            "monitor.tensorboard=false",
            "model.path=123",  # a str that looks like a number must stay a str
            "trainer.lr=1e-5",
        ],
        environ={"VERIFIER_ENDPOINT": "http://v:1"},
    )
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_yaml(config))
    again = build_config(load_yaml(path))
    assert again == config
    assert again.model.path == "123"
    # Every field is written, so the file alone reproduces the run.
    sections = {f.name for f in dataclasses.fields(Config)}
    assert set(load_yaml(path)) == {
        f"{s}.{f.name}" for s in sections for f in dataclasses.fields(getattr(config, s))
    }
