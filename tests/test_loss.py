"""pods.loss: chosen-token log-probs, completion log-probs on a tiny real model, the policy loss."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from pods.loss import (
    LOSS_TYPES,
    completion_logprobs,
    mean_abs_difference,
    policy_loss,
    selected_token_logprobs,
    truncated_importance_weights,
)

# ----------------------------------------------------------------------------- selected_token_logprobs


def _reference_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 10_000, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_selected_token_logprobs_matches_log_softmax_and_its_gradient(chunk_size, temperature):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 11, generator=gen)).requires_grad_()
    ids = torch.randint(0, 11, (3, 5), generator=gen)
    weights = torch.randn(3, 5, generator=gen)

    ours = selected_token_logprobs(logits, ids, temperature, chunk_size=chunk_size)
    (grad_ours,) = torch.autograd.grad((ours * weights).sum(), logits)
    ref = _reference_logprobs(logits, ids, temperature)
    (grad_ref,) = torch.autograd.grad((ref * weights).sum(), logits)

    assert ours.dtype == torch.float32 and ours.shape == (3, 5)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_ours, grad_ref, rtol=1e-5, atol=1e-6)


def test_selected_token_logprobs_on_non_contiguous_bf16_logits():
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(2, 6, 13, generator=gen).to(torch.bfloat16)
    logits = full[:, 1:-1]  # a strided view, as in completion_logprobs
    ids = torch.randint(0, 13, (2, 4), generator=gen)
    ours = selected_token_logprobs(logits, ids, chunk_size=3)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, _reference_logprobs(logits, ids), rtol=1e-6, atol=1e-6)


def test_selected_token_logprobs_rejects_bad_shapes_and_temperature():
    with pytest.raises(ValueError, match="token_ids"):
        selected_token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        selected_token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), temperature=0.0)


# ----------------------------------------------------------------------------- completion_logprobs


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def _padded_batch(tokenizer):
    """Two left-padded prompts and two right-padded completions of different lengths."""
    prompts = [tokenizer.encode("Question: Tom has 12 apples."), tokenizer.encode("abc")]
    completions = [tokenizer.encode(" Answer: 19. #### 19"), tokenizer.encode(" 42")]
    pad = tokenizer.pad_token_id
    lp, lc = max(map(len, prompts)), max(map(len, completions))
    prompt_ids = torch.tensor([[pad] * (lp - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (lp - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.tensor([c + [pad] * (lc - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (lc - len(c)) for c in completions])
    return prompts, completions, (prompt_ids, prompt_mask, completion_ids, completion_mask)


@pytest.fixture(scope="module")
def tiny_gpt2(tiny):
    """A model with absolute position embeddings: left padding breaks it unless positions follow the mask."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = tiny[1]
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=16, n_layer=1, n_head=2)
    return GPT2LMHeadModel(config).eval(), tokenizer


@pytest.mark.parametrize("temperature", [1.0, 0.5])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_completion_logprobs_equals_unpadded_full_forward(request, arch, temperature):
    model, tokenizer = request.getfixturevalue("tiny" if arch == "llama" else "tiny_gpt2")
    prompts, completions, batch = _padded_batch(tokenizer)
    with torch.no_grad():
        ours = completion_logprobs(model, *batch, temperature=temperature)
        rows = [
            completion_logprobs(model, *(t[i : i + 1] for t in batch), temperature=temperature)
            for i in range(len(prompts))
        ]
        micro = torch.cat([torch.nn.functional.pad(r, (0, batch[2].shape[1] - r.shape[1])) for r in rows])
        for row, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1]
            manual = torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(c)[:, None])[
                :, 0
            ]
            torch.testing.assert_close(ours[row, : len(c)], manual, rtol=1e-4, atol=1e-5)
    assert ours.shape == batch[2].shape and ours.dtype == torch.float32
    real = batch[3].bool()
    torch.testing.assert_close(micro[real], ours[real], rtol=1e-5, atol=1e-6)


