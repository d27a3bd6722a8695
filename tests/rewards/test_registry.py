"""load_reward_fn: built-in names, module paths, files, and one-line errors."""

import json
import sys

import pytest

from honing.errors import RewardError
from honing.rewards import registry
from honing.rewards.math.numeric import format_reward, numeric_reward
from honing.rewards.registry import REWARD_FUNCTIONS, load_reward_fn, register_reward

REWARD_FILE = """
def exact(response, ground_truth, **context):
    return float(response.strip() == str(ground_truth))

NOT_A_FUNCTION = 3
"""


def assert_one_line(error):
    assert "\n" not in str(error.value)


def test_builtins_by_name():
    assert load_reward_fn("numeric") is numeric_reward
    assert load_reward_fn(" format ") is format_reward


def test_register_reward_adds_a_name(monkeypatch):
    monkeypatch.setattr(registry, "REWARD_FUNCTIONS", dict(REWARD_FUNCTIONS))

    @register_reward("always_one")
    def always_one(response, ground_truth, **context):
        return 1.0

    assert load_reward_fn("always_one") is always_one
    with pytest.raises(ValueError, match="already registered"):
        register_reward("always_one")(lambda response, ground_truth, **context: 0.0)


def test_module_function():
    assert load_reward_fn("json:dumps") is json.dumps
    assert load_reward_fn("honing.rewards.math.numeric:numeric_reward") is numeric_reward


def test_file_function_relative_to_current_directory(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(REWARD_FILE)
    monkeypatch.chdir(tmp_path)
    exact = load_reward_fn("my_rewards.py:exact")
    assert exact(" 5 ", 5) == 1.0
    assert exact("6", 5) == 0.0
    assert load_reward_fn(f"{tmp_path / 'my_rewards.py'}:exact") is exact


def test_unknown_name_lists_builtins_and_forms():
    with pytest.raises(RewardError) as error:
        load_reward_fn("unknown_name")
    message = str(error.value)
    assert "unknown reward function 'unknown_name'" in message
    assert "code, format, math, numeric" in message
    assert "'package.module:function'" in message and "'path/to/file.py:function'" in message
    assert_one_line(error)


def test_missing_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardError, match=r"reward function file not found: .*nope\.py") as error:
        load_reward_fn("nope.py:f")
    assert_one_line(error)


def test_missing_attribute():
    with pytest.raises(
        RewardError, match=r"honing\.rewards\.math\.numeric has no attribute 'missing'"
    ) as error:
        load_reward_fn("honing.rewards.math.numeric:missing")
    assert_one_line(error)


def test_module_not_importable_includes_import_error():
    with pytest.raises(RewardError, match="cannot import module 'no_such_module_xyz'") as error:
        load_reward_fn("no_such_module_xyz:f")
    assert "ModuleNotFoundError" in str(error.value)
    assert_one_line(error)


def test_not_callable(tmp_path):
    path = tmp_path / "rewards_b.py"
    path.write_text(REWARD_FILE)
    with pytest.raises(RewardError, match="is a int, not callable"):
        load_reward_fn(f"{path}:NOT_A_FUNCTION")


def test_file_that_raises_on_load(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('boom\\nsecond line')\n")
    with pytest.raises(RewardError, match="RuntimeError: boom second line") as error:
        load_reward_fn(f"{path}:f")
    assert_one_line(error)
    assert not any(getattr(m, "__file__", None) == str(path) for m in list(sys.modules.values()))
