"""C++ kernels built on first use with the machine's compiler (torch's cpp_extension and
ninja): the paged decode attention kernel (engine/attention/csrc) and the small-batch
int4 matmul (engine/quant/csrc). Each is built once per source version and checkout, in
torch's extension directory (~/.cache/torch_extensions/tandem/<name>_<hash>/, the hash of
the source and of its directory: ninja's build file holds the source's absolute path, so
two checkouts sharing one directory rebuilt it for each other, about 20 s a start), and
registers its ops under ``torch.ops.tandem``. An engine loads the kernels it runs at
start-up (engine/model_runner.py); metrics read ``known_reason``, which never builds.

Builders take an flock first (the kernel drops it when a builder dies), so a process
killed mid-build cannot leave torch's own lock file behind to hang every later start.
A kernel that cannot be built (no compiler, no headers, a CPU without the ISA) is
unavailable with its reason, which its caller logs once and reports as a fallback.

$TANDEM_CPU_CAPABILITY (else $ATEN_CPU_CAPABILITY, so one variable caps both ATen's
dispatch and ours) caps the instruction sets Tandem sees and compiles for: ``avx2``
hides AVX-512 and AMX (an Intel host then runs what an AVX2-only AMD EPYC runs: int4
weights on aten's kernel, fp32 by default, the decode kernel built for AVX2),
``default`` hides AVX as well, ``avx512`` hides AMX. The test suite runs once so.
The ceiling caps oneDNN's GEMMs too (``ONEDNN_MAX_CPU_ISA``, unless set: read at
oneDNN's first primitive, after this module is imported): otherwise a capped run's dense
matmuls kept AVX-512 and flattered the AVX2 path.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

BUILD_WAIT_S = 900.0
"""How long a process waits for another one's build before giving up on the kernel."""


class NativeKernel:
    def __init__(self, name: str, source: Path, register_fakes: Callable[[], None],
                 without: str, needs_cpu_flags: tuple[str, ...] = ()) -> None:
        self.name, self.source, self.without = name, source, without
        """without: what runs instead (the log's warning says it)."""
        self.register_fakes = register_fakes
        """Registers the ops' shape functions (torch.compile traces through them)."""
        self.needs_cpu_flags = needs_cpu_flags
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._tried = False

    def unavailable(self) -> str | None:
        """None when the kernel is loaded (building it on the first call), else why not."""
        with self._lock:
            if not self._tried:
                self._reason = self._build()
                self._tried = True
                if self._reason is not None:
                    log.warning("%s kernel unavailable (%s); %s", self.name, self._reason,
                                self.without)
            return self._reason

    def known_reason(self) -> str | None:
        """Why the kernel is not running, as far as known, without building it or waiting
        for a build (metrics ask this): None once loaded, a reason before it was tried."""
        if not self._tried:  # _reason is set before _tried (unavailable)
            return "not loaded: nothing has run it yet"
        return self._reason

    def build_directory(self) -> Path:
        from torch.utils.cpp_extension import get_default_build_root

        where = str(self.source.resolve().parent).encode()  # build.ninja's absolute paths
        digest = hashlib.sha256(self.source.read_bytes() + b"\0" + where).hexdigest()[:12]
        root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
        cap = f"_{cpu_capability()}" if cpu_capability() else ""  # a capped build apart
        return Path(root) / "tandem" / f"tandem_{self.name}_{digest}{cap}"

    def _build(self) -> str | None:
        missing = [f for f in self.needs_cpu_flags if f not in cpu_flags()]
        if missing:
            return f"this CPU lacks {', '.join(missing)}"
        try:
            from torch.utils.cpp_extension import load

            build_dir = self.build_directory()
            build_dir.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()
            with build_lock(build_dir, BUILD_WAIT_S):
                load(name=build_dir.name, sources=[str(self.source)], is_python_module=False,
                     extra_cflags=["-O3", march(), "-fopenmp", *vec_flags()],
                     extra_ldflags=["-fopenmp"], build_directory=str(build_dir))
            if time.monotonic() - t0 > 2:
                log.info("built the %s kernel in %.0f s (once per source version)",
                         self.name, time.monotonic() - t0)
            self.register_fakes()
        except Exception as e:  # no compiler, no headers: the callers' fallbacks still work
            return f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200] if str(e) else ''}"
        return None


