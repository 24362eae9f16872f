"""What ``longce-train`` leaves behind a run: ``all_results.json``, the model card and a summary on stdout.

The model card is transformers' (``Trainer.create_model_card``) tagged ``MODEL_CARD_TAGS``, with the
LongCE settings and the paper's citation.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .script_arguments import ModelArguments
    from .trainer import LongCETrainer

#: Tags of the model card (besides those transformers adds); the hub finds LongCE models by them.
MODEL_CARD_TAGS = ("longce", "long-context")


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
