"""``pods eval``: accuracy of a model, checkpoint or run on a task's test set, greedy or the paper's sampled protocol."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pods.cli.common import first_line, option, quiet_libraries
from pods.errors import ConfigError


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``pods eval`` to the command line."""
    evaluate = commands.add_parser(
        "eval", allow_abbrev=False, help="accuracy of a model or checkpoint on a test set"
    )
    evaluate.add_argument(
        "--model", required=True, help="model folder, hub name, 'embedded', checkpoint or run folder"
    )
    evaluate.add_argument(
        "--dataset", help="a task: gsm8k, math500, math, arith, arith-hard (or a registered task)"
    )
    evaluate.add_argument(
        "--source", help="hub name or local file/folder of the task's data (default: the hub)"
    )
    option(
        evaluate,
        "split",
        "--dataset_test_split",
        "--dataset-test-split",
        help="the split scored (default: test)",
    )
    evaluate.add_argument(
        "--config",
        help="a training YAML (or preset): its data keys (task, or dataset_name and the keys below) and accuracy "
        "reward are the defaults, so that a run is scored as it was evaluated while training",
    )
    user = evaluate.add_argument_group("your own data (docs/tasks.md): instead of --dataset")
    option(
        user,
        "dataset_name",
        help="a Hub dataset id, or a .jsonl/.json/.parquet/.csv file or a folder of them",
    )
    option(user, "dataset_config", help="the Hub dataset's configuration")
    option(user, "prompt_column", help="the column with the prompt, text or chat messages (default: prompt)")
    option(user, "prompt_template", help="the prompt from columns instead, e.g. 'Question: {problem}'")
    option(user, "answer_column", help="the column copied into 'answer', which the built-in checkers read")
    option(user, "system_prompt", help="a system message added to chat prompts")
    option(
        user,
        "accuracy_reward",
        help="the function scored as accuracy: a built-in name, file.py:function, module:function or a reward "
        "model (default: the task's; with --dataset_name: accuracy)",
    )
    evaluate.add_argument(
        "--protocol",
        choices=("greedy", "sampled"),
        default="greedy",
        help="greedy pass@1 (community convention) or the paper's sampled average (default: greedy)",
    )
    evaluate.add_argument("--samples", type=int, default=5, help="samples per problem for --protocol sampled")
    evaluate.add_argument(
        "--temperature", type=float, default=0.9, help="for --protocol sampled (default: 0.9)"
    )
    evaluate.add_argument("--limit", type=int, help="evaluate on the first N problems only")
    option(
        evaluate,
        "max_new_tokens",
        type=int,
        help="default: --config's max_completion_length, else the task's (32 for arith, 512 otherwise; 512 for "
        "--dataset_name)",
    )
    option(evaluate, "batch_size", type=int, default=64, help="completions generated at once")
    option(
        evaluate,
        "prompt_style",
        choices=("chat", "plain", "raw"),
        help="default: the task's (plain for arith; chat when the tokenizer has a chat template)",
    )
    option(
        evaluate,
        "rollout_engine",
        choices=("auto", "hf", "vllm"),
        default="auto",
        help="auto: vLLM where it is installed and can run, else Hugging Face generate (default: auto)",
    )
    agent = evaluate.add_argument_group("tools (docs/agents.md): episodes turn by turn, as in training")
    option(
        agent, "tools", nargs="+", help="file.py:function or module:function per tool (default: the task's)"
    )
    option(agent, "environment_factory", help="file.py:Class: one environment per rollout, reset(**row)")
    option(agent, "tool_format", choices=("auto", "chat_template", "text"), default="auto",
           help="how calls are written: chat_template, text (<call>f(x)</call>); auto: by the prompt style")  # fmt: skip
    option(agent, "max_tool_calling_iterations", type=int, help="rounds of tool calls per episode at most")
    option(agent, "tool_timeout", type=float, default=10.0, help="seconds a turn's tool calls may take")
    evaluate.add_argument("--output", help="JSON report path (default: eval-DATASET-PROTOCOL.json)")
    evaluate.set_defaults(handler=run_eval)


