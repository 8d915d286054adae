"""Video records in every family: a family with video takes a clip at the run's ``--video-fps`` and
``--video-max-frames`` (the frames the model receives are min(rate x duration, cap), rounded up to an even count,
a temporal patch being 2 frames) and the length check and memory plan count its tokens; a family without video
refuses the record naming itself, before step 1. The generic family takes video where the checkpoint's processor
has a video processor and the model a video path: a real run on a tiny InternVL checkpoint (frames folded into the
image input), and the encoding of a tiny LLaVA-NeXT-Video one (clips through ``get_video_features``). Real runs
on clips, images and text for SmolVLM2, LLaVA-OneVision and Gemma 4; under 2-process DDP, with a clip on one
process and only text on the other, for InternVL and GLM-4.1V (the text-only process must run the tower).

The test clip: 12 frames at 4 fps (3 s). At 2 fps, 6 frames; capped at 4, 4; at 1 fps, 3, made 4."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from generic_checkpoints import build

from helpers import cli_invoke, installed, vlft_command

QUESTION, ANSWER = "What colour is the product?", "red"
CLIP_FRAMES, CLIP_FPS = 12, 4
RATES = [((2.0, 16), 6), ((2.0, 4), 4), ((1.0, 16), 4)]  # (--video-fps, --video-max-frames) -> frames received


def _family_names() -> list[str]:
    from vlft.models.families import installed_families

    return [f.name for f in installed_families(installed()) if f.tiny is not None]


def _mp4(path: Path) -> Path:
    av = pytest.importorskip("av", reason="writing a test video needs PyAV (pip install av), not installed here")
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=CLIP_FPS)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(CLIP_FRAMES):
            arr = np.full((48, 64, 3), (i * 20) % 256, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _video(question=QUESTION, answer=ANSWER) -> dict:
    return {
        "video": "clips/a.mp4",
        "conversations": [{"from": "human", "value": f"<video>\n{question}"}, {"from": "gpt", "value": answer}],
    }


@pytest.fixture(scope="module")
def clip_data(tmp_path_factory) -> Path:
    """A folder with the clip, an image, and data files: one video record, and a mixed set (video, image, text)."""
    from PIL import Image

    root = tmp_path_factory.mktemp("video")
    _mp4(root / "clips" / "a.mp4")
    Image.new("RGB", (40, 30), (200, 10, 10)).save(root / "red.png")
    _write(root / "one.jsonl", [_video()])
    image = {"image": "red.png", "conversations": [{"from": "human", "value": f"<image>\n{QUESTION}"}]}
    image["conversations"].append({"from": "gpt", "value": ANSWER})
    text = {"conversations": [{"from": "human", "value": "Say yes."}, {"from": "gpt", "value": "yes"}]}
    _write(root / "mixed.jsonl", [_video(), text, image, _video("How many frames?", "four"), text])
    _write(root / "pair.jsonl", [_video(), text])  # under 2 processes: a clip on one, text only on the other
    return root


def _frames(sample: dict, processor) -> int:
    """The frames of the record's one clip as the model receives them, read from its inputs."""
    if "video_grid_thw" in sample:  # Qwen: (t, h, w) patches, t a temporal patch of frames
        return int(sample["video_grid_thw"][:, 0].sum()) * processor.video_processor.temporal_patch_size
    if "pixel_values_videos" in sample and sample["pixel_values_videos"].dim() == 5:
        # [clips, frames, C, H, W], or [frames, 1, C, H, W] (LLaVA-NeXT-Video built in: a clip's frames apart)
        return int(sample["pixel_values_videos"].shape[0] * sample["pixel_values_videos"].shape[1])
    if "num_frames_per_video" in sample:  # Gemma 4: every clip's frames laid end to end
        return int(sample["num_frames_per_video"].sum())
    if "pixel_values" in sample and sample["pixel_values"].dim() == 4:  # frames folded into the images (InternVL)
        return int(sample["pixel_values"].shape[0])
    if "pixel_values" in sample and sample["pixel_values"].dim() == 5:  # SmolVLM2: frames as tiles [frames, 1, ...]
        return int(sample["pixel_values"].shape[0])
    raise AssertionError(f"no clip input this test knows in {sorted(sample)}: add the family's layout here")


