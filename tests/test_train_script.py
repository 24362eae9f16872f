"""longce-train (longce.cli; scripts/train_longce.py runs it from a checkout): the tiny recipe trains,
overrides, checkpoints/resumes, LoRA, packing, bad inputs, evaluation data, renamed fields, torch
threads. Its help, its one-line errors and its output folder: test_train_command.py."""

from __future__ import annotations

import json
import math
import os
import sys
import warnings

import pytest
import torch
import yaml
from helpers import DATA, REPO, TINY, one_torch_thread, read_recipe, run_guarded, tiny_argv
from safetensors.torch import load_file

from longce import LongCETrainer, apply_context_extension, cli
from longce.arguments import parse_args
from longce.data import build_train_dataset, byte_level_tokenizer, load_datasets, load_text_dataset, load_tokenizer
from longce.documents import batch_documents


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


def logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


# ------------------------------------------------------------------ (a) the tiny recipe


def test_tiny_recipe_trains_and_loss_decreases(tmp_path):
    trainer = cli.train(tiny_argv(tmp_path))
    recipe = read_recipe()
    assert trainer.state.global_step == recipe["max_steps"]
    losses = logged(trainer, "loss")
    assert len(losses) == recipe["max_steps"] // recipe["logging_steps"]
    # Random init starts near ln(259) = 5.56; a byte model learns letter frequencies fast.
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.0, losses
    # LongCE's own statistics are logged, and the short-context windows really ran: some weights
    # differ from 1 (tokens before K + d in their block keep weight exactly 1).
    shares = logged(trainer, "longce_weight_gt1_share")
    assert len(shares) == len(losses) and len(logged(trainer, "longce_mean_weight")) == len(losses)
    assert 0 < min(shares) and max(shares) < 1
    assert max(logged(trainer, "longce_max_weight")) <= recipe["longce_gamma"]
    out = tmp_path / "run"
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert (out / f"checkpoint-{recipe['max_steps']}" / "trainer_state.json").is_file()
    # EABF was applied to the built model (context_extension: eabf in the recipe).
    assert trainer.model.config._attn_implementation == "longce_eabf"
    assert trainer.model.config.rope_parameters["rope_theta"] == 500000.0


