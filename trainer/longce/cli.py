"""``longce-train``: fine-tune a causal LM with LongCE (``LongCETrainer``) from a YAML recipe.

    longce-train --config configs/tiny_cpu.yaml               # CPU, seconds
    longce-train --config configs/tiny_cpu.yaml --learning_rate 1e-4 --max_steps 10
    accelerate launch --config_file <accelerate.yaml> -m longce.cli \\
        --config configs/setting_a_pg19_eabf.yaml             # the paper's setting A

(``python scripts/train_longce.py`` is the same command.) Every field of ``ModelArguments``,
``DataArguments`` and ``LongCEConfig`` (``TrainingArguments`` plus ``longce_*``) can be set in the
YAML file and overridden on the command line (a model or data source given there replaces the
recipe's: ``--model_name_or_path`` its ``model_config`` and tokenizer; run_clm's ``--train_file``,
``--validation_file``, ``--block_size`` and TRL's ``--dataset_text_field`` name our fields); ``--help`` lists the model, data and LongCE fields,
``--help-all`` every ``TrainingArguments`` field too (``--config recipe.yaml --help`` shows the
recipe's values as the defaults). The recipe's rules (defaults, relative paths, aliases such as
``dtype`` / ``torch_dtype``) are in ``longce.arguments``; how the text becomes sequences
(run_clm-style blocks or per-document ``packing``) in ``longce.data``.

Evaluation data (``eval_data_files``, ``eval_split`` or ``validation_split_percentage``) is
processed like the training data; ``--eval_strategy steps --eval_steps N`` then logs
``eval_loss`` and the LongCE statistics (``eval_ce_loss``, ...) every N steps.

``--longce_weights cache --key_tokens <folder>`` weighs each token from an evaluator's key-token cache
(``longppl-score --output <folder>``) instead of a short-context pass of the trained model
(``longce.data``, ``longce.add_key_token_weights``).

``resume_from_checkpoint`` takes a checkpoint folder, or ``last`` for the newest
``checkpoint-*`` folder of ``output_dir``. Without it, an ``output_dir`` that holds files is treated as
transformers' run_clm treats it (``checkpoint_to_resume``): checkpoints there are resumed from, any other
non-empty folder is refused unless ``--overwrite_output_dir``; nothing in it is ever deleted. A run
that has already reached its ``max_steps`` (or ``num_train_epochs``) is not trained again: one line
says so and the command ends (status 0, nothing written); a larger ``max_steps`` resumes and continues.

At the end the output folder holds the model (and tokenizer), ``trainer_state.json``,
``all_results.json`` (the training metrics, and the final evaluation's when there is evaluation data)
and a model card, ``README.md``, tagged ``longce`` and citing the paper.

``torch_threads`` sets torch's CPU threads (``OMP_NUM_THREADS`` wins), as the quickstart does for its toy
model: ``configs/tiny_cpu.yaml`` uses 1.

A bad input (a missing recipe, a bad value, a mistyped option, a cache without the training texts)
ends the command with one ``<prog>: error: ...`` line, as the ``longppl-*`` commands do
(``longppl.tools.cli.run_command``); ``LONGPPL_DEBUG=1`` shows the traceback. ``<prog>`` is the name the
command was started by (``longce-train``, ``longppl train``), in every message.

What needs no torch is checked before torch is imported (``longce.recipes.check_before_loading``: a
missing or malformed recipe, a misspelled field or option, a data file or key-token cache that is not
there); torch's model classes, ``datasets`` and the trainer load after the arguments are parsed, so
``--help`` and argument errors come without them.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from typing import TYPE_CHECKING

from longppl.tools.cli import run_command

# Nothing that imports torch at this module's import (transformers' TrainingArguments does): the command
# checks what it can before (recipes.check_before_loading), and `longce.arguments` loads after that.
from .recipes import PROG, check_before_loading

if TYPE_CHECKING:
    import torch

    from .arguments import ModelArguments, RecipeConfig
    from .config import LongCEConfig
    from .trainer import LongCETrainer

__all__ = ["checkpoint_to_resume", "finished_run", "load_model", "main", "train"]


#: Tags of the model card (besides those transformers adds); the hub finds LongCE models by them.
MODEL_CARD_TAGS = ("longce", "long-context")


# ------------------------------------------------------------------ model


def load_model(model_args: ModelArguments, training_args: LongCEConfig, tokenizer) -> torch.nn.Module:
    """Build (``model_config``) or load the model, after the context extension edited its config; then LoRA."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, set_seed

    from longppl.models.named import resolve

    from .context_extension import apply_context_extension

    # a real model's short name or a GGUF file: the folder it is converted into (once)
    source = model_args.model_name_or_path and (
        resolve(model_args.model_name_or_path, "model_name_or_path") or model_args.model_name_or_path
    )
    if model_args.model_config is not None:
        kwargs = dict(model_args.model_config)
        kwargs.setdefault("vocab_size", len(tokenizer))
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            kwargs.setdefault(name, getattr(tokenizer, name))
        config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    else:
        config = AutoConfig.from_pretrained(source, cache_dir=model_args.cache_dir)
    attn = apply_context_extension(
        config,
        model_args.context_extension,
        factor=model_args.rope_factor,
        rope_theta=model_args.rope_theta,
        original_max_position_embeddings=model_args.original_max_position_embeddings,
        eabf_base_length=model_args.eabf_base_length,
    )
    if attn is not None and model_args.attn_implementation not in (None, attn):
        raise ValueError(
            f"context_extension={model_args.context_extension!r} needs its own attention ({attn!r}); "
            f"unset attn_implementation (got {model_args.attn_implementation!r})."
        )
    attn = attn or model_args.attn_implementation
    dtype = "auto" if model_args.dtype == "auto" else getattr(torch, model_args.dtype)
    set_seed(training_args.seed)  # random init (model_config) and LoRA init follow the run's seed
    if model_args.model_config is not None:
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32 if dtype == "auto" else dtype, attn_implementation=attn
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            source,
            config=config,
            dtype=dtype,
            attn_implementation=attn,
            cache_dir=model_args.cache_dir,
        )
    embedding = model.get_input_embeddings().weight
    rows = getattr(embedding, "ds_shape", embedding.shape)[0]  # DeepSpeed ZeRO-3 keeps the full shape aside
    if len(tokenizer) > rows:
        raise ValueError(
            f"The tokenizer has {len(tokenizer)} tokens but the model's embedding only {rows} rows; "
            "use the model's own tokenizer or a larger vocab_size."
        )
    if model_args.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        if training_args.activation_checkpointing:  # LongCEConfig mirrors gradient_checkpointing into it
            # Frozen embeddings give checkpointed blocks inputs without grad; LoRA weights inside them need it.
            model.enable_input_require_grads()
        lora = LoraConfig(
            r=model_args.lora_r,
            lora_alpha=model_args.lora_alpha,
            lora_dropout=model_args.lora_dropout,
            target_modules=list(model_args.lora_target_modules),
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
    return model


# ------------------------------------------------------------------ training


def main(argv: list[str] | None = None) -> int:
    """The ``longce-train`` command: ``train(argv)``, then the process group closed; returns the exit status 0.

    ``argv``: the arguments after the command (default ``sys.argv[1:]``). ``-h`` / ``--help`` and
    ``--help-all`` print the help and exit (``SystemExit(0)``). A bad input exits with one
    ``<prog>: error: ...`` line and status 1 (``run_command``; ``LONGPPL_DEBUG=1``: the traceback).
    """
    return run_command(_train_and_close, argv)


def _train_and_close(argv: list[str] | None, prog: str) -> None:
    # prog: run_command's name for the command (the name it was started by), in every message
    train(argv, prog)
    close_process_group()


def close_process_group() -> None:
    """End the ``torch.distributed`` process group a launched run opened, if any: a gloo group left open
    can abort the process at exit (SIGABRT) after the work is done. Call it last in a process."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # every rank arrives first: a rank that tears its group down while a peer still works in it
        # (e.g. rank 0 writing results) can abort in gloo's threads at exit
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def train(argv: list[str] | None = None, prog: str = PROG) -> LongCETrainer | None:
    """Parse the arguments, train (resuming as ``checkpoint_to_resume`` says), evaluate, save the model,
    ``all_results.json`` and the model card; returns the trainer. A run that ``finished_run`` finds
    already done is not trained again: one line says so and ``None`` is returned, nothing written.
    ``prog``: the command's name in its messages.

    What needs no torch is checked before torch is imported (``recipes.check_before_loading``).

    With evaluation data, ``eval_strategy`` steps/epoch evaluates during training, and the final model
    is evaluated once more unless the last of those ran at the last step; with ``eval_strategy`` no,
    once after training.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    check_before_loading(argv, prog)
    from .arguments import check_weight_source, parse_args

    model_args, data_args, training_args = parse_args(argv, prog)
    # After parsing: `--help` and argument errors come without datasets and the trainer.
    from transformers import DataCollatorWithFlattening, default_data_collator

    from .data import load_datasets, load_tokenizer
    from .trainer import LongCETrainer

    if training_args.eval_strategy != "no" and not data_args.has_eval_data:
        raise ValueError(
            f"eval_strategy={training_args.eval_strategy.value!r} needs evaluation data: set "
            "eval_data_files (local files), eval_split (a split of the training source, e.g. "
            "'validation') or validation_split_percentage (hold out a share of the training documents)."
        )
    check_weight_source(data_args, training_args)
    resume = checkpoint_to_resume(training_args, prog)
    finished = finished_run(training_args, resume)
    if finished is not None:
        if training_args.process_index == 0:
            print(f"{prog}: {finished}", file=sys.stderr)
        return None
    if training_args.torch_threads is not None:
        from longppl.tools.threads import choose_torch_threads

        choose_torch_threads(training_args.torch_threads)
    tokenizer = load_tokenizer(model_args)
    # Rank 0 tokenizes first and fills the datasets cache; the other ranks then read it.
    with training_args.main_process_first(desc="dataset preparation"):
        train_dataset, eval_dataset = load_datasets(
            data_args, tokenizer, model_args.cache_dir, training_args.longce_rule
        )
    model = load_model(model_args, training_args, tokenizer)
    collator = DataCollatorWithFlattening() if data_args.packing else default_data_collator

    trainer = LongCETrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=collator,
        processing_class=tokenizer,
    )
    start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=resume)
    metrics = {**result.metrics, "train_samples": len(train_dataset)}
    if eval_dataset is not None:
        metrics.update(final_evaluation(trainer), eval_samples=len(eval_dataset))
    trainer.save_model()
    trainer.save_state()  # trainer_state.json: the logged losses and LongCE statistics of every step
    if trainer.is_world_process_zero():
        write_results(training_args.output_dir, metrics)
        write_model_card(trainer, model_args, data_args)
        print_summary(
            trainer,
            model_args,
            data_args,
            training_args,
            len(train_dataset),
            result.training_loss,
            time.perf_counter() - start,
            resume,
        )
    return trainer


