"""A reward model as a reward term (`reward.terms[].model`): a sequence-classification model whose first logit
scores prompt + completion, as TRL's GRPOTrainer scores with one.

The text is TRL's: a conversational prompt and its completion rendered together with the reward model's own chat
template (`messages = prompt + completion`), a plain one concatenated; tokenized without added special tokens,
padded on the right, and scored in batches of `batch_size` under `torch.inference_mode()`, in float32 on `device`
(`cpu`, or `cuda`: the worker's first visible GPU). It runs in a reward worker process of its own (reward_pool.py),
which loads its weights once, when the run starts, and scores only the reward-model terms: the time limit and the
errors of a batched reward function apply, and its seconds and failures are counted apart.
"""

from __future__ import annotations

from typing import Any

from rlbridge.errors import RlbridgeError


class RewardModel:
    """Callable as a batched reward function: `(prompts=..., completions=..., **columns) -> list[float]`."""

    def __init__(self, path: str, *, batch_size: int = 16, device: str = "cpu") -> None:
        import torch

        from rlbridge.model.hf import AutoModelForSequenceClassification, AutoTokenizer
        from rlbridge.model.info import resolve_model_path

        where = resolve_model_path(
            path
        )  # a local directory, or a Hub id's snapshot in the Hugging Face cache
        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(where))
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model: Any = AutoModelForSequenceClassification.from_pretrained(
            str(where), dtype=torch.float32
        ).eval()
        self.device = torch.device(device)
        self.model.to(self.device)
        # the model scores its rightmost token that is not config.pad_token_id: that id must be the one the
        # tokenizer pads with, whatever config.json says (TRL's GRPOTrainer sets it the same way)
        self.model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id
        self.batch_size = batch_size

    def texts(self, prompts: list[Any], completions: list[Any]) -> list[str]:
        out = []
        for prompt, completion in zip(prompts, completions, strict=True):
            if isinstance(prompt, list):  # a conversation: its messages and the completion's, one chat
                messages = prompt + (completion if isinstance(completion, list) else [completion])
                out.append(self.tokenizer.apply_chat_template(messages, tokenize=False))
            else:
                out.append(prompt + completion)
        return out

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        import torch

        texts = self.texts(prompts, completions)
        scores: list[float] = []
        with torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(
                    texts[i : i + self.batch_size],
                    return_tensors="pt",
                    padding=True,
                    padding_side="right",
                    add_special_tokens=False,
                )
                enc = {k: v.to(self.device) for k, v in enc.items()}
                scores.extend(self.model(**enc).logits[:, 0].float().cpu().tolist())
        return scores


def model_problem(path: str) -> str | None:
    """Why `path` cannot be a reward model (validation: its config.json alone), or None."""
    import json

    from rlbridge.model.info import config_file

    try:
        cfg = json.loads(config_file(path, download=True).read_text(encoding="utf-8"))
    except RlbridgeError as e:
        return str(e)
    except (OSError, ValueError) as e:
        return f"cannot read the reward model's config.json: {e}"
    archs = cfg.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        return (
            f"{path} is not a sequence-classification model (architectures: {', '.join(map(str, archs)) or 'none'}); "
            "a reward model scores a text with a ...ForSequenceClassification head"
        )
    return None
