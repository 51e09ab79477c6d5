"""A rollout engine on Hugging Face ``generate``: left-padded, chunked sampling of n completions per prompt."""

from __future__ import annotations

import weakref

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList, StopStringCriteria

from pods.architectures import row_plan
from pods.errors import ConfigError
from pods.model_info import cache_keyword, expand_prompt_cache
from pods.rollout.base import (
    Rollouts,
    SamplingParams,
    batch_multiple,
    cut_after_stop,
    eos_token_ids,
    left_pad,
    pad_token_id,
    tokenize_prompts,
)

__all__ = ["HFGenerateEngine"]

# Building a StopStringCriteria scans the whole vocabulary (1-3 s for Qwen's 151k tokens on 2 CPU cores),
# so keep one per (tokenizer, stop strings) for as long as the tokenizer lives, across engines.
_STOP_CRITERIA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _stop_criterion(tokenizer, stop_strings: tuple[str, ...]) -> StopStringCriteria | None:
    """The criterion for ``stop_strings``; None where no token can end any of them (the completions then
    never contain one: e.g. "</answer>" for the embedded model, whose vocabulary has no "<")."""
    try:
        per_tokenizer = _STOP_CRITERIA.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced or hashed: no caching
        per_tokenizer = {}
    if stop_strings not in per_tokenizer:
        try:
            criterion = _StopStrings(tokenizer=tokenizer, stop_strings=list(stop_strings))
        except ValueError as error:  # HF refuses stop strings that no token of the vocabulary can end
            if "unable to identify tokens" not in str(error):
                raise
            criterion = None
        per_tokenizer[stop_strings] = criterion
    return per_tokenizer[stop_strings]


class _StopStrings(StopStringCriteria):
    """HF's stop-string criterion for any tokenizer whose tokens decode to text.

    To learn the text of each token, HF decodes it after a fixed prefix ("abcdef") and cuts the prefix off, so
    the prefix must come back from encoding and decoding; a word-level vocabulary (the embedded model's) turns
    it into ``<unk>``, and HF's cut fails. Here the prefix is one the tokenizer does round-trip."""

    @staticmethod
    def clean_tokenizer_vocab(tokenizer, static_prefix: str = "abcdef", stop_string_matching_mode=None):
        return StopStringCriteria.clean_tokenizer_vocab(
            tokenizer, _round_trip_prefix(tokenizer, static_prefix), stop_string_matching_mode
        )


def _round_trip_prefix(tokenizer, preferred: str) -> str:
    """``preferred`` if the tokenizer decodes it back from its tokens, else the first such alphabetic token."""

    def round_trips(text: str) -> bool:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return text in tokenizer.convert_tokens_to_string(tokenizer.convert_ids_to_tokens(ids))

    if round_trips(preferred):
        return preferred
    for token in tokenizer.get_vocab():
        if token.isalpha() and token.isascii() and round_trips(token):
            return token
    raise ConfigError(
        "stop_strings: the tokenizer decodes no plain word back to itself, so the text of its tokens (which "
        "stop-string matching needs) is unknown; end completions with an EOS token instead"
    )


class _RecordStops(StoppingCriteria):
    """HF's stop-string criterion on the completion only (a prompt ending in "\\n" must not let a first
    "\\n" match "\\n\\n"), remembering how many new tokens each row had when it first matched."""

    def __init__(self, inner: StopStringCriteria, prompt_length: int, rows: int) -> None:
        self.inner = inner
        self.prompt_length = prompt_length
        self.stop_length = torch.full((rows,), -1, dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None, **kwargs) -> torch.Tensor:
        done = self.inner(input_ids[:, self.prompt_length :], scores)  # completions only, as vLLM does
        first = done.cpu() & (self.stop_length < 0)
        self.stop_length[first] = input_ids.shape[1] - self.prompt_length
        return done