def checkpoint_to_resume(args: RecipeConfig, prog: str = PROG) -> str | None:
    """The checkpoint folder training resumes from, or ``None`` to train afresh; the rules of run_clm.
    ``prog``: the command's name in its messages.

    - ``resume_from_checkpoint``: that folder; ``last`` (or ``true``): the newest ``checkpoint-*`` of
      ``output_dir`` (none there is a ``ValueError``).
    - otherwise an ``output_dir`` that is missing or empty trains afresh; one holding ``checkpoint-*``
      folders resumes from the newest (a line on stderr says so); any other non-empty one is refused.
    - ``overwrite_output_dir``: train afresh into a non-empty ``output_dir``, unless it holds
      ``checkpoint-*`` folders: refused, since a later ``resume_from_checkpoint last`` would pick the
      earlier run's, and this command deletes nothing it did not write.

    Runs on every process before any of them writes into ``output_dir``, so they all decide alike.
    """
    from transformers.trainer_utils import get_last_checkpoint

    folder, resume = args.output_dir, args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("last", "true"):
        last = get_last_checkpoint(folder) if os.path.isdir(folder) else None
        if last is None:
            raise ValueError(f"resume_from_checkpoint='last' but {folder!r} holds no checkpoint-* folder.")
        return last
    if resume is not None:
        return resume
    if not os.path.isdir(folder) or not os.listdir(folder):
        return None
    last = get_last_checkpoint(folder)
    if args.overwrite_output_dir:
        if last is not None:
            raise ValueError(
                f"overwrite_output_dir trains afresh into output_dir {folder!r}, but it holds the checkpoint "
                f"folders of an earlier run (the newest: {os.path.basename(last)}), which a later "
                f"resume_from_checkpoint 'last' would pick; {prog} deletes nothing it did not write. Move "
                "or delete them, or choose another output_dir."
            )
        return None
    if last is None:
        raise ValueError(
            f"output_dir {folder!r} is not empty and holds no checkpoint-* folder to resume from. Choose a new "
            "or empty output_dir, or add --overwrite_output_dir to train afresh into it (files of the same "
            "names are replaced, others kept)."
        )
    if args.process_index == 0 and finished_run(args, last) is None:  # else train() says it is finished
        print(
            f"{prog}: output_dir {folder!r} holds checkpoints of an earlier run: resuming from "
            f"{os.path.basename(last)} (choose another output_dir to train afresh).",
            file=sys.stderr,
        )
    return last


