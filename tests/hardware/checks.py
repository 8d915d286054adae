"""What a run really did on its device, read from the model, the device and torch: the device tests' checks.

Each check takes its expected value from the user's request or from a fact of the hardware, not from
the plan the run resolved, so a plugin that answers a policy wrongly fails it (one exception, by
contract: the frozen base weights are checked against the plan's parameter dtype, the trainable ones
against fp32, whatever the plan says). The same checks run on
the CPU in ``tests/test_device_checks.py``, once with the built-in plugins (they pass) and once with a
wrong answer registered ``tryfirst`` (they must fail): a check that cannot fail is caught there.

Imported as ``hardware.checks`` (``tests/`` is on ``sys.path`` through its conftest).
"""

from __future__ import annotations

import contextlib
import math
import sys

import torch

from vlft.hookspecs import hookimpl

TOWERS = ("vision", "text")
# Relative error of a 1024-deep fp32 matmul of unit normals against float64: about 1e-7 with true
# fp32, about 5e-4 with TF32's 10-bit mantissas; the threshold sits between, a decade from each.
TF32_ERROR_THRESHOLD = 1e-5


def tower_of(module_name: str) -> str:
    return "vision" if "visual" in module_name.split(".") else "text"


class Observer:
    """A plugin that watches a run and answers no policy.

    Its ``vlft_patch_model`` runs last (``trylast``), after every backend's patch, and gets the loaded
    base model. It records what each tower's configuration says right then, and hooks the model to
    record, for every forward in training mode (the training steps, not evaluation), which attention
    implementation each attention module dispatched on, the dtype every linear layer produced, and how
    often ``scaled_dot_product_attention`` was called (while ``counting_sdpa()`` is active).
    """

    def __init__(self):
        self.model = None
        self.loaded_attention: dict[str, str] | None = None
        self.forward_attention: dict[str, set] = {t: set() for t in TOWERS}
        self.linear_dtypes: dict[str, set] = {t: set() for t in TOWERS}
        self.sdpa_calls = 0
        self._training_forward = 0

    @hookimpl(trylast=True)
    def vlft_patch_model(self, backend, model, config, attention):
        self.watch(model)
        return None

    def watch(self, model) -> None:
        from vlft.models.loading import tower_attention

        self.model = model
        self.loaded_attention = tower_attention(model)
        for name, module in model.named_modules():
            tower = tower_of(name)
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(self._linear_hook(tower))
            cfg = getattr(module, "config", None)
            if type(module).__name__.endswith("Attention") and hasattr(cfg, "_attn_implementation"):
                # transformers picks the attention function from this very value at each forward
                module.register_forward_pre_hook(self._attention_hook(tower))
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._leave)

    def _enter(self, module, args):
        if module.training:
            self._training_forward += 1

    def _leave(self, module, args, output):
        if module.training:
            self._training_forward -= 1

    def _linear_hook(self, tower):
        def hook(module, args, output):
            if module.training:
                self.linear_dtypes[tower].add(output.dtype)

        return hook

    def _attention_hook(self, tower):
        def hook(module, args):
            if module.training:
                self.forward_attention[tower].add(module.config._attn_implementation)

        return hook

    @contextlib.contextmanager
    def counting_sdpa(self):
        """Count ``torch.nn.functional.scaled_dot_product_attention`` calls made in training forwards."""
        real = torch.nn.functional.scaled_dot_product_attention

        def counted(*args, **kwargs):
            if self._training_forward:
                self.sdpa_calls += 1
            return real(*args, **kwargs)

        torch.nn.functional.scaled_dot_product_attention = counted
        try:
            yield self
        finally:
            torch.nn.functional.scaled_dot_product_attention = real


# -- checks ------------------------------------------------------------------------------------------


def check_autocast(observer: Observer, expected: torch.dtype) -> None:
    """Every linear layer of both towers computed in ``expected`` during the training steps."""
    for tower in TOWERS:
        seen = observer.linear_dtypes[tower]
        assert seen, f"no {tower} linear layer ran in a training step: nothing was observed"
        assert seen == {expected}, (
            f"{tower} linear layers computed in {sorted(map(str, seen))} in the training steps; expected {expected}"
        )


