"""What a model-family plugin answers (``vlft_model_families``): a ``ModelFamily`` and its capabilities."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from vlft.contracts import contract

# A family is a small required core (name, model types, towers), groups with defaults (targets, chat, kernels)
# and capabilities it fills only when it has them: image inputs, video inputs, positions, packing, sharding,
# experts, a tiny model. Each is a small frozen dataclass the core reads; a family leaves a capability None
# where it lacks it, and the core then refuses what needs it, saying why. ``check_family``
# (``vlft.models.families``) checks them when the plugin's families are first asked for, naming plugin and field.

FAMILY_TOWERS = ("vision", "text", "both")
BATCH_JOINS = ("concat", "sequence", "concat_padded", "concat_last")


@contract
@dataclass
class Media:
    """A record's images and clips as a family's image inputs receive them (``ImageInputs.prepare``).

    ``images`` is None when only the sizes are known (the length check and the memory plan measure a record
    without decoding its images); a family may then answer from ``sizes`` alone or process blank images of
    those sizes. ``videos`` holds each clip as (frames ``[T, C, H, W]`` uint8 tensor, frames per second),
    already sampled at the run's ``--video-fps``."""

    sizes: list  # (width, height) of each image, in placeholder order
    images: list | None = None  # PIL images, or None when measuring
    videos: list = field(default_factory=list)
    where: str = ""  # the record's file:line, for errors


@contract
@dataclass
class Written:
    """What ``ImageInputs.write`` answers: each text's token ids with its images' tokens written in, and
    the sample's model inputs besides input_ids and labels (each key one of ``ImageInputs.batch_inputs``:
    a 'sequence' input 1-D over the texts' ids laid end to end, a 'concat' input the images' tensors),
    and the patch grid (t, h, w) of each image and clip where the family has one (the memory plan's)."""

    ids: list  # list[list[int]], one per text
    inputs: dict = field(default_factory=dict)
    grids: list = field(default_factory=list)


@contract
@dataclass(frozen=True)
class ImageInputs:
    """How an image becomes model inputs. Two calls per record: ``prepare`` once (its images, and its clips
    where the family has ``video_inputs``), ``write`` once per conversation over them (a preference pair's
    two share one ``prepare``). Whether the core or the processor writes an image's tokens into the text is
    the family's choice inside ``write``: the Qwen families repeat the image pad once per LLM token of the
    image grid; ``vlft.processor_image_inputs`` builds the answer for a processor that writes
    them itself (Gemma 3's)."""

    prepare: Callable[..., Any] = field(
        metadata={
            "help": "prepare(processor, media: vlft.Media, max_pixels: int | None) -> anything `write` takes: a "
            "record's images (and clips) as model inputs, capped at `max_pixels` by the family's own rule; "
            "with `media.images` None (measuring) from the sizes alone where it can."
        }
    )
    write: Callable[..., Any] = field(
        metadata={
            "help": "write(processor, texts: list[str], prepared) -> vlft.Written: each rendered text piece's token "
            "ids with the image tokens written in (the first piece with the tokenizer's special tokens, the "
            "others without), and the sample's extra model inputs."
        }
    )
    batch_inputs: dict = field(
        metadata={
            "help": "The model inputs `write` gives besides input_ids/labels, and how a batch joins each: 'concat' "
            "(along dim 0 over the samples that have it: pixel tensors, grids) or 'sequence' (one value per "
            "token, padded with 0 like input_ids and laid end to end by packing: Qwen's modality type per "
            "token, Gemma 3's token_type_ids) or 'concat_padded' (joined along dim 0 like 'concat', each "
            "tensor first padded with 0 at the end of its other dims to the batch's largest: LLaVA-OneVision's "
            "pixels [images, tiles, 3, H, W], whose tile count differs by image size, the model reading only "
            "each image's own tiles) or 'concat_last' (joined along the last dim: a NaViT-packed patch sequence "
            "[1, C, p, patches] holding every image of a batch in one row, of a NaViT-style tower; the model "
            "cuts it by its per-image sizes, joined 'concat')."
        }
    )
    pixels: str = field(
        default="pixel_values",
        metadata={
            "help": "The batch input holding an image's pixels: a batch without it has no image (the mixed-data "
            "warm-up runs the tower on a dummy then)."
        },
    )
    size_cap: str = field(
        default="",
        metadata={
            "help": "What `--max-pixels` means for this family, in words (Qwen: a pixel budget per image, the "
            "resize keeps the aspect ratio). '' : the family has no size cap, and `--max-pixels` is refused "
            "with that reason."
        },
    )
    grid: Callable[..., tuple] | None = field(
        default=None,
        compare=False,
        metadata={
            "help": "grid(height, width, max_pixels=None) -> (t, h, w): the patch grid of one image at the family's "
            "default budget, without pixels (the memory plan resizes grids by it for its --max-pixels "
            "advice). None: the plan gives no such advice."
        },
    )
    patch_size: int = field(
        default=0,
        metadata={"help": "The pixel side of one patch of `grid` (the memory plan turns a grid back into pixels)."},
    )
    patches_per_token: int = field(
        default=1,
        metadata={"help": "Patches per LLM token (Qwen: merge 2 x 2 = 4): the memory plan's tokens from patches."},
    )
    trace: Callable[..., Any] | None = field(
        default=None,
        compare=False,
        metadata={
            "help": "trace(tower, grids, dtype, run_block) -> features: run the vision tower's blocks once on the "
            "meta device for the memory plan, calling run_block(module, fn, block_input) around each block "
            "and run_block(module, fn) around each merger, so activations are counted per block. None: "
            "vision activations are not traced, and the plan says so."
        },
    )


