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


# Tiny random configs of the architectures users train (transformers' model types). Windows of 12 positions,
# so that test rows of ~30 tokens reach past them; hybrids with one stateful layer and one attention layer.
_ZOO_COMMON = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
_LINEAR_ATTENTION = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
_MAMBA = {"mamba_d_head": 8, "mamba_n_groups": 1, "mamba_d_state": 8, "mamba_chunk_size": 8}
ZOO_CONFIGS: dict[str, dict] = {
    "llama": {},
    "qwen2": {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1},
    "qwen3": {},
    "qwen3_moe": _MOE,
    "qwen3_5_text": {"layer_types": ["linear_attention", "full_attention"], **_LINEAR_ATTENTION},
    "qwen3_next": {
        "layer_types": ["linear_attention", "full_attention"],
        "shared_expert_intermediate_size": 16,
        **_MOE,
        **_LINEAR_ATTENTION,
    },
    "mistral": {"sliding_window": 12},
    "phi3": {"sliding_window": 12},
    "starcoder2": {"sliding_window": 12},
    "gemma2": {"sliding_window": 12},
    "gemma3_text": {"sliding_window": 12, "layer_types": ["sliding_attention", "full_attention"]},
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "falcon_h1": {"mamba_d_ssm": 32, "mamba_n_heads": 4, **_MAMBA},
    "granitemoehybrid": {
        "layer_types": ["mamba", "attention"],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 16,
        "mamba_n_heads": 8,
        "mamba_expand": 2,
        **_MAMBA,
    },
    "olmo2": {},
    "gpt_oss": {
        "sliding_window": 12,
        "layer_types": ["sliding_attention", "full_attention"],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
}
# gpt-oss's attention sinks run in eager attention only; transformers 5.2x runs Gemma 2 in eager only
ZOO_ATTENTION = {"gpt_oss": "eager", "gemma2": "eager"}


def build_zoo_model(
    model_type: str, vocab_size: int = 64, *, seed: int = 0, special_tokens: dict | None = None
):
    """A random float32 causal LM of ``model_type`` (a key of :data:`ZOO_CONFIGS`), in evaluation mode."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokens = special_tokens or {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    config = AutoConfig.for_model(
        model_type, vocab_size=vocab_size, **_ZOO_COMMON, **ZOO_CONFIGS[model_type], **tokens
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=ZOO_ATTENTION.get(model_type, "sdpa"), dtype=torch.float32
    )
    return model.eval()


def save_zoo_model(path: str | Path, model_type: str, *, seed: int = 0) -> Path:
    """Save a random tiny ``model_type`` model with :func:`build_tiny_tokenizer`'s tokenizer under ``path``."""
    path = Path(path)
    tokenizer = build_tiny_tokenizer()
    special = {
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": None,
        "eos_token_id": tokenizer.eos_token_id,
    }
    model = build_zoo_model(model_type, len(tokenizer), seed=seed, special_tokens=special)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