def check_attention(observer: Observer, expected: dict[str, str]) -> None:
    """Each tower was loaded with, and dispatched every training forward on, the expected implementation."""
    assert observer.loaded_attention == expected, f"towers loaded with {observer.loaded_attention}; expected {expected}"
    for tower in TOWERS:
        seen = observer.forward_attention[tower]
        assert seen == {expected[tower]}, (
            f"{tower} attention modules ran {sorted(seen) or 'nothing'} in the training steps; "
            f"expected {expected[tower]}"
        )
    if "sdpa" not in expected.values():
        assert observer.sdpa_calls == 0, (
            f"scaled_dot_product_attention ran {observer.sdpa_calls} times in the "
            f"training steps, though neither tower should use it ({expected})"
        )


def check_parameters(model, device_type: str, frozen_dtype: torch.dtype) -> None:
    """Every parameter on the device; frozen base weights in ``frozen_dtype``; every trainable one fp32."""
    params = list(model.named_parameters())
    trainable = [(n, p) for n, p in params if p.requires_grad]
    assert trainable, "no trainable parameter: no adapter was applied"
    elsewhere = sorted({f"{p.device}" for _, p in params if p.device.type != device_type})
    assert not elsewhere, f"parameters left on {elsewhere}, not on {device_type}"
    bad = [(n, p.dtype) for n, p in trainable if p.dtype != torch.float32]
    assert not bad, f"{len(bad)} trainable parameters are not float32, e.g. {bad[:3]}"
    bad = [(n, p.dtype) for n, p in params if not p.requires_grad and p.dtype != frozen_dtype]
    assert not bad, f"{len(bad)} frozen parameters are not {frozen_dtype}, e.g. {bad[:3]}"


def tf32_switches() -> dict:
    return {
        "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def check_tf32(expected_on: bool) -> None:
    """The process-wide TF32 switches (matmul, cuDNN, matmul precision) all say ``expected_on``."""
    s = tf32_switches()
    want = {
        "cuda.matmul.allow_tf32": expected_on,
        "cudnn.allow_tf32": expected_on,
        "float32_matmul_precision": "high" if expected_on else "highest",
    }
    assert s == want, f"TF32 switches are {s}; expected {want}"


def fp32_matmul_error(device, emulate_tf32: bool = False) -> float:
    """Relative error of one fp32 matmul on ``device`` against float64 on the host.

    ``emulate_tf32`` rounds the inputs to TF32's 10-bit mantissa first: what a TF32 device does, for
    showing on a CPU that the threshold tells the two apart.
    """
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 1024, generator=g), torch.randn(1024, 256, generator=g)
    ref = a.double() @ b.double()
    if emulate_tf32:  # keep 10 of fp32's 23 mantissa bits
        a, b = (t.view(torch.int32).bitwise_and(~0x1FFF).view(torch.float32) for t in (a, b))
    got = (a.to(device) @ b.to(device)).cpu().double()
    return float((got - ref).norm() / ref.norm())


def check_tf32_in_effect(device, expected_on: bool) -> None:
    """A matmul on ``device`` loses TF32's precision exactly when TF32 is meant to be on."""
    err = fp32_matmul_error(device)
    if expected_on:
        assert err > TF32_ERROR_THRESHOLD, f"fp32 matmul error {err:.1e}: TF32 is not in effect"
    else:
        assert err < TF32_ERROR_THRESHOLD, f"fp32 matmul error {err:.1e}: TF32 (or worse) is in effect"


def check_overflowing_step_is_skipped(session, tries: int = 5) -> None:
    """vlft's own ``train_step``: a step whose gradients overflow changes no weight and lowers the loss
    scale; a finite step after it trains."""

    scaler = session.policy.scaler
    assert scaler is not None, "fp16 without a loss scaler: an overflowing step would write inf into the weights"
    params = [p for p in session.model.parameters() if p.requires_grad]
    groups = session.batches()
    session.model.train()

    def snapshot():
        return [p.detach().clone() for p in params]

    before, scale = snapshot(), float(scaler.get_scale())
    # an overflow as fp16 produces it: one gradient turns infinite in the backward pass
    handle = params[0].register_hook(lambda g: torch.full_like(g, math.inf))
    try:
        session.train_step(next(groups))
    finally:
        handle.remove()
    moved = [i for i, (b, p) in enumerate(zip(before, params)) if not torch.equal(b, p.detach())]
    assert not moved, f"the overflowing step changed {len(moved)} trainable tensors"
    assert float(scaler.get_scale()) < scale, f"loss scale {scaler.get_scale()} did not back off from {scale}"
    for _ in range(tries):  # fp16 may overflow on its own at a high scale; the scaler backs off each time
        before = snapshot()
        session.train_step(next(groups))
        if any(not torch.equal(b, p.detach()) for b, p in zip(before, params)):
            break
    else:
        raise AssertionError(f"no finite step went through in {tries} tries (scale {scaler.get_scale()})")
    assert all(bool(torch.isfinite(p).all()) for p in params), "a trainable weight is not finite"


