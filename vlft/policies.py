"""Plain answers that plugins give and the run uses.

Every concern a backend or method decides is resolved once, at set-up, into
one of these dataclasses. The training step reads them; it calls no hooks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable


@dataclass(frozen=True)
class BackendInfo:
    """What ``vlft_backends()`` answers: one entry per backend a plugin offers."""

    name: str
    description: str
    device_type: str  # the torch device type: "cpu", "cuda", "npu", ...
    priority: int = 0  # ``--backend auto`` takes the available backend with the highest priority


@dataclass(frozen=True)
class MethodInfo:
    """What ``vlft_methods()`` answers: one entry per adapter method a plugin offers."""

    name: str
    description: str


@dataclass(frozen=True)
class ObjectiveInfo:
    """What ``vlft_objectives()`` answers: one entry per training objective a plugin offers (``--objective``)."""

    name: str
    description: str


@dataclass
class ProbeResult:
    """Whether a backend can run here; ``reason`` says why not, with the fix."""

    available: bool
    reason: str = ""
    device_count: int = 0
    versions: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


@dataclass
class DeviceSetup:
    """The device a process trains on, and the environment set for it."""

    device: Any  # torch.device
    local_rank: int = 0
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class AttentionPolicy:
    """Attention implementation per tower ("eager", "sdpa", "flash_attention_2")."""

    vision: str
    text: str
    reason: str = ""
    # how the text attention keeps packed samples apart (``--packing``): "varlen" (flash-attention takes each
    # sample's bounds from the text position row), "segments" (sdpa or eager run per sample, see
    # ``models.segments``) or "" (it cannot: runs pad). None: derived from ``text`` (``packing_path``).
    packing: str | None = None
    packing_reason: str = ""

    def packing_path(self) -> tuple[str, str]:
        """("varlen" | "segments" | "", why): how packed samples are kept apart in the text attention."""
        if self.packing is not None:
            return self.packing, self.packing_reason or f"the backend says {self.packing or 'no packing'}"
        if self.text == "flash_attention_2":
            return "varlen", "flash_attention_2 finds each sample's bounds from the text position row"
        if self.text in ("sdpa", "eager"):
            return "segments", (f"{self.text} runs sample by sample, the row cut where its text position row "
                                f"restarts")
        return "", f"no known way for text attention '{self.text}' to keep packed samples apart"

    def as_attn_implementation(self) -> str | dict[str, str]:
        """The value for ``from_pretrained(attn_implementation=...)``."""
        if self.vision == self.text:
            return self.text
        return {"vision_config": self.vision, "text_config": self.text, "": self.text}


@dataclass
class PrecisionPolicy:
    """Parameter dtype, autocast, and loss scaling.

    ``make_scaler`` builds the gradient scaler when ``loss_scaling`` is on;
    the backend owns it because each device has its own (torch.amp,
    torch.npu.amp, ...).
    """

    name: str  # "fp32", "bf16", "fp16"
    param_dtype: str = "float32"  # the frozen base weights; trainable (adapter) weights are always float32
    autocast_dtype: str | None = None  # None: no autocast
    loss_scaling: bool = False
    init_scale: float = 2.0 ** 16
    growth_interval: int = 2000
    reason: str = ""
    param_reason: str = ""  # why the base weights have ``param_dtype``
    # 4-bit NF4 base weights (QLoRA): whether this backend can train on them, and why (not); the backend's answer
    four_bit: bool = False
    four_bit_reason: str = ""
    quantization: str | None = None  # "nf4" once asked for and offered; linear weights then 4-bit
    double_quant: bool = False  # the per-block constants quantized again (8-bit, one fp32 per 256 blocks)
    # torch's fused AdamW runs on this device and skips a step on the device when told ``found_inf`` (as
    # GradScaler tells it): the non-finite guard then copies nothing (used on accelerators; the CPU reads the
    # flag on the host). False (the default) keeps the copy-and-restore guard, which the memory plan counts;
    # a backend says True only where it was tried
    fused_optimizer: bool = False
    make_scaler: Callable[[], Any] | None = field(default=None, repr=False, compare=False)

    def describe(self) -> dict:
        d = asdict(self)
        d.pop("make_scaler")
        return d


@dataclass
class DataLoaderOptions:
    """Keyword arguments for ``torch.utils.data.DataLoader``; plugins may each add some."""

    pin_memory: bool = False
    num_workers: int = 0
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    reasons: list[str] = field(default_factory=list)

    def loader_kwargs(self) -> dict:
        kw: dict[str, Any] = {"pin_memory": self.pin_memory, "num_workers": self.num_workers}
        if self.num_workers > 0:
            kw["persistent_workers"] = self.persistent_workers
            if self.prefetch_factor is not None:
                kw["prefetch_factor"] = self.prefetch_factor
        return kw


@dataclass
class DistributedOptions:
    """How processes talk: the process-group backend, its timeout and environment, and whether
    ``--shard fsdp`` (torch FSDP2) works on it.

    ``fsdp`` is False unless the backend says so: FSDP2 needs the process group's all-gather and
    reduce-scatter and DTensor support on the device, which a backend author has to have tried.
    ``fsdp_reason`` says why not (or any caveat); it is shown to a user who asks for sharding.
    """

    process_group_backend: str  # "gloo", "nccl", "hccl", ...
    timeout_s: int = 1800
    env: dict[str, str] = field(default_factory=dict)
    reason: str = ""
    fsdp: bool = False
    fsdp_reason: str = ""
    # FSDP2 averages gradients with ReduceOp.AVG where it can; a process group without a trustworthy AVG
    # asks it to reduce with SUM and divide by the world size itself (set_force_sum_reduction_for_comms)
    sum_reductions: bool = False


@dataclass
class MemoryStats:
    """Device memory figures in bytes, for reports; None where the device cannot tell."""

    peak_bytes: int | None = None
    current_bytes: int | None = None


@dataclass
class DeviceCapacity:
    """How much memory one process's device offers, for the memory plan.

    ``total_bytes`` None means the backend cannot tell here (a dry run for a
    device this machine lacks); ``--device-memory`` then supplies it.
    ``reserved_bytes`` is what the runtime itself takes outside the tensors
    vlft counts (CUDA context, cuBLAS workspace, HCCL buffers, interpreter).
    """

    total_bytes: int | None
    reserved_bytes: int = 0
    source: str = ""
    # the device's dense peak FLOP/s at the run's compute dtype, where the backend knows it: the model FLOPs
    # utilisation (MFU) in metrics.jsonl is given against it, and left out where it is None
    peak_flops: float | None = None


@dataclass(frozen=True)
class KernelPatch:
    """One faster kernel a backend offers for a model (``vlft_kernel_patches``): declared at plan time,
    chosen or declined there (``--kernels``), applied once to the loaded base model.

    ``available`` says whether its ``condition`` holds here and ``reason`` says why or why not (the
    versions, the capability, the package found or missing). ``default`` False keeps an available patch off
    under ``--kernels auto`` (the user names it to take it); ``reason`` then says why it is opt-in.
    ``attention`` is a per-tower attention implementation (``{"vision": "flash_attention_2"}``) the model
    must be loaded with for the patch; ``apply(model)`` rewrites the loaded base model in place (before the
    adapter and before it moves to the device) and returns one line saying what it changed. ``check`` names
    the test that shows the patch equal to what it replaces (empty where none can run here).
    """

    name: str  # what ``--kernels NAME`` selects, e.g. "linear-patch-embed"
    replaces: str  # what it replaces, e.g. "Conv3d patch embedding"
    why: str  # the measured reason to take it
    condition: str  # when it applies: package, version, device capability, model
    available: bool  # the condition holds here
    reason: str = ""  # why it is (not) available here
    default: bool = True  # taken by ``--kernels auto`` when available
    attention: dict = field(default_factory=dict, compare=False)  # tower -> implementation it needs
    apply: Callable[[Any], str] | None = field(default=None, repr=False, compare=False)
    check: str = ""  # the equivalence test (file::name), where one exists
    backend: str = ""  # the backend that offers it

    def describe(self) -> dict:
        return {k: getattr(self, k) for k in ("name", "replaces", "why", "condition", "available", "reason",
                                              "default", "attention", "check", "backend")}


@dataclass
class AdapterDefaults:
    """A method's hyper-parameters and where it adapts by default.

    ``text_modules`` and ``vision_modules`` are the leaf names of the linear
    layers to adapt inside text decoder layers and vision blocks; the shared
    target selection turns them into full module names.
    """

    method: str
    lr: float
    hyperparameters: dict[str, Any]
    text_modules: tuple[str, ...] = ()
    vision_modules: tuple[str, ...] = ()
    default_targets: str = "both"  # what ``--targets auto`` means for this method
    # the method also adapts a mixture-of-experts family's fused expert weights (ModelFamily.expert_parameters):
    # the core then passes them to vlft_apply_adapter as ``target_parameters`` (routers stay frozen)
    target_experts: bool = False
    help: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass
class DoctorCheck:
    """One line of ``vlft doctor``: what was checked, whether it is fine, and the one-line fix when not.

    ``blocking`` False marks advice (say, a suspicious environment variable)
    that does not by itself stop the backend from running.
    """

    name: str
    ok: bool
    detail: str
    fix: str = ""
    blocking: bool = True


class MetricSink:
    """Where logged metrics go besides ``metrics.jsonl`` (``--report-to``): returned by ``vlft_metric_sink``.

    ``write`` receives each record ``metrics.jsonl`` receives (``step`` plus scalars); ``close`` is
    called once at the end of the run. A plain object: the training loop calls it without hooks.
    """

    def write(self, record: dict) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


# -- model families --------------------------------------------------------------------------------------

FAMILY_TOWERS = ("vision", "text", "both")


@dataclass(frozen=True)
class ModelFamily:
    """Everything vlft needs to know about one model family (one or more ``model_type`` values)."""

    # --- identity -------------------------------------------------------------------------------------
    name: str = field(metadata={"help": "Short name, used in `--model embedded:<name>` and `vlft plugins`, "
                                        "e.g. 'qwen3-vl'."})
    model_types: tuple[str, ...] = field(metadata={"help": "The `config.model_type` values this family owns, "
                                                           "e.g. ('qwen3_vl',)."})
    description: str = field(default="", metadata={"help": "One line for `vlft plugins`."})

    # --- towers (dotted paths from the *ForConditionalGeneration model) --------------------------------
    vision_tower: str = field(default="", metadata={
        "help": "The vision encoder module; everything under it (blocks, mergers, patch embedding) is the "
                "vision side for freezing, memory accounting and dtype policies."})
    vision_blocks: str = field(default="", metadata={
        "help": "The nn.ModuleList of vision transformer blocks; `--vision-last-n N` adapts its last N."})
    vision_mergers: tuple[str, ...] = field(default=(), metadata={
        "help": "Projector(s) from the vision width to the text width. Qwen3-VL also has "
                "`model.visual.deepstack_merger_list` (a ModuleList): it belongs to the vision side and stays "
                "frozen with the tower unless the plan adapts it."})
    decoder_layers: str = field(default="model.language_model.layers", metadata={
        "help": "The nn.ModuleList of text decoder layers."})
    embed_tokens: str = field(default="model.language_model.embed_tokens", metadata={
        "help": "The input token embedding (tied to the head where `tie_word_embeddings`)."})
    lm_head: str = field(default="lm_head", metadata={"help": "The output head (logits)."})

    # --- what --targets / --vision-last-n select (leaf names of nn.Linear modules) ---------------------
    vision_attention: tuple[str, ...] = field(default=(), metadata={
        "help": "Linear modules inside each vision block for attention, as paths relative to the block "
                "(the leaf name alone is ambiguous: Qwen2.5-VL's vision MLP and text MLP share names)."})
    vision_mlp: tuple[str, ...] = field(default=(), metadata={
        "help": "Linear modules inside each vision block for the MLP, relative to the block."})
    text_attention: tuple[str, ...] = field(default=("self_attn.q_proj", "self_attn.k_proj",
                                                     "self_attn.v_proj", "self_attn.o_proj"), metadata={
        "help": "Linear modules inside each decoder layer for (full) attention, relative to the layer."})
    text_linear_attention: tuple[str, ...] = field(default=(), metadata={
        "help": "Linear modules of linear-attention layers (Qwen3.5's Gated DeltaNet, `linear_attn.*`) that "
                "are targets. Layers of the other type simply lack them."})
    text_linear_attention_optional: tuple[str, ...] = field(default=(), metadata={
        "help": "Linear modules of linear-attention layers that exist but are not targets by default "
                "(Qwen3.5's per-head gates `in_proj_a`/`in_proj_b`, hidden -> num_value_heads)."})
    text_mlp: tuple[str, ...] = field(default=("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"), metadata={
        "help": "Linear modules inside each decoder layer for the dense MLP (or a MoE's shared expert)."})
    default_targets: str = field(default="both", metadata={"help": "What `--targets auto` means: vision, text "
                                                                      "or both."})
    default_vision_last_n: int = field(default=6, metadata={"help": "Default `--vision-last-n`."})
    default_parts: tuple[str, ...] = field(default=("attention",), metadata={
        "help": "Which module groups an adapter takes by default: 'attention' (today's behaviour: "
                "q/k/v/o and the vision qkv/proj, plus linear attention), 'mlp', or both."})

    # --- mixture of experts ------------------------------------------------------------------------------
    expert_parameters: tuple[str, ...] = field(default=(), metadata={
        "help": "Fused 3-D expert weights, relative to a decoder layer, for PEFT's `target_parameters` "
                "(e.g. 'mlp.experts.gate_up_proj' [E, 2*I, H] and 'mlp.experts.down_proj' [E, H, I]). Empty for "
                "dense models. Not adapted unless asked."})
    router_modules: tuple[str, ...] = field(default=(), metadata={
        "help": "Router / gate modules relative to a decoder layer; they always stay frozen and are never "
                "targets (Qwen3-VL MoE 'mlp.gate'; Qwen3.5 MoE also 'mlp.shared_expert_gate', an nn.Linear "
                "hidden->1 that a leaf-name 'gate' match would otherwise catch)."})

    load_kwargs: Callable[[str], dict] | None = field(default=None, compare=False, metadata={
        "help": "load_kwargs(param_dtype) -> extra keyword arguments for transformers' from_pretrained/from_config "
                "(the run's model, its meta-device plan copy and evaluation), given the parameter dtype the "
                "precision policy chose ('float32', 'bfloat16', ...). The MoE families return "
                "{'experts_implementation': 'eager'} for float32: transformers 5.2x runs fused experts with "
                "torch._grouped_mm, which takes only 16-bit weights (its meta-device and CUDA kernels refuse "
                "fp32). None: no extra arguments."})

    # --- tokens and the resize rule --------------------------------------------------------------------
    image_token: str = field(default="", metadata={"help": "Placeholder repeated once per image "
                                                                         "token."})
    video_token: str = field(default="", metadata={"help": "Placeholder repeated once per video "
                                                                         "token."})
    vision_start_token: str = field(default="", metadata={"help": "Opens an image/video (per "
                                                                                   "frame for Qwen3-VL/3.5)."})
    vision_end_token: str = field(default="", metadata={"help": "Closes it."})
    patch_size: int = field(default=0, metadata={"help": "Vision patch side in pixels."})
    merge_size: int = field(default=1, metadata={"help": "Spatial merge (tokens = patches / merge_size**2)."})
    temporal_patch_size: int = field(default=1, metadata={"help": "Frames per temporal patch."})
    image_min_pixels: int = field(default=0, metadata={"help": "The image processor's default "
                                                                      "size['shortest_edge'] (a pixel budget)."})
    image_max_pixels: int = field(default=0, metadata={"help": "Default size['longest_edge']."})
    video_min_pixels: int = field(default=0, metadata={"help": "The video processor's default "
                                                                           "size['shortest_edge']."})
    video_max_pixels: int = field(default=0, metadata={"help": "Default size['longest_edge'] "
                                                                          "(Qwen3-VL: over all frames)."})
    image_tokens: Callable[..., int] | None = field(default=None, compare=False, metadata={
        "help": "image_tokens(height, width, min_pixels=None, max_pixels=None) -> LLM tokens of one image "
                "by the family's own resize rule (None: the defaults above)."})
    video_tokens: Callable[..., int] | None = field(default=None, compare=False, metadata={
        "help": "video_tokens(frames, height, width, min_pixels=None, max_pixels=None) -> video pad tokens "
                "(excluding per-frame timestamps and vision start/end, which are text)."})
    box_coordinates: str = field(default="absolute", metadata={
        "help": "Grounding convention: 'absolute' pixels of the resized image (Qwen2.5-VL) or 'relative-1000' "
                "(Qwen3-VL, Qwen3.5). vlft never converts silently."})

    # --- processor ---------------------------------------------------------------------------------------
    processor_class: str = field(default="", metadata={"help": "transformers processor class name."})
    load_processor: Callable[[str], Any] | None = field(default=None, compare=False, metadata={
        "help": "load_processor(path) -> processor for a model folder (AutoProcessor by default)."})
    bundled_processor: Callable[[str, Any], Any] | None = field(default=None, compare=False, metadata={
        "help": "bundled_processor(config_dir, tokenizer) -> processor for a weightless bundled config: its "
                "image/video processor from the folder, the given stand-in tokenizer, the family's template."})
    processor_expands_placeholders: bool = field(default=False, metadata={
        "help": "Who writes an image's tokens into the text. False (Qwen): vlft's encoder repeats `image_token` "
                "once per LLM token (the image grid's product / merge_size**2) and builds the batch's "
                "mm_token_type_ids itself. True: the family's processor does it (`processor(text=, images=)` per "
                "rendered piece, e.g. Gemma 3's fixed <start_of_image><image_soft_token>*N<end_of_image>); the "
                "encoder keeps every processor output `batch_inputs` names (its 'sequence' keys, e.g. "
                "token_type_ids, aligned with input_ids) and the collator joins exactly those. Images only: "
                "videos are refused there."})
    reply_end_token: str = field(default="", metadata={
        "help": "The token that closes an assistant turn in the template (the trained reply ends there). Qwen: "
                "<|im_end|> (= the tokenizer's eos). Gemma 3: <end_of_turn>, while its eos is <eos>."})
    batch_inputs: dict = field(default_factory=dict, compare=False, metadata={
        "help": "Processor outputs the model takes besides input_ids/attention_mask/labels, and how a batch "
                "joins them: 'concat' (along dim 0: pixel_values, image_grid_thw, ...) or 'sequence' (one value "
                "per token, padded like input_ids with 0: mm_token_type_ids, Gemma 3's token_type_ids)."})
    chat_template_kwargs: dict = field(default_factory=dict, compare=False, metadata={
        "help": "Extra keyword arguments for apply_chat_template (Qwen3.5: enable_thinking=False, so prompt "
                "and reply split cleanly)."})

    # --- sharding, positions -------------------------------------------------------------------------------
    no_split_modules: tuple[str, ...] = field(default=(), metadata={
        "help": "Block classes FSDP shards as units (the model class's `_no_split_modules`)."})
    vision_stem: str = field(default="", metadata={
        "help": "The vision patch embedding module (its `proj` a Conv3d whose kernel equals its stride, for "
                "Qwen2-VL to Qwen3.5: `model.visual.patch_embed`); a backend's kernel patch may replace the "
                "convolution with an equal matmul. Empty: no such patch is offered."})
    kernel_targets: dict = field(default_factory=dict, compare=False, metadata={
        "help": "What backends' fused-op kernel patches may replace, by role: 'rms_norm' and 'gated_mlp' (module "
                "class names, a gated MLP being `down_proj(act(gate_proj(x)) * up_proj(x))`), 'rotary' "
                "('module:function' names of q/k rotary functions `f(q, k, cos, sin, ...)`). Empty: none."})
    rope_index: Callable[..., Any] | None = field(default=None, compare=False, metadata={
        "help": "rope_index(model_config, input_ids [L], image_grid_thw=None, video_grid_thw=None, "
                "attention_mask=None, second_per_grid_ts=None) -> LongTensor [3, 1, L]: the 3-D mRoPE "
                "positions of ONE sample, exactly as the model computes them (for packing: per sample, "
                "then concatenate). None: the model uses plain 1-D positions (Gemma 3, LLaVA, InternVL)."})

    packing_refusal: str = field(default="", metadata={
        "help": "Why this family's text model cannot keep packed samples apart, or '' where it can: `--packing "
                "on` is then an error with this reason and `auto` pads (Qwen3.5: its Gated DeltaNet layers carry "
                "state along the row unless run with varlen kernels)."})

    # --- embedded tiny model, bundled configs --------------------------------------------------------------
    build_tiny: Callable[[Any], None] | None = field(default=None, compare=False, metadata={
        "help": "build_tiny(path): writes a tiny random model of the family + processor there (offline)."})
    tiny_recipe: dict = field(default_factory=dict, compare=False, metadata={
        "help": "The tiny model's recipe; its hash names the cache folder."})
    bundled_configs: tuple[str, ...] = field(default=(), metadata={
        "help": "Names of bundled planning configs (folders under plugins/models/configs)."})

    # --- planning (memory) -----------------------------------------------------------------------------
    image_grid: Callable[..., tuple] | None = field(default=None, compare=False, metadata={
        "help": "image_grid(height, width, min_pixels=None, max_pixels=None) -> (t, h, w): the patch grid the "
                "image processor makes of one image (its product / merge_size**2 is the token count). The length "
                "check and the memory plan use it without decoding pixels. None: images are measured by "
                "running the processor."})
    vision_dummy: Callable[..., Any] | None = field(default=None, compare=False, metadata={
        "help": "vision_dummy(model, modality) -> VisionWarmup or None: the smallest input the vision tower takes "
                "for 'image' or 'video' (the module with the features method, the method's name and its keyword "
                "arguments). Every run whose data holds that modality runs it on each training step whose batch lacks "
                "it (and, sharded, on evaluation's first pass), so every process uses the same parameters (DDP) "
                "and gathers the same blocks (FSDP), and 1 process trains as N. None: a multi-process run on data "
                "that mixes text-only and image records may fail there."})
    trace_vision: Callable[..., Any] | None = field(default=None, compare=False, metadata={
        "help": "trace_vision(tower, grids, dtype, run_block) -> features: run the vision tower's blocks once "
                "on the meta device for the memory plan, calling run_block(module, fn, block_input) around each "
                "block (with its input tensor) and run_block(module, fn) around each merger, so activations are "
                "counted per block. None: vision activations are not traced and "
                "the plan says so."})

    # --- derived views ------------------------------------------------------------------------------------
    def vision_targets(self) -> tuple[str, ...]:
        parts = self.default_parts
        return (self.vision_attention if "attention" in parts else ()) + (self.vision_mlp if "mlp" in parts else ())

    def text_targets(self) -> tuple[str, ...]:
        parts = self.default_parts
        out = (self.text_attention + self.text_linear_attention) if "attention" in parts else ()
        return out + (self.text_mlp if "mlp" in parts else ())

    def owns(self, model_type: str) -> bool:
        return model_type in self.model_types

    def count_image_tokens(self, height: int, width: int, **budget) -> int:
        if self.image_tokens is None:
            raise NotImplementedError(f"family {self.name} gives no image token count")
        return self.image_tokens(height, width, **budget)

    def count_video_tokens(self, frames: int, height: int, width: int, **budget) -> int:
        if self.video_tokens is None:
            raise NotImplementedError(f"family {self.name} gives no video token count")
        return self.video_tokens(frames, height, width, **budget)

    def vision_side(self) -> tuple[str, ...]:
        """The roots of every vision-side module: the tower and any projector outside it."""
        return (self.vision_tower, *(m for m in self.vision_mergers if not m.startswith(self.vision_tower + ".")))

    def describe(self) -> dict:
        """Plain-data view (callables by name) for `vlft plugins --json` and the plan report."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = getattr(v, "__qualname__", repr(v)) if callable(v) else v
        return out