@contract
@dataclass(frozen=True)
class VideoInputs:
    """A family that takes video clips: its ``image_inputs.prepare`` then receives them in ``Media.videos``.
    Without it a record with a video is refused, naming the family."""

    pixels: str = field(
        metadata={
            "help": "The batch input holding a clip's pixels (Qwen: pixel_values_videos): a batch without it has no "
            "clip (the mixed-data warm-up runs the tower on a dummy clip then)."
        }
    )
    grid: Callable[..., tuple] | None = field(
        default=None,
        compare=False,
        metadata={
            "help": "grid(frames, height, width, max_pixels=None) -> (t, h, w): the patch grid of a clip of `frames` "
            "sampled frames at the family's default budget (a family's tests check it against the "
            "processor)."
        },
    )


@contract
@dataclass(frozen=True)
class Positions:
    """A family whose model computes positions from more than the token index (Qwen's 3-D mRoPE): packing
    builds each sample's positions with it. None: plain 1-D positions (Gemma 3, LLaVA)."""

    rope_index: Callable[..., Any] = field(
        metadata={
            "help": "rope_index(model_config, sample: dict) -> LongTensor [rows, 1, L]: the positions of ONE encoded "
            "sample (its input_ids and the inputs `image_inputs.write` gave), exactly as the model computes "
            "them unpacked. Packing puts a text row in front of them and concatenates the samples."
        }
    )
    rows: int = field(default=3, metadata={"help": "Rows of `rope_index`'s answer (3 for mRoPE)."})


@contract
@dataclass(frozen=True)
class Packing:
    """A family whose samples can be laid end to end in one row (``--packing``): the attention keeps them
    apart where the text position row restarts, its 'sequence' batch inputs are laid end to end and its
    'concat' ones joined in order. None: the family cannot pack, and ``--packing on`` says so."""

    refusal: str = field(
        default="",
        metadata={
            "help": "Why this family's text model cannot keep packed samples apart after all, or '' where it can "
            "(Qwen3.5: its Gated DeltaNet layers carry state along the row unless run with varlen kernels)."
        },
    )
    probe: Callable[..., str] | None = field(
        default=None,
        compare=False,
        metadata={
            "help": "probe(model) -> str: '' where the loaded model (the base model, as the run loaded it: its "
            "attention, its dtype, on its device) keeps packed samples apart, else why not, with the numbers "
            "(the generic family: a packed and an unpacked forward of two token runs through its text model "
            "compared). Run once before step 1, in eval mode without gradients, where the run packs and each "
            "process holds the whole model; a non-empty answer stops the run. None: no probe."
        },
    )


