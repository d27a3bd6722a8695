"""A trainer pointed at rollout servers (``rollout.engine=openai``) checks them as it starts:
a server it cannot reach, one that refuses its token, one that serves another model or
tokenizes differently, and a ``rollout.weight_dir`` it cannot write are one line each, before
the run directory is written. Servers: ``honing serve rollout``'s app on loopback, over the
micro model (or a copy of it) in process."""

import json
import shutil

import httpx
import pytest
import torch

from honing.cli import main
from honing.errors import ConfigError, UserError
from honing.models.loading import load_causal_lm, load_tokenizer
from honing.rollout.native.engine import TransformersEngine
from honing.rollout.remote.engine import OpenAIEngine
from honing.services.process import free_port
from honing.services.rollout import rollout_app

CPU = torch.device("cpu")


def _engine(model_dir, tokenizer=None) -> TransformersEngine:
    tokenizer = tokenizer or load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, tokenizer, dtype="float32", device=CPU).eval()
    return TransformersEngine(model, tokenizer, device=CPU)


@pytest.fixture(scope="module")
def tokenizer(micro_model_dir):
    return load_tokenizer(micro_model_dir)


@pytest.fixture(scope="module")
def policy_engine(micro_model_dir):
    """The policy, as a server loads it (nothing here changes its weights)."""
    return _engine(micro_model_dir)


@pytest.fixture(scope="module")
def other_model(micro_model_dir, tmp_path_factory):
    """Another model directory (the micro model's files under another name)."""
    return shutil.copytree(micro_model_dir, tmp_path_factory.mktemp("m") / "other-policy")


@pytest.fixture(scope="module")
def other_tokenizer(micro_model_dir, tmp_path_factory):
    """The micro model's tokenizer with the ids of "1" and "2" swapped."""
    path = shutil.copytree(micro_model_dir, tmp_path_factory.mktemp("t") / "swapped")
    spec = json.loads((path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["1"], vocab["2"] = vocab["2"], vocab["1"]
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return load_tokenizer(path)


def test_the_policys_servers_pass_and_say_what_they_serve(
    serve, policy_engine, tokenizer, micro_model_dir
):
    urls = [serve(rollout_app(policy_engine, model_name=name)) for name in ("policy", "policy")]
    engine = OpenAIEngine(urls, tokenizer, model_dir=str(micro_model_dir))
    assert engine.model == "policy"  # named by its root, the directory it was loaded from
    engine.close()
    (model,) = httpx.get(f"{urls[0]}/v1/models").json()["data"]
    assert model["root"] == str(micro_model_dir) and model["max_model_len"] == 4096
    body = {"prompt": "12+3=<eos>", "add_special_tokens": False}
    answer = httpx.post(f"{urls[0]}/tokenize", json=body).json()
    assert answer["tokens"] == tokenizer("12+3=<eos>", add_special_tokens=False)["input_ids"]
    assert answer["count"] == 6 and answer["max_model_len"] == 4096


def test_a_refused_token_says_401_and_how_to_pass_one(serve, policy_engine, tokenizer):
    url = serve(rollout_app(policy_engine, model_name="policy", token="s3cret"))
    advice = (
        "(HTTP 401); set HONING_ROLLOUT_TOKEN to the server's token (honing serve rollout "
        "--token, vLLM's and SGLang's --api-key)"
    )
    with pytest.raises(UserError) as missing:
        OpenAIEngine([url], tokenizer)
    assert str(missing.value) == f"rollout.endpoints: {url} needs a token {advice}"
    with pytest.raises(UserError) as wrong:
        OpenAIEngine([url], tokenizer, token="nope")
    assert str(wrong.value) == (
        f"rollout.endpoints: {url} refused the token in HONING_ROLLOUT_TOKEN {advice}"
    )
    OpenAIEngine([url], tokenizer, token="s3cret").close()


def test_an_unreachable_server_is_named(serve, policy_engine, tokenizer):
    up, down = serve(rollout_app(policy_engine, model_name="p")), f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UserError) as refused:
        OpenAIEngine([up, down], tokenizer)
    assert str(refused.value).startswith(f"rollout.endpoints: cannot reach {down} (ConnectError")
    assert str(refused.value).endswith("; start the server or correct the address")


def test_a_server_of_another_model_is_refused(
    serve, policy_engine, tokenizer, micro_model_dir, other_model, other_tokenizer
):
    other = serve(rollout_app(_engine(other_model), model_name=str(other_model)))
    with pytest.raises(ConfigError) as refused:
        OpenAIEngine([other], tokenizer, model_dir=str(micro_model_dir))
    assert str(refused.value) == (
        f"rollout.endpoints: {other} serves '{other_model}' (from {other_model}), not the "
        f"policy at {micro_model_dir}; serve the policy there (the servers start from "
        "model.path), or if it is the policy under another name, set "
        f"rollout.model_name={other_model}"
    )
    # named after the policy, but its tokenizer is not the policy's
    swapped = _engine(micro_model_dir, other_tokenizer)
    lookalike = serve(rollout_app(swapped, model_name=str(micro_model_dir)))
    for model in ("", str(micro_model_dir)):
        with pytest.raises(ConfigError, match="tokenizes .* differently from the tokenizer of"):
            OpenAIEngine([lookalike], tokenizer, model=model, model_dir=str(micro_model_dir))
    policy = serve(rollout_app(policy_engine, model_name="policy"))
    with pytest.raises(ConfigError) as unserved:
        OpenAIEngine([policy], tokenizer, model="qwen")
    assert str(unserved.value) == (
        f"rollout.model_name: {policy} does not serve 'qwen' (it serves ['policy'])"
    )
    with pytest.raises(ConfigError) as mixed:
        OpenAIEngine([policy, other], tokenizer)
    assert str(mixed.value) == (
        f"rollout.endpoints: {other} does not serve 'policy' (it serves ['{other_model}']); "
        f"{policy} serves it"
    )


def test_an_unwritable_weight_dir_is_refused(serve, policy_engine, tokenizer, tmp_path):
    url = serve(rollout_app(policy_engine, model_name="p"))
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match=r"^rollout.weight_dir: cannot write to .*a-file/w \("):
        OpenAIEngine([url], tokenizer, weight_sync="disk", weight_dir=str(tmp_path / "a-file/w"))