def check_non_finite_step_is_undone_on_the_device(session) -> None:
    """vlft's own ``train_step`` without a loss scaler (bf16, the default on GPUs from Ampere on): a step
    whose gradients are NaN is taken and undone on the device (``guarded_step``, no host sync): every
    trainable weight and the AdamW state come back bit for bit, the step counters (host tensors) once
    ``settle_step_counters`` has run as the loop runs it; the step reports itself skipped, and a finite
    step after it trains."""
    from vlft.training.step import settle_step_counters, train_step_on

    policy, optimizer = session.policy, session.optimizer
    assert policy.scaler is None, f"a loss scaler ({type(policy.scaler).__name__}): not the default path"
    assert not policy.flags_on_host, "the step reads its flag on the host: the device path is not taken"
    params = [p for p in session.model.parameters() if p.requires_grad]
    groups = session.batches()
    session.model.train()

    def snapshot():
        return (
            [p.detach().clone() for p in params],
            [{k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()} for p in params],
        )

    def step(poison: bool):
        handle = params[0].register_hook(lambda g: torch.full_like(g, math.nan)) if poison else None
        try:
            out = train_step_on(session.model, optimizer, session.scheduler, next(groups), policy)
        finally:
            if handle is not None:
                handle.remove()
        return out

    assert not bool(step(False).skipped), "a finite first step was skipped"  # the AdamW state exists now
    before, state_before = snapshot()
    out = step(True)
    assert bool(out.skipped), "a step with NaN gradients was not reported skipped"
    settle_step_counters(optimizer, 1, policy.device)
    after, state_after = snapshot()
    moved = [i for i, (b, a) in enumerate(zip(before, after)) if not torch.equal(b, a)]
    assert not moved, f"the NaN step changed {len(moved)} of {len(params)} trainable tensors"
    for i, (old, new) in enumerate(zip(state_before, state_after)):
        assert old.keys() == new.keys(), (i, sorted(old), sorted(new))
        changed = [k for k in old if not (torch.equal(old[k], new[k]) if torch.is_tensor(old[k]) else old[k] == new[k])]
        assert not changed, f"the NaN step changed the optimizer state {changed} of trainable tensor {i}"
    assert not bool(step(False).skipped), "the finite step after it was skipped"
    assert any(not torch.equal(b, p.detach()) for b, p in zip(after, params)), "the finite step after it did not train"
    assert all(bool(torch.isfinite(p).all()) for p in params), "a trainable weight is not finite"


def check_memory_reader(reader, device, nbytes: int = 64 << 20) -> torch.Tensor:
    """The reader sees ``nbytes`` allocated on ``device``: peak at least that, current up by that.

    Returns the block, so a caller can hold it while reading another device.
    """
    before = reader()
    block = torch.ones(nbytes, dtype=torch.uint8, device=device)  # written, so a host counts its pages too
    after = reader()
    assert after.peak_bytes is not None and after.peak_bytes >= nbytes, (
        f"peak {after.peak_bytes} bytes after allocating {nbytes} on {device}"
    )
    if before.current_bytes is not None:
        assert after.current_bytes - before.current_bytes >= nbytes, (
            f"current bytes went from {before.current_bytes} to {after.current_bytes} after allocating {nbytes} "
            f"on {device}: the reader does not read that device"
        )
        assert after.peak_bytes >= after.current_bytes
    return block


def check_memory_readers_per_device(registry, backend: str, device_type: str, count: int) -> None:
    """The backend's reader for device 0 sees a block there; with two devices, a block on device 1 is
    seen by device 1's reader only (a local-rank mix-up would show up here)."""
    readers = [
        registry.first("vlft_memory_reader", backend=backend, device=torch.device(device_type, i))
        for i in range(min(count, 2))
    ]
    block = check_memory_reader(readers[0], torch.device(device_type, 0))
    if len(readers) == 2:
        before = readers[0]().current_bytes
        block1 = check_memory_reader(readers[1], torch.device(device_type, 1))
        assert readers[0]().current_bytes == before, f"{device_type}:0's reader counted a block on {device_type}:1"
        del block1
    del block