@contract
@dataclass(frozen=True)
class Sharding:
    """How the model's work is cut over processes: ``--shard fsdp``'s units, and what ``--sequence-parallel``
    cuts besides the tokens."""

    no_split_modules: tuple[str, ...] = field(
        metadata={"help": "Block classes FSDP shards as units (the model class's `_no_split_modules`)."}
    )
    marked_inputs: dict[str, tuple[str, ...]] = field(
        default_factory=dict,
        metadata={
            "help": "The text model's inputs that mark positions of the sequence (a [batch, tokens] boolean mask), "
            "each with the inputs that hold one row per marked position (a tensor, or a list of tensors), in the "
            "mask's row-major order: Qwen3-VL's {'visual_pos_masks': ('deepstack_visual_embeds',)}, the image "
            "features its first decoder layers add at the image tokens. --sequence-parallel keeps each process's "
            "part of the mask and the rows of its marked positions. Empty: none (--sequence-parallel refuses a "
            "text model that takes inputs it does not know)."
        },
    )


@contract
@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts family's fused expert weights and routers."""

    parameters: tuple[str, ...] = field(
        metadata={
            "help": "Fused 3-D expert weights, relative to a decoder layer, for PEFT's `target_parameters` (e.g. "
            "'mlp.experts.gate_up_proj' [E, 2*I, H] and 'mlp.experts.down_proj' [E, H, I]). Adapted only "
            "when the method asks (`target_experts`)."
        }
    )
    routers: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "Router / gate modules relative to a decoder layer; they always stay frozen and are never "
            "targets (Qwen3-VL MoE 'mlp.gate'; Qwen3.5 MoE also 'mlp.shared_expert_gate', an nn.Linear "
            "hidden->1 that a leaf-name 'gate' match would otherwise catch)."
        },
    )


@contract
@dataclass(frozen=True)
class Towers:
    """Where the model's parts are: dotted attribute paths from the loaded ``*ForConditionalGeneration`` model
    (not a PEFT wrapper; the core resolves them on ``model.get_base_model()``)."""

    vision: str = field(
        default="",
        metadata={
            "help": "The vision encoder module; everything under it (blocks, mergers, patch embedding) is the "
            "vision side for freezing, memory accounting and dtype policies."
        },
    )
    vision_blocks: str = field(
        default="",
        metadata={"help": "The nn.ModuleList of vision transformer blocks; `--vision-last-n N` adapts its last N."},
    )
    vision_mergers: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "Projector(s) from the vision width to the text width. Qwen3-VL also has "
            "`model.visual.deepstack_merger_list` (a ModuleList): it belongs to the vision side and stays "
            "frozen with the tower unless the plan adapts it."
        },
    )
    decoder_layers: str = field(
        default="model.language_model.layers", metadata={"help": "The nn.ModuleList of text decoder layers."}
    )
    lm_head: str = field(default="lm_head", metadata={"help": "The output head (logits)."})