def finished_run(args: RecipeConfig, resume: str | None) -> str | None:
    """The line saying so when the run to resume has already reached ``max_steps`` (or, with
    ``max_steps`` unset, ``num_train_epochs``); ``None`` when there is training left to do.

    Resuming a finished run would train one step past its end (transformers' resume at the last step)
    and rewrite the model, the checkpoints and ``all_results.json``. The run's progress is the
    checkpoint's ``trainer_state.json`` and, when the checkpoint was found in ``output_dir`` rather than
    named, the ``trainer_state.json`` the finished run wrote there (its last step may lie after its
    last checkpoint). A larger ``max_steps`` / ``num_train_epochs`` resumes and continues.
    """
    if resume is None:
        return None
    states = [os.path.join(resume, "trainer_state.json")]
    if args.resume_from_checkpoint is None or str(args.resume_from_checkpoint).lower() in ("last", "true"):
        states.append(os.path.join(args.output_dir, "trainer_state.json"))
    for path in states:
        try:
            with open(path, encoding="utf-8") as handle:
                state = json.load(handle)
            step, epoch = int(state["global_step"]), float(state.get("epoch") or 0.0)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # no state there (or not one transformers wrote): the trainer decides
        if args.max_steps > 0 and step >= args.max_steps:
            reached = f"step {step} of max_steps {args.max_steps}"
        elif args.max_steps <= 0 and epoch >= args.num_train_epochs - 1e-6:
            reached = f"epoch {epoch:g} of num_train_epochs {args.num_train_epochs:g}"
        else:
            continue
        return (
            f"the run in {args.output_dir!r} is finished ({reached}, {os.path.relpath(path, args.output_dir)}): "
            "nothing to do, nothing written. Raise --max_steps (or --num_train_epochs) to continue it, or choose "
            "another output_dir to train afresh."
        )
    return None