class HFGenerateEngine:
    """Sample with ``model.generate`` on the very model being trained (so ``sync_weights`` is a no-op).

    Prompts are tokenized as given (rendered chat strings; no special tokens added unless
    ``add_special_tokens``), left-padded, repeated n times and generated in chunks of
    ``generation_batch_size`` completions, so a large n fits in memory. Randomness comes from torch's
    global RNG: the same seed gives the same rollouts.

    With ``share_prefix`` (the ``packing`` setting) each distinct prompt of a chunk is prefilled once and
    its KV cache repeated for its samples (:func:`shared_prefill`): the same distribution, n times fewer
    prompt tokens computed.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        generation_batch_size: int = 64,
        max_prompt_length: int | None = None,
        add_special_tokens: bool = False,
        share_prefix: bool = True,
    ) -> None:
        if generation_batch_size < 1:
            raise ValueError(f"generation_batch_size must be >= 1, got {generation_batch_size}.")
        if max_prompt_length is not None and max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1 or None, got {max_prompt_length}.")
        self.model = model
        self.tokenizer = tokenizer
        self.generation_batch_size = generation_batch_size
        self.max_prompt_length = max_prompt_length
        self.add_special_tokens = add_special_tokens
        self.share_prefix = share_prefix
        self.eos_token_ids = eos_token_ids(tokenizer, model)
        self.pad_token_id = pad_token_id(tokenizer, model, self.eos_token_ids)

    def sync_weights(self, model: torch.nn.Module) -> None:
        """No-op: generation runs on the model object itself, so it always sees the current weights."""

    def round_multiple(self, num_generations: int) -> int:
        """Prompts filling one chunk of ``generation_batch_size`` completions on a GPU, else 1 (:func:`batch_multiple`)."""
        on_gpu = next(self.model.parameters()).device.type == "cuda"
        return batch_multiple(on_gpu, self.generation_batch_size, num_generations)

    def generate(self, prompts: list[str], num_generations: int, sampling: SamplingParams) -> Rollouts:
        """``num_generations`` completions of each prompt, prompt-major (row ``p * n + i``)."""
        return self.generate_tokens(
            tokenize_prompts(self, prompts, num_generations), num_generations, sampling
        )

    def generate_tokens(
        self, encoded: list[list[int]], num_generations: int, sampling: SamplingParams
    ) -> Rollouts:
        """:meth:`generate` from prompts given as token ids (a multi-turn episode's context, never re-tokenized)."""
        prompt_ids, prompt_mask = left_pad(encoded, self.pad_token_id)
        prompt_ids = prompt_ids.repeat_interleave(num_generations, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(num_generations, dim=0)

        device = next(self.model.parameters()).device
        config = self._generation_config(sampling)
        was_training = self.model.training
        self.model.eval()
        chunks = []
        try:
            with torch.no_grad():
                for start in range(0, prompt_ids.shape[0], self.generation_batch_size):
                    end = start + self.generation_batch_size
                    chunks.append(
                        self._generate_chunk(
                            prompt_ids[start:end], prompt_mask[start:end], config, sampling, device
                        )
                    )
        finally:
            self.model.train(was_training)

        width = max(ids.shape[1] for ids, _, _ in chunks)
        completion_ids = torch.cat([_pad_right(ids, width, self.pad_token_id) for ids, _, _ in chunks])
        lengths = torch.cat([length for _, length, _ in chunks])
        truncated = torch.cat([trunc for _, _, trunc in chunks])
        width = int(lengths.max())
        completion_ids = completion_ids[:, :width]
        completion_mask = (torch.arange(width) < lengths[:, None]).long()
        completion_ids = completion_ids.masked_fill(completion_mask == 0, self.pad_token_id)
        texts = self.tokenizer.batch_decode(
            [row[:n].tolist() for row, n in zip(completion_ids, lengths.tolist(), strict=True)],
            skip_special_tokens=True,
        )
        return Rollouts(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            texts=[cut_after_stop(text, sampling.stop_strings) for text in texts],
            truncated=truncated,
            num_prompts=len(encoded),
            num_generations=num_generations,
        )

    def _generation_config(self, sampling: SamplingParams) -> GenerationConfig:
        """A config that samples from exactly softmax(logits / T) (+ top-p / top-k): the model's own
        defaults (repetition penalty, min-p, ...) would bias the rollouts away from the policy."""
        options = {
            "max_new_tokens": sampling.max_new_tokens,
            "do_sample": not sampling.greedy,
            "num_beams": 1,
            "repetition_penalty": 1.0,
            "no_repeat_ngram_size": 0,
            "typical_p": 1.0,
            "epsilon_cutoff": 0.0,
            "eta_cutoff": 0.0,
            "eos_token_id": self.eos_token_ids or None,
            "pad_token_id": self.pad_token_id,
            "use_cache": True,
        }
        if not sampling.greedy:
            options.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        if getattr(getattr(self.model, "generation_config", None), "min_p", None) is not None:
            options["min_p"] = 0.0
        return GenerationConfig(**options)

    def _generate_chunk(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        config: GenerationConfig,
        sampling: SamplingParams,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Generate for one chunk; return (new tokens [rows, W], lengths [rows], truncated [rows])."""
        first = int(mask.any(dim=0).long().argmax())  # drop columns that are padding in every row
        ids, mask = ids[:, first:], mask[:, first:]
        rows, prompt_length = ids.shape
        stops = None
        inner = _stop_criterion(self.tokenizer, sampling.stop_strings) if sampling.stop_strings else None
        if inner is not None:
            stops = _RecordStops(inner, prompt_length, rows)
        # In lockstep every process prefills inside generate: whether a shared prefill runs (None where no row
        # repeats) depends on a process's own prompts, and would be a forward of that process alone.
        lockstep = generation_in_lockstep(self.model)
        cache = shared_prefill(self.model, ids, mask, device) if self.share_prefix and not lockstep else None
        output = self.model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([stops]) if stops else None,
            synced_gpus=lockstep,
            **({cache_keyword(self.model): cache} if cache is not None else {}),
        )
        new_tokens = output[:, prompt_length:].cpu()
        width = new_tokens.shape[1]
        never = torch.full((rows,), width + 1, dtype=torch.long)
        is_eos = torch.isin(new_tokens, torch.tensor(self.eos_token_ids, dtype=torch.long))
        eos_length = torch.where(is_eos.any(dim=1), is_eos.long().argmax(dim=1) + 1, never)
        stop_length = never if stops is None else torch.where(stops.stop_length > 0, stops.stop_length, never)
        length = torch.minimum(eos_length, stop_length)
        truncated = length > width
        return new_tokens, length.clamp_max(width), truncated


def generation_in_lockstep(model: torch.nn.Module) -> bool:
    """Whether every process must run each generation forward together (``generate``'s ``synced_gpus``, which
    keeps a process whose rows have ended stepping until all have): the weights are sharded over several
    processes (DeepSpeed ZeRO-3, FSDP), so each forward gathers them. transformers' own rule, said here."""
    from transformers.distributed.fsdp import is_fsdp_managed_module
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_world_size() == 1:
        return False
    return is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model)


def shared_prefill(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, device: torch.device):
    """The KV cache of every prompt but its last token, computed once per distinct row of ``ids`` [rows, L]
    and repeated for the rows that share it; None where no row repeats, the prompts are one token, or the
    model's cache cannot be shared exactly (:func:`pods.architectures.row_plan`: a recurrent state, ...).

    ``generate`` then runs only the last prompt token per row before sampling, as it would after its own
    prefill: the same logits (to float rounding) and the same random draws."""
    # a one-token prompt has no prefix; a model asking for its own cache (static, ...) keeps it
    if ids.shape[1] < 2 or getattr(getattr(model, "generation_config", None), "cache_implementation", None):
        return None
    if row_plan(model).prefill_blocker is not None:
        return None
    return expand_prompt_cache(model, ids.to(device), mask.to(device))


def _pad_right(ids: torch.Tensor, width: int, pad_id: int) -> torch.Tensor:
    return torch.nn.functional.pad(ids, (0, width - ids.shape[1]), value=pad_id)