# -- running ------------------------------------------------------------------------------------------


def observed_run(tmp_path, train, val, plugins=(), **values):
    """``vlft run`` (``execute``) with an ``Observer`` next to the installed plugins and ``plugins``.

    Returns (RunResult, Observer).
    """
    from vlft.commands.run import execute
    from vlft.config import build_config
    from vlft.registry import load_registry

    observer = Observer()
    config = build_config(
        {},
        {
            "steps": 2,
            "batch_size": 4,
            "eval_samples": 1,
            "max_new_tokens": 2,
            "eval_every": 0,
            "save_every": 0,
            "log_every": 1,
            "data": str(train),
            "val_data": str(val),
            "output": str(tmp_path / "run"),
            **values,
        },
    )
    with observer.counting_sdpa():
        result = execute(load_registry(plugins=(*plugins, observer)), config, progress=False)
    return result, observer


def prepared(train, tmp_path, plugins=(), **values):
    """A trainer set up by ``build_trainer`` (no step taken), for checks that drive the step themselves."""
    from vlft.config import build_config
    from vlft.registry import load_registry
    from vlft.training.trainer import build_trainer

    config = build_config(
        {},
        {
            "steps": 8,
            "batch_size": 4,
            "eval_every": 0,
            "save_every": 0,
            "data": str(train),
            "output": str(tmp_path / "session"),
            "warmup_ratio": 0.0,
            **values,
        },
    )
    return build_trainer(load_registry(plugins=plugins), config)


# -- kernel patches --------------------------------------------------------------------------------------------

# packages whose module-level functions a kernel patch may replace for the whole process
PROCESS_WIDE = ("transformers", "torch_npu", "liger_kernel", "flash_attn")
KERNEL_TOLERANCE_FACTOR = 2  # a patch within twice the unpatched model's own error (flash-attention's tests' rule)
_MISSING = object()


def _process_state() -> dict:
    return {
        name: dict(vars(m))
        for name, m in list(sys.modules.items())
        if m is not None and name.split(".")[0] in PROCESS_WIDE
    }


def _restore(state: dict) -> None:
    """Every attribute of those packages' modules back as ``state`` had it, and the modules imported since
    forgotten (their next import is a fresh, unpatched one)."""
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] not in PROCESS_WIDE:
            continue
        if name not in state:
            del sys.modules[name]
            continue
        now, old = vars(module), state[name]
        for key in [k for k in now if k not in old]:
            delattr(module, key)
        for key, value in old.items():
            if now.get(key, _MISSING) is not value:
                setattr(module, key, value)


PIN_FILE = "vlft/models/patching.py"


def _call_key(frame, event, arg):
    if frame.f_code.co_filename.endswith(PIN_FILE):  # vlft's pin around a patched forward is not the patch's code
        return None
    if event == "call":
        code = frame.f_code
        where = f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno}"
        return f"{getattr(code, 'co_qualname', code.co_name)} ({where})"
    if event == "c_call":
        name = getattr(arg, "__qualname__", getattr(arg, "__name__", repr(arg)))
        return f"{getattr(arg, '__module__', None) or ''}.{name}"
    return None


def forward_calls(model, inputs, device, dtype) -> set[str]:
    """The Python functions and builtins one forward of ``model`` calls (this thread's, with ``sys.setprofile``):
    where a patched model calls what the unpatched one never does, the patch's code ran."""
    from vlft.models.loss import autocast_context

    seen: set[str] = set()

    def profile(frame, event, arg):
        key = _call_key(frame, event, arg)
        if key is not None:
            seen.add(key)

    with torch.no_grad(), autocast_context(device, dtype):
        sys.setprofile(profile)
        try:
            model(**inputs)
        finally:
            sys.setprofile(None)
    return seen