def _check_rates(processor, family, record) -> None:
    from vlft.data.encoding import SampleEncoder

    lengths = []
    for (fps, cap), frames in RATES:
        encoder = SampleEncoder(processor, family, video_fps=fps, video_max_frames=cap)
        sample = encoder.encode(record)
        assert _frames(sample, processor) == frames, (family.name, fps, cap)
        assert encoder.measure(record)[0] == len(sample["input_ids"]), family.name  # the length check's count
        assert (sample["labels"] != -100).sum() > 0
        lengths.append(len(sample["input_ids"]))
    assert lengths[0] > lengths[1] == lengths[2], (family.name, lengths)  # 6 frames cost more tokens than 4


@pytest.mark.parametrize("name", _family_names())
def test_each_family_takes_a_clip_at_the_runs_rate_or_refuses_it_naming_itself(name, clip_data):
    from vlft import DataError
    from vlft.data.encoding import SampleEncoder
    from vlft.data.records import read_records
    from vlft.models.embedded import embedded_family_dir
    from vlft.models.families import family_named
    from vlft.models.loading import load_processor

    registry = installed()
    family = family_named(registry, name)
    processor = load_processor(str(embedded_family_dir(family)), family, registry)
    [record] = read_records(clip_data / "one.jsonl")
    if family.video_inputs is None:
        with pytest.raises(DataError, match=f"videos are not supported for the {name} family"):
            SampleEncoder(processor, family).measure(record)
        return
    _check_rates(processor, family, record)


def test_the_generic_family_takes_a_clip_where_the_processor_and_model_have_a_video_path(clip_data, tmp_path_factory):
    """A LLaVA-NeXT-Video checkpoint read by the generic reader (the built-in family declared on it owns the model
    type now, so the reader is asked directly): its clips through get_video_features."""
    from transformers import AutoConfig

    from vlft.data.records import read_records
    from vlft.models.loading import load_processor
    from vlft_models import generic

    folder = build("llava_next_video", tmp_path_factory.mktemp("ckpt") / "llava_next_video")
    registry = installed()
    family = generic.read(AutoConfig.from_pretrained(folder), str(folder))
    assert family is not None and family.name == "generic" and family.video_inputs is not None
    assert "video <video>" in family.description, family.description
    processor = load_processor(str(folder), family, registry)
    [record] = read_records(clip_data / "one.jsonl")
    _check_rates(processor, family, record)


def test_a_generic_checkpoint_without_a_video_processor_refuses_a_clip_saying_why(clip_data, tmp_path_factory):
    from vlft import DataError
    from vlft.data.encoding import SampleEncoder
    from vlft.data.records import read_records
    from vlft.models.loading import load_processor, model_config_and_family

    folder = build("llava", tmp_path_factory.mktemp("ckpt") / "llava")
    registry = installed()
    _, family = model_config_and_family(str(folder), registry)
    assert family.video_inputs is None and "video none (its processor (LlavaProcessor) has no video" in (
        family.description
    )
    [record] = read_records(clip_data / "one.jsonl")
    with pytest.raises(DataError, match="videos are not supported for the generic family"):
        SampleEncoder(load_processor(str(folder), family, registry), family).measure(record)


def test_a_family_without_video_refuses_a_clip_before_step_1(clip_data, tmp_path):
    """Through the CLI: the run stops at the data check, naming the family, and writes no step."""
    from vlft.models.families import installed_families

    name = next(f.name for f in installed_families(installed()) if f.video_inputs is None and f.tiny is not None)
    out = tmp_path / "run"
    code, output = cli_invoke(
        "run", "--quiet", "--backend", "cpu", "--model", f"embedded:{name}", "--data", clip_data / "one.jsonl",
        "--output", out, "--steps", "2", "--eval-every", "0", "--save-every", "0",
    )  # fmt: skip
    assert code != 0 and f"videos are not supported for the {name} family" in output, output
    assert not (out / "metrics.jsonl").exists()