def run_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    from pods.evaluation import evaluate
    from pods.models import load_tokenizer
    from pods.scoring import reward_name

    with_defaults(args)
    quiet_libraries()
    model_dir = find_model_folder(args.model)
    model = load_model_for_eval(model_dir)
    tokenizer = load_tokenizer(model_dir)
    choose = user_dataset if args.dataset_name is not None else task_dataset
    dataset, accuracy_fn, style, max_new_tokens = choose(args, tokenizer)
    engine = eval_engine(args.rollout_engine, model, tokenizer, dataset, max_new_tokens, args.batch_size)
    engine = with_tools(engine, args, tokenizer, style, max_new_tokens)
    result = evaluate(
        model,
        tokenizer,
        dataset,
        accuracy_fn,
        protocol=args.protocol,
        samples=args.samples,
        temperature=args.temperature,
        max_new_tokens=max_new_tokens,
        batch_size=args.batch_size,
        prompt_style=style,
        progress=True,
        engine=engine,
    )
    name = args.dataset or args.dataset_name
    report = {"model": str(model_dir), "dataset": name, "split": args.split, "prompt_style": style}
    report["accuracy_reward"] = reward_name(accuracy_fn)
    report.update(result.to_dict())
    label = args.dataset or Path(args.dataset_name.rstrip("/")).stem
    output = Path(args.output) if args.output else Path(f"eval-{label}-{args.protocol}.json")
    output.write_text(json.dumps(report, indent=2))
    what = (
        "greedy pass@1"
        if args.protocol == "greedy"
        else f"sampled, T={args.temperature}, {args.samples} per problem"
    )
    print(f"{name} {args.split} ({result.num_problems} problems, {what}), {model_dir}:")
    print(
        f"  accuracy {result.accuracy:.2%}   format {result.format_accuracy:.2%}   both {result.correct_and_formatted:.2%}"
    )
    print(f"  report written to {output} ({result.seconds:.0f} s)")
    return 0


DATA_KEYS = (
    "dataset_name",
    "dataset_config",
    "prompt_column",
    "prompt_template",
    "answer_column",
    "system_prompt",
)


def with_defaults(args: argparse.Namespace) -> None:
    """Fill what the command line leaves unset from ``--config`` (a training YAML), then check that one dataset
    is named: a task (``--dataset``) or your own (``--dataset_name``)."""
    if args.config:
        from pods.cli.common import load_train_config

        config = load_train_config(args.config, [])
        if args.dataset is None and args.dataset_name is None:
            if config.dataset_name is None:
                args.dataset = config.eval_task or config.task
                args.source = (
                    args.source or config.eval_source or (None if config.eval_task else config.task_source)
                )
            else:
                args.dataset_name = config.dataset_name
        from_config = args.dataset_name == config.dataset_name and args.dataset_name is not None
        same_task = config.dataset_name is None and args.dataset == (config.eval_task or config.task)
        if from_config or same_task:  # the YAML's own dataset: score it as its run evaluated it
            for key in DATA_KEYS[1:] if from_config else ("system_prompt",):
                if getattr(args, key) is None:
                    setattr(args, key, getattr(config, key))
            args.split = args.split or (config.dataset_test_split if from_config else config.eval_split)
            args.prompt_style = args.prompt_style or config.prompt_style
            args.max_new_tokens = args.max_new_tokens or config.max_completion_length
            for key in ("tools", "environment_factory", "max_tool_calling_iterations"):  # its episodes' tools
                if getattr(args, key) is None:
                    setattr(args, key, getattr(config, key))
            if args.tool_format == "auto":
                args.tool_format = config.tool_format
            if args.accuracy_reward is None:
                from pods.run_inputs import accuracy_spec

                args.accuracy_reward = accuracy_spec(config)
    if (args.dataset is None) == (args.dataset_name is None):
        raise ConfigError(
            "name one dataset: --dataset TASK, --dataset_name FILE_OR_FOLDER_OR_HUB_ID, or --config "
            "a training YAML"
        )
    args.split = args.split or "test"
    if args.dataset_name is None:
        given = [f"--{key}" for key in DATA_KEYS[1:-1] if getattr(args, key) is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} apply to --dataset_name, not to a task (--dataset)")


def task_dataset(args: argparse.Namespace, tokenizer) -> tuple[Any, Any, str, int]:
    """A task's split: its rows, accuracy function (or ``--accuracy_reward``), prompt style and completion budget."""
    from pods.data import get_task
    from pods.rewards.imported import resolve_reward

    task = get_task(args.dataset)
    style = args.prompt_style or (
        "plain" if task.prompt_style == "chat" and not tokenizer.chat_template else task.prompt_style
    )
    dataset = task.load(
        args.split, source=args.source, prompt_style=style, limit=args.limit, system_prompt=args.system_prompt
    )
    accuracy = args.accuracy_reward
    accuracy_fn = resolve_reward(accuracy, "accuracy_reward") if accuracy else task.accuracy_function()
    return dataset, accuracy_fn, style, args.max_new_tokens or task.max_new_tokens


def user_dataset(args: argparse.Namespace, tokenizer) -> tuple[Any, Any, str, int]:
    """``--split`` of ``--dataset_name`` (:mod:`pods.data.user`; prompts as they are, or chat with
    ``--prompt_style chat``), its accuracy function (default ``accuracy``), style and completion budget."""
    from pods.data.user import load_dataset_rows
    from pods.rewards.imported import resolve_reward
    from pods.run_inputs import check_reward_columns

    accuracy_fn = resolve_reward(args.accuracy_reward or "accuracy", "accuracy_reward")
    rows = load_dataset_rows(
        args.dataset_name,
        args.split,
        config=args.dataset_config,
        prompt_column=args.prompt_column or "prompt",
        prompt_template=args.prompt_template,
        answer_column=args.answer_column,
        system_prompt=args.system_prompt,
        prompt_style=None if args.prompt_style == "raw" else args.prompt_style,
        tokenizer=tokenizer,
        limit=args.limit,
    )
    check_reward_columns([accuracy_fn], rows, f"--dataset_name {args.dataset_name} split {args.split}")
    return rows, accuracy_fn, args.prompt_style or "raw", args.max_new_tokens or 512