def model_family_help() -> dict[str, str]:
    """Each ``ModelFamily`` field's help (docs/plugin-hooks.md lists them; a docs test checks)."""
    return {f.name: f.metadata.get("help", "") for f in fields(ModelFamily)}


@dataclass
class VisionWarmup:
    """How to run one modality's tower on a dummy input (``ModelFamily.vision_dummy``): the module holding
    the features method (``get_image_features``), that method's name and its keyword arguments (tensors on
    the host, moved per call)."""

    module: Any
    method: str
    inputs: dict


# -- objectives ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Objective:
    """What a run optimises (``--objective``), answered once at plan time by ``vlft_objective``.

    The core reads its fields and calls its callables; the training step calls no hook. A callable left None
    is the supervised default, today's ``sft``: conversation records, one row per record, the next-token loss
    summed over label tokens and averaged over the step's label tokens. ``objective_help()`` lists the fields.
    """

    name: str = field(metadata={"help": "What `--objective` selects, e.g. 'dpo'."})
    description: str = field(default="", metadata={"help": "One line for `vlft objectives` and the plan."})
    options: dict = field(default_factory=dict, compare=False, metadata={
        "help": "The objective's resolved options, shown in the plan and written to plan.json ({'beta': 0.1})."})
    help: dict = field(default_factory=dict, compare=False, metadata={
        "help": "One line per option, for `vlft objectives`."})
    layout: str = field(default="conversations: user turns and the assistant replies to learn", metadata={
        "help": "The record layout it trains on, in words (the plan and `vlft objectives` show it)."})
    parse: Callable[..., Any] | None = field(default=None, compare=False, metadata={
        "help": "parse(obj, add_placeholders) -> a parsed record (vlft.data.formats.Parsed), for each JSON object "
                "of a data file: its layout and checks, raising FormatProblem with what to fix (reported as "
                "file:line before step 1). None: the conversation layouts of README 'Data'."})
    encoder: Callable[..., Any] | None = field(default=None, compare=False, metadata={
        "help": "encoder(sample_encoder) -> the encoder of this objective's samples: its encode(record) gives one "
                "sample (DPO: chosen and rejected sharing the images, processed once) and its "
                "measure_labelled(record) the longest row's (tokens, grids, labelled), for --max-length and the "
                "memory plan. None: the sample encoder itself."})
    collate: Callable[..., Any] | None = field(default=None, compare=False, metadata={
        "help": "collate(row_collator) -> the batch builder, given the collator of plain rows (padding). None: "
                "the row collator."})
    rows_per_record: int = field(default=1, metadata={
        "help": "Sequences the model runs per record (DPO: 2, chosen and rejected); the memory plan counts them."})
    average_over: str = field(default="label tokens", metadata={
        "help": "What the step's loss is averaged over, over every micro-batch and process: 'label tokens' or "
                "'records' (the batch's 'records' count, e.g. DPO's pairs)."})
    loss: Callable[..., Any] | None = field(default=None, compare=False, metadata={
        "help": "loss(model, batch, autocast, reference) -> (loss summed over the batch's units, {figure: sum "
                "over the batch's units}) from a batch on the device; `reference()` is a context manager "
                "giving the reference model (no gradients, adapter off or the --init-adapter weights). "
                "None: the next-token loss over label tokens."})
    figures: tuple[str, ...] = field(default=(), metadata={
        "help": "The figures `loss` returns, logged as means over the units (metrics.jsonl, --report-to) and, "
                "as val_<figure>, in validation."})
    reference: str = field(default="", metadata={
        "help": "What the reference pass is, in words, where the loss uses one ('' none): the plan shows it "
                "and the memory plan counts the --init-adapter copy it keeps."})
    demo_data: Callable[..., Any] | None = field(default=None, compare=False, metadata={
        "help": "demo_data(folder) -> (train, val) data files of the embedded demo task in this objective's "
                "layout, for a run without --data. None: the product-inspection conversations."})
    demo_epochs: float | None = field(default=None, metadata={
        "help": "Epochs on the demo data when neither --epochs nor --steps is given (None: the SFT default)."})
    packing_refusal: str = field(default="", metadata={
        "help": "Why --packing cannot lay this objective's rows out, or '' where it can (auto then pads)."})
    sharding_refusal: str = field(default="", metadata={
        "help": "Why --shard fsdp cannot run this objective, or '' where it can (the run stops before any "
                "process starts otherwise)."})
    notes: tuple[str, ...] = field(default=(), metadata={"help": "Lines for the plan."})
    check: Callable[..., Any] | None = field(default=None, compare=False, metadata={
        "help": "check(records) -> ['file:line: problem', ...]: what the objective checks of the records as read "
                "(GRPO: every reward scores every reference), every run before step 1 and outside the cached "
                "data check (it may run the user's code, which can change while the data does not); any "
                "problem stops the run with the list, nothing written. None: nothing more."})
    rollout: Callable[..., Any] | None = field(default=None, compare=False, metadata={
        "help": "rollout(model, host_batches, device, autocast) -> (device batches, units): what the step runs "
                "before the loss, once per step over all its micro-batches (GRPO: sample completions with the "
                "model and score them), and this process's count of the units the loss is averaged over (known "
                "only then: GRPO's completion tokens). None: the batches move to the device as they are."})
    figure_units: dict = field(default_factory=dict, compare=False, metadata={
        "help": "{figure: what its mean is over}: another figure that counts its units (GRPO's 'reward' over "
                "'completions'), or 'steps' (per process and step: a count, a time); figures not named are "
                "means over the loss's units."})
    generation: dict = field(default_factory=dict, compare=False, metadata={
        "help": "What the step generates, for the memory plan: {'sequences_per_record': G, 'new_tokens': T} "
                "({} none): the plan counts the KV cache of the step's G x batch sequences."})

    @property
    def supervised(self) -> bool:
        """The default: the next-token loss over label tokens (what ``sft`` answers)."""
        return self.loss is None

    def describe(self) -> dict:
        """Plain data for the plan and `vlft objectives` (callables left out)."""
        return {"name": self.name, "description": self.description, "options": dict(self.options),
                "layout": self.layout, "rows_per_record": self.rows_per_record, "average_over": self.average_over,
                "figures": list(self.figures), "reference": self.reference, "notes": list(self.notes),
                **({"generation": dict(self.generation)} if self.generation else {})}


@dataclass(frozen=True)
class Reward:
    """What ``vlft_rewards()`` answers: one reward function a plugin offers to reward objectives (``--reward
    NAME`` or ``--reward NAME=ARGUMENT``).

    ``build(argument)`` is called once at plan time (``argument`` None when not given) and returns the
    function, ``function(completions, references, **context) -> list[float]``: one number per completion, the
    reference being the record's assistant reply; ``context`` holds ``where`` (each completion's record,
    ``file:line``) and may grow, so accept ``**context``. Raise ``ConfigError`` from ``build`` for a bad
    argument. A reward that cannot score a record (a reference it cannot read) should raise: every reward runs
    on every record's reference before step 1, and a record it raises on is reported as ``file:line``."""

    name: str
    description: str
    build: Callable[[str | None], Callable[..., list]] = field(compare=False)
    argument: str = ""  # what NAME=ARGUMENT takes, in words ('' none)


def objective_help() -> dict[str, str]:
    """Each ``Objective`` field's help (docs/plugin-hooks.md lists them; a docs test checks)."""
    return {f.name: f.metadata.get("help", "") for f in fields(Objective)}
