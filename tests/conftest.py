"""Shared fixtures: a very small warm-started model and a reward with signal for it; and how
the suite runs on several workers (pytest-xdist, ``make test``): which tests stay together on
one worker, and a test marked ``alone`` with no other test beside it."""

import fcntl
import os
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest

from honing.data import warmstart_corpus
from honing.models.loading import load_tokenizer, save_model
from honing.models.tiny import TinySpec, build_tiny_model
from tests.models.moe_families import build as build_moe_family
from tests.models.moe_models import moe_model

# Every metric a test run logs must be in honing/monitor/names.py, which alert rules are
# checked against (the logger refuses an unknown name under this variable).
os.environ["HONING_CHECK_METRIC_NAMES"] = "1"

MICRO_SPEC = TinySpec(
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    intermediate_size=64,
    warmstart_steps=30,
    warmstart_batch=64,
)

# The micro model almost never answers an arithmetic problem correctly, so under the built-in
# reward every score is 0, every GRPO advantage is 0 and training would not move the weights.
# This graded reward varies within every group, so pipeline tests really train.
DIGIT_REWARD = '''
def digit_fraction(response, ground_truth, **context):
    """Fraction of the response's characters that are digits (0 for an empty response)."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)
'''


# Modules whose tests share a costly fixture made once per module (a Ray cluster, served
# engines, an MLflow server): under pytest-xdist all of a group's tests go to one worker, which
# makes it once. The Ray modules are two groups, each with a local cluster of its own (two run
# at once: Ray instances on one machine are independent). Every other test is scheduled on its
# own.
ONE_WORKER = {
    "tests/pipeline/test_ray_backend.py": "ray",
    "tests/pipeline/test_ray_placement.py": "ray",
    "tests/pipeline/test_ray_autoscale.py": "ray-2",
    "tests/pipeline/test_ray_trainers.py": "ray-2",
    "tests/rollout/test_openai_engine.py": "rollout-servers",
    "tests/rollout/test_vllm_server.py": "vllm-server",
    "tests/monitor/test_trackers_e2e.py": "trackers",
    # a module-scoped set of spawned ranks serves every test of the module: one worker, so
    # that the ranks are spawned once, not on each worker that runs one of its tests
    "tests/trainer/test_expert_parallel.py": "expert-parallel",
    "tests/trainer/test_sequence_families.py": "sequence-families",
    "tests/trainer/test_sequence_routing.py": "sequence-routing",
    "tests/trainer/test_sequence_parallel.py": "sequence-parallel",
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's ``--dist load`` (what ``-n`` gives), with the groups of ``ONE_WORKER``. (Its
    ``xdist_group`` mark does not group under pytest 9.2: pytest-xdist issue 1386.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class TestsAndGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return ONE_WORKER.get(nodeid.split("::", 1)[0], nodeid)

    return TestsAndGroups(config, log)


@pytest.fixture(autouse=True)
def _share_of_the_machine(request, tmp_path_factory):
    """Under pytest-xdist (``make test``), a test marked ``alone`` holds the machine by
    itself: its timings or machine-wide counters would otherwise include another worker's
    load. Every other test holds a share; a gate taken first lets a waiting ``alone`` test in
    before later shares (without it, a stream of short tests could hold it off for good).
    Only tests take it: another worker's module fixtures, and the processes they started (a
    server booting), may still run beside an ``alone`` test, so its bounds keep a margin."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    root = tmp_path_factory.getbasetemp().parent  # the session's, shared by its workers
    mode = fcntl.LOCK_EX if request.node.get_closest_marker("alone") else fcntl.LOCK_SH
    with open(root / "machine.gate", "a") as gate, open(root / "machine.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(lock, mode)
        fcntl.flock(gate, fcntl.LOCK_UN)
        yield  # closing the file releases the lock


@pytest.fixture(scope="session")
def micro_model_dir(tmp_path_factory) -> Path:
    """A ~20k-parameter Llama in Hugging Face format, with the built-in tiny tokenizer."""
    corpus = warmstart_corpus(1000, 0, 2, 0.6)
    return build_tiny_model(
        tmp_path_factory.mktemp("models"), corpus, MICRO_SPEC, log=lambda message: None
    )


# vLLM's CPU attention has no kernel for the micro model's head size (16): 64 over 2 heads is 32.
# Its tokenizer has the tool-call tags as tokens of their own, as chat models with tools do.
VLLM_SPEC = TinySpec(
    **(asdict(MICRO_SPEC) | {"hidden_size": 64, "intermediate_size": 128, "tool_tags": True})
)


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory) -> Path:
    """The micro model with a head size vLLM's CPU build takes (tied embeddings, as the tiny
    models have) and the tool-call tags."""
    corpus = warmstart_corpus(1000, 0, 2, 0.6)
    return build_tiny_model(
        tmp_path_factory.mktemp("vllm-models"), corpus, VLLM_SPEC, log=lambda message: None
    )


@pytest.fixture(scope="session")
def tagged_model_dir(micro_model_dir, tmp_path_factory) -> Path:
    """The micro model with the Hermes tags as special tokens of its tokenizer (embeddings
    grown by two rows), as a chat model with tools has them."""
    from honing.models.loading import load_causal_lm, load_tokenizer, save_model

    tokenizer = load_tokenizer(micro_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    model = load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device="cpu")
    model.resize_token_embeddings(len(tokenizer))
    directory = tmp_path_factory.mktemp("tagged") / "model"
    save_model(model, tokenizer, directory)
    return directory


@pytest.fixture(scope="session")
def tagged_tokenizer(tagged_model_dir):
    """``tagged_model_dir``'s tokenizer: the built-in one with the Hermes tags as tokens."""
    from honing.models.loading import load_tokenizer

    return load_tokenizer(tagged_model_dir)


