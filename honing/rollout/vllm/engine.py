"""vLLM in the trainer's process (``rollout.engine=vllm``): the colocated engine.

vLLM's ``LLM`` runs here (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), loaded from the policy's
model directory; every weight version after that is loaded in place, bucket by bucket, with
vLLM's layerwise reload (``weights.py``): no disk, no whole copy of the model. Each
request samples with a seed of its own derived from the call's seed and the request's position,
so a step's samples do not depend on history; the logprob of each sampled token is vLLM's
``processed_logprobs``, taken from the distribution the token was sampled from (after
temperature, top-k and top-p), which is what importance weights need.

vLLM holds a plain model: its pieces are the policy's under the plain model's names, a LoRA
policy's adapters merged (``Holding.REMOTE``). On CUDA, ``sleep`` frees the KV cache and moves
the weights off the GPU between generations (vLLM's sleep mode), so the trainer has the memory
while it updates.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from honing.rollout.base import (
    EngineReport,
    GenerationRequest,
    Holding,
    RolloutEngine,
    SamplingParams,
    WeightBuckets,
)
from honing.rollout.vllm.live import LiveRequests
from honing.rollout.vllm.weights import begin_reload, finish_reload, load_pieces
from honing.seeds import request_seed
from honing.types import Rollout

IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"
CPU_KV_CACHE_MB = 256  # rollout.vllm_kv_cache_mb=0 on a CPU
INSTALL_HINT = (
    'rollout.engine=vllm needs vLLM: pip install -e ".[vllm]" (x86-64 CPUs), or upstream vllm '
    "on a GPU machine (README)"
)


@dataclass(frozen=True)
class VLLMSettings:
    """How vLLM runs: its KV cache (CPU: bytes reserved; CUDA: 0 lets
    ``gpu_memory_utilization`` size it), eager or compiled (CUDA graphs), CUDA's share of the
    GPU and sleep mode between generations, sequences in flight, the weights' dtype; the
    prefix cache (off: the engine keeps live requests' caches across updates, ``keeps_kv``);
    ``torchrun``: vLLM joins the torchrun ranks' process group (vLLM's external launcher: each
    rank's engine on its own device), tensor-parallel over groups of ``tensor_parallel``
    consecutive ranks, which all generate the same requests."""

    kv_cache_mb: int = 256
    enforce_eager: bool = True
    gpu_memory_utilization: float = 0.5
    sleep: bool = False
    max_num_seqs: int = 256
    dtype: str = "float32"
    seed: int = 0
    prefix_caching: bool = True
    torchrun: bool = False
    tensor_parallel: int = 1


def vllm_available() -> str | None:
    """None when vLLM imports, else the one line that says how to install it."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return INSTALL_HINT
    except Exception as err:  # noqa: BLE001 - installed but broken (e.g. a CUDA torchvision)
        return f"rollout.engine=vllm: vLLM is installed but does not import ({err})"
    return None


def model_problem(model_config, device_type: str) -> str | None:
    """Why vLLM cannot run this model here, or None: on a CPU its attention kernels take
    only some head sizes (32, 64, 80, ... 512; not 16)."""
    if device_type != "cpu":
        return None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in sizes:
        return (
            f"vLLM's CPU attention takes head sizes {', '.join(map(str, sizes))}; this "
            f"model's is {head_dim}"
        )
    return None


SHM = Path("/dev/shm")


def _drop_cpu_segments() -> None:
    """Lets go of the shared-memory segments of vLLM's tensor-parallel groups on a CPU
    (``...-cpushm_<rank>``). vLLM names them after the run's init method alone, which under
    torchrun is the same for every run, and leaves them behind when it closes: a segment a
    killed run left would make the next run's engine fail to start (``create shm in
    SHMManager failed. errno: 17``). Called before an engine starts (creating them takes
    every rank of the group, so no rank's new ones are there yet) and after it closes."""
    for path in SHM.glob("*-cpushm_*"):
        if path.name.rsplit("_", 1)[1].isdigit():
            path.unlink(missing_ok=True)


def _begin_reload(worker) -> None:
    """In vLLM's worker: ``weights.begin_reload``."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        begin_reload(worker.model_runner.model)


def _load_bucket(worker, bucket: list) -> set[str]:
    """In vLLM's worker: ``weights.load_pieces`` (the parameter names loaded)."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        return load_pieces(worker.model_runner.model, bucket)


def _finish_reload(worker) -> set[str]:
    """In vLLM's worker: ``weights.finish_reload``; returns the names of the model's
    parameters (a tied one once)."""
    from vllm.config import set_current_vllm_config

    model = worker.model_runner.model
    with set_current_vllm_config(worker.vllm_config):
        finish_reload(model, worker.vllm_config.model_config)
    return {name for name, _ in model.named_parameters()}


def _vllm_sampling(params: SamplingParams, max_tokens: int, seed: int, stop_ids, n: int):
    from vllm import SamplingParams as VLLMSampling

    return VLLMSampling(
        n=n,
        max_tokens=max_tokens,
        temperature=0.0 if params.greedy else params.temperature,
        top_k=0 if params.greedy else params.top_k,
        top_p=1.0 if params.greedy else params.top_p,
        seed=seed,
        logprobs=0,  # the sampled token's own logprob
        stop_token_ids=sorted(stop_ids),
        ignore_eos=True,  # the stop ids above are the whole set (the tokenizer's EOS included)
        detokenize=False,
    )


class VLLMEngine(RolloutEngine):
    """Samples with vLLM's ``LLM`` in this process; takes each new version as buckets of the
    plain model's (name, tensor) pieces. ``stop_ids``: the token ids that end a response
    (the tokenizer's EOS and the model's generation config's); ``max_seq_len``: the model
    length vLLM reserves for (prompt + response)."""

    def __init__(
        self,
        model_dir: Path | str,
        tokenizer,
        *,
        stop_ids: set[int],
        max_seq_len: int,
        settings: VLLMSettings | None = None,
        device_type: str = "cpu",
        weights: WeightBuckets | None = None,
        vocab_size: int | None = None,
    ):
        """``weights``: the policy's starting weights, which vLLM then takes in place of the
        directory's (it starts with placeholder weights: no second read of the checkpoint;
        ``vocab_size``, the policy's embedding rows, when honing grew them for a pad token
        the tokenizer lacked)."""
        super().__init__(Holding.REMOTE)
        self.seeds_by_index = True  # request_seed of the request's index in the whole call
        if (hint := vllm_available()) is not None:
            raise ImportError(hint)
        self.tokenizer = tokenizer
        self.stop_ids = set(stop_ids)
        self.settings = settings or VLLMSettings()
        self.shared_by_ranks = self.settings.tensor_parallel
        self.cuda = device_type == "cuda"
        # on a CPU, tensor parallel: vLLM's groups keep segments in /dev/shm
        self._cpu_segments = not self.cuda and self.settings.torchrun and self.shared_by_ranks > 1
        self.model_dir = str(model_dir)
        self.max_seq_len = max_seq_len
        started = time.perf_counter()
        self.llm = self._start(max_seq_len, weights is not None, vocab_size)
        self._pinned = threading.local()  # the threads given ``_threads`` (_pin_threads)
        self._threads = self._omp_threads()
        # without a prefix cache: keyed requests stay alive between calls (live.py)
        self.keeps_kv = not self.settings.prefix_caching
        self._live = LiveRequests(self.llm, self._live_sampling)
        if weights is not None:
            self.load_weights(0, weights)
        self.start_seconds = time.perf_counter() - started

    def _start(self, max_seq_len: int, placeholder: bool, vocab_size: int | None):
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        import torch
        from vllm import LLM

        s = self.settings
        options: dict = {}
        if self.cuda:
            options["gpu_memory_utilization"] = s.gpu_memory_utilization
            options["enable_sleep_mode"] = s.sleep
            if s.kv_cache_mb:
                options["kv_cache_memory_bytes"] = s.kv_cache_mb << 20
        else:  # on a CPU, gpu_memory_utilization would reserve that share of the RAM
            options["kv_cache_memory_bytes"] = s.kv_cache_mb << 20
        if s.torchrun:  # vLLM uses torchrun's RANK, LOCAL_RANK and the ranks' group
            options["distributed_executor_backend"] = "external_launcher"
            options["tensor_parallel_size"] = s.tensor_parallel
            if self._cpu_segments:
                _drop_cpu_segments()  # stale ones
        if placeholder:
            options["load_format"] = "dummy"
        if vocab_size is not None:
            options["hf_overrides"] = {"vocab_size": vocab_size}
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process;
        # the trainer's thread setting (trainer.threads) stays the trainer's to make.
        set_num_threads = torch.set_num_threads
        multiprocessing = os.environ.get(IN_PROCESS)
        os.environ[IN_PROCESS] = "0"  # the engine core in this process
        try:
            return LLM(
                model=self.model_dir,
                skip_tokenizer_init=True,
                dtype=s.dtype,
                enforce_eager=s.enforce_eager,
                max_model_len=max_seq_len,
                max_num_seqs=s.max_num_seqs,
                seed=s.seed,
                logprobs_mode="processed_logprobs",
                enable_prefix_caching=s.prefix_caching,
                **options,
            )
        finally:  # a vLLM server started from this process later spawns its own
            torch.set_num_threads = set_num_threads
            if multiprocessing is None:
                os.environ.pop(IN_PROCESS, None)
            else:
                os.environ[IN_PROCESS] = multiprocessing

    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[Rollout]:
        from vllm.inputs import TokensPrompt

        for r in requests:
            if len(r.prompt_ids) >= min(params.max_seq_len, self.max_seq_len):
                raise ValueError(
                    f"prompt {r.prompt_id} has {len(r.prompt_ids)} tokens; rollout.max_seq_len "
                    f"is {min(params.max_seq_len, self.max_seq_len)} (raise it or shorten the "
                    "prompt)"
                )
        self._pin_threads()
        self._wake()
        if self.keeps_kv and any(r.key is not None for r in requests):
            return self._continue(requests, params)
        self._live.drop()  # a call drops the live requests it does not continue
        # vLLM samples greedily one sequence per request: a greedy group is n requests.
        copies, n = (params.n, 1) if params.greedy else (1, params.n)
        flat = [r for r in requests for _ in range(copies)]
        prompts, sampling = [], []
        for index, r in enumerate(flat):
            limit = min(params.max_seq_len, self.max_seq_len)
            budget = min(params.max_new_tokens, limit - len(r.prompt_ids))
            prompts.append(TokensPrompt(prompt_token_ids=list(r.prompt_ids)))
            seed = request_seed(params.seed, params.first_index * copies + index, n)
            stops = self.stop_ids | set(params.stop_ids)
            sampling.append(_vllm_sampling(params, budget, seed, stops, n))
        started = time.perf_counter()
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        seconds = time.perf_counter() - started
        rollouts = [
            self._rollout(request, completion, seconds)
            for request, output in zip(flat, outputs, strict=True)
            for completion in output.outputs
        ]
        self._rest()
        return rollouts

    def _continue(self, requests: list[GenerationRequest], params: SamplingParams) -> list[Rollout]:
        """A chunk of each keyed request, continued in vLLM over its kept cache."""
        if params.n != 1 or any(r.key is None for r in requests):
            raise ValueError("keyed requests are single samples to continue: all keyed, n=1")
        started = time.perf_counter()
        made = self._live.generate(requests, params, self.max_seq_len)
        seconds = time.perf_counter() - started
        return [
            Rollout(
                prompt_id=r.prompt_id,
                group_index=r.group_index,
                prompt_ids=list(r.prompt_ids),
                response_ids=m.ids,
                behaviour_logprobs=m.logprobs,
                finish_reason=m.finish,
                weight_version=self.weight_version,
                text=self.tokenizer.decode(m.ids, skip_special_tokens=True),
                gen_seconds=seconds,
            )
            for r, m in zip(requests, made, strict=True)
        ]

    def take_report(self) -> EngineReport:
        """The cache tokens that continued samples went on from since the last take."""
        kept, self._live.kept_tokens = self._live.kept_tokens, 0
        return ({"partial/kv_kept_tokens": float(kept)} if kept else {}), []

    def _live_sampling(self, params: SamplingParams, max_tokens: int, seed: int):
        return _vllm_sampling(params, max_tokens, seed, self.stop_ids | set(params.stop_ids), 1)

    def _rollout(self, request: GenerationRequest, completion, seconds: float) -> Rollout:
        ids = list(completion.token_ids)
        entries = zip(completion.logprobs, ids, strict=True)
        logprobs = [entry[token].logprob for entry, token in entries]
        reason = completion.finish_reason
        if reason == "error":  # vLLM failed inside: nothing to train on
            raise RuntimeError(f"vLLM failed while completing prompt {request.prompt_id}")
        if reason not in ("stop", "length"):
            reason = "abort"
        return Rollout(
            prompt_id=request.prompt_id,
            group_index=request.group_index,
            prompt_ids=list(request.prompt_ids),
            response_ids=ids,
            behaviour_logprobs=logprobs,
            finish_reason=reason,
            weight_version=self.weight_version,
            text=self.tokenizer.decode(ids, skip_special_tokens=True),
            gen_seconds=seconds,
        )

    def load_weights(self, version: int, weights: WeightBuckets | None = None) -> None:
        """Loads each bucket into vLLM's model as it comes (layerwise reload: a layer is
        processed once all its tensors have arrived), then drops the prefix cache, whose
        keys and values were computed with the old weights."""
        if weights is not None:
            self._pin_threads()
            if self._asleep():
                self.llm.wake_up(tags=["weights"])
            self.llm.collective_rpc(_begin_reload)
            loaded: set[str] = set()
            for bucket in weights:
                [names] = self.llm.collective_rpc(_load_bucket, args=(list(bucket),))
                loaded |= names
            [expected] = self.llm.collective_rpc(_finish_reload)
            if self.settings.prefix_caching:
                self.llm.reset_prefix_cache()
            if missing := sorted(expected - loaded):
                raise ValueError(
                    f"vLLM's model got no weights for {len(missing)} of its parameters (e.g. "
                    f"{', '.join(missing[:3])}): the policy's weight names do not map onto "
                    "vLLM's for this model; use rollout.engine=transformers"
                )
        self.weight_version = version

    def _pin_threads(self) -> None:
        """Gives the calling thread the OpenMP thread count the engine was built with, once
        per thread. A thread that never set its own reads OpenMP's process-wide default, and
        vLLM's CPU attention checks that the count its step metadata was built with is the
        count its kernel runs with: in a generation thread beside a training thread the two
        differed and the step aborted (``input->metadata->thread_num == thread_num``)."""
        if not getattr(self._pinned, "done", False):
            self._omp_threads(self._threads)
            self._pinned.done = True

    @staticmethod
    def _omp_threads(count: int | None = None) -> int:
        """This thread's OpenMP thread count, after setting it to ``count`` if given."""
        import torch

        if count is not None:
            torch.set_num_threads(count)
        return torch.get_num_threads()

    def _asleep(self) -> bool:
        """Whether vLLM sleeps (asked of vLLM, so that a sleep that failed half-way is not
        taken for one that happened)."""
        return self.cuda and self.settings.sleep and self.llm.llm_engine.is_sleeping()

    def _wake(self) -> None:
        if self._asleep():
            self.llm.wake_up()

    def _rest(self) -> None:
        """CUDA with ``sleep``: frees the KV cache and offloads the weights until the next
        generation, so the update has the GPU's memory."""
        if self.cuda and self.settings.sleep:
            self.llm.sleep(level=1)

    def detached_copy(self) -> VLLMEngine:
        """Itself: vLLM holds weights of its own, which only ``load_weights`` changes."""
        return self

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            self._live.drop()
            llm.llm_engine.engine_core.shutdown()
        if getattr(self, "_cpu_segments", False):  # the ones its groups made
            _drop_cpu_segments()