def _truncated_reference(logits: torch.Tensor, token: int, top_k: int, top_p: float) -> float:
    """One position, written plainly: keep the top-k tokens, renormalise, then drop the least likely ones
    while their total stays within 1 - top_p (at least one stays), renormalise, read the token's log-prob."""
    probs = torch.softmax(logits.double(), dim=-1)
    kept = set(range(len(probs)))
    if top_k:
        kth = sorted(logits.tolist(), reverse=True)[top_k - 1]
        kept = {i for i in kept if logits[i] >= kth}
    mass = sum(probs[i] for i in kept)
    dropped = 0.0
    for i in sorted(kept, key=lambda i: probs[i].item())[:-1]:
        if dropped + probs[i] / mass > 1 - top_p:
            break
        dropped += probs[i] / mass
        kept.remove(i)
    return math.log(probs[token] / sum(probs[i] for i in kept)) if token in kept else math.log(probs[token])


@pytest.mark.parametrize(("top_k", "top_p"), [(3, 1.0), (0, 0.6), (5, 0.8)])
def test_truncated_completion_logprobs_are_the_renormalised_top_k_top_p_distribution(tiny, top_k, top_p):
    model, tokenizer = tiny
    prompts, completions, batch = _padded_batch(tokenizer)
    # the second completion's tokens are the model's most likely ones (inside every truncation); the
    # first's are arbitrary (mostly outside: they keep their untruncated log-prob)
    with torch.no_grad():
        greedy = model.generate(
            torch.tensor([prompts[1]]), max_new_tokens=len(completions[1]), do_sample=False
        )
    completions[1] = greedy[0, len(prompts[1]) :].tolist()
    batch[2][1, : len(completions[1])] = torch.tensor(completions[1])
    with torch.no_grad():
        ours = completion_logprobs(model, *batch, temperature=0.7, top_k=top_k, top_p=top_p, chunk_size=5)
        full = completion_logprobs(model, *batch, temperature=0.7)
        for row, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1] / 0.7
            expected = [_truncated_reference(logits[t], c[t], top_k, top_p) for t in range(len(c))]
            torch.testing.assert_close(
                ours[row, : len(c)], torch.tensor(expected, dtype=torch.float32), atol=1e-5, rtol=1e-4
            )
    real = batch[3].bool()
    assert (ours[real] >= full[real] - 1e-6).all()  # renormalised over fewer tokens: never less likely
    assert (ours[1, : len(completions[1])] > full[1, : len(completions[1])] + 1e-3).all()
    with pytest.raises(ValueError, match="no gradient"):
        completion_logprobs(model, *batch, top_p=0.5)