def test_a_run_of_llava_next_video_trains_on_clips_and_the_plan_counts_their_frames(clip_data, tmp_path):
    """The built-in LLaVA-NeXT-Video (declared on the generic family): a real `vlft run --packing on` on clips, images
    and text, 2 steps (packed equal to padded: check_family's, on images); each clip is (frames, S/p, S/p) for the memory plan (every frame one tile through the tower) at the run's
    --video-max-frames, the plan's longest sample is what encoding gives at that rate (here an image record's: an
    image's tiles cost more than 4 pooled frames), and the vision tower's adapters trained."""
    from safetensors.torch import load_file

    from vlft.data.encoding import SampleEncoder
    from vlft.data.records import read_records
    from vlft.models.embedded import embedded_family_dir
    from vlft.models.families import family_named
    from vlft.models.loading import load_processor

    registry = installed()
    family = family_named(registry, "llava-next-video")
    processor = load_processor(str(embedded_family_dir(family)), family, registry)
    [record] = read_records(clip_data / "one.jsonl")
    for cap, frames in ((16, 6), (4, 4)):  # 12 frames at 4 fps, sampled at 2 fps
        _, grids = SampleEncoder(processor, family, video_fps=2.0, video_max_frames=cap).measure(record)
        assert grids == [(frames, 4, 4)], (cap, grids)  # a 32 px frame of 8 px patches
    out = tmp_path / "run"
    code, output = cli_invoke(
        "run", "--quiet", "--backend", "cpu", "--model", "embedded:llava-next-video", "--data",
        clip_data / "mixed.jsonl", "--val-data", clip_data / "one.jsonl", "--output", out, "--steps", "2",
        "--batch-size", "2", "--log-every", "1", "--eval-every", "0", "--eval-samples", "1", "--max-new-tokens", "2",
        "--save-every", "0", "--lr", "3e-3", "--video-fps", "2", "--video-max-frames", "4", "--packing", "on",
    )  # fmt: skip
    assert code == 0, output
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    plan = json.loads((out / "plan.json").read_text())
    assert plan["model_family"]["name"] == "llava-next-video" and plan["packing"]["enabled"]
    encoder = SampleEncoder(processor, family, video_fps=2.0, video_max_frames=4)
    assert plan["lengths"]["longest"] == max(encoder.measure(r)[0] for r in read_records(clip_data / "mixed.jsonl"))
    weights = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    vision_b = [v for k, v in weights.items() if "lora_B" in k and "vision_tower" in k]
    assert vision_b and max(float(v.abs().max()) for v in vision_b) > 0


def test_glm_video_positions_are_the_models_and_a_packed_run_trains_on_clips(clip_data, tmp_path):
    """GLM-4.1V's clips (frames written by its processor after each frame's second): the positions packing builds
    for a video sample (the family's rope index) equal those the model computes unpacked, and a real `vlft run
    --packing` on clips, images and text trains 2 steps."""
    import torch
    from transformers import AutoModelForImageTextToText

    from vlft.data.encoding import SampleEncoder
    from vlft.data.records import read_records
    from vlft.models.embedded import embedded_family_dir
    from vlft.models.families import family_named
    from vlft.models.loading import load_processor

    registry = installed()
    family = family_named(registry, "glm4.1v")
    folder = embedded_family_dir(family)
    processor = load_processor(str(folder), family, registry)
    [record] = read_records(clip_data / "one.jsonl")
    sample = SampleEncoder(processor, family, video_fps=2.0, video_max_frames=4).encode(record)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    captured = []
    hook = model.model.language_model.register_forward_pre_hook(
        lambda mod, args, kwargs: captured.append(kwargs["position_ids"]), with_kwargs=True
    )
    inputs = {k: (v.unsqueeze(0) if k in ("input_ids", "mm_token_type_ids") else v) for k, v in sample.items()}
    try:
        with torch.no_grad():
            model(**{k: v for k, v in inputs.items() if k != "labels"})
    finally:
        hook.remove()
    mine = family.positions.rope_index(model.config, sample)
    assert torch.equal(mine[:, 0].long(), captured[0][-3:, 0].long())
    assert int(mine.max()) < len(sample["input_ids"])  # the frames' positions are compressed: a real clip

    out = tmp_path / "run"
    code, output = cli_invoke(
        "run", "--quiet", "--backend", "cpu", "--model", "embedded:glm4.1v", "--data", clip_data / "mixed.jsonl",
        "--val-data", clip_data / "one.jsonl", "--output", out, "--steps", "2", "--batch-size", "2",
        "--packing", "on", "--eval-every", "0", "--eval-samples", "1", "--max-new-tokens", "2", "--save-every", "0",
        "--video-fps", "2", "--video-max-frames", "4",
    )  # fmt: skip
    assert code == 0, output
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in logged if "loss" in m)


