"""Worker of test_longce_ddp.py: ``longce-train`` with its forward passes counted.

    python tests/distributed/ddp_longce_worker.py REPORT.json [longce-train arguments...]

(or under ``accelerate launch``): trains through ``longce.cli.train`` and writes, per process,
``REPORT.json.rank<R>`` = ``{"rank", "world_size", "forwards", "own_window_passes", "steps",
"log_history"}``. ``forwards`` counts every call of the inner transformer (gradient pass, short-
context window passes and idle passes); ``own_window_passes`` the short-context passes this
process's own documents need.
"""

from __future__ import annotations

import json
import sys

from longce import LongCETrainer, cli
from longce.documents import batch_documents, count_window_passes


def run(report: str, argv: list[str]) -> LongCETrainer:
    """Train with ``argv`` while counting forwards; write this process's report; undo the patches."""
    counts = {"forwards": 0, "own_window_passes": 0, "steps": 0}
    short_pass, load_model = LongCETrainer._short_context_pass, cli.load_model

    def counting_short_pass(self, model, head, inputs):
        documents = batch_documents(inputs["input_ids"], inputs.get("attention_mask"), inputs.get("position_ids"))
        counts["own_window_passes"] += count_window_passes(
            inputs["input_ids"].cpu(),
            documents,
            self.args.longce_window,
            self.args.longce_max_tokens_per_batch,
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
    cli.load_model = counting_load_model  # what cli.train calls
    try:
        trainer = cli.train(argv)
    finally:
        LongCETrainer._short_context_pass, cli.load_model = short_pass, load_model
    rank = trainer.args.process_index
    with open(f"{report}.rank{rank}", "w", encoding="utf-8") as handle:
        json.dump(
            {"rank": rank, "world_size": trainer.args.world_size, **counts, "log_history": trainer.state.log_history},
            handle,
        )
    return trainer


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2:])
    cli.close_process_group()