def with_tools(engine: Any, args: argparse.Namespace, tokenizer: Any, style: str, max_new_tokens: int) -> Any:
    """The engine run turn by turn with ``--tools`` / ``--environment_factory`` (the task's tools by default)."""
    from types import SimpleNamespace

    from pods.agents import multi_turn_engine

    settings = SimpleNamespace(
        tools=args.tools,
        environment_factory=args.environment_factory,
        tool_format=args.tool_format,
        max_tool_calling_iterations=args.max_tool_calling_iterations,
        tool_timeout=args.tool_timeout,
        max_completion_length=max_new_tokens,
        dataset_name=args.dataset_name,
        task=args.dataset,
    )
    return multi_turn_engine(engine, settings, tokenizer, style)


def eval_engine(requested: str, model, tokenizer, dataset, max_new_tokens: int, batch_size: int):
    """The rollout engine ``pods eval`` samples with (``auto``: vLLM where it can run); says which."""
    from pods.prompts import render_prompt
    from pods.rollout import build_engine, choose_engine

    try:
        name, reason = choose_engine(requested, model=model)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    print(f"rollout engine: {name} ({reason})")
    longest = max(
        (
            len(tokenizer(render_prompt(dataset[i]["prompt"], tokenizer))["input_ids"])
            for i in range(len(dataset))
        ),
        default=1,
    )
    return build_engine(
        name,
        model,
        tokenizer,
        generation_batch_size=batch_size,
        vllm_options={"max_model_length": longest + max_new_tokens},
    )


def find_model_folder(name: str) -> str:
    """A model folder, hub name, ``embedded``, a checkpoint (uses its ``model/``) or a run (its newest intact checkpoint).

    A checkpoint's model files are checked against its manifest first: a damaged one is a clear error.
    """
    from pods.checkpoint import STATE_FILE, newest_intact_checkpoint, verify_checkpoint
    from pods.models import resolve_model_path

    path = Path(name)
    if path.name == "model" and (path.parent / STATE_FILE).is_file():
        path = path.parent
    if (path / STATE_FILE).is_file():
        verify_checkpoint(path, under="model")
        return str(path / "model")
    if (path / "checkpoints").is_dir():
        warn = lambda text: print(f"pods eval: warning: {text}", file=sys.stderr)  # noqa: E731
        found = newest_intact_checkpoint(path / "checkpoints", warn=warn)
        if found is None:
            raise ConfigError(f"--model {name}: this run folder has no intact checkpoint")
        return str(found / "model")
    return resolve_model_path(name)


def load_model_for_eval(model_dir: str):
    """Load safetensors weights only, never running a model's own code; a broken folder is a clear error.

    A LoRA adapter's base is loaded in the dtype its run trained in (the run's ``config.yaml``; else the
    base's own), a full model in bfloat16 on a GPU and float32 on a CPU.
    """
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        if (Path(model_dir) / "adapter_config.json").is_file():
            from peft import AutoPeftModelForCausalLM

            model = AutoPeftModelForCausalLM.from_pretrained(
                model_dir, dtype=training_dtype(model_dir), use_safetensors=True
            )
        else:
            from transformers import AutoModelForCausalLM

            dtype = torch.bfloat16 if device == "cuda" else torch.float32
            model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=dtype, use_safetensors=True, trust_remote_code=False
            )
    except Exception as error:  # safetensors, OSError, ValueError, ...: name the folder and the cause
        raise ConfigError(
            f"--model {model_dir}: cannot load the model ({type(error).__name__}: {first_line(error)}); "
            "the folder may be damaged or incomplete (pods eval reads model.safetensors only and never runs "
            "a model's own code)"
        ) from None
    return model.to(device).eval()


def training_dtype(model_dir: str):
    """The dtype a checkpoint's exported model was trained in (its run's ``config.yaml``), else ``"auto"``
    (the checkpoint's own)."""
    import yaml

    from pods.checkpoint import STATE_FILE
    from pods.models import DTYPES

    path = Path(model_dir)
    run_config = path.parent.parent.parent / "config.yaml"  # <run>/checkpoints/step-N/model
    if path.name == "model" and (path.parent / STATE_FILE).is_file() and run_config.is_file():
        dtype = (yaml.safe_load(run_config.read_text()) or {}).get("dtype")
        if dtype in DTYPES:
            return DTYPES[dtype]
    return "auto"