def final_evaluation(trainer: LongCETrainer) -> dict[str, float]:
    """The ``eval_*`` metrics of the final model: the evaluation logged at the last step, or a new one."""
    last = next((entry for entry in reversed(trainer.state.log_history) if "eval_loss" in entry), None)
    if last is None or last.get("step") != trainer.state.global_step:
        return trainer.evaluate()
    return {key: value for key, value in last.items() if key.startswith("eval_")}


def write_results(output_dir: str, metrics: dict[str, float]) -> None:
    """``all_results.json`` in ``output_dir``: ``metrics`` (training's and the final evaluation's), as
    run_clm writes it; replaced whole (an earlier run's keys do not linger), atomically."""
    from longppl.atomic_files import write_file_atomically

    write_file_atomically(
        os.path.join(output_dir, "all_results.json"),
        lambda handle: json.dump(metrics, handle, indent=4, sort_keys=True),
    )


def write_model_card(trainer: LongCETrainer, model_args: ModelArguments, data_args) -> None:
    """``README.md`` in ``output_dir``: transformers' model card (``Trainer.create_model_card``: the
    hyperparameters, the results, the framework versions; a PEFT adapter's metadata kept) with the
    ``MODEL_CARD_TAGS``, and the paper's citation, as TRL's trainers cite theirs."""
    from huggingface_hub import ModelCard

    from longppl.atomic_files import write_file_atomically
    from longppl.metric.compute import CITATION as _CITATION  # the metric's citation: one copy of the paper's BibTeX

    trainer.create_model_card(
        model_name=os.path.basename(os.path.normpath(trainer.args.output_dir)),
        finetuned_from=model_args.model_name_or_path,
        tags=list(MODEL_CARD_TAGS),
        dataset=data_args.dataset_name,
    )
    path = os.path.join(trainer.args.output_dir, "README.md")
    card = ModelCard.load(path)
    # A PEFT adapter's card is rewritten by PEFT after transformers' (create_model_card), with its own tags.
    card.data.tags = list(dict.fromkeys([*MODEL_CARD_TAGS, *(card.data.tags or [])]))
    args = trainer.args
    if args.longce_weights == "cache":  # the cache's own K and d: longce_trunc_len / _sliding_window were not read
        settings = (
            f"gamma = {args.longce_gamma:g} (longce_gamma), weights from 'cache' (longce_weights): an evaluator's "
            f"key-token cache, {os.path.basename(os.path.normpath(data_args.key_tokens or 'key_tokens'))}, scored "
            "with its own K and d"
        )
    else:
        settings = (
            f"K = {args.longce_trunc_len} (longce_trunc_len), d = {args.longce_sliding_window} "
            f"(longce_sliding_window), gamma = {args.longce_gamma:g} (longce_gamma), weights from "
            f"{args.longce_weights!r} (longce_weights)"
        )
    # transformers' first sentence knows neither a model built from model_config nor local data files
    # ("a fine-tuned version of [](https://huggingface.co/) on an unknown dataset"): ours names both.
    text = re.sub(
        r"^This model (is a fine-tuned version of|was trained from scratch on) .*$",
        lambda _: f"This model is {model_card_origin(model_args, data_args)}, trained with LongCE ({settings}).",
        card.text,
        count=1,
        flags=re.M,
    )
    card.text = (
        text.rstrip()
        + "\n\n## Training procedure: LongCE\n\nTrained with the LongCE loss (`longce-train`, `LongCETrainer`): "
        "each token's cross-entropy is weighted by min(exp(LSD), gamma), where LSD is the gain in its "
        "log-probability from the long context (the whole sequence) over a short one (windows of K tokens "
        f"advancing by d): {settings}.\n\n## Citation\n\n```bibtex\n" + _CITATION.strip() + "\n```\n"
    )
    write_file_atomically(path, lambda handle: handle.write(str(card)))