@pytest.mark.parametrize("fault", ["token", "unreachable", "other model", "weight_dir"])
def test_a_run_stops_at_the_start_with_one_line(
    fault, serve, policy_engine, other_model, micro_model_dir, digit_reward, tmp_path, capsys
):
    """``honing train`` against servers it cannot use: status 2 and one line, and no run
    directory."""
    url = serve(rollout_app(policy_engine, model_name="policy", token="s3cret"))
    values = {
        "rollout.engine": "openai",
        "rollout.endpoints": url,
        "rollout.weight_sync": "disk",
        "rollout.weight_dir": str(tmp_path / "weights"),
    }
    if fault == "unreachable":
        values["rollout.endpoints"] = f"http://127.0.0.1:{free_port()}"
    elif fault == "other model":
        values["rollout.endpoints"] = serve(rollout_app(_engine(other_model), model_name="o"))
    elif fault == "weight_dir":
        (tmp_path / "a-file").write_text("")
        values["rollout.weight_dir"] = str(tmp_path / "a-file" / "weights")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HONING_ROLLOUT_TOKEN", "" if fault == "token" else "s3cret")
        args = [f"{key}={value}" for key, value in values.items()]
        base = [f"model.path={micro_model_dir}", f"reward.function={digit_reward}"]
        run = tmp_path / "run"
        assert main(["train", *base, *_small(), *args, "--output-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("honing: error: rollout.") and err.count("\n") == 1, err
    assert {
        "token": "(HTTP 401)",
        "unreachable": "cannot reach",
        "other model": "not the policy",
        "weight_dir": "cannot write",
    }[fault] in err
    assert not run.exists()


def _small() -> list[str]:
    from tests.pipeline._configs import BASE

    return [f"{key}={value}" for key, value in BASE.items()]
