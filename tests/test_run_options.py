"""Every option of ``vlft run`` has a real run in the suite that sets it and checks what it promises.

``RUN_OPTION_TESTS`` names, for each option click knows, the test that does so; the first test reads the
options from click itself, so adding an option without naming its test fails here, naming the option, and a
named test must exist. That the named test's runs set the option is read from evidence, not from its text:
every ``vlft run`` records the options its command line (or its --config file) set, and a session in which a
named test passed but none of its runs (its own, or its fixtures') set the option fails at its end, naming
both (run_option_index.py; tests/test_option_index.py shows it refusing a test that only names an option).
The runs below cover the options no other module's run used.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import click
import numpy as np
import pytest
import run_option_index
import torch

from helpers import brief_flags, cli_invoke
from vlft.cli import cli

PACK = "test_packing_runs.py::"
TOWERS = "test_tuning.py::test_each_towers_learning_rate_moves_its_own_parameters_in_a_real_run"
RUN_OPTION_TESTS = {
    "--backend": "test_run.py::test_unavailable_backend_stops_at_once_with_the_reason",
    "--method": "test_run.py::test_short_run_writes_adapter_metrics_and_eval",
    "--objective": "test_objectives.py::test_a_dpo_run_trains_saves_resumes_and_evaluates",
    "--beta": "test_objectives.py::test_dpo_loss_options_take_effect",
    "--dpo-loss": "test_objectives.py::test_dpo_loss_options_take_effect",
    "--label-smoothing": "test_objectives.py::test_dpo_loss_options_take_effect",
    "--rpo-alpha": "test_objectives.py::test_dpo_loss_options_take_effect",
    "--orpo-lambda": "test_preference_objectives.py::test_the_guides_orpo_plugin_adds_its_option_and_trains",
    "--simpo-gamma": "test_preference_objectives.py::test_simpo_and_kto_options_take_effect",
    "--desirable-weight": "test_preference_objectives.py::test_simpo_and_kto_options_take_effect",
    "--undesirable-weight": "test_preference_objectives.py::test_simpo_and_kto_options_take_effect",
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
    "--shard-loading": "parity/test_several_processes.py::"
    "test_each_process_reading_its_own_shares_trains_as_rank_0_reading_them_all",
    "--offload": "parity/test_several_processes.py::test_each_process_reading_its_own_shares_trains_as_rank_0_reading_them_all",
    "--sequence-parallel": "test_sequence_parallel.py::test_a_long_video_record_refused_at_one_process_trains_split_over_two",
    "--packing": PACK + "test_two_data_parallel_processes_packed_train_as_one_padded_process",
    "--lr": "test_run.py::test_short_run_writes_adapter_metrics_and_eval",
    "--lr-vision": TOWERS,
    "--lr-merger": TOWERS,
    "--train-merger": "test_tuning.py::test_train_merger_trains_the_merger_in_full_and_saves_it",
    "--weight-decay": "test_run_options.py::test_training_options_take_effect_in_a_real_run",
    "--warmup-ratio": "test_tuning.py::test_warmup_ratio_warms_every_group_up_over_its_share_of_the_steps",
    "--max-grad-norm": "test_run_options.py::test_training_options_take_effect_in_a_real_run",
    "--eval-every": "test_run.py::test_short_run_writes_adapter_metrics_and_eval",
    "--eval-batches": PACK + "test_two_data_parallel_processes_packed_train_as_one_padded_process",
    "--eval-samples": "test_run.py::test_short_run_writes_adapter_metrics_and_eval",
    "--max-new-tokens": "test_run.py::test_short_run_writes_adapter_metrics_and_eval",
    "--scorer": "test_scorer_runs.py::test_a_run_scores_with_auto_and_named_scorers_and_the_figures_rise",
    "--save-every": "test_run.py::test_short_run_writes_adapter_metrics_and_eval",
    "--keep-checkpoints": "test_run.py::test_short_run_writes_adapter_metrics_and_eval",
    "--resume": "test_run.py::test_resume_continues_with_the_same_losses",
    "--force-resume": "test_run_options.py::test_resume_refuses_a_changed_run_unless_forced",
    "--max-skipped-steps": "test_survival.py::test_non_finite_steps_are_not_applied_and_too_many_stop_the_run",
    "--trust-pickle": "test_survival.py::test_hostile_config_and_pickled_weights_exit_non_zero_and_write_nothing",
    "--seed": "test_tuning.py::test_seed_draws_the_adapter_initialisation",
    "--deterministic": "test_run_options.py::test_training_options_take_effect_in_a_real_run",
    "--targets": "test_objectives.py::test_sft_then_dpo_from_its_adapter",
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
    "--adapter-opt": PACK + "test_two_data_parallel_processes_packed_train_as_one_padded_process",
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
    """Every option of ``vlft run``: its own and the installed objectives' (``vlft.cli.RunCommand``)."""
    run = cli.get_command(click.Context(cli), "run")
    return {
        max(p.opts, key=len): p
        for p in run.get_params(click.Context(run))
        if isinstance(p, click.Option) and p.name != "help" and "--help" not in p.opts
    }