@pytest.mark.slow
def test_script_runs_as_a_command(tmp_path):
    """End to end in a fresh interpreter, from the repository root, as the README would run it."""
    argv = [
        sys.executable,
        "scripts/train_longce.py",
        "--config",
        "configs/tiny_cpu.yaml",
        "--output_dir",
        str(tmp_path / "out"),
        "--cache_dir",
        str(tmp_path / "cache"),
        "--max_steps",
        "4",
        "--logging_steps",
        "2",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = run_guarded(argv, cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LongCE training done" in done.stdout and "steps: 4" in done.stdout, done.stdout
    assert (tmp_path / "out" / "model.safetensors").is_file()


# ------------------------------------------------------------------ (b) command-line overrides


def test_command_line_overrides_yaml_fields(tmp_path):
    model_config = {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 256,
    }
    model_args, data_args, args = parse_args(
        tiny_argv(
            tmp_path,
            "--learning_rate",
            "1e-4",
            "--longce_trunc_len",
            "8",
            "--max_seq_length",
            "64",
            "--model_config",
            json.dumps(model_config),
            "--packing",
            "true",
            "--lora_target_modules",
            "q_proj",
            "o_proj",
        )
    )
    assert args.learning_rate == 1e-4 and args.longce_trunc_len == 8 and data_args.max_seq_length == 64
    assert model_args.model_config == model_config and data_args.packing is True
    assert model_args.lora_target_modules == ["q_proj", "o_proj"]
    # Fields not overridden keep the recipe's values, converted to the field types.
    assert args.adam_beta2 == 0.95 and args.longce_sliding_window == 16 and model_args.eabf_base_length == 64
    assert data_args.data_files == [DATA]

    # ... and the overrides reach training: a constant learning rate shows in the log.
    trainer = cli.train(
        tiny_argv(
            tmp_path,
            "--max_steps",
            "3",
            "--logging_steps",
            "1",
            "--learning_rate",
            "1e-4",
            "--lr_scheduler_type",
            "constant",
            "--warmup_steps",
            "0",
            "--save_strategy",
            "no",
        )
    )
    assert trainer.state.global_step == 3
    assert logged(trainer, "learning_rate") == [pytest.approx(1e-4)] * 3


def test_a_model_source_on_the_command_line_replaces_the_recipes(tmp_path):
    from helpers import byte_level_bpe, tiny_model

    tokenizer = byte_level_bpe()
    tiny_model("llama", len(tokenizer), max_positions=256).save_pretrained(tmp_path / "mine")
    tokenizer.save_pretrained(tmp_path / "mine")
    model_args, _, _ = parse_args(tiny_argv(tmp_path, "--model_name_or_path", str(tmp_path / "mine")))
    # the recipe's model_config and its byte-level tokenizer give way: the model's own tokenizer is used
    assert model_args.model_name_or_path == str(tmp_path / "mine")
    assert model_args.model_config is None and model_args.tokenizer_name_or_path is None
    assert model_args.context_extension == "eabf"  # the rest of the recipe stays
    trainer = cli.train(
        tiny_argv(tmp_path, "--model_name_or_path", str(tmp_path / "mine"), "--max_steps", "1", "--save_strategy", "no")
    )
    assert trainer.state.global_step == 1 and len(trainer.processing_class) == len(tokenizer)
    # and the reverse: a recipe's pretrained model gives way to --model_config
    recipe = write_recipe(tmp_path, {"model_name_or_path": str(tmp_path / "mine")}, drop=("model_config",))
    model_config = json.dumps(read_recipe()["model_config"])
    model_args, _, _ = parse_args(["--config", recipe, "--model_config", model_config])
    assert model_args.model_name_or_path is None and model_args.model_config == read_recipe()["model_config"]
    assert model_args.tokenizer_name_or_path == "byte-level"
    # a Hub dataset on the command line replaces the recipe's data files
    _, data_args, _ = parse_args(["--config", TINY, "--dataset_name", "some/dataset"])
    assert data_args.dataset_name == "some/dataset" and data_args.data_files is None


def test_run_clm_and_trl_names_of_the_data_fields(tmp_path):
    argv = ["--config", TINY, "--train_file", DATA, "--validation_file", DATA, "--block_size", "64"]
    _, data_args, _ = parse_args([*argv, "--dataset_text_field", "body"])
    assert data_args.data_files == [DATA] and data_args.eval_data_files == [DATA]
    assert data_args.max_seq_length == 64 and data_args.text_column == "body"
    recipe = write_recipe(
        tmp_path, {"train_file": "../data.jsonl", "block_size": 32}, drop=("data_files", "max_seq_length")
    )
    _, data_args, _ = parse_args(["--config", recipe])
    assert data_args.data_files == [str(tmp_path.parent / "data.jsonl")] and data_args.max_seq_length == 32
    with pytest.raises(ValueError, match="max_seq_length=64 and block_size=32 are two names of one setting"):
        parse_args(["--config", TINY, "--max_seq_length", "64", "--block_size", "32"])


# ------------------------------------------------------------------ (c) checkpoint and resume


def test_checkpoint_then_resume_continues_where_it_stopped(tmp_path, monkeypatch):
    common = ("--lr_scheduler_type", "constant", "--warmup_steps", "0", "--logging_steps", "2")
    straight = cli.train(tiny_argv(tmp_path, *common, "--max_steps", "8", "--save_strategy", "no", subdir="straight"))
    first = cli.train(tiny_argv(tmp_path, *common, "--max_steps", "4", "--save_steps", "4", subdir="resumed"))
    checkpoint = tmp_path / "resumed" / "checkpoint-4"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 4
    assert first.state.global_step == 4

    calls = []
    compute_loss = LongCETrainer.compute_loss
    monkeypatch.setattr(
        LongCETrainer, "compute_loss", lambda self, *a, **k: calls.append(1) or compute_loss(self, *a, **k)
    )
    resumed = cli.train(
        tiny_argv(
            tmp_path,
            *common,
            "--max_steps",
            "8",
            "--save_steps",
            "4",
            "--resume_from_checkpoint",
            "last",
            subdir="resumed",
        )
    )
    assert len(calls) == 4  # steps 5..8 only
    assert resumed.state.global_step == 8
    state = json.loads((tmp_path / "resumed" / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["global_step"] == 8
    # The history of the first run came back with the checkpoint, and training went on from step 4.
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [2, 4, 6, 8]
    # Optimizer, scheduler, RNG and data position were restored: same result as never stopping.
    assert logged(resumed, "loss") == pytest.approx(logged(straight, "loss"), rel=1e-5)
    a = load_file(str(tmp_path / "straight" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


# ------------------------------------------------------------------ (d) LoRA


def test_lora_trains_only_the_adapter(tmp_path, monkeypatch):
    before = {}
    train = LongCETrainer.train

    def snapshot_then_train(self, *args, **kwargs):
        before.update({k: v.detach().clone() for k, v in self.model.named_parameters()})
        return train(self, *args, **kwargs)

    monkeypatch.setattr(LongCETrainer, "train", snapshot_then_train)
    trainer = cli.train(
        tiny_argv(
            tmp_path,
            "--lora_r",
            "4",
            "--lora_alpha",
            "8",
            "--lora_target_modules",
            "q_proj",
            "v_proj",
            "--max_steps",
            "4",
            "--learning_rate",
            "1e-2",
            "--save_strategy",
            "no",
            "--gradient_checkpointing",
            "true",
        )
    )
    params = dict(trainer.model.named_parameters())
    adapter = {k for k in params if "lora_A" in k or "lora_B" in k}
    assert len(adapter) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
    assert {k for k, p in params.items() if p.requires_grad} == adapter
    for name, param in params.items():
        if name in adapter:
            assert not torch.equal(param, before[name]), f"{name} did not train"
        else:
            assert torch.equal(param, before[name]), f"frozen {name} changed"
    assert trainer.model.base_model.model.model.layers[0].gradient_checkpointing  # LoRA under checkpointing
    assert (tmp_path / "run" / "adapter_model.safetensors").is_file()


# ------------------------------------------------------------------ (e) packing


def test_packing_keeps_documents_apart(tmp_path):
    # Each document is one repeated letter, so any token's document is readable from its value.
    lengths = [300, 40, 90, 130, 10, 200]
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": chr(ord("a") + i) * n}) + "\n" for i, n in enumerate(lengths)))
    trainer = cli.train(
        tiny_argv(
            tmp_path,
            "--data_files",
            str(docs),
            "--packing",
            "true",
            "--per_device_train_batch_size",
            "3",
            "--max_steps",
            "2",
            "--logging_steps",
            "1",
            "--train_sampling_strategy",
            "sequential",
            "--save_strategy",
            "no",
        )
    )
    bos, eos, length = 256, 257, 128
    # Each document (<s> + bytes + </s>) is cut into pieces of <= max_seq_length, in order.
    expected = []
    for i, n in enumerate(lengths):
        tokens = [bos] + [ord("a") + i] * n + [eos]
        expected += [tokens[j : j + length] for j in range(0, len(tokens), length)]
    assert trainer.train_dataset["input_ids"] == expected

    batch = next(iter(trainer.get_train_dataloader()))
    ids, positions, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
    assert ids.shape[0] == 1 and positions.shape == ids.shape  # one flattened row
    pieces = expected[:3]
    assert ids[0].tolist() == sum(pieces, [])
    assert positions[0].tolist() == sum([list(range(len(p))) for p in pieces], [])
    starts = [sum(len(p) for p in pieces[:k]) for k in range(len(pieces))]
    assert [int(i) for i in (positions[0] == 0).nonzero()] == starts
    assert all(labels[0, s] == -100 for s in starts)  # no piece predicts its neighbour's first token
    # LongCE sees the same documents, and the short-context windows ran inside them.
    spans = batch_documents(ids, None, positions)
    assert [(s.start, s.end) for s in spans] == [(s, s + len(p)) for s, p in zip(starts, pieces)]
    assert len(logged(trainer, "loss")) == 2 and max(logged(trainer, "longce_weight_gt1_share")) > 0


# ------------------------------------------------------------------ the paper's recipes


@pytest.mark.parametrize(
    "name, dataset, method, global_batch",
    [
        ("setting_a_pg19_eabf", "emozilla/pg19", "eabf", 64),
        ("setting_b_pg19_pi", "emozilla/pg19", "pi", 64),
        ("setting_c_arxiv_eabf", "timaeus/pile-arxiv", "eabf", 8),
    ],
)
def test_paper_recipes_hold_the_paper_settings(name, dataset, method, global_batch):
    """App. A.2 and Sec. 4.2: Llama-2-7B, 32k tokens, K=4096, d=1024, gamma=5, lr 2e-5, no weight
    decay, 20 warmup steps, AdamW (0.9, 0.95), 200 steps, global batch 64 (PG-19) / 8 (arxiv) on 8 GPUs."""
    # bf16 needs a GPU; everything else parses as on the paper's machines.
    model_args, data_args, args = parse_args(
        ["--config", os.path.join(REPO, "configs", f"{name}.yaml"), "--bf16", "false"]
    )
    assert model_args.model_name_or_path == "meta-llama/Llama-2-7b-hf" and model_args.lora_r == 0
    assert data_args.dataset_name == dataset and data_args.max_seq_length == 32768
    assert (args.longce_trunc_len, args.longce_sliding_window, args.longce_gamma) == (4096, 1024, 5.0)
    assert (args.learning_rate, args.weight_decay, args.warmup_steps) == (2e-5, 0.0, 20)
    assert (args.adam_beta1, args.adam_beta2, args.max_steps) == (0.9, 0.95, 200)
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps * 8 == global_batch
    assert args.activation_checkpointing and args.gradient_checkpointing and not args.longce_plain_ce
    assert args.activation_checkpointing_kwargs == args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert read_recipe(os.path.join(REPO, "configs", f"{name}.yaml"))["bf16"] is True
    # The context extension the script applies to Llama-2's config (4096 positions, base 10000).
    from transformers import LlamaConfig

    config = LlamaConfig(max_position_embeddings=4096, rope_theta=10000.0)
    attn = apply_context_extension(
        config,
        model_args.context_extension,
        factor=model_args.rope_factor,
        rope_theta=model_args.rope_theta,
        eabf_base_length=model_args.eabf_base_length,
    )
    if method == "pi":
        assert config.rope_parameters["rope_type"] == "linear" and config.rope_parameters["factor"] == 8.0
        assert attn is None
    else:
        assert config.rope_parameters["rope_theta"] == 500000.0 and model_args.eabf_base_length == 4096
        assert attn == "longce_eabf"


# ------------------------------------------------------------------ (f) bad inputs


def write_recipe(tmp_path, changes: dict, drop: tuple[str, ...] = ()) -> str:
    recipe = read_recipe()
    recipe.update(data_files=DATA, output_dir=str(tmp_path / "out"), cache_dir=str(tmp_path / "cache"))
    recipe.update(changes)
    for key in drop:
        recipe.pop(key)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def write_jsonl(tmp_path, rows: list[dict]) -> str:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"Config file .*nope\.yaml.* not found"):
        cli.train(["--config", str(tmp_path / "nope.yaml")])


def test_config_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- learning_rate: 1.0e-4\n- max_steps: 3\n")
    with pytest.raises(ValueError, match="must hold a YAML mapping of field: value, got a list"):
        cli.train(["--config", str(path)])


def test_unknown_yaml_key(tmp_path):
    with pytest.raises(ValueError, match=r"Unknown field\(s\) \['learnin_rate', 'lora_rank'\]"):
        cli.train(["--config", write_recipe(tmp_path, {"learnin_rate": 1e-4, "lora_rank": 8})])


def test_neither_model_source(tmp_path):
    with pytest.raises(ValueError, match="exactly one of model_name_or_path .* neither is set"):
        cli.train(["--config", write_recipe(tmp_path, {}, drop=("model_config",))])


def test_both_model_sources(tmp_path):
    with pytest.raises(ValueError, match="exactly one of model_name_or_path .* both are set"):
        cli.train(["--config", write_recipe(tmp_path, {"model_name_or_path": "some/model"})])


def test_model_config_without_model_type(tmp_path):
    with pytest.raises(ValueError, match="model_config must be a mapping with a 'model_type' key"):
        cli.train(["--config", write_recipe(tmp_path, {"model_config": {"hidden_size": 64}})])


def test_no_dataset(tmp_path):
    with pytest.raises(ValueError, match="exactly one of dataset_name .* and data_files .* neither is set"):
        cli.train(["--config", write_recipe(tmp_path, {}, drop=("data_files",))])


def test_no_max_seq_length(tmp_path):
    with pytest.raises(ValueError, match="max_seq_length must be an integer >= 2"):
        cli.train(["--config", write_recipe(tmp_path, {}, drop=("max_seq_length",))])


def test_missing_data_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data_files: .*absent\.jsonl.* not found"):
        cli.train(["--config", write_recipe(tmp_path, {"data_files": str(tmp_path / "absent.jsonl")})])


def test_unsupported_data_file_extension(tmp_path):
    path = tmp_path / "docs.xml"
    path.write_text("<doc/>")
    with pytest.raises(ValueError, match=r"unsupported extension; use one of \['.csv'"):
        cli.train(["--config", write_recipe(tmp_path, {"data_files": str(path)})])


def test_text_column_missing_names_the_columns(tmp_path):
    data = write_jsonl(tmp_path, [{"id": 1, "body": "some text"}, {"id": 2, "body": "more"}])
    with pytest.raises(ValueError, match=r"Text column 'text' not found .* its columns are \['id', 'body'\]"):
        cli.train(["--config", write_recipe(tmp_path, {"data_files": data})])


def test_non_string_text_column(tmp_path):
    data = write_jsonl(tmp_path, [{"text": 12}, {"text": 13}])
    with pytest.raises(ValueError, match=r"Text column 'text' .* holds Value\('int64'\).*, not strings"):
        cli.train(["--config", write_recipe(tmp_path, {"data_files": data})])


def test_null_text_row(tmp_path):
    data = write_jsonl(tmp_path, [{"text": "a document"}, {"text": None}])
    with pytest.raises(ValueError, match="Row 1 of .* has None in text column 'text'"):
        cli.train(["--config", write_recipe(tmp_path, {"data_files": data})])


def test_too_little_text(tmp_path):
    data = write_jsonl(tmp_path, [{"text": "short"}])
    with pytest.raises(ValueError, match="gives no training sequence: 7 tokens in all, fewer than max_seq_length=128"):
        cli.train(["--config", write_recipe(tmp_path, {"data_files": data})])


def test_resume_last_without_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="resume_from_checkpoint='last' but .* holds no checkpoint"):
        cli.train(["--config", write_recipe(tmp_path, {"resume_from_checkpoint": "last"})])


# ------------------------------------------------------------------ (g) evaluation data


def plain_mean_nll(model, sequences) -> float:
    """Mean next-token NLL of ``sequences`` (lists of ids, labels = inputs) from the model's own logits."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in sequences:
            ids = torch.tensor(ids)[None]
            logits = model(input_ids=ids).logits[0, :-1].float()
            total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    return total / count


def test_eval_strategy_steps_evaluates_a_held_out_share(tmp_path):
    trainer = cli.train(
        tiny_argv(
            tmp_path,
            "--validation_split_percentage",
            "20",
            "--eval_strategy",
            "steps",
            "--eval_steps",
            "2",
            "--max_steps",
            "4",
            "--logging_steps",
            "2",
            "--save_strategy",
            "no",
            "--max_eval_samples",
            "6",
            "--per_device_eval_batch_size",
            "3",
        )
    )
    evaluations = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    assert [entry["step"] for entry in evaluations] == [2, 4]
    for entry in evaluations:
        assert {
            "eval_ce_loss",
            "eval_longce_mean_weight",
            "eval_longce_weight_gt1_share",
            "eval_longce_max_weight",
        } <= set(entry)
        assert entry["eval_loss"] > 0 and 0 < entry["eval_longce_weight_gt1_share"] < 1
    # Held out: the first 20% of the 13 documents (3, rounded), processed like the training data.
    _, data_args, _ = parse_args(tiny_argv(tmp_path))
    raw = load_text_dataset(data_args)
    tokenizer = load_tokenizer(parse_args(tiny_argv(tmp_path))[0])
    expected_eval = build_train_dataset(raw.select(range(3)), tokenizer, data_args)["input_ids"][:6]
    expected_train = build_train_dataset(raw.select(range(3, len(raw))), tokenizer, data_args)
    assert trainer.eval_dataset["input_ids"] == expected_eval
    assert trainer.train_dataset["input_ids"] == expected_train["input_ids"][:512]
    # The last evaluation ran on the final model: its unweighted CE is the plain mean NLL of those sequences.
    assert evaluations[-1]["eval_ce_loss"] == pytest.approx(plain_mean_nll(trainer.model, expected_eval), rel=1e-4)


def test_eval_data_files_are_evaluated_after_training_without_eval_strategy(tmp_path, capsys):
    texts = [json.loads(line)["text"] for line in open(DATA, encoding="utf-8")][-2:]
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    trainer = cli.train(
        tiny_argv(
            tmp_path,
            "--eval_data_files",
            str(held_out),
            "--max_eval_samples",
            "4",
            "--max_steps",
            "2",
            "--save_strategy",
            "no",
        )
    )
    evaluations = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    assert len(evaluations) == 1 and evaluations[0]["step"] == 2 and "eval_ce_loss" in evaluations[0]
    tokenizer = byte_level_tokenizer()
    tokens = [t for text in texts for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    assert trainer.eval_dataset["input_ids"] == [tokens[i : i + 128] for i in range(0, 4 * 128, 128)]
    summary = capsys.readouterr().out
    assert "evaluation: 1 run(s); at step 2 eval_loss" in summary
    assert f"eval_perplexity {math.exp(evaluations[0]['eval_ce_loss']):.2f}" in summary  # plain CE's perplexity


def test_eval_split_of_the_training_files_equals_the_percentage_split(tmp_path):
    tokenizer = byte_level_tokenizer()
    _, by_split, _ = parse_args(tiny_argv(tmp_path, "--dataset_split", "train[3:]", "--eval_split", "train[:3]"))
    _, by_share, _ = parse_args(tiny_argv(tmp_path, "--validation_split_percentage", "20"))
    train_a, eval_a = load_datasets(by_split, tokenizer)
    train_b, eval_b = load_datasets(by_share, tokenizer)
    assert eval_a["input_ids"] == eval_b["input_ids"] and len(eval_a) > 0
    assert train_a["input_ids"] == train_b["input_ids"]


@pytest.mark.parametrize(
    "extra, error, message",
    [
        (
            ("--eval_strategy", "steps"),
            ValueError,
            "eval_strategy='steps' needs evaluation data: set eval_data_files .*, eval_split .* or validation_split_percentage",
        ),
        (
            ("--validation_split_percentage", "10", "--eval_split", "validation"),
            ValueError,
            "validation_split_percentage .* cannot be combined with eval_data_files or eval_split",
        ),
        (
            ("--validation_split_percentage", "100"),
            ValueError,
            r"validation_split_percentage must be between 0 and 100 \(exclusive\), got 100",
        ),
        (
            ("--validation_split_percentage", "1"),
            ValueError,
            "validation_split_percentage=1.0 of the 13 documents of .* leaves no evaluation document",
        ),
        (
            ("--eval_data_files", "/nonexistent/held_out.jsonl"),
            FileNotFoundError,
            r"eval_data_files: '/nonexistent/held_out\.jsonl' not found",
        ),
        (
            ("--max_eval_samples", "0", "--eval_split", "train"),
            ValueError,
            "max_eval_samples must be >= 1 or unset, got 0",
        ),
    ],
)
def test_bad_evaluation_settings(tmp_path, extra, error, message):
    with pytest.raises(error, match=message):
        cli.train(tiny_argv(tmp_path, *extra))


def test_too_little_evaluation_text(tmp_path):
    data = write_jsonl(tmp_path, [{"text": "short"}])
    with pytest.raises(ValueError, match="gives no evaluation sequence: 7 tokens in all, fewer than max_seq_length"):
        cli.train(tiny_argv(tmp_path, "--eval_data_files", data))


# ------------------------------------------------------------------ (h) renamed fields: dtype, activation_checkpointing


def test_dtype_and_torch_dtype_are_one_field(tmp_path):
    model_args, _, args = parse_args(tiny_argv(tmp_path, "--dtype", "bfloat16"))
    assert model_args.dtype == model_args.torch_dtype == "bfloat16"  # the recipe's torch_dtype: float32 is overridden
    model = cli.load_model(model_args, args, byte_level_tokenizer())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    model_args, _, _ = parse_args(tiny_argv(tmp_path, "--torch_dtype", "float16"))
    assert model_args.dtype == model_args.torch_dtype == "float16"
    model_args, _, _ = parse_args(tiny_argv(tmp_path, "--dtype", "float32", "--torch_dtype", "float32"))
    assert model_args.dtype == "float32"
    with pytest.raises(ValueError, match="dtype='bfloat16' and torch_dtype='float16' are two names of one setting"):
        parse_args(tiny_argv(tmp_path, "--dtype", "bfloat16", "--torch_dtype", "float16"))
    recipe = write_recipe(tmp_path, {"dtype": "bfloat16"})  # the tiny recipe also has torch_dtype: float32
    with pytest.raises(ValueError, match=r"sets dtype: 'bfloat16' and torch_dtype: 'float32', two names of one field"):
        parse_args(["--config", recipe])
    model_args, _, _ = parse_args(["--config", write_recipe(tmp_path, {"dtype": "bfloat16"}, drop=("torch_dtype",))])
    assert model_args.dtype == model_args.torch_dtype == "bfloat16"


def test_the_deprecated_plain_ce_flag_still_trains_plain_ce_and_names_its_replacement(tmp_path):
    with pytest.warns(FutureWarning, match=r"longce_plain_ce is deprecated.*--longce_weights none"):
        _, _, args = parse_args(tiny_argv(tmp_path, "--longce_plain_ce", "true"))
    assert args.longce_weights == "none"
    _, _, replacement = parse_args(tiny_argv(tmp_path, "--longce_weights", "none"))
    assert replacement.longce_weights == "none" and not replacement.longce_plain_ce


def test_either_checkpointing_name_in_recipe_or_command_line(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, args = parse_args(tiny_argv(tmp_path, "--gradient_checkpointing", "true"))
        _, _, from_recipe = parse_args(
            [
                "--config",
                write_recipe(
                    tmp_path,
                    {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"use_reentrant": False}},
                ),
            ]
        )
    assert not [str(w.message) for w in caught if "checkpointing" in str(w.message)]
    assert args.activation_checkpointing is True and args.gradient_checkpointing is True
    assert from_recipe.gradient_checkpointing is True
    assert from_recipe.gradient_checkpointing_kwargs == {"use_reentrant": False}
    # The command line overrides the recipe under either name (and either spelling).
    for flag in ("--gradient_checkpointing", "--gradient-checkpointing=false", "--activation_checkpointing"):
        argv = ["--config", write_recipe(tmp_path, {"activation_checkpointing": True}), flag]
        _, _, off = parse_args(argv if "=" in flag else argv + ["false"])
        assert off.activation_checkpointing is False and off.gradient_checkpointing is False, flag
    with pytest.raises(ValueError, match="activation_checkpointing: True and gradient_checkpointing: False, two names"):
        parse_args(
            ["--config", write_recipe(tmp_path, {"activation_checkpointing": True, "gradient_checkpointing": False})]
        )


# ------------------------------------------------------------------ (k) torch threads from the recipe


def test_the_tiny_recipe_trains_on_one_thread_unless_omp_num_threads_says(tmp_path, monkeypatch):
    assert read_recipe()["torch_threads"] == 1
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)  # torch's default on a two-core machine
    cli.train(tiny_argv(tmp_path, "--max_steps", "1", "--save_strategy", "no"))
    assert torch.get_num_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice wins over the recipe's
    torch.set_num_threads(1)
    _, _, args = parse_args(tiny_argv(tmp_path))
    from longppl.commandline.threads import choose_torch_threads

    assert args.torch_threads == 1 and choose_torch_threads(args.torch_threads) == 2