def model_card_origin(model_args: ModelArguments, data_args) -> str:
    """What the model card's first sentence says the model came from: the base model (a Hub id linked,
    a local folder by its name, or a random model of ``model_config``) and the training data (a Hub
    dataset linked, else the local files by name)."""
    base = model_args.model_name_or_path
    if base is None:
        origin = f"a randomly initialised {model_args.model_config['model_type']} model (model_config)"
    elif os.path.isdir(base):
        origin = f"a fine-tuned version of the local model `{os.path.basename(os.path.normpath(base))}`"
    else:
        origin = f"a fine-tuned version of [{base}](https://huggingface.co/{base})"
    if data_args.dataset_name is not None:
        name = data_args.dataset_name
        data = f"the [{name}](https://huggingface.co/datasets/{name}) dataset (split {data_args.dataset_split!r})"
    else:
        data = "the local files " + ", ".join(f"`{os.path.basename(f)}`" for f in data_args.data_files)
    return f"{origin} on {data}"


def print_summary(trainer, model_args, data_args, training_args, sequences, training_loss, seconds, resume) -> None:
    """A few lines on what was trained and how the loss went."""
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.model.parameters())
    global_batch = (
        training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps * training_args.world_size
    )
    model = model_args.model_name_or_path or f"random {model_args.model_config['model_type']}"
    print(
        f"LongCE training done: {model}, context extension {model_args.context_extension}, "
        f"{trainable:,} of {total:,} parameters trained"
    )
    print(
        f"  data: {data_args.source_name}, {sequences} sequences of <= {data_args.max_seq_length} tokens"
        f"{' (packed per document)' if data_args.packing else ''}, global batch {global_batch}"
        f"{f', LongCE weights from {data_args.key_tokens}' if data_args.key_tokens else ''}"
    )
    print(
        f"  steps: {trainer.state.global_step}{f' (resumed from {resume})' if resume else ''} in {seconds:.1f} s; "
        f"mean training loss {training_loss:.4f}"
    )
    if losses:
        print(
            f"  logged loss: first {losses[0]:.4f}, last {losses[-1]:.4f}"
            f"{'' if math.isfinite(losses[-1]) else ' (not finite!)'}"
        )
    evaluations = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    if evaluations:
        last = evaluations[-1]
        print(
            f"  evaluation: {len(evaluations)} run(s); at step {last['step']} eval_loss {last['eval_loss']:.4f}"
            + (f", eval_ce_loss {last['eval_ce_loss']:.4f}" if "eval_ce_loss" in last else "")
            + (f", eval_perplexity {last['eval_perplexity']:.2f}" if "eval_perplexity" in last else "")
        )
    print(f"  saved to {training_args.output_dir}")


if __name__ == "__main__":  # `python -m longce.cli` (e.g. under `accelerate launch -m longce.cli`)
    sys.exit(main())