def test_every_run_option_names_the_test_that_shows_it():
    """Static: every option named, no stale name, every named test defined. Whether the named test's runs
    set the option is checked at the end of the session it runs in (run_option_index.py)."""
    options = _run_options()
    missing = sorted(set(options) - set(RUN_OPTION_TESTS))
    assert not missing, (
        f"vlft run options without an end-to-end test: {', '.join(missing)}; add a real run "
        f"that sets each and checks its promise, and name it in RUN_OPTION_TESTS"
    )
    stale = sorted(set(RUN_OPTION_TESTS) - set(options))
    assert not stale, f"RUN_OPTION_TESTS names options vlft run no longer has: {', '.join(stale)}"
    defined = run_option_index.defined_tests(Path(__file__).parent)
    unknown = [f"{flag}: no test {where}" for flag, where in RUN_OPTION_TESTS.items() if where not in defined]
    assert not unknown, "\n".join(unknown)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, Path]:
    from vlft.data.demo import write_demo_dataset

    ds = write_demo_dataset(tmp_path_factory.mktemp("opts") / "demo", n_train=16, n_val=4, seed=7)
    return ds.train, ds.val


BASE = ("run", *brief_flags(batch_size=2, max_new_tokens=2, seed=4))


class _RunSpies:
    """What a run does while it trains, seen from inside it: each attention call (which function ran, for which
    tower, with the deterministic switches as they were then) and each DataLoader worker started (its pid and
    what ``get_worker_info`` says there; written to ``workers`` by the worker process)."""

    def __init__(self, monkeypatch, workers: Path):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl  # the embedded default's modelling

        import vlft.data.order as order

        self.attention: set[tuple[str, str, bool, bool]] = set()
        self.workers = workers

        def spied(kind, fn):
            def attend(module, *args, **kwargs):
                tower = "vision" if "Vision" in type(module).__name__ else "text"
                self.attention.add(
                    (
                        tower,
                        kind,
                        torch.are_deterministic_algorithms_enabled(),
                        torch.is_deterministic_algorithms_warn_only_enabled(),
                    )
                )
                return fn(module, *args, **kwargs)

            return attend

        # the functions the attention modules call (whichever way a transformers version dispatches to them)
        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", spied("sdpa", ALL_ATTENTION_FUNCTIONS["sdpa"]))
        monkeypatch.setattr(
            modeling_qwen2_5_vl, "eager_attention_forward", spied("eager", modeling_qwen2_5_vl.eager_attention_forward)
        )
        seeded = order.worker_init

        def worker_init(worker_id: int) -> None:  # runs in the worker process
            import os

            info = torch.utils.data.get_worker_info()
            with open(workers, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "id": info.id, "of": info.num_workers}) + "\n")
            seeded(worker_id)

        monkeypatch.setattr(order, "worker_init", worker_init)

    def started_workers(self) -> list[dict]:
        return [json.loads(line) for line in self.workers.read_text().splitlines()] if self.workers.exists() else []

    def ran(self, tower: str) -> set[str]:
        return {kind for t, kind, *_ in self.attention if t == tower}

    def switches(self) -> set[tuple[bool, bool]]:
        return {(on, warn_only) for *_, on, warn_only in self.attention}


