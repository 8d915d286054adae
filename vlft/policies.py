"""Plain answers that plugins give and the run uses.

Every concern a backend or method decides is resolved once, at set-up, into
one of these dataclasses. The training step reads them; it calls no hooks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from functools import partial
from typing import Any, Callable

from vlft.errors import ConfigError


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
#
# A family is a small required core (name, model types, tower paths, target names, the processor and its
# template) plus capabilities it fills only when it has them: image inputs, video inputs, positions,
# packing, sharding, experts. Each capability is a small frozen dataclass the core reads; a family leaves
# one None where it lacks it, and the core then refuses what needs it, saying why. ``check_family`` checks
# them when the plugin's families are first asked for (``vlft.models.families``), naming plugin and field.

FAMILY_TOWERS = ("vision", "text", "both")
BATCH_JOINS = ("concat", "sequence", "concat_padded")


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


@dataclass
class Written:
    """What ``ImageInputs.write`` answers: each text's token ids with its images' tokens written in, and
    the sample's model inputs besides input_ids and labels (each key one of ``ImageInputs.batch_inputs``:
    a 'sequence' input 1-D over the texts' ids laid end to end, a 'concat' input the images' tensors),
    and the patch grid (t, h, w) of each image and clip where the family has one (the memory plan's)."""

    ids: list  # list[list[int]], one per text
    inputs: dict = field(default_factory=dict)
    grids: list = field(default_factory=list)


@dataclass(frozen=True)
class ImageInputs:
    """How an image becomes model inputs. Two calls per record: ``prepare`` once (its images, and its clips
    where the family has ``video_inputs``), ``write`` once per conversation over them (a preference pair's
    two share one ``prepare``). Whether the core or the processor writes an image's tokens into the text is
    the family's choice inside ``write``: the Qwen families repeat the image pad once per LLM token of the
    image grid; ``vlft.data.encoding.processor_image_inputs`` builds the answer for a processor that writes
    them itself (Gemma 3's)."""

    prepare: Callable[..., Any] = field(metadata={
        "help": "prepare(processor, media: vlft.Media, max_pixels: int | None) -> anything `write` takes: a "
                "record's images (and clips) as model inputs, capped at `max_pixels` by the family's own rule; "
                "with `media.images` None (measuring) from the sizes alone where it can."})
    write: Callable[..., Any] = field(metadata={
        "help": "write(processor, texts: list[str], prepared) -> vlft.Written: each rendered text piece's token "
                "ids with the image tokens written in (the first piece with the tokenizer's special tokens, the "
                "others without), and the sample's extra model inputs."})
    batch_inputs: dict = field(metadata={
        "help": "The model inputs `write` gives besides input_ids/labels, and how a batch joins each: 'concat' "
                "(along dim 0 over the samples that have it: pixel tensors, grids) or 'sequence' (one value per "
                "token, padded with 0 like input_ids and laid end to end by packing: Qwen's modality type per "
                "token, Gemma 3's token_type_ids) or 'concat_padded' (joined along dim 0 like 'concat', each "
                "tensor first padded with 0 at the end of its other dims to the batch's largest: LLaVA-OneVision's "
                "pixels [images, tiles, 3, H, W], whose tile count differs by image size, the model reading only "
                "each image's own tiles)."})
    pixels: str = field(default="pixel_values", metadata={
        "help": "The batch input holding an image's pixels: a batch without it has no image (the mixed-data "
                "warm-up runs the tower on a dummy then)."})
    size_cap: str = field(default="", metadata={
        "help": "What `--max-pixels` means for this family, in words (Qwen: a pixel budget per image, the "
                "resize keeps the aspect ratio). '' : the family has no size cap, and `--max-pixels` is refused "
                "with that reason."})
    grid: Callable[..., tuple] | None = field(default=None, compare=False, metadata={
        "help": "grid(height, width, max_pixels=None) -> (t, h, w): the patch grid of one image at the family's "
                "default budget, without pixels (the memory plan resizes grids by it for its --max-pixels "
                "advice). None: the plan gives no such advice."})
    patch_size: int = field(default=0, metadata={
        "help": "The pixel side of one patch of `grid` (the memory plan turns a grid back into pixels)."})
    patches_per_token: int = field(default=1, metadata={
        "help": "Patches per LLM token (Qwen: merge 2 x 2 = 4): the memory plan's tokens from patches."})
    trace: Callable[..., Any] | None = field(default=None, compare=False, metadata={
        "help": "trace(tower, grids, dtype, run_block) -> features: run the vision tower's blocks once on the "
                "meta device for the memory plan, calling run_block(module, fn, block_input) around each block "
                "and run_block(module, fn) around each merger, so activations are counted per block. None: "
                "vision activations are not traced, and the plan says so."})


@dataclass(frozen=True)
class VideoInputs:
    """A family that takes video clips: its ``image_inputs.prepare`` then receives them in ``Media.videos``.
    Without it a record with a video is refused, naming the family."""

    pixels: str = field(metadata={
        "help": "The batch input holding a clip's pixels (Qwen: pixel_values_videos): a batch without it has no "
                "clip (the mixed-data warm-up runs the tower on a dummy clip then)."})
    grid: Callable[..., tuple] | None = field(default=None, compare=False, metadata={
        "help": "grid(frames, height, width, max_pixels=None) -> (t, h, w): the patch grid of a clip of `frames` "
                "sampled frames at the family's default budget (a family's tests check it against the "
                "processor)."})


@dataclass(frozen=True)
class Positions:
    """A family whose model computes positions from more than the token index (Qwen's 3-D mRoPE): packing
    builds each sample's positions with it. None: plain 1-D positions (Gemma 3, LLaVA)."""

    rope_index: Callable[..., Any] = field(metadata={
        "help": "rope_index(model_config, sample: dict) -> LongTensor [rows, 1, L]: the positions of ONE encoded "
                "sample (its input_ids and the inputs `image_inputs.write` gave), exactly as the model computes "
                "them unpacked. Packing puts a text row in front of them and concatenates the samples."})
    rows: int = field(default=3, metadata={"help": "Rows of `rope_index`'s answer (3 for mRoPE)."})


@dataclass(frozen=True)
class Packing:
    """A family whose samples can be laid end to end in one row (``--packing``): the attention keeps them
    apart where the text position row restarts, its 'sequence' batch inputs are laid end to end and its
    'concat' ones joined in order. None: the family cannot pack, and ``--packing on`` says so."""

    refusal: str = field(default="", metadata={
        "help": "Why this family's text model cannot keep packed samples apart after all, or '' where it can "
                "(Qwen3.5: its Gated DeltaNet layers carry state along the row unless run with varlen kernels)."})


@dataclass(frozen=True)
class Sharding:
    """How ``--shard fsdp`` cuts the model."""

    no_split_modules: tuple[str, ...] = field(metadata={
        "help": "Block classes FSDP shards as units (the model class's `_no_split_modules`)."})


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts family's fused expert weights and routers."""

    parameters: tuple[str, ...] = field(metadata={
        "help": "Fused 3-D expert weights, relative to a decoder layer, for PEFT's `target_parameters` (e.g. "
                "'mlp.experts.gate_up_proj' [E, 2*I, H] and 'mlp.experts.down_proj' [E, H, I]). Adapted only "
                "when the method asks (`target_experts`)."})
    routers: tuple[str, ...] = field(default=(), metadata={
        "help": "Router / gate modules relative to a decoder layer; they always stay frozen and are never "
                "targets (Qwen3-VL MoE 'mlp.gate'; Qwen3.5 MoE also 'mlp.shared_expert_gate', an nn.Linear "
                "hidden->1 that a leaf-name 'gate' match would otherwise catch)."})


# --- a family whose processor writes each image's tokens itself -------------------------------------------------

# params: a builder of ImageInputs, every optional part of which a family names by keyword
def processor_image_inputs(batch_inputs: dict, pixels: str = "pixel_values", size_cap: str = "", grid=None,
                           patch_size: int = 0, patches_per_token: int = 1, trace=None, processor_kwargs=None,
                           reshape=None, image_grids=None) -> ImageInputs:
    """``ImageInputs`` for a family whose processor writes each image's token sequence into the text
    (``processor(text=, images=)``, e.g. Gemma 3's ``<start_of_image><image_soft_token>*N<end_of_image>``): the
    processor is called once per rendered piece with that piece's images (those of its ``processor.image_token``
    placeholders), and the outputs ``batch_inputs`` names are kept: 'sequence' ones laid end to end over the
    pieces (0 where a piece has none), 'concat' ones joined along dim 0. Measuring processes blank images of
    the recorded sizes (no pixels decoded). ``grid(height, width, max_pixels)``, where given, is each image's patch
    grid (the processor writes none): the memory plan counts its patches and, with ``trace``, traces the tower;
    without it the plan says it counted no vision activations.

    Three optional callables for a processor that needs more: ``processor_kwargs(processor, max_pixels) -> dict``,
    the keyword arguments of every processor call of a record with images under ``--max-pixels`` (the family's own
    cap, as its processor takes it: SmolVLM's tile edge, GLM-4.1V's pixel budget, Gemma 4's soft-token budget; it
    comes with ``size_cap``, the cap in words, and may raise ``vlft.errors.ConfigError`` for a cap the family cannot
    meet; ``grid`` then gets ``max_pixels`` too); ``reshape(name, tensor) -> tensor``, each kept output as the batch joins
    it (SmolVLM's ``[1, tiles, ...]`` pixels as ``[tiles, 1, ...]``, so 'concat' joins samples of any tile count);
    ``image_grids(processor, sizes, max_pixels) -> [(t, h, w), ...]``, each image's grid from the processor's own
    numbers, where ``grid`` (which has no processor) cannot give it."""
    if (processor_kwargs is None) != (not size_cap):
        raise ValueError("processor_image_inputs: size_cap (what --max-pixels means, in words) and processor_kwargs "
                         "(how the cap reaches the processor) come together")
    return ImageInputs(prepare=partial(_processor_prepare, processor_kwargs),
                       write=partial(_processor_write, dict(batch_inputs), grid, reshape, image_grids),
                       batch_inputs=dict(batch_inputs), pixels=pixels, size_cap=size_cap, grid=grid,
                       patch_size=patch_size, patches_per_token=patches_per_token, trace=trace)


def _processor_prepare(processor_kwargs, processor, media: Media, max_pixels=None):
    from PIL import Image

    images = media.images if media.images is not None else [Image.new("RGB", size) for size in media.sizes]
    capped = processor_kwargs is not None and max_pixels is not None
    return images, media.where, (max_pixels if capped else None), \
        (dict(processor_kwargs(processor, max_pixels)) if capped else {})


def _processor_write(wanted: dict, grid, reshape, image_grids, processor, texts: list[str], prepared) -> Written:
    import torch

    from vlft.errors import DataError

    left, where, max_pixels, kwargs = list(prepared[0]), prepared[1], prepared[2], prepared[3]
    placeholder = processor.image_token or ""
    ids_per_text: list[list[int]] = []
    sequences: dict[str, list] = {k: [] for k, how in wanted.items() if how == "sequence"}
    stacked: dict[str, list] = {k: [] for k, how in wanted.items() if how == "concat"}
    for k, text in enumerate(texts):
        n = text.count(placeholder) if placeholder else 0
        if n > len(left):
            raise DataError(f"{where}: the rendered conversation has more image placeholders than images")
        mine, left = left[:n], left[n:]
        out = processor(text=[text], images=[mine] if mine else None, add_special_tokens=(k == 0),
                        return_tensors="pt", **(kwargs if mine else {}))
        ids = out["input_ids"][0].tolist()
        ids_per_text.append(ids)
        for key, parts in sequences.items():
            parts.append(out[key][0] if key in out else torch.zeros(len(ids), dtype=torch.long))
        for key, parts in stacked.items():
            if key in out:
                parts.append(reshape(key, out[key]) if reshape is not None else out[key])
    if left:
        raise DataError(f"{where}: {len(left)} image(s) have no placeholder in the rendered conversation")
    extra = {key: torch.cat(parts) for key, parts in (*sequences.items(), *stacked.items()) if parts}
    if image_grids is not None:
        grids = [tuple(g) for g in image_grids(processor, [img.size for img in prepared[0]], max_pixels)]
    elif grid is not None:
        grids = [tuple(grid(img.size[1], img.size[0], max_pixels)) for img in prepared[0]]
    else:
        grids = []
    return Written(ids_per_text, extra, grids)


CAPABILITIES = {"image_inputs": ImageInputs, "video_inputs": VideoInputs, "positions": Positions,
                "packing": Packing, "sharding": Sharding, "experts": Experts}


@dataclass(frozen=True)
class ModelFamily:
    """Everything vlft needs to know about one model family (one or more ``model_type`` values): a required
    core, then optional capabilities (``CAPABILITIES``), each None where the family lacks it."""

    # --- identity -------------------------------------------------------------------------------------
    name: str = field(metadata={"help": "Short name, used in `--model embedded:<name>` and `vlft plugins`, "
                                        "e.g. 'qwen3-vl'."})
    model_types: tuple[str, ...] = field(metadata={"help": "The `config.model_type` values this family owns, "
                                                           "e.g. ('qwen3_vl',)."})
    description: str = field(default="", metadata={"help": "One line for `vlft plugins`."})
    plugin: str = field(default="", compare=False, metadata={
        "help": "Leave it empty: vlft fills it in when it loads the family (the plugin that offered it), so "
                "errors and `vlft plugins` name the plugin."})

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
    text_mlp: tuple[str, ...] = field(default=("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"), metadata={
        "help": "Linear modules inside each decoder layer for the dense MLP (or a MoE's shared expert)."})
    default_targets: str = field(default="both", metadata={"help": "What `--targets auto` means: vision, text "
                                                                      "or both (a method's own default wins)."})
    default_parts: tuple[str, ...] = field(default=("attention",), metadata={
        "help": "Which module groups an adapter takes by default: 'attention' (today's behaviour: "
                "q/k/v/o and the vision qkv/proj, plus linear attention), 'mlp', or both."})

    # --- processor and template ------------------------------------------------------------------------
    processor_class: str = field(default="", metadata={
        "help": "transformers processor class name (a helper outside a run finds a processor's family by it)."})
    load_processor: Callable[[str], Any] | None = field(default=None, compare=False, metadata={
        "help": "load_processor(path) -> processor for a model folder (AutoProcessor by default)."})
    bundled_processor: Callable[[str, Any], Any] | None = field(default=None, compare=False, metadata={
        "help": "bundled_processor(config_dir, tokenizer) -> processor for a weightless bundled config: its "
                "image/video processor from the folder, the given stand-in tokenizer, the family's template. "
                "None: bundled configs of this family cannot be planned."})
    reply_end_token: str = field(default="", metadata={
        "help": "The token that closes an assistant turn in the template (the trained reply ends there). Qwen: "
                "<|im_end|> (= the tokenizer's eos). Gemma 3: <end_of_turn>, while its eos is <eos>."})
    reply_end_appended: bool = field(default=False, metadata={
        "help": "The chat template leaves each assistant reply open: the turn ends where the next turn's role token "
                "begins, and generation stops on it (GLM-4.1V: `<|user|>`, one of its generation eos ids). True: the "
                "core trains `reply_end_token` as each reply's last token, that of the next turn's start where one "
                "follows (the ids then equal the template's render) and appended after the last reply, so the model "
                "learns to stop. False: the template writes the reply end itself (Qwen's <|im_end|>)."})
    chat_template_kwargs: dict = field(default_factory=dict, compare=False, metadata={
        "help": "Extra keyword arguments for apply_chat_template (Qwen3.5: enable_thinking=False, so prompt "
                "and reply split cleanly)."})
    box_coordinates: str = field(default="absolute", metadata={
        "help": "Grounding convention: 'absolute' pixels of the resized image (Qwen2.5-VL), 'relative-1000' "
                "(Qwen3-VL, Qwen3.5) or 'relative-1' (fractions of the image: LLaVA's). vlft never converts "
                "silently."})

    # --- loading and kernels ----------------------------------------------------------------------------
    load_kwargs: Callable[[str], dict] | None = field(default=None, compare=False, metadata={
        "help": "load_kwargs(param_dtype) -> extra keyword arguments for transformers' from_pretrained/from_config "
                "(the run's model, its meta-device plan copy and evaluation), given the parameter dtype the "
                "precision policy chose ('float32', 'bfloat16', ...). The MoE families return "
                "{'experts_implementation': 'eager'} for float32: transformers 5.2x runs fused experts with "
                "torch._grouped_mm, which takes only 16-bit weights (its meta-device and CUDA kernels refuse "
                "fp32). None: no extra arguments."})
    vision_stem: str = field(default="", metadata={
        "help": "The vision patch embedding module (its `proj` a Conv3d whose kernel equals its stride, for "
                "Qwen2-VL to Qwen3.5: `model.visual.patch_embed`); a backend's kernel patch may replace the "
                "convolution with an equal matmul. Empty: no such patch is offered."})
    kernel_targets: dict = field(default_factory=dict, compare=False, metadata={
        "help": "What backends' fused-op kernel patches may replace, by role: 'rms_norm' and 'gated_mlp' (module "
                "class names, a gated MLP being `down_proj(act(gate_proj(x)) * up_proj(x))`), 'rotary' "
                "('module:function' names of q/k rotary functions `f(q, k, cos, sin, ...)`). Empty: none."})
    vision_dummy: Callable[..., Any] | None = field(default=None, compare=False, metadata={
        "help": "vision_dummy(model, modality) -> VisionWarmup or None: the smallest input the vision tower takes "
                "for 'image' or 'video' (the module with the features method, the method's name and its keyword "
                "arguments). Every run whose data holds that modality runs it on each training step whose batch lacks "
                "it (and, sharded, on evaluation's first pass), so every process uses the same parameters (DDP) "
                "and gathers the same blocks (FSDP), and 1 process trains as N. None: a multi-process run on data "
                "that mixes text-only and image records may fail there."})

    trace_layer_kwargs: Callable[..., dict] | None = field(default=None, compare=False, metadata={
        "help": "trace_layer_kwargs(text_model, hidden) -> dict: extra keyword arguments each decoder layer takes "
                "when the memory plan runs the text layers one by one on the meta device (called once per trace, "
                "the answer shared by the layers; `hidden` is the [samples, tokens, width] meta input), for what "
                "the text model hands its layers besides hidden states, mask and rotary tables (Gemma 4: the "
                "shared_kv_states dict every layer writes, and per_layer_input where the config has per-layer "
                "embeddings). None: no extra arguments."})

    # --- capabilities (None: the family lacks it; see CAPABILITIES) -------------------------------------
    image_inputs: ImageInputs | None = field(default=None, compare=False, metadata={
        "help": "How an image becomes model inputs (vlft.ImageInputs). None: the family trains on text only, "
                "and a record with an image is refused."})
    video_inputs: VideoInputs | None = field(default=None, compare=False, metadata={
        "help": "The family takes video clips (vlft.VideoInputs). None: a record with a video is refused."})
    positions: Positions | None = field(default=None, compare=False, metadata={
        "help": "Positions beyond the token index, e.g. 3-D mRoPE (vlft.Positions). None: plain 1-D positions."})
    packing: Packing | None = field(default=None, compare=False, metadata={
        "help": "The family's samples can be packed into one row (vlft.Packing). None: `--packing on` is refused "
                "and `auto` pads."})
    sharding: Sharding | None = field(default=None, compare=False, metadata={
        "help": "FSDP's units (vlft.Sharding). None: the model class's own `_no_split_modules`."})
    experts: Experts | None = field(default=None, compare=False, metadata={
        "help": "Fused expert weights and routers of a mixture-of-experts family (vlft.Experts). None: dense."})

    # --- embedded tiny model -----------------------------------------------------------------------------
    build_tiny: Callable[..., None] | None = field(default=None, compare=False, metadata={
        "help": "build_tiny(path, corpus=None): writes a tiny random model of the family + processor there "
                "(offline), its tokenizer trained on `corpus` (a list of strings, the demo task's words) where "
                "given. None: no `--model embedded:<name>`."})
    tiny_recipe: dict = field(default_factory=dict, compare=False, metadata={
        "help": "The tiny model's recipe; its hash names the cache folder."})

    # --- derived views ------------------------------------------------------------------------------------
    @property
    def expert_parameters(self) -> tuple[str, ...]:
        return self.experts.parameters if self.experts is not None else ()

    @property
    def router_modules(self) -> tuple[str, ...]:
        return self.experts.routers if self.experts is not None else ()

    def vision_targets(self) -> tuple[str, ...]:
        parts = self.default_parts
        return (self.vision_attention if "attention" in parts else ()) + (self.vision_mlp if "mlp" in parts else ())

    def text_targets(self) -> tuple[str, ...]:
        parts = self.default_parts
        out = (self.text_attention + self.text_linear_attention) if "attention" in parts else ()
        return out + (self.text_mlp if "mlp" in parts else ())

    def owns(self, model_type: str) -> bool:
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
        return (self.vision_tower, *(m for m in self.vision_mergers if not m.startswith(self.vision_tower + ".")))

    def describe(self) -> dict:
        """Plain-data view (callables by name, capabilities as dicts) for `vlft plugins --json` and the plan."""
        def plain(v):
            if callable(v):
                return getattr(v, "__qualname__", repr(v))
            if hasattr(v, "__dataclass_fields__"):
                return {f.name: plain(getattr(v, f.name)) for f in fields(v)}
            return v

        return {f.name: plain(getattr(self, f.name)) for f in fields(self)}


def model_family_help() -> dict[str, str]:
    """Each ``ModelFamily`` field's help, capabilities' fields as ``capability.field`` (docs/plugin-hooks.md
    and docs/writing-plugins.md list them; a docs test checks)."""
    out = {f.name: f.metadata.get("help", "") for f in fields(ModelFamily)}
    for cap, cls in CAPABILITIES.items():
        out.update({f"{cap}.{f.name}": f.metadata.get("help", "") for f in fields(cls)})
    return out


_PATH_STEP = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_"


def _dotted(path: str) -> bool:
    return bool(path) and all(step and not step[0].isdigit() and all(c in _PATH_STEP for c in step)
                              for step in path.split("."))


def check_family(family: Any) -> list[str]:
    """What is wrong with a family's answer, field by field ('image_inputs.write must be callable ...'), with
    no model: called when a plugin's families are first asked for; an empty list when all is well."""
    if not isinstance(family, ModelFamily):
        return [f"is a {type(family).__name__}, not a vlft.ModelFamily"]
    problems = []

    def need(ok: bool, field_name: str, what: str):
        if not ok:
            problems.append(f"{field_name} {what}")

    need(isinstance(family.name, str) and bool(family.name), "name", "must be a non-empty string")
    need(isinstance(family.model_types, tuple) and bool(family.model_types)
         and all(isinstance(t, str) for t in family.model_types), "model_types", "must be a non-empty tuple of str")
    for name in ("decoder_layers", "lm_head"):
        need(_dotted(getattr(family, name)), name, "must be a dotted module path")
    if family.vision_tower or family.vision_blocks:
        need(_dotted(family.vision_tower), "vision_tower", "must be a dotted module path")
        need(family.vision_blocks.startswith(family.vision_tower + ".") and _dotted(family.vision_blocks),
             "vision_blocks", "must be a dotted module path under vision_tower")
    for m in family.vision_mergers:  # a projector may live outside the tower (Gemma 3, LLaVA): still vision side
        need(_dotted(m), "vision_mergers", f"entry {m!r} must be a dotted module path")
    need(family.default_targets in FAMILY_TOWERS, "default_targets", f"must be one of {FAMILY_TOWERS}")
    for name in ("load_processor", "bundled_processor", "load_kwargs", "vision_dummy", "build_tiny",
                 "trace_layer_kwargs"):
        v = getattr(family, name)
        need(v is None or callable(v), name, f"must be callable or None, not {type(v).__name__}")
    for cap, cls in CAPABILITIES.items():
        v = getattr(family, cap)
        if v is None:
            continue
        if not isinstance(v, cls):
            problems.append(f"{cap} must be a vlft.{cls.__name__} or None, not {type(v).__name__}")
            continue
        for f in fields(cls):
            x = getattr(v, f.name)
            if "Callable" in str(f.type):
                need(callable(x) or (x is None and "None" in str(f.type)), f"{cap}.{f.name}",
                     f"must be callable{' or None' if 'None' in str(f.type) else ''}, not {type(x).__name__}")
    def given(cap):  # the capability, where it is one (a wrong type was reported above)
        v = getattr(family, cap)
        return v if isinstance(v, CAPABILITIES[cap]) else None

    images = given("image_inputs")
    if images is not None:
        joins = images.batch_inputs
        need(isinstance(joins, dict) and all(h in BATCH_JOINS for h in joins.values()), "image_inputs.batch_inputs",
             f"must map each input name to one of {BATCH_JOINS}")
        need(isinstance(joins, dict) and images.pixels in joins, "image_inputs.pixels",
             "must be one of image_inputs.batch_inputs")
        need(images.grid is None or images.patch_size > 0, "image_inputs.patch_size", "must be > 0 with a grid")
    video = given("video_inputs")
    if video is not None:
        need(images is not None, "video_inputs", "needs image_inputs (its prepare receives the clips)")
        need(images is None or not isinstance(images.batch_inputs, dict) or video.pixels in images.batch_inputs,
             "video_inputs.pixels", "must be one of image_inputs.batch_inputs")
    sharding = given("sharding")
    if sharding is not None:
        need(isinstance(sharding.no_split_modules, tuple) and all(isinstance(c, str) for c in sharding.no_split_modules),
             "sharding.no_split_modules", "must be a tuple of class names")
    return problems


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
    iterations: int = field(default=1, metadata={
        "help": "Steps each rollout is trained on (GRPO's --num-iterations): the data order draws a step's "
                "prompts for that many steps in a row and the step reuses the rollout's batches, sampled once, "
                "so the loss sees the same batch dicts again (GRPO keeps its first pass's log-probabilities on "
                "them as the old policy's). A run resumed inside a rollout samples its prompts afresh."})
    figure_units: dict = field(default_factory=dict, compare=False, metadata={
        "help": "{figure: what its mean is over}: another figure that counts its units (GRPO's 'reward' over "
                "'completions'), or 'steps' (per process and step: a count, a time); figures not named are "
                "means over the loss's units."})
    dropout: bool = field(default=True, metadata={
        "help": "Whether the trained pass keeps the model's dropout (the adapter's lora_dropout). False: every "
                "dropout layer is off for the whole run (TRL's disable_dropout), so the trained pass computes what "
                "the reference pass and generation compute (both in evaluation mode): for DPO and GRPO, whose "
                "losses compare the trained pass with those, step 1's KL to an --init-adapter reference is 0 and "
                "GRPO's gradient is that of the policy that sampled."})
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
                "dropout": self.dropout,
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


@dataclass(frozen=True)
class Scorer:
    """What ``vlft_scorers()`` answers: one way of scoring answers against their references (``--scorer NAME``
    on ``vlft run`` and ``vlft eval``), which is also a reward (``--reward NAME``): one function seen twice.

    ``score(predictions, references, **context) -> list[float]``: one finite number per prediction, higher
    better (the reward GRPO adds up; 1 - CER for character error rate). ``figures(predictions, references,
    values, **context) -> {figure: value}``: what the evaluation reports for the set (a corpus BLEU, an IoU and
    its accuracy at 0.5, per-field accuracy and F1 as ``{field: {"accuracy": ..., "f1": ...}}``); None: ``{name:
    the mean of values}``. ``fits(references, **context) -> str``: why ``--scorer auto`` picks it for these
    references ('' when it does not; None: auto never picks it). ``context`` holds ``where`` (each record's
    ``file:line``) and, in evaluation, ``records`` (the records: their prompts and images) and
    ``box_coordinates`` (the model family's grounding convention), and may grow: accept ``**context`` and read
    what is there. A reference the scorer cannot read should raise: the chosen scorers run on every reference
    before any weight is loaded, and a record one raises on is reported as ``file:line``."""

    name: str
    description: str
    score: Callable[..., list] = field(compare=False)
    figures: Callable[..., dict] | None = field(default=None, compare=False)
    fits: Callable[..., str] | None = field(default=None, compare=False)
    lower_is_better: tuple[str, ...] = ()  # figures where less is better (the character error rate)

    def as_reward(self) -> Reward:
        """The scorer as a reward function (``--reward NAME``, no argument)."""
        def build(argument):
            if argument is not None:
                raise ConfigError(f"--reward {self.name}={argument}: the {self.name} scorer takes no argument")
            return self.score
        return Reward(self.name, self.description + " (a scorer: vlft eval --scorer " + self.name + ")", build)


def objective_help() -> dict[str, str]:
    """Each ``Objective`` field's help (docs/plugin-hooks.md lists them; a docs test checks)."""
    return {f.name: f.metadata.get("help", "") for f in fields(Objective)}
