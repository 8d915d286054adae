"""What every benchmark group shares: the resolved backend, models, batches, timing and memory meters.

Everything here goes through vlft's own set-up path (plugin registry, plan,
``load_model``, the method plugins' ``vlft_apply_adapter``), so the numbers
are those of a real run, on whatever backend ``--backend`` names.

How the groups time their variants
----------------------------------
Each benchmark test compares its variants in ONE pytest-benchmark call: the
benchmarked function is one *round* that runs every variant once (or a few
times, ``Interleaved(repeats=...)``), in an order rotated every time
(A B C, B C A, C A B, ...), each call timed on its own (with a device
synchronisation before and after on accelerators).
pytest-benchmark decides how many rounds to run (``--benchmark-min-rounds``,
``--benchmark-max-time``) and its own statistics describe a whole round; the
per-variant medians, the ratios between them and the memory figures go into
``benchmark.extra_info``. Interleaving means a burst of background load hits
every variant alike, so the ratios are honest even on a busy machine, where
separate benchmarks run one after the other would not be. One untimed
warm-up round comes first (first calls pay for lazy initialisation).

With ``--benchmark-disable`` (the default ``make test``) the round runs once,
on a reduced workload where a group says so, and no warm-up: the code is
exercised so it cannot rot, and the figures it computes mean nothing.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

BATCH_SIZE = 4
VISION_LAST_N = 6  # vlft's default: adapt the last 6 vision blocks (all of them where there are fewer)
TARGETS = "both"


# -- the backend, resolved once through the plugin hooks ------------------------------------------

@dataclass
class BenchEnv:
    """The backend as a run would see it: device, precision, memory reader, all from the plugins."""

    registry: Any
    backend: str
    device: torch.device
    precision: Any  # PrecisionPolicy
    memory_reader: Callable
    threads: int
    versions: dict = field(default_factory=dict)
    choice: Any = None  # the plan's BackendChoice
    asked_precision: str = "auto"

    def config(self, **over):
        from vlft.config import build_config

        values = dict(backend=self.backend, targets=TARGETS, vision_last_n=VISION_LAST_N, batch_size=BATCH_SIZE,
                      precision=self.asked_precision)
        values.update(over)
        return build_config({}, values)

    @property
    def autocast_dtype(self):
        return getattr(torch, self.precision.autocast_dtype) if self.precision.autocast_dtype else None

    def autocast(self):
        if self.autocast_dtype is None:
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def synchronize(self) -> None:
        if self.device.type != "cpu":
            module = torch.get_device_module(self.device.type)
            if hasattr(module, "synchronize"):
                module.synchronize(self.device)

    def device_module(self):
        return None if self.device.type == "cpu" else torch.get_device_module(self.device.type)

    def describe(self) -> dict:
        import os

        return {"backend": self.backend, "device": str(self.device), "precision": self.precision.name,
                "threads": self.threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), **self.versions}


def resolve_env(backend: str, threads: int, precision: str = "auto") -> BenchEnv:
    """Probe ``backend`` through the registry and set its device up; skip the caller when it is unavailable."""
    import os

    import pytest

    from vlft.planning.plan import choose_backend
    from vlft.registry import load_registry

    registry = load_registry()
    choice = choose_backend(registry, backend)  # unknown names raise with the valid ones; "auto" picks
    probe = choice.probe
    if not probe.available:
        pytest.skip(f"backend '{backend}' is not available here: {probe.reason}")
    backend = choice.info.name
    torch.set_num_threads(threads)
    env = BenchEnv(registry, backend, torch.device("cpu"), None, lambda: None, threads, dict(probe.versions),
                   choice, precision)
    config = env.config()
    registry.hook.vlft_seed(backend=backend, seed=0, deterministic=False)
    setup = registry.first("vlft_setup_device", backend=backend, config=config)
    for key, value in setup.env.items():
        os.environ.setdefault(key, value)
    env.device = setup.device
    env.precision = registry.first("vlft_precision_policy", backend=backend, config=config)
    env.memory_reader = registry.first("vlft_memory_reader", backend=backend, device=setup.device)
    return env


# -- models -----------------------------------------------------------------------------------

def wide_recipe() -> dict:
    """The embedded recipe made wider, so that compute (not Python) dominates a step."""
    from vlft.models.embedded import RECIPE

    recipe = copy.deepcopy(RECIPE)
    recipe["text"].update(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                          num_key_value_heads=2)
    # Qwen2.5-VL's 3-D rotary sections must add up to head_dim / 2 = 32
    recipe["text"]["rope_parameters"] = dict(recipe["text"]["rope_parameters"], mrope_section=[8, 12, 12])
    recipe["vision"].update(hidden_size=256, intermediate_size=688, num_heads=4, out_hidden_size=512)
    recipe["bench"] = "wide"  # its own cache folder
    return recipe


@dataclass
class ModelSize:
    """One model size: where it lies, its processor, sample encoder and config."""

    name: str
    path: str
    processor: Any
    encoder: Any
    model_config: Any

    def collator(self, **kw):
        from vlft.data.batching import Collator

        return Collator(self.processor.tokenizer.pad_token_id, self.processor.image_token_id, **kw)


def model_size(name: str, path: str) -> ModelSize:
    from vlft.data.encoding import SampleEncoder
    from vlft.models.loading import load_model_config, load_processor

    processor = load_processor(path)
    return ModelSize(name, path, processor, SampleEncoder(processor), load_model_config(path))


def plan_for(env: BenchEnv, size: ModelSize, method: str):
    from vlft.planning.plan import resolve_plan

    # after the device is set up, as a run does, so policies reading device properties see it
    return resolve_plan(env.registry, env.config(method=method), size.path, size.model_config, env.choice)


def load_base(env: BenchEnv, size: ModelSize):
    """The base model with the backend's attention, dtype and patches (still on the host)."""
    from vlft.models.loading import load_model

    plan = plan_for(env, size, "lora")
    model = load_model(size.path, plan.attention, plan.precision)
    env.registry.hook.vlft_patch_model(backend=env.backend, model=model, config=plan.config,
                                       attention=plan.attention)
    return model