def _vision_trained(out: Path, tower: str) -> bool:
    """The vision adapters moved (LoRA B starts at 0): the tower's gradients reached them."""
    from safetensors.torch import load_file

    weights = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    vision_b = [v for k, v in weights.items() if "lora_B" in k and tower in k]
    return bool(vision_b) and max(float(v.abs().max()) for v in vision_b) > 0


# (family, --video-max-frames): LLaVA-OneVision's image record is 56 tokens, so its clip takes 8 frames to outgrow
# it; Gemma 4 pads every frame to its soft-token budget's patches (630 on the tiny model), so it takes the fewest
@pytest.mark.parametrize(("name", "cap"), [("smolvlm", 4), ("llava-onevision", 8), ("gemma4", 4)])
def test_a_run_trains_on_clips_images_and_text_where_the_family_has_video(name, cap, clip_data, tmp_path):
    """SmolVLM2 (frames as tiles, each after its timestamp), LLaVA-OneVision (frames pooled 2 x 2 through
    get_video_features) and Gemma 4 (each frame's soft tokens after its mm:ss): a real 2-step `vlft run` on clips,
    images and text-only records at --video-fps 4 and a --video-max-frames at which a clip outgrows the image
    record; the plan's longest sample is the clip at that rate and cap, and the vision adapters trained."""
    from vlft.data.encoding import SampleEncoder
    from vlft.data.records import read_records
    from vlft.models.embedded import embedded_family_dir
    from vlft.models.families import family_named
    from vlft.models.loading import load_processor

    out = tmp_path / "run"
    code, output = cli_invoke(
        "run", "--quiet", "--backend", "cpu", "--model", f"embedded:{name}", "--data", clip_data / "mixed.jsonl",
        "--val-data", clip_data / "one.jsonl", "--output", out, "--steps", "2", "--batch-size", "2", "--log-every", "1", "--eval-every", "0",
        "--save-every", "0", "--eval-samples", "1", "--max-new-tokens", "1", "--lr", "3e-3", "--video-fps", "4",
        "--video-max-frames", str(cap),
    )  # fmt: skip
    assert code == 0, output
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    registry = installed()
    family = family_named(registry, name)
    processor = load_processor(str(embedded_family_dir(family)), family, registry)
    encoder = SampleEncoder(processor, family, video_fps=4.0, video_max_frames=cap)
    clips = [encoder.measure(r)[0] for r in read_records(clip_data / "mixed.jsonl") if r.videos]
    assert json.loads((out / "plan.json").read_text())["lengths"]["longest"] == max(clips)
    assert _vision_trained(out, "vision")


def _ddp_clip_run(model: str, clip_data: Path, out: Path) -> Path:
    """A 2-step `vlft run --nproc-per-node 2` on ``pair.jsonl`` at --video-fps 2 --video-max-frames 4: at every
    step one process holds the clip and the other the text-only record."""
    args = [
        "run", "--nproc-per-node", "2", "--quiet", "--backend", "cpu", "--model", model,
        "--data", str(clip_data / "pair.jsonl"), "--val-data", str(clip_data / "one.jsonl"), "--output", str(out),
        "--steps", "2", "--batch-size", "2", "--log-every", "1", "--eval-every", "0", "--save-every", "0",
        "--eval-samples", "1", "--max-new-tokens", "1", "--lr", "3e-3", "--seed", "2",
        "--video-fps", "2", "--video-max-frames", "4",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*vlft_command(), *args], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert json.loads((out / "config.json").read_text())["world_size"] == 2
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    return out


