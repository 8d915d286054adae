"""Every option of ``vlft run`` has a real run in the suite that uses it and checks what it promises.

``RUN_OPTION_TESTS`` names, for each option click knows, the test that does so; the first test reads the
options from click itself, so adding an option without naming its test fails here, naming the option. A
named test must exist and must both start a real run and name the option (run_option_index.py reads the
tests' sources, with their fixtures). The runs below cover the options no other module's run used.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import click
import numpy as np
import pytest
import torch
import run_option_index
from helpers import cli_invoke

from vlft.cli import cli

PACK = "test_packing_runs.py::"
RUN_OPTION_TESTS = {
    "--backend": "test_run.py::test_short_run_writes_adapter_metrics_and_eval",
    "--method": "test_run.py::test_short_run_writes_adapter_metrics_and_eval",
    "--objective": "test_objectives.py::test_a_dpo_run_trains_saves_resumes_and_evaluates",
    "--beta": "test_objectives.py::test_dpo_loss_options_take_effect",
    "--dpo-loss": "test_objectives.py::test_dpo_loss_options_take_effect",
    "--label-smoothing": "test_objectives.py::test_dpo_loss_options_take_effect",
    "--rpo-alpha": "test_objectives.py::test_dpo_loss_options_take_effect",
    "--init-adapter": "test_objectives.py::test_sft_then_dpo_from_its_adapter",
    "--reward": "test_grpo.py::test_a_grpo_run_from_an_sft_adapter_logs_its_figures_and_trains",
    "--num-generations": "test_grpo.py::test_a_grpo_run_from_an_sft_adapter_logs_its_figures_and_trains",
    "--temperature": "test_grpo.py::test_a_grpo_run_from_an_sft_adapter_logs_its_figures_and_trains",
    "--top-p": "test_grpo.py::test_sequence_norm_unscaled_rewards_top_p_and_clip_options_reach_the_run",
    "--clip-epsilon": "test_grpo.py::test_sequence_norm_unscaled_rewards_top_p_and_clip_options_reach_the_run",
    "--num-iterations": "test_grpo.py::test_num_iterations_trains_each_rollout_over_n_steps_and_the_clip_acts",
    "--scale-rewards": "test_grpo.py::test_sequence_norm_unscaled_rewards_top_p_and_clip_options_reach_the_run",
    "--grpo-norm": "test_grpo.py::test_sequence_norm_unscaled_rewards_top_p_and_clip_options_reach_the_run",
    "--model": "test_family_runs.py::test_every_family_trains_on_mixed_data",
    "--data": "test_run.py::test_short_run_writes_adapter_metrics_and_eval",
    "--image-root": "test_run_options.py::test_data_options_reach_the_samples_a_run_trains_on",
    "--add-placeholders": "test_run_options.py::test_data_options_reach_the_samples_a_run_trains_on",
    "--columns": "test_columnar.py::test_hub_sets_check_and_train_as_their_json_lines_conversions",
    "--video-fps": "test_run_options.py::test_data_options_reach_the_samples_a_run_trains_on",
    "--video-max-frames": "test_run_options.py::test_data_options_reach_the_samples_a_run_trains_on",
    "--early-stopping-patience": "test_formats.py::test_every_layout_trains_one_step_and_data_check_reports_them",
    "--val-data": "test_run.py::test_short_run_writes_adapter_metrics_and_eval",
    "--output": "test_run.py::test_short_run_writes_adapter_metrics_and_eval",
    "--steps": "test_run.py::test_short_run_writes_adapter_metrics_and_eval",
    "--epochs": "test_run_options.py::test_training_options_take_effect_in_a_real_run",
    "--batch-size": "test_run.py::test_short_run_writes_adapter_metrics_and_eval",
    "--grad-accum": "parity/test_several_processes.py::test_sharded_gradient_accumulation_trains_as_one_process",
    "--packing": PACK + "test_a_packed_run_trains_evaluates_and_saves_with_the_padded_losses",
    "--lr": "test_run.py::test_short_run_writes_adapter_metrics_and_eval",
    "--lr-vision": "test_tuning.py::test_the_plan_shows_the_groups_and_the_merger_trained_in_full",
    "--lr-merger": "test_tuning.py::test_the_plan_shows_the_groups_and_the_merger_trained_in_full",
    "--train-merger": "test_tuning.py::test_the_plan_shows_the_groups_and_the_merger_trained_in_full",
    "--weight-decay": "test_run_options.py::test_training_options_take_effect_in_a_real_run",
    "--warmup-ratio": "parity/test_several_processes.py::test_two_sharded_processes_train_as_one_process_with_the_same_global_batch",
    "--max-grad-norm": "test_run_options.py::test_training_options_take_effect_in_a_real_run",
    "--eval-every": "test_run.py::test_short_run_writes_adapter_metrics_and_eval",
    "--eval-batches": "test_after_training.py::test_progress_bar_writes_no_line_per_logged_step_when_stderr_is_not_a_terminal",
    "--eval-samples": "test_run.py::test_short_run_writes_adapter_metrics_and_eval",
    "--max-new-tokens": "test_run.py::test_short_run_writes_adapter_metrics_and_eval",
    "--scorer": "test_scorer_runs.py::test_a_run_scores_with_auto_and_named_scorers_and_the_figures_rise",
    "--save-every": "test_run.py::test_short_run_writes_adapter_metrics_and_eval",
    "--keep-checkpoints": "test_run.py::test_short_run_writes_adapter_metrics_and_eval",
    "--resume": "test_run.py::test_resume_continues_with_the_same_losses",
    "--force-resume": "test_run_options.py::test_resume_refuses_a_changed_run_unless_forced",
    "--max-skipped-steps": "test_survival.py::test_non_finite_steps_are_not_applied_and_too_many_stop_the_run",
    "--trust-pickle": "test_survival.py::test_hostile_config_and_pickled_weights_exit_non_zero_and_write_nothing",
    "--seed": "test_run.py::test_resume_continues_with_the_same_losses",
    "--deterministic": "test_run_options.py::test_training_options_take_effect_in_a_real_run",
    "--targets": "test_after_training.py::test_export_adapter_only_copies_peft_folder_with_a_model_card",
    "--vision-last-n": "test_run_options.py::test_training_options_take_effect_in_a_real_run",
    "--max-pixels": "test_run_options.py::test_data_options_reach_the_samples_a_run_trains_on",
    "--precision": "test_survival.py::test_fp16_scaler_back_offs_at_the_start_do_not_stop_the_run_and_a_nan_loss_still_does",
    "--param-dtype": "test_qlora.py::test_eval_scores_the_trained_4bit_model_quantized_as_the_run_was",
    "--double-quant": "test_qlora.py::test_eval_scores_the_trained_4bit_model_quantized_as_the_run_was",
    "--grad-checkpointing": "parity/test_several_processes.py::test_two_sharded_processes_train_as_one_process_with_the_same_global_batch",
    "--max-length": "test_memory.py::test_too_long_samples_stop_the_run_with_their_lines_and_write_nothing",
    "--skip-too-long": "test_memory.py::test_skipped_samples_are_counted_and_listed",
    "--group-by-length": "test_run_options.py::test_grouped_batches_under_two_processes_pad_less",
    "--device-memory": "test_run_options.py::test_training_options_take_effect_in_a_real_run",
    "--shard": PACK + "test_two_sharded_processes_packed_train_as_one_padded_process",
    "--no-memory-check": "test_run_options.py::test_training_options_take_effect_in_a_real_run",
    "--attn": "test_run_options.py::test_training_options_take_effect_in_a_real_run",
    "--kernels": "test_kernels.py::test_a_run_with_a_kernel_calls_no_hook_inside_a_step",
    "--num-workers": "test_run_options.py::test_training_options_take_effect_in_a_real_run",
    "--log-every": "test_run.py::test_short_run_writes_adapter_metrics_and_eval",
    "--report-to": "test_after_training.py::test_tensorboard_gets_the_scalars_of_metrics_jsonl",
    "--adapter-opt": PACK + "test_a_packed_run_trains_evaluates_and_saves_with_the_padded_losses",
    "--dry-run": "test_run.py::test_dry_run_prints_the_plan_without_training",
    "--config": "test_run_options.py::test_training_options_take_effect_in_a_real_run",
    "--json": "test_run.py::test_dry_run_prints_the_plan_without_training",
    "--verbose": "test_dry_run.py::test_the_plan_groups_adapted_modules_per_tower_and_layer_range_and_verbose_lists_each",
    "--quiet": PACK + "test_two_data_parallel_processes_packed_train_as_one_padded_process",
    "--nproc-per-node": PACK + "test_two_data_parallel_processes_packed_train_as_one_padded_process",
    "--nnodes": "parity/test_several_processes.py::test_two_torchrun_agents_resume_a_sharded_run_with_the_uninterrupted_losses",
    "--node-rank": "parity/test_several_processes.py::test_two_torchrun_agents_resume_a_sharded_run_with_the_uninterrupted_losses",
    "--master-addr": "parity/test_several_processes.py::test_two_torchrun_agents_resume_a_sharded_run_with_the_uninterrupted_losses",
    "--master-port": "parity/test_several_processes.py::test_two_torchrun_agents_resume_a_sharded_run_with_the_uninterrupted_losses",
}


def _run_options() -> dict[str, click.Parameter]:
    run = cli.get_command(click.Context(cli), "run")
    return {max(p.opts, key=len): p for p in run.params if isinstance(p, click.Option)}


def test_every_run_option_names_a_real_run_that_uses_it():
    options = _run_options()
    missing = sorted(set(options) - set(RUN_OPTION_TESTS))
    assert not missing, (f"vlft run options without an end-to-end test: {', '.join(missing)}; add a real run "
                         f"that uses each and checks its promise, and name it in RUN_OPTION_TESTS")
    stale = sorted(set(RUN_OPTION_TESTS) - set(options))
    assert not stale, f"RUN_OPTION_TESTS names options vlft run no longer has: {', '.join(stale)}"
    tests = run_option_index.collect()
    problems = []
    for flag, where in RUN_OPTION_TESTS.items():
        test = tests.get(where)
        if test is None:
            problems.append(f"{flag}: no test {where}")
        elif not run_option_index.runs(test.text):
            problems.append(f"{flag}: {where} starts no real run")
        elif not run_option_index.uses(test.text, flag, options[flag].name):
            problems.append(f"{flag}: {where} does not use it")
    assert not problems, "\n".join(problems)


def test_the_index_fails_an_option_a_test_does_not_use():
    """The check above can fail: a test that runs but never names an option, or names it without a run."""
    tests = run_option_index.collect()
    dry = tests["test_run.py::test_short_run_writes_adapter_metrics_and_eval"].text
    assert run_option_index.runs(dry) and not run_option_index.uses(dry, "--vision-last-n", "vision_last_n")
    layering = next(t for w, t in tests.items() if w.startswith("test_layering.py::"))
    assert not run_option_index.runs(layering.text)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, Path]:
    from vlft.data.demo import write_demo_dataset

    ds = write_demo_dataset(tmp_path_factory.mktemp("opts") / "demo", n_train=16, n_val=4, seed=7)
    return ds.train, ds.val


BASE = ("run", "--quiet", "--backend", "cpu", "--batch-size", "2", "--log-every", "1", "--eval-every", "0",
        "--eval-samples", "1", "--max-new-tokens", "2", "--save-every", "0", "--seed", "4")


def test_training_options_take_effect_in_a_real_run(demo, tmp_path):
    """One run with --epochs, --vision-last-n and --weight-decay (from a --config file), --max-grad-norm
    (tiny), --num-workers, --deterministic, --attn, and --no-memory-check beside a --device-memory it cannot
    fit: each checked against what it promises."""
    from safetensors.torch import load_file

    train, val = demo
    out = tmp_path / "run"
    config_file = tmp_path / "run.yaml"
    config_file.write_text("vision-last-n: 2\nweight_decay: 0.1\nepochs: 0.5\n")
    code, output = cli_invoke(*BASE, "--data", train, "--val-data", val, "--output", out, "--config", config_file,
                         "--max-grad-norm", "1e-12",
                         "--num-workers", "1", "--deterministic", "--attn", "vision=sdpa,text=eager",
                         "--device-memory", "1MiB", "--no-memory-check", "--lr", "3e-3")
    assert code == 0, output
    plan = json.loads((out / "plan.json").read_text())
    assert [m["step"] for m in _metrics(out) if "loss" in m] == [1, 2, 3, 4]  # half of 16 records, 2 a step
    assert plan["targets"]["vision_blocks"] == [6, 7]  # the last 2 of the embedded model's 8
    assert plan["dataloader"]["num_workers"] == 1
    assert plan["attention"]["vision"] == "sdpa" and plan["attention"]["text"] == "eager"
    assert plan["memory"]["fits"] is False  # planned for 1 MiB, trained anyway
    state = torch.load(out / "checkpoints" / "step-000004" / "state.pt", weights_only=False)
    assert {g["weight_decay"] for g in state["optimizer"]["param_groups"]} == {0.1}
    config = json.loads((out / "config.json").read_text())
    assert config["deterministic"] is True
    # clipped to a norm of 1e-12, AdamW's steps (g / (|g| + 1e-8)) leave LoRA B, which starts at 0, at ~0;
    # unclipped, three steps at lr 3e-3 move it by ~1e-2 (test_run's runs)
    b = [v for k, v in load_file(str(out / "adapter" / "adapter_model.safetensors")).items() if "lora_B" in k]
    assert b and max(float(v.abs().max()) for v in b) < 1e-5
    assert all(m["grad_norm"] > 1e-3 for m in _metrics(out) if "loss" in m)  # the norm before clipping


def test_resume_refuses_a_changed_run_unless_forced(demo, tmp_path, monkeypatch):
    """A run stopped after its step-2 checkpoint, resumed with another --lr: refused, naming what changed and
    --force-resume; with --force-resume it continues to its last step."""
    from helpers import die_at_step

    train, val = demo
    out = tmp_path / "run"
    common = (*BASE[:-4], "--seed", "4", "--data", train, "--val-data", val, "--output", out, "--steps", "4",
              "--save-every", "2")
    die_at_step(monkeypatch, 3)
    code, output = cli_invoke(*common)
    assert code != 0 and (out / "checkpoints" / "step-000002").is_dir()  # interrupted during step 3
    monkeypatch.undo()
    code, output = cli_invoke(*common, "--resume", "--lr", "1e-3")
    assert code != 0 and "lr" in output and "--force-resume" in output, output
    code, output = cli_invoke(*common, "--resume", "--lr", "1e-3", "--force-resume")
    assert code == 0, output
    assert [m["step"] for m in _metrics(out) if "loss" in m] == [1, 2, 3, 4]
    # the finished run extended: refused as changed, then trained on from its last step with --force-resume
    code, output = cli_invoke(*common, "--resume", "--lr", "1e-3", "--steps", "6")
    assert code != 0 and "steps" in output, output
    code, output = cli_invoke(*common, "--resume", "--lr", "1e-3", "--steps", "6", "--force-resume")
    assert code == 0, output
    assert [m["step"] for m in _metrics(out) if "loss" in m] == [1, 2, 3, 4, 5, 6]
    assert json.loads((out / "summary.json").read_text())["steps"] == 6


def _video(path: Path, frames: int = 8, fps: int = 4) -> None:
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((64, 64, 3), (i * 30) % 256, dtype=np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def test_data_options_reach_the_samples_a_run_trains_on(demo, tmp_path):
    """--image-root (paths start there, not at the data file), --add-placeholders (records without <image>),
    --max-pixels (fewer image tokens), --video-fps and --video-max-frames (fewer frames): a 2-step run on
    such records, its plan's longest sample against the same records encoded without the options."""
    train, _ = demo
    media = tmp_path / "media"
    shutil.copytree(Path(train).parent / "imgs", media / "imgs")
    _video(media / "clips" / "a.mp4", frames=8, fps=4)
    records = [json.loads(line) for line in Path(train).read_text().splitlines()][:6]
    for r in records[::2]:  # half without the placeholder
        r["conversations"][0]["value"] = r["conversations"][0]["value"].replace("<image>\n", "")
    video = {"video": "clips/a.mp4", "conversations": [{"from": "human", "value": "<video>\nWhat happens?"},
                                                        {"from": "gpt", "value": "it brightens"}]}
    data = tmp_path / "data" / "train.jsonl"  # the images are not beside it: --image-root says where
    data.parent.mkdir()
    data.write_text("".join(json.dumps(r) + "\n" for r in [*records, video]))

    def lengths(*flags) -> dict:
        out = tmp_path / f"run{len(flags)}"
        code, output = cli_invoke(*BASE, "--data", data, "--val-data", data, "--output", out, "--steps", "2",
                             "--image-root", media, "--add-placeholders", *flags)
        assert code == 0, output
        assert [m["step"] for m in _metrics(out) if "loss" in m] == [1, 2]
        return json.loads((out / "plan.json").read_text())["lengths"]

    code, output = cli_invoke(*BASE, "--data", data, "--val-data", data, "--output", tmp_path / "no", "--steps", "2")
    assert code != 0 and "--image-root" in output  # without it the images are not found, nothing is written
    assert not (tmp_path / "no").exists()
    full = lengths()
    capped = lengths("--max-pixels", "3136", "--video-fps", "1", "--video-max-frames", "2")
    # the image records (the median): 112 x 112 pixels are 16 image tokens, 56 x 56 are 4
    assert full["median"] - capped["median"] == 12
    # the video (the longest): 8 frames at 4 fps give 4 frames at 2 fps (2 temporal patches), 2 at 1 fps (1)
    assert capped["longest"] < full["longest"]


