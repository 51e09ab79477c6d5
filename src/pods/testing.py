"""Tiny real models for tests and smoke runs: a byte-level BPE tokenizer trained on the fly and a
randomly initialised Llama-architecture causal LM, saved as an ordinary Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = [
    "Question: Tom has 12 apples and buys 7 more. How many apples does he have? Answer: 12 + 7 = 19. #### 19",
    "<think> add the numbers </think> <answer> 42 </answer> The answer is 3.5 or -8 or 1,000.",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 + - * / = . , ! ? # $ % ( ) { } \\boxed",
    "Please reason step by step, and put your final answer after ####. You are a helpful assistant.",
]


def build_tiny_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer (any text round-trips) with eos/pad tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|pad|>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        padding_side="left",
        chat_template=TINY_CHAT_TEMPLATE,
    )


def build_tiny_model(
    path: str | Path,
    *,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
) -> Path:
    """Save a random tiny causal LM and its tokenizer under ``path``; return the path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def use_torch_collectives_under_deepspeed() -> None:
    """Make DeepSpeed on the CPU use torch.distributed's collectives (its own path where its shared-memory
    op cannot be built) instead of first probing a compiler for each of its ~30 C++ ops and compiling that
    op: a minute on 2 busy cores in a fresh environment. For test processes, which check pods's step, not
    DeepSpeed's kernels; call before DeepSpeed initialises its communication backend."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__ = {}  # read only to decide whether to build the shared-memory op