@pytest.fixture
def deterministic_off():
    """torch's deterministic switch off before, and as found after (a run with --deterministic sets it for the
    process, and leaves it so)."""
    found = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    yield
    torch.use_deterministic_algorithms(found[0], warn_only=found[1])


def test_training_options_take_effect_in_a_real_run(demo, tmp_path, monkeypatch, deterministic_off):
    """One run with --epochs, --vision-last-n and --weight-decay (from a --config file), --max-grad-norm
    (tiny), --num-workers, --deterministic, --attn, and --no-memory-check beside a --device-memory it cannot
    fit: each checked against what it promises, the last three seen inside the run: the attention functions
    its forward passes called per tower, torch's deterministic switches then, and the worker processes."""
    import os

    from safetensors.torch import load_file

    from vlft.registry import get_registry

    train, val = demo
    out = tmp_path / "run"
    config_file = tmp_path / "run.yaml"
    config_file.write_text("vision-last-n: 2\nweight_decay: 0.1\nepochs: 0.5\n")
    spies = _RunSpies(monkeypatch, tmp_path / "workers.jsonl")
    code, output = cli_invoke(
        *BASE,
        "--data",
        train,
        "--val-data",
        val,
        "--output",
        out,
        "--config",
        config_file,
        "--max-grad-norm",
        "1e-12",
        "--num-workers",
        "2",
        "--deterministic",
        "--attn",
        "vision=sdpa,text=eager",
        "--device-memory",
        "1MiB",
        "--no-memory-check",
        "--lr",
        "3e-3",
    )
    assert code == 0, output
    plan = json.loads((out / "plan.json").read_text())
    # --attn: the vision blocks' forward called SDPA and the decoder layers' eager attention, nothing else
    assert spies.ran("vision") == {"sdpa"} and spies.ran("text") == {"eager"}, (
        f"attention the run's forwards called: vision {spies.ran('vision')}, text {spies.ran('text')}"
    )
    assert plan["attention"]["vision"] == "sdpa" and plan["attention"]["text"] == "eager"
    # --deterministic: the CPU seed hook switched torch to deterministic algorithms (warning only where an op
    # has none) before the first forward; unasked, it leaves them off
    assert spies.switches() == {(True, True)}, f"deterministic, warn-only during the run's forwards: {spies.switches()}"
    assert json.loads((out / "config.json").read_text())["deterministic"] is True
    torch.use_deterministic_algorithms(False)
    get_registry().hook.vlft_seed(backend="cpu", seed=4, deterministic=False)
    assert not torch.are_deterministic_algorithms_enabled()
    # --num-workers 2: two worker processes (not this one) started, and torch told each it is one of 2
    workers = spies.started_workers()
    assert sorted(w["id"] for w in workers) == [0, 1] and {w["of"] for w in workers} == {2}, (
        f"DataLoader workers the run started: {workers or 'none'}"
    )
    assert len({w["pid"] for w in workers}) == 2 and os.getpid() not in {w["pid"] for w in workers}
    assert plan["dataloader"]["num_workers"] == 2
    assert [m["step"] for m in _metrics(out) if "loss" in m] == [1, 2, 3, 4]  # half of 16 records, 2 a step
    assert plan["targets"]["vision_blocks"] == [6, 7]  # the last 2 of the embedded model's 8
    assert plan["memory"]["fits"] is False  # planned for 1 MiB, trained anyway
    state = torch.load(out / "checkpoints" / "step-000004" / "state.pt", weights_only=False)
    assert {g["weight_decay"] for g in state["optimizer"]["param_groups"]} == {0.1}
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
    common = (
        "run",
        *brief_flags(
            batch_size=2, max_new_tokens=2, seed=4, save_every=2, data=train, val_data=val, output=out, steps=4
        ),
    )
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