@contract
@dataclass(frozen=True)
class Targets:
    """What ``--targets`` and ``--vision-last-n`` select: the nn.Linear modules inside each vision block and
    decoder layer, as paths relative to it (the leaf name alone is ambiguous: Qwen2.5-VL's vision MLP and text
    MLP share names). Adapters take the attention ones; the MLP ones where a caller asks for them."""

    vision_attention: tuple[str, ...] = field(
        default=(), metadata={"help": "Linear modules inside each vision block for attention, relative to the block."}
    )
    vision_mlp: tuple[str, ...] = field(
        default=(), metadata={"help": "Linear modules inside each vision block for the MLP, relative to the block."}
    )
    text_attention: tuple[str, ...] = field(
        default=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
        metadata={"help": "Linear modules inside each decoder layer for (full) attention, relative to the layer."},
    )
    text_linear_attention: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "Linear modules of linear-attention layers (Qwen3.5's Gated DeltaNet, `linear_attn.*`) that "
            "are targets. Layers of the other type simply lack them."
        },
    )
    text_mlp: tuple[str, ...] = field(
        default=("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
        metadata={"help": "Linear modules inside each decoder layer for the dense MLP (or a MoE's shared expert)."},
    )
    default: str = field(
        default="both",
        metadata={"help": "What `--targets auto` means: vision, text or both (a method's own default wins)."},
    )


@contract
@dataclass(frozen=True)
class Chat:
    """The processor, its chat template and the model's conventions in text."""

    processor_class: str = field(
        default="",
        metadata={
            "help": "transformers processor class name (a helper outside a run finds a processor's family by it)."
        },
    )
    load_processor: Callable[[str], Any] | None = field(
        default=None,
        compare=False,
        metadata={"help": "load_processor(path) -> processor for a model folder (AutoProcessor by default)."},
    )
    bundled_processor: Callable[[str, Any], Any] | None = field(
        default=None,
        compare=False,
        metadata={
            "help": "bundled_processor(config_dir, tokenizer) -> processor for a weightless bundled config: its "
            "image/video processor from the folder, the given stand-in tokenizer, the family's template. "
            "None: bundled configs of this family cannot be planned."
        },
    )
    reply_end_token: str = field(
        default="",
        metadata={
            "help": "The token that closes an assistant turn in the template (the trained reply ends there). Qwen: "
            "<|im_end|> (= the tokenizer's eos). Gemma 3: <end_of_turn>, while its eos is <eos>."
        },
    )
    reply_end_appended: bool = field(
        default=False,
        metadata={
            "help": "The chat template leaves each assistant reply open: the turn ends where the next turn's role token "
            "begins, and generation stops on it (GLM-4.1V: `<|user|>`, one of its generation eos ids). True: the "
            "core trains `reply_end_token` as each reply's last token, that of the next turn's start where one "
            "follows (the ids then equal the template's render) and appended after the last reply, so the model "
            "learns to stop. False: the template writes the reply end itself (Qwen's <|im_end|>)."
        },
    )
    last_reply_only: bool = field(
        default=False,
        metadata={
            "help": "The model takes one prompt and one reply, not turns (a prefix-LM: PaliGemma's image and prompt "
            "attended both ways, the reply causally): the conversation up to its last reply is rendered as the "
            "prompt (the family's template writes earlier turns into it) and only that last reply trains. False: "
            "every assistant reply is a trained piece."
        },
    )
    template_kwargs: dict = field(
        default_factory=dict,
        compare=False,
        metadata={
            "help": "Extra keyword arguments for apply_chat_template (Qwen3.5: enable_thinking=False, so prompt "
            "and reply split cleanly)."
        },
    )
    box_coordinates: str = field(
        default="absolute",
        metadata={
            "help": "Grounding convention: 'absolute' pixels of the resized image (Qwen2.5-VL), 'relative-1000' "
            "(Qwen3-VL, Qwen3.5) or 'relative-1' (fractions of the image: LLaVA's). vlft never converts "
            "silently."
        },
    )


@contract
@dataclass(frozen=True)
class Kernels:
    """What backends' kernel patches (``vlft_kernel_patches``) may rewrite in this family's model."""

    vision_stem: str = field(
        default="",
        metadata={
            "help": "The vision patch embedding module (its `proj` a Conv3d whose kernel equals its stride, for "
            "Qwen2-VL to Qwen3.5: `model.visual.patch_embed`); a backend's kernel patch may replace the "
            "convolution with an equal matmul. Empty: no such patch is offered."
        },
    )
    targets: dict = field(
        default_factory=dict,
        compare=False,
        metadata={
            "help": "What fused-op kernel patches may replace, by role: 'rms_norm' and 'gated_mlp' (module class "
            "names, a gated MLP being `down_proj(act(gate_proj(x)) * up_proj(x))`), 'rotary' "
            "('module:function' names of q/k rotary functions `f(q, k, cos, sin, ...)`). Empty: none."
        },
    )


@contract
@dataclass(frozen=True)
class Tiny:
    """The family's tiny embedded model (``--model embedded:<name>``), built offline on first use."""

    build: Callable[..., None] = field(
        compare=False,
        metadata={
            "help": "build(path, corpus=None): writes a tiny random model of the family + processor there "
            "(offline), its tokenizer trained on `corpus` (a list of strings, the demo task's words) where "
            "given."
        },
    )
    recipe: dict = field(
        default_factory=dict,
        compare=False,
        metadata={"help": "The tiny model's recipe; its hash names the cache folder."},
    )


CAPABILITIES = {
    "image_inputs": ImageInputs,
    "video_inputs": VideoInputs,
    "positions": Positions,
    "packing": Packing,
    "sharding": Sharding,
    "experts": Experts,
    "tiny": Tiny,
}
GROUPS = {"towers": Towers, "targets": Targets, "chat": Chat, "kernels": Kernels}


@contract
@dataclass(frozen=True)
class ModelFamily:
    """Everything vlft needs to know about one model family (one or more ``model_type`` values): a required
    core (name, model types, towers), groups with defaults (``GROUPS``: targets, chat, kernels), then optional
    capabilities (``CAPABILITIES``), each None where the family lacks it."""

    name: str = field(
        metadata={"help": "Short name, used in `--model embedded:<name>` and `vlft plugins`, e.g. 'qwen3-vl'."}
    )
    model_types: tuple[str, ...] = field(
        metadata={"help": "The `config.model_type` values this family owns, e.g. ('qwen3_vl',)."}
    )
    towers: Towers = field(metadata={"help": "Where the towers are (vlft.Towers): module paths."})
    description: str = field(default="", metadata={"help": "One line for `vlft plugins`."})
    plugin: str = field(
        default="",
        compare=False,
        metadata={
            "help": "Leave it empty: vlft fills it in when it loads the family (the plugin that offered it), so "
            "errors and `vlft plugins` name the plugin."
        },
    )
    targets: Targets = field(
        default_factory=Targets, metadata={"help": "What --targets and --vision-last-n select (vlft.Targets)."}
    )
    chat: Chat = field(
        default_factory=Chat,
        compare=False,
        metadata={"help": "The processor, the chat template and the grounding convention (vlft.Chat)."},
    )
    kernels: Kernels = field(
        default_factory=Kernels,
        compare=False,
        metadata={"help": "What backends' kernel patches may rewrite (vlft.Kernels)."},
    )

    # --- loading and running -----------------------------------------------------------------------------
    load_kwargs: Callable[[str], dict] | None = field(
        default=None,
        compare=False,
        metadata={
            "help": "load_kwargs(param_dtype) -> extra keyword arguments for transformers' from_pretrained/from_config "
            "(the run's model, its meta-device plan copy and evaluation), given the parameter dtype the "
            "precision policy chose ('float32', 'bfloat16', ...). The MoE families return "
            "{'experts_implementation': 'eager'} for float32: transformers 5.2x runs fused experts with "
            "torch._grouped_mm, which takes only 16-bit weights (its meta-device and CUDA kernels refuse "
            "fp32). None: no extra arguments."
        },
    )
    vision_dummy: Callable[..., Any] | None = field(
        default=None,
        compare=False,
        metadata={
            "help": "vision_dummy(model, modality) -> VisionWarmup or None: the smallest input the vision tower takes "
            "for 'image' or 'video' (the module with the features method, the method's name and its keyword "
            "arguments). Every run whose data holds that modality runs it on each training step whose batch lacks "
            "it (and, sharded, on evaluation's first pass), so every process uses the same parameters (DDP) "
            "and gathers the same blocks (FSDP), and 1 process trains as N. None: a multi-process run on data "
            "that mixes text-only and image records may fail there."
        },
    )
    trace_layer_kwargs: Callable[..., dict] | None = field(
        default=None,
        compare=False,
        metadata={
            "help": "trace_layer_kwargs(text_model, hidden) -> dict: extra keyword arguments each decoder layer takes "
            "when the memory plan runs the text layers one by one on the meta device (called once per trace, "
            "the answer shared by the layers; `hidden` is the [samples, tokens, width] meta input), for what "
            "the text model hands its layers besides hidden states, mask and rotary tables (Gemma 4: the "
            "shared_kv_states dict every layer writes, and per_layer_input where the config has per-layer "
            "embeddings). None: no extra arguments."
        },
    )

    # --- capabilities (None: the family lacks it; see CAPABILITIES) -------------------------------------
    image_inputs: ImageInputs | None = field(
        default=None,
        compare=False,
        metadata={
            "help": "How an image becomes model inputs (vlft.ImageInputs). None: the family trains on text only, "
            "and a record with an image is refused."
        },
    )
    video_inputs: VideoInputs | None = field(
        default=None,
        compare=False,
        metadata={"help": "The family takes video clips (vlft.VideoInputs). None: a record with a video is refused."},
    )
    positions: Positions | None = field(
        default=None,
        compare=False,
        metadata={
            "help": "Positions beyond the token index, e.g. 3-D mRoPE (vlft.Positions). None: plain 1-D positions."
        },
    )
    packing: Packing | None = field(
        default=None,
        compare=False,
        metadata={
            "help": "The family's samples can be packed into one row (vlft.Packing). None: `--packing on` is refused "
            "and `auto` pads."
        },
    )
    sharding: Sharding | None = field(
        default=None,
        compare=False,
        metadata={"help": "FSDP's units (vlft.Sharding). None: the model class's own `_no_split_modules`."},
    )
    experts: Experts | None = field(
        default=None,
        compare=False,
        metadata={
            "help": "Fused expert weights and routers of a mixture-of-experts family (vlft.Experts). None: dense."
        },
    )
    tiny: Tiny | None = field(
        default=None,
        compare=False,
        metadata={"help": "The family's tiny embedded model (vlft.Tiny). None: no `--model embedded:<name>`."},
    )

    def owns(self, model_type: str | None) -> bool:
        return model_type in self.model_types

    def label(self) -> str:
        """How errors name the family: "family 'gemma3' (plugin vlft_example_plugin)"."""
        return f"family '{self.name}'" + (f" (plugin {self.plugin})" if self.plugin else "")

    def call(self, what: str, fn: Callable[..., Any], *args, **kwargs):
        """``fn`` (one of this family's functions, ``what`` its field), an error inside it raised as a PluginError
        naming the family, its plugin and the field; vlft's own errors (a bad record) pass as they are."""
        from vlft.errors import call_plugin

        return call_plugin(self.label(), what, fn, *args, **kwargs)

    def vision_side(self) -> tuple[str, ...]:
        """The roots of every vision-side module: the tower and any projector outside it."""
        towers = self.towers
        return (towers.vision, *(m for m in towers.vision_mergers if not m.startswith(towers.vision + ".")))


def model_family_help() -> dict[str, str]:
    """Each ``ModelFamily`` field's help, a group's or capability's fields as ``towers.vision`` (the guide's
    family section names them all; tests/test_family_contract.py checks)."""
    out = {f.name: f.metadata.get("help", "") for f in fields(ModelFamily)}
    for cap, cls in {**GROUPS, **CAPABILITIES}.items():
        out.update({f"{cap}.{f.name}": f.metadata.get("help", "") for f in fields(cls)})
    return out


@contract
@dataclass
class VisionWarmup:
    """How to run one modality's tower on a dummy input (``ModelFamily.vision_dummy``): the module holding
    the features method (``get_image_features``), that method's name and its keyword arguments (tensors on
    the host, moved per call)."""

    module: Any
    method: str
    inputs: dict


@contract
@dataclass(frozen=True)
class FamilyReader:
    """A family read from a checkpoint itself (``vlft_family_readers``), for a ``model_type`` no plugin's
    ``ModelFamily`` owns: asked at plan time with the checkpoint's config and folder, after every offered
    family declined it."""

    name: str = field(metadata={"help": "Short name, as `vlft plugins` lists it, e.g. 'generic'."})
    description: str = field(metadata={"help": "One line for `vlft plugins`: which checkpoints it reads."})
    read: Callable[..., Any] = field(
        compare=False,
        metadata={
            "help": "read(model_config, path: str | None) -> ModelFamily or None: the family of this checkpoint, "
            "its towers and targets found in the model's module tree and its chat conventions in the processor "
            "at `path` (None: a model already loaded, no folder to read), or None where the checkpoint is not one "
            "it reads. It raises vlft.ConfigError naming what it could not find in a checkpoint it should read."
        },
    )
