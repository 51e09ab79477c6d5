"""Loading the policy (full fine-tuning or LoRA through peft, optionally on a 4-bit base) and its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pods.config import EMBEDDED_MODEL, ConfigError, TrainConfig

# The configuration's dtype names.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Policy:
    model: torch.nn.Module
    tokenizer: object
    is_lora: bool


def resolve_model_path(name: str) -> str:
    """``"embedded"`` -> the shipped arithmetic model, ``"embedded-<task>"`` -> the one shipped for that
    task (``embedded-arith-hard``); a local folder as is; anything else a hub name."""
    if name == EMBEDDED_MODEL or name.startswith(f"{EMBEDDED_MODEL}-"):
        from pods.embedded import EMBEDDED_MODELS, model_path

        task = name.removeprefix(EMBEDDED_MODEL).removeprefix("-") or "arith"
        if task not in EMBEDDED_MODELS:
            shipped = ", ".join([EMBEDDED_MODEL] + [f"{EMBEDDED_MODEL}-{t}" for t in EMBEDDED_MODELS])
            raise ConfigError(f"model: {name!r} is not a shipped model; the shipped ones are {shipped}")
        return str(model_path(task))
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
            raise ConfigError(
                f"model: {path} has no config.json (nor adapter_config.json): not a model folder"
            )
        return str(path)
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ConfigError(f"model: the folder {name} does not exist; give a model folder or a hub name")
    return name


def local_model_folder(name: str) -> Path:
    """The folder on this machine holding the model ``name`` names (a hub name: its cached snapshot)."""
    path = Path(resolve_model_path(name))
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name, local_files_only=True))


def load_tokenizer(name: str, padding_side: str = "left"):
    """The tokenizer with left padding (generation) and a pad token (falls back to EOS)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except OSError as error:
        raise ConfigError(f"could not load a tokenizer from {name!r}: {_offline_hint(error)}") from None
    tokenizer.padding_side = padding_side
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_kwargs(config: TrainConfig) -> dict:
    """``from_pretrained`` arguments of the configuration's dtype and attention implementation."""
    kwargs: dict = {}
    if config.dtype != "auto":
        kwargs["dtype"] = DTYPES[config.dtype]
    if config.attn_implementation != "auto":
        kwargs["attn_implementation"] = config.attn_implementation
    return kwargs


def load_policy(config: TrainConfig, device: torch.device | None = None) -> Policy:
    """Build the model to train from the configuration: full weights, LoRA, or QLoRA (4-bit base); on ``device``
    if given (else where transformers loads it: the trainer's accelerator moves it)."""
    policy = _build_policy(config)
    if device is not None and next(policy.model.parameters()).device != torch.device(device):
        policy.model.to(device)
    return policy


def _build_policy(config: TrainConfig) -> Policy:
    from transformers import AutoModelForCausalLM

    name = resolve_model_path(config.model)
    adapter_dir = Path(name) / "adapter_config.json"
    tokenizer = load_tokenizer(resolve_model_path(config.tokenizer) if config.tokenizer else name)

    kwargs = model_kwargs(config)
    if config.load_in_4bit:
        kwargs["quantization_config"] = _four_bit_config(config)
    try:
        if adapter_dir.is_file():  # a LoRA checkpoint exported by pods: load base + adapter, keep training it
            from peft import AutoPeftModelForCausalLM

            model = AutoPeftModelForCausalLM.from_pretrained(name, is_trainable=True, **kwargs)
            keep_4bit_compute_dtype(model)
            return Policy(model=model, tokenizer=tokenizer, is_lora=True)
        model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except OSError as error:
        raise ConfigError(f"model: could not load {name!r}: {_offline_hint(error)}") from None
    except (ImportError, ValueError) as error:
        if "attn_implementation" not in kwargs:
            raise
        first = str(error).strip().splitlines()[0]
        raise ConfigError(
            f"attn_implementation: {config.attn_implementation} cannot run here ({first}); "
            "use auto, sdpa or eager"
        ) from None
    keep_4bit_compute_dtype(model)

    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if config.gradient_checkpointing:
        enable_checkpointing(model)
        model.config.use_cache = False
    if config.lora_r > 0:
        model = add_lora(model, config)
    return Policy(model=model, tokenizer=tokenizer, is_lora=config.lora_r > 0)


def keep_4bit_compute_dtype(model: torch.nn.Module) -> None:
    """Make every bitsandbytes 4-bit layer compute in its configured dtype in every forward.

    On a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit weight with bfloat16 scales and computes in
    bfloat16 in eval-mode no-grad forwards only. The trainer's no-grad log-probs (the importance weights'
    "before", the KL reference), HF ``generate`` and the engine's dequantized weights would then disagree
    with the training forward by ~0.4% per weight (measured on such a CPU): one precision, the run's."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def add_lora(model: torch.nn.Module, config: TrainConfig) -> torch.nn.Module:
    """Wrap ``model`` with trainable LoRA adapters (the base stays frozen and doubles as the KL reference)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if config.load_in_4bit:
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=config.gradient_checkpointing
        )
    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.lora_target_modules,
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, lora)
    except ValueError as error:
        raise ConfigError(f"lora_target_modules: {error}") from None


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Activation (gradient) checkpointing under the name this transformers has: ``activation_checkpointing_enable``
    from 5.2x on, ``gradient_checkpointing_enable`` before (deprecated since, removed in 6)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


def load_reference(config: TrainConfig) -> torch.nn.Module:
    """A frozen copy of the starting weights for the KL term (full fine-tuning only; LoRA disables its adapter)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(resolve_model_path(config.model), **model_kwargs(config))
    reference.requires_grad_(False)
    return reference.eval()


def _four_bit_config(config: TrainConfig):
    """NF4 with double quantization (the QLoRA recipe), computing in the run's dtype (bfloat16 for ``auto``)."""
    try:
        import bitsandbytes
        from transformers import BitsAndBytesConfig
    except ImportError:
        raise ConfigError(
            "load_in_4bit needs bitsandbytes >= 0.48: pip install 'bitsandbytes>=0.48'"
        ) from None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:  # bitsandbytes >= 0.48 has CPU kernels; older ones (and broken CUDA set-ups) fail here, not mid-load
        bitsandbytes.functional.quantize_4bit(torch.ones(64, device=device), quant_type="nf4")
    except Exception as error:
        raise ConfigError(
            f"load_in_4bit: bitsandbytes {bitsandbytes.__version__} cannot quantize to 4-bit on {device} "
            f"({type(error).__name__}); install bitsandbytes >= 0.48, or set load_in_4bit: false"
        ) from None
    compute = DTYPES.get(config.dtype, torch.bfloat16)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute,
    )


def _offline_hint(error: Exception) -> str:
    text = str(error).splitlines()[0]
    return (
        f"{text}. If this machine is offline, download the model elsewhere and pass its local folder "
        "(or set HF_HUB_OFFLINE=1 with the model already in the Hugging Face cache)."
    )
