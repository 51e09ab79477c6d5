"""A tiny Qwen2 on the Qwen2.5 tokenizer and TRL's Qwen2.5 chat template, fitted in seconds to call a tool: the
``tool_model_dir`` fixtures of tests/conftest.py build it (tests/test_trl_tools.py, tests/test_agents_chat.py)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

QUESTIONS = [(3, 4), (5, 6), (7, 8), (2, 9)]
AGAIN = "again"  # a tool answer after which a model fitted with ``call_again`` calls the tool once more


def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return str(a * b)


def tool_value(serial: int) -> int:
    """The answer of the ``serial``-th tool call: distinct for every call, 1 to 3 more digits from one call to the
    next, so that rows of a group differ in length and a misplaced mask shows."""
    return serial * 10 ** (serial % 3)


def fit_tool_model(
    shared_data: Path,
    folder: Path,
    *,
    hidden_size: int = 32,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    lr: float = 3e-2,
    call_again: bool = False,
) -> Path:
    """A 2-layer Qwen2 on the Qwen2.5 vocabulary that answers each question of :data:`QUESTIONS` with a call of
    ``multiply(3, 4)`` and, after any tool answer, with ``Done.`` (``call_again``: after the answer
    :data:`AGAIN`, with the same call again), saved to ``folder``. Tokens the conversations never use keep a zero
    embedding (their logit is exactly 0), so the full-vocabulary loss is computed over the used tokens plus one
    constant term: a few seconds of Adam on a CPU."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    from trl.chat_template_utils import qwen2_5_chat_template

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(shared_data / "tokenizers" / "qwen2.5")
    tokenizer.chat_template = qwen2_5_chat_template
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
    rows, labels = [], []

    def render(messages: list[dict], generation: bool = False) -> list[int]:
        return tokenizer.apply_chat_template(
            messages, tools=[multiply], add_generation_prompt=generation, tokenize=True, return_dict=False
        )

    conversations = [(a, b, [str(tool_value(index + 7))]) for index, (a, b) in enumerate(QUESTIONS)]
    if call_again:
        conversations.append((*QUESTIONS[0], [AGAIN, str(tool_value(1))]))
    for a, b, answers in conversations:
        messages = [{"role": "user", "content": f"What is {a} times {b}?"}]
        learn_spans = []  # the model's own tokens: each call and its last answer
        for answer in answers:
            start = len(render(messages, True))
            messages += [{"role": "assistant", "content": "", "tool_calls": [call]}]
            learn_spans.append((start, len(render(messages)) - 1))
            messages += [{"role": "tool", "name": "multiply", "content": answer}]
        start = len(render(messages, True))
        ids = render([*messages, {"role": "assistant", "content": "Done."}])[:-1]  # ends at <|im_end|>
        learn = torch.zeros(len(ids), dtype=torch.bool)
        for begin, end in [*learn_spans, (start, len(ids))]:
            learn[begin:end] = True
        rows.append(torch.tensor(ids))
        labels.append(learn)
    width = max(len(row) for row in rows)
    ids = torch.stack([torch.nn.functional.pad(row, (0, width - len(row))) for row in rows])
    attention = torch.stack(
        [torch.nn.functional.pad(torch.ones_like(row), (0, width - len(row))) for row in rows]
    )
    learn = torch.stack([torch.nn.functional.pad(row, (0, width - len(row))) for row in labels])

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    used = torch.unique(ids)
    index = torch.full((len(tokenizer),), -1)
    index[used] = torch.arange(len(used))
    embedding = torch.nn.Parameter(model.get_input_embeddings().weight.detach()[used].clone())
    unused = math.log(len(tokenizer) - len(used))  # logsumexp of the unused tokens' logits, all 0
    body = [param for name, param in model.named_parameters() if "embed_tokens" not in name]
    optimizer = torch.optim.Adam([*body, embedding], lr=lr)
    targets = index[ids[:, 1:]][learn[:, 1:]]
    for _ in range(300):
        hidden = model.model(inputs_embeds=embedding[index[ids]], attention_mask=attention).last_hidden_state
        logits = hidden[:, :-1][learn[:, 1:]] @ embedding.T
        logits = torch.cat([logits, torch.full((logits.shape[0], 1), unused)], dim=1)
        loss = torch.nn.functional.cross_entropy(logits, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 2e-3:
            break
    assert loss.item() < 0.05, f"the tool-calling model did not fit: loss {loss.item()}"
    with torch.no_grad():
        weight = model.get_input_embeddings().weight
        weight.zero_()
        weight[used] = embedding.detach()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