def kernel_step(model, batch, device, dtype) -> dict:
    """One training forward and backward as the run computes them (autocast, the token loss over the label
    tokens): the loss, the logits at the real positions and every gradient, in float64 on the host, and the
    seconds it took."""
    import time

    from vlft.data.batching import model_inputs
    from vlft.models.loss import autocast_context, token_loss_sum

    model.zero_grad(set_to_none=True)
    sync = getattr(torch, device.type).synchronize if device.type != "cpu" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with autocast_context(device, dtype):
        logits = model(**model_inputs(batch)).logits
    loss = token_loss_sum(logits, batch["labels"]) / (batch["labels"] != -100).sum()
    loss.backward()
    sync()
    seconds = time.perf_counter() - t0
    real = batch["attention_mask"].bool()
    return {
        "loss": loss.detach().double().cpu(),
        "logits": logits.detach()[real].double().cpu(),
        "seconds": seconds,
        "grads": {n: p.grad.detach().double().cpu() for n, p in model.named_parameters() if p.grad is not None},
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else float((a - b).norm())


def kernel_errors(patched: dict, unpatched: dict, exact: dict, u: float) -> list[str]:
    """What of ``patched`` is further from ``exact`` than ``KERNEL_TOLERANCE_FACTOR`` times ``unpatched`` is,
    plus one rounding ``u`` of the compute dtype (no kernel is asked to beat that): the logits, then each
    gradient, as relative norm errors. Both models ran the same inputs in the same dtype on the same device, so
    the unpatched model's error is that dtype's rounding on this model, measured side by side."""
    failures = []
    pairs = [("logits", patched["logits"], unpatched["logits"], exact["logits"])]
    if set(patched["grads"]) != set(exact["grads"]):
        failures.append(f"gradients of other parameters: {sorted(set(patched['grads']) ^ set(exact['grads']))[:4]}")
    pairs += [
        (f"grad {n}", patched["grads"][n], unpatched["grads"][n], g)
        for n, g in exact["grads"].items()
        if n in patched["grads"]
    ]
    for what, got, ref, want in pairs:
        err, ref_err = _rel(got, want), _rel(ref, want)
        tol = KERNEL_TOLERANCE_FACTOR * ref_err + u
        if not err <= tol:
            failures.append(
                f"{what}: relative error {err:.2e} > {KERNEL_TOLERANCE_FACTOR} x {ref_err:.2e} (unpatched) + {u:.1e}"
            )
    return failures


def _exact_step(model, batch) -> dict:
    """``model``'s weights in float64 on the host, eager attention: the step without rounding to speak of."""
    import copy

    from vlft.models.loading import tower_attention

    exact = copy.deepcopy(model).to("cpu", torch.float64)
    for tower_config in (exact.config.vision_config, exact.config.text_config):
        tower_config._attn_implementation = "eager"
    exact.config._attn_implementation = "eager"
    assert set(tower_attention(exact).values()) == {"eager"}
    host = {k: (v.to("cpu", torch.float64) if v.is_floating_point() else v.cpu()) for k, v in batch.items()}
    return kernel_step(exact.train(), host, torch.device("cpu"), None)


def compare_each_patch(
    backend: str, registry=None, **config_values
) -> tuple[list[str], dict[str, list[str]], list[str]]:
    """Every kernel patch ``backend`` offers whose condition holds here (opt-in ones too), taken as a run takes
    it (``--kernels NAME``: the plan lists it, ``setup.base_model`` applies it) and set against the run without it
    (``--kernels none``) on the embedded model and one batch of the demo data: (report lines, {patch:
    failures}, the patches compared). A patch fails when

    - it took no effect: its forward called no function the unpatched one does not call, and no parameter
      changed dtype (a patch asking for the attention the backend already uses is one);
    - a tower it sets attention for did not load or dispatch on that implementation;
    - its logits or a gradient left the tolerance of ``kernel_errors`` against a float64 host copy.

    Process-wide patches (module-level functions replaced) are undone after each patch, before the next.
    """
    import dataclasses
    import tempfile

    from vlft.config import RunConfig
    from vlft.data.batching import collator_for, model_inputs, to_device
    from vlft.data.demo import write_demo_dataset
    from vlft.data.encoding import SampleEncoder
    from vlft.data.records import read_records
    from vlft.models.embedded import embedded_model_dir
    from vlft.models.loading import load_processor, model_config_and_family, tower_attention
    from vlft.planning.plan import resolve_policies
    from vlft.registry import load_registry
    from vlft.training.setup import base_model

    registry = registry or load_registry()
    model_dir = str(embedded_model_dir(registry))
    base = RunConfig(backend=backend, **config_values)
    device = registry.first("vlft_setup_device", backend=backend, config=base).device
    model_config, family = model_config_and_family(model_dir, registry)

    def plan_for(kernels: str):
        config = dataclasses.replace(base, kernels=kernels)
        return resolve_policies(registry, config, model_dir, model_config, family=family), config

    unpatched_plan, none_config = plan_for("none")
    offered = [
        k
        for ks in registry.hook.vlft_kernel_patches(
            backend=backend, config=base, model_config=model_config, family=family
        )
        if ks
        for k in ks
    ]
    lines = [f"{backend}: offered {[k.name for k in offered]}"]
    lines += [f"  declined {k.name}: {k.reason}" for k in offered if not k.available]
    usable = [k for k in offered if k.available]
    if not usable:
        return lines, {}, []
    processor = load_processor(model_dir, family, registry)
    encoder = SampleEncoder(processor, family=family)
    ds = write_demo_dataset(tempfile.mkdtemp(prefix="kernels-"), 8, 2)
    batch = collator_for(processor, family)([encoder.encode(r) for r in read_records(ds.train)[:2]])
    dtype_name = unpatched_plan.precision.autocast_dtype
    dtype = getattr(torch, dtype_name) if dtype_name else None
    ref, _ = base_model(registry, unpatched_plan)
    ref = ref.to(device).train()
    compute = dtype or next(ref.parameters()).dtype
    u = torch.finfo(compute).eps / 2  # unit roundoff of the dtype the step computes in
    exact = _exact_step(ref, batch)
    Observer().watch(ref)  # the same hooks as the patched model's, so their calls are no difference
    on_device = to_device(batch, device)
    warm_up = device.type != "cpu"  # the first step on a device pays for the allocator and kernel selection
    if warm_up:
        kernel_step(ref, on_device, device, dtype)
    unpatched = kernel_step(ref, on_device, device, dtype)
    ref_calls = forward_calls(ref, model_inputs(on_device), device, dtype)
    ref_dtypes = {n: p.dtype for n, p in ref.named_parameters()}
    ref_attention = tower_attention(ref)
    del ref
    clean = _process_state()  # after the unpatched path imported all it needs: what is new is a patch's
    lines.append(
        f"  unpatched: loss {float(unpatched['loss']):.6f} (float64 host: {float(exact['loss']):.6f}), logits "
        f"error {_rel(unpatched['logits'], exact['logits']):.2e}, step {unpatched['seconds'] * 1e3:.1f} ms"
    )

    failures: dict[str, list[str]] = {}
    for k in usable:
        plan, config = plan_for(k.name)
        problems = failures.setdefault(k.name, [])
        if k.name not in [c.name for c in plan.kernels.chosen]:
            problems.append(f"--kernels {k.name}: the plan does not list it as chosen")
            continue
        try:
            model, _ = base_model(registry, plan)
            model = model.to(device).train()
            observer = Observer()
            observer.watch(model)
            if warm_up:
                kernel_step(model, on_device, device, dtype)
            patched = kernel_step(model, on_device, device, dtype)
            new_calls = sorted(forward_calls(model, model_inputs(on_device), device, dtype) - ref_calls)
            retyped = sorted(n for n, p in model.named_parameters() if ref_dtypes.get(n) != p.dtype)
            attention = tower_attention(model)
            del model
        finally:
            _restore(clean)
        if not new_calls and not retyped:
            problems.append(
                "took no effect: its forward called nothing the unpatched one does not, and no parameter changed dtype"
            )
        for tower, impl in k.attention.items():
            if attention[tower] != impl or observer.forward_attention[tower] != {impl}:
                ran = sorted(observer.forward_attention[tower])
                problems.append(f"{tower} tower loaded {attention[tower]} and ran {ran}, not {impl}")
            elif ref_attention[tower] == impl:
                problems.append(f"{tower} tower: the backend already uses {impl} without the patch")
        problems += kernel_errors(patched, unpatched, exact, u)
        lines.append(
            f"  {k.name}: loss {float(patched['loss']):.6f}, logits error "
            f"{_rel(patched['logits'], exact['logits']):.2e}; step {patched['seconds'] * 1e3:.1f} ms vs "
            f"{unpatched['seconds'] * 1e3:.1f} ms unpatched; new in its forward: {new_calls[:6]}"
            + (f" (+{len(new_calls) - 6})" if len(new_calls) > 6 else "")
            + (f"; parameters retyped: {len(retyped)}" if retyped else "")
        )
    return lines, {k: v for k, v in failures.items() if v}, [k.name for k in usable]