def test_grouped_batches_under_two_processes_pad_less(tmp_path):
    """--group-by-length under 2 data-parallel processes: each process's micro-batches hold samples of
    similar length, so fewer of the positions computed are padding than in the plain shuffle (both logged
    as tokens_per_s against effective_tokens_per_s, over all processes)."""
    import os
    import subprocess

    from helpers import vlft_command

    from vlft.data.demo import write_varied_dataset

    data = write_varied_dataset(tmp_path / "varied", n=32, seed=3, min_side=28, max_side=96, max_images=1,
                                answer_words=(1, 60), max_turns=1)
    ratios = {}
    for grouped in (False, True):
        out = tmp_path / f"run-{grouped}"
        args = [*BASE, "--data", data, "--val-data", data, "--output", out, "--steps", "8"]
        if grouped:  # 2 processes of micro-batch 2
            proc = subprocess.run([*vlft_command(), *map(str, args), "--nproc-per-node", "2", "--group-by-length"],
                                  capture_output=True, text=True, timeout=600,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            assert proc.returncode == 0, proc.stderr[-3000:]
        else:  # the plain shuffle, in micro-batches of 2 as well
            code, output = cli_invoke(*args)
            assert code == 0, output
        logged = [m for m in _metrics(out) if "loss" in m]
        assert len(logged) == 8
        ratios[grouped] = (sum(m["tokens_per_s"] * m["step_time_s"] for m in logged)
                           / sum(m["effective_tokens_per_s"] * m["step_time_s"] for m in logged))
    assert ratios[True] < 1 + 0.5 * (ratios[False] - 1), ratios  # at most half the padding