def test_completion_logprobs_gradients_flow_and_work_with_lora(tiny):
    from peft import LoraConfig, get_peft_model

    base, tokenizer = tiny
    _, _, batch = _padded_batch(tokenizer)
    with torch.no_grad():
        expected = completion_logprobs(base, *batch)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    peft_model = get_peft_model(copy.deepcopy(base), config)
    logprobs = completion_logprobs(peft_model, *batch)
    # A fresh LoRA adapter (B = 0) leaves the function unchanged, and gradients reach the adapter.
    torch.testing.assert_close(logprobs.detach(), expected, rtol=1e-5, atol=1e-6)
    (logprobs * batch[3]).sum().backward()
    lora_grads = [p.grad for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert lora_grads and all(g is not None and g.abs().sum() > 0 for g in lora_grads)


def test_completion_logprobs_through_a_ddp_wrapper(tiny, tmp_path):
    """The trainer calls the DDP-wrapped model (for gradient sync): logits_to_keep must still be found."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from pods.model_info import accepts_logits_to_keep

    model, tokenizer = tiny
    _, _, batch = _padded_batch(tokenizer)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        wrapped = DistributedDataParallel(copy.deepcopy(model))
        assert accepts_logits_to_keep(wrapped)
        with torch.no_grad():
            torch.testing.assert_close(
                completion_logprobs(wrapped, *batch), completion_logprobs(model, *batch)
            )
    finally:
        dist.destroy_process_group()


def test_completion_logprobs_rejects_mismatched_batches(tiny):
    model, tokenizer = tiny
    _, _, (pi, pm, ci, cm) = _padded_batch(tokenizer)
    with pytest.raises(ValueError, match="batch sizes differ"):
        completion_logprobs(model, pi, pm, ci[:1], cm[:1])
    with pytest.raises(ValueError, match="completion_mask"):
        completion_logprobs(model, pi, pm, ci, cm[:, :1])
    with pytest.raises(ValueError, match="at least one prompt token"):
        completion_logprobs(model, pi, torch.zeros_like(pm), ci, cm)


# ----------------------------------------------------------------------------- policy_loss

MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
ADV = torch.tensor([1.0, -0.5])


def _totals(mask=MASK, length=4):
    return {
        "total_sequences": mask.shape[0],
        "total_tokens": int(mask.sum()),
        "max_completion_length": length,
    }


@pytest.mark.parametrize(
    ("loss_type", "expected"),
    [
        # on-policy: per-token loss is -A; row 0 (2 tokens) gives -1, row 1 (3 tokens) gives +0.5
        ("grpo", (-1.0 + 0.5) / 2),  # mean per sequence, then / 2 sequences
        ("bnpo", (-1.0 * 2 + 0.5 * 3) / 5),  # token sum / 5 tokens
        ("dapo", (-1.0 * 2 + 0.5 * 3) / 5),
        ("dr_grpo", (-1.0 * 2 + 0.5 * 3) / (2 * 4)),  # token sum / (2 sequences x max length 4)
    ],
)
def test_policy_loss_hand_computed_on_policy(loss_type, expected):
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.1, -4.0]], requires_grad=True)
    out = policy_loss(logprobs, ADV, MASK, loss_type=loss_type, **_totals())
    assert out.loss.item() == pytest.approx(expected, abs=1e-7)
    assert out.ratio_mean.item() == pytest.approx(1.0)
    assert out.clip_fraction.item() == 0.0 and out.kl.item() == 0.0 and out.num_tokens.item() == 5
    out.loss.backward()
    # d loss / d logprob = -A x (the token's weight in the aggregation); masked tokens get nothing.
    weights = {
        "grpo": torch.tensor([[1 / 2, 1 / 2, 0], [1 / 3, 1 / 3, 1 / 3]]) / 2,
        "bnpo": MASK / 5,
        "dapo": MASK / 5,
        "dr_grpo": MASK / 8,
    }[loss_type]
    torch.testing.assert_close(logprobs.grad, -ADV[:, None] * weights)


@pytest.mark.parametrize(("epsilon_high", "high"), [(None, 1.2), (0.28, 1.28)])
def test_policy_loss_clips_the_ratio(epsilon_high, high):
    # ratios 1.5, 0.5, 0.5, 1.5 against advantages +1, +1, -1, -1 (one token per sequence)
    old = torch.zeros(4, 1)
    logprobs = torch.log(torch.tensor([[1.5], [0.5], [0.5], [1.5]])).requires_grad_()
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0])
    mask = torch.ones(4, 1)
    out = policy_loss(
        logprobs,
        advantages,
        mask,
        old_logprobs=old,
        epsilon_high=epsilon_high,
        loss_type="bnpo",
        **_totals(mask),
    )
    # -min(r A, clip(r) A): 1.5 A=+1 -> -high (clipped); 0.5 A=+1 -> -0.5; 0.5 A=-1 -> +0.8 (clipped);
    # 1.5 A=-1 -> +1.5
    expected = (-high - 0.5 + 0.8 + 1.5) / 4
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    assert out.clip_fraction.item() == pytest.approx(0.5)
    assert out.ratio_mean.item() == pytest.approx(1.0)
    out.loss.backward()
    # clipped tokens get no gradient; the others get -A r / 4
    torch.testing.assert_close(logprobs.grad[:, 0], torch.tensor([0.0, -0.5 / 4, 0.0, 1.5 / 4]))


def test_policy_loss_kl_term_is_k3_times_beta():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.1, -4.0]])
    ref = logprobs + torch.tensor([[0.5, -0.5, 9.0], [0.0, 1.0, -1.0]])  # the 9.0 is masked out
    k3 = lambda d: math.exp(d) - d - 1  # noqa: E731
    kls = [k3(0.5), k3(-0.5), k3(0.0), k3(1.0), k3(-1.0)]
    beta = 0.1
    out = policy_loss(logprobs, ADV, MASK, ref_logprobs=ref, beta=beta, loss_type="dapo", **_totals())
    assert out.kl.item() == pytest.approx(sum(kls) / 5, rel=1e-6)
    surrogate = (-1.0 * 2 + 0.5 * 3) / 5
    assert out.loss.item() == pytest.approx(surrogate + beta * sum(kls) / 5, rel=1e-6)
    # beta = 0 with a reference: the KL is reported but not added
    out0 = policy_loss(logprobs, ADV, MASK, ref_logprobs=ref, beta=0.0, loss_type="dapo", **_totals())
    assert out0.loss.item() == pytest.approx(surrogate, rel=1e-6)
    assert out0.kl.item() == pytest.approx(out.kl.item())


@pytest.mark.parametrize("loss_type", [t for t in LOSS_TYPES if t != "bnpo"])  # bnpo: per micro-batch, below
def test_micro_batches_sum_to_the_batch_loss_and_gradient(loss_type):
    gen = torch.Generator().manual_seed(3)
    batch, length = 6, 5
    logits = torch.randn(batch, length, 7, generator=gen, requires_grad=True)
    ids = torch.randint(0, 7, (batch, length), generator=gen)
    lengths = torch.tensor([5, 1, 3, 4, 2, 5])
    mask = torch.arange(length)[None] < lengths[:, None]
    advantages = torch.randn(batch, generator=gen)
    old = torch.randn(batch, length, generator=gen) * 0.1 - 2.0
    ref = torch.randn(batch, length, generator=gen) * 0.1 - 2.0
    common = {
        "old_logprobs": old,
        "ref_logprobs": ref,
        "beta": 0.04,
        "epsilon_high": 0.28,
        "loss_type": loss_type,
        "total_sequences": batch,
        "total_tokens": int(mask.sum()),
        "max_completion_length": 8,
    }

    def loss_of(rows):
        logprobs = selected_token_logprobs(logits[rows], ids[rows])
        return policy_loss(
            logprobs,
            advantages[rows],
            mask[rows],
            **{**common, "old_logprobs": old[rows], "ref_logprobs": ref[rows]},
        ).loss

    whole = loss_of(slice(0, batch))
    (grad_whole,) = torch.autograd.grad(whole, logits)
    parts = [loss_of(rows) for rows in (slice(0, 2), slice(2, 5), slice(5, 6))]
    (grad_parts,) = torch.autograd.grad(sum(parts), logits)
    assert sum(p.item() for p in parts) == pytest.approx(whole.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grad_parts, grad_whole, rtol=1e-5, atol=1e-7)
    assert grad_whole.abs().sum() > 0


def test_bnpo_normalises_each_micro_batch_by_its_own_tokens_as_trl_does():
    """TRL's bnpo: each micro-batch's token mean, divided by the number of accumulated micro-batches."""
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.1, -4.0], [-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 0, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])  # 2 tokens, then 6 tokens
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0])
    totals = {"total_sequences": 4, "total_tokens": 8, "max_completion_length": 3}

    def micro_losses(loss_type):
        return [
            policy_loss(
                logprobs[rows], advantages[rows], mask[rows], loss_type=loss_type, **totals
            ).loss.item()
            for rows in (slice(0, 2), slice(2, 4))
        ]

    # On-policy the per-token loss is -A: micro-batch token means -1 and +1, each / 2 micro-batches.
    assert micro_losses("bnpo") == pytest.approx([-0.5, 0.5])
    assert sum(micro_losses("dapo")) == pytest.approx((-2 + 6) / 8)  # dapo: one token mean over the batch


def test_policy_loss_ignores_non_finite_values_at_masked_positions():
    logprobs = torch.tensor([[-1.0, float("-inf")], [-0.5, float("nan")]], requires_grad=True)
    mask = torch.tensor([[1, 0], [1, 0]])
    ref = torch.tensor([[-1.0, float("nan")], [-0.4, float("inf")]])
    out = policy_loss(logprobs, ADV, mask, ref_logprobs=ref, beta=0.1, loss_type="grpo", **_totals(mask))
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(out.kl) and torch.isfinite(logprobs.grad).all()


def test_policy_loss_rejects_bad_input():
    logprobs = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"grpo, bnpo, dapo, dr_grpo"):
        policy_loss(logprobs, ADV, MASK, loss_type="ppo", **_totals())
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logprobs, ADV, MASK, beta=0.1, **_totals())
    with pytest.raises(ValueError, match="mask"):
        policy_loss(logprobs, ADV, MASK[:, :2], **_totals())
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logprobs, torch.zeros(3), MASK, **_totals())
    with pytest.raises(ValueError, match="old_logprobs"):
        policy_loss(logprobs, ADV, MASK, old_logprobs=torch.zeros(2, 2), **_totals())
    with pytest.raises(ValueError, match="total_sequences"):
        policy_loss(logprobs, ADV, MASK, **{**_totals(), "total_sequences": 0})
    with pytest.raises(ValueError, match="total_tokens"):
        policy_loss(logprobs, ADV, MASK, loss_type="dapo", **{**_totals(), "total_tokens": 0})


def test_truncated_importance_weights_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    sampler = torch.tensor([[-1.5, -1.0, -0.5 - math.log(5.0), 7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    weights = truncated_importance_weights(trainer, sampler, mask, cap=3.0)
    expected = torch.tensor([[math.exp(0.5), math.exp(-1.0), 3.0, 0.0]])  # 5 capped at 3; padding 0
    assert torch.allclose(weights, expected)
    assert mean_abs_difference(trainer, sampler, mask) == pytest.approx((0.5 + 1.0 + math.log(5.0)) / 3)
    with pytest.raises(ValueError, match="cap must be >= 1"):
        truncated_importance_weights(trainer, sampler, mask, cap=0.5)


def test_policy_loss_importance_weights_scale_each_tokens_surrogate_but_not_the_kl():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]], requires_grad=True)
    ref = torch.tensor([[-1.2, -1.5, -0.5], [-0.3, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages = torch.tensor([1.5, -0.5])
    weights = torch.tensor([[2.0, 0.5, 1.0], [3.0, 1.0, 100.0]])  # the last one sits on padding
    common = dict(total_sequences=2, total_tokens=5, max_completion_length=3, loss_type="bnpo")
    weighted = policy_loss(
        logprobs, advantages, mask, ref_logprobs=ref, beta=0.1, importance_weights=weights, **common
    )
    surrogate = -(advantages[:, None] * weights * mask).sum() / 5  # on-policy: ratio 1
    kl = policy_loss(logprobs, torch.zeros(2), mask, ref_logprobs=ref, beta=0.1, **common).loss
    assert weighted.loss.item() == pytest.approx(surrogate.item() + kl.item(), rel=1e-6)
    weighted.loss.backward()
    unweighted = logprobs.detach().clone().requires_grad_(True)
    policy_loss(unweighted, advantages, mask, ref_logprobs=ref, beta=0.1, **common).loss.backward()
    assert not torch.allclose(logprobs.grad, unweighted.grad)  # the weights change the gradient
    assert logprobs.grad[1, 2] == 0 and unweighted.grad[1, 2] == 0