def _video(path: Path, frames: int = 8, fps: int = 4, side: int = 64) -> None:
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = side, side, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((side, side, 3), (i * 30) % 256, dtype=np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def test_data_options_reach_the_samples_a_run_trains_on(demo, tmp_path):
    """--image-root (paths start there, not at the data file), --add-placeholders (records without <image>),
    --max-pixels (fewer image tokens), --video-fps and --video-max-frames (each alone: fewer frames): 2-step runs
    on such records, one option each, their plans' median (an image record) and longest sample (the video)
    against the same records encoded without the options."""
    train, _ = demo
    media = tmp_path / "media"
    shutil.copytree(Path(train).parent / "imgs", media / "imgs")
    _video(media / "clips" / "a.mp4", frames=16, fps=4, side=112)  # 4 s of 112 x 112: 8 x 8 patches of 14
    records = [json.loads(line) for line in Path(train).read_text().splitlines()][:6]
    for r in records[::2]:  # half without the placeholder
        r["conversations"][0]["value"] = r["conversations"][0]["value"].replace("<image>\n", "")
    answer = "it brightens from black to white, a step every quarter of a second, over the whole clip"
    video = {
        "video": "clips/a.mp4",
        "conversations": [{"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": answer}],
    }
    data = tmp_path / "data" / "train.jsonl"  # the images are not beside it: --image-root says where
    data.parent.mkdir()
    data.write_text("".join(json.dumps(r) + "\n" for r in [*records, video]))

    def lengths(name, *flags) -> dict:
        out = tmp_path / name
        code, output = cli_invoke(
            *BASE,
            "--data",
            data,
            "--val-data",
            data,
            "--output",
            out,
            "--steps",
            "2",
            "--image-root",
            media,
            "--add-placeholders",
            *flags,
        )
        assert code == 0, output
        assert [m["step"] for m in _metrics(out) if "loss" in m] == [1, 2]
        return json.loads((out / "plan.json").read_text())["lengths"]

    code, output = cli_invoke(*BASE, "--data", data, "--val-data", data, "--output", tmp_path / "no", "--steps", "2")
    assert code != 0 and "--image-root" in output  # without it the images are not found, nothing is written
    assert not (tmp_path / "no").exists()
    full = lengths("full")
    # the image records (the median): 112 x 112 pixels are 16 image tokens, 56 x 56 are 4
    assert full["median"] - lengths("pixels", "--max-pixels", "3136")["median"] == 12
    # the video (the longest sample, by its long answer, in every run): 2 frames make a temporal patch of 16 tokens
    # (8 x 8 patches, merged 2 x 2); its 16 frames at 4 fps give 8 frames at the default 2 fps (4 patches), 4 at
    # --video-fps 1 (2 patches) and 2 with --video-max-frames 2 (1 patch)
    longest = {
        "full": full["longest"],
        "fps": lengths("fps", "--video-fps", "1")["longest"],
        "frames": lengths("frames", "--video-max-frames", "2")["longest"],
    }
    assert (longest["full"] - longest["fps"], longest["full"] - longest["frames"]) == (2 * 16, 3 * 16), (
        f"the video's length by run (default, --video-fps 1, --video-max-frames 2): {longest}"
    )


def test_grouped_batches_under_two_processes_pad_less(tmp_path):
    """--group-by-length under 2 data-parallel processes: each process's micro-batches hold samples of
    similar length, so fewer of the positions computed are padding than in the plain shuffle (both logged
    as tokens_per_s against effective_tokens_per_s, over all processes)."""
    import os
    import subprocess

    from helpers import vlft_command
    from vlft.data.demo import write_varied_dataset

    data = write_varied_dataset(
        tmp_path / "varied", n=32, seed=3, min_side=28, max_side=96, max_images=1, answer_words=(1, 60), max_turns=1
    )
    ratios = {}
    for grouped in (False, True):
        out = tmp_path / f"run-{grouped}"
        args = [*BASE, "--data", data, "--val-data", data, "--output", out, "--steps", "8"]
        if grouped:  # 2 processes of micro-batch 2
            proc = subprocess.run(
                [*vlft_command(), *map(str, args), "--nproc-per-node", "2", "--group-by-length"],
                capture_output=True,
                text=True,
                timeout=600,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
        else:  # the plain shuffle, in micro-batches of 2 as well
            code, output = cli_invoke(*args)
            assert code == 0, output
        logged = [m for m in _metrics(out) if "loss" in m]
        assert len(logged) == 8
        ratios[grouped] = sum(m["tokens_per_s"] * m["step_time_s"] for m in logged) / sum(
            m["effective_tokens_per_s"] * m["step_time_s"] for m in logged
        )
    assert ratios[True] < 1 + 0.5 * (ratios[False] - 1), ratios  # at most half the padding
