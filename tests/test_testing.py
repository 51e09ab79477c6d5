"""The tiny test model loads through the ordinary Hugging Face entry points and generates."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def test_tiny_model_round_trip(tiny_model_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert tokenizer.padding_side == "left"
    text = "Tom has 12 apples, ünïcode and #### 19"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|user|>hi<|end|><|assistant|>"
    batch = tokenizer(["a", "a longer prompt"], return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=5, do_sample=True, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[0] == 2 and out.shape[1] <= batch["input_ids"].shape[1] + 5
    assert sum(p.numel() for p in model.parameters()) < 100_000
    assert torch.isfinite(model(**batch).logits).all()
