"""Rollouts with transformers `generate`: the rollout that needs nothing but torch, transformers and peft.

It is the embedded default where vLLM is absent, and the reference the vLLM rollout is tested against.
Prompts are left-padded into one batch (each repeated n times, so groups stay contiguous); a completion
ends at the first EOS (kept in the response, as vLLM keeps it) or at max_tokens.

Log-probs are of the raw model distribution, like vLLM's `raw_logprobs` mode: they come from
`output_logits` (the logits before temperature, top-k/top-p and any other processor), so they match a
trainer forward of the same tokens regardless of the sampling settings.

Weights: 'merged' loads a full HF state dict (names checked strictly; a missing `lm_head.weight` is allowed
when embeddings are tied); 'adapter' wraps the model with peft once and loads the PEFT tensors into it, so
the adapter is applied exactly as the peft trainer applies it (unmerged).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import torch

from rlbridge.batch import Rollouts
from rlbridge.model.experts import stack_expert_weights
from rlbridge.model.routing import RoutingRecorder
from rlbridge.recipe.schema import ModelCfg, RolloutCfg
from rlbridge.rollout.base import SamplingCfg, StaleWeightsError
from rlbridge.weights import WeightExport, WeightSync
from rlbridge.weights.directory import read_export_dir

log = logging.getLogger(__name__)


class HFRollout:
    """transformers.generate behind the RolloutEngine protocol (rlbridge/rollout/base.py)."""

    def __init__(
        self,
        model_dir: str | Path,
        rollout_cfg: RolloutCfg,
        model_cfg: ModelCfg,
        *,
        seed: int,
        num_threads: int | None = None,
    ) -> None:
        from rlbridge.model.hf import AutoModelForCausalLM, AutoTokenizer

        if num_threads:  # CPU: async runs give the rollout its own share of the cores
            torch.set_num_threads(num_threads)

        self.weight_version = 0
        self.cfg = rollout_cfg
        self.last_sync_s = 0.0
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, model_cfg.dtype))
        self.model: Any = model.to(self.device).eval()
        self._peft: Any = None
        self._peft_config: dict[str, Any] | None = None
        self._seed = seed
        self._num_calls = 0
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.eos_ids[0])

    # ---------------------------------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingCfg,
        *,
        expect_version: int,
        seed: int | None = None,
        group_seeds: list[int] | None = None,
    ) -> Rollouts:
        """n completions per prompt, grouped: rows [i*n, (i+1)*n) belong to prompt i. Sampling draws from
        torch's RNG seeded with `seed`, or (None) with the engine seed + the number of earlier calls.
        group_seeds: not supported (one RNG per call; rollout/group.py sends one seed per call instead)."""
        if group_seeds is not None:
            raise ValueError("the hf rollout samples a call from one seed; it takes no group_seeds")
        if expect_version != self.weight_version:
            raise StaleWeightsError(
                f"hf rollout holds weight version {self.weight_version}, caller expects {expect_version}"
            )
        check_request(prompt_ids, sampling, self.cfg)
        rows = [list(p) for p in prompt_ids for _ in range(sampling.n)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, width - len(row) :] = torch.tensor(row)
            mask[i, width - len(row) :] = 1
        model = self._peft if self._peft is not None else self.model
        devices = [self.device] if self.device.type == "cuda" else []
        recorder = RoutingRecorder(model) if self.cfg.routing_replay else None
        with torch.random.fork_rng(devices=devices), recorder or contextlib.nullcontext():
            torch.manual_seed(self._seed + self._num_calls if seed is None else seed)
            self._num_calls += 1
            out = model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                generation_config=self._generation_config(sampling),
            )
        new_bt = out.sequences[:, width:].cpu()
        logprobs_bt = torch.stack(
            [
                torch.log_softmax(step.float(), dim=-1)
                .gather(-1, new_bt[:, t, None].to(step.device))[:, 0]
                .cpu()
                for t, step in enumerate(out.logits)
            ],
            dim=1,
        )
        out_ro = self._to_rollouts(rows, new_bt, logprobs_bt, sampling.max_tokens)
        if recorder is not None:
            out_ro.routed_experts = _per_sample(recorder.take(len(rows)), out_ro, width)
        return out_ro

    def _generation_config(self, sampling: SamplingCfg) -> Any:
        from rlbridge.model.hf import GenerationConfig

        common: dict[str, Any] = dict(
            max_new_tokens=sampling.max_tokens,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        if sampling.ignore_eos:
            common["min_new_tokens"] = sampling.max_tokens
        if sampling.greedy:
            return GenerationConfig(do_sample=False, **common)
        return GenerationConfig(
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0,
            **common,
        )

    def _to_rollouts(
        self, rows: list[list[int]], new_bt: torch.Tensor, logprobs_bt: torch.Tensor, max_tokens: int
    ) -> Rollouts:
        out = Rollouts([], [], [], [], self.weight_version, [])
        eos = torch.tensor(self.eos_ids)
        for i, prompt in enumerate(rows):
            hits = torch.isin(new_bt[i], eos).nonzero()
            length = int(hits[0, 0]) + 1 if len(hits) else min(max_tokens, new_bt.shape[1])
            response = new_bt[i, :length].tolist()
            out.prompt_ids.append(prompt)
            out.response_ids.append(response)
            out.response_logprobs.append(logprobs_bt[i, :length].tolist())
            out.finish_reasons.append("stop" if len(hits) else "length")
            out.texts.append(self.tokenizer.decode(response, skip_special_tokens=True))
        return out

    # ------------------------------------------------------------------------------------ weight sync
    @torch.no_grad()
    def load_weights(self, weights: WeightExport, version: int) -> None:
        """Make the engine sample from these weights from now on, as `version`."""
        start = time.perf_counter()
        if weights.path:
            weights = read_export_dir(weights)
        if weights.kind == WeightSync.MERGED:
            self._load_merged(weights.tensors)
        elif weights.kind == WeightSync.ADAPTER:
            self._load_adapter(weights)
        else:
            raise ValueError(f"WeightExport.kind must be 'merged' or 'adapter', got {weights.kind!r}")
        self.weight_version = version
        self.last_sync_s = time.perf_counter() - start
        log.info("hf rollout: %s weights v%d loaded in %.2f s", weights.kind, version, self.last_sync_s)

    def _load_merged(self, tensors: dict[str, torch.Tensor]) -> None:
        if self._peft is not None:
            self.model = self._peft.unload()
            self._peft, self._peft_config = None, None
        expected = set(self.model.state_dict())
        tensors = stack_expert_weights(
            tensors, expected
        )  # an MoE export's per-expert names -> stacked experts
        missing = expected - set(tensors)
        if getattr(self.model.config, "tie_word_embeddings", False):
            missing.discard("lm_head.weight")
        unexpected = set(tensors) - expected
        if missing or unexpected:
            raise ValueError(
                f"merged weights do not match the model: missing {sorted(missing)[:5]} "
                f"({len(missing)}), unexpected {sorted(unexpected)[:5]} ({len(unexpected)})"
            )
        self.model.load_state_dict(tensors, strict=False)

    def _load_adapter(self, weights: WeightExport) -> None:
        from rlbridge.model.hf import get_peft_model, set_peft_model_state_dict

        if not weights.adapter_config:
            raise ValueError(
                "an 'adapter' WeightExport needs adapter_config (the PEFT adapter_config.json content)"
            )
        config = dict(weights.adapter_config)
        if self._peft is None or config != self._peft_config:
            if self._peft is not None:
                self.model = self._peft.unload()
            self._peft = get_peft_model(self.model, _lora_config(config)).eval()
            self._peft_config = config
        result: Any = set_peft_model_state_dict(self._peft, weights.tensors)
        missing_lora = [k for k in result.missing_keys if "lora_" in k]
        if result.unexpected_keys or missing_lora:
            raise ValueError(
                f"adapter tensors do not match the adapter config: unexpected {result.unexpected_keys[:5]}, "
                f"missing {missing_lora[:5]}"
            )

    def shutdown(self) -> None:
        """Drop the model (frees its memory once no one else holds it)."""
        self._peft = None
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _per_sample(routed_bslk: torch.Tensor, ro: Rollouts, width: int) -> list[torch.Tensor]:
    """The generation's routing [rows, left-padded prompt width + forwards after it, layers, k] -> per sample
    [prompt + response positions, layers, k]. The last sampled token never ran through the model: its position
    repeats the one before (arbitrary; no scored log-prob depends on it)."""
    out = []
    for i, (prompt, response) in enumerate(zip(ro.prompt_ids, ro.response_ids, strict=True)):
        ran = routed_bslk[i, width - len(prompt) : width + len(response) - 1]
        out.append(torch.cat([ran, ran[-1:]]).clone())
    return out


def _lora_config(config: dict[str, Any]) -> Any:
    """A peft LoraConfig from adapter_config.json content (keys peft does not know are dropped)."""
    from rlbridge.model.hf import LoraConfig

    known = {f.name for f in dataclasses.fields(LoraConfig)}
    kwargs = {k: v for k, v in config.items() if k in known and k not in ("peft_type", "task_type")}
    kwargs["inference_mode"] = True
    return LoraConfig(**kwargs)


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    found = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = [found] if isinstance(found, int) else list(found or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(int(tokenizer.eos_token_id))
    if not ids:
        raise ValueError("the model has no EOS token (generation_config.eos_token_id or tokenizer.eos_token)")
    return ids


def check_request(prompt_ids: list[list[int]], sampling: SamplingCfg, cfg: RolloutCfg) -> None:
    """The argument checks every rollout engine applies before generating (shared with rollout/vllm.py)."""
    if sampling.greedy and sampling.n != 1:
        raise ValueError(f"greedy decoding gives one completion per prompt; got n={sampling.n}")
    if sampling.max_tokens > cfg.max_response_tokens:
        raise ValueError(
            f"max_tokens={sampling.max_tokens} exceeds rollout.max_response_tokens={cfg.max_response_tokens}"
        )
    longest = max((len(p) for p in prompt_ids), default=0)
    if longest > cfg.max_prompt_tokens or not all(prompt_ids):
        raise ValueError(
            f"prompts must have 1..{cfg.max_prompt_tokens} tokens (rollout.max_prompt_tokens); longest {longest}"
        )