def test_a_run_of_internvl_trains_on_clips_under_two_process_ddp_beside_a_text_only_process(clip_data, tmp_path):
    """A real `vlft run --model DIR` on a tiny InternVL checkpoint written by plain transformers (the built-in
    family, whose processor folds a clip's frames into its tiles), 2 processes: the one holding the text-only record
    runs the tower on the family's dummy image (the frames go in the image input, so one warm-up serves both), or
    DDP stops on parameters that took no part in its loss. The plan's longest sample is the clip at
    --video-max-frames 4, and the vision tower's adapters trained."""
    from vlft.data.encoding import SampleEncoder
    from vlft.data.records import read_records
    from vlft.models.loading import load_processor, model_config_and_family

    folder = build("internvl", tmp_path / "internvl")
    out = _ddp_clip_run(str(folder), clip_data, tmp_path / "run")
    plan = json.loads((out / "plan.json").read_text())
    assert plan["model_family"]["name"] == "internvl"
    registry = installed()
    _, family = model_config_and_family(str(folder), registry)
    encoder = SampleEncoder(load_processor(str(folder), family, registry), family, video_fps=2.0, video_max_frames=4)
    clips = [encoder.measure(r)[0] for r in read_records(clip_data / "pair.jsonl") if r.videos]
    assert plan["lengths"]["longest"] == max(clips)
    assert _vision_trained(out, ".vision_tower.")


def test_glm_clips_train_under_two_process_ddp_beside_a_text_only_process(clip_data, tmp_path):
    """GLM-4.1V, 2 processes: the one holding the text-only record runs the tower on the family's dummy clip
    (get_video_features), or DDP stops on parameters that took no part in its loss."""
    out = _ddp_clip_run("embedded:glm4.1v", clip_data, tmp_path / "run")
    assert _vision_trained(out, ".visual.")


def test_an_image_and_a_clip_in_one_turn_are_refused_where_the_processor_returns_both_under_one_name(clip_data):
    """SmolVLM2's video processor returns its frames as ``pixel_values``, the image processor's name: in one
    processor call the clip's would replace the image's, so the record is refused before step 1, saying how."""
    from vlft import DataError
    from vlft.data.encoding import SampleEncoder
    from vlft.data.records import read_records
    from vlft.models.embedded import embedded_family_dir
    from vlft.models.families import family_named
    from vlft.models.loading import load_processor

    both = {
        "video": "clips/a.mp4",
        "image": "red.png",
        "conversations": [{"from": "human", "value": f"<image><video>\n{QUESTION}"}, {"from": "gpt", "value": ANSWER}],
    }
    [record] = read_records(_write(clip_data / "both.jsonl", [both]))
    registry = installed()
    family = family_named(registry, "smolvlm")
    processor = load_processor(str(embedded_family_dir(family)), family, registry)
    with pytest.raises(DataError, match="put the image and the video in different turns"):
        SampleEncoder(processor, family, video_fps=2.0, video_max_frames=4).measure(record)


def test_gemma4s_dummy_clip_runs_the_vision_tower_through_get_video_features():
    """The warm-up a process without clips runs when the data holds them (Gemma 4's own video path): one blank
    frame of one soft token through get_video_features reaches every vision encoder layer."""
    from transformers import AutoModelForImageTextToText

    from vlft.models.embedded import embedded_family_dir
    from vlft.models.families import family_named

    family = family_named(installed(), "gemma4")
    model = AutoModelForImageTextToText.from_pretrained(embedded_family_dir(family))
    warmup = family.vision_dummy(model, "video")
    assert warmup.method == "get_video_features"
    out = getattr(warmup.module, warmup.method)(**warmup.inputs, return_dict=True)
    sum(t.sum() for t in out.pooler_output).backward()
    layers = model.model.vision_tower.encoder.layers
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layers.parameters() if p.dim() > 1)