@contextlib.contextmanager
def build_lock(build_dir: Path, wait_s: float):
    """Hold the build directory's flock (waiting up to wait_s for a live builder:
    TimeoutError after). Holding it, any torch ``lock`` file there is stale, left by a
    builder that died (torch's FileBaton would wait for it forever), and is removed."""
    with open(build_dir / "tandem-build.lock", "w") as f:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building {build_dir.name} "
                                       f"for over {wait_s:.0f} s") from None
                time.sleep(0.2)
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that was killed", stale)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


CAPABILITY_ENV = "TANDEM_CPU_CAPABILITY"
_HIDDEN = {"default": ("avx", "fma", "f16c", "amx"), "avx2": ("avx512", "amx"), "avx512": ("amx",)}
"""Per capability, the prefixes of the /proc/cpuinfo flags it hides."""
_MARCH = {"default": "-march=x86-64", "avx2": "-march=x86-64-v3", "avx512": "-march=x86-64-v4"}


def cpu_capability() -> str | None:
    """The ISA ceiling asked for ($TANDEM_CPU_CAPABILITY, else ATen's), None for the
    CPU's own. A bad value of ours is a ValueError naming it; ATen's other values
    (zvector, sve, ...) are not x86 ceilings and leave ours alone."""
    ours = os.environ.get(CAPABILITY_ENV)
    if ours:
        if ours.lower() not in _HIDDEN:
            raise ValueError(f"${CAPABILITY_ENV} must be one of {', '.join(_HIDDEN)}; "
                             f"got {ours!r}")
        return ours.lower()
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    return aten if aten in _HIDDEN else None


_ONEDNN_ISA = {"default": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE_BF16"}
"""Per capability, oneDNN's ISA ceiling (its ONEDNN_MAX_CPU_ISA names)."""


def cap_onednn() -> None:
    """Give oneDNN the capability ceiling, where one is asked for and oneDNN's own
    variable is not set (module docstring)."""
    try:
        cap = cpu_capability()
    except ValueError:  # a bad $TANDEM_CPU_CAPABILITY: named where the flags are read
        return
    if cap and "ONEDNN_MAX_CPU_ISA" not in os.environ and "DNNL_MAX_CPU_ISA" not in os.environ:
        os.environ["ONEDNN_MAX_CPU_ISA"] = _ONEDNN_ISA[cap]


def cpu_flags() -> set[str]:
    """The CPU's feature flags, less what the capability ceiling hides."""
    hidden = _HIDDEN.get(cpu_capability() or "", ())
    return {f for f in _cpuinfo_flags() if not f.startswith(hidden)}


def _cpuinfo_flags() -> set[str]:
    """/proc/cpuinfo's flags (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


SIMD_PREFIXES = ("sse", "ssse3", "avx", "fma", "f16c", "amx")


def simd_flags() -> list[str]:
    """The vector-instruction flags among cpu_flags(), sorted: what a start-up line names."""
    return sorted(f for f in cpu_flags() if f.startswith(SIMD_PREFIXES))


def march() -> str:
    """-march for the kernels: the CPU's own, or the ceiling's baseline when capped (so
    the compiler does not vectorise with instructions the ceiling hides)."""
    cap = cpu_capability()
    return _MARCH[cap] if cap else "-march=native"


def vec_flags() -> list[str]:
    """ATen's Vectorized<float> at the widest ISA this CPU has (its exp is then inline)."""
    flags = cpu_flags()
    for isa, need in (("AVX512", ("avx512f", "avx512bw", "avx512vl", "avx512dq")),
                      ("AVX2", ("avx2", "fma"))):
        if all(n in flags for n in need):
            return [f"-DCPU_CAPABILITY={isa}", f"-DCPU_CAPABILITY_{isa}"]
    return []


cap_onednn()
