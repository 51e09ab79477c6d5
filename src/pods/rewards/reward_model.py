"""A reward model as a reward function, as TRL accepts one: a sequence-classification checkpoint (one label)
scores prompt + completion (a conversation through its tokenizer's chat template), in batches, on the device of
the process that scores (the trainer's, or the rollout worker's)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pods.errors import ConfigError

__all__ = ["RewardModel", "position_limit", "process_device"]


class RewardModel:
    """``AutoModelForSequenceClassification`` (``num_labels=1``) and its tokenizer, called in TRL's reward signature;
    pickles as its name, so a rollout worker loads its own copy."""

    def __init__(
        self, name_or_path: str, *, batch_size: int = 32, key: str = "reward_model_name_or_path"
    ) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.name_or_path, self.batch_size = name_or_path, batch_size
        self.__name__ = Path(name_or_path.rstrip("/")).name
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(name_or_path)
            self.model = AutoModelForSequenceClassification.from_pretrained(name_or_path, num_labels=1).eval()
        except Exception as error:
            text = str(error).strip().splitlines()[0] if str(error).strip() else "no details"
            raise ConfigError(
                f"{key}: cannot load {name_or_path!r} as a sequence-classification reward model "
                f"({type(error).__name__}: {text}); give a folder saved with save_pretrained or a Hub id"
            ) from error
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # the model scores the last token that is not padding
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        # a text longer than the model's positions keeps its end (the completion), which the score is read from
        self.max_length = position_limit(self.model.config, self.tokenizer)
        self.tokenizer.truncation_side = "left"
        self.device: Any = None

    def texts(self, prompts: list[Any], completions: list[Any]) -> list[str]:
        """What the model reads: prompt + completion, or the conversation through the chat template."""
        texts = []
        for prompt, completion in zip(prompts, completions, strict=True):
            if isinstance(prompt, list):
                reply = (
                    completion
                    if isinstance(completion, list)
                    else [{"role": "assistant", "content": completion}]
                )
                texts.append(self.tokenizer.apply_chat_template(prompt + reply, tokenize=False))
            else:
                texts.append(
                    prompt + (completion if isinstance(completion, str) else completion[0]["content"])
                )
        return texts

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        import torch

        if self.device is None:  # the scoring process's device, known only once it runs (maybe on a thread)
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            self.device = torch.device(process_device(gpus, os.environ.get("LOCAL_RANK")))
            self.model.to(self.device)
        texts, scores = self.texts(prompts, completions), []
        for start in range(0, len(texts), self.batch_size):
            inputs = self.tokenizer(
                texts[start : start + self.batch_size],
                return_tensors="pt",
                padding=True,
                padding_side="right",
                add_special_tokens=False,
                truncation=self.max_length is not None,
                max_length=self.max_length,
            ).to(self.device)
            with torch.inference_mode():
                scores += self.model(**inputs).logits[:, 0].float().tolist()
        return scores

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.name_or_path, self.batch_size))

    def __repr__(self) -> str:
        return f"RewardModel({self.name_or_path!r})"


def _rebuild(name_or_path: str, batch_size: int) -> RewardModel:
    return RewardModel(name_or_path, batch_size=batch_size)


def position_limit(model_config: Any, tokenizer: Any) -> int | None:
    """The most tokens the model reads: its position embeddings, or its tokenizer's ``model_max_length`` where
    that is smaller (a RoBERTa's 514 positions hold 512 tokens); None where neither says."""
    limits = (
        getattr(model_config, "max_position_embeddings", None),
        getattr(tokenizer, "model_max_length", None),
    )
    known = [n for n in limits if isinstance(n, int) and 0 < n < 10**8]  # a tokenizer without one says 10**30
    return min(known) if known else None


def process_device(gpus: int, local_rank: str | None) -> str:
    """The device a process's reward model runs on: its own GPU, ``cuda:LOCAL_RANK``, where it sees several (each
    rank of ``accelerate launch``); ``cuda:0`` where it sees one (a rollout worker sees its GPU alone); else the CPU.
    Read from the environment because the scoring may run on a thread, where CUDA's current device is always 0."""
    if gpus == 0:
        return "cpu"
    rank = int(local_rank) if local_rank and local_rank.isdigit() else 0
    return f"cuda:{rank if rank < gpus else 0}"
