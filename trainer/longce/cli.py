"""``longce-train``: fine-tune a causal LM with LongCE (``LongCETrainer``) from a YAML recipe.

    longce-train --config configs/tiny_cpu.yaml               # CPU, seconds
    longce-train --config configs/tiny_cpu.yaml --learning_rate 1e-4 --max_steps 10
    accelerate launch --config_file <accelerate.yaml> -m longce.cli \\
        --config configs/setting_a_pg19_eabf.yaml             # the paper's setting A

(``python scripts/train_longce.py`` is the same command.) The script over one parser, as TRL's
``sft.py``: ``longce.arguments.parse_args`` reads ``ModelArguments``, ``DataArguments`` and
``RecipeConfig`` (``LongCEConfig`` plus the command's own fields) from the recipe and the command line
(``--help`` lists the model, data and LongCE fields, ``--help-all`` every field); ``longce.data`` makes
the sequences, ``longce.models`` the model, ``longce.run_folder`` decides what to resume (run_clm's
rules: checkpoints in ``output_dir`` are resumed from, nothing in it is deleted, a finished run is left
as it is) and ``longce.results`` writes ``all_results.json``, the model card and the summary.

A bad input ends the command with one ``<prog>: error: ...`` line (``longppl.commandline.running.run_command``;
``LONGPPL_DEBUG=1`` shows the traceback), ``<prog>`` being the name it was started by. What needs no
torch is checked before torch is imported (``longce.recipes.check_before_loading``).
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from longppl.commandline.running import run_command

# Nothing here imports torch at import time (transformers' TrainingArguments does): the command checks
# what it can first (recipes.check_before_loading); `longce.arguments` and the trainer load after that.
from .models import load_model
from .recipes import PROG, check_before_loading
from .results import final_evaluation, model_card_origin, print_summary, write_model_card, write_results
from .run_folder import checkpoint_to_resume, finished_run

if TYPE_CHECKING:
    from .trainer import LongCETrainer

__all__ = ["checkpoint_to_resume", "finished_run", "load_model", "main", "model_card_origin", "train"]


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

    With evaluation data, ``eval_strategy`` steps/epoch evaluates during training, and the final model
    is evaluated once more unless the last of those ran at the last step; with ``eval_strategy`` no,
    once after training.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    check_before_loading(argv, prog)
    from .arguments import parse_args
    from .script_arguments import check_combination

    model_args, data_args, training_args = parse_args(argv, prog)
    check_combination(data_args, training_args)
    # After parsing: `--help` and argument errors come without datasets and the trainer.
    from transformers import DataCollatorWithFlattening, default_data_collator

    from .data import load_datasets, load_tokenizer
    from .trainer import LongCETrainer

    resume = checkpoint_to_resume(training_args, prog)
    finished = finished_run(training_args, resume)
    if finished is not None:
        if training_args.process_index == 0:
            print(f"{prog}: {finished}", file=sys.stderr)
        return None
    if training_args.torch_threads is not None:
        from longppl.commandline.threads import choose_torch_threads

        choose_torch_threads(training_args.torch_threads)
    tokenizer = load_tokenizer(model_args)
    # Rank 0 tokenizes first and fills the datasets cache; the other ranks then read it.
    with training_args.main_process_first(desc="dataset preparation"):
        train_dataset, eval_dataset = load_datasets(
            data_args, tokenizer, model_args.cache_dir, training_args.longce_rule
        )
    trainer = LongCETrainer(
        model=load_model(model_args, training_args, tokenizer),
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=DataCollatorWithFlattening() if data_args.packing else default_data_collator,
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
        seconds = time.perf_counter() - start
        print_summary(
            trainer, model_args, data_args, training_args, len(train_dataset), result.training_loss, seconds, resume
        )
    return trainer


if __name__ == "__main__":  # `python -m longce.cli` (e.g. under `accelerate launch -m longce.cli`)
    sys.exit(main())