@pytest.fixture(scope="session")
def digit_reward(tmp_path_factory) -> str:
    """A ``reward.function`` spec (``file.py:function``) for ``DIGIT_REWARD``."""
    path = tmp_path_factory.mktemp("rewards") / "digit_reward.py"
    path.write_text(DIGIT_REWARD)
    return f"{path}:digit_fraction"


@pytest.fixture
def run_config():
    """``small_run_config`` of the pipeline tests, for tests in other folders."""
    from pipeline._configs import small_run_config

    return small_run_config


# families whose routers differ from Qwen3-MoE's most (their routers' names, outputs and
# recipes; DBRX's block chooses) and phimoe, refused
OTHER_MOE_FAMILIES = ("gpt_oss", "llama4_text", "granitemoe", "jamba", "dbrx", "phimoe")


@pytest.fixture(scope="session")
def moe_dirs(tmp_path_factory, micro_model_dir):
    """Model directories of small random MoE families with the micro model's tokenizer."""
    tokenizer = load_tokenizer(micro_model_dir)
    root = tmp_path_factory.mktemp("moe")
    dirs = {}
    for family in ("qwen3_moe", "mixtral", "deepseek_v3", *OTHER_MOE_FAMILIES):
        if family in OTHER_MOE_FAMILIES:  # as tests/models/moe_families.py builds them
            special = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": None}
            model = build_moe_family(family, vocab_size=len(tokenizer), **special)
        else:
            model = moe_model(family, len(tokenizer), tokenizer.pad_token_id)
        model.config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        save_model(model, tokenizer, root / family)
        dirs[family] = root / family
    return dirs


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size, mount_point=None)`` mounts a real tmpfs of that size (``"8k"``) at
    ``mount_point`` (made; a fresh folder of ``tmp_path`` by default) and returns it; the
    test is skipped where mounting is not permitted."""
    mounted = []

    def mount(size: str, mount_point: Path | None = None) -> Path:
        mount_point = mount_point or tmp_path / f"disk-{len(mounted)}"
        mount_point.mkdir(parents=True)
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip() or 'not permitted'}")
        mounted.append(mount_point)
        return mount_point

    yield mount
    for mount_point in mounted:
        subprocess.run(["umount", "--lazy", str(mount_point)], check=True)  # even if still open