def targets_for(env: BenchEnv, size: ModelSize, model, method: str = "lora") -> list[str]:
    from vlft.models.targets import select_targets

    plan = plan_for(env, size, method)
    return select_targets(model, plan.adapter, TARGETS, VISION_LAST_N).modules


def adapted_model(env: BenchEnv, size: ModelSize, method: str, seed: int = 0):
    """Base model + ``method``'s adapter on vlft's default targets, through the method plugin, on the device."""
    from vlft.training.step import seed_everything

    model = load_base(env, size)
    plan = plan_for(env, size, method)
    targets = targets_for(env, size, model, method)
    seed_everything(seed)
    adapted = env.registry.first("vlft_apply_adapter", method=method, model=model, targets=targets,
                                 config=plan.config)
    return adapted.to(env.device), plan


def perturb_adapter(model, seed: int = 0, scale: float = 0.05) -> None:
    """Move the adapter away from its identity start, so merging has something to fold in."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_((torch.randn(p.shape, generator=g) * scale).to(p.device, p.dtype))


class FrozenBase(torch.nn.Module):
    """The "no adapter" variant: every weight frozen, one trainable scalar gain.

    A step with nothing trainable would skip backward altogether and measure
    only a forward pass. Instead a single scalar gain multiplies the hidden
    states entering the first vision block an adapter would touch, so
    backward propagates activation gradients through exactly the layers
    an adapter's backward traverses (that block onward, and the whole text
    model), but computes no weight gradient; the optimizer steps one scalar.
    This is the floor every adapter method stands on.
    """

    def __init__(self, model, first_block: int):
        super().__init__()
        self.model = model
        for p in model.parameters():
            p.requires_grad_(False)
        self.gain = torch.nn.Parameter(torch.ones(()))
        block = model.model.visual.blocks[first_block]
        block.register_forward_pre_hook(self._scale, with_kwargs=True)

    def _scale(self, module, args, kwargs):
        if args:
            return (args[0] * self.gain.to(args[0].dtype), *args[1:]), kwargs
        kwargs = dict(kwargs, hidden_states=kwargs["hidden_states"] * self.gain.to(kwargs["hidden_states"].dtype))
        return args, kwargs

    def forward(self, **inputs):
        return self.model(**inputs)


def frozen_model(env: BenchEnv, size: ModelSize):
    model = load_base(env, size)
    targets = targets_for(env, size, model)
    first = min(int(t.split("visual.blocks.")[1].split(".")[0]) for t in targets if "visual.blocks." in t)
    return FrozenBase(model, first).to(env.device)


# -- data -------------------------------------------------------------------------------------------

FOLLOW_UPS = [
    ("Where on the product is the defect?", "It is near the middle of the product."),
    ("Is the defect large enough to reject the product?", "Yes, it should be rejected at inspection."),
    ("Describe the surface of the product around the defect.", "The surface is smooth apart from the defect."),
    ("What shape is the product?", "It is a rounded box seen from above."),
]
CONTEXT = ("You are inspecting products on a production line. Look at the whole product, left and right, top "
           "and bottom, and name the colour of the product and the kind of damage you see, if any. ")


def write_mixed_dataset(demo_train: Path) -> Path:
    """Mixed lengths, as real instruction data has: the demo records, half of them made longer.

    Of every four records two stay single-turn with a short question, one gets
    a long question (an inspection brief repeated one to three times before
    it), one becomes a multi-turn conversation (two to four more question and
    answer rounds). Same images; written beside the demo set.
    """
    import json
    import random

    rng = random.Random(11)
    out = Path(demo_train).parent / "mixed.jsonl"
    lines = []
    for i, line in enumerate(Path(demo_train).read_text().splitlines()):
        rec = json.loads(line)
        convo = rec["conversations"]
        if i % 4 == 2:
            convo[0]["value"] = "<image>\n" + CONTEXT * rng.randint(1, 3) + convo[0]["value"].split("\n", 1)[1]
        elif i % 4 == 3:
            for q, a in rng.sample(FOLLOW_UPS, rng.randint(2, 4)):
                convo += [{"from": "user", "value": q}, {"from": "assistant", "value": a}]
        lines.append(json.dumps(rec))
    out.write_text("\n".join(lines) + "\n")
    return out


# -- training pieces -------------------------------------------------------------------------------

def optimizer_for(model, lr: float = 1e-4):
    from vlft.training.step import cosine_with_warmup

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    return optimizer, cosine_with_warmup(optimizer, 0, 1_000_000)


def step_policy(env: BenchEnv, scaler=None, as_on_a_device: bool = False):
    """The step policy a run on ``env`` resolves; ``as_on_a_device``: the accelerator's (the non-finite flag
    stays on the device), for counting the syncs a step would make there."""
    from vlft.training.step import StepPolicy

    if scaler is None and env.precision.loss_scaling:
        scaler = env.precision.make_scaler()
    return StepPolicy(env.device, env.autocast_dtype, scaler, max_grad_norm=1.0, grad_accum=1, world_size=1,
                      flags_on_host=env.device.type == "cpu" and not as_on_a_device)


@dataclass
class Trainer:
    """A model, its optimizer and scheduler, and one ``vlft.train.train_step`` on a batch."""

    model: Any
    optimizer: Any
    scheduler: Any
    policy: Any

    def step(self, host_batch: dict, device_batch: dict) -> dict:
        from vlft.data.batching import label_count

        # as in vlft.train.run_training: labels counted on the host, before the batch moved
        return self.step_counted(label_count(host_batch), device_batch)

    def step_counted(self, local_tokens: int, device_batch: dict) -> dict:
        from vlft.training.step import train_step

        return train_step(self.model, self.optimizer, self.scheduler, [device_batch], self.policy, local_tokens)

    def host_state(self) -> list:
        """Optimizer state that stays on the host on every backend (AdamW's step counters)."""
        return [s["step"] for s in self.optimizer.state.values()
                if isinstance(s.get("step"), torch.Tensor) and s["step"].device.type == "cpu"]


def trainer(env: BenchEnv, model, as_on_a_device: bool = False) -> Trainer:
    model.train()
    optimizer, scheduler = optimizer_for(model)
    return Trainer(model, optimizer, scheduler, step_policy(env, as_on_a_device=as_on_a_device))


def encode_batches(size: ModelSize, records, batch_size: int = BATCH_SIZE, **collate_kw) -> list[dict]:
    collate = size.collator(**collate_kw)
    return [collate([size.encoder.encode(r) for r in records[i:i + batch_size]])
            for i in range(0, len(records) - batch_size + 1, batch_size)]


def to_device(env: BenchEnv, batch: dict) -> dict:
    from vlft.data.batching import to_device as move

    return move(batch, env.device)


# -- timing ---------------------------------------------------------------------------------------

class Interleaved:
    """Times several variants side by side: one round runs each once, in an order rotated every time.

    ``repeats`` sub-rounds per benchmarked round give more paired samples to
    groups whose variants differ by a few percent (only when benchmarking).
    """

    def __init__(self, env: BenchEnv, variants: dict[str, Callable[[], Any]], repeats: int = 1):
        self.env = env
        self.variants = variants
        self.repeats = repeats
        self.times: dict[str, list[float]] = {name: [] for name in variants}
        self.turn = 0

    def _once(self) -> None:
        names = list(self.variants)
        k = self.turn % len(names)
        for name in names[k:] + names[:k]:
            self.env.synchronize()
            t0 = time.perf_counter()
            self.variants[name]()
            self.env.synchronize()
            self.times[name].append(time.perf_counter() - t0)
        self.turn += 1

    def run(self, benchmark, rounds: int | None = None) -> None:
        """Warm up (when benchmarking), then let pytest-benchmark run the rounds (exactly ``rounds`` if given:
        for groups whose figures are not times and whose steps are slow)."""
        repeats = 1 if benchmark.disabled else self.repeats
        if not benchmark.disabled:
            self._once()
            self.times = {name: [] for name in self.variants}

        def one_round():
            for _ in range(repeats):
                self._once()

        if rounds is None or benchmark.disabled:
            benchmark(one_round)
        else:
            benchmark.pedantic(one_round, rounds=rounds, iterations=1)

    def median(self, name: str) -> float:
        return statistics.median(self.times[name])

    def ratio(self, num: str, den: str, per_item: dict[str, float] | None = None) -> float:
        """Median over sub-rounds of the paired time ratio num/den (or of throughputs when ``per_item``).

        Pairing each sample with its partner from the same sub-round cancels
        load that drifts over the run; the ratio of the medians is kept in
        ``summary()`` for comparison.
        """
        pairs = [a / b for a, b in zip(self.times[num], self.times[den])]
        if per_item:
            pairs = [(per_item[num] / a) / (per_item[den] / b) for a, b in zip(self.times[num], self.times[den])]
        return statistics.median(pairs)

    def ratio_figure(self, num: str, den: str, target: str | None = None, per_item: dict | None = None) -> dict:
        """A figure from ``ratio`` (paired), with the ratio of the medians alongside."""
        if per_item:
            of_medians = (per_item[num] / self.median(num)) / (per_item[den] / self.median(den))
        else:
            of_medians = self.median(num) / self.median(den)
        out = figure(self.ratio(num, den, per_item), target)
        out["ratio_of_medians"] = of_medians
        return out

    def summary(self, per_call_items: dict[str, float] | None = None) -> dict:
        """Per variant: median, min and max seconds per call and the samples; items/s where given."""
        out = {}
        for name, ts in self.times.items():
            med = statistics.median(ts)
            entry = {"median_s": med, "min_s": min(ts), "max_s": max(ts), "samples": len(ts)}
            if per_call_items and name in per_call_items:
                entry["items"] = per_call_items[name]
                entry["items_per_s"] = per_call_items[name] / med
            out[name] = entry
        return out


def figure(value: float | None, target: str | None = None, unit: str = "x", note: str = "") -> dict:
    """One reported figure; ``target`` like "<= 1.25", ">= 2", "0.95..1.05" (checked, never asserted)."""
    met = None
    if value is not None and target:
        t = target.replace(" ", "")
        if t.startswith("<="):
            met = value <= float(t[2:])
        elif t.startswith(">="):
            met = value >= float(t[2:])
        elif ".." in t:
            lo, hi = (float(x) for x in t.split(".."))
            met = lo <= value <= hi
        elif t.startswith("=="):
            met = value == float(t[2:])
    out = {"value": value, "target": target, "met": met, "unit": unit}
    if note:
        out["note"] = note
    return out


def record(benchmark, env: BenchEnv, size: ModelSize | None, group: str, figures: dict, variants: dict,
           memory: dict | None = None, notes: list[str] | None = None, **extra) -> None:
    benchmark.extra_info.update({
        "group": group, "model": size.name if size else None, **env.describe(),
        "figures": figures, "variants": variants, "memory": memory or {}, "notes": notes or [],
        "benchmark_disabled": bool(benchmark.disabled), **extra,
    })


# -- memory -----------------------------------------------------------------------------------------

from vlft.measure import SavedTensorMeter  # noqa: E402 - one meter for the plan's tests and the bench


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    return total


def step_memory(env: BenchEnv, tr: Trainer, host_batch: dict, device_batch: dict) -> dict:
    """Peak memory of one training step, the way this backend can measure it honestly.

    Accelerators: the backend's memory reader after resetting the device's
    peak counter: ``peak_bytes`` is the allocator's true peak during the
    step (weights included), ``step_bytes`` the part above what was resident
    before it. CPU has no allocator statistics (``ru_maxrss`` only grows, so
    it cannot tell variants apart in one process); there ``peak_bytes`` is
    counted: weights and buffers + every tensor autograd saves for backward
    (caught with ``saved_tensors_hooks``, each storage once) + gradients +
    optimizer state. That is deterministic and counts what differs between
    methods; it leaves out short-lived temporaries inside single operations.
    """
    module = env.device_module()
    if module is not None and hasattr(module, "reset_peak_memory_stats") and hasattr(module, "memory_allocated"):
        env.synchronize()
        tr.optimizer.zero_grad(set_to_none=True)
        before = int(module.memory_allocated(env.device))
        module.reset_peak_memory_stats(env.device)
        tr.step(host_batch, device_batch)
        env.synchronize()
        peak = env.memory_reader().peak_bytes
        return {"measure": f"{env.device.type} allocator peak (backend memory reader)", "peak_bytes": peak,
                "step_bytes": peak - before if peak is not None else None, "resident_bytes": before}
    meter = SavedTensorMeter(tr.model)
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        tr.step(host_batch, device_batch)
    weights = _tensor_bytes(list(tr.model.parameters()) + list(tr.model.buffers()))
    trainable = [p for g in tr.optimizer.param_groups for p in g["params"]]
    grads = sum(p.numel() * p.element_size() for p in trainable)  # set to None after the step; were this size
    state = _tensor_bytes(v for s in tr.optimizer.state.values() for v in s.values())
    peak = weights + meter.bytes + grads + state
    return {"measure": "counted: weights + autograd-saved tensors + grads + optimizer state",
            "peak_bytes": peak, "activation_bytes": meter.bytes, "weight_bytes": weights,
            "grad_bytes": grads, "optimizer_bytes": state}


# -- host-device synchronisations (hook calls: vlft.measure.HookCallCounter) -------------------

def _sync_ops():
    aten = torch.ops.aten
    scalar = {aten._local_scalar_dense.default, aten.equal.default}
    # ops whose output shape depends on the data: the host waits for the device to know it
    shaped = set()
    for name, overloads in (("nonzero", ("default",)), ("masked_select", ("default",)),
                            ("_unique2", ("default",)), ("unique_consecutive", ("default",)),
                            ("unique_dim", ("default",)), ("repeat_interleave", ("Tensor",))):
        op = getattr(aten, name, None)
        for ov in overloads:
            if op is not None and hasattr(op, ov):
                shaped.add(getattr(op, ov))
    copies = {aten._to_copy.default, aten.copy_.default}
    return scalar, shaped, copies


_HERE = str(Path(__file__).resolve())
# frames of the dispatch machinery itself, never the site of a synchronisation
_MACHINERY = ("torch/utils/_python_dispatch", "torch/_ops", "torch/_dynamo/", "torch/_compile", "torch/overrides")
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)


