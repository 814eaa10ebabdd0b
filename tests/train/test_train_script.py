"""scripts/train_default.py: a tiny CPU run writes a checkpoint that ``dayzero.LLM`` loads and generates from;
bad options stop it before anything is built, with the option named."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dayzero import LLM, SamplingParams
from dayzero.config.model_config import HybridConfig
from dayzero.train.card import card_results
from dayzero.train.checkpoint import checkpoint_tensors, load_model, new_model

ROOT = Path(__file__).resolve().parents[2]
ASSET_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
               "generation_config.json"}


def _script():
    spec = importlib.util.spec_from_file_location("train_default", ROOT / "scripts" / "train_default.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_run_writes_a_checkpoint_the_engine_loads(tmp_path, capsys):
    out = tmp_path / "ckpt"
    profile = tmp_path / "step.txt"
    assert _script().main(["--tiny", "--device", "cpu", "--steps", "3", "--out", str(out), "--eval-n", "2",
                           "--profile", str(profile)]) == 0
    printed = capsys.readouterr().out
    assert "step      3" in printed and "addition" in printed  # progress lines, then the held-out table
    table = profile.read_text()
    assert "step 3, by self_cpu_time_total" in table and "aten::" in table
    assert "calling lines" in table and "dayzero/" in table  # the ops grouped by our source lines too
    assert ASSET_FILES | {"README.md"} <= {p.name for p in out.iterdir()}
    card = (out / "README.md").read_text()
    results = card_results(out)  # the card's accuracy, as the final table printed it
    assert set(results["accuracy"]) == {"addition", "subtraction", "reversal", "sorting", "recall", "copy"}
    assert results["n"] == 2 and results["device"] == "cpu" and "| addition | 2 |" in card
    assert "python scripts/train_default.py --tiny" in card and "--out ckpt" in card and str(tmp_path) not in card
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "dayzero_hybrid" and config["quantization_config"]["quant_method"] == "mxfp4"
    llm = LLM(str(out), device="cpu")
    o = llm.generate(["12+34="], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert len(o.token_ids) == 4
    chat = llm.chat([{"role": "user", "content": "reverse abc ="}], SamplingParams(max_tokens=2))
    assert chat[0].outputs[0].token_ids


def test_bf16_experts_checkpoint_loads(tmp_path):
    out = tmp_path / "ckpt"
    _script().main(["--tiny", "--device", "cpu", "--steps", "1", "--out", str(out), "--eval-n", "0",
                    "--expert-format", "bf16", "--tasks", "addition,recall"])
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    LLM(str(out), device="cpu").generate(["1+1="], SamplingParams(max_tokens=2, temperature=0.0))


def test_init_continues_from_a_checkpoint_with_mxfp4_experts(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    _script().main(["--tiny", "--device", "cpu", "--steps", "1", "--out", str(first), "--eval-n", "0"])
    model = load_model(first, "cpu")  # the MXFP4 experts dequantised into dense, trainable ones
    config = HybridConfig.from_file(first / "config.json")
    assert all(p.is_floating_point() and p.requires_grad for n, p in model.named_parameters()
               if n.endswith((".w1", ".w2")))
    again = checkpoint_tensors(model, config, "mxfp4")  # saved again: the same file, bit for bit
    stored = load_file(first / "model.safetensors")
    assert again.keys() == stored.keys() and all(torch.equal(again[k], stored[k]) for k in stored)
    _script().main(["--tiny", "--device", "cpu", "--steps", "2", "--out", str(second), "--eval-n", "0", "--init",
                    str(first)])
    assert json.loads((second / "config.json").read_text()) == json.loads((first / "config.json").read_text())
    trained = load_file(second / "model.safetensors")
    assert any(not torch.equal(trained[k], stored[k]) for k in stored)  # it trained on from there
    assert "--init a" in (second / "README.md").read_text()
    with pytest.raises(ValueError, match="--init takes the checkpoint's own config"):
        _script().main(["--device", "cpu", "--out", str(tmp_path / "c"), "--init", str(first), "--config",
                        str(first / "config.json")])
    with pytest.raises(ValueError, match="no config.json and model.safetensors there"):
        _script().main(["--device", "cpu", "--out", str(tmp_path / "c"), "--init", str(tmp_path / "none")])


@pytest.mark.parametrize("argv,match", [
    (["--tasks", "addition,multiplication"], "--tasks: unknown task multiplication"),
    (["--minutes", "0"], "--minutes must be positive"),
    (["--minutes", "-1"], "--minutes must be positive"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--tokens", "0"], "--tokens must be positive"),
    (["--copy-warmup", "1.5"], "--copy-warmup must be in"),
    (["--sparse-from", "-0.1"], "--sparse-from must be in"),
    (["--recall-share", "1"], "--recall-share must be in"),
    (["--question-share", "2"], "--question-share must be in"),
    (["--loss-parts", "recall"], "--loss-parts takes TASK=WEIGHT"),
    (["--loss-parts", "recall=0"], "--loss-parts: positive weights"),
    (["--loss-parts", "poetry=2"], "--loss-parts: positive weights"),
    (["--recall-lengths", "192,1024"], "--recall-lengths takes MIN,START,MAX"),
    (["--recall-lengths", "1024,192,8192"], "--recall-lengths needs 0 < MIN <= START <= MAX"),
    (["--recipe", "bundled", "--copy-warmup", "2"], "--copy-warmup must be in"),
], ids=["task", "minutes-zero", "minutes-negative", "steps", "tokens", "copy-warmup", "sparse-from", "recall-share",
        "question-share", "loss-parts-form", "loss-parts-zero", "loss-parts-task", "recall-lengths-form",
        "recall-lengths-order", "recipe-then-bad-flag"])
def test_bad_options_name_the_option(tmp_path, argv, match):
    with pytest.raises(ValueError, match=match):
        _script().main(["--tiny", "--device", "cpu", "--out", str(tmp_path / "x"), *argv])
    assert not (tmp_path / "x").exists()


def test_an_unknown_recipe_is_refused_with_the_known_ones(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _script().parse_args(["--recipe", "best", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert "argument --recipe: invalid choice: 'best'" in err and "bundled" in err and "--out OUT" in err


def test_the_bundled_recipe_is_the_bundled_models_recorded_job():
    """``--recipe bundled`` gives every option of the job the model card records (its first process's command),
    and a flag given beside the recipe still wins."""
    import shlex

    script = _script()
    card = (ROOT / "dayzero" / "assets" / "default" / "README.md").read_text()
    line = next(ln for ln in card.splitlines()
                if ln.startswith("python scripts/train_default.py") and "--resume" not in ln)
    recorded = script.parse_args(shlex.split(line)[2:])
    recipe = script.parse_args(["--recipe", "bundled", "--device", "cuda", "--pause-after", "5.5", "--out", "part1"])
    differ = {n: (getattr(recorded, n), getattr(recipe, n)) for n in vars(recorded)
              if n != "recipe" and getattr(recorded, n) != getattr(recipe, n)}
    assert not differ, differ
    assert recipe.recall_style == "joined" and recipe.minutes == 15.0  # not the script's defaults
    mine = script.parse_args(["--recipe", "bundled", "--copy-warmup", "0.6", "--minutes", "4", "--out", "x"])
    assert (mine.copy_warmup, mine.minutes, mine.sparse_from) == (0.6, 4.0, 0.5)


def test_recipe_data_options_build_the_data_stream_the_script_would():
    from dayzero.train.recipes import data_config, recipe_data

    data = data_config(**recipe_data("bundled"))
    assert (data.recall_min, data.recall_start, data.recall_max) == (192, 1024, 8192)
    assert data.loss_parts == {"recall": 3.0, "copy": 2.0} and data.copy_warmup == 0.3 and data.tokens == 98304
    assert data.recall_share == 0.5 and data.recall_min_pairs == 8 and data.recall_style == "joined"
    only = data_config(tasks="recall", tiny=True)
    assert set(only.weights) == {"copy"} and only.recall_share == 0.95 and only.tokens == 2048


def test_output_dir_with_files_needs_overwrite(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not empty; pass --overwrite"):
        _script().main(["--tiny", "--device", "cpu", "--steps", "1", "--out", str(tmp_path)])
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_default_training_config_fits_16_mib_with_mxfp4_experts():
    config = HybridConfig.from_file(ROOT / "configs" / "dayzero-default-train.json")
    assert config.index_topk < 2048  # the recall contexts reach past the DSA top-k
    assert config.max_position_embeddings > 8192  # and the 8K-token recall target fits in the context
    tensors = checkpoint_tensors(new_model(config, "cpu"), config, "mxfp4")
    assert sum(t.numel() * t.element_size() for t in tensors.values()) <= 16 * 2**20
    assert any(name.endswith("w1_blocks") and t.dtype == torch.uint8 for name, t in tensors.items())


def test_a_card_given_its_training_section_has_one_heading_for_it():
    """``card_default.py --training FILE``: the section's text with or without its own heading."""
    from dayzero.config.model_config import HybridConfig
    from dayzero.engine.engine import DEFAULT_MODEL
    from dayzero.train.card import model_card

    config = HybridConfig.from_file(DEFAULT_MODEL / "config.json")
    common = dict(config=config, n_params=1, size_bytes=1, expert_format="mxfp4", tasks=["addition"], rows=[],
                  eval_setup={})
    for text in ("Two jobs.", "## Training\n\nTwo jobs.\n"):
        card = model_card(**common, training=text)
        assert card.count("## Training") == 1 and "## Training\n\nTwo jobs.\n" in card


def test_a_paused_and_resumed_job_ends_where_the_whole_job_does(tmp_path):
    base = ["--tiny", "--device", "cpu", "--steps", "6", "--eval-n", "0", "--lr", "1e-3"]
    script = _script()
    assert script.main(base + ["--out", str(tmp_path / "whole")]) == 0
    assert script.main(base + ["--pause-at-step", "3", "--out", str(tmp_path / "first")]) == 0
    assert (tmp_path / "first" / "trainer_state.pt").is_file()
    with pytest.raises(ValueError, match="--lr"):  # the recipe is the job's own
        script.main(["--resume", str(tmp_path / "first"), "--out", str(tmp_path / "x"), "--lr", "2e-3"])
    with pytest.raises(ValueError, match="no trainer_state.pt"):
        script.main(["--resume", str(tmp_path / "whole"), "--out", str(tmp_path / "y")])
    assert script.main(["--resume", str(tmp_path / "first"), "--device", "cpu", "--eval-n", "0",
                        "--out", str(tmp_path / "second")]) == 0
    whole, resumed = (load_file(tmp_path / d / "model.safetensors") for d in ("whole", "second"))
    assert whole.keys() == resumed.keys()
    for name in whole:
        torch.testing.assert_close(resumed[name], whole[name], msg=name)
    card = (tmp_path / "second" / "README.md").read_text()
    assert "--resume" in card and "6 steps" in card.replace(",", "")
