"""Multi-turn rollouts: any rollout engine, turn after turn, with tools between the turns.

The first turn samples n completions of each prompt as a single-turn run does. Every rollout whose turn ends
in tool calls gets their answers appended as tokens (tool output: ``tool_mask`` 0), and all such rollouts continue
together in one batch, one completion each from their own context (prompt, turns and answers so far, as token
ids: nothing is re-tokenized). An episode ends when a turn calls no tool, after ``max_tool_calling_iterations``
rounds of calls, or when its tokens reach ``max_completion_length`` (turns and answers together, as TRL counts
it; an answer that would pass it is not appended and the episode ends truncated).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from pods.agents.formats import ToolFormat, Turn
from pods.agents.tools import Toolbox, ToolCall, call_tools, tool_schemas
from pods.errors import ConfigError
from pods.rollout.base import EngineWrapper, Rollouts, SamplingParams, left_pad, tokenize_prompts

__all__ = ["EPISODE_STATS", "Episodes", "MultiTurnEngine", "sample_rollouts"]

EPISODE_STATS = ("tool_calls", "tool_errors", "turns")
"""The columns of ``Rollouts.episode_stats``: calls the rollout made, calls answered with an error, model turns."""


@dataclass
class _Episode:
    """One rollout as it grows: its completion tokens, which of them the model sampled, their sampler log-probs."""

    context: list[int]  # the prompt's tokens
    tokens: list[int]
    sampled: list[int]
    logprobs: list[float]
    truncated: bool = False
    calls: int = 0
    errors: int = 0
    turns: int = 0
    rounds: int = 0  # rounds of tool calls answered
    turn_length: int = 0  # tokens of the last model turn
    pending: list[ToolCall] = field(default_factory=list)  # the last turn's calls, to answer next
    messages: list[dict[str, Any]] = field(
        default_factory=list
    )  # the conversation (chat formats), TRL's shape


@dataclass
class Episodes:
    """A batch of finished episodes: the rollouts, and each rollout's environment (None without a factory: reward
    functions then get no ``environments``, as in TRL)."""

    rollouts: Rollouts
    environments: list[Any] | None


class MultiTurnEngine(EngineWrapper):
    """A rollout engine (HF ``generate``, vLLM colocated or served, the rollout worker's) run turn by turn with
    tools: :meth:`episodes` for rows of data; the engine protocol's other methods go to the engine inside."""

    def __init__(
        self,
        engine: Any,
        tool_format: ToolFormat,
        *,
        tools: list[Callable[..., Any]] | None = None,
        environment_factory: Callable[[], Any] | None = None,
        max_tool_calling_iterations: int | None = None,
        tool_timeout: float | None = 10.0,
        max_completion_length: int = 256,
    ) -> None:
        if not tools and environment_factory is None:
            raise ConfigError("a multi-turn run needs tools or an environment_factory")
        super().__init__(engine)
        self.format = tool_format
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        self.max_tool_calling_iterations = max_tool_calling_iterations
        self.tool_timeout = tool_timeout
        self.max_completion_length = max_completion_length
        Toolbox(self.tools)  # two tools of one name fail now, not at the first call
        self._schemas: dict[type, list[dict[str, Any]]] = {}

    def generate(self, prompts: list[str], num_generations: int, sampling: SamplingParams) -> Rollouts:
        raise TypeError(
            "a multi-turn engine needs the rows (an environment resets from its row): call episodes(rows, ...) "
            "or pods.agents.sample_rollouts"
        )

    def episodes(
        self,
        rows: list[dict[str, Any]],
        num_generations: int,
        sampling: SamplingParams,
        *,
        most: Callable[[int], int] | None = None,
    ) -> Episodes:
        """``num_generations`` episodes of each row (prompt-major, as :class:`Rollouts`), and their environments.

        ``most`` (several processes): the largest of a count over the processes. An engine whose forwards are
        collectives (ZeRO-3 / FSDP generation in lockstep, a shared vLLM server) then runs as many turns on every
        process, a process without a rollout left sampling one token it discards."""
        n = num_generations
        environments = self._environments(rows, n)
        toolboxes = [Toolbox(self.tools, env) for env in environments]
        prompts = [self._prompt(row, environments[p * n : (p + 1) * n]) for p, row in enumerate(rows)]
        rendered = [
            self.format.render(prompt, self._schemas_of(toolboxes[p * n])) for p, prompt in enumerate(prompts)
        ]
        encoded = tokenize_prompts(self.engine, rendered, n)
        turn = replace(sampling, stop_strings=(*sampling.stop_strings, *self.format.stop_strings))
        episodes = [_Episode(encoded[r // n], [], [], []) for r in range(len(rows) * n)]

        first = self.engine.generate_tokens(encoded, n, turn)
        active = self._absorb(episodes, list(range(len(episodes))), first)
        while (most(len(active)) if most is not None else len(active)) > 0:
            if not active:  # others still run turns whose forwards need this process too
                self.engine.generate_tokens([encoded[0]], 1, replace(turn, max_new_tokens=1))
                continue
            calls = [episodes[r].pending for r in active]
            answers = call_tools([toolboxes[r] for r in active], calls, self.tool_timeout)
            going = []
            for r, row_answers in zip(active, answers, strict=True):
                episode = episodes[r]
                episode.calls += len(row_answers)
                episode.errors += sum(answer.failed for answer in row_answers)
                episode.rounds += 1
                suffix = self.format.answer_ids(row_answers)
                if len(episode.tokens) + len(suffix) >= self.max_completion_length:
                    episode.truncated = True  # no room for the answer and a turn after it
                    continue
                episode.tokens += suffix
                episode.sampled += [0] * len(suffix)
                episode.logprobs += [0.0] * len(suffix)
                if episode.messages:  # the tool messages follow the assistant turn that called them
                    episode.messages += [
                        {"role": "tool", "name": a.name, "content": a.text} for a in row_answers
                    ]
                going.append(r)
            if not going:
                active = []
                continue
            budget = max(self.max_completion_length - len(episodes[r].tokens) for r in going)
            contexts = [episodes[r].context + episodes[r].tokens for r in going]
            output = self.engine.generate_tokens(contexts, 1, replace(turn, max_new_tokens=budget))
            active = self._absorb(episodes, going, output)
        rollouts = self._rollouts(episodes, encoded, n, first.sampling_logprobs is not None)
        return Episodes(rollouts, environments if self.environment_factory is not None else None)

    # ------------------------------------------------------------------ pieces
    def _environments(self, rows: list[dict[str, Any]], n: int) -> list[Any]:
        """One fresh environment per rollout (TRL's isolation), or None each without a factory."""
        if self.environment_factory is None:
            return [None] * (len(rows) * n)
        environments = []
        for _ in range(len(rows) * n):
            environment = self.environment_factory()
            if not callable(getattr(environment, "reset", None)):
                raise ConfigError(
                    f"environment_factory: {type(environment).__name__} has no reset method; an environment "
                    "defines reset(**row), which may return text to append to the prompt, and its tools as methods"
                )
            environments.append(environment)
        return environments

    def _prompt(self, row: dict[str, Any], environments: list[Any]) -> Any:
        """The row's prompt, with the text its environments' ``reset(**row)`` return appended to the last user
        message (TRL's rule); the n environments of a row must return the same text (they share one prompt)."""
        prompt = row["prompt"]
        if environments[0] is None:
            return prompt
        texts = {environment.reset(**row) for environment in environments}
        if len(texts) > 1:
            raise ConfigError(
                "environment_factory: reset(**row) returned different texts for rollouts of one row; pods samples "
                "a row's n rollouts from one prompt, so the text must depend on the row only (seed from the row)"
            )
        text = texts.pop()
        if not text:
            return prompt
        if isinstance(prompt, str):
            return prompt + text
        prompt = copy.deepcopy(prompt)
        users = [message for message in prompt if message.get("role") == "user"]
        if not users:
            raise ConfigError("environment_factory: reset returned text but the prompt has no user message")
        users[-1]["content"] = f"{users[-1]['content']}{text}"
        return prompt

    def _schemas_of(self, toolbox: Toolbox) -> list[dict[str, Any]]:
        key = type(toolbox.environment)
        if key not in self._schemas:
            self._schemas[key] = tool_schemas(list(toolbox.tools.values()))
        return self._schemas[key]

    @staticmethod
    def _before(episode: _Episode) -> list[int]:
        """The context of an episode's last turn: the prompt and every token before that turn."""
        return episode.context + episode.tokens[: len(episode.tokens) - episode.turn_length]

    def _absorb(self, episodes: list[_Episode], rows: list[int], output: Rollouts) -> list[int]:
        """Append one turn per listed episode from ``output`` (row i is episode ``rows[i]``), cut to each one's own
        budget; return those that go on (their turn has calls and rounds remain)."""
        going = []
        lengths = output.completion_mask.sum(dim=1).tolist()
        for index, r in enumerate(rows):
            episode = episodes[r]
            tokens = output.completion_ids[index, : lengths[index]].tolist()
            room = self.max_completion_length - len(episode.tokens)
            cut = len(tokens) > room
            tokens = tokens[:room]
            logprobs = (
                output.sampling_logprobs[index, : len(tokens)].tolist()
                if output.sampling_logprobs is not None
                else [0.0] * len(tokens)
            )
            episode.tokens += tokens
            episode.sampled += [1] * len(tokens)
            episode.logprobs += logprobs
            episode.turn_length = len(tokens)
            episode.turns += 1
            episode.truncated = cut or bool(output.truncated[index])
            rounds_left = (
                self.max_tool_calling_iterations is None or episode.rounds < self.max_tool_calling_iterations
            )
            turn = self.format.read_turn(tokens, self._before(episode)) if tokens else Turn([])
            episode.pending = turn.calls
            if turn.message is not None:
                episode.messages.append(turn.message)
            if episode.pending and not episode.truncated and rounds_left:
                going.append(r)
        return going

    def _rollouts(
        self, episodes: list[_Episode], encoded: list[list[int]], n: int, logprobs: bool
    ) -> Rollouts:
        pad = self.engine.pad_token_id
        width = max(1, max(len(e.tokens) for e in episodes))
        rows = len(episodes)
        ids = torch.full((rows, width), pad, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        sampled = torch.zeros((rows, width), dtype=torch.long)
        sampler = torch.zeros((rows, width), dtype=torch.float32)
        for r, e in enumerate(episodes):
            length = len(e.tokens)
            ids[r, :length] = torch.tensor(e.tokens, dtype=torch.long)
            mask[r, :length] = 1
            sampled[r, :length] = torch.tensor(e.sampled, dtype=torch.long)
            sampler[r, :length] = torch.tensor(e.logprobs, dtype=torch.float32)
        prompt_ids, prompt_mask = left_pad(encoded, pad)
        return Rollouts(
            prompt_ids=prompt_ids.repeat_interleave(n, dim=0),
            prompt_mask=prompt_mask.repeat_interleave(n, dim=0),
            completion_ids=ids,
            completion_mask=mask,
            texts=self.tokenizer.batch_decode([e.tokens for e in episodes], skip_special_tokens=True),
            truncated=torch.tensor([e.truncated for e in episodes]),
            num_prompts=len(encoded),
            num_generations=n,
            sampling_logprobs=sampler if logprobs else None,
            tool_mask=sampled,
            episode_stats=torch.tensor([[e.calls, e.errors, e.turns] for e in episodes], dtype=torch.long),
            messages=[e.messages for e in episodes] if episodes[0].messages else None,
        )


def sample_rollouts(
    engine: Any,
    rows: list[dict[str, Any]],
    num_generations: int,
    sampling: SamplingParams,
    tokenizer: Any,
    *,
    most: Callable[[int], int] | None = None,
) -> Episodes:
    """``num_generations`` rollouts of each row with any engine: episodes with tools for a
    :class:`MultiTurnEngine`, else one completion of each rendered prompt (no environments)."""
    if isinstance(engine, MultiTurnEngine):
        return engine.episodes(rows, num_generations, sampling, most=most)
    from pods.prompts import render_prompt

    prompts = [render_prompt(row["prompt"], tokenizer) for row in rows]
    return Episodes(engine.generate(prompts, num_generations, sampling), None)