def _site(frame) -> tuple[str, str]:
    """(innermost frame outside the dispatch machinery, innermost frame outside torch) as 'file:line func'."""
    site = caller = None
    f = frame
    while f is not None:
        fn = f.f_code.co_filename
        if fn != _HERE and not any(m in fn for m in _MACHINERY):
            where = _short(fn) + f":{f.f_lineno} {f.f_code.co_name}"
            if site is None:
                site = where
            if not fn.startswith(_TORCH_DIR):
                caller = where
                break
        f = f.f_back
    return site or "?", caller or "?"


def _short(filename: str) -> str:
    for marker in ("site-packages/", "/vlft/", "/plugins/", "/bench/"):
        if marker in filename:
            tail = filename.split(marker, 1)[1]
            return tail if marker == "site-packages/" else marker.strip("/") + "/" + tail
    return filename


def _owner(where: str) -> str:
    path = where.split(":", 1)[0]
    for owner in ("vlft", "transformers", "peft", "bench", "plugins"):
        if path.startswith(owner + "/"):
            return owner
    if path.startswith("torch/optim"):
        return "torch.optim"
    if path.startswith("torch/"):
        return "torch"
    return "other"


def _owner_of(site: str, caller: str) -> str:
    """Who asked: the site's package, or for plain torch helpers the code that called them."""
    owner = _owner(site)
    return _owner(caller) if owner == "torch" else owner


