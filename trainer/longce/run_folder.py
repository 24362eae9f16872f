"""The run folder of ``longce-train``: which checkpoint a run resumes from, and whether it is finished.

The rules are transformers' run_clm's (``checkpoint_to_resume``), plus a finished run left as it is
(``finished_run``); nothing in ``output_dir`` is ever deleted.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING

from .recipes import PROG

if TYPE_CHECKING:
    from .script_arguments import RecipeConfig


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
