"""A backend plugin: the CPU with bf16 base weights (``vlft run --backend cpu-bf16``).

vlft's own ``cpu`` backend is the fp32 reference. This one stores the frozen
base weights in bf16 (half the memory) and runs the forward pass under bf16
autocast; vlft keeps the adapter weights in fp32 whatever the backend says.
On a CPU with native bf16 (AVX512-BF16, AMX, Arm BF16) it is also faster;
elsewhere bf16 is emulated and slower, which the probe and ``vlft doctor``
say, and ``vlft bf16-speed`` measures.

Every backend hook below answers only for ``NAME`` and returns None for any
other backend: the plugin manager asks every plugin, and the first non-None
answer wins. ``@cpu_bf16_hookimpl`` (``hookimpl_for(NAME)``) writes that guard
once; hooks without a ``backend`` argument keep ``@hookimpl``.

Imports inside functions: nothing heavy at module level (``vlft plugins`` loads this module just to
list it): torch inside the hooks; ``resource`` (Unix only) where memory is read; click and time where
the command runs.
"""

from __future__ import annotations

import sys

from vlft import (
    AttentionPolicy,
    BackendInfo,
    ConfigError,
    DataLoaderOptions,
    DeviceCapacity,
    DeviceSetup,
    DistributedOptions,
    DoctorCheck,
    MemoryStats,
    PrecisionPolicy,
    ProbeResult,
    hookimpl,
    hookimpl_for,
    parse_attn,
)

NAME = "cpu-bf16"
# marks a backend hook that runs only when asked about NAME (None for any other backend)
cpu_bf16_hookimpl = hookimpl_for(NAME)
# /proc/cpuinfo flags of CPUs that compute bf16 natively: x86 AVX512-BF16 and AMX; "bf16" on Arm
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def native_bf16() -> bool | None:
    """Whether this CPU computes bf16 natively; None where the OS does not say (not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):  # x86, Arm
                    return any(flag in line.split(":", 1)[1].split() for flag in NATIVE_BF16_FLAGS)
    except OSError:
        pass
    return None


@hookimpl
def vlft_backends():
    # priority below the cpu reference (0): `--backend auto` never picks this one by surprise
    return [
        BackendInfo(
            NAME,
            "CPU with bf16 base weights and bf16 autocast (half the weight memory of cpu)",
            device_type="cpu",
            priority=-1,
        )
    ]


@cpu_bf16_hookimpl
def vlft_probe_backend(backend):
    import torch

    warnings = []
    if native_bf16() is False:
        warnings.append("this CPU has no native bf16: cpu-bf16 saves memory here but runs slower than cpu")
    return ProbeResult(True, device_count=1, versions={"torch": torch.__version__}, warnings=warnings)


@cpu_bf16_hookimpl
def vlft_setup_device(backend, config):
    import torch

    return DeviceSetup(torch.device("cpu"), local_rank=config.local_rank)


@cpu_bf16_hookimpl
def vlft_attention_implementation(backend, config, model_config):
    asked = parse_attn(config.attn) or {}  # the user's --attn, per tower
    # sdpa does not keep the attention matrix for backward the way eager does
    return AttentionPolicy(
        asked.get("vision", "sdpa"),
        asked.get("text", "sdpa"),
        "as asked" if asked else "cpu-bf16: sdpa saves attention memory",
    )


@cpu_bf16_hookimpl
def vlft_precision_policy(backend, config):
    if config.precision not in ("auto", "bf16"):
        # refuse what this backend is not for, and name the one that is
        raise ConfigError(f"backend {NAME} computes in bf16; for --precision {config.precision} use --backend cpu")
    return PrecisionPolicy(
        "bf16",
        param_dtype="bfloat16",
        autocast_dtype="bfloat16",
        reason="bf16 autocast; no loss scaling (bf16 has fp32's range)",
        param_reason=f"{NAME}: bf16 base weights, half the memory of fp32",
    )


@cpu_bf16_hookimpl
def vlft_dataloader_options(backend, config, options: DataLoaderOptions):
    # every plugin is called with the same object: change only what this backend decides, and say why
    options.pin_memory = False
    options.num_workers = 0
    options.reasons.append(f"{NAME}: no pinned memory (nothing to copy); no workers (they share the cores)")


@cpu_bf16_hookimpl
def vlft_distributed_options(backend, config):
    # fsdp=True would let --shard fsdp run here too (gloo has the collectives); this example leaves it
    # off, so the error a user gets for a backend without sharding can be seen
    return DistributedOptions(
        "gloo",
        timeout_s=600,
        reason="gloo is torch's CPU process group",
        fsdp_reason="the example backend has not been tried with FSDP2",
    )


@cpu_bf16_hookimpl
def vlft_seed(backend, seed, deterministic):
    # vlft has seeded Python, NumPy and torch's CPU generator already; the CPU has no other generator
    if deterministic:
        import torch

        torch.use_deterministic_algorithms(True, warn_only=True)


@cpu_bf16_hookimpl
def vlft_device_capacity(backend, config):
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        # the memory plan then asks for --device-memory instead of guessing
        return DeviceCapacity(None, source="MemAvailable unknown on this OS")
    return DeviceCapacity(available, reserved_bytes=512 * 2**20, source="available RAM (/proc/meminfo)")


@cpu_bf16_hookimpl
def vlft_memory_reader(backend, device):
    import resource

    def read() -> MemoryStats:
        # called by reports, never inside a step; ru_maxrss is KiB on Linux, bytes on macOS
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return MemoryStats(peak_bytes=peak if sys.platform == "darwin" else peak * 1024)

    return read


@cpu_bf16_hookimpl
def vlft_doctor_checks(backend):
    native = native_bf16()
    detail = {True: "native (cpuinfo flags)", False: "emulated: slower than fp32", None: "unknown on this OS"}
    # advice, not a blocker: the backend runs either way
    return [
        DoctorCheck(
            "native bf16",
            native is not False,
            detail[native],
            fix="" if native is not False else "use --backend cpu for speed; cpu-bf16 for memory",
            blocking=False,
        )
    ]


@hookimpl
def vlft_register_commands(cli):
    import click

    @cli.command("bf16-speed")
    @click.option("--size", default=1024, show_default=True, help="Matrix size.")
    @click.option("--repeat", default=10, show_default=True, help="Multiplications timed per dtype.")
    def bf16_speed(size, repeat):
        """Time a matrix product in fp32 and bf16 on this CPU: is cpu-bf16 faster here?"""
        import time

        import torch

        timings = {}
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.randn(size, size, dtype=dtype)
            a @ a  # warm-up: the first call pays for kernel selection
            start = time.perf_counter()
            for _ in range(repeat):
                a @ a
            timings[dtype] = (time.perf_counter() - start) / repeat
        ratio = timings[torch.float32] / timings[torch.bfloat16]
        click.echo(
            f"fp32 {timings[torch.float32] * 1e3:.2f} ms, bf16 {timings[torch.bfloat16] * 1e3:.2f} ms "
            f"per {size}x{size} product: bf16 is {ratio:.2f}x the speed of fp32"
        )