def sync_counter(device: torch.device, host_tensors=()):
    """A TorchDispatchMode counting the operations that make the host wait for the device.

    Counted: scalar reads (``aten::_local_scalar_dense`` behind ``.item()``,
    ``float(t)``, ``bool(t)``; ``aten::equal``), ops whose output shape
    depends on the data (``nonzero``, ``masked_select``, ``unique``,
    ``repeat_interleave`` without ``output_size``), and blocking copies
    from the device to the host. On an accelerator only those touching a
    device tensor count; on CPU nothing truly synchronises, so every such
    operation is counted as the synchronisation it would be on a device
    (including reads of tensors that stay on the host there, such as
    AdamW's step counters; the report attributes each to its caller).
    Works on every device, since it sits in torch's dispatcher.
    ``host_tensors`` are tensors known to stay on the host on every backend
    (AdamW's step counters); reads of them are never counted.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    scalar, shaped, copies = _sync_ops()
    on_cpu = device.type == "cpu"

    host_ptrs = {t.untyped_storage().data_ptr() for t in host_tensors if isinstance(t, torch.Tensor)}

    def on_device(t) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type != "cpu"

    def would_be_on_device(t) -> bool:
        if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in host_ptrs:
            return False
        return on_cpu or t.device.type != "cpu"

    class SyncCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.events: list[tuple[str, str, str]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            hit = False
            if func in scalar or func in shaped:
                hit = any(would_be_on_device(a) for a in args)
            elif func in copies:
                is_copy_ = func is torch.ops.aten.copy_.default
                blocking = not kwargs.get("non_blocking", args[2] if is_copy_ and len(args) > 2 else False)
                src = args[1] if is_copy_ else args[0]
                dst = args[0] if is_copy_ else out
                hit = blocking and on_device(src) and isinstance(dst, torch.Tensor) and dst.device.type == "cpu"
            if hit:
                site, caller = _site(sys._getframe(1))
                self.events.append((func.name() if hasattr(func, "name") else str(func), site, caller))
            return out

        def summary(self) -> dict:
            by_op = Counter(e[0] for e in self.events)
            by_owner = Counter(_owner_of(e[1], e[2]) for e in self.events)
            by_site = Counter(f"{e[1]}  <- {e[2]}" if e[1] != e[2] else e[1] for e in self.events)
            return {"total": len(self.events), "vlft_own": by_owner.get("vlft", 0), "by_op": dict(by_op),
                    "by_owner": dict(by_owner), "top_sites": dict(by_site.most_common(12))}

    return SyncCounter()


def large_recipe() -> dict:
    """A third size for the memory plan's calibration: text hidden 1024, vision hidden 512 (about 80 M parameters)."""
    recipe = wide_recipe()
    recipe["text"].update(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4)
    recipe["vision"].update(hidden_size=512, intermediate_size=1376, num_heads=8, out_hidden_size=1024)
    recipe["bench"] = "large"
    return recipe


