"""Shared-prefix packing: the layout is right by construction (pure tests), and every forward over rollouts
gives the unpacked path's log-probs, loss and gradients in float32 (Llama and Qwen2, SDPA and eager, LoRA,
4-bit QLoRA, gradient checkpointing, every loss type, a KL reference, several passes, the sampler's
importance weights)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from pods.architectures import packing_blocker, row_plan
from pods.checkpoint import TrainerState
from pods.config import TrainConfig
from pods.loss import completion_logprobs
from pods.models import enable_checkpointing
from pods.packing import (
    attention_implementation,
    attention_mask,
    flex_block_mask,
    forward_slices,
    pack,
    packable,
)
from pods.rollout import Rollouts
from pods.update import NonFiniteGuard, policy_update

VOCAB = 61


def padded(prompts: list[list[int]], completions: list[list[int]], width: int | None = None):
    """Left-padded prompts and right-padded completions (pad id 0) with their masks."""
    lp = max(map(len, prompts))
    lc = width or max(1, max(map(len, completions)))
    prompt_ids = torch.zeros(len(prompts), lp, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    completion_ids = torch.zeros(len(prompts), lc, dtype=torch.long)
    completion_mask = torch.zeros_like(completion_ids)
    for b, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        prompt_ids[b, lp - len(p) :], prompt_mask[b, lp - len(p) :] = torch.tensor(p), 1
        if c:
            completion_ids[b, : len(c)], completion_mask[b, : len(c)] = torch.tensor(c), 1
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def test_a_group_packs_its_prompt_once_with_positions_continuing_from_it() -> None:
    """Two rows of prompt [5, 6] and one of [7]: the shared prompt appears once (its last token in front of
    each completion, at the same position), each completion's positions continue from its prompt, and every
    completion token is the label of the position just before it in its own sequence."""
    batch = padded([[5, 6], [5, 6], [7]], [[11, 12, 13], [14], [15, 16]])
    packed = pack(*batch)
    assert packed.input_ids.tolist() == [[5, 6, 11, 12, 13, 6, 14], [7, 15, 16, 0, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 1, 2], [0, 1, 2, 0, 0, 0, 0]]
    assert packed.segment_ids.tolist() == [[0, 1, 1, 1, 1, 2, 2], [1, 1, 1, -1, -1, -1, -1]]
    assert packed.labels.tolist() == [
        [-100, 11, 12, 13, -100, 14, -100],
        [15, 16, -100, -100, -100, -100, -100],
    ]
    labels, completion_ids = packed.labels.flatten(), batch[2].flatten()
    assert labels[packed.label_index].tolist() == completion_ids[packed.label_dest].tolist()
    assert sorted(packed.label_dest.tolist()) == batch[3].flatten().nonzero().flatten().tolist()
    assert packed.first_column == 0 and packed.num_tokens == 6


def test_a_long_group_splits_with_its_own_prompt_copy_and_small_groups_share_a_row() -> None:
    """Budget 6: prompt [1, 2] with completions of 3, 2 and 3 tokens makes units of 5, 4 and 5 tokens (the
    prompt's last token counts once per completion), each with its prompt; an empty completion is left out;
    the units of [3] (3 tokens) and [4] (2) share one row as long as the longest unit."""
    batch = padded([[1, 2]] * 4 + [[3], [4]], [[21, 22, 23], [24, 25], [], [26, 27, 28], [29, 30], [31]])
    packed = pack(*batch, token_budget=6)
    rows = [[t for t in row if t] for row in packed.input_ids.tolist()]
    expected = [[1, 2, 21, 22, 23], [1, 2, 24, 25], [1, 2, 26, 27, 28], [3, 29, 30, 4, 31]]
    assert sorted(rows) == sorted(expected)
    assert packed.input_ids.shape[1] == 5  # as long as the longest unit, not the budget
    # a single prompt + completion longer than the budget stands alone rather than failing
    assert pack(*padded([[1, 2]], [[3, 4, 5]]), token_budget=2).input_ids.tolist() == [[1, 2, 3, 4, 5]]


def unit_sizes(packed) -> list[int]:
    """Tokens of each unit (a prompt copy with its completions) of a packing."""
    return [
        int((row == block).sum()) for row in packed.block_ids for block in row.unique().tolist() if block >= 0
    ]


def test_completions_share_a_prompt_only_where_that_costs_less_than_apart() -> None:
    """Under a dense mask a packed row costs attention over its whole length: a 2-token prompt shared by
    completions of 12 tokens saves 1 token per completion but makes a row of 40. With a small hidden size
    (attention weighs much) each completion gets a unit of its own, with a large one they share; for random
    batches no unit ever costs more than its rows unpacked."""
    from pods.packing import dense_cost

    batch = padded([[1, 2]] * 3, [list(range(10, 22))] * 3)
    assert unit_sizes(pack(*batch, hidden_size=2)) == [14, 14, 14]  # three units: the rows as they were
    assert unit_sizes(pack(*batch, hidden_size=4096)) == [1 + 3 * 13]  # one unit: the prompt once
    assert unit_sizes(pack(*batch)) == [1 + 3 * 13]  # without a model: tokens only
    for seed in range(20):
        batch = random_batch(seed=seed, prompts=4, kept=5, width=12)
        rows = [(int(batch[1][b].sum()), int(batch[3][b].sum())) for b in range(batch[0].shape[0])]
        for hidden in (1, 4, 16, 64):
            packed = pack(*batch, token_budget=4096, hidden_size=hidden)
            unpacked = sum(dense_cost(p + c, hidden) for p, c in rows if c)
            assert sum(dense_cost(size, hidden) for size in unit_sizes(packed)) <= unpacked + 1e-9


def test_forward_slices_stay_within_the_budget_and_score_every_completion_once() -> None:
    """Eight packed rows of 5 tokens (budget 5: every completion a unit of its own): a budget of 12 gives
    forwards of 2 rows (10 tokens), each scoring whole completions, together each completion token once; a
    budget under one row still forwards row by row."""
    batch = padded(
        [[1, 2]] * 6 + [[3, 4, 5]] * 2,
        [
            [21, 22, 23],
            [24, 25, 26],
            [27, 28, 29],
            [30, 31, 32],
            [33, 34, 35],
            [36, 37, 38],
            [39, 40],
            [41, 42],
        ],
    )
    packed = pack(*batch, token_budget=5)
    rows, length = packed.input_ids.shape
    assert (rows, length) == (8, 5)
    for budget, expected in ((12, [2, 2, 2, 2]), (3, [1] * 8), (40, [8]), (39, [7, 1])):
        slices = forward_slices(packed, budget)
        assert [piece.input_ids.shape[0] for piece in slices] == expected, budget
        scored = torch.stack([piece.rows_scored() for piece in slices])
        assert scored.sum(dim=0).tolist() == [1] * 8  # every row in exactly one forward
        for piece in slices:
            # the same tokens at the same places: labels gathered through the slice's own indices
            labels = piece.labels.flatten()[piece.label_index]
            assert labels.tolist() == batch[2].flatten()[piece.label_dest].tolist()
            assert piece.first_column == min(int(i) % length for i in piece.label_index)
            assert set((piece.label_dest // batch[2].shape[1]).tolist()) == set(
                piece.rows_scored().nonzero().flatten().tolist()
            )
        assert sum(piece.num_tokens for piece in slices) == packed.num_tokens


def test_the_mask_shows_each_completion_its_prompt_and_its_own_past_only() -> None:
    """Row: prompt p0 p1 | completion a0 a1 | completion b0 | next unit q0 c0 | padding x x."""
    block = torch.tensor([[0, 0, 0, 0, 0, 1, 1, -1, -1]])
    segment = torch.tensor([[0, 0, 1, 1, 2, 0, 1, -1, -1]])
    expected = [
        [1, 0, 0, 0, 0, 0, 0, 0, 0],  # p0
        [1, 1, 0, 0, 0, 0, 0, 0, 0],  # p1
        [1, 1, 1, 0, 0, 0, 0, 0, 0],  # a0
        [1, 1, 1, 1, 0, 0, 0, 0, 0],  # a1
        [1, 1, 0, 0, 1, 0, 0, 0, 0],  # b0: not a
        [0, 0, 0, 0, 0, 1, 0, 0, 0],  # q0: not the other unit
        [0, 0, 0, 0, 0, 1, 1, 0, 0],  # c0
        [0, 0, 0, 0, 0, 0, 0, 1, 0],  # padding attends to padding (no empty row)
        [0, 0, 0, 0, 0, 0, 0, 1, 1],
    ]
    assert attention_mask(block, segment)[0, 0].long().tolist() == expected


def test_the_flex_attention_block_mask_is_the_same_mask() -> None:
    """FlexAttention's mask function, evaluated densely (no kernel: FlexAttention has no CPU backward)."""
    from torch.nn.attention.flex_attention import create_mask

    packed = pack(*random_batch(), token_budget=12)
    block, segment = packed.block_ids, packed.segment_ids
    rows, length = block.shape
    block_mask = flex_block_mask(block, segment)
    dense = create_mask(block_mask.mask_mod, rows, 1, length, length, device="cpu")
    assert torch.equal(dense, attention_mask(block, segment))


def test_packable_wants_left_padded_prompts_and_right_padded_completions() -> None:
    assert packable(torch.tensor([[0, 1, 1]]), torch.tensor([[1, 1, 0]]))
    assert not packable(torch.tensor([[1, 1, 0]]), torch.tensor([[1, 1, 0]]))
    assert not packable(torch.tensor([[1, 1, 1]]), torch.tensor([[1, 0, 1]]))


def tiny(architecture: str, attention: str, seed: int = 0) -> torch.nn.Module:
    """A random 2-layer float32 Llama or Qwen2 (grouped-query attention) on the given attention path."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(seed)
    if architecture == "llama":
        model = LlamaForCausalLM(LlamaConfig(**sizes, attn_implementation=attention))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**sizes, attn_implementation=attention))
    return model.float()


def random_batch(seed: int = 0, prompts: int = 3, kept: int = 3, width: int = 7):
    """``prompts`` groups of ``kept`` rows, prompts of different lengths, completions of every length from
    empty to clipped (the full width)."""
    generator = torch.Generator().manual_seed(seed)
    prompt_rows, completion_rows = [], []
    for p in range(prompts):
        prompt = torch.randint(1, VOCAB, (2 + 3 * p,), generator=generator).tolist()
        for k in range(kept):
            length = (p * kept + k * 3) % (width + 1)
            prompt_rows.append(prompt)
            completion_rows.append(torch.randint(1, VOCAB, (length,), generator=generator).tolist())
    return padded(prompt_rows, completion_rows, width)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logprobs_equal_unpacked_ones(architecture: str, attention: str) -> None:
    """Every token's log-prob within 1e-5 of the unpacked path, at budgets that split every group, some, or
    none, under top-k / top-p truncation too, with a group of one row; and gradients within 1e-4."""
    model = tiny(architecture, attention)
    batch = random_batch()
    batch = tuple(torch.cat([t, t[:1]]) for t in batch[:2]) + tuple(
        torch.cat([t, t[-1:]]) for t in batch[2:]
    )  # one more row: the first prompt with the last completion (its group now has one row more)
    mask = batch[3].bool()
    unpacked = completion_logprobs(model, *batch, temperature=0.7, packing=False)
    grads = torch.autograd.grad(unpacked[mask].sum(), list(model.parameters()))
    for budget in (1, 12, 4096):
        packed = completion_logprobs(model, *batch, temperature=0.7, token_budget=budget)
        torch.testing.assert_close(packed[mask], unpacked[mask], rtol=0, atol=1e-5)
        assert bool((packed[~mask] == 0).all())
    packed_grads = torch.autograd.grad(packed[mask].sum(), list(model.parameters()))
    for a, b in zip(packed_grads, grads, strict=True):
        assert float((a - b).norm()) <= 1e-4 * float(b.norm()) + 1e-9
    with torch.no_grad():
        truncated = {
            packing: completion_logprobs(model, *batch, top_k=5, top_p=0.8, packing=packing)
            for packing in (True, False)
        }
    torch.testing.assert_close(truncated[True][mask], truncated[False][mask], rtol=0, atol=1e-5)
    # one group only, one row only: the same as well
    one = tuple(t[1:2] for t in batch)
    alone = completion_logprobs(model, *one, temperature=0.7)
    torch.testing.assert_close(alone[mask[1:2]], unpacked[1:2][mask[1:2]], rtol=0, atol=1e-5)


def test_packing_is_refused_with_a_reason_for_flash_attention() -> None:
    """The one-line reason completion_logprobs prints (once) when it runs such a model unpacked; sliding
    windows pack (tests/test_architectures.py)."""
    model = tiny("llama", "sdpa")
    assert packing_blocker(model) is None and packing_blocker(tiny("qwen2", "eager")) is None
    model.config._attn_implementation = "flash_attention_2"  # decided anew for the new implementation
    reason = packing_blocker(model)
    assert reason is not None and "flash_attention_2" in reason and "sdpa" in reason  # names the fix


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients of each step (what the update's backward produced)."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.steps: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        grads = [
            p.grad.detach().clone() for g in self.param_groups for p in g["params"] if p.grad is not None
        ]
        self.steps.append(grads)
        return super().step(closure)


def rollouts_of(batch, prompts: int, kept: int, sampling: bool) -> Rollouts:
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch
    rows = prompt_ids.shape[0]
    noise = torch.randn(completion_ids.shape, generator=torch.Generator().manual_seed(1))
    return Rollouts(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
        completion_mask=completion_mask, texts=[""] * rows, truncated=torch.zeros(rows, dtype=torch.bool),
        num_prompts=prompts, num_generations=kept,
        sampling_logprobs=(-2.0 + 0.1 * noise) * completion_mask if sampling else None,
    )  # fmt: skip


def run_update(model, batch: Rollouts, settings: dict, packing: bool, lora: bool):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    model = copy.deepcopy(model)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    config = TrainConfig(
        num_generations=3, num_generations_kept=3, prompts_per_step=3, micro_batch_size=9, max_grad_norm=1e9,
        max_completion_length=7, packing=packing, **settings,
    )  # fmt: skip
    optimizer = RecordingSGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    forwards: list[int] = []  # tokens of each forward with gradients (the update's, not old/ref log-probs)
    model.register_forward_pre_hook(
        lambda module, args, kwargs: (
            forwards.append(kwargs["input_ids"].numel()) if torch.is_grad_enabled() else None
        ),
        with_kwargs=True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    reference = copy.deepcopy(model).eval() if settings.get("beta") and not lora else None
    guard = NonFiniteGuard(TrainerState(), 3, Path("unused"))
    advantages = torch.linspace(-1.0, 1.2, len(batch))
    trained = torch.ones(len(batch), dtype=torch.bool)
    trained[[4, 5]] = False  # the second group trains one row (the others weigh nothing)
    metrics = policy_update(
        accelerator, model, optimizer, scheduler, batch, advantages, config, guard, reference, trained=trained
    )
    return metrics, optimizer.optimizer.steps, forwards


def assert_same_update(model, batch: Rollouts, settings: dict, lora: bool = False) -> None:
    """Loss within 1e-6 relative, every parameter's gradient at every optimizer step within 1e-4. With a
    ``token_budget`` that one prompt + completion fits, every packed forward stays within it (so the
    micro-batches of 9 rows run as several forwards each)."""
    assert packing_blocker(model) is None  # the packed arm does pack
    packed, packed_steps, packed_forwards = run_update(model, batch, settings, packing=True, lora=lora)
    unpacked, unpacked_steps, unpacked_forwards = run_update(model, batch, settings, packing=False, lora=lora)
    passes = settings.get("num_iterations", 1)
    assert len(unpacked_forwards) == 2 * passes  # one forward per micro-batch and pass
    if "token_budget" in settings:
        assert max(packed_forwards) <= settings["token_budget"], packed_forwards
        assert len(packed_forwards) > len(unpacked_forwards)
    assert packed.keys() == unpacked.keys()
    for key, value in unpacked.items():
        tolerance = 1e-4 if key == "grad_norm" else 1e-6
        assert packed[key] == pytest.approx(value, rel=tolerance, abs=1e-7), key
    assert len(packed_steps) == len(unpacked_steps) == settings.get("num_iterations", 1)
    for step_packed, step_unpacked in zip(packed_steps, unpacked_steps, strict=True):
        assert len(step_packed) == len(step_unpacked) > 0 and all(bool(b.any()) for b in step_unpacked)
        for a, b in zip(step_packed, step_unpacked, strict=True):
            assert float((a - b).norm()) <= 1e-4 * float(b.norm()) + 1e-9


# name: (architecture, attention, settings, with the sampler's log-probs: importance weights)
UPDATE_CASES = {
    "grpo-kl-2-passes-weights": (
        "llama",
        "sdpa",
        dict(loss_type="grpo", beta=0.1, num_iterations=2, token_budget=16),
        True,
    ),
    "bnpo": ("qwen2", "eager", dict(loss_type="bnpo", token_budget=16), False),
    "dapo-kl-weights": ("qwen2", "sdpa", dict(loss_type="dapo", beta=0.05), True),
    "dr_grpo-2-passes": ("llama", "eager", dict(loss_type="dr_grpo", num_iterations=2), False),
}


@pytest.mark.parametrize("case", list(UPDATE_CASES))
def test_the_packed_update_equals_the_unpacked_one(case: str) -> None:
    """Three groups over two micro-batches (a group split between them), one group training a single row;
    with a budget of 16 tokens, each micro-batch as several forwards, each backpropagated on its own."""
    architecture, attention, settings, sampling = UPDATE_CASES[case]
    model = tiny(architecture, attention)
    assert_same_update(model, rollouts_of(random_batch(), 3, 3, sampling), settings)


def test_the_packed_update_equals_the_unpacked_one_with_lora_and_gradient_checkpointing() -> None:
    """LoRA (the KL reference: the adapter disabled) on a gradient-checkpointed Qwen2."""
    from pods.models import add_lora

    model = tiny("qwen2", "sdpa")
    enable_checkpointing(model)
    model.config.use_cache = False
    model = add_lora(model, TrainConfig(lora_r=4, lora_alpha=8))
    for name, parameter in model.named_parameters():  # LoRA's B starts at 0: make the adapter do something
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.05)
    assert_same_update(model, rollouts_of(random_batch(), 3, 3, True), dict(beta=0.1), lora=True)


def test_the_packed_update_equals_the_unpacked_one_on_a_4bit_qlora_base(tiny_model_dir: Path) -> None:
    """bitsandbytes' CPU backend: NF4 base, LoRA adapters, float32 compute."""
    pytest.importorskip("bitsandbytes")
    from pods.models import load_policy

    config = TrainConfig(model=str(tiny_model_dir), load_in_4bit=True, lora_r=4, lora_alpha=8)
    model = load_policy(config).model
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.05)
    vocab = model.get_input_embeddings().weight.shape[0]
    batch = tuple(t % vocab if i % 2 == 0 else t for i, t in enumerate(random_batch(seed=3)))
    assert_same_update(model, rollouts_of(batch, 3, 3, False), dict(beta=0.1, num_iterations=2), lora=True)


