"""Worker of test_longce_ddp.py: ``scripts/train_longce.py`` with its forward passes counted.

    python tests/ddp_longce_worker.py REPORT.json [train_longce.py arguments...]

(or under ``accelerate launch``): trains through the script's ``main`` and writes, per process,
``REPORT.json.rank<R>`` = ``{"rank", "world_size", "forwards", "own_window_passes", "steps",
"log_history"}``. ``forwards`` counts every call of the inner transformer (gradient pass, short-
context window passes and idle passes); ``own_window_passes`` the short-context passes this
process's own documents need.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "scripts"))

import train_longce  # noqa: E402

from longce import LongCETrainer  # noqa: E402
from longce.documents import batch_documents, count_window_passes  # noqa: E402


def run(report: str, argv: list[str]) -> LongCETrainer:
    """Train with ``argv`` while counting forwards; write this process's report; undo the patches."""
    counts = {"forwards": 0, "own_window_passes": 0, "steps": 0}
    short_pass, load_model = LongCETrainer._short_context_pass, train_longce.load_model

    def counting_short_pass(self, model, head, inputs):
        documents = batch_documents(inputs["input_ids"], inputs.get("attention_mask"), inputs.get("position_ids"))
        counts["own_window_passes"] += count_window_passes(
            inputs["input_ids"].cpu(),
            documents,
            self.longce.trunc_len,
            self.longce.sliding_window,
            self.longce.max_tokens_per_batch,
        )
        counts["steps"] += 1
        return short_pass(self, model, head, inputs)

    def counting_load_model(*args, **kwargs):
        model = load_model(*args, **kwargs)
        # The decoder stack runs once per forward of the LM, whatever wraps it (DDP, PEFT).
        model.get_decoder().register_forward_pre_hook(
            lambda module, inputs: counts.__setitem__("forwards", counts["forwards"] + 1)
        )
        return model

    LongCETrainer._short_context_pass = counting_short_pass
    train_longce.load_model = counting_load_model
    try:
        trainer = train_longce.main(argv)
    finally:
        LongCETrainer._short_context_pass, train_longce.load_model = short_pass, load_model
    rank = trainer.args.process_index
    with open(f"{report}.rank{rank}", "w", encoding="utf-8") as handle:
        json.dump(
            {"rank": rank, "world_size": trainer.args.world_size, **counts, "log_history": trainer.state.log_history},
            handle,
        )
    return trainer


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2:])