def measured_step_peak(env: BenchEnv, session, group: list[dict]) -> dict:
    """Peak memory of one real ``train_step_on`` of a prepared session (optimizer state already made).

    Accelerators: the allocator's peak through the backend's memory reader.
    CPU: every tensor storage alive at once, followed through the dispatcher
    (``vlft.activations.LiveTensorMeter``), with the resident weights and optimizer
    state counted from the start; transients inside the step are included.
    """
    from vlft.measure import LiveTensorMeter
    from vlft.training.step import train_step_on

    module = env.device_module()
    if module is not None and hasattr(module, "reset_peak_memory_stats"):
        env.synchronize()
        before = int(module.memory_allocated(env.device))
        module.reset_peak_memory_stats(env.device)
        train_step_on(session.model, session.optimizer, session.scheduler, group, session.policy)
        env.synchronize()
        peak = env.memory_reader().peak_bytes
        return {"measure": f"{env.device.type} allocator peak", "peak_bytes": peak, "step_bytes": peak - before,
                "resident_bytes": before}
    resident = [*session.model.parameters(), *session.model.buffers(),
                *(v for st in session.optimizer.state.values() for v in st.values())]
    with LiveTensorMeter(resident) as meter:
        train_step_on(session.model, session.optimizer, session.scheduler, group, session.policy)
    return {"measure": "live tensor storages, followed through the dispatcher", "peak_bytes": meter.peak,
            "step_bytes": meter.peak - meter.start_bytes, "resident_bytes": meter.start_bytes}