def test_hf_generation_prefills_each_prompt_once_and_samples_the_same_completions(
    tiny_model_dir: Path,
) -> None:
    """Three prompts x 4 samples in chunks of 5 rows (a group split across chunks): the same completions for
    a fixed seed (sampled, top-k / top-p, greedy) with and without the shared prefill, while the model's
    embedding sees each prompt once per chunk (+ the last prompt token per row) instead of once per row."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pods.rollout import HFGenerateEngine, SamplingParams

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert row_plan(model).prefill_blocker is None  # its self-check's forwards run here, not counted below
    seen = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: seen.append(args[0].numel()))
    prompts = ["say a", "a longer prompt than that one", "x"]
    settings = [
        SamplingParams(max_new_tokens=6, temperature=1.0),
        SamplingParams(max_new_tokens=6, temperature=0.8, top_k=20, top_p=0.9),
        SamplingParams(max_new_tokens=6, temperature=0.0),
    ]
    for sampling in settings:
        tokens, completions = {}, {}
        for share in (True, False):
            torch.manual_seed(3)
            engine = HFGenerateEngine(model, tokenizer, generation_batch_size=5, share_prefix=share)
            seen.clear()
            completions[share] = engine.generate(prompts, 4, sampling).completion_ids
            tokens[share] = seen[0] + seen[1] if share else seen[0]  # the first chunk's prefill
        assert torch.equal(completions[True], completions[False])
        width = int(tokenizer(prompts[:2], padding=True, return_tensors="pt")["attention_mask"].shape[1])
        assert tokens[False] == 5 * width  # rows 0-4: prompts 0 (x4) and 1 (x1), every row its prompt
        assert tokens[True] == 2 * (width - 1) + 5  # each distinct prompt once, then the last token per row


def test_pods_train_with_and_without_packing_samples_and_learns_the_same(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two steps of the real trainer (KL reference, two passes): ``packing: false`` turns off the shared
    prefill and the packed forwards, and both runs sample the same completions and end on the same weights."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    from tiny_run import TINY_SETTINGS, count_of_a, tiny_dataset

    from pods.metrics import read_jsonl
    from pods.trainer import PODSTrainer

    runs = {}
    for packing in (True, False):
        settings = {**TINY_SETTINGS, "beta": 0.1, "num_iterations": 2, "packing": packing}
        config = TrainConfig(model=str(tiny_model_dir), output_dir=str(tmp_path / str(packing)), **settings)
        trainer = PODSTrainer(config, reward_funcs=[count_of_a], train_dataset=tiny_dataset())
        assert trainer.engine.share_prefix is packing
        trainer.train()
        weights = [p.detach().clone() for p in trainer.accelerator.unwrap_model(trainer.model).parameters()]
        runs[packing] = (read_jsonl(tmp_path / str(packing) / "metrics.jsonl"), weights)
    (packed, packed_weights), (unpacked, unpacked_weights) = runs[True], runs[False]
    for a, b in zip(packed, unpacked, strict=True):
        assert a["completions/mean_length"] == b["completions/mean_length"] and a["reward"] == b["reward"]
        for key in ("loss", "kl", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), key
    for a, b in zip(packed_weights, unpacked_weights, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # Adam: 1% of a step (lr 1e-3)


def test_attn_implementation_picks_the_attention_packing_runs_on(tiny_model_dir: Path) -> None:
    """auto leaves transformers' default (SDPA: it takes the mask); eager is loaded as asked, for the reference
    too; an implementation this machine cannot run stops at load with one line naming the key and the fix."""
    from pods.errors import ConfigError
    from pods.models import load_policy, load_reference

    auto = load_policy(TrainConfig(model=str(tiny_model_dir))).model
    assert attention_implementation(auto) == "sdpa" and packing_blocker(auto) is None
    eager = TrainConfig(model=str(tiny_model_dir), attn_implementation="eager")
    assert attention_implementation(load_policy(eager).model) == "eager"
    assert attention_implementation(load_reference(eager)) == "eager"
    with pytest.raises(
        ConfigError, match=r"^attn_implementation: flash_attention_2 cannot run here .*use auto"
    ):
        load_policy(TrainConfig(model=str(tiny_model_dir), attn_implementation="flash_attention_2"))
